"""Diagnostics of credit assignment: verifier density, chain coverage, mixing, learning curves.

Formulas (docs/design.md sections 4 and 5):

* verifier density ``V_d = k / C``: ``k`` steps the verifier can judge independently, ``C`` the
  length of the hard-prerequisite chain.
* ``P_cover = comb(k, C) / comb(T, C)`` if ``k >= C`` else 0: probability that an update whose
  credit lands on ``k`` of ``T`` steps (chosen at random) covers all ``C`` causal steps.
* ``E[L]/C = (1/C) sum_{j=1..C} q^j = q (1 - q^C) / (C (1 - q))``: expected fraction of a chain
  that can be opened when each causal step is independently visible with probability ``q``
  (the chain opens up to the first invisible step).
* turn mixing score ``2 min(n_pos, n_neg) / (n_pos + n_neg)``; excluded when no turn is judged.
* chain length by dataflow: an edge from a read call to a later call whose arguments contain a
  value that the read returned and the instruction did not contain; ``C`` is the number of calls
  on the longest path ending at the final write.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from creditlab.core._checks import any_true, check_scalar, check_tensor
from creditlab.errors import InputError

__all__ = [
    "aulc",
    "chain_length",
    "concentration",
    "expected_open_fraction",
    "mixing_score",
    "p_cover",
    "rollback",
    "verifier_density",
]


def _as_tensor(x, dtype=torch.float64, like: tuple = ()) -> torch.Tensor:
    """``x`` as a tensor; a Python value goes on the device of the first tensor in ``like`` (else CPU)."""
    if isinstance(x, torch.Tensor):
        return x
    device = next((v.device for v in like if isinstance(v, torch.Tensor)), None)
    return torch.as_tensor(x, dtype=dtype, device=device)


def p_cover(T, C, k) -> torch.Tensor:
    """``comb(k, C) / comb(T, C)`` if ``k >= C`` else 0 (broadcast over tensors).

    >>> round(float(p_cover(12, 3, 3)), 6) == round(1 / 220, 6)
    True
    >>> float(p_cover(12, 4, 3))
    0.0
    """
    args = (T, C, k)
    T, C, k = (_as_tensor(v, like=args).to(torch.float64) for v in args)
    if any_true(C < 0) or any_true(k < 0):
        raise InputError("p_cover: C and k must be >= 0")
    if any_true(C > T):
        raise InputError("p_cover: C must be <= T")
    if any_true(k > T):
        raise InputError("p_cover: k must be <= T")

    def lcomb(n, r):
        return torch.lgamma(n + 1) - torch.lgamma(r + 1) - torch.lgamma(n - r + 1)

    ok = k >= C
    val = torch.exp(lcomb(k, torch.minimum(C, k)) - lcomb(T, C))
    return torch.where(ok, val, torch.zeros_like(val))


def expected_open_fraction(q, C) -> torch.Tensor:
    """``(1/C) sum_{j=1..C} q^j``: expected opened fraction of a ``C``-step chain (``q`` in [0, 1]).

    >>> float(expected_open_fraction(1.0, 5))
    1.0
    >>> round(float(expected_open_fraction(0.5, 2)), 4)  # (0.5 + 0.25) / 2
    0.375
    """
    q, C = _as_tensor(q, like=(q, C)), _as_tensor(C, like=(q, C))
    if any_true((q < 0) | (q > 1)):
        raise InputError("expected_open_fraction: q must be in [0, 1]")
    if any_true(C < 1):
        raise InputError("expected_open_fraction: C must be >= 1")
    # closed form q (1 - q^C) / (C (1 - q)), with its limit 1 at q = 1
    near_one = (1 - q).abs() < 1e-12
    safe_q = torch.where(near_one, torch.zeros_like(q), q)
    closed = safe_q * (1 - safe_q**C) / (C * (1 - safe_q))
    return torch.where(near_one, torch.ones_like(closed), closed)


def verifier_density(k, C) -> torch.Tensor:
    """``V_d = k / C`` (``C >= 1``)."""
    k, C = _as_tensor(k, like=(k, C)), _as_tensor(C, like=(k, C))
    if any_true(C < 1):
        raise InputError("verifier_density: C must be >= 1")
    if any_true(k < 0):
        raise InputError("verifier_density: k must be >= 0")
    return k / C


def mixing_score(n_pos, n_neg) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn mixing score per rollout, ``2 min(n_pos, n_neg) / (n_pos + n_neg)``.

    Returns ``(score, included)``: rollouts with no judged turn get score 0 and
    ``included = False`` (never NaN); average ``score[included]``.

    >>> s, inc = mixing_score(torch.tensor([2, 3, 0]), torch.tensor([2, 0, 0]))
    >>> s.tolist(), inc.tolist()
    ([1.0, 0.0, 0.0], [True, True, False])
    """
    n_pos, n_neg = _as_tensor(n_pos, like=(n_pos, n_neg)), _as_tensor(n_neg, like=(n_pos, n_neg))
    if n_pos.shape != n_neg.shape:
        raise InputError(f"mixing_score: n_pos shape {tuple(n_pos.shape)} != n_neg shape {tuple(n_neg.shape)}")
    if any_true(n_pos < 0) or any_true(n_neg < 0):
        raise InputError("mixing_score: counts must be >= 0")
    total = n_pos + n_neg
    included = total > 0
    score = torch.where(included, 2 * torch.minimum(n_pos, n_neg) / total.clamp_min(1), torch.zeros_like(total))
    return score.to(torch.float64), included


def aulc(scores: torch.Tensor) -> torch.Tensor:
    """Area under the learning curve normalised by the number of updates: the mean of the score
    over updates (last dimension). ``scores``: ``(..., U)``."""
    scores = _as_tensor(scores)
    check_tensor("scores", scores, floating=True, finite=True)
    if scores.shape[-1] == 0:
        raise InputError("scores: needs at least one update")
    return scores.mean(-1)


def rollback(scores: torch.Tensor) -> torch.Tensor:
    """Best score during training minus final score, over the last dimension (>= 0)."""
    scores = _as_tensor(scores)
    check_tensor("scores", scores, floating=True, finite=True)
    if scores.shape[-1] == 0:
        raise InputError("scores: needs at least one update")
    return scores.max(-1).values - scores[..., -1]


def concentration(values: torch.Tensor, top_frac: float) -> tuple[float, float]:
    """Share of ``sum(values)`` carried by the top ``top_frac`` of entries (at least one entry).

    Returns ``(share_of_total, share_of_entries)``. ``values`` must be non-negative (e.g. a
    per-turn KL). An all-zero input has share 0.
    """
    values = _as_tensor(values).flatten().to(torch.float64)
    check_tensor("values", values, floating=True, finite=True)
    check_scalar("top_frac", top_frac, low=0.0, high=1.0, low_open=True)
    if values.numel() == 0:
        raise InputError("values: empty")
    if bool((values < 0).any()):
        raise InputError("values: must be non-negative")
    n_top = max(1, math.ceil(top_frac * values.numel()))
    total = float(values.sum())
    top = float(values.sort(descending=True).values[:n_top].sum())
    return (top / total if total > 0 else 0.0, n_top / values.numel())


def _get(call: Any, field: str) -> Any:
    if isinstance(call, Mapping):
        if field not in call:
            raise InputError(f"chain_length: call is missing field {field!r}")
        return call[field]
    if not hasattr(call, field):
        raise InputError(f"chain_length: call is missing field {field!r}")
    return getattr(call, field)


def _atoms(x: Any) -> set[str]:
    """All scalar values inside a nested structure, as strings (so 7 and "7" match)."""
    out: set[str] = set()
    if isinstance(x, Mapping):
        for v in x.values():
            out |= _atoms(v)
    elif isinstance(x, list | tuple | set | frozenset):
        for v in x:
            out |= _atoms(v)
    elif x is not None:
        out.add(str(x))
    return out


def chain_length(calls: Sequence[Any], instruction: str | Iterable[Any] = "") -> int:
    """Hard-prerequisite chain length ``C`` of one trajectory, by dataflow.

    Each call has fields ``name``, ``arguments`` (dict), ``returned`` (values the call returned)
    and ``is_write`` (bool); dicts or objects with those attributes. There is an edge
    ``i -> j`` (``i < j``, call ``i`` a read) when an argument value of call ``j`` was returned by
    call ``i`` and does not appear in the instruction (values given in the instruction need no
    read). ``C`` is the number of calls on the longest path ending at the final write (0 when
    there is no write).

    ``instruction``: the instruction text (a value "appears" if it occurs as a whole token)
    or an iterable of the values it contains.

    >>> calls = [
    ...     {"name": "find_user", "arguments": {"name": "ann"}, "returned": {"user_id": "u1"}, "is_write": False},
    ...     {"name": "get_orders", "arguments": {"user_id": "u1"}, "returned": ["o7"], "is_write": False},
    ...     {"name": "list_products", "arguments": {}, "returned": ["p1"], "is_write": False},
    ...     {"name": "cancel", "arguments": {"order_id": "o7"}, "returned": {"ok": True}, "is_write": True},
    ... ]
    >>> chain_length(calls, "cancel ann's order")
    3
    """
    if isinstance(instruction, str):
        import re

        given = set(re.findall(r"[\w.\-]+", instruction))
    else:
        given = _atoms(list(instruction))
    n = len(calls)
    for c in calls:
        _get(c, "name")  # every call must be named, even if the name plays no part in the dataflow
    args = [_atoms(_get(c, "arguments")) for c in calls]
    rets = [_atoms(_get(c, "returned")) for c in calls]
    writes = [bool(_get(c, "is_write")) for c in calls]
    if not any(writes):
        return 0
    final = max(i for i in range(n) if writes[i])
    depth = [1] * n  # longest path (in calls) ending at j
    for j in range(n):
        needed = args[j] - given
        for i in range(j):
            if not writes[i] and needed & rets[i]:
                depth[j] = max(depth[j], depth[i] + 1)
    return depth[final]
