"""``capsense-masked``: lm-eval's ``hf`` model with attention heads ablated.

    lm_eval --model capsense-masked \\
        --model_args pretrained=smollm2-135m,heads=L3H1+L7H4,ablation=zero --tasks ...

Takes every ``hf`` model arg plus:

* ``heads``: a head spec (``L16H21+L15H13``) or the path of a heads JSON file;
* ``head_file``: the path of a heads JSON file (alias of ``heads=FILE``);
* ``top_k``: keep the first k heads of a ranked heads file (without it: the set the file's locate run chose);
* ``ablation``: ``zero`` or ``mean``; default: what a heads file's locate run ablated under (and its reference
  texts), as ``capsense validate`` and ``export`` apply it; ``zero`` for a spec;
* ``mean_reference``: for mean ablation, a text file (one passage per line) or JSONL file
  (a ``text`` field per line) of reference texts; default: the run's, else capsense's neutral prose;
* ``full_logits``: ``true`` scores log-likelihoods on ``hf``'s own path (every position's logits), bit for bit
  ``hf``; by default a float32 model's run the LM head only at the continuations' positions.

With no heads it is lm-eval's ``hf`` model: a float32 model's log-likelihoods run the LM head only at the
continuations' positions (:mod:`capsense.evaluation.loglikelihood`), which gives ``hf``'s scores to float32 rounding
(the head's product over fewer rows rounds its last bits differently: 9.5e-6 nats at most over the 858 requests of
SmolLM2's validation suite, none on Gemma 3, the same greedy flags) in 0.78x and 0.37x the time
(``recipes/bench/bench_loglikelihood.py``);
``full_logits=true`` is ``hf`` bit for bit. Every forward (log-likelihood and
generation) runs inside :meth:`HeadAblator.apply`, so the hooks exist only during calls.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from capsense.core.ablation import HeadAblator, located_ablation, reference_means
from capsense.core.arch import head_layout
from capsense.core.heads import HeadSet, located_revision
from capsense.core.model_config import config_head_layout
from capsense.core.models import check_model, model_load_errors, resolve_pretrained, unpack_packed
from capsense.errors import CapsenseError


def _optional_int(value: Any, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise CapsenseError(f"{name} must be an integer, got {value!r}") from None


def _bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise CapsenseError(f"{name} must be true or false, got {value!r}")


@register_model("capsense-masked")
class CapsenseMaskedLM(HFLM):
    """An ``HFLM`` whose forward passes ablate a fixed set of attention heads."""

    def __init__(
        self,
        pretrained: Any,
        heads: Any = None,
        head_file: str | None = None,
        top_k: int | str | None = None,
        ablation: str | None = None,
        mean_reference: str | None = None,
        ablator: HeadAblator | None = None,
        full_logits: bool | str = False,
        device: str | None = None,
        **kwargs: Any,
    ) -> None:
        """``ablator``: from Python only, an ablator of the same ``pretrained`` model to share (a locate run's, so
        mean ablation's head means are computed once per run, not again here). ``full_logits``: score log-likelihoods
        on ``hf``'s own path, every position's logits (bit for bit ``hf``), not only the continuations'.

        ``device``: None (the default) takes CUDA where there is one, else the CPU, as lm-eval's command line does;
        ``HFLM``'s own default from Python is ``"cuda"``, and on a machine without CUDA the load failed with
        "Torch not compiled with CUDA enabled"."""
        # Check everything that needs no model before the (slow) load.
        full_logits = _bool(full_logits, "full_logits")
        if heads not in (None, "") and head_file not in (None, ""):
            raise CapsenseError("give heads= or head_file=, not both")
        spec = heads if heads not in (None, "") else head_file
        # (None: a heads file's run's ablation and reference texts, as validate and export apply them; zero for a spec)
        ablation, mean_reference = located_ablation(spec, None if ablation in (None, "") else str(ablation),
                                                    mean_reference or None)
        if ablator is not None and ablator.ablation != ablation:
            raise CapsenseError(f"`ablator` must ablate this model under ablation {ablation!r}; "
                                f"got one for {ablator.ablation!r}")
        k = _optional_int(top_k, "top_k")
        if k is not None and spec in (None, ""):  # (the model would be evaluated as is)
            raise CapsenseError("top_k keeps the first k heads of heads= or head_file=, and neither is given: give one")
        head_set = HeadSet.parse(spec, top_k=k) if spec not in (None, "") else HeadSet()
        name = pretrained
        if isinstance(pretrained, str):
            # (no revision=: the one a heads file's run loaded, where `pretrained` is its model; HFLM's is "main")
            if revision := located_revision(spec, pretrained, kwargs.get("revision")):
                kwargs["revision"] = revision
            check_model(pretrained, kwargs.get("revision"))
            layout = config_head_layout(pretrained, kwargs.get("revision")) if head_set else None
            if layout is not None:
                head_set.check_fits(layout)  # out-of-range heads or another model's file, before the load
            pretrained = resolve_pretrained(pretrained)
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        with model_load_errors(str(name)):
            super().__init__(pretrained=pretrained, device=device, **kwargs)
        if ablator is not None and ablator.model is not self.model:
            raise CapsenseError(f"`ablator` must ablate this model under ablation {ablation!r}; got one for another model")
        self.ablation = ablation
        self.full_logits = full_logits
        self.mean_reference = mean_reference
        self._ablator: HeadAblator | None = ablator
        self.quiet_requests = False  # True while capsense shows its own progress display
        self.heads = HeadSet()
        self.set_heads(head_set)

    def _create_model(self, *args: Any, **kwargs: Any) -> None:
        """HFLM's load, then a packed compressed-tensors checkpoint unpacked as capsense's own loads unpack it
        (:func:`~capsense.core.models.unpack_packed`: scoring runs the model's body, which never unpacks it).
        lm-eval hands a checkpoint's own ``quantization_config`` back to ``from_pretrained``, and transformers then
        warns that the user passed one: that warning, untrue of anything the user gave, is not shown."""
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="You passed `quantization_config`", category=UserWarning)
            super()._create_model(*args, **kwargs)
        unpack_packed(self._model)

    def set_heads(self, heads: Any) -> None:
        """Ablate ``heads`` from now on (an empty set restores the plain ``hf`` model).

        Lets one loaded model be evaluated under several head sets.
        """
        head_set = HeadSet.parse(heads)
        if head_set:
            head_set.check_fits(head_layout(self.model))
            if self._ablator is None:
                means = reference_means(self.model, self.tokenizer, self.ablation, self.mean_reference)
                self._ablator = HeadAblator(self.model, self.ablation, means)
        self.heads = head_set

    def loglikelihood(self, requests: Any, disable_tqdm: bool = False) -> Any:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or self.quiet_requests)

    def loglikelihood_rolling(self, requests: Any, disable_tqdm: bool = False) -> Any:
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm or self.quiet_requests)

    def generate_until(self, requests: Any, disable_tqdm: bool = False) -> Any:
        return super().generate_until(requests, disable_tqdm=disable_tqdm or self.quiet_requests)

    def loglikelihood_path(self, batch_size: Any = None) -> str:
        """How log-likelihoods are scored at ``batch_size`` (default: the model's): ``continuations`` (the LM head only
        at the continuations' positions, :mod:`capsense.evaluation.loglikelihood`) for a causal float32 model of an
        architecture capsense knows (:data:`~capsense.core.arch.ARCHITECTURES`, whose logits after the head
        :func:`~capsense.scoring.logits.output_logits` reproduces), unwrapped, at a fixed batch size; else ``hf``
        (lm-eval's own path: ``full_logits``, reduced precision, a seq2seq model, another architecture or a PEFT
        wrapper, an automatic batch size). A validation folder records it: conditions scored one way are not resumed the other."""
        from capsense.core.arch import ARCHITECTURES, unwrap
        from capsense.core.precision import computes_in_float32

        size = self.batch_size if batch_size is None else batch_size
        known = unwrap(self.model) is self.model and getattr(self.model.config, "model_type", None) in ARCHITECTURES
        fast = (not self.full_logits and self.backend == "causal" and isinstance(size, int) and known
                and getattr(self, "mixed_precision_dtype", None) is None and computes_in_float32(self.model))
        return "continuations" if fast else "hf"

    def _loglikelihood_tokens(self, requests: Any, disable_tqdm: bool = False, override_bs: int | None = None) -> Any:
        """``hf``'s log-likelihoods, on the path :meth:`loglikelihood_path` names: ``hf``'s batches and scores to float32
        rounding in 0.78x the time on SmolLM2's validation suite (``recipes/bench/bench_loglikelihood.py``), or ``hf``'s own.
        ``override_bs`` comes from ``hf``'s ``loglikelihood_rolling`` alone, once per batch of a perplexity task's windows,
        with ``disable_tqdm`` False whatever its caller asked: no bar is drawn there (it drew one per 16 windows under
        ``--no-progress``)."""
        from capsense.evaluation.loglikelihood import continuation_loglikelihoods

        size = override_bs if override_bs is not None else self.batch_size
        disable_tqdm = disable_tqdm or override_bs is not None  # (quiet_requests: loglikelihood and the rolling one passed it)
        if self.loglikelihood_path(size) == "hf":
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        from tqdm import tqdm

        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood requests")
        try:
            return continuation_loglikelihoods(
                self.model, requests, self.max_length, size, self.device, self._ablating,
                one_token_cache=bool(getattr(self, "logits_cache", True)), done=bar.update,
                record=lambda strings, answer: self.cache_hook.add_partial("loglikelihood", strings, answer))
        finally:
            bar.close()

    def _ablating(self):
        if self._ablator is None or not self.heads:
            return nullcontext()
        return self._ablator.apply(self.heads)

    def _model_call(self, *args: Any, **kwargs: Any):
        with self._ablating():
            return super()._model_call(*args, **kwargs)

    def _model_generate(self, *args: Any, **kwargs: Any):
        with self._ablating():
            return super()._model_generate(*args, **kwargs)
