"""Token-level quantities of a dump, computed once on the flat token arrays.

Same definitions as ``creditlab.core.correction`` (docs/design.md section 7), on ragged rows
concatenated with offsets instead of a padded ``(B, L)`` batch (a dump of ragged rows would pad to
its longest row): ``delta_t = logprobs_t - rollout_logprobs_t`` on policy tokens, 0 elsewhere;
``K3_t = exp(delta_t) - 1 - delta_t``; the prefix ``E_t = sum_{u <= t} delta_u`` along the row
(it carries across tool tokens). tests/test_diagnose_checks.py compares these with
``mismatch_metrics`` on the same rows padded.

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

from dataclasses import dataclass

import numpy as np

from creditlab.diagnose.schema import ENGINE_SOURCE, LOGPROB_TOL
from reference.diagnose_inmemory.readers import DERIVE_TURN, Dump

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


@dataclass
class TokenStats:
    """Flat per-token arrays (``M`` tokens) and per-row sums (``N`` rows) of a dump."""

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


def token_stats(dump: Dump) -> TokenStats:
    """The :class:`TokenStats` of ``dump`` (which must have token columns)."""
    t = dump.tokens
    assert t is not None
    N = len(dump)
    lengths = t.lengths
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
    # rows whose logprobs are the engine's own (verl bypass mode): nothing to compare them with
    source = dump.texts.get("logprobs_source")
    engine = np.zeros(N, dtype=bool)
    if source is not None:
        engine = np.asarray([s is not None and s.startswith(ENGINE_SOURCE) for s in source], dtype=bool) & t.has_tokens
    engine_all = bool(engine.any()) and bool(engine[t.has_tokens].all())
    if engine.any():
        usable = usable & ~np.repeat(engine, lengths)
    # one computation stored twice: bit-identical on every usable token (of the dump, or of a file)
    same = usable & (lp == rlp)
    n_usable = int(usable.sum())
    copied_all = n_usable > 0 and int(same.sum()) == n_usable
    copied_files: tuple[int, ...] = ()
    copied = None
    if not copied_all and n_usable:
        tok_file = dump.row_file[row]
        F = len(dump.files)
        u_f = np.bincount(tok_file[usable], minlength=F)
        s_f = np.bincount(tok_file[same], minlength=F)
        files = np.flatnonzero((u_f >= COPY_MIN_TOKENS) & (s_f == u_f))
        if files.size:
            copied_files = tuple(int(f) for f in files)
            copied = usable & np.isin(tok_file, files)
            usable = usable & ~copied
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
    return TokenStats(row=row, policy=policy, nonfinite=nonfinite, positive=positive, zero_fill=zero_fill,
                      placeholder=placeholder, zero_side=zero_side, padding=padding,
                      usable=usable, delta=delta, prefix=prefix, turn=turn, row_usable=row_usable,
                      row_delta=row_delta, row_policy=row_policy, copied_all=copied_all, copied_files=copied_files,
                      copied=copied, engine_rows=int(engine.sum()), engine_all=engine_all,
                      rejected=None if t.rejected is None else t.rejected & policy,
                      zero_rows=(int(zero_engine.sum()), int(zero_learner.sum())),
                      padded_rows=int(np.unique(row[padding]).size))
