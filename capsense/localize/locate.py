"""Where ``locate`` used to live; it is now split by concept (import from those modules):

config (:class:`LocateConfig`, :class:`LocateError`), evaluator (masks -> scores -> run
folder), fit (scores -> ranking, :class:`LocateResult`), methods (the method registry),
run (:func:`locate`), outputs (heads.json, scores.csv, report.md, heatmap).

Kept so that ``from capsense.localize.locate import locate, LocateConfig, LocateError``
still works while the other branches move to the new paths.
"""

from capsense.localize.config import LocateConfig, LocateError
from capsense.localize.run import locate

__all__ = ["LocateConfig", "LocateError", "locate"]
