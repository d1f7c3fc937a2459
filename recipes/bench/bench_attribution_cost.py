"""What the one-pass gradient attribution really costs, in clean forwards timed beside it.

    OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 python recipes/bench/bench_attribution_cost.py \\
        --model smollm2-135m --model gemma3-270m --task capsense_induction --task capsense_antonyms \\
        --out recipes/results/attribution_cost_r35.json

The budget counts a backward pass as 2 forward-equivalents (``capsense.scoring.cost.BACKWARD``), so
the attribution is charged 3 FE (its forward is the clean evaluation's). That is the usual rule of
thumb for training, where the backward computes the gradients of the inputs *and* of the weights.
The attribution freezes the weights (``attribution._frozen``): its backward computes only the
activations' gradients, about one matmul per forward matmul, so its real price may be lower. This
script measures it per (model, task), on the probe a run builds (the same documents, seed and batches):

* ``forward``: the clean model scored by the knockout evaluator (``MaskEvaluator``, no prefix reuse: the
  definition of 1 FE; a multiple-choice probe on its shared context, as the search scores it);
* ``attribution``: :meth:`AttributionScorer.attribute`, its forward with the multipliers and the backward.

Repeats alternate the two (``--repeats``, after one warm-up of each) and the medians are compared; the
ratio is the attribution's cost in measured forward-equivalents, against the 3 FE the budget charges.
The budget's rule is not changed by this script: FE stay comparable across rounds and methods; the
measured ratio says how conservative they are on the hardware it ran on.

``--precision`` (repeatable) times each (model, task) in several precisions of a float32 model, each row's
seconds also as a ratio to the first precision's: ``float32``; ``autocast`` (``--autocast bfloat16``, as a
locate run's search computes: since round 41 with the attention kernel in float32 on a CPU,
:func:`capsense.core.precision.autocast_attention`); ``autocast-bf16-attention``, autocast with the attention
kernel in bfloat16 too, as rounds 39-40 ran it. Round 40 found that under that autocast the attribution gained
nothing (18.4 s against float32's 19.2 s in the main job), because PyTorch's CPU flash-attention backward ran
about 4x slower in bfloat16 than in float32 (``torch.profiler``, a batch of 16 documents on SmolLM2); its
runs of this script (``attribution_cost_autocast_r40.json``) name today's ``autocast`` ``autocast-attention32``
and today's ``autocast-bf16-attention`` ``autocast``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import numpy as np


def _timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


class Paths:
    """The two timed paths on ``probe``: the clean forward (the knockout evaluator's scorer, no prefix reuse: the
    definition of 1 FE) and the attribution (forward and backward)."""

    def __init__(self, model, probe, batch_size: int = 16) -> None:
        from capsense.localize.evaluator import MaskEvaluator
        from capsense.scoring.attribution import AttributionScorer

        ev = MaskEvaluator(model, {probe.name: probe}, batch_size=batch_size, masks_per_forward=1, prefix_reuse=False)
        self.scorer, self.att = ev.scorers[probe.name], AttributionScorer(model, probe, batch_size=batch_size)
        self.clean = ev.knockouts(np.zeros((1, self.att.layout.n_layers * self.att.layout.n_heads), dtype=bool))

    def time(self, sync=lambda: None) -> tuple[float, float]:
        """Seconds of one clean forward, then of one attribution."""
        return _timed(lambda: self.scorer.score(self.clean), sync), _timed(self.att.attribute, sync)


def summary(paths: Paths, fwd: list[float], bwd: list[float]) -> dict:
    """Medians of the timed repeats; ``measured_fe`` is their ratio, ``charged_fe`` what the budget counts."""
    from capsense.scoring.cost import ATTRIBUTION

    f, a = statistics.median(fwd), statistics.median(bwd)
    return {"scorer": type(paths.scorer).__name__, "forward_s": fwd, "attribution_s": bwd, "median_forward_s": f,
            "median_attribution_s": a, "measured_fe": a / f, "charged_fe": ATTRIBUTION}


def time_attribution(model, probe, batch_size: int = 16, repeats: int = 3, sync=lambda: None) -> dict:
    """Median seconds of the clean forward and of the attribution on ``probe`` (:class:`Paths`), alternated
    ``repeats`` times after one warm-up of each (``sync``: a device's synchronize)."""
    paths = Paths(model, probe, batch_size)
    paths.time(sync)  # warm-up of both paths
    fwd, bwd = zip(*(paths.time(sync) for _ in range(repeats)))
    return summary(paths, list(fwd), list(bwd))


PRECISIONS = ("float32", "autocast", "autocast-bf16-attention")


@contextlib.contextmanager
def precision(name: str, model, device: str = "cpu"):
    """The block computes as ``name`` says (:data:`PRECISIONS`) on ``model``, a float32 model, with the library's
    :func:`capsense.core.precision.autocast`."""
    from capsense.core.precision import autocast, autocast_attention

    if name not in PRECISIONS:
        raise ValueError(f"precision {name!r}: one of {', '.join(PRECISIONS)}")
    if name == "float32":
        yield
        return
    attention = autocast_attention(model, "bfloat16") if name == "autocast" else None
    with autocast(device, "bfloat16", attention):
        yield


def measure(model_name: str, task: str, limit: int, dtype: str, repeats: int, batch_size: int,
            precisions: tuple[str, ...] = ("float32",)) -> list[dict]:
    """One row per precision (the first is each ratio's reference). Each repeat times every precision, in
    alternating order; until round 41 each precision's repeats ran in a block, so a drift of the host's speed
    (Gemma 3's forward took 0.52-0.89 s within one block) fell on one precision."""
    from capsense.core.models import load_model
    from capsense.scoring.probe import build_probe

    model, tok = load_model(model_name, dtype)
    probe = build_probe(task, tok, limit, 0)
    paths, times = Paths(model, probe, batch_size), {name: ([], []) for name in precisions}
    for name in precisions:  # one warm-up in each precision
        with precision(name, model):
            paths.time()
    for r in range(repeats):  # every repeat times each precision, in alternating order: a drifting host's speed
        for name in precisions if r % 2 == 0 else precisions[::-1]:  # falls on each alike
            with precision(name, model):
                for kept, t in zip(times[name], paths.time()):
                    kept.append(t)
    rows = []
    for name in precisions:
        row = {"model": model_name, "task": task, "kind": probe.kind, "documents": int(probe.n_docs),
               "precision": name, **summary(paths, *times[name])}
        ref = rows[0] if rows else row
        row["forward_ratio"] = row["median_forward_s"] / ref["median_forward_s"]
        row["attribution_ratio"] = row["median_attribution_s"] / ref["median_attribution_s"]
        rows.append(row)
        print(f"{model_name} {task} {name}: forward {row['median_forward_s']:.2f} s ({row['forward_ratio']:.2f}x "
              f"{precisions[0]}), attribution {row['median_attribution_s']:.2f} s ({row['attribution_ratio']:.2f}x) = "
              f"{row['measured_fe']:.2f} FE measured (charged {row['charged_fe']:.0f})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", help="embedded model name or folder (repeatable; default smollm2-135m)")
    p.add_argument("--task", action="append", help="task (repeatable; default capsense_induction)")
    p.add_argument("--limit", type=int, default=24)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--precision", action="append", choices=PRECISIONS,
                   help="repeatable; the first is the ratios' reference (default float32 alone; needs --dtype float32)")
    p.add_argument("--out", type=Path, help="write the rows and the machine as JSON here")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.limit < 1:
        p.error("--repeats and --limit must be at least 1")
    precisions = tuple(dict.fromkeys(args.precision or ["float32"]))
    if precisions != ("float32",) and args.dtype != "float32":
        p.error(f"--precision {', '.join(precisions)} times a float32 model: give --dtype float32 (not {args.dtype})")
    rows = [r for m in args.model or ["smollm2-135m"] for t in args.task or ["capsense_induction"]
            for r in measure(m, t, args.limit, args.dtype, args.repeats, args.batch_size, precisions)]
    if args.out:
        from capsense.core.files import atomic_write_json
        from capsense.core.provenance import cpu_info, provenance

        out = {"rows": rows, "dtype": args.dtype, "limit": args.limit, "batch_size": args.batch_size,
               "repeats": args.repeats, "cpu_flags": cpu_info(), **provenance("cpu")}
        print(f"wrote {atomic_write_json(args.out, out)}")


if __name__ == "__main__":
    main()
