"""Which training steps of a run to diagnose: ``creditlab diagnose --steps``.

A selection is one or more items separated by commas, each over the ``step`` numbers the dump holds
(verl's ``global_steps``, which start at 1; a lab's updates, from 0):

* ``N``: step ``N``;
* ``A:B``: the steps ``A <= step < B`` (the end excluded, as in a Python slice); ``A:`` every step from
  ``A``, ``:B`` every step before ``B``;
* ``A:B:K``: every ``K``-th of them, ``A, A + K, ...`` (``::10``: the steps divisible by 10);
* ``every:K``: the steps divisible by ``K``, as verl's ``save_freq`` and ``test_freq`` count them (the same as
  ``::K``).

``0:100:10,250:260`` reads steps 0, 10, ..., 90 and 250-259. Rows of other steps are not validated and not
read past their ``step`` (a verl ``rollout_data_dir`` file named after its step is not opened past its first
line), so a subset of a huge run reads in a fraction of the time.

>>> sel = parse_steps("0:100:10,250:260")
>>> [s for s in (0, 5, 10, 99, 250, 259, 260) if s in sel]
[0, 10, 250, 259]
>>> describe_steps([0, 10, 20, 30, 40])
'0, 10, ..., 40 (every 10)'
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from creditlab.errors import ConfigError

__all__ = ["StepSelection", "describe_steps", "parse_steps"]

_INT = r"-?\d+"
_ITEM = re.compile(rf"^(?:(?P<one>{_INT})|every:(?P<every>\d+)|(?P<a>{_INT})?:(?P<b>{_INT})?(?::(?P<k>\d+))?)$")


@dataclass(frozen=True)
class StepSelection:
    """A parsed ``--steps``: ``text`` as given, ``ranges`` the items as ``(start, stop, stride)`` (None: open)."""

    text: str
    ranges: tuple[tuple[int | None, int | None, int], ...]

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int | np.integer) or isinstance(step, bool):
            return False
        s = int(step)
        for a, b, k in self.ranges:
            if (a is None or s >= a) and (b is None or s < b) and (s - (a or 0)) % k == 0:
                return True
        return False

    def mask(self, steps: np.ndarray) -> np.ndarray:
        """(N,) which of the integer ``steps`` are selected."""
        steps = np.asarray(steps, dtype=np.int64)
        out = np.zeros(steps.shape, dtype=bool)
        for a, b, k in self.ranges:
            sel = (steps - (a or 0)) % k == 0
            if a is not None:
                sel &= steps >= a
            if b is not None:
                sel &= steps < b
            out |= sel
        return out


def parse_steps(text: str) -> StepSelection:
    """The :class:`StepSelection` of ``text`` (module docstring); a :class:`ConfigError` naming ``--steps``
    and the item otherwise."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError("--steps", f"expected steps such as 0:100:10, every:10 or 5,7; got {text!r}")
    ranges = []
    for item in text.replace(" ", "").split(","):
        m = _ITEM.match(item)
        if m is None:
            raise ConfigError("--steps", f"{item!r} is not a step selection: use N, START:STOP (STOP excluded), "
                                         "START:STOP:STEP (every STEP-th), every:K (the steps divisible by K), or "
                                         "several joined by commas")
        if m["one"] is not None:
            ranges.append((int(m["one"]), int(m["one"]) + 1, 1))
            continue
        if m["every"] is not None:
            a, b, k = None, None, int(m["every"])
        else:
            a = None if m["a"] is None else int(m["a"])
            b = None if m["b"] is None else int(m["b"])
            k = 1 if m["k"] is None else int(m["k"])
        if k < 1:
            raise ConfigError("--steps", f"{item!r}: the stride must be >= 1")
        if a is not None and b is not None and b <= a:
            raise ConfigError("--steps", f"{item!r} selects no step: START:STOP reads START <= step < STOP (STOP "
                                         "excluded)")
        ranges.append((a, b, k))
    return StepSelection(text, tuple(ranges))


def describe_steps(steps: Iterable[int], limit: int = 8) -> str:
    """A short list of sorted step numbers: ``0-15``, ``0, 10, ..., 90 (every 10)``, or the first ones."""
    s = sorted({int(x) for x in steps})
    if not s:
        return "none"
    if len(s) == 1:
        return str(s[0])
    d = np.diff(s)
    if (d == 1).all():
        return f"{s[0]}-{s[-1]}"
    if (d == d[0]).all():
        if len(s) <= 3:
            return ", ".join(map(str, s))
        return f"{s[0]}, {s[1]}, ..., {s[-1]} (every {int(d[0])})"
    head = ", ".join(map(str, s[:limit]))
    return head + (f" and {len(s) - limit} more (up to {s[-1]})" if len(s) > limit else "")
