"""Knowledge distillation: recover a pruned student from its uncompressed teacher on offline text.

Data: a fixed set of unique tokens from the repo's own tasks (their *last* documents, so
probe documents never train) each followed by ``gen_tokens`` tokens the teacher generates
greedily (no download). Training: ``epochs`` passes over that set (or, with ``fresh``, one pass
over ``epochs`` times as many texts, each epoch reading texts no earlier epoch read: the other
arm of the data-reuse comparison, :func:`capsense.compress.study.epochs.fit_reuse_penalty`), loss
``KL(teacher || student)`` of the next-token distributions at every position, Adam on the student's target matrices
(in bfloat16, on float32 masters of them) with their zeros held at zero (pruning masks kept, so the exact size
accounting of the student still holds). Other families (RTN codes, low-rank factors) would leave their grid when
trained, so only pruned students are accepted.

Resumable: after every ``save_every`` steps the student weights, optimizer state and position
go to ``<out>.partial/state.pt``; a rerun with the same arguments continues from there. The
per-capability loss after each epoch is appended to ``<out>.partial/epochs.jsonl``; at the
end the student is written to ``out`` atomically, like ``capsense compress``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from capsense.compress.capabilities import DISTILL_SOURCES
from capsense.core.models import TRAIN_DTYPES
from capsense.core.placement import input_device
from capsense.errors import CapsenseError
from capsense.core.progress import without_library_bars


@dataclass(frozen=True)
class DistillConfig:
    """What fixes a distillation run (a resumed run must match it).

    A bfloat16 run loads and computes in bfloat16 (half the memory of float32) while Adam updates float32 masters of
    the trained matrices, copied back each step: at the default lr (2e-5) Adam's step (~2e-5 per weight) is below half
    the bfloat16 spacing of weights of ~0.02 (1.2e-4): in place they never move (test_compress_distill.py)."""

    student: str
    teacher: str
    sources: str = DISTILL_SOURCES
    n_texts: int = 96
    gen_tokens: int = 32
    seq_len: int = 128
    epochs: int = 3
    lr: float = 2e-5
    seed: int = 0
    fresh: bool = False  # every epoch reads n_texts texts never read before (epochs x n_texts unique texts)
    teacher_revision: str | None = None  # of a Hub teacher (None: its default branch; :func:`teacher_revision`)
    dtype: str = "float32"  # both models load and compute in it; trained matrices keep float32 masters (above)

    def __post_init__(self) -> None:
        for name in ("n_texts", "seq_len", "epochs"):
            if getattr(self, name) < 1:
                raise CapsenseError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.gen_tokens < 0 or not self.lr > 0:
            raise CapsenseError(f"gen_tokens must be >= 0 and lr > 0, got {self.gen_tokens} and {self.lr}")
        if self.dtype not in TRAIN_DTYPES:
            raise CapsenseError(f"distillation `dtype` {self.dtype!r}: valid are {', '.join(TRAIN_DTYPES)} (float16 "
                                "trains without a loss scale here, and its small gradients underflow)")

    @property
    def unique_texts(self) -> int:
        """The distinct texts the run reads from ``sources``: ``n_texts``, or with ``fresh`` that many per epoch."""
        return self.n_texts * (self.epochs if self.fresh else 1)


def check_distill_held_out(cfg: DistillConfig, capabilities: Sequence[str], n_probes: int,
                           include_path: Sequence[str] = ()) -> None:
    """Before any model loads: every training source of ``cfg.sources`` a file, literal text or a known task (as
    a calibration spec is checked), and the capabilities' probes (first ``n_probes`` documents) apart from the
    training texts the sources take from their last documents
    (:func:`~capsense.compress.capabilities.check_held_out`; ``include_path``: folders of task YAMLs declaring the
    capabilities and the sources)."""
    from capsense.compress.calibration import calibration_documents
    from capsense.compress.capabilities import check_calibration_spec, check_held_out

    check_calibration_spec(cfg.sources, include_path)
    check_held_out({c: (n_probes, n) for c, n in calibration_documents(capabilities, cfg.sources, cfg.unique_texts).items()},
                   "lower `probes` or `texts`, or train on other sources", include_path)


@torch.no_grad()
def build_corpus(teacher: nn.Module, tokenizer, cfg: DistillConfig, include_path: Sequence[str] = ()) -> list[list[int]]:
    """Token sequences of at most ``seq_len``: task texts, each followed by the teacher's greedy continuation
    (``include_path``: folders of task YAMLs a source may come from)."""
    from capsense.compress.calibration import calibration_samples

    wanted = cfg.unique_texts
    samples, _ = calibration_samples(cfg.sources, tokenizer, wanted, max_tokens=cfg.seq_len - cfg.gen_tokens,
                                     include_path=include_path)
    if len(samples) < wanted:  # a source ran out of documents: fewer unique texts than the run claims
        raise CapsenseError(f"`sources` {cfg.sources!r} give {len(samples)} texts, not the {wanted} asked "
                            f"({cfg.n_texts} texts{' x ' + str(cfg.epochs) + ' fresh epochs' if cfg.fresh else ''}): "
                            "ask for fewer `n_texts` or name more sources")
    out = []
    for ids in samples:
        x = torch.tensor([ids], device=input_device(teacher))
        if cfg.gen_tokens:
            x = teacher.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=cfg.gen_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        out.append(x[0, : cfg.seq_len].tolist())
    return out


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of ``KL(teacher || student)`` of the next-token distributions."""
    t = F.log_softmax(teacher_logits.float(), -1)
    s = F.log_softmax(student_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def _trainable(student: nn.Module) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    from capsense.compress.targets import find_targets, has_experts

    # A mixture-of-experts student: its experts are fused 3-D tensors, never compressed (targets
    # attn is the only choice there), so the attention projections are what distillation restores.
    params = [t.module.weight for t in find_targets(student, "attn" if has_experts(student) else None)]
    masks = [p.detach() != 0 for p in params]
    for p in student.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    return params, masks


def _masters(params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    """What Adam updates: a float32 copy of each trained matrix held in another dtype, the matrix itself otherwise."""
    return [p if p.dtype == torch.float32 else p.detach().float() for p in params]


class _State:
    """Resumable position of a run: epoch, step within it, optimizer, weights."""

    def __init__(self, work: Path, cfg: DistillConfig):
        self.path = work / "state.pt"
        self.cfg = cfg

    def load(self, params, masters, opt) -> tuple[int, int]:
        if not self.path.is_file():
            return 0, 0
        st = torch.load(self.path, weights_only=False)
        older = {"fresh": False, "teacher_revision": None, "dtype": "float32"}  # what states written before them hold
        if {**older, **st["config"]} != asdict(self.cfg):
            raise CapsenseError(f"{self.path.parent} holds another distillation ({st['config']}): use another `out`")
        with torch.no_grad():
            for p, m, w in zip(params, masters, st["weights"]):
                m.copy_(w)
                p.copy_(m)
        opt.load_state_dict(st["optimizer"])
        return st["epoch"], st["step"]

    def save(self, masters, opt, epoch: int, step: int) -> None:
        tmp = self.path.with_suffix(".tmp")
        torch.save({"config": asdict(self.cfg), "epoch": epoch, "step": step, "optimizer": opt.state_dict(),
                    "weights": [m.detach().clone() for m in masters]}, tmp)  # float32: a resumed run is exact
        tmp.replace(self.path)


def _order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def epoch_order(cfg: DistillConfig, n_corpus: int, epoch: int) -> list[int]:
    """Corpus indices epoch ``epoch`` trains on, in order: a reshuffle of the whole set, or with
    ``fresh`` the epoch's own slice of one fixed shuffle (no text is read twice)."""
    if not cfg.fresh:
        return _order(n_corpus, cfg.seed, epoch)
    per = n_corpus // cfg.epochs
    return _order(n_corpus, cfg.seed, 0)[epoch * per:(epoch + 1) * per]


def run_distill(
    cfg: DistillConfig,
    out: str | Path,
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None,
    save_every: int = 20,
    progress: bool = True,
    overwrite: bool = False,
    models: tuple[nn.Module, nn.Module, Any] | None = None,
    stop_after: int | None = None,
    include_path: Sequence[str] = (),
) -> list[dict[str, Any]] | None:
    """Distil ``cfg.student`` from ``cfg.teacher``; per-epoch records (epoch 0 = before).

    ``evaluate(student)`` gives per-capability losses; ``stop_after`` stops after that many
    steps of this call, as a kill would (returns None; the state is saved first); ``include_path``: folders of
    task YAMLs ``cfg.sources`` may name tasks of (not part of the run's identity: the corpus is kept with it).
    """
    from tqdm.auto import tqdm

    from capsense.core.files import check_output_dir
    from capsense.core.lock import RunFolderLock

    out = Path(out)
    check_output_dir(out, overwrite, (cfg.student, cfg.teacher, cfg.sources, *include_path))
    work = out.parent / (out.name + ".partial")
    with RunFolderLock(work):  # one writer: a second distillation into `out` is refused before its models load
        student, teacher, tokenizer = models or load_models(cfg)
        _check_pruned(cfg.student)
        _check_dtype(cfg, student, teacher)
        corpus = _corpus(work, teacher, tokenizer, cfg, include_path)
        run = _Run(cfg, work, student, teacher, corpus, evaluate)
        per_epoch = len(epoch_order(cfg, len(corpus), 0))
        bar = tqdm(total=cfg.epochs * per_epoch, initial=run.epoch * per_epoch + run.step, desc="distill",
                   disable=not progress)
        try:
            if not run.train(bar, save_every, stop_after):
                return None
        finally:
            bar.close()
        _write(student, tokenizer, cfg, out, run.records, overwrite)
    return run.records


class _Run:
    """One distillation's training state: weights, masks, optimizer, position and epoch records."""

    def __init__(self, cfg, work, student, teacher, corpus, evaluate):
        from capsense.core.files import read_jsonl, repair_jsonl_tail

        self.cfg, self.student, self.teacher, self.corpus, self.evaluate = cfg, student, teacher, corpus, evaluate
        student.eval()  # no dropout: a resumed run repeats an uninterrupted one exactly
        self.params, self.masks = _trainable(student)
        self.masters = _masters(self.params)
        self.opt = torch.optim.Adam(self.masters, lr=cfg.lr)
        self.state = _State(work, cfg)
        self.epoch, self.step = self.state.load(self.params, self.masters, self.opt)
        self.log_path = work / "epochs.jsonl"
        repair_jsonl_tail(self.log_path)
        self.records = list({r["epoch"]: r for r in read_jsonl(self.log_path)}.values())
        if evaluate and not self.records:
            self._record(0)

    def _record(self, epoch: int) -> None:
        from capsense.core.files import append_jsonl

        seen = {i for e in range(epoch) for i in epoch_order(self.cfg, len(self.corpus), e)}
        rec = {"epoch": epoch, "dL": self.evaluate(self.student), "tokens": sum(map(len, self.corpus)),
               "unique_tokens_seen": sum(len(self.corpus[i]) for i in seen)}
        self.records = [r for r in self.records if r["epoch"] != epoch] + [rec]
        append_jsonl(self.log_path, rec)

    def train(self, bar, save_every: int, stop_after: int | None) -> bool:
        """Train to the last epoch (True) or until ``stop_after`` steps (False)."""
        done_now = 0
        while self.epoch < self.cfg.epochs:
            order = epoch_order(self.cfg, len(self.corpus), self.epoch)
            while self.step < len(order):
                _train_step(self, self.corpus[order[self.step]])
                self.step += 1
                done_now += 1
                bar.update(1)
                stop = stop_after is not None and done_now >= stop_after
                if self.step % save_every == 0 or stop:
                    self.state.save(self.masters, self.opt, self.epoch, self.step)
                if stop:
                    return False
            if self.evaluate:
                self._record(self.epoch + 1)
            self.epoch, self.step = self.epoch + 1, 0
            self.state.save(self.masters, self.opt, self.epoch, self.step)
        return True


def _train_step(trained: _Run, ids) -> float:
    """One Adam step on ``trained``'s masters from the student's gradients; the student's matrices follow them."""
    student, teacher, opt = trained.student, trained.teacher, trained.opt
    with torch.no_grad():
        t_logits = teacher(input_ids=torch.tensor([ids], device=input_device(teacher)), use_cache=False).logits
    s_logits = student(input_ids=torch.tensor([ids], device=input_device(student)), use_cache=False).logits
    loss = kd_loss(s_logits, t_logits.to(s_logits.device))  # under device maps the LM heads may differ
    opt.zero_grad(set_to_none=True)
    loss.backward()
    for p, m in zip(trained.params, trained.masters):
        if m is not p:  # (a matrix no gradient reached keeps none, as Adam skips it in float32)
            m.grad, p.grad = (None if p.grad is None else p.grad.float()), None
    opt.step()
    with torch.no_grad():
        for p, m, keep in zip(trained.params, trained.masters, trained.masks):
            m.mul_(keep)  # pruned weights stay exactly zero
            if m is not p:
                p.copy_(m)
    return float(loss.detach())


def load_models(cfg: DistillConfig, device_map: str | dict[str, Any] | None = None,
                device: str = "cpu") -> tuple[nn.Module, nn.Module, Any]:
    """The student, the teacher and the tokenizer, each placed by ``device_map`` (:mod:`capsense.core.placement`),
    without one on ``device``; a student whose weights the map offloads is refused."""
    from capsense.core.models import load_model
    from capsense.core.placement import check_weights_in_memory

    student, tokenizer = load_model(cfg.student, cfg.dtype, device=device, device_map=device_map)
    check_weights_in_memory(student, "distillation trains the student's weights in place and saves them")
    teacher, _ = load_model(cfg.teacher, cfg.dtype, device=device, device_map=device_map, revision=cfg.teacher_revision)
    return student, teacher, tokenizer


def teacher_revision(student: str, teacher: str, given: str | None = None) -> str | None:
    """The revision of ``teacher`` to load: ``given``, else the one ``capsense compress`` loaded its base model at to
    make ``student`` (``capsense.json``'s ``base_model``), where ``teacher`` is that Hub model; None otherwise. Until
    round 52 a student compressed from a pinned checkpoint was distilled toward the default branch's weights."""
    meta_path = Path(student) / "capsense.json"
    if given or not meta_path.is_file():
        return given
    base = json.loads(meta_path.read_text()).get("base_model") or {}
    revision = base.get("revision") if base.get("model") == teacher else None
    return revision if revision != "main" else None  # (a fingerprint's name for no revision)


def _check_dtype(cfg: DistillConfig, student: nn.Module, teacher: nn.Module) -> None:
    """Models given to :func:`run_distill` are in the run's ``dtype`` (it is part of the run's identity)."""
    for name, model in (("student", student), ("teacher", teacher)):
        if (got := next(model.parameters()).dtype) != getattr(torch, cfg.dtype):
            raise CapsenseError(f"the {name} is {str(got).removeprefix('torch.')}, the run's `dtype` is {cfg.dtype}")


def _check_pruned(student: str) -> None:
    meta_path = Path(student) / "capsense.json"
    if not meta_path.is_file():
        return  # an in-memory or foreign student: the masks are its zeros
    meta = json.loads(meta_path.read_text())
    from capsense.compress.methods import METHODS

    bad = {m["method"] for m in meta.get("matrices", []) if m["method"] != "none" and METHODS[m["method"]].family != "prune"}
    if bad:
        raise CapsenseError(f"distillation keeps pruning masks only; {student} also holds {', '.join(sorted(bad))} matrices")


def _corpus(work: Path, teacher, tokenizer, cfg: DistillConfig, include_path: Sequence[str] = ()) -> list[list[int]]:
    """The fixed token set, built once and kept with the run (a resumed run trains on the same tokens)."""
    from capsense.core.files import atomic_write_json

    path = work / "corpus.json"
    if path.is_file():
        return json.loads(path.read_text())
    corpus = build_corpus(teacher, tokenizer, cfg, include_path)  # bad sources fail here, before the run's folder exists
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, corpus)
    return corpus


def _write(student, tokenizer, cfg: DistillConfig, out: Path, records, overwrite: bool) -> None:
    """The student, ``capsense.json`` (the compressed one's with this run, no path of this machine) and, for a student
    of ``capsense compress``, the card and size on disk of this folder (before round 54: none, and the student's)."""
    import shutil

    from capsense.compress.card import render_card
    from capsense.compress.methods import parse_setting
    from capsense.compress.packed import size_on_disk
    from capsense.core.files import atomic_output_dir
    from capsense.core.provenance import provenance
    from capsense.ship.metadata import public_name, public_path

    work = out.parent / (out.name + ".partial")
    meta_in = Path(cfg.student) / "capsense.json"
    meta = json.loads(meta_in.read_text()) if meta_in.is_file() else {}
    if "distill" in meta:  # a distilled student distilled again: the earlier runs are kept, oldest first
        meta["distill_earlier"] = [*meta.get("distill_earlier", []), meta["distill"]]
    public = {**asdict(cfg), "student": public_name(cfg.student), "teacher": public_name(cfg.teacher),
              "sources": public_path(cfg.sources) if Path(cfg.sources).is_file() else cfg.sources}
    meta["distill"] = {"config": public, "epochs": records, **provenance(next(student.parameters()).device)}
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        with without_library_bars():
            student.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if "summary" in meta:  # a checkpoint of capsense compress
            meta["size"] = {**meta.get("size", {}), "bytes_on_disk": size_on_disk(tmp)}
            setting = parse_setting(meta.get("setting") or {})
            (tmp / "README.md").write_text(render_card(meta, setting.family if setting is not None else ""))
        (tmp / "capsense.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    shutil.rmtree(work, ignore_errors=True)


def capability_evaluator(teacher: nn.Module, tokenizer, capabilities, n_probes: int = 32, batch_size: int = 16,
                         include_path: Sequence[str] = ()):
    """``evaluate(student) -> {capability: dL}``, dL against the teacher on the first ``n_probes`` documents
    (``include_path``: folders of task YAMLs declaring the capabilities)."""
    from capsense.compress.capability_loss import build_probes, measure
    from capsense.scoring.probe import model_max_length

    probes = build_probes(tokenizer, capabilities, n_probes, include_path, model_max_length(teacher))
    base = {c: m.nll for c, m in measure(teacher, probes, batch_size).items()}

    def evaluate(student: nn.Module) -> dict[str, float]:
        with torch.no_grad():
            return {c: m.nll - base[c] for c, m in measure(student, probes, batch_size).items()}

    return evaluate
