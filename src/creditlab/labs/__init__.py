"""The labs: each reproduces one failure of agentic RL training and its correction on a CPU.

One module per lab, each defining ``LAB`` (an object implementing
:class:`creditlab.lab.protocol.Lab`), listed once in :data:`BUILTIN` (name -> module), imported only
when asked for (:func:`get_lab`), so importing this package or :mod:`creditlab.lab.protocol` imports no
lab. Labs of other packages register through the entry-point group :data:`ENTRY_POINT_GROUP`
(``[project.entry-points."creditlab.labs"] coin = "mypkg.coin:LAB"``) or, in a session, with
:func:`register_lab`; :func:`lab_names` and :func:`get_lab` read all three, and the CLI builds one
``creditlab lab <name>`` sub-command per name.

>>> lab_names()[:5]
('coverage', 'fork', 'toolshop', 'mismatch', 'granularity')
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from creditlab.core.registry import Registry
from creditlab.errors import ConfigError

__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "get_lab", "lab_names", "register_lab", "unregister_lab"]

#: The built-in labs: CLI name -> module defining ``LAB``.
BUILTIN: dict[str, str] = {
    "coverage": "creditlab.labs.coverage",
    "fork": "creditlab.labs.fork",
    "toolshop": "creditlab.labs.toolshop",
    "mismatch": "creditlab.labs.mismatch",
    "granularity": "creditlab.labs.granularity",
}
#: Entry-point group of labs from other packages (value: ``"module:LAB"`` or a module defining ``LAB``).
ENTRY_POINT_GROUP = "creditlab.labs"
_MEMBERS = ("name", "summary", "config_type", "describe", "cells", "tables", "plots", "interpret")
_REGISTERED: Registry[Any] = Registry("lab")  # the session registrations


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def lab_names() -> tuple[str, ...]:
    """Every lab name: the built-ins in table order, then entry points, then session registrations."""
    names = dict.fromkeys(BUILTIN)
    names.update(dict.fromkeys(_entry_points()))
    names.update(dict.fromkeys(_REGISTERED))
    return tuple(names)


def _checked(lab: Any, where: str) -> Any:
    missing = [m for m in _MEMBERS if not hasattr(lab, m)]
    if missing:
        raise ConfigError("lab", f"{where} does not implement the lab protocol: missing {missing}")
    return lab


def register_lab(lab: Any) -> Any:
    """Register ``lab`` for this session under ``lab.name``. Registering the same object again is a
    no-op; another object under a taken name (a built-in, an entry point or a registration) raises
    :class:`ConfigError`, as the other registries of creditlab do."""
    _checked(lab, f"lab {getattr(lab, 'name', lab)!r}")
    if lab.name not in _REGISTERED and (lab.name in BUILTIN or lab.name in _entry_points()):
        raise ConfigError("lab", f"{lab.name!r} is already registered to {BUILTIN.get(lab.name, 'an entry point')}")
    return _REGISTERED.register(lab.name, lab)


def unregister_lab(name: str) -> Any:
    """Remove a session registration (tests, notebooks) and return it."""
    if name not in _REGISTERED:
        raise ConfigError("lab", f"{name!r} is not a session registration; registered: {', '.join(_REGISTERED)}")
    return _REGISTERED.unregister(name)


def get_lab(name: str) -> Any:
    """The lab called ``name`` (importing its module on first use); :class:`ConfigError` listing every
    lab name otherwise."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in BUILTIN:
        return _checked(importlib.import_module(BUILTIN[name]).LAB, BUILTIN[name])
    ep = _entry_points().get(name)
    if ep is None:
        raise ConfigError("lab", f"unknown lab {name!r}; valid: {', '.join(lab_names())}")
    obj = ep.load()
    return _checked(getattr(obj, "LAB", obj), f"entry point {name} = {ep.value}")
