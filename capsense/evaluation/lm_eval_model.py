"""``capsense-masked``: lm-eval's ``hf`` model with attention heads ablated.

    lm_eval --model capsense-masked \\
        --model_args pretrained=smollm2-135m,heads=L3H1+L7H4,ablation=zero --tasks ...

Takes every ``hf`` model arg plus:

* ``heads``: a head spec (``L16H21+L15H13``) or the path of a heads JSON file;
* ``head_file``: the path of a heads JSON file (alias of ``heads=FILE``);
* ``top_k``: keep the first k heads of a ranked heads file;
* ``ablation``: ``zero`` (default) or ``mean``;
* ``mean_reference``: for mean ablation, a text file (one passage per line) or JSONL file
  (a ``text`` field per line) of reference texts; default: capsense's neutral prose.

With no heads it is exactly lm-eval's ``hf`` model. Every forward (log-likelihood and
generation) runs inside :meth:`HeadAblator.apply`, so the hooks exist only during calls.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from capsense.core.ablation import HeadAblator, check_ablation_mode, reference_means
from capsense.core.arch import head_layout
from capsense.core.heads import HeadSet
from capsense.core.models import check_model, model_load_errors, resolve_pretrained
from capsense.errors import CapsenseError


def _optional_int(value: Any, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise CapsenseError(f"{name} must be an integer, got {value!r}") from None


@register_model("capsense-masked")
class CapsenseMaskedLM(HFLM):
    """An ``HFLM`` whose forward passes ablate a fixed set of attention heads."""

    def __init__(
        self,
        pretrained: Any,
        heads: Any = None,
        head_file: str | None = None,
        top_k: int | str | None = None,
        ablation: str = "zero",
        mean_reference: str | None = None,
        ablator: HeadAblator | None = None,
        **kwargs: Any,
    ) -> None:
        """``ablator``: from Python only, an ablator of the same ``pretrained`` model to share (a locate run's, so
        mean ablation's head means are computed once per run, not again here)."""
        # Check everything that needs no model before the (slow) load.
        ablation = check_ablation_mode(str(ablation))
        if heads not in (None, "") and head_file not in (None, ""):
            raise CapsenseError("give heads= or head_file=, not both")
        if ablator is not None and ablator.ablation != ablation:
            raise CapsenseError(f"`ablator` must ablate this model under ablation {ablation!r}; "
                                f"got one for {ablator.ablation!r}")
        spec = heads if heads not in (None, "") else head_file
        k = _optional_int(top_k, "top_k")
        head_set = HeadSet.parse(spec, top_k=k) if spec not in (None, "") else HeadSet()
        name = pretrained
        if isinstance(pretrained, str):
            check_model(pretrained, kwargs.get("revision"))
            pretrained = resolve_pretrained(pretrained)
        with model_load_errors(str(name)):
            super().__init__(pretrained=pretrained, **kwargs)
        if ablator is not None and ablator.model is not self.model:
            raise CapsenseError(f"`ablator` must ablate this model under ablation {ablation!r}; got one for another model")
        self.ablation = ablation
        self.mean_reference = mean_reference
        self._ablator: HeadAblator | None = ablator
        self.quiet_requests = False  # True while capsense shows its own progress display
        self.heads = HeadSet()
        self.set_heads(head_set)

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
