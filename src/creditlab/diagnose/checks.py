"""The checks of ``creditlab diagnose``: one registry, one function per check.

A check reads a :class:`Context` (the dump and its token quantities, reduced per row as the dump was
read: :class:`~creditlab.diagnose._tokens.RowStats`) and returns an :class:`Outcome`;
:func:`run_checks` adds what the registry knows (id, title, threshold, fix) and turns missing columns
into ``skipped`` results with the reason. Statuses: ``ok``, ``warn``, ``fail``, ``skipped``. Thresholds
and the reasons for them are in docs/diagnose.md.

Trends over training compare the first and the last quarter of the dump's steps ("early" and
"late"; at least 4 distinct steps). A per-row value may be null in some rows: a trend uses the rows
that have it and says how many, and is only judged when each quarter has it in at least half of its
rows (and in ``MIN_PHASE_ROWS``); otherwise the check is skipped with that reason, or, for a
secondary quantity (precision beside the length), judged without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from creditlab.core.diagnostics import CheckParams, mixing_score, p_cover, trajectory_ess
from creditlab.core.registry import Registry
from creditlab.diagnose._tokens import COPY_MIN_TOKENS, MEASURABLE, POSITIVE_TOL, RUN_GAP, RUN_MIN, MismatchRows
from creditlab.diagnose._trl_logs import FORMAT_TRL
from creditlab.diagnose._trl_logs import NO_LOGPROBS as TRL_NO_LOGPROBS
from creditlab.diagnose.calibration import Calibration, MeasuredThreshold, calibration
from creditlab.diagnose.readers import FORMAT_VERL, Dump
from creditlab.diagnose.schema import TOKEN_COLUMNS
from creditlab.errors import ConfigError, InputError

__all__ = [
    "CHECKS",
    "CHECK_PARAMS",
    "Check",
    "CheckResult",
    "Context",
    "Outcome",
    "STATUSES",
    "Threshold",
    "format_value",
    "register_check",
    "run_checks",
]

STATUSES = ("ok", "warn", "fail", "info", "skipped")
"""``info``: the check measured its value, and no calibrated verdict exists for it (its threshold was not
measured, or not in a unit that carries over to this run): the value and what it means, never a pass."""
MIN_PHASE_ROWS, MIN_PHASE_SHARE = 4, 0.5
"""A trend needs a per-row value in at least this many rows, and this share of the rows, of both the
first and the last quarter of steps."""


@dataclass(frozen=True)
class Threshold:
    """Where a check's value turns into ``warn`` and ``fail``.

    ``direction`` "above": worse as the value grows (``value >= warn`` warns); "below": worse as it
    shrinks. ``None``: that level is never reached on the value alone. ``note`` says what else the
    status needs (e.g. precision falling too).
    """

    warn: float | None
    fail: float | None
    direction: str = "above"
    note: str = ""
    measured: bool = False
    """A measured threshold (a calibration's): ``warn`` is the worst value measured safe, so only a value beyond
    it warns, and ``fail`` the best value measured unsafe, which fails itself (:meth:`level`)."""

    def level(self, value: float) -> str:
        """``fail``, ``warn`` or ``ok`` of ``value`` on the value alone (a measured threshold: strictly beyond
        ``warn``, at or beyond ``fail``; otherwise at or beyond each, or below for ``direction`` "below")."""
        above = self.direction == "above"

        def past(t: float, inclusive: bool) -> bool:
            return (value >= t if inclusive else value > t) if above else (value <= t if inclusive else value < t)

        if self.fail is not None and past(self.fail, True if self.measured else above):
            return "fail"
        if self.warn is not None and past(self.warn, not self.measured and above):
            return "warn"
        return "ok"

    def text(self) -> str:
        if self.measured:
            op_w, op_f = (">", ">=") if self.direction == "above" else ("<", "<=")
        else:
            op_w = op_f = ">=" if self.direction == "above" else "<"
        parts = []
        if self.warn is not None:
            parts.append(f"warn {op_w} {format_value(self.warn)}")
        if self.fail is not None:
            parts.append(f"fail {op_f} {format_value(self.fail)}")
        s = ", ".join(parts)
        return f"{s}; {self.note}" if self.note and s else (self.note or s)

    def to_json(self) -> dict[str, Any]:
        return {"warn": self.warn, "fail": self.fail, "direction": self.direction, "note": self.note,
                "measured": self.measured}


@dataclass
class Outcome:
    """What a check function returns. ``message``: one sentence of evidence."""

    status: str
    value: float | None
    message: str
    details: dict[str, Any] = field(default_factory=dict)
    series: dict[str, Any] = field(default_factory=dict)


@dataclass
class CheckResult:
    """One verdict: what :func:`run_checks` returns and ``diagnose.json`` stores."""

    id: str
    title: str
    status: str
    value: float | None
    threshold: Threshold
    message: str
    fix: str
    details: dict[str, Any] = field(default_factory=dict)
    series: dict[str, Any] = field(default_factory=dict)
    plot: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "title": self.title, "status": self.status, "value": _jsonable(self.value),
                "threshold": self.threshold.to_json(), "message": self.message, "fix": self.fix,
                "details": {k: _jsonable(v) for k, v in self.details.items()}, "plot": self.plot}


@dataclass(frozen=True)
class Check:
    id: str
    title: str
    needs: tuple[str, ...]
    threshold: Threshold
    fix: str
    fn: Callable[[Context], Outcome]


CHECKS: Registry[Check] = Registry("check", key=lambda check: check.fn)
"""Every registered check by id, in report order."""


def register_check(id: str, *, title: str, needs: Sequence[str], threshold: Threshold, fix: str):
    """Decorator registering ``fn(ctx) -> Outcome`` as check ``id``; ``needs``: the columns without
    which it is skipped. Registering the same function again is a no-op; another function under a
    taken id raises :class:`ConfigError` naming the function it is registered to."""

    def deco(fn: Callable[[Context], Outcome]) -> Callable[[Context], Outcome]:
        CHECKS.register(id, Check(id, title, tuple(needs), threshold, fix, fn))
        return fn

    return deco


# ------------------------------------------------------------------------------------------------
# context: the dump and what several checks share
# ------------------------------------------------------------------------------------------------


class Context:
    """The dump, with the quantities several checks share computed once on first use. ``max_turns``:
    the turns the by-turn plot draws (``--max-turns``); every check reads every turn."""

    def __init__(self, dump: Dump, *, max_turns: int = 16):
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 2:
            raise ConfigError("max_turns", f"must be an integer >= 2, got {max_turns!r}")
        self.dump = dump
        self.max_turns = max_turns
        self.steps, self.step_code = np.unique(dump.step, return_inverse=True)

    @cached_property
    def tokens(self) -> MismatchRows:
        """The rows' token sums, copied files left out (the dump must have token columns)."""
        return self.dump.mismatch()

    @cached_property
    def units(self) -> dict[str, float]:
        """The transfer experiment's candidate units on this dump (:func:`mismatch_units`), computed once for the
        checks that read them."""
        return mismatch_units(self)

    @property
    def n_steps(self) -> int:
        return int(self.steps.shape[0])

    def phases(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Row masks of the first and the last quarter of the steps (None below 4 steps)."""
        S = self.n_steps
        if S < 4:
            return None
        q = max(1, S // 4)
        return self.step_code < q, self.step_code >= S - q

    def per_step(self, values: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """Mean of a per-row value at each step over rows where it is finite (NaN where none)."""
        ok = np.isfinite(values) if rows is None else np.isfinite(values) & rows
        n = np.bincount(self.step_code[ok], minlength=self.n_steps)
        s = np.bincount(self.step_code[ok], weights=values[ok], minlength=self.n_steps)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 0, s / np.maximum(n, 1), np.nan)

    def coverage(self, values: np.ndarray, name: str) -> tuple[str | None, str]:
        """Whether a per-row value (NaN = missing) can carry an early-vs-late trend: ``(reason, note)``.

        ``reason`` is None when both quarters of steps have the value in at least half of their rows
        and in ``MIN_PHASE_ROWS`` rows, else why not ("0 of the 64 rows of the last quarter of steps
        have precision, ..."); ``note`` is "" when every row has the value, else "name in K of N rows"
        for the evidence.
        """
        have = np.isfinite(values)
        n, k = int(have.size), int(have.sum())
        note = "" if k == n else f"{name} in {k:,} of {n:,} rows"
        phases = self.phases()
        if phases is None:
            return f"needs at least 4 training steps for a trend, got {self.n_steps}", note
        for rows, which in zip(phases, ("first", "last"), strict=True):
            m, h = int(rows.sum()), int((have & rows).sum())
            if h < max(MIN_PHASE_ROWS, MIN_PHASE_SHARE * m):
                return (f"{h:,} of the {m:,} rows of the {which} quarter of steps have {name}, and a trend needs at "
                        f"least half of them (and {MIN_PHASE_ROWS})"), note
        return None, note

    def length_unit_mix(self) -> str | None:
        """Why lengths cannot be compared across files (characters in some, tokens in others), or None."""
        units = {u for u in self.dump.length_units if u is not None}
        if len(units) < 2:
            return None
        return "response_length is in characters in some files and in tokens in others (see the input warnings)"

    def lengths(self) -> tuple[np.ndarray, str] | None:
        """Response length per row and its unit: ``response_length`` (in the unit the readers found),
        else the policy tokens, else the characters of ``response``."""
        d = self.dump
        if d.has("response_length"):
            units = {u for u in d.length_units if u is not None}
            if len(units) == 1:
                unit = units.pop()
            else:
                unit = "characters" if all(f == FORMAT_VERL for f in d.formats) else "tokens"
            return d.scalars["response_length"], unit
        if d.has("policy_mask"):
            out = self.tokens.rows.policy.astype(np.float64)
            out[~self.tokens.rows.has_tokens] = np.nan
            return out, "policy tokens"
        if d.has("response"):
            return d.response_chars.copy(), "characters"
        return None


def _early_late(x: np.ndarray, phases: tuple[np.ndarray, np.ndarray]) -> tuple[float, float]:
    early, late = phases
    e, l_ = x[early & np.isfinite(x)], x[late & np.isfinite(x)]
    return (float(e.mean()) if e.size else math.nan, float(l_.mean()) if l_.size else math.nan)


def format_value(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    x = float(x)
    if x == 0:
        return "0"
    if abs(x) >= 1e4 or abs(x) < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}" if abs(x) >= 1 else f"{x:.{digits}f}".rstrip("0").rstrip(".")


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, np.ndarray):
        return [_jsonable(v) for v in x.tolist()]
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    return x


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if x >= 0.01 or x == 0 else f"{100 * x:.2g}%"


def _excluded(ctx: Context) -> str:
    """What the token-level evidence leaves out: flagged tokens, copied files, rows without tokens."""
    ts = ctx.tokens
    d = ctx.dump
    out = []
    nf = int(ts.rows.nonfinite.sum())
    if nf:
        out.append(f"{nf:,} tokens with a NaN/inf log-prob (mismatch.nonfinite_logprobs) left out")
    for cause in _flag_causes(ts, short=True):
        out.append(f"{cause} (mismatch.placeholder_logprobs) left out")
    if ts.copied_files:
        names = ", ".join(Path(d.files[f]).name for f in ts.copied_files[:3])
        more = f" and {len(ts.copied_files) - 3} more" if len(ts.copied_files) > 3 else ""
        out.append(f"{ts.copied:,} tokens of {names}{more}, whose rollout_logprobs equal logprobs, left out")
    no_tok = int((~ts.rows.has_tokens).sum())
    if no_tok:
        out.append(f"token columns in {len(d) - no_tok:,} of {len(d):,} rows")
    if ts.engine_rows:
        out.append(f"{ts.engine_rows:,} rows whose logprobs_source says logprobs are the engine's left out")
    return f" ({'; '.join(out)})" if out else ""


def _flag_causes(ts: MismatchRows, *, short: bool = False) -> list[str]:
    """What the placeholder flags found, one phrase per cause, most telling first: a side that is 0.0 on
    every policy token of rows, padding, then the token-level findings. ``short``: with counts and the
    check's name, for the other checks' evidence."""
    out = []
    r = ts.rows
    eng, lrn = ts.zero_rows
    zs, pad = int(r.zero_side.sum()), int(r.padding.sum())
    rows = ts.padded_rows
    if short:
        if zs:
            which = " and ".join(x for x, k in (("rollout_logprobs", eng), ("logprobs", lrn)) if k)
            out.append(f"{zs:,} tokens of {eng + lrn:,} rows whose {which} are 0.0 throughout")
        if pad:
            out.append(f"{pad:,} padding tokens ending {rows:,} row{'s' if rows > 1 else ''}")
        rest = int(r.positive.sum() + r.zero_fill.sum() + r.placeholder.sum())  # disjoint by construction
        if rest:
            out.append(f"{rest:,} tokens with placeholder values")
        return out
    if eng:
        out.append(f"rollout_logprobs exactly 0.0 on every policy token of {eng:,} row{'s' if eng > 1 else ''}: the "
                   "engine returned no log-probs there")
    if lrn:
        out.append(f"logprobs exactly 0.0 on every policy token of {lrn:,} row{'s' if lrn > 1 else ''}: the learner "
                   "never scored them")
    if pad:
        out.append(f"{pad:,} padding tokens in the policy mask (runs of {RUN_MIN}+ tokens with log-prob exactly 0.0 "
                   f"on both sides ending {rows:,} row{'s' if rows > 1 else ''})")
    pos, zf, ph = (int(x.sum()) for x in (r.positive, r.zero_fill, r.placeholder))
    if pos:
        out.append(f"{pos:,} above 0")
    if zf:
        out.append(f"{zf:,} exactly 0.0 on one side where the other gives < e^-{RUN_GAP}")
    if ph:
        out.append(f"{ph:,} in runs of {RUN_MIN}+ repeated values where the models differ by > {RUN_GAP} nats (a "
                   f"run of 0.0: by > {RUN_GAP} nats over the run)")
    return out


def _unusable_outcome(ctx: Context) -> Outcome | None:
    """Skipped, naming the cause, when the dump has policy tokens but every one is flagged (placeholders,
    padding, NaN/inf): what is left is no evidence about precision."""
    ts = ctx.tokens
    if ts.rows.usable.any():
        return None
    P = int(ts.rows.policy.sum())
    if P == 0:
        return Outcome("skipped", None, "No policy tokens in the dump.")
    if ts.engine_rows and ts.engine_all:
        return None  # the engine outcome says why
    parts = [f"{c} (mismatch.placeholder_logprobs)" for c in _flag_causes(ts, short=True)]
    nf = int(ts.rows.nonfinite.sum())
    if nf:
        parts.append(f"{nf:,} with a NaN/inf log-prob (mismatch.nonfinite_logprobs)")
    if ts.copied:
        parts.append(f"{ts.copied:,} in files whose rollout_logprobs equal logprobs")
    if ts.engine_rows:
        parts.append(f"{ts.engine_rows:,} rows whose logprobs_source says logprobs are the engine's")
    return Outcome("skipped", None, f"No usable policy token: all {P:,} are flagged or left out ({'; '.join(parts)}), "
                   "so there is no precision evidence to judge; the check named beside each count gives the cause "
                   "and its fix.", {"policy_tokens": P})


COPIED = ("rollout_logprobs equal logprobs on every policy token: the dump holds one log-prob computation twice "
          "(a copied column, or a trainer that overwrote one with the other, e.g. verl's bypass mode), so no "
          "mismatch can be measured")


ENGINE = ("logprobs_source says logprobs are the rollout engine's own ({source}): the learner's log-probs were "
          "never computed (verl's bypass mode sets old_log_probs := rollout_log_probs), so no mismatch can be "
          "measured; run a step with bypass_mode false, or dump the learner's log-probs, to measure it")


def _engine_outcome(ctx: Context) -> Outcome | None:
    """Skipped, with the reason, when every row with tokens has the engine's log-probs as ``logprobs``."""
    if not ctx.tokens.engine_all:
        return None
    src = next(s for s in ctx.dump.sources if s is not None)
    return Outcome("skipped", None, ENGINE.format(source=src) + ".", {"engine_rows": ctx.tokens.engine_rows})


def _copied_outcome(ctx: Context, *, headline: bool = False) -> Outcome | None:
    """The finding for a dump whose two log-prob columns are bit-identical, or None.

    ``headline`` (mismatch.k3): a warning with the evidence (skipped below ``COPY_MIN_TOKENS`` tokens,
    which can agree by chance); the other mismatch checks are skipped with the reason."""
    engine = _engine_outcome(ctx)
    if engine is not None:
        return engine
    ts = ctx.tokens
    if not ts.copied_all:
        return None
    n = int(ts.rows.usable.sum())
    if not headline:
        return Outcome("skipped", None, f"{COPIED} (see mismatch.k3).")
    if n < COPY_MIN_TOKENS:
        return Outcome("skipped", None, f"All {n:,} usable policy tokens have rollout_logprobs equal to logprobs: too "
                       f"few ({n} < {COPY_MIN_TOKENS}) to tell a copied column from close models, and no mismatch "
                       "to measure.", {"tokens": n, "identical": n})
    return Outcome("warn", None, f"{COPIED} ({n:,} of {n:,} usable policy tokens bit-identical); dump the engine's "
                   "own log-probs, unless engine and learner are bitwise identical by design (batch-invariant "
                   "kernels).", {"tokens": n, "identical": n, "copied": True},
                   {"steps": ctx.steps, "k3": np.zeros(ctx.n_steps)})


def _verb(a: float, b: float) -> str:
    """How a positive quantity moved from ``a`` to ``b``: grows, shrinks or stays (within 1%)."""
    if b > a * 1.01:
        return "grows"
    if b < a * 0.99:
        return "shrinks"
    return "stays"


# ------------------------------------------------------------------------------------------------
# execution mismatch
# ------------------------------------------------------------------------------------------------

K3_WARN, K3_FAIL, K3_FLOOR = 1e-3, 1e-2, 1e-4
#: Where the fixes below come from: the mismatch lab's results, row by row (docs/correction.md).
_WHAT_TO_USE = "docs/correction.md, \"What to use, by what your dumps show\", says what the mismatch lab measured"


@register_check(
    "mismatch.k3", title="K3(engine || learner) per policy token", needs=TOKEN_COLUMNS,
    threshold=Threshold(K3_WARN, K3_FAIL, note=f"warn too when the last quarter of steps is >= 2x the first "
                                               f"and >= {K3_FLOOR:g}"),
    fix="Score with a learner in the engine's precision (QAT), which removes most of a quantized engine's "
        "mismatch, and keep PPO's dual clip (verl `clip_ratio_c=3`, TRL `GRPOConfig(delta=3)`); a K3 rising late "
        f"points to a stale weight sync or a changed engine setting before any correction. {_WHAT_TO_USE}.")
def check_k3(ctx: Context) -> Outcome:
    copied = _copied_outcome(ctx, headline=True)
    if copied is not None:
        return copied
    unusable = _unusable_outcome(ctx)
    if unusable is not None:
        return unusable
    ts = ctx.tokens
    r = ts.rows
    n = int(r.usable.sum())
    k3 = float(r.sum_k3.sum() / n)  # sum_k3: the sum of expm1(delta) - delta over a row's usable tokens
    cnt = np.bincount(ctx.step_code, weights=r.usable, minlength=ctx.n_steps)
    tot = np.bincount(ctx.step_code, weights=r.sum_k3, minlength=ctx.n_steps)
    with np.errstate(invalid="ignore", divide="ignore"):
        by_step = np.where(cnt > 0, tot / np.maximum(cnt, 1), np.nan)
    details: dict[str, Any] = {"k3": k3, "tokens": n, "k3_max_step": float(np.nanmax(by_step))}
    kept_note = ""
    if ts.has_rejected:  # rejection sampling (verl rollout_rs): K3 of what the loss still sees
        n_kept = int(r.kept.sum())
        k3_kept = float(r.sum_k3_kept.sum() / n_kept) if n_kept else math.nan
        details.update(k3_kept=k3_kept, tokens_kept=n_kept, tokens_rejected=n - n_kept)
        kept_note = (f"; over the {n_kept:,} policy tokens rejection sampling kept it is {format_value(k3_kept)} "
                     f"({n - n_kept:,} rejected: the value covers every policy token the engine sampled)")
    phases = ctx.phases()
    trend = ""
    rising = False
    if phases is not None:
        q = max(1, ctx.n_steps // 4)
        e_cnt, l_cnt = cnt[:q].sum(), cnt[-q:].sum()
        early = float(tot[:q].sum() / e_cnt) if e_cnt else math.nan
        late = float(tot[-q:].sum() / l_cnt) if l_cnt else math.nan
        details.update(early=early, late=late)
        rising = bool(late >= 2 * early and late >= K3_FLOOR)
        if e_cnt and l_cnt:
            trend = f"; {format_value(early)} in the first quarter of steps and {format_value(late)} in the last" + \
                (" (rising late)" if rising else "")
        else:
            trend = f"; no trend: no usable policy token in the {'first' if not e_cnt else 'last'} quarter of steps"
    status = "fail" if k3 >= K3_FAIL else "warn" if k3 >= K3_WARN or rising else "ok"
    msg = (f"K3 between engine and learner is {format_value(k3)} per policy token over {n:,} tokens{trend}"
           f"{kept_note}{_excluded(ctx)}.")
    if ts.copied_files:  # part of the dump holds one computation twice: not a clean pass either
        status = "warn" if status == "ok" else status
        details["copied_files"] = [ctx.dump.files[f] for f in ts.copied_files]
        msg += (f" In {len(ts.copied_files)} file{'s' if len(ts.copied_files) > 1 else ''} rollout_logprobs equal "
                "logprobs on every policy token (a copied column, or a trainer that overwrote one): dump the "
                "engine's own log-probs there.")
    return Outcome(status, k3, msg, details, {"steps": ctx.steps, "k3": by_step})


#: The fewest usable policy tokens a turn needs to count in ``mismatch.prefix_drift``'s turn profile.
TURN_MIN_TOKENS = 20


def turn_profile(ctx: Context) -> dict[str, np.ndarray]:
    """By turn, every turn of the dump: tokens, mean and RMS of the current (``delta``) and the prefix
    (``E``) log ratio over the usable policy tokens of turn ``k``. The turns (``"turn"``) are
    ``0 .. max_turns - 1`` (with 0 tokens where none) and every later turn that has usable tokens."""
    tt = ctx.tokens.turns  # sums over the usable policy tokens of each (row, turn)
    turns = np.union1d(np.arange(ctx.max_turns), np.unique(tt.turn))  # turn ids may be sparse
    T = turns.shape[0]
    k = np.searchsorted(turns, tt.turn)
    n = np.bincount(k, weights=tt.n, minlength=T)
    with np.errstate(invalid="ignore", divide="ignore"):
        def mean(sums):
            return np.where(n > 0, np.bincount(k, weights=sums, minlength=T) / np.maximum(n, 1), np.nan)

        return {"turn": turns, "tokens": n, "current_mean": mean(tt.sum_delta), "prefix_mean": mean(tt.sum_prefix),
                "current_rms": np.sqrt(mean(tt.sum_delta2)), "prefix_rms": np.sqrt(mean(tt.sum_prefix2))}


def mismatch_units(ctx: Context) -> dict[str, float]:
    """The candidate units of the mismatch lab's transfer experiment on this dump, and what its domain is
    judged by, each as :func:`creditlab.core.diagnostics.batch_check_values` computes it on one batch (a dump
    of one step gives the same values):

    * ``total``: the RMS prefix log ratio at the last turn with ``TURN_MIN_TOKENS`` usable tokens (NaN
      below 2 such turns), ``mismatch.prefix_drift``'s statistic;
    * ``per_token``: K3 per usable policy token (``mismatch.k3``'s);
    * ``ess``: the trajectory ESS share of the sequence ratios ``exp(sum_t delta_t)`` of each step's rows
      with usable tokens (steps of ``SEQ_MIN_ROWS``+ such rows; the median over those steps, NaN when none);
    * ``policy_tokens``: usable policy tokens per row, ``turns``: turns with usable tokens per row (means
      over the rows with usable tokens)."""
    r, tt = ctx.tokens.rows, ctx.tokens.turns
    rows = r.usable > 0
    n = float(r.usable.sum())
    prof = turn_profile(ctx)
    good = np.flatnonzero(prof["tokens"] >= TURN_MIN_TOKENS)
    total = float(prof["prefix_rms"][good[-1]]) if good.size >= 2 else math.nan
    code = ctx.step_code[rows]
    lw_all = r.sum_delta[rows]
    ess = [float(trajectory_ess(torch.from_numpy(lw))) for lw in (lw_all[code == s] for s in np.unique(code))
           if lw.size >= SEQ_MIN_ROWS]
    turns = np.bincount(tt.row[tt.n > 0], minlength=r.usable.shape[0])
    return {"total": total, "per_token": float(r.sum_k3.sum() / n) if n else math.nan,
            "ess": float(np.median(ess)) if ess else math.nan, "ess_steps": len(ess),
            "policy_tokens": float(r.usable[rows].mean()) if rows.any() else math.nan,
            "turns": float(turns[rows].mean()) if rows.any() else math.nan}


#: What each candidate unit of the transfer experiment is, for the thresholds' notes and the messages.
UNIT_WORDS = {"total": "RMS prefix log ratio at the last turn (nats)", "per_token": "K3 per policy token",
              "ess": "trajectory ESS share of the sequence ratios", "seq_ratio": "median |log product ratio| in the "
                                                                                 "longest length quartile (nats)"}


#: Why a calibrated check has no verdict when the package's calibration file is missing (a broken install).
NO_CALIBRATION = "creditlab's calibration.json is missing from the installed package (reinstall creditlab)"


def measured_threshold(check_id: str) -> Threshold:
    """A check's threshold under the package's calibration (:mod:`creditlab.diagnose.calibration`): the measured
    one when the transfer run calibrated it, none (the check says ``info``) when the run gave it no calibrated
    verdict or the calibration file is missing."""
    cal = calibration()
    t = cal.thresholds.get(check_id) if cal is not None else None
    if t is None:
        return Threshold(None, None, note=f"no calibrated verdict: {cal.why if cal else NO_CALIBRATION} (status "
                                          "info)")
    return Threshold(t.warn, t.fail, t.direction, note=f"{UNIT_WORDS[t.unit]}, measured by {cal.run} in "
                     f"{' and '.join(cal.worlds)} ({cal.policy_tokens[0]:,.0f}-{cal.policy_tokens[1]:,.0f} policy "
                     "tokens per trajectory); outside that domain it warns at most", measured=True)


def calibrated_status(ctx: Context, check_id: str, units: dict[str, float], own: float | None,
                      details: dict[str, Any]) -> tuple[str, float | None, str]:
    """(status, value, sentence to add) of a calibrated check whose own statistic is ``own``: the value in the
    calibration's unit judged by its measured threshold, with no ``fail`` outside the measured domain; ``info``
    with ``own`` where the transfer run gave the check no calibrated verdict (or the calibration file is
    missing). ``details`` gains ``domain`` and ``in_domain`` (when there is a calibration)."""
    cal: Calibration | None = calibration()
    if cal is None:
        return "info", own, f" No calibrated verdict: {NO_CALIBRATION}."
    inside = cal.in_domain(units["policy_tokens"], units["turns"])
    details.update(domain=cal.domain(), in_domain=inside)
    t: MeasuredThreshold | None = cal.thresholds.get(check_id)
    if t is None:
        return "info", own, f" No calibrated verdict: {cal.why}."
    value = units[t.unit]
    if value is None or not math.isfinite(value):
        return "skipped", None, f" Its calibrated unit ({UNIT_WORDS[t.unit]}) cannot be computed on this dump."
    status = measured_threshold(check_id).level(value)
    extra = f" In the calibrated unit, {UNIT_WORDS[t.unit]}, it is {format_value(value)}."
    if not inside:
        status = "warn" if status == "fail" else status
        extra += " " + cal.outside(units["policy_tokens"], units["turns"])
    return status, value, extra


@register_check(
    "mismatch.prefix_drift", title="Prefix vs current log ratio by turn", needs=TOKEN_COLUMNS,
    threshold=measured_threshold("mismatch.prefix_drift"),
    fix="Drift from actions that decide which states later turns reach: the untruncated execution-prefix ratio "
        "(`prefix:eps_low=1e6,eps_high=1e6`; verl `rollout_is: creditlab_prefix:eps_low=1e6,eps_high=1e6`), "
        "which token-level TIS/MIS never see (InterQ at its default envelope resolved no gain there); drift "
        f"spread over free text no later state depends on: nothing beyond the dual clip. {_WHAT_TO_USE}.")
def check_prefix_drift(ctx: Context) -> Outcome:
    copied = _copied_outcome(ctx) or _unusable_outcome(ctx)
    if copied is not None:
        return copied
    prof = turn_profile(ctx)
    good = np.flatnonzero(prof["tokens"] >= TURN_MIN_TOKENS)  # every turn of the dump counts
    drawn = prof["turn"] < ctx.max_turns  # --max-turns limits the plot, never the value
    series: dict[str, Any] = {k: v[drawn] for k, v in prof.items()}
    hidden = prof["turn"][good][prof["turn"][good] >= ctx.max_turns]
    not_drawn = ""
    if hidden.size:
        series["not_drawn"] = (int(hidden.size), int(hidden[0]), int(hidden[-1]), ctx.max_turns)
        not_drawn = (f" The plot draws turns 0-{ctx.max_turns - 1} (--max-turns {ctx.max_turns}); the "
                     f"{hidden.size:,} later turn{'s' if hidden.size > 1 else ''} with {TURN_MIN_TOKENS}+ tokens "
                     f"({_span(hidden)}) {'are' if hidden.size > 1 else 'is'} left out of it, not of the value.")
    units = ctx.units
    if good.size < 2:
        return Outcome("skipped", None, f"Needs policy tokens in at least 2 turns ({TURN_MIN_TOKENS}+ tokens each); "
                       f"this dump has {good.size}: without a history there is nothing to compound.",
                       {"units": units}, series=series)
    first, last = int(prof["turn"][good[0]]), int(prof["turn"][good[-1]])
    p0, pK = float(prof["prefix_rms"][good[0]]), float(prof["prefix_rms"][good[-1]])
    c0, cK = float(prof["current_rms"][good[0]]), float(prof["current_rms"][good[-1]])
    flat = cK <= max(2 * c0, c0 + 1e-3)  # changes below 1e-3 nats are float noise, not growth
    verb = _verb(p0, pK)
    if flat:
        cur = f"while the current one stays flat ({format_value(c0)} -> {format_value(cK)})"
    else:
        cur = f"and the current one grows{' too' if verb == 'grows' else ''} ({format_value(c0)} -> {format_value(cK)})"
    span = (f"{verb} from {format_value(p0)} at turn {first} to {format_value(pK)} nats at turn {last}"
            if verb != "stays" else f"stays at {format_value(pK)} nats from turn {first} to turn {last}")
    msg = f"The RMS prefix log ratio {span} {cur}{_excluded(ctx)}.{not_drawn}"
    details = {"turn_first": first, "turn_last": last, "prefix_rms_first": p0, "prefix_rms_last": pK,
               "current_rms_first": c0, "current_rms_last": cK,
               "prefix_mean_last": float(prof["prefix_mean"][good[-1]]), "current_flat": flat,
               "turns": int(good.size), "turns_not_drawn": int(hidden.size), "units": units}
    status, value, extra = calibrated_status(ctx, "mismatch.prefix_drift", units, pK, details)
    return Outcome(status, value, msg + extra, details, series)


def _span(turns: np.ndarray) -> str:
    """"turn 17", "turns 16-29" (consecutive) or "turns 16, 18 and 40"."""
    t = [int(x) for x in turns]
    if len(t) == 1:
        return f"turn {t[0]}"
    if t[-1] - t[0] == len(t) - 1:
        return f"turns {t[0]}-{t[-1]}"
    head = ", ".join(map(str, t[:4]))
    return f"turns {head} and {len(t) - 4} more" if len(t) > 5 else f"turns {', '.join(map(str, t[:-1]))} and {t[-1]}"


ONE_SIDED_WARN, ONE_SIDED_FAIL, MIN_MEASURABLE, NEGLIGIBLE_SHARE = 0.75, 0.9, 100, 0.05


@register_check(
    "mismatch.one_sided", title="One-sided mismatch (truncated engine log-probs)", needs=TOKEN_COLUMNS,
    threshold=Threshold(ONE_SIDED_WARN, ONE_SIDED_FAIL,
                        note=f"share of tokens with |delta| > {MEASURABLE:g} on the majority side"),
    fix="Make the engine report log-probs of the distribution the learner scores (no top-k/top-p at sampling, "
        "or the same truncation in the learner); until then bounded token weights (`tis`, `interq`) cap the "
        "bias, but do not remove it.")
def check_one_sided(ctx: Context) -> Outcome:
    copied = _copied_outcome(ctx) or _unusable_outcome(ctx)
    if copied is not None:
        return copied
    r = ctx.tokens.rows
    size = int(r.usable.sum())  # usable tokens, with delta = logprobs - rollout_logprobs
    m = int(r.measurable.sum())  # ... with |delta| > MEASURABLE
    rows = r.usable > 0
    bias = float(r.sum_delta.sum() / size) if size else 0.0
    seq_bias = float(r.sum_delta[rows].mean()) if rows.any() else 0.0
    details = {"tokens": size, "measurable": m, "bias_per_token": bias, "bias_per_sequence": seq_bias}
    if size == 0:
        return Outcome("skipped", None, "No usable policy tokens.")
    if m < MIN_MEASURABLE:
        if m <= NEGLIGIBLE_SHARE * size:  # (almost) no token differs: there is no side to take
            return Outcome("ok", 0.0, f"No measurable mismatch: |delta| <= {MEASURABLE:g} on {size - m:,} of "
                           f"{size:,} policy tokens.", details)
        return Outcome("skipped", None, f"Too few measurable tokens to tell a side: |delta| > {MEASURABLE:g} on "
                       f"{m:,} of {size:,} policy tokens ({m:,} < {MIN_MEASURABLE}).", details)
    above = float(r.measurable_neg.sum() / m)  # delta = learner - engine < 0: the engine is above
    share = max(above, 1 - above)
    details.update(engine_above=above)
    side = "engine log-probs above the learner's" if above >= 0.5 else "learner log-probs above the engine's"
    status = "fail" if share >= ONE_SIDED_FAIL else "warn" if share >= ONE_SIDED_WARN else "ok"
    if status == "ok":
        msg = (f"The mismatch is two-sided: the engine is above the learner on {_pct(above)} of {m:,} measurable "
               f"policy tokens (mean delta {format_value(bias)} nats per token).")
    else:
        why = (", the signature of an engine reporting log-probs of a top-k/top-p truncated distribution"
               if above >= 0.5 else "")
        msg = (f"{side[0].upper()}{side[1:]} on {_pct(share)} of {m:,} measurable policy tokens, a bias of "
               f"{format_value(-bias if above >= 0.5 else bias)} nats per token and {format_value(abs(seq_bias))} per "
               f"sequence{why}.")
    return Outcome(status, share, msg, details)


PLACEHOLDER_FAIL = 1e-3


@register_check(
    "mismatch.placeholder_logprobs", title="Impossible or placeholder log-probs at policy positions",
    needs=TOKEN_COLUMNS,
    threshold=Threshold(None, PLACEHOLDER_FAIL, note="share of policy tokens flagged (NaN/inf ones are "
                                                     "mismatch.nonfinite_logprobs'); warn when any is"),
    fix="Fix the policy mask: tool, observation and padding tokens must have policy_mask false (drop padding "
        "from the rows, or pass valid_mask to rows_from_arrays). A side that is 0.0 on every policy token of a "
        "row was never computed: have the engine return the sampled tokens' log-probs (vLLM "
        "`SamplingParams(logprobs=0)`) and dump those. Positive log-probs are an exporter or engine bug. "
        "creditlab's corrections ignore values at masked positions, so placeholders there are harmless once the "
        "mask is right.")
def check_placeholders(ctx: Context) -> Outcome:
    engine = _engine_outcome(ctx)
    if engine is not None:
        return engine
    ts = ctx.tokens
    r = ts.rows
    P = int(r.policy.sum())
    if P == 0:
        return Outcome("skipped", None, "No policy tokens in the dump.")
    nf = int(r.nonfinite.sum())
    bad = int(r.flagged.sum())  # NaN/inf: mismatch.nonfinite_logprobs, an engine that could not score, not a mask leak
    share = bad / P
    eng, lrn = ts.zero_rows
    details = {"policy_tokens": P, "positive": int(r.positive.sum()), "zero_fill": int(r.zero_fill.sum()),
               "repeated_runs": int(r.placeholder.sum()), "zero_rows_tokens": int(r.zero_side.sum()),
               "padding": int(r.padding.sum()), "padded_rows": ts.padded_rows, "zero_rollout_logprobs_rows": eng,
               "zero_logprobs_rows": lrn}
    nan_note = f" ({nf:,} NaN/inf log-probs are reported by mismatch.nonfinite_logprobs)" if nf else ""
    if bad == 0:
        return Outcome("ok", 0.0, f"No positive, zero-filled, repeated placeholder or padding log-probs among {P:,} "
                       f"policy tokens{nan_note}.", details)
    status = "fail" if share >= PLACEHOLDER_FAIL else "warn"
    i = int(np.flatnonzero(r.flagged)[0])  # the first row with one, and its first
    where = f"{ctx.dump.where(i)}, token {int(r.first_flagged[i])}"
    if eng or lrn:
        why = ("the engine's log-probs are placeholders, not a precision mismatch: no mismatch can be measured on "
               "those rows" if eng else "the learner's log-probs are placeholders: no mismatch can be measured "
               "on those rows")
    elif r.padding.any() and r.padding.sum() == bad:
        why = "padding marked as policy tokens: it would dilute every mismatch average"
    else:
        why = "tool/observation tokens or padding in the policy mask, or masked positions filled with a constant"
    msg = (f"{bad:,} of {P:,} policy tokens ({_pct(share)}) hold impossible or placeholder log-probs "
           f"({'; '.join(_flag_causes(ts))}), first at {where}: {why}; they are left out of the other mismatch "
           f"checks{nan_note}.")
    return Outcome(status, share, msg, details)


NONFINITE_FAIL = 1e-3


@register_check(
    "mismatch.nonfinite_logprobs", title="NaN/inf log-probs at policy positions", needs=TOKEN_COLUMNS,
    threshold=Threshold(None, NONFINITE_FAIL, note="share of policy tokens with a NaN/inf (or null) log-prob on "
                                                   "either side; warn when any is, fail on any in logprobs too"),
    fix="A NaN engine log-prob is a token the engine could not score (vLLM reports None for it): TRL reads it as "
        "NaN and gives the token an importance ratio of 1, so it is trained on uncorrected, and a rollout "
        "correction that reads it (verl's, creditlab's) gets a NaN weight. Find what makes the engine return no "
        "log-prob (with vLLM, serve `--logprobs-mode processed_logprobs` and check that the sampled token is in "
        "what the engine scores), or leave such tokens out of the policy mask. A NaN in the learner's logprobs "
        "makes the loss NaN: look for overflowing logits in its forward.")
def check_nonfinite(ctx: Context) -> Outcome:
    r = ctx.tokens.rows
    P = int(r.policy.sum())
    if P == 0:
        return Outcome("skipped", None, "No policy tokens in the dump.")
    n, n_e, n_l = int(r.nonfinite.sum()), int(r.nonfinite_engine.sum()), int(r.nonfinite_learner.sum())
    rows = int((r.nonfinite > 0).sum())
    details = {"policy_tokens": P, "nonfinite": n, "rollout_logprobs": n_e, "logprobs": n_l, "rows": rows}
    if n == 0:
        return Outcome("ok", 0.0, f"No NaN/inf log-prob among {P:,} policy tokens.", details)
    share = n / P
    status = "fail" if n_l or share >= NONFINITE_FAIL else "warn"
    i = int(np.flatnonzero(r.nonfinite)[0])  # the first row with one, and its first
    where = f"{ctx.dump.where(i)}, token {int(r.first_nonfinite[i])}"
    parts = [f"{n_e:,} in rollout_logprobs, tokens the engine could not score (TRL gives them an importance "
             "ratio of 1: no correction)" if n_e else "",
             f"{n_l:,} in logprobs, the learner's (the loss is NaN there)" if n_l else ""]
    msg = (f"{n:,} of {P:,} policy tokens ({_pct(share)}) in {rows:,} rows have a NaN/inf log-prob "
           f"({'; '.join(p for p in parts if p)}), first at {where}; they are left out of the other mismatch "
           "checks.")
    return Outcome(status, share, msg, details)


SEQ_MIN_ROWS = 8


def _quartiles(n: np.ndarray) -> np.ndarray:
    """(R,) length quartile 0-3 of each row by its length ``n`` alone, so that it does not depend on the
    order of the rows: the quartiles of ``np.array_split`` of the rows sorted by length (the last holds
    the ``R // 4`` longest), with rows of equal length all in the quartile of the highest-ranked of them.
    Without ties this is the sorted split; with many rows at the maximum length (responses cut at the
    limit) the longest quartile holds all of them."""
    R = n.shape[0]
    sizes = [len(part) for part in np.array_split(np.arange(R), 4)]
    first_rank = np.cumsum(sizes)[:-1]  # rank where quartiles 1, 2, 3 start
    top_rank = np.searchsorted(np.sort(n), n, side="right") - 1  # highest rank among the rows tied with each
    return np.searchsorted(first_rank, top_rank, side="right")


@register_check(
    "mismatch.sequence_ratio_length", title="Sequence ratio by response length", needs=TOKEN_COLUMNS,
    threshold=measured_threshold("mismatch.sequence_ratio_length"),
    fix="Use token-level or length-normalised weights (`tis`, `interq`, or the geometric mean `geo`) instead of "
        "a product of token ratios (`seq_is`).")
def check_sequence_ratio(ctx: Context) -> Outcome:
    copied = _copied_outcome(ctx) or _unusable_outcome(ctx)
    if copied is not None:
        return copied
    r = ctx.tokens.rows
    rows = np.flatnonzero(r.usable > 0)
    if rows.size < SEQ_MIN_ROWS:
        return Outcome("skipped", None, f"Needs at least {SEQ_MIN_ROWS} trajectories with policy tokens, got "
                       f"{rows.size}.")
    n = r.usable[rows].astype(np.float64)
    S = r.sum_delta[rows]
    if np.unique(n).size < 2:
        return Outcome("skipped", None, "Every trajectory has the same number of policy tokens: no length trend.")
    k = _quartiles(n)
    quart = [q for q in (np.flatnonzero(k == i) for i in range(4)) if q.size]  # ties go up: one can be empty
    out = {"lo": [], "hi": [], "prod_abs": [], "geo_abs": [], "prod_med": [], "prod_q25": [], "prod_q75": [],
           "geo_med": [], "geo_q25": [], "geo_q75": [], "rows": []}
    for q in quart:
        s, g = S[q], S[q] / n[q]
        out["lo"].append(float(n[q].min()))
        out["hi"].append(float(n[q].max()))
        out["rows"].append(int(q.size))
        out["prod_abs"].append(float(np.median(np.abs(s))))
        out["geo_abs"].append(float(np.median(np.abs(g))))
        for name, x in (("prod", s), ("geo", g)):
            lo_, med, hi_ = np.exp(np.clip(np.quantile(x, [0.25, 0.5, 0.75]), -80, 80))
            out[f"{name}_q25"].append(float(lo_))
            out[f"{name}_med"].append(float(med))
            out[f"{name}_q75"].append(float(hi_))
    series = {k: np.asarray(v) for k, v in out.items()}
    value = out["prod_abs"][-1]
    tied = (f", {out['rows'][-1]} rows: rows of one length are never split between quartiles"
            if out["rows"][-1] != rows.size // 4 else "")
    msg = (f"In the longest quartile ({out['lo'][-1]:.0f}-{out['hi'][-1]:.0f} policy tokens{tied}) the product "
           f"sequence ratio is off from 1 by a median {format_value(value)} nats (median weight "
           f"{format_value(out['prod_med'][-1])}), "
           f"against {format_value(out['prod_abs'][0])} in the shortest; the geometric mean stays within "
           f"{format_value(out['geo_abs'][-1])}.")
    details = {"longest_quartile": [out["lo"][-1], out["hi"][-1]], "median_abs_log_ratio_shortest": out["prod_abs"][0],
               "median_weight_longest": out["prod_med"][-1], "median_abs_log_geo_longest": out["geo_abs"][-1]}
    units = {**ctx.units, "seq_ratio": value}
    details["units"] = units
    status, value, extra = calibrated_status(ctx, "mismatch.sequence_ratio_length", units, value, details)
    return Outcome(status, value, msg + extra, details, series)


CHECK_PARAMS = CheckParams(logprob_tol=POSITIVE_TOL, run_min=RUN_MIN, run_gap=RUN_GAP, measurable=MEASURABLE,
                           min_measurable=MIN_MEASURABLE, negligible_share=NEGLIGIBLE_SHARE,
                           turn_min_tokens=TURN_MIN_TOKENS, max_turns=None, seq_min_rows=SEQ_MIN_ROWS)
"""The constants of the token-level checks, for :func:`creditlab.core.diagnostics.batch_check_values` (the
values the trainer integrations log each step; ``max_turns`` None: every turn of the batch counts, as every
turn of a dump does in :func:`check_prefix_drift`)."""


# ------------------------------------------------------------------------------------------------
# reward
# ------------------------------------------------------------------------------------------------

LENGTH_WARN, PRECISION_DROP = 0.3, 0.05


@register_check(
    "reward.length_hacking", title="Response length rising with the reward", needs=("reward",),
    threshold=Threshold(LENGTH_WARN, None,
                        note=f"relative length growth, first to last quarter of steps, with the reward not "
                             f"falling; fail when precision falls by >= {PRECISION_DROP} too"),
    fix="The FORK reward (`creditlab.rewards.fork`, F-beta of rubric recall and unit-level precision) makes "
        "padding and wrong content cost reward; `creditlab lab fork` shows the effect.")
def check_length_hacking(ctx: Context) -> Outcome:
    mix = ctx.length_unit_mix()
    if mix is not None:
        return Outcome("skipped", None, f"{mix[0].upper()}{mix[1:]}: lengths in two units cannot be averaged.")
    got = ctx.lengths()
    if got is None:
        return Outcome("skipped", None, "Needs response_length, token columns or response to measure length.")
    length, unit = got
    phases = ctx.phases()
    series = {"steps": ctx.steps, "length": ctx.per_step(length), "reward": ctx.per_step(ctx.dump.reward),
              "unit": unit}
    d = ctx.dump
    has_prec = d.has("precision")
    if has_prec:
        series["precision"] = ctx.per_step(d.scalars["precision"])
    if phases is None:
        return Outcome("skipped", None, f"Needs at least 4 training steps for a trend, got {ctx.n_steps}.",
                       series=series)
    name = "response_length" if d.has("response_length") else "token columns" if unit == "policy tokens" \
        else "response"
    reason, note = ctx.coverage(length, name)
    if reason is not None:
        return Outcome("skipped", None, f"Too few rows with {name} for a trend: {reason}.", series=series)
    L0, L1 = _early_late(length, phases)
    R0, R1 = _early_late(d.reward, phases)
    if not (L0 > 0):
        return Outcome("skipped", None, "No response length in the first quarter of steps.", series=series)
    g = L1 / L0 - 1
    details: dict[str, Any] = {"length_early": L0, "length_late": L1, "reward_early": R0, "reward_late": R1,
                               "unit": unit, "rows_with_length": int(np.isfinite(length).sum()), "rows": len(d)}
    rising = g >= LENGTH_WARN and R1 >= R0
    notes = [note] if note else []
    prec_reason = None
    if has_prec:
        prec_reason, prec_note = ctx.coverage(d.scalars["precision"], "precision")
        if prec_note and prec_reason is None:
            notes.append(prec_note)
    counted = f" ({'; '.join(notes)})" if notes else ""
    base = (f"Mean response length went from {format_value(L0)} to {format_value(L1)} {unit} ({g:+.0%}) while the "
            f"reward went from {format_value(R0)} to {format_value(R1)}{counted}")
    if has_prec and prec_reason is None:
        P0, P1 = _early_late(d.scalars["precision"], phases)
        details.update(precision_early=P0, precision_late=P1)
        fell = P0 - P1 >= PRECISION_DROP
        status = "fail" if rising and fell else "ok"
        p0, p1 = format_value(P0), format_value(P1)
        tail = (f" and precision fell from {p0} to {p1}: the recall-reward padding signature" if fell else
                f" and precision held ({p0} -> {p1}): the extra length is content")
        return Outcome(status, g, base + tail + ".", details, series)
    why = "no precision column to tell" if not has_prec else f"precision cannot tell: {prec_reason}"
    if rising:
        return Outcome("warn", g, base + f": the padding signature of a recall-only reward, unless the task "
                       f"rewards longer answers ({why}).", details, series)
    return Outcome("ok", g, base + ".", details, series)


PROCESS_RISE, OUTCOME_STALL, CALLS_RISE, TRUNC_RISE = 0.25, 0.1, 0.2, 0.05


@register_check(
    "reward.process_hacking", title="Process reward rising while the outcome stalls", needs=("process_reward",),
    threshold=Threshold(PROCESS_RISE, None,
                        note=f"process-reward rise in standard deviations, with the outcome rising < "
                             f"{OUTCOME_STALL} sd; fail when tool calls (+{CALLS_RISE:.0%}) or truncation "
                             f"(+{TRUNC_RISE}) rise too"),
    fix="Mix the process reward with a weight that decays to 0 (`creditlab.core.schedules.decay` with "
        "`prm_mixed_advantages`; verl `algorithm.creditlab.prm_schedule: decay`), so it shapes only early training.")
def check_process_hacking(ctx: Context) -> Outcome:
    d = ctx.dump
    proc = d.scalars["process_reward"]
    phases = ctx.phases()
    series: dict[str, Any] = {"steps": ctx.steps, "process": ctx.per_step(proc), "outcome": ctx.per_step(d.reward)}
    calls = None
    if d.turn_rows is not None:
        calls = d.turn_rows.calls  # NaN where a row has no turns
        series["tool_calls"] = ctx.per_step(calls)
    trunc = d.scalars.get("truncated")
    if trunc is not None:
        series["truncated"] = ctx.per_step(trunc)
    if phases is None:
        return Outcome("skipped", None, f"Needs at least 4 training steps for a trend, got {ctx.n_steps}.",
                       series=series)
    reason, note = ctx.coverage(proc, "process_reward")
    if reason is not None:
        return Outcome("skipped", None, f"Too few rows with process_reward for a trend: {reason}.", series=series)
    counted = f" ({note})" if note else ""
    fin = np.isfinite(proc)
    sdP = float(proc[fin].std())
    sdR = float(d.reward.std())
    P0, P1 = _early_late(proc, phases)
    R0, R1 = _early_late(d.reward, phases)
    if sdP == 0:
        return Outcome("ok", 0.0, f"The process reward is constant ({format_value(P0)}){counted}.", series=series)
    dP = (P1 - P0) / sdP
    dR = (R1 - R0) / sdR if sdR > 0 else 0.0
    details: dict[str, Any] = {"process_early": P0, "process_late": P1, "outcome_early": R0, "outcome_late": R1,
                               "process_rise_sd": dP, "outcome_rise_sd": dR, "rows_with_process": int(fin.sum()),
                               "rows": len(d)}
    act, unjudged = [], []
    for name, x, col in (("tool calls", calls, "turns"), ("truncation", trunc, "truncated")):
        if x is None:
            continue
        why, _ = ctx.coverage(x, col)
        if why is not None:
            unjudged.append(f"{name} not compared: {why}")
            continue
        A0, A1 = _early_late(x, phases)
        if name == "tool calls":
            details.update(tool_calls_early=A0, tool_calls_late=A1)
            if A0 > 0 and A1 / A0 - 1 >= CALLS_RISE:
                act.append(f"tool calls per trajectory {format_value(A0)} -> {format_value(A1)}")
        else:
            details.update(truncated_early=A0, truncated_late=A1)
            if A1 - A0 >= TRUNC_RISE:
                act.append(f"truncation {_pct(A0)} -> {_pct(A1)}")
    base = (f"The process reward moved {dP:+.2f} sd ({format_value(P0)} -> {format_value(P1)}) and the outcome "
            f"{dR:+.2f} sd ({format_value(R0)} -> {format_value(R1)}){counted}")
    tail = f" ({'; '.join(unjudged)})" if unjudged else ""
    if dP >= PROCESS_RISE and dR < OUTCOME_STALL:
        if act:
            return Outcome("fail", dP, base + f", with {' and '.join(act)}: the policy is farming the process "
                           f"reward{tail}.", details, series)
        return Outcome("warn", dP, base + f": the process reward is being optimised without the outcome{tail}.",
                       details, series)
    return Outcome("ok", dP, base + ".", details, series)


DEGENERATE_WARN, DEGENERATE_FAIL = 0.5, 0.8


@register_check(
    "baseline.degenerate_groups", title="Groups with zero reward variance", needs=("reward",),
    threshold=Threshold(DEGENERATE_WARN, DEGENERATE_FAIL, note="share of groups in the last quarter of steps "
                                                               "(all steps below 4)"),
    fix="A graded reward breaks the ties (FORK's F-beta instead of a pass/fail rubric, per-turn credit from "
        "a verifier); otherwise drop or resample zero-variance groups (dynamic sampling) or enlarge the group.")
def check_degenerate_groups(ctx: Context) -> Outcome:
    d = ctx.dump
    key = ctx.step_code.astype(np.int64) * (int(d.group.max()) + 1) + d.group
    uniq, inv = np.unique(key, return_inverse=True)
    G = uniq.shape[0]
    size = np.bincount(inv, minlength=G)
    hi = np.full(G, -np.inf)
    lo = np.full(G, np.inf)
    np.maximum.at(hi, inv, d.reward)
    np.minimum.at(lo, inv, d.reward)
    degenerate = (hi - lo) <= 1e-9 * np.maximum(1.0, np.abs(hi))
    g_step = np.zeros(G, dtype=np.int64)
    g_step[inv] = ctx.step_code
    per_step = np.bincount(g_step, weights=degenerate, minlength=ctx.n_steps) / \
        np.maximum(np.bincount(g_step, minlength=ctx.n_steps), 1)
    series = {"steps": ctx.steps, "share": per_step}
    overall = float(degenerate.mean())
    singles = int((size == 1).sum())
    phases = ctx.phases()
    if phases is not None:
        q = max(1, ctx.n_steps // 4)
        late_g = g_step >= ctx.n_steps - q
        value = float(degenerate[late_g].mean())
        early = float(degenerate[g_step < q].mean())
        span = f"; {_pct(early)} in the first quarter of steps, {_pct(value)} in the last"
    else:
        value, early, span = overall, overall, ""
    details = {"groups": G, "degenerate": int(degenerate.sum()), "singleton_groups": singles, "share_all": overall,
               "share_early": early, "mean_group_size": float(size.mean())}
    status = "fail" if value >= DEGENERATE_FAIL else "warn" if value >= DEGENERATE_WARN else "ok"
    note = ""
    if singles == G:
        note = " Every group holds one trajectory: is `group` the prompt id of the GRPO group?"
    elif singles:
        note = f" {singles:,} groups hold a single trajectory (advantage 0 by construction)."
    msg = (f"{_pct(overall)} of {G:,} groups (step, group) have all rewards equal and give no gradient{span}."
           f"{note}")
    return Outcome(status, value, msg, details, series)


# ------------------------------------------------------------------------------------------------
# credit
# ------------------------------------------------------------------------------------------------

VD_WARN = 0.8


def _turns_note(d: Dump, used: int | None = None) -> str:
    """The evidence's count of rows: " (turns in J of N rows)" when rows lack turns, and the
    trajectories used when ``used`` differs from the rows with turns."""
    have = int((d.turn_rows.calls > 0).sum())
    parts = [] if used is None or used == have else [f"from {used:,} trajectories ending in a write"]
    if have < len(d):
        parts.append(f"turns in {have:,} of {len(d):,} rows")
    return f" ({'; '.join(parts)})" if parts else ""


@register_check(
    "credit.coverage", title="Chain length, verifier density and coverage", needs=("turns",),
    threshold=Threshold(VD_WARN, None, direction="below", note="mean V_d over trajectories whose chain ends in "
                                                               "a write, with chains of 2+ calls"),
    fix="Below V_d 0.8 spread credit over the whole chain (the `uniform` geometry; verl "
        "`algorithm.adv_estimator: creditlab_uniform`): credit concentrated on the verifier-visible steps leaves "
        "the others at chance (docs/credit.md).")
def check_coverage(ctx: Context) -> Outcome:
    d = ctx.dump
    tr = d.turn_rows  # per row: chain length C by dataflow (core.diagnostics.chain_length), writes, scored turns
    instr = d.instruction
    with_turns = tr.calls > 0  # rows with a non-empty list of turns
    if tr.errors:
        i = min(tr.errors)
        raise InputError(f"{d.where(i)}: column 'turns': {tr.errors[i]}")
    scored_any = bool(tr.scored.any())
    wf = tr.writes[with_turns] / tr.calls[with_turns]
    sel = with_turns & (tr.chain >= 1)
    if not sel.any():
        return Outcome("skipped", None, "No trajectory ends in a write: the chain length by dataflow is 0 "
                       "everywhere.", {"trajectories": int(wf.size)})
    C = tr.chain[sel]
    k = np.minimum(tr.scored[sel] if scored_any else tr.writes[sel], C)
    C_t, T_t, k_t = (torch.tensor(x.astype(np.float64), dtype=torch.float64) for x in (C, tr.calls[sel], k))
    vd = float((k_t / C_t).mean())
    pc = float(p_cover(T_t, C_t, k_t).mean())
    C_mean, T_mean, k_mean, w = float(C_t.mean()), float(T_t.mean()), float(k_t.mean()), float(np.mean(wf))
    seen = "turns with a process score" if scored_any else "the writes, as a state-diff verifier does"
    details = {"trajectories": int(C.size), "C_mean": C_mean, "T_mean": T_mean, "k_mean": k_mean, "V_d": vd,
               "write_fraction": w, "p_cover": pc, "k_counts": seen, "instruction": instr is not None}
    long_chain = C_mean >= 2
    status = "warn" if vd < VD_WARN and long_chain else "ok"
    regime = ("below 0.8, concentrated credit leaves causal steps at chance: spread credit over the whole chain"
              if status == "warn" else "dense enough for targeted credit" if long_chain else "chains of one call")
    no_instr = "" if instr is not None else " (no instruction column: values it would give count as reads)"
    msg = (f"Chains by dataflow hold C = {format_value(C_mean)} of T = {format_value(T_mean)} calls on average and the "
           f"verifier sees k = {format_value(k_mean)} of them ({seen}): V_d = {format_value(vd)}, write fraction "
           f"{format_value(w)}, P_cover {format_value(pc)}; {regime}{no_instr}{_turns_note(d, int(C.size))}.")
    return Outcome(status, vd, msg, details)


MIXING_WARN = 0.5


@register_check(
    "credit.mixing", title="Turn mixing score", needs=("turns",),
    threshold=Threshold(MIXING_WARN, None, note="mean over trajectories with judged turns; a turn is good when "
                                                "its process_score > 0.5 (scores in [0, 1]) or > 0"),
    fix="Credit per turn where the process signal is trustworthy (the `per_turn` geometry, or PRM mixing "
        "`prm_mixed_advantages` with a decaying weight) instead of broadcasting the outcome to every turn.")
def check_mixing(ctx: Context) -> Outcome:
    d = ctx.dump
    tr = d.turn_rows  # per row: process scores above and at most 0.5 and 0, their least and largest
    if not tr.scored.any():
        return Outcome("skipped", None, "No turn has a process_score.")
    cut = 0.5 if tr.score_min.min() >= 0 and tr.score_max.max() <= 1 else 0.0
    pos, neg = (tr.pos_half, tr.neg_half) if cut == 0.5 else (tr.pos_zero, tr.neg_zero)
    n_pos = torch.tensor(pos.astype(np.float64), dtype=torch.float64)
    n_neg = torch.tensor(neg.astype(np.float64), dtype=torch.float64)
    mix, inc = mixing_score(n_pos, n_neg)
    value = float(mix[inc].mean())
    details = {"trajectories": int(inc.sum()), "good_turn_cut": cut,
               "good_share": float(n_pos.sum() / (n_pos.sum() + n_neg.sum()))}
    status = "warn" if value >= MIXING_WARN else "ok"
    tail = (": good and bad turns share rollouts, so an outcome broadcast to every turn pushes many of them the "
            "wrong way" if status == "warn" else ": turns mostly agree with their rollout, trajectory-level credit "
            "is adequate")
    msg = (f"Mean turn mixing score {format_value(value)} over {int(inc.sum()):,} trajectories with judged turns"
           f"{tail}{_turns_note(d)}.")
    return Outcome(status, value, msg, details)


# ------------------------------------------------------------------------------------------------


def _skip_reason(check: Check, dump: Dump) -> str | None:
    missing = [c for c in check.needs if not dump.has(c)]
    if not missing:
        return None
    s = "s" if len(missing) > 1 else ""
    msg = f"Needs column{s} {', '.join(missing)}, which this dump does not have."
    if set(missing) & set(TOKEN_COLUMNS) and all(f == FORMAT_VERL for f in dump.formats):
        msg += " verl's rollout_data_dir holds no log-probs: dump with creditlab's verl exporter."
    elif set(missing) & set(TOKEN_COLUMNS) and all(f == FORMAT_TRL for f in dump.formats):
        msg += f" {TRL_NO_LOGPROBS}."
    return msg


def run_checks(dump: Dump, *, only: Sequence[str] | None = None, max_turns: int = 16,
               progress: Callable[[str, int, int], None] | None = None) -> list[CheckResult]:
    """Run every registered check (or those in ``only``: one id, or a list of them) on ``dump``, in
    registry order."""
    if isinstance(only, str):
        only = [only]
    if only is not None:
        if not isinstance(only, Sequence | set | frozenset) or not all(isinstance(c, str) for c in only):
            raise ConfigError("--check", f"expected a check id or a list of them, got {only!r}")
        unknown = [c for c in only if c not in CHECKS]
        if unknown:
            s = "s" if len(unknown) > 1 else ""
            raise ConfigError("--check", f"unknown check{s} {', '.join(repr(c) for c in unknown)}; "
                                         f"valid: {', '.join(CHECKS)}")
    ids = [c for c in CHECKS if only is None or c in only]
    ctx = Context(dump, max_turns=max_turns)
    results = []
    for i, cid in enumerate(ids):
        check = CHECKS[cid]
        reason = _skip_reason(check, dump)
        out = Outcome("skipped", None, reason) if reason else check.fn(ctx)
        if out.status not in STATUSES:
            raise ConfigError("check", f"{cid} returned status {out.status!r}; valid: {', '.join(STATUSES)}")
        results.append(CheckResult(cid, check.title, out.status, out.value, check.threshold, out.message, check.fix,
                                   out.details, out.series))
        if progress is not None:
            progress(f"check {cid}", i + 1, len(ids))
    return results
