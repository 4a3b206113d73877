"""Name -> object registries: the one helper behind creditlab's registries of arms, geometries,
checks and labs.

A :class:`Registry` is a read-only :class:`~collections.abc.Mapping` in registration order (index it,
test membership, iterate, join its names); it changes only through :meth:`Registry.register`,
:meth:`Registry.unregister` and :meth:`Registry.registered`, which treat every family alike:
registering the same object again is a no-op, another object under a taken name raises
:class:`~creditlab.errors.ConfigError` naming where the name is registered, and an unknown name
raises one listing every registered name.

>>> import math
>>> units = Registry("unit")
>>> units.register("sqrt", math.sqrt) is math.sqrt
True
>>> units.register("sqrt", math.sqrt) is math.sqrt  # the same object again: a no-op
True
>>> units.register("sqrt", math.floor)
Traceback (most recent call last):
...
creditlab.errors.ConfigError: unit: 'sqrt' is already registered to math.sqrt
>>> units.get("cbrt")
Traceback (most recent call last):
...
creditlab.errors.ConfigError: unit: unknown 'cbrt'; valid: sqrt
>>> with units.registered("floor", math.floor):
...     ", ".join(units), units["floor"](2.5)
('sqrt, floor', 2)
>>> "floor" in units, units.unregister("sqrt") is math.sqrt, len(units)
(False, True, 0)

The helpers the registries of functions share: :func:`check_name` (a name a trainer config can
spell) and :func:`signature_of` / :func:`keyword_parameters` (what a registered function declares).

Pure Python: importing it imports no tensor library.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from creditlab.errors import ConfigError

__all__ = ["Registry", "check_name", "keyword_parameters", "signature_of"]

T = TypeVar("T")
_MISSING: Any = object()


_NAME = re.compile(r"^[A-Za-z0-9_]+$")


def check_name(name: object, family: str, what: str) -> str:
    """``name`` if it is letters, digits and ``_`` (it becomes part of a trainer's config keys, e.g.
    verl's ``creditlab_<name>``); else :class:`~creditlab.errors.ConfigError` ``family: <what> names
    are ...``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(family, f"{what} names are letters, digits and '_', got {name!r}")
    return name


def signature_of(fn: Callable[..., Any], family: str) -> inspect.Signature:
    """``inspect.signature(fn)``; :class:`~creditlab.errors.ConfigError` when it has none."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        raise ConfigError(family, f"{fn!r} has no inspectable signature") from None


def keyword_parameters(fn: Callable[..., Any], sig: inspect.Signature, params: Sequence[inspect.Parameter],
                       family: str, what: str) -> tuple[str, ...]:
    """The names of ``params``, the parameters a trainer config may set (``fn``'s after its fixed
    ones), once ``fn`` declares every parameter by name (no ``*args`` / ``**kwargs``: configs are
    validated against them) and each of ``params`` has a default; else
    :class:`~creditlab.errors.ConfigError` naming ``fn``."""
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
        raise ConfigError(family, f"{fn.__name__}{sig}: declare the {what}'s parameters by name (no *args / "
                                  "**kwargs): trainer configs are validated against them")
    missing = [p.name for p in params if p.default is p.empty]
    if missing:
        raise ConfigError(family, f"{fn.__name__}: parameter(s) {missing} need a default")
    return tuple(p.name for p in params)


def _where(obj: Any) -> str:
    """``module.qualname`` of a function or class, else of the object's class."""
    named = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(named, '__module__', '?')}.{named.__qualname__}"


class Registry(Mapping[str, T], Generic[T]):
    """Objects of one family by name, in registration order (a read-only mapping).

    Args:
        family: the name of the family in errors (``"correction"``, ``"geometry"``, ``"check"``,
            ``"lab"``): it is the :attr:`~creditlab.errors.ConfigError.parameter` of every error.
        key: what identifies a registered object when a name is registered again and what the clash
            error names (default: the object itself; e.g. the function of a record).
        validate: called with an object before it is stored under a free name (not on the no-op of
            registering the same object again); raises to refuse it.
    """

    def __init__(self, family: str, *, key: Callable[[T], Any] | None = None,
                 validate: Callable[[T], Any] | None = None) -> None:
        self.family = family
        self._items: dict[str, T] = {}
        self._key = key
        self._validate = validate

    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._items

    def __repr__(self) -> str:
        return f"Registry({self.family!r}: {', '.join(self._items)})"

    def _identity(self, obj: T) -> Any:
        return obj if self._key is None else self._key(obj)

    def register(self, name: str, obj: T) -> T:
        """Store ``obj`` under ``name`` and return what is registered there.

        The same object again (by ``key``) is a no-op; another object under a taken name raises
        :class:`~creditlab.errors.ConfigError` naming the ``module.qualname`` it is registered to.
        """
        taken = self._items.get(name, _MISSING)
        if taken is not _MISSING:
            held = self._identity(taken)
            if held is self._identity(obj):
                return taken
            raise ConfigError(self.family, f"{name!r} is already registered to {_where(held)}")
        if self._validate is not None:
            self._validate(obj)
        self._items[name] = obj
        return obj

    def get(self, name: str, default: Any = _MISSING) -> Any:
        """The object registered as ``name``; for an unknown name ``default`` when one is given, else
        :class:`~creditlab.errors.ConfigError` listing every registered name."""
        if name in self:
            return self._items[name]
        if default is not _MISSING:
            return default
        raise ConfigError(self.family, f"unknown {name!r}; valid: {', '.join(self._items)}")

    def unregister(self, name: str) -> T:
        """Remove ``name`` and return what was registered (an unknown name raises as :meth:`get`)."""
        obj = self.get(name)
        del self._items[name]
        return obj

    @contextlib.contextmanager
    def registered(self, name: str, obj: T) -> Iterator[T]:
        """``with registry.registered(name, obj):`` registers ``obj`` for the block, then removes it
        (unless the block already replaced or removed it)."""
        self.register(name, obj)
        try:
            yield obj
        finally:
            if self._items.get(name, _MISSING) is obj:
                del self._items[name]
