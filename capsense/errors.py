"""capsense's user-facing errors: one base class and the few kinds a caller tells apart.

Library code raises :class:`CapsenseError` for bad input (a head out of range, a malformed
spec, an unknown task or architecture, an option that does not apply, ...): its message says
what was wrong and what is valid, in terms of parameters in backticks (```top_k```), not
command-line flags. The CLI catches this class, and only this class, once (``capsense.cli``),
maps the parameters to its flags and prints the message; any other exception is a bug and
keeps its traceback.

The subclasses below are the ones some caller catches by type (in capsense, or a Python user
who retries, skips or falls back), each for a reason given in its docstring. There used to be
37 classes, one per module; the ones nobody ever caught (``LocateError``, ``ExportError``,
``GridError``, ...) are now plain :class:`CapsenseError`. Add a class here only together with
the code that catches it.

It is not a ``ValueError``: an ``except ValueError`` around library code would otherwise turn
real bugs (a ``ValueError`` from torch or numpy) into a tidy one-line ``Error:``. Argument checks
of the math (``capsense.compress.prune/quantize/lowrank``) raise it too, since their arguments
come from users; a plain ``ValueError`` from them means a caller broke a precondition.
"""

from __future__ import annotations


class CapsenseError(Exception):
    """Bad input to capsense: the message names what was wrong and what is valid."""


class HeadSpecError(CapsenseError):
    """A head spec, list or heads file that cannot be parsed or does not fit the model
    (compression re-raises it as a :class:`BudgetError` about the heads to protect)."""


class BudgetError(CapsenseError):
    """A compression request that cannot be used as given: a setting, a budget file, target kinds
    or heads to protect (the engine prefixes it with the matrix it concerns). ``TargetError`` and
    ``ProtectionError`` are aliases kept for one release."""


class FitError(CapsenseError):
    """A grid's measurements cannot answer: too few or unusable points for a fit, or no setting
    the budget allows (the analysis skips that group, a sweep over budgets skips that budget)."""


class UnknownTaskError(CapsenseError):
    """A task name that neither capsense nor lm-eval (nor an ``include_path`` folder) defines
    (calibration then reads the name as text only if it cannot be a misspelt task)."""


class UnknownModelError(CapsenseError, OSError):
    """A model that cannot be loaded from here: no embedded model, local folder or reachable Hub
    model of that name, an embedded model whose package is not installed, or a ``.gguf`` file that
    is missing, unreadable or of an unsupported architecture. An ``OSError``, as transformers'
    own "not found" is."""


class OutputExistsError(CapsenseError, FileExistsError):
    """The output folder exists and is not empty, and overwriting was not asked for."""


class RunStoreError(CapsenseError):
    """The run folder cannot hold this run: it holds another run (the message says which setting
    resumes it) or a damaged log. Rerunning cannot help; another ``out`` can."""


class RunFolderBusyError(CapsenseError):
    """Another process is writing this run folder: transient, a caller may wait and retry."""


class HubError(CapsenseError, RuntimeError):
    """A push that cannot be done (offline, no token, bad repo id, Hub error); the token is
    scrubbed from the message."""
