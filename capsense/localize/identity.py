"""What identifies a localization run folder: the settings a resumed run must share with the one that
wrote it (:func:`identity_keys` picks them from :func:`run_identity`), and how a folder from an earlier
release, written before a setting was recorded, is resumed (:data:`EARLIER_IDENTITY`).
"""

from __future__ import annotations

from typing import Any

from capsense.core.ablation import ablation_identity
from capsense.localize.config import LocateConfig
from capsense.localize.methods import get_method, refine_budget
from capsense.scoring import METRICS

#: Settings every run folder is identified by (a method adds its own: :attr:`Method.identity_keys`).
BASE_IDENTITY = ("model", "task", "controls", "limit", "seed", "method", "dtype", "autocast", "autocast_attention", "doc_ids",
                 "ablation")


#: How to resume a folder written before an identity key was recorded: the setting that does what
#: the earlier release did (it had no collateral screen, and controls used `limit` documents), or None where
#: no setting does (rounds 39-40 ran autocast's attention kernel in bfloat16 on a CPU; this release runs it in float32).
EARLIER_IDENTITY = {"autocast_attention": None,
                    "screen": "`screen` 0 (no collateral screen, as that release ran)",
                    "prior_score": "`prior_score` estimate (that release ordered singles by |estimate|)",
                    "control_limit": "no `control_limit` (that release scored controls on `limit` documents)",
                    "single_controls": "`single_controls` all (that release scored every single on every control)",
                    "set_controls": "`set_controls` all (that release scored every measure-and-choose set on every control)",
                    "refine_search": "`refine_search` swaps (that release searched by swaps after a first set beyond tolerance)"}


def identity_keys(cfg: LocateConfig) -> list[str]:
    """The settings that must match for a run folder to be resumed by ``cfg``."""
    keys = [*BASE_IDENTITY, *get_method(cfg).identity_keys]
    if cfg.design == "adaptive":  # its rounds follow from fits of the earlier masks
        keys += ["metric", "solver", "alpha"]
    if cfg.metric not in METRICS:  # the task's own metric is stored beside nll and acc
        keys.append("metric")
    if refine_budget(cfg):  # refine's sets follow from the fit of every earlier mask
        keys += ["masks", "metric", "solver", "alpha", "top_k", "refine", "tolerance"]
        keys.append("refine_dtype")  # (None where it is the run's dtype, as in folders from before it)
        keys.append("refine_search")  # (None: swaps, as in folders from before it)
        if cfg.controls and cfg.screen:  # the screen decides refine's candidates (folders from before it: screen off)
            keys += ["screen", "single_controls"]  # (and, with estimates, which controls its extra singles are scored on)
        keys.append("set_controls")  # (None: every control of every set, as in folders from before it)
    if cfg.control_limit is not None:  # (doc_ids hold the documents; a folder from before control_limit has none)
        keys.append("control_limit")
    return list(dict.fromkeys(keys))


def run_identity(cfg: LocateConfig, fingerprint: dict, dtype: str, k: int, probes: dict,
                 refine_dtype: str | None = None, autocast_attention: str | None = None) -> dict[str, Any]:
    """Every setting that may identify a run folder (:func:`identity_keys` picks the ones compared).
    ``refine_dtype``: measure-and-choose's resolved precision (None: ``cfg``'s rule alone);
    ``autocast_attention``: :func:`capsense.core.precision.autocast_attention` of the run's model."""
    refine_dtype = refine_dtype or cfg.resolved_refine_dtype(dtype)
    return {
        "model": fingerprint.get("content_sha256") or f"{cfg.model}@{fingerprint.get('revision_sha') or fingerprint.get('revision')}",
        "task": cfg.task,
        "controls": list(cfg.controls),
        "limit": cfg.limit,
        "control_limit": cfg.control_limit,
        "screen": cfg.screen or None,
        "ablation": ablation_identity(cfg.ablation, cfg.mean_reference),  # None: zero, as in folders from before it
        "refine_dtype": refine_dtype if refine_dtype != dtype else None,  # None as in folders from before it
        "refine_search": None if cfg.resolved_refine_search == "swaps" else cfg.resolved_refine_search,  # None: swaps, as before
        "prior_score": None if cfg.prior_score == "estimate" else cfg.prior_score,  # None: |estimate| order, as in folders from before it
        "group_price": None if cfg.group_price == "full" else cfg.group_price,  # None: full, as in folders from before it
        # None: every control of every single, as in folders from before it (and wherever nothing is screened, or no
        # estimates set the screen's thresholds before a knockout: methods without a gradient attribution)
        "single_controls": cfg.single_controls if cfg.controls_until_excluded and get_method(cfg).attribution else None,
        # None: every control of every set, as in folders from before it (and wherever there are no controls to stop)
        "set_controls": cfg.set_controls if cfg.sets_until_beyond else None,
        "seed": cfg.seed,
        "method": cfg.method,
        "dtype": dtype,
        "autocast": cfg.autocast,  # None: off, as in folders from before it
        # "float32" where autocast runs the attention kernel in float32 (a CPU since round 41); None: autocast's dtype,
        # as in folders from before it (an autocast folder of rounds 39-40 is not resumed by a CPU run: its knockouts differ)
        "autocast_attention": autocast_attention,
        "design": cfg.design,
        "heads_per_mask": k,
        "top_k": cfg.top_k,
        "masks": cfg.masks,
        "refine": refine_budget(cfg),
        "tolerance": cfg.tolerance,
        "metric": cfg.metric,
        "solver": cfg.solver,
        "alpha": cfg.alpha,
        "doc_ids": {t: [int(d) for d in p.doc_ids] for t, p in probes.items()},
    }
