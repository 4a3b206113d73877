"""Token-level quantities of a dump: computed on a batch of rows at a time, and reduced per row.

Same definitions as ``creditlab.core.correction`` (docs/design.md section 7), on ragged rows
concatenated with offsets instead of a padded ``(B, L)`` batch (a dump of ragged rows would pad to
its longest row): ``delta_t = logprobs_t - rollout_logprobs_t`` on policy tokens, 0 elsewhere;
``K3_t = exp(delta_t) - 1 - delta_t``; the prefix ``E_t = sum_{u <= t} delta_u`` along the row
(it carries across tool tokens). tests/test_diagnose_checks.py compares these with
``mismatch_metrics`` on the same rows padded.

Every quantity here but one is a function of one row's tokens, so the readers compute them on each
batch of rows as it is read (:func:`reduce_tokens`) and keep only their sums per row
(:class:`RowStats`) and per row and turn (:class:`TurnStats`): what the checks and the trainers'
metrics need, a few hundred bytes per row whatever its length. The exception is a file whose two
log-prob columns are identical (below): decided per file from the per-row counts once every row is
read (:func:`mismatch_rows`).

Tokens that the placeholder check flags are left out of every other mismatch quantity, so a leak in
the policy mask is reported once, by that check, and does not pose as a precision mismatch:

* NaN/inf log-probs (reported by the non-finite check), log-probs above 0;
* an exact 0.0 on one side where the other model gives the token less than ``exp(-RUN_GAP)``;
* runs of ``RUN_MIN``+ of one repeated value where the two models disagree by more than ``RUN_GAP``
  nats on average;
* a side that is exactly 0.0 on a run of ``RUN_MIN``+ policy tokens, or on every policy token of a row
  (2+), while the other side gives those tokens less than ``exp(-RUN_GAP)`` together: a column of
  zeros, not a measurement (an engine asked for no log-probs, a learner that never scored the row),
  even where each token alone is close to 0;
* padding in the policy mask: a run of ``RUN_MIN``+ policy tokens with exactly 0.0 on both sides at
  the end of a row. A sampled token can have probability 1 on both sides (0.0 in float), but not
  ``RUN_MIN`` times in a row where a row ends, where a padded batch puts its filler.

``rollout_logprobs`` bit-identical to ``logprobs`` on every usable policy token is not a measurement
of zero mismatch but one log-prob computation stored twice (a copied column, or a trainer that
overwrote one with the other): ``copied_all`` says so for the whole dump, and the tokens of a file
that is identical on all of its ``COPY_MIN_TOKENS``+ usable policy tokens (when others are not) are
left out of the mismatch quantities like placeholders. Rows whose ``logprobs_source`` says their
``logprobs`` are the engine's own (verl's bypass mode) are left out the same way (``engine_rows``);
``engine_all`` says no other row is left.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from creditlab.diagnose.schema import ENGINE_SOURCE, LOGPROB_TOL

POSITIVE_TOL = LOGPROB_TOL
"""A log-prob above this is impossible (float rounding of ``log_softmax`` stays far below it); the
readers already refuse one on a policy token."""
COPY_MIN_TOKENS = 20
"""Usable policy tokens a file needs before its bit-identical columns count as copied (fewer can agree
by chance when engine and learner are close)."""
RUN_MIN = 4
"""Shortest run of one repeated value that counts as a placeholder ..."""
RUN_GAP = 0.5
"""... when the two models disagree on it by more than this (mean |delta| over the run, nats)."""
DERIVE_TURN = -2
"""``TokenData.turn_ids`` of rows whose file had no ``turn_ids``: their turns are their policy runs."""
MEASURABLE = 1e-5
"""|delta| above this is a measurable mismatch (``mismatch.one_sided`` counts the sides of those tokens)."""
_SAFETY = 20.0  # verl's SAFETY_BOUND on log ratios (trainer_metrics)


@dataclass
class TokenData:
    """The token columns of every row, flat: row ``i`` owns ``[offsets[i], offsets[i + 1])``.

    Rows without token columns (a file that has none) own an empty range and ``has_tokens`` False.
    """

    offsets: np.ndarray           # (N + 1,) int64
    logprobs: np.ndarray          # (M,) float64, NaN where a value was null
    rollout_logprobs: np.ndarray  # (M,) float64
    policy_mask: np.ndarray       # (M,) bool
    turn_ids: np.ndarray | None   # (M,) int64, or None when no file has turn_ids
    has_tokens: np.ndarray        # (N,) bool
    rejected: np.ndarray | None = None  # (M,) bool, or None when no file has rejected (False: kept)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass
class TokenStats:
    """Flat per-token arrays (``M`` tokens) and per-row sums (``N`` rows) of a batch of rows."""

    row: np.ndarray          # (M,) row of each token
    policy: np.ndarray       # (M,) policy_mask
    nonfinite: np.ndarray    # (M,) policy token with a NaN/inf log-prob on either side
    positive: np.ndarray     # (M,) policy token with a log-prob > POSITIVE_TOL
    zero_fill: np.ndarray    # (M,) policy token with exactly 0.0 on one side and < -RUN_GAP on the other
    placeholder: np.ndarray  # (M,) policy token in a run of repeated values the models disagree on
    zero_side: np.ndarray    # (M,) policy token of a run (RUN_MIN+) or row (2+) that one side fills with 0.0
    padding: np.ndarray      # (M,) policy token of a run of RUN_MIN+ (0.0, 0.0) that ends its row
    usable: np.ndarray       # (M,) policy & none of the flags
    delta: np.ndarray        # (M,) float64 logprobs - rollout_logprobs on usable tokens, else 0
    prefix: np.ndarray       # (M,) float64 running sum of delta along the row
    turn: np.ndarray         # (M,) int64 turn of each policy token (-1: none)
    row_usable: np.ndarray   # (N,) usable tokens per row
    row_delta: np.ndarray    # (N,) sum of delta per row (sequence log ratio)
    row_policy: np.ndarray   # (N,) policy tokens per row
    copied_all: bool = False  # every usable policy token has rollout_logprobs == logprobs exactly
    copied_files: tuple[int, ...] = ()  # files identical on all their COPY_MIN_TOKENS+ usable tokens
    copied: np.ndarray | None = None  # (M,) tokens of those files, left out of usable (None: none)
    engine_rows: int = 0     # rows with tokens whose logprobs_source says logprobs are the engine's (left out)
    engine_all: bool = False  # every row with tokens is such a row: no learner log-prob in the dump
    rejected: np.ndarray | None = None  # (M,) policy tokens rejection sampling dropped (None: no column)
    zero_rows: tuple[int, int] = (0, 0)  # rows whose rollout_logprobs / logprobs are 0.0 on every policy token
    padded_rows: int = 0     # rows that end in padding
    zero_engine: np.ndarray | None = None   # (N,) rows whose rollout_logprobs are 0.0 on every policy token
    zero_learner: np.ndarray | None = None  # (N,) ... whose logprobs are

    @property
    def flagged(self) -> np.ndarray:
        return self.nonfinite | self.positive | self.zero_fill | self.placeholder | self.zero_side | self.padding


def _runs_of_equal(x: np.ndarray, policy: np.ndarray, row_start: np.ndarray, gap: np.ndarray) -> np.ndarray:
    """Policy tokens in a run of >= RUN_MIN consecutive policy tokens of one row holding exactly one
    value of ``x``, with mean ``gap`` over the run above RUN_GAP, or, for a run of 0.0, the summed
    ``gap`` above RUN_GAP (a column of zeros)."""
    M = x.shape[0]
    same = np.zeros(M, dtype=bool)
    if M > 1:
        same[1:] = (x[1:] == x[:-1]) & policy[1:] & policy[:-1] & ~row_start[1:]
    start = policy & ~same
    run = np.cumsum(start) - 1  # run id of each policy token (meaningless elsewhere)
    n_runs = int(start.sum())
    if n_runs == 0:
        return np.zeros(M, dtype=bool)
    ids = run[policy]
    length = np.bincount(ids, minlength=n_runs)
    total = np.bincount(ids, weights=gap[policy], minlength=n_runs)
    zero = x[start] == 0
    bad_run = (length >= RUN_MIN) & ((total > RUN_GAP * length) | (zero & (total > RUN_GAP)))
    out = np.zeros(M, dtype=bool)
    out[policy] = bad_run[ids]
    return out


def _zero_rows(x: np.ndarray, other: np.ndarray, ok: np.ndarray, row: np.ndarray, N: int) -> np.ndarray:
    """(N,) rows whose 2+ ``ok`` policy tokens all hold exactly 0.0 in ``x`` while ``other`` sums below
    ``-RUN_GAP`` over them."""
    n = np.bincount(row[ok], minlength=N)
    zeros = np.bincount(row[ok], weights=(x[ok] == 0), minlength=N)
    other_sum = np.bincount(row[ok], weights=other[ok], minlength=N)
    return (n >= 2) & (zeros == n) & (other_sum < -RUN_GAP)


def _trailing_padding(both_zero: np.ndarray, policy: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Policy tokens in the run of (0.0, 0.0) policy tokens that ends a row, when it holds RUN_MIN+."""
    M = both_zero.shape[0]
    out = np.zeros(M, dtype=bool)
    pad = both_zero & policy
    if M == 0 or not pad.any():
        return out
    # distance from each token back to the last token of its row that is not padding
    idx = np.arange(M)
    last_not = np.maximum.accumulate(np.where(pad, -1, idx))
    ends = offsets[1:][np.diff(offsets) > 0] - 1  # last token of each non-empty row
    starts = offsets[:-1][np.diff(offsets) > 0]
    for_end = ends[pad[ends]]
    if for_end.size == 0:
        return out
    first = np.maximum(last_not[for_end] + 1, starts[pad[ends]])  # the run stays within its row
    keep = (for_end - first + 1) >= RUN_MIN
    length = (for_end - first + 1)[keep]
    if length.size:
        run_tok = np.repeat(first[keep], length) + (np.arange(length.sum()) - np.repeat(np.cumsum(length) - length,
                                                                                      length))
        out[run_tok] = True
    return out


def engine_rows(sources: list[str | None] | None, has_tokens: np.ndarray) -> np.ndarray:
    """(N,) rows with tokens whose ``logprobs_source`` says their ``logprobs`` are the engine's own."""
    if sources is None:
        return np.zeros(has_tokens.shape[0], dtype=bool)
    return np.asarray([s is not None and s.startswith(ENGINE_SOURCE) for s in sources], dtype=bool) & has_tokens


def _flags(t: TokenData, engine: np.ndarray | None) -> TokenStats:
    """The per-token flags and quantities of the rows of ``t``, every one a function of its own row
    (``engine``: rows left out, see :func:`engine_rows`); copied files are not decided here."""
    lengths = t.lengths
    N = lengths.shape[0]
    M = int(t.offsets[-1])
    row = np.repeat(np.arange(N), lengths)
    row_start = np.zeros(M, dtype=bool)
    row_start[t.offsets[:-1][lengths > 0]] = True
    lp, rlp, policy = t.logprobs, t.rollout_logprobs, t.policy_mask

    finite = np.isfinite(lp) & np.isfinite(rlp)
    nonfinite = policy & ~finite
    with np.errstate(invalid="ignore"):
        positive = policy & finite & ((lp > POSITIVE_TOL) | (rlp > POSITIVE_TOL))
        gap = np.where(finite, np.abs(lp - rlp), 0.0)
    with np.errstate(invalid="ignore"):
        zero_fill = policy & finite & ~positive & (((lp == 0) & (rlp < -RUN_GAP)) | ((rlp == 0) & (lp < -RUN_GAP)))
    placeholder = (_runs_of_equal(lp, policy & finite, row_start, gap)
                   | _runs_of_equal(rlp, policy & finite, row_start, gap)) & ~positive & ~zero_fill
    ok = policy & finite & ~positive
    zero_engine = _zero_rows(rlp, lp, ok, row, N)
    zero_learner = _zero_rows(lp, rlp, ok, row, N)
    padding = _trailing_padding(finite & (lp == 0) & (rlp == 0), policy, t.offsets) & ok
    # a row that one side fills with 0.0 is one finding (its tokens are counted there, not token by token)
    zero_side = ok & np.repeat(zero_engine | zero_learner, lengths) & ~padding
    zero_fill &= ~zero_side
    placeholder &= ~zero_side
    usable = ok & ~zero_fill & ~placeholder & ~zero_side & ~padding
    if engine is not None and engine.any():  # logprobs are the engine's own: nothing to compare them with
        usable = usable & ~np.repeat(engine, lengths)
    delta = np.where(usable, np.where(finite, lp - rlp, 0.0), 0.0)

    def per_row_base(cs: np.ndarray) -> np.ndarray:
        """Value of the running sum ``cs`` just before each row starts, per token."""
        before = np.concatenate([[0.0], cs])[t.offsets[:-1]]
        return before[row]

    cs = np.cumsum(delta)
    prefix = cs - per_row_base(cs)

    # turns: the given turn_ids, or the index of the policy run within its row
    prev_policy = np.zeros(M, dtype=bool)
    if M > 1:
        prev_policy[1:] = policy[:-1] & ~row_start[1:]
    seg_start = (policy & ~prev_policy).astype(np.int64)
    cs_seg = np.cumsum(seg_start)
    seg_turn = cs_seg - per_row_base(cs_seg).astype(np.int64) - 1
    if t.turn_ids is None:
        turn = np.where(policy, seg_turn, -1)
    else:
        given = np.where(t.turn_ids == DERIVE_TURN, seg_turn, t.turn_ids)
        turn = np.where(policy, given, -1)

    row_usable = np.bincount(row, weights=usable, minlength=N)
    row_delta = np.bincount(row, weights=delta, minlength=N)
    row_policy = np.bincount(row, weights=policy, minlength=N)
    eng = np.zeros(N, dtype=bool) if engine is None else engine
    return TokenStats(row=row, policy=policy, nonfinite=nonfinite, positive=positive, zero_fill=zero_fill,
                      placeholder=placeholder, zero_side=zero_side, padding=padding,
                      usable=usable, delta=delta, prefix=prefix, turn=turn, row_usable=row_usable,
                      row_delta=row_delta, row_policy=row_policy, engine_rows=int(eng.sum()),
                      engine_all=bool(eng.any()) and bool(eng[t.has_tokens].all()),
                      rejected=None if t.rejected is None else t.rejected & policy,
                      zero_rows=(int(zero_engine.sum()), int(zero_learner.sum())),
                      padded_rows=int(np.unique(row[padding]).size), zero_engine=zero_engine,
                      zero_learner=zero_learner)


# ------------------------------------------------------------------------------------------------
# per-row reductions
# ------------------------------------------------------------------------------------------------


@dataclass
class RowStats:
    """The token columns of ``N`` rows reduced to what the checks and the trainers' metrics use: counts and
    sums over each row's tokens (0 for a row without tokens). "usable" tokens are the policy tokens none of
    the flags (above) marks, outside rows with the engine's log-probs as ``logprobs``; ``delta`` is
    ``logprobs - rollout_logprobs`` on them."""

    has_tokens: np.ndarray       # bool: the row has token columns
    tokens: np.ndarray           # tokens in the row
    policy: np.ndarray           # policy tokens
    nonfinite: np.ndarray        # policy tokens with a NaN/inf log-prob on either side
    nonfinite_engine: np.ndarray  # ... in rollout_logprobs
    nonfinite_learner: np.ndarray  # ... in logprobs
    first_nonfinite: np.ndarray  # index in the row of the first of them (-1: none)
    positive: np.ndarray         # flags, one count each (see TokenStats)
    zero_fill: np.ndarray
    placeholder: np.ndarray
    zero_side: np.ndarray
    padding: np.ndarray
    flagged: np.ndarray          # tokens with any of the five flags above
    first_flagged: np.ndarray    # index in the row of the first of them (-1: none)
    zero_engine: np.ndarray      # bool: rollout_logprobs 0.0 on every policy token
    zero_learner: np.ndarray     # bool: logprobs 0.0 on every policy token
    engine: np.ndarray           # bool: logprobs_source says logprobs are the engine's (no usable token)
    usable: np.ndarray           # usable tokens
    same: np.ndarray             # usable tokens with rollout_logprobs == logprobs exactly
    kept: np.ndarray             # usable tokens that rejection sampling kept
    sum_delta: np.ndarray        # sum of delta (the sequence log ratio)
    sum_k3: np.ndarray           # sum of expm1(delta) - delta
    sum_k3_kept: np.ndarray      # ... over the kept tokens
    sum_k2: np.ndarray           # sum of delta^2 / 2
    sum_chi2: np.ndarray         # sum of expm1(delta)^2
    sum_abs: np.ndarray          # sum of |delta|
    measurable: np.ndarray       # usable tokens with |delta| > MEASURABLE
    measurable_neg: np.ndarray   # ... with delta < 0 (the engine above the learner)
    trl_n: np.ndarray            # TRL: policy tokens with a non-NaN |logprobs - rollout_logprobs|
    trl_sum_abs: np.ndarray      # ... the sum of it
    trl_max_abs: np.ndarray      # ... its maximum (-inf: none)
    trl_sum_diff: np.ndarray     # sum of (logprobs - rollout_logprobs) * policy_mask, NaN as 0 (TRL)
    verl_n: np.ndarray           # verl: policy tokens with finite log-probs
    verl_lp: np.ndarray          # ... sum of logprobs
    verl_rlp: np.ndarray         # ... sum of rollout_logprobs
    verl_lr: np.ndarray          # ... sum of the log ratio lr = logprobs - rollout_logprobs
    verl_k3: np.ndarray          # ... sum of exp(lr) - lr - 1
    verl_k3_clip: np.ndarray     # ... sum of exp(c) - 1 - c, c = lr clipped to +-20
    verl_chi2_clip: np.ndarray   # ... sum of exp(c)^2

    def __len__(self) -> int:
        return int(self.has_tokens.shape[0])

    def take(self, keep: np.ndarray) -> RowStats:
        return RowStats(**{f.name: getattr(self, f.name)[keep] for f in fields(self)})

    @staticmethod
    def concat(parts: list[RowStats]) -> RowStats:
        return RowStats(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(RowStats)})

    @staticmethod
    def empty(n: int) -> RowStats:
        """``n`` rows without token columns."""
        out: dict[str, np.ndarray] = {}
        for f in fields(RowStats):
            if f.name in ("has_tokens", "zero_engine", "zero_learner", "engine"):
                out[f.name] = np.zeros(n, dtype=bool)
            elif f.name.startswith(("sum_", "verl_l", "verl_r", "verl_k", "verl_c", "trl_sum")):
                out[f.name] = np.zeros(n, dtype=np.float64)
            elif f.name.startswith("first_"):
                out[f.name] = np.full(n, -1, dtype=np.int64)
            elif f.name == "trl_max_abs":
                out[f.name] = np.full(n, -np.inf)
            else:
                out[f.name] = np.zeros(n, dtype=np.int64)
        return RowStats(**out)


@dataclass
class TurnStats:
    """Sums over the usable policy tokens of each (row, turn) that has any (``K`` records)."""

    row: np.ndarray          # (K,) int64 row
    turn: np.ndarray         # (K,) int64 turn
    n: np.ndarray            # (K,) int64 usable tokens
    sum_delta: np.ndarray    # (K,) sum of delta
    sum_prefix: np.ndarray   # (K,) sum of the prefix E
    sum_delta2: np.ndarray   # (K,) sum of delta^2
    sum_prefix2: np.ndarray  # (K,) sum of E^2

    def take_rows(self, keep: np.ndarray, *, renumber: bool = True) -> TurnStats:
        """The records of the rows where ``keep`` (N,) is True, renumbered as those rows are (``renumber``)."""
        sel = keep[self.row]
        cols = {f.name: getattr(self, f.name)[sel] for f in fields(self)}
        if renumber:
            cols["row"] = (np.cumsum(keep) - 1)[cols["row"]]
        return TurnStats(**cols)

    @staticmethod
    def concat(parts: list[TurnStats], offsets: list[int]) -> TurnStats:
        """``parts`` of consecutive blocks of rows starting at ``offsets``."""
        cols: dict[str, Any] = {f.name: np.concatenate([getattr(p, f.name) for p in parts]) if parts else
                                np.zeros(0, dtype=np.int64 if f.name in ("row", "turn", "n") else np.float64)
                                for f in fields(TurnStats)}
        if parts:
            cols["row"] = np.concatenate([p.row + o for p, o in zip(parts, offsets, strict=True)])
        return TurnStats(**cols)


def _first(mask: np.ndarray, row: np.ndarray, offsets: np.ndarray, N: int) -> np.ndarray:
    """(N,) index within its row of the first token of each row where ``mask`` is True (-1: none)."""
    out = np.full(N, -1, dtype=np.int64)
    idx = np.flatnonzero(mask)
    if idx.size:
        rows, at = np.unique(row[idx], return_index=True)
        out[rows] = idx[at] - offsets[rows]
    return out


def trl_row_sums(lp: np.ndarray, rlp: np.ndarray, policy: np.ndarray, tok_row: np.ndarray, R: int,
                 offsets: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """What TRL's ``sampling/*`` metrics need of each of ``R`` rows (flat tokens, ``tok_row`` the row of each;
    ``offsets``: the rows' token ranges, when ``tok_row`` is sorted): its policy tokens with a non-NaN
    ``|lp - rlp|``, their sum and maximum, and the row's ``sum((lp - rlp) * policy)`` with NaN as 0 (the log
    of TRL's sequence importance ratio)."""
    with np.errstate(invalid="ignore"):
        absdiff = np.abs(lp - rlp)
        diff = np.nan_to_num((lp - rlp) * policy, nan=0.0)  # TRL: (old - sampling) * mask, NaN -> 0
    keep = policy & ~np.isnan(absdiff)
    top = np.full(R, -np.inf)
    x = np.where(keep, absdiff, -np.inf)
    if offsets is not None:
        nonempty = np.diff(offsets) > 0
        if nonempty.any():
            top[nonempty] = np.maximum.reduceat(x, offsets[:-1][nonempty])
    else:
        np.maximum.at(top, tok_row, x)
    return {"trl_n": np.bincount(tok_row[keep], minlength=R).astype(np.int64),
            "trl_sum_abs": np.bincount(tok_row, weights=np.where(keep, absdiff, 0.0), minlength=R),
            "trl_max_abs": top, "trl_sum_diff": np.bincount(tok_row, weights=diff, minlength=R)}


def verl_row_sums(lp: np.ndarray, rlp: np.ndarray, mask: np.ndarray, tok_row: np.ndarray,
                  R: int) -> dict[str, np.ndarray]:
    """What verl's ``compute_offpolicy_metrics`` (and its ``seq_sum_k3``) need of each of ``R`` rows, over the
    tokens of ``mask`` (verl's ``response_mask``): their count and the sums of ``lp``, ``rlp``, the log ratio
    ``lr = lp - rlp``, ``exp(lr) - lr - 1``, and with ``c = clip(lr, -20, 20)`` of ``exp(c) - 1 - c`` and
    ``exp(c)^2``, each as verl writes it."""
    m = mask.astype(np.float64)
    lp0, rlp0 = np.where(mask, lp, 0.0), np.where(mask, rlp, 0.0)
    lr = lp0 - rlp0
    lrc = np.clip(lr, -_SAFETY, _SAFETY)
    with np.errstate(over="ignore"):
        e_lr, e_lrc = np.exp(lr), np.exp(lrc)

    def total(x: np.ndarray) -> np.ndarray:
        return np.bincount(tok_row, weights=x * m, minlength=R)

    return {"verl_n": np.bincount(tok_row[mask], minlength=R).astype(np.int64), "verl_lp": total(lp0),
            "verl_rlp": total(rlp0), "verl_lr": total(lr), "verl_k3": total(e_lr - lr - 1),
            "verl_k3_clip": total(e_lrc - 1.0 - lrc), "verl_chi2_clip": total(e_lrc ** 2)}


def reduce_tokens(t: TokenData, engine: np.ndarray | None = None) -> tuple[RowStats, TurnStats]:
    """The :class:`RowStats` and :class:`TurnStats` of the rows of ``t`` (a batch of whole rows), with the rows
    where ``engine`` is True left out of the usable tokens. Each row's sums are accumulated in token
    order, as one ``np.bincount`` over the whole dump would."""
    ts = _flags(t, engine)
    lengths = t.lengths
    N = lengths.shape[0]
    off = t.offsets
    row = ts.row
    lp, rlp, pm = t.logprobs, t.rollout_logprobs, t.policy_mask

    def count(mask: np.ndarray) -> np.ndarray:
        return np.bincount(row[mask], minlength=N).astype(np.int64)

    def total(w: np.ndarray) -> np.ndarray:
        return np.bincount(row, weights=w, minlength=N)

    usable, delta = ts.usable, ts.delta
    kept = usable if ts.rejected is None else usable & ~ts.rejected
    r1 = np.expm1(delta)
    k3 = r1 - delta
    meas = usable & (np.abs(delta) > MEASURABLE)
    found = ts.positive | ts.zero_fill | ts.placeholder | ts.zero_side | ts.padding
    eng = np.zeros(N, dtype=bool) if engine is None else engine
    rows = RowStats(
        has_tokens=t.has_tokens.copy(), tokens=lengths.astype(np.int64), policy=count(pm),
        nonfinite=count(ts.nonfinite), nonfinite_engine=count(pm & ~np.isfinite(rlp)),
        nonfinite_learner=count(pm & ~np.isfinite(lp)), first_nonfinite=_first(ts.nonfinite, row, off, N),
        positive=count(ts.positive), zero_fill=count(ts.zero_fill), placeholder=count(ts.placeholder),
        zero_side=count(ts.zero_side), padding=count(ts.padding), flagged=count(found),
        first_flagged=_first(found, row, off, N), zero_engine=ts.zero_engine, zero_learner=ts.zero_learner,
        engine=eng & t.has_tokens, usable=count(usable), same=count(usable & (lp == rlp)), kept=count(kept),
        sum_delta=ts.row_delta, sum_k3=total(k3), sum_k3_kept=total(np.where(kept, k3, 0.0)),
        sum_k2=total(np.where(usable, delta * delta / 2, 0.0)), sum_chi2=total(np.where(usable, r1 * r1, 0.0)),
        sum_abs=total(np.where(usable, np.abs(delta), 0.0)), measurable=count(meas),
        measurable_neg=count(meas & (delta < 0)),
        **trl_row_sums(lp, rlp, pm, row, N, off),
        **verl_row_sums(lp, rlp, pm & np.isfinite(lp) & np.isfinite(rlp), row, N),
    )
    return rows, _turn_sums(ts)


def _turn_sums(ts: TokenStats) -> TurnStats:
    sel = ts.usable & (ts.turn >= 0)
    r, k = ts.row[sel], ts.turn[sel]
    d, E = ts.delta[sel], ts.prefix[sel]
    if r.size == 0:
        return TurnStats.concat([], [])
    if int(k.max()) < 2 ** 31:
        key = (r.astype(np.int64) << 31) | k
        uniq, inv = np.unique(key, return_inverse=True)
        urow, uturn = uniq >> 31, uniq & (2 ** 31 - 1)
    else:  # turn ids beyond 2^31: pair them the slow way
        uniq, inv = np.unique(np.stack([r, k], axis=1), axis=0, return_inverse=True)
        urow, uturn = uniq[:, 0], uniq[:, 1]
    inv = inv.reshape(-1)
    K = uniq.shape[0]
    return TurnStats(row=urow.astype(np.int64), turn=uturn.astype(np.int64),
                     n=np.bincount(inv, minlength=K).astype(np.int64),
                     sum_delta=np.bincount(inv, weights=d, minlength=K),
                     sum_prefix=np.bincount(inv, weights=E, minlength=K),
                     sum_delta2=np.bincount(inv, weights=d * d, minlength=K),
                     sum_prefix2=np.bincount(inv, weights=E * E, minlength=K))


# ------------------------------------------------------------------------------------------------
# the dump's mismatch rows: copied files left out
# ------------------------------------------------------------------------------------------------


@dataclass
class MismatchRows:
    """A dump's :class:`RowStats` and :class:`TurnStats` with the tokens of copied files left out of the
    usable ones, and what was left out (what ``ctx.tokens`` is for the checks)."""

    rows: RowStats
    turns: TurnStats
    copied_all: bool          # every usable policy token has rollout_logprobs == logprobs exactly
    copied_files: tuple[int, ...]  # files identical on all their COPY_MIN_TOKENS+ usable tokens
    copied: int               # usable tokens of those files, left out
    engine_rows: int          # rows whose logprobs_source says logprobs are the engine's (left out)
    engine_all: bool          # every row with tokens is such a row
    has_rejected: bool        # some file has the column rejected
    row_file: np.ndarray      # (N,) file of each row

    @property
    def zero_rows(self) -> tuple[int, int]:
        return int(self.rows.zero_engine.sum()), int(self.rows.zero_learner.sum())

    @property
    def padded_rows(self) -> int:
        return int((self.rows.padding > 0).sum())


def mismatch_rows(rows: RowStats, turns: TurnStats, row_file: np.ndarray, n_files: int,
                  has_rejected: bool) -> MismatchRows:
    """Leave out the files whose ``rollout_logprobs`` equal ``logprobs`` on every one of their
    ``COPY_MIN_TOKENS``+ usable tokens, unless every usable token of the dump is (``copied_all``: one
    finding for the whole dump). A copied file's usable tokens all have ``delta`` 0, so leaving them out
    changes the counts only."""
    U, S = int(rows.usable.sum()), int(rows.same.sum())
    copied_all = U > 0 and S == U
    engine = rows.engine
    engine_all = bool(engine.any()) and bool(engine[rows.has_tokens].all())
    files: tuple[int, ...] = ()
    copied = 0
    if not copied_all and U:
        u_f = np.bincount(row_file, weights=rows.usable, minlength=n_files)
        s_f = np.bincount(row_file, weights=rows.same, minlength=n_files)
        bad = np.flatnonzero((u_f >= COPY_MIN_TOKENS) & (s_f == u_f))
        if bad.size:
            files = tuple(int(f) for f in bad)
            out = np.isin(row_file, bad)
            copied = int(rows.usable[out].sum())
            rows = replace(rows, usable=np.where(out, 0, rows.usable), kept=np.where(out, 0, rows.kept),
                           measurable=np.where(out, 0, rows.measurable),
                           measurable_neg=np.where(out, 0, rows.measurable_neg))
            turns = turns.take_rows(~out, renumber=False)
    return MismatchRows(rows, turns, copied_all, files, copied, int(engine.sum()), engine_all, has_rejected, row_file)


def token_stats(dump: Any) -> TokenStats:
    """The per-token :class:`TokenStats` of a dump read with its tokens kept (``read_dump(..., tokens=True)``),
    copied files (decided as :func:`mismatch_rows` does) left out: the flat arrays the per-row sums of
    :class:`RowStats` are sums of."""
    t = dump.tokens
    if t is None:
        raise ValueError("token_stats needs a dump read with its token columns kept (read_dump(..., tokens=True))")
    ts = _flags(t, dump.rows.engine if dump.rows is not None else None)
    mr = dump.mismatch()
    ts.copied_all, ts.copied_files = mr.copied_all, mr.copied_files
    if mr.copied_files:
        ts.copied = ts.usable & np.isin(dump.row_file[ts.row], mr.copied_files)
        ts.usable = ts.usable & ~ts.copied
        ts.delta = np.where(ts.usable, ts.delta, 0.0)
        ts.row_usable = np.bincount(ts.row, weights=ts.usable, minlength=len(dump))
    return ts
