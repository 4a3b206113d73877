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
* :func:`batch_check_values`: the values of ``creditlab diagnose``'s batch checks on one padded
  training batch, on its device with no host read (what the trainer integrations log every step).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from creditlab.core._checks import any_true, check_scalar, check_tensor, require_values
from creditlab.errors import InputError

__all__ = [
    "CheckParams",
    "aulc",
    "batch_check_values",
    "chain_length",
    "concentration",
    "expected_open_fraction",
    "mixing_score",
    "p_cover",
    "trajectory_ess",
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


def trajectory_ess(log_w: torch.Tensor) -> torch.Tensor:
    """Effective sample size, as a share of the rows, of the weights ``exp(log_w)`` over the last dimension:
    ``(sum w)^2 / (N sum w^2)`` in ``[1/N, 1]`` (1 when every weight is equal), computed in log space so that
    a log weight of hundreds of nats neither overflows nor underflows. ``log_w``: ``(..., N)`` finite, N >= 1.
    Computed in float64. For the trajectory-level importance ratio ``w = pi / mu`` of a batch it says what share
    of its trajectories an unbiased sequence-level correction effectively keeps."""
    log_w = _as_tensor(log_w)
    check_tensor("log_w", log_w, floating=True, finite=True)
    log_w = log_w.to(torch.float64)
    n = log_w.shape[-1]
    if n == 0:
        raise InputError("log_w: needs at least one row")
    return torch.exp(2 * torch.logsumexp(log_w, -1) - torch.logsumexp(2 * log_w, -1) - math.log(n))


def concentration(values: torch.Tensor, top_frac: float) -> tuple[float, float]:
    """Share of ``sum(values)`` carried by the top ``top_frac`` of entries (at least one entry).

    Returns ``(share_of_total, share_of_entries)``. ``values`` must be non-negative (e.g. a
    per-turn KL). An all-zero input has share 0.
    """
    require_values("concentration", "it returns Python floats (a once-per-step diagnostic)", values)
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


# --------------------------------------------------------------------------------------------
# the batch checks of `creditlab diagnose` on one training batch, on the device


@dataclass(frozen=True)
class CheckParams:
    """The constants that define the values of the batch checks (the diagnose checks own them:
    ``creditlab.diagnose.checks.CHECK_PARAMS``)."""

    logprob_tol: float      # a log-prob above this is impossible
    run_min: int            # a run of this many equal log-probs ...
    run_gap: float          # ... where the two models differ by more than this is a placeholder
    measurable: float       # |delta| above this is a measurable difference
    min_measurable: int     # a side needs this many measurable tokens
    negligible_share: float  # at most this share measurable: no side to take (0)
    turn_min_tokens: int    # a turn counts with this many usable tokens
    max_turns: int | None   # turns from this index on are left out (None: none, every turn of the batch)
    seq_min_rows: int       # the sequence ratio needs this many rows with tokens


_F64 = torch.float64


def _runs(x: torch.Tensor, ok: torch.Tensor, gap: torch.Tensor, run_min: int, run_gap: float) -> torch.Tensor:
    """``ok`` tokens in a run of ``run_min``+ consecutive ``ok`` tokens of a row holding one value of ``x``
    with mean ``gap`` over the run above ``run_gap``, or, for a run of 0.0, summed ``gap`` above
    ``run_gap`` (a column of zeros; runs numbered across the flattened batch)."""
    same = torch.zeros_like(ok)
    if ok.shape[1] > 1:
        same[:, 1:] = (x[:, 1:] == x[:, :-1]) & ok[:, 1:] & ok[:, :-1]
    start = (ok & ~same).reshape(-1)
    run = (torch.cumsum(start, 0) - 1).clamp_min(0)
    n = start.numel()
    okf = ok.reshape(-1).to(_F64)
    length = torch.zeros(n, dtype=_F64, device=x.device).scatter_add_(0, run, okf)
    total = torch.zeros(n, dtype=_F64, device=x.device).scatter_add_(0, run, gap.reshape(-1) * okf)
    zero = torch.zeros(n, dtype=_F64, device=x.device).scatter_add_(0, run, (start & (x.reshape(-1) == 0)).to(_F64)) > 0
    bad = (length >= run_min) & ((total > run_gap * length) | (zero & (total > run_gap)))
    return (bad[run] & ok.reshape(-1)).reshape(ok.shape)


def _zero_rows(x: torch.Tensor, other: torch.Tensor, ok: torch.Tensor, run_gap: float) -> torch.Tensor:
    """``(B,)`` rows whose 2+ ``ok`` tokens all hold exactly 0.0 in ``x`` while ``other`` sums below
    ``-run_gap`` over them (a side that never scored the row)."""
    n = ok.sum(1)
    zeros = (ok & (x == 0)).sum(1)
    return (n >= 2) & (zeros == n) & (torch.where(ok, other, 0.0).sum(1) < -run_gap)


def _trailing_padding(both_zero: torch.Tensor, pm: torch.Tensor, run_min: int) -> torch.Tensor:
    """Policy tokens of the run of (0.0, 0.0) policy tokens that ends a row at the batch's last column, when
    it holds ``run_min``+: padding marked as policy (a trainer's batch is right-padded to its width)."""
    pad = both_zero & pm
    L = pad.shape[1]
    # a token is in the trailing run when it and every token after it are pad: a reversed cumulative AND
    tail = torch.flip(torch.cumprod(torch.flip(pad, [1]).to(torch.int64), 1), [1]).bool()
    return tail & (tail.sum(1, keepdim=True) >= run_min) if L else tail


def _nan(like: torch.Tensor) -> torch.Tensor:
    return torch.full((), math.nan, dtype=_F64, device=like.device)


def batch_check_values(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, policy_mask: torch.Tensor,
                       params: CheckParams, *, group_ids: torch.Tensor | None = None,
                       rewards: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The values of ``creditlab diagnose``'s checks on one padded batch ``(B, L)``, as 0-dim float64
    tensors on the inputs' device, computed without reading a tensor value on the host (it runs on
    ``meta`` tensors).

    The same definitions as the checks on a dump of this one batch (docs/diagnose.md), with the turns
    the runs of policy tokens: tokens with a NaN/inf log-prob on either side, one above
    ``logprob_tol``, an exact 0.0 on one side where the other gives ``< -run_gap``, in a run of
    repeated values, in a row that one side fills with 0.0, or in a run of ``run_min``+ (0.0, 0.0)
    policy tokens that ends the row at the batch's last column (padding marked as policy) are left out
    of the others (``usable``); ``delta = old - rollout`` on usable tokens. Keys (each the check id with
    ``/`` for ``.``):

    * ``mismatch/k3``: mean ``exp(delta) - 1 - delta`` over usable tokens (0 when none);
    * ``mismatch/nonfinite_logprobs``, ``mismatch/placeholder_logprobs``: share of the policy tokens
      with a NaN/inf log-prob; with a positive, zero-filled, repeated or padding placeholder one;
    * ``mismatch/prefix_drift``: RMS of the prefix log ratio ``E_t`` at the last turn with
      ``turn_min_tokens`` usable tokens, and ``mismatch/prefix_drift/first_turn`` at the first (NaN
      when fewer than 2 turns have them);
    * ``mismatch/one_sided``: share of the measurable tokens (``|delta| > measurable``) on the majority
      side; 0 when at most ``negligible_share`` of the tokens are measurable, NaN when fewer than
      ``min_measurable`` are but more than that share, or when no token is usable;
    * ``mismatch/sequence_ratio_length``: median ``|sum_t delta_t|`` over the longest length quartile of
      the rows by usable tokens, rows of one length never split (NaN below ``seq_min_rows`` rows with
      tokens or with one length only);
    * ``mismatch/trajectory_ess``: the effective sample size, as a share of the rows with usable tokens, of
      the sequence ratios ``exp(sum_t delta_t)`` (:func:`trajectory_ess`; NaN below ``seq_min_rows`` rows);
    * ``baseline/degenerate_groups`` (with ``group_ids`` ``(B,)`` integer codes in ``[0, B)`` and
      ``rewards`` ``(B,)``): share of the groups whose rewards are all equal (rows with a NaN reward
      left out).
    """
    p = params
    dims: dict[str, int] = {}
    check_tensor("policy_mask", policy_mask, shape=("B", "L"), boolean=True, dims=dims)
    check_tensor("old_logprobs", old_logprobs, shape=("B", "L"), floating=True, dims=dims)
    check_tensor("rollout_logprobs", rollout_logprobs, shape=("B", "L"), floating=True, dims=dims)
    B, L = policy_mask.shape
    dev = policy_mask.device
    with torch.no_grad():
        lp, rlp, pm = old_logprobs.to(_F64), rollout_logprobs.to(_F64), policy_mask
        finite = torch.isfinite(lp) & torch.isfinite(rlp)
        nonfinite = pm & ~finite
        ok = pm & finite
        lp0, rlp0 = torch.where(finite, lp, 0.0), torch.where(finite, rlp, 0.0)
        positive = ok & ((lp0 > p.logprob_tol) | (rlp0 > p.logprob_tol))
        zero_fill = ok & ~positive & (((lp0 == 0) & (rlp0 < -p.run_gap)) | ((rlp0 == 0) & (lp0 < -p.run_gap)))
        gap = (lp0 - rlp0).abs()
        runs = (_runs(lp0, ok, gap, p.run_min, p.run_gap) | _runs(rlp0, ok, gap, p.run_min, p.run_gap))
        scored = ok & ~positive
        # a row one side fills with 0.0, and padding marked as policy, are named, not measured
        padding = _trailing_padding(finite & (lp0 == 0) & (rlp0 == 0), pm, p.run_min) & scored
        zero_row = _zero_rows(rlp0, lp0, scored, p.run_gap) | _zero_rows(lp0, rlp0, scored, p.run_gap)
        zero_side = scored & zero_row[:, None] & ~padding
        placeholder = (positive | zero_fill | runs | zero_side | padding) & ok
        usable = ok & ~placeholder
        delta = torch.where(usable, lp0 - rlp0, 0.0)
        uf = usable.to(_F64)
        n_pol = pm.sum(dtype=_F64)
        n = uf.sum()
        out: dict[str, torch.Tensor] = {
            "mismatch/k3": (torch.expm1(delta) - delta).sum() / n.clamp_min(1),
            "mismatch/nonfinite_logprobs": nonfinite.sum(dtype=_F64) / n_pol.clamp_min(1),
            "mismatch/placeholder_logprobs": placeholder.sum(dtype=_F64) / n_pol.clamp_min(1),
        }
        # one-sided: the majority side of the measurable tokens
        meas = usable & (delta.abs() > p.measurable)
        m = meas.sum(dtype=_F64)
        above = (meas & (delta < 0)).sum(dtype=_F64) / m.clamp_min(1)
        share = torch.maximum(above, 1 - above)
        few = torch.where(m <= p.negligible_share * n, torch.zeros((), dtype=_F64, device=dev), _nan(m))
        out["mismatch/one_sided"] = torch.where(n > 0, torch.where(m >= p.min_measurable, share, few), _nan(m))
        # prefix drift: RMS of the prefix log ratio by turn (turns: runs of policy tokens)
        first = pm.clone()
        if L > 1:
            first[:, 1:] &= ~pm[:, :-1]
        turn = torch.cumsum(first, 1) - 1
        T = max(1, (L + 1) // 2) if p.max_turns is None else int(p.max_turns)  # a row has <= ceil(L/2) turns
        bucket = torch.where(usable & (turn < T), turn, T).reshape(-1)
        E = torch.cumsum(delta, 1)
        cnt = torch.zeros(T + 1, dtype=_F64, device=dev).scatter_add_(0, bucket, uf.reshape(-1))[:T]
        sq = torch.zeros(T + 1, dtype=_F64, device=dev).scatter_add_(0, bucket, (E * E * uf).reshape(-1))[:T]
        rms = torch.sqrt(sq / cnt.clamp_min(1))
        good = cnt >= p.turn_min_tokens
        k = torch.arange(T, device=dev)
        k_first = torch.where(good, k, T).min().clamp(max=T - 1)
        k_last = torch.where(good, k, -1).max().clamp_min(0)
        two = good.sum() >= 2
        at = torch.stack([k_last, k_first])  # gathered, not indexed: a 0-dim index is a host read on a GPU
        last_first = rms.gather(0, at)
        out["mismatch/prefix_drift"] = torch.where(two, last_first[0], _nan(rms))
        out["mismatch/prefix_drift/first_turn"] = torch.where(two, last_first[1], _nan(rms))
        # sequence ratio: median |S| over the longest length quartile of the rows with usable tokens; rows of
        # one length share the quartile of the highest-ranked of them (a function of the set of rows, not of
        # their order)
        n_row = uf.sum(1)
        S = delta.sum(1).abs()
        has = n_row > 0
        R = has.sum()
        sorted_n = torch.sort(torch.where(has, n_row, math.inf)).values
        top_rank = torch.searchsorted(sorted_n, n_row.contiguous(), right=True) - 1  # highest rank among ties
        base, extra = torch.div(R, 4, rounding_mode="floor"), torch.remainder(R, 4)
        j = torch.arange(1, 4, device=dev)
        first_rank = j * base + torch.minimum(j, extra)  # ranks where quartiles 1, 2, 3 start
        quart = (top_rank[:, None] >= first_rank[None, :]).sum(1)
        top = torch.where(has, quart, -1).max() if B else R
        longest = has & (quart == top)
        M = longest.sum()
        vals = torch.sort(torch.where(longest, S, math.inf)).values
        lo_i = torch.div(M - 1, 2, rounding_mode="floor").clamp_min(0)
        hi_i = torch.div(M, 2, rounding_mode="floor").clamp(max=max(B - 1, 0))
        med = vals.gather(0, torch.stack([lo_i, hi_i])).mean() if B else _nan(S)
        spread = torch.where(has, n_row, -math.inf).max() > torch.where(has, n_row, math.inf).min() if B else R > 0
        out["mismatch/sequence_ratio_length"] = torch.where((R >= p.seq_min_rows) & spread, med, _nan(S))
        # trajectory ESS: the share of the rows (with usable tokens) that the sequence ratios exp(sum_t delta_t)
        # effectively keep, (sum w)^2 / (R sum w^2), in log space (:func:`trajectory_ess`)
        lw = torch.where(has, delta.sum(1), -math.inf)
        ess = torch.exp(2 * torch.logsumexp(lw, 0) - torch.logsumexp(2 * lw, 0) - torch.log(R.to(_F64).clamp_min(1)))
        out["mismatch/trajectory_ess"] = torch.where(R >= p.seq_min_rows, ess, _nan(S))
        if group_ids is not None and rewards is not None:
            check_tensor("group_ids", group_ids, shape=(B,), integer=True)
            check_tensor("rewards", rewards, shape=(B,), floating=True)
            r = rewards.to(_F64)
            seen = ~torch.isnan(r)
            g = group_ids.to(torch.int64).clamp(0, max(B - 1, 0))
            hi = torch.full((B,), -math.inf, dtype=_F64, device=dev).scatter_reduce(
                0, g, torch.where(seen, r, -math.inf), "amax")
            lo = torch.full((B,), math.inf, dtype=_F64, device=dev).scatter_reduce(
                0, g, torch.where(seen, r, math.inf), "amin")
            present = torch.zeros(B, dtype=_F64, device=dev).scatter_add_(0, g, seen.to(_F64)) > 0
            degenerate = present & ((hi - lo) <= 1e-9 * torch.clamp(hi.abs(), min=1.0))
            out["baseline/degenerate_groups"] = degenerate.sum(dtype=_F64) / present.sum(dtype=_F64).clamp_min(1)
    return out
