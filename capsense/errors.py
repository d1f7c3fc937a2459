"""The one base class of capsense's user-facing errors.

Library code raises a subclass of :class:`CapsenseError` for bad input (a head out of range, a
malformed spec, an unknown task or architecture, an existing output folder, ...): its message
says what was wrong and what is valid, in terms of parameters, not command-line flags. The CLI
catches this class, and only this class, once (``capsense.cli``) and prints the message; any
other exception is a bug and keeps its traceback.

It is not a ``ValueError``: an ``except ValueError`` around library code would otherwise turn
real bugs (a ``ValueError`` from torch or numpy) into a tidy one-line ``Error:``. Argument checks
of the math (``capsense.compress.prune/quantize/lowrank``) raise it too, since their arguments
come from users; a plain ``ValueError`` from them means a caller broke a precondition.
"""

from __future__ import annotations


class CapsenseError(Exception):
    """Bad input to capsense: the message names what was wrong and what is valid."""
