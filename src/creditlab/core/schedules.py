"""Schedules ``lambda(k)`` of the update index ``k`` (e.g. the PRM mixing weight).

A schedule is a small frozen dataclass with ``__call__(k) -> float``: picklable (it crosses
process pools) and printable (it is logged with the config). Build one with :func:`constant` or
:func:`decay`.

Every kind is registered by name in :data:`SCHEDULES` (``constant``, ``decay``), and a
:class:`Schedule` is the one settings record that names a kind with its parameters: the trainer
integrations build it from their config keys (``prm_schedule``, ``prm_lambda``, ``prm_start``,
``prm_end``, ``prm_power``) and the labs from their own config, so both evaluate the same function.

>>> Schedule("decay", l0=1.0, start=20, end=30, power=3)(25)
0.125
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from creditlab.core._checks import check_scalar
from creditlab.core.registry import Registry
from creditlab.errors import ConfigError

__all__ = ["SCHEDULES", "Constant", "Decay", "Schedule", "constant", "decay", "get_schedule"]


def _finite(name: str, value: float) -> float:
    v = check_scalar(name, value)
    if not math.isfinite(v):
        raise ConfigError(name, f"must be finite, got {value!r}")
    return v


def _step(k: float) -> float:
    v = check_scalar("k", k, low=0.0)
    if not math.isfinite(v):
        raise ConfigError("k", f"must be finite, got {k!r}")
    return v


@dataclass(frozen=True)
class Constant:
    """``lambda(k) = l0`` for every update ``k``."""

    l0: float

    def __call__(self, k: float) -> float:
        _step(k)
        return self.l0


@dataclass(frozen=True)
class Decay:
    """Polynomial decay between two updates.

    ``lambda(k) = l0`` for ``k < start``; ``l0 * (1 - s)^power`` with ``s = (k - start)/(end -
    start)`` for ``start <= k < end``; 0 for ``k >= end``.
    """

    l0: float
    start: float
    end: float
    power: float

    def __call__(self, k: float) -> float:
        k = _step(k)
        if k < self.start:
            return self.l0
        if k >= self.end:
            return 0.0
        s = (k - self.start) / (self.end - self.start)
        return self.l0 * (1.0 - s) ** self.power


def constant(l0: float) -> Constant:
    """A constant schedule.

    >>> constant(0.3)(0), constant(0.3)(1000)
    (0.3, 0.3)
    """
    return Constant(_finite("l0", l0))


def decay(l0: float, start: float = 20, end: float = 30, power: float = 3) -> Decay:
    """``l0`` until ``start``, then ``l0 (1 - s)^power`` down to 0 at ``end`` (docs/design.md section 6).

    >>> lam = decay(1.0, start=20, end=30, power=3)
    >>> lam(0), lam(20), lam(25), lam(30), lam(99)
    (1.0, 1.0, 0.125, 0.0, 0.0)
    """
    l0 = _finite("l0", l0)
    start = _finite("start", start)
    end = _finite("end", end)
    power = _finite("power", power)
    if start < 0:
        raise ConfigError("start", f"must be >= 0, got {start}")
    if end < start:
        raise ConfigError("end", f"must be >= start ({start}), got {end}")
    if power <= 0:
        raise ConfigError("power", f"must be > 0, got {power}")
    return Decay(l0, start, end, power)


#: Every schedule kind by name: ``name -> factory(l0, start, end, power) -> schedule``.
SCHEDULES: Registry = Registry("schedule")


def _constant(l0: float, start: float, end: float, power: float) -> Constant:
    """``constant`` in the factory shape of :data:`SCHEDULES` (it has no start, end or power)."""
    return constant(l0)


SCHEDULES.register("constant", _constant)
SCHEDULES.register("decay", decay)


def get_schedule(name: str):
    """The factory of the schedule kind ``name``; :class:`ConfigError` listing the kinds otherwise."""
    return SCHEDULES.get(name)


@dataclass(frozen=True)
class Schedule:
    """A schedule by kind and parameters: the settings record every caller of a scheduled weight holds.

    ``kind`` names an entry of :data:`SCHEDULES`; ``l0`` is the weight (``constant``'s value, the start
    of ``decay``); ``start``, ``end``, ``power`` are :func:`decay`'s (unused by ``constant``). The
    parameters are checked when the record is made (:class:`ConfigError` naming the parameter).

    >>> Schedule("constant", l0=0.3)(1000)
    0.3
    """

    kind: str = "constant"
    l0: float = 0.5
    start: float = 20
    end: float = 30
    power: float = 3

    def __post_init__(self) -> None:
        self.build()

    def build(self) -> Constant | Decay:
        """The schedule itself (:class:`Constant` or :class:`Decay`)."""
        return get_schedule(self.kind)(self.l0, self.start, self.end, self.power)

    def __call__(self, k: float) -> float:
        return self.build()(k)
