"""The localization methods by name (``--method``), declared here without importing them.

Each entry is a :class:`~capsense.localize.methods.Method` in the module that defines it,
imported the first time it is used; so ``capsense locate --help`` lists them and a bad
``--method`` is refused before torch loads, and ``prior-guided`` is registered here, not as
a side effect of importing :mod:`capsense.localize.guided`. A new method is one line here
(or :func:`capsense.localize.methods.register` for one defined outside capsense).
"""

from __future__ import annotations

from capsense.core.registry import Registry
from capsense.errors import CapsenseError

METHODS: Registry = Registry("method", "methods", CapsenseError)
METHODS.register_lazy("cs", "capsense.localize.methods:CS")
METHODS.register_lazy("exhaustive", "capsense.localize.methods:EXHAUSTIVE")
METHODS.register_lazy("greedy", "capsense.localize.methods:GREEDY")
METHODS.register_lazy("thompson", "capsense.localize.methods:THOMPSON")
METHODS.register_lazy("attribution", "capsense.localize.guided:ATTRIBUTION_METHOD")
METHODS.register_lazy("prior-guided", "capsense.localize.guided:PRIOR_GUIDED")
