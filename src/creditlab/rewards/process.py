"""Turn-level process rewards for tool-use trajectories, scored apart from the outcome verifier.

:func:`evidence_scores` is the *evidence-gathering* process reward: it sees only what the agent
saw (the instruction's values and each turn's call and returned values), never the task's goal or
the store, so it is a separate scorer from the terminal verifier. It is a plausible proxy and a
hackable one on purpose:

* a read that returned a value the episode had not seen yet scores ``1`` (it gathered evidence);
* a read that returned only values already seen scores ``repeat`` (default ``0.25``: a repeated
  read still scores a little);
* a failed or malformed call scores ``0``, and so does a write (it gathers no evidence).

Early in training this teaches the chain's reads (each correct read brings new ids). Late in
training it pays for reading instead of finishing: reads are always available, and every turn
spent on a read instead of the write scores more. Its scores lie in ``[0, 1]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from creditlab.errors import ConfigError

__all__ = ["evidence_scores"]


def _get(turn: Any, name: str) -> Any:
    return turn.get(name) if isinstance(turn, dict) else getattr(turn, name)


def evidence_scores(turns: Sequence[Any], given: Iterable[object] = (), *, repeat: float = 0.25) -> list[float]:
    """Evidence score of each turn of one trajectory (see the module docstring).

    Args:
        turns: the trajectory's turns in order, each a mapping or an object with ``returned`` (the
            values the call returned), ``is_write`` and ``ok`` (a mapping without ``ok`` counts as
            ok when it returned something).
        given: values the instruction already contains (they are not new evidence).
        repeat: score of a successful read that returned nothing new, in ``[0, 1]``.

    >>> class T:  # a stand-in for toolshop's TurnRecord
    ...     def __init__(self, returned, ok=True, is_write=False):
    ...         self.returned, self.ok, self.is_write = returned, ok, is_write
    >>> evidence_scores([T([7, 9]), T([7]), T([], ok=False), T([3]), T([], is_write=True)], given=["9"])
    [1.0, 0.25, 0.0, 1.0, 0.0]
    """
    if not 0.0 <= float(repeat) <= 1.0:
        raise ConfigError("repeat", f"must be in [0, 1], got {repeat}")
    seen = {str(v) for v in given}
    out = []
    for turn in turns:
        returned = [str(v) for v in (_get(turn, "returned") or [])]
        ok = _get(turn, "ok") if not isinstance(turn, dict) or "ok" in turn else bool(returned)
        if not ok or _get(turn, "is_write"):
            out.append(0.0)
            continue
        new = [v for v in returned if v not in seen]
        out.append(1.0 if new else float(repeat))
        seen.update(returned)
    return out
