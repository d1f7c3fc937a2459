"""capsense: find the attention heads a capability depends on, prove it, ship the edited model."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Head", "HeadSet", "__version__"]


def __getattr__(name: str):
    # Lazy, so that the lm-eval start-up hook can import capsense.evaluation.lm_eval_hook cheaply.
    if name in ("Head", "HeadSet"):
        from capsense.core import heads

        return getattr(heads, name)
    raise AttributeError(f"module 'capsense' has no attribute {name!r}")
