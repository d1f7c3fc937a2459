"""Registries: name -> object, with one message for a name that is not there.

Every "choose one of these by name" in capsense (localization methods, mask designs, solvers,
export formats, compression methods, low-rank factorizers, allocation units, ...) is a
:class:`Registry`. Entries are added explicitly (:meth:`Registry.register`, usable as a
decorator) or lazily as ``"module:attribute"`` (:meth:`Registry.register_lazy`), so a module
that is heavy to import (torch) is imported only when its entry is used, while its *name* is
known at once: the CLI builds ``--help`` lists and rejects a bad name before any heavy import.

An unknown name raises the registry's error class (a
:class:`~capsense.errors.CapsenseError`) with one message, ``unknown `param` 'x': valid
<plural> are a, b, c``; ``param`` is the parameter name, which the CLI shows as its flag.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from capsense.errors import CapsenseError

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Names in registration order, each an object or a lazy ``"module:attribute"`` reference.

    ``param``: the parameter the name is given as (``solver``); ``plural``: how the message
    calls the entries (``solvers``); ``error``: the :class:`CapsenseError` subclass raised.
    """

    def __init__(self, param: str, plural: str, error: type[CapsenseError] = CapsenseError) -> None:
        self.param = param
        self.plural = plural
        self.error = error
        self._entries: dict[str, Any] = {}
        self._lazy: set[str] = set()

    def register(self, name: str, obj: T | None = None) -> Any:
        """Add ``obj`` under ``name`` (returns it); without ``obj``, a decorator that does."""
        if obj is None:
            return lambda o: self.register(name, o)
        self._entries[name] = obj
        self._lazy.discard(name)
        return obj

    def register_lazy(self, name: str, target: str) -> None:
        """Add ``name`` as ``"module:attribute"``, imported the first time the entry is used."""
        self._entries[name] = target
        self._lazy.add(name)

    def __delitem__(self, name: str) -> None:
        """Remove ``name`` (tests, plugins that replace an entry)."""
        del self._entries[name]
        self._lazy.discard(name)

    def check(self, name: str) -> str:
        """``name`` if it is registered (nothing is imported), else the registry's error."""
        if name not in self._entries:
            raise self.error(self.unknown_message(name))
        return name

    def unknown_message(self, name: str) -> str:
        return f"unknown `{self.param}` {name!r}: valid {self.plural} are {', '.join(self._entries)}"

    def __getitem__(self, name: str) -> T:
        self.check(name)
        if name in self._lazy:
            module, _, attr = self._entries[name].partition(":")
            self.register(name, getattr(importlib.import_module(module), attr))
        return self._entries[name]

    def get(self, name: str, default: Any = None) -> Any:
        """The entry, or ``default`` when ``name`` is not registered."""
        return self[name] if name in self._entries else default

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        """The registered names, in order (nothing is imported)."""
        return list(self._entries)

    def help(self, describe: Callable[[str], str] | None = None) -> str:
        """``a, b, c`` (or each name with ``describe(name)``), for ``--help`` texts."""
        return ", ".join(f"{n} ({describe(n)})" if describe else n for n in self._entries)
