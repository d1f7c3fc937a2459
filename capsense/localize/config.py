"""The settings of a localization run (:class:`LocateConfig`) and their checks.

The method-dependent settings (which method, which settings identify its masks, whether
measure-and-choose follows) live with the methods in :mod:`capsense.localize.methods`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from capsense.core.ablation import resolve_ablation
from capsense.core.batching import check_batch_size
from capsense.core.models import DTYPES
from capsense.core.precision import AUTOCAST_DTYPES
from capsense.errors import CapsenseError
from capsense.localize.designs import DESIGNS
from capsense.localize.prior import DEFAULT_GROUP_SIZE, DEFAULT_TOP_M, GROUP_PRICES, PRIOR_SCORES
from capsense.localize.refine import DEFAULT_SEARCH, DEFAULT_TOLERANCE, SEARCHES, SET_CONTROLS
from capsense.localize.screen import DEFAULT_SCREEN_Z, SINGLE_CONTROLS
from capsense.localize.solvers import SOLVERS
from capsense.scoring import CHOICE_METRICS, METRICS
from capsense.tasks.suite import expand_controls


@dataclass
class LocateConfig:
    """Every setting of a localization run (defaults follow the paper where they fit)."""

    model: str
    task: str
    out: str
    # control tasks and suites ("default", "held-out"), expanded on construction (capsense.tasks.suite);
    # empty: not selective. The CLI and recipes default to the "default" suite.
    controls: list[str] = field(default_factory=list)
    control_limit: int | None = None  # documents per control task (None: `limit`)
    screen: float = DEFAULT_SCREEN_Z  # collateral screen: robust z beyond which a control's damage excludes a head; 0 = off
    # measure-and-choose's precision: None = float32 when the search ran in bfloat16/float16 on one device
    # (bf16 moved one set's control damage from +1.9% to +15.7%) and, on a GPU, the float32 model takes at
    # most half its memory (capsense.core.placement.recast_fits), else the run's dtype; or a dtype name
    refine_dtype: str | None = None
    # the search's matrix products in this dtype over float32 weights (capsense.core.precision; None: off);
    # measure-and-choose then measures its sets without it, against the clean model evaluated again
    autocast: str | None = None
    metric: str = "nll"
    # what a knocked-out head's output becomes (capsense.core.ablation): "zero", or "mean" over `mean_reference`'s
    # texts (None: capsense's neutral prose); the knockouts, the gradient attribution and the handed-on set all use it
    ablation: str = "zero"
    mean_reference: str | None = None
    limit: int | None = 100  # paper: 100 samples per mask
    masks: int = 100  # paper: 100 masks
    sparsity: float | None = 0.02  # paper: ~2% of heads per mask
    heads_per_mask: int | None = None
    design: str = "balanced"
    solver: str = "lasso"
    alpha: float | None = None  # paper: 0.01
    method: str = "prior-guided"
    seed: int = 0
    batch_size: int | str = 16  # requests per forward pass, or "auto" (capsense.core.batching)
    masks_per_forward: int | None = None  # None: automatic (1, with prefix reuse; from free memory on a GPU without it)
    device: str = "cpu"
    device_map: str | None = None  # spread the model over devices (capsense.core.placement): auto, or a map
    dtype: str = "auto"  # auto: capsense.core.precision.search_precision (one CPU with native bf16: float32 + autocast)
    include_path: list[str] = field(default_factory=list)
    revision: str | None = None
    top_k: int = 5  # heads in the set the run hands on (greedy's rounds, refine's set)
    refine: int | None = None  # measure-and-choose budget; None = refine.DEFAULT_BUDGET with controls, else 0
    tolerance: float = DEFAULT_TOLERANCE
    # measure-and-choose after a start that breaks the tolerance, one of refine.SEARCHES; None = refine.DEFAULT_SEARCH
    refine_search: str | None = None
    # measure-and-choose with controls: a set's controls scored until the first beyond the search's bound, or all
    # (refine.SET_CONTROLS)
    set_controls: str = "until-beyond"
    budget: float = 50.0  # prior-guided: forward-equivalents for attribution + knockouts (refine not included)
    top_m: int = DEFAULT_TOP_M  # prior-guided: heads with the largest |estimate| knocked out alone
    group_size: int = DEFAULT_GROUP_SIZE  # prior-guided: heads per group knockout over the rest
    # prior-guided: what orders the single-head knockouts: "estimate" (|attribution estimate|) or
    # "documents" (each document's |gradient|, summed: cancellation across documents cannot hide a head)
    prior_score: str = "documents"
    group_price: str = "full"  # prior-guided with controls: a group's price in the budget (prior.GROUP_PRICES)
    # prior-guided with controls and a screen: a single's probes scored cheapest first until a control excludes it,
    # the target first and then the controls until one excludes it, or all (screen.SINGLE_CONTROLS)
    single_controls: str = "cheapest-first"
    prefix_reuse: bool = True
    progress: bool = True
    confirm_run_unsafe_code: bool = False  # tasks that run model-written code (lm-eval asks the same)
    task_metric_higher_is_better: bool = True  # set by locate from the task when --metric is the task's own

    def __post_init__(self) -> None:
        self.controls = expand_controls(self.controls, self.task)

    @property
    def controls_until_excluded(self) -> bool:
        """Whether a single-head knockout's controls stop at the first beyond its screen threshold
        (:data:`~capsense.localize.screen.SINGLE_CONTROLS`): only where there are controls and a screen."""
        return self.single_controls in ("cheapest-first", "until-excluded") and bool(self.controls) and self.screen > 0

    @property
    def target_after_cheaper_controls(self) -> bool:
        """Whether a single is scored on the controls cheaper than the target before the target, so a head one of them
        sets aside is never scored on the target (``single_controls`` cheapest-first, where controls stop at all)."""
        return self.controls_until_excluded and self.single_controls == "cheapest-first"

    @property
    def sets_until_beyond(self) -> bool:
        """Whether measure-and-choose scores a set's controls until the first beyond the search's bound
        (:data:`~capsense.localize.refine.SET_CONTROLS`): only where there are controls to stop at."""
        return self.set_controls == "until-beyond" and bool(self.controls)

    def resolved_refine_dtype(self, dtype: str) -> str:
        """The dtype measure-and-choose runs in, given the run's resolved ``dtype`` (see ``refine_dtype``)."""
        if self.refine_dtype is not None:
            return self.refine_dtype
        return "float32" if dtype in ("bfloat16", "float16") and not self.device_map else dtype

    @property
    def resolved_refine_search(self) -> str:
        """The search measure-and-choose runs after a start beyond tolerance (``refine_search``, else the default)."""
        return self.refine_search or DEFAULT_SEARCH

    def check(self) -> None:
        """Raise :class:`CapsenseError` for settings that are wrong before any model is loaded.

        The method and its own settings are checked by :func:`capsense.localize.methods.get_method`.
        """
        choice("design", self.design, DESIGNS)
        choice("solver", self.solver, SOLVERS)
        choice("dtype", self.dtype, DTYPES)
        if self.autocast is not None:
            choice("autocast", self.autocast, AUTOCAST_DTYPES)
            if self.dtype != "float32":
                raise CapsenseError(f"`autocast` {self.autocast} runs a float32 model's matrix products in {self.autocast}: "
                                    f"give `dtype` float32 (got {self.dtype}; a model loaded in {self.autocast} computes "
                                    f"in it everywhere, autocast or not)")
        choice("prior_score", self.prior_score, PRIOR_SCORES)
        choice("group_price", self.group_price, GROUP_PRICES)
        choice("single_controls", self.single_controls, SINGLE_CONTROLS)
        resolve_ablation({}, self.ablation, self.mean_reference)  # the mode, and its reference texts where given
        if self.refine_search is not None:
            choice("refine_search", self.refine_search, SEARCHES)
        choice("set_controls", self.set_controls, SET_CONTROLS)
        if self.group_price != "full" and not self.controls:
            raise CapsenseError(f"`group_price` {self.group_price} applies to a run with `controls` (without them a group "
                                "is scored on every probe, and full is its price)")
        if self.single_controls != "cheapest-first" and not (self.controls and self.screen > 0):
            raise CapsenseError(f"`single_controls` {self.single_controls} applies to a run with `controls` and a collateral "
                                "`screen` (without them a single is scored on every probe)")
        if not self.metric or not isinstance(self.metric, str):
            raise CapsenseError(
                "give a metric: nll (nats/token of the reference continuation, the default), acc (greedy "
                "exact match, or multiple-choice accuracy), choice_nll (a multiple-choice target: nats per document "
                "of the gold choice among its document's choices) or one of the target task's own lm-eval metrics"
            )
        self._check_numbers()
        if self.task in self.controls:
            raise CapsenseError(f"the target task {self.task!r} is also listed as a control")
        if len(set(self.controls)) != len(self.controls):
            raise CapsenseError(f"duplicate control tasks in {self.controls}")

    def _check_numbers(self) -> None:
        self.batch_size = check_batch_size(self.batch_size)
        if self.heads_per_mask is None and (self.sparsity is None or not 0 < self.sparsity < 1):
            raise CapsenseError(f"`sparsity` must be strictly between 0 and 1, got {self.sparsity}")
        if self.heads_per_mask is not None and self.heads_per_mask < 1:
            raise CapsenseError(f"`heads_per_mask` must be at least 1, got {self.heads_per_mask}")
        if self.masks < 2:
            raise CapsenseError(f"`masks` must be at least 2, got {self.masks}")
        if self.limit is not None and self.limit < 1:
            raise CapsenseError(f"`limit` must be at least 1, got {self.limit}")
        if self.control_limit is not None and self.control_limit < 1:
            raise CapsenseError(f"`control_limit` must be at least 1 document per control task, got {self.control_limit}")
        if self.control_limit is not None and not self.controls:
            raise CapsenseError("`control_limit` applies to control tasks, and this run has none (`controls`)")
        if self.refine_dtype is not None:
            choice("refine_dtype", self.refine_dtype, ("float32", "bfloat16", "float16"))
        if not self.screen >= 0:
            raise CapsenseError(f"`screen` must be a robust z-score >= 0 (0 = no collateral screen), got {self.screen}")
        if self.alpha is not None and self.alpha <= 0:
            raise CapsenseError(f"`alpha` must be positive, got {self.alpha}")
        if self.top_k < 1:
            raise CapsenseError(f"`top_k` must be at least 1, got {self.top_k}")
        if self.refine is not None and self.refine < 0:
            raise CapsenseError(f"`refine` must be 0 (off) or a number of evaluations, got {self.refine}")
        if not self.budget > 0:
            raise CapsenseError(f"`budget` must be a positive number of forward-equivalents, got {self.budget}")
        if self.top_m < 0:
            raise CapsenseError(f"`top_m` must be 0 or more heads, got {self.top_m}")
        if self.group_size < 2:
            raise CapsenseError(f"`group_size` must be at least 2 heads, got {self.group_size}")
        if not self.tolerance >= 0:
            raise CapsenseError(f"`tolerance` must be a relative worsening >= 0 (0.03 = 3%), got {self.tolerance}")
        if self.masks_per_forward is not None and self.masks_per_forward < 1:
            raise CapsenseError(f"`masks_per_forward` must be at least 1 (or None: automatic), got {self.masks_per_forward}")

    def limit_for(self, task: str) -> int | None:
        """Documents scored for ``task``: ``control_limit`` for controls (when set), else ``limit``."""
        if task != self.task and self.control_limit is not None:
            return self.control_limit
        return self.limit

    @property
    def tasks(self) -> list[str]:
        """The target, then the controls."""
        return [self.task, *self.controls]

    def metric_for(self, task: str) -> str:
        """The metric ``task`` is scored by: ``metric`` for the target, and for controls too
        when every probe has it (nll, acc); a task's own metric (``exact_match``) and
        ``choice_nll`` (multiple choice only) are the target's, so controls then use nll."""
        shared = self.metric in METRICS and self.metric not in CHOICE_METRICS
        return self.metric if task == self.task or shared else "nll"

    def higher_is_better(self, task: str) -> bool:
        """Whether a larger value of ``task``'s metric is better."""
        m = self.metric_for(task)
        return {"nll": False, "acc": True, "choice_nll": False}.get(m, self.task_metric_higher_is_better)


def choice(name: str, value: str, valid: Sequence[str]) -> None:
    """Raise :class:`CapsenseError` naming the valid values unless ``value`` is one of them."""
    if value not in valid:
        raise CapsenseError(f"unknown {name} {value!r}: valid values are {', '.join(valid)}")
