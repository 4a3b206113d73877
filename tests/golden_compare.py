"""Comparing stored lab rows with recorded goldens on any CPU.

Two machines run the same float32 program with other vector widths (AVX2, AVX-512, NEON), so sums
are taken in other orders and a value differs in its last bits. Every tolerance here is derived from
the quantity it compares, not tuned to one machine:

* a log-prob computed twice (engine and learner, or two CPUs) differs by a few float32 ulps:
  ``TOKEN_NOISE = 16 * eps32`` nats per token (log-softmax of logits of size <= 8);
* a per-token mean of log-prob differences (``k1``, ``mean_abs_delta``, the current log ratio by
  turn) moves by at most ``TOKEN_NOISE``; a per-sequence sum (``seq_k1``, the prefix log ratio by
  turn, the prefix weights of the correction) by ``TOKEN_NOISE`` times the policy tokens of a
  trajectory (the row's ``episode/policy_tokens``, capped by the token budget);
* quadratic statistics (``k2``, ``k3``, ``chi2``, the correction magnitude ``C_mean``, the loss's
  ``approx_kl``) are compared on the square-root scale, where they are log-prob differences again;
* the support ``rho`` and budget ``alpha`` of the InterQ correction on a row whose correction
  magnitude ``C_mean`` is itself at float-noise level are ratios of noise (``rho <= C / (C + 1e-8)``,
  ``alpha`` normalised over noise): compared within those bounds only;
* rows of a quantized engine or learner: a pre-quantization value that differs in its last bit can
  land on the other side of a rounding boundary, and then one element moves by a whole quantization
  step (1/8 of its size for FP8 E4M3, 1/2 for FP4 E2M1 near its largest values). Their *mismatch
  statistics* (the engine-vs-learner log-ratio ``delta``: ``k1``..``chi2``, ``mean_abs_delta``, the
  prefix and current log ratios by turn, the drift, the correction's weights and magnitude) are made
  of such rounding decisions: on a QAT row, whose engine and learner round alike, ``k3`` is a handful
  of tokens that rounded differently, and a signed sum such as the drift can cancel to nearly 0. A
  tolerance relative to the value is therefore meaningless there (measured: 0.02-5x of the value
  across back-ends). They are compared against what one rounding flip can move: a token whose
  rounding differs moves its ``delta`` by at most the dose's whole quantization error per token,
  ``e_d`` (the golden's own gate row: mean ``|delta|`` between that engine and an fp32 learner on the
  base policy), so a per-token statistic moves by at most ``e_d`` (quadratic ones on the square-root
  scale) and a per-sequence sum by at most ``e_d`` per policy token (:func:`flip_tolerance`). The
  support ``rho`` and budget ``alpha`` of such rows are ratios of those flip-made displacements: only
  their range and order are checked there (their formulas have hand-computed goldens in
  ``tests/test_correction.py``). Measured across the emulated back-ends (``ATEN_CPU_CAPABILITY``,
  ``ONEDNN_MAX_CPU_ISA``, ``MKL_CBWR``, ``MKL_ENABLE_INSTRUCTIONS``): at most 0.37 ``e_d`` per token
  and 0.07 ``e_d`` per policy token. Every other value of those rows (rewards, success, tokens, tool
  calls, losses, gradient norms: downstream of the flips only through log-probs that move by far less
  than a sampled token's margin) is compared within ``QUANT_RTOL = 5%`` (measured: within 1e-5);
* every other value (rewards, success rates, losses, gradient norms over a few updates) within
  ``rtol = 1e-5`` (about 80 ulps) and ``atol = 1e-6``.

A real change (another seed, another arm, a dropped correction) moves these values by orders of
magnitude more; ``assert_real_signal_exceeds`` checks that a golden holds such a signal, and
``tests/test_lab_golden.py`` plants real changes and checks that each fails.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

EPS32 = float(np.finfo(np.float32).eps)
TOKEN_NOISE = 16 * EPS32
RTOL, ATOL = 1e-5, 1e-6
QUANT_RTOL = 0.05

_QUADRATIC = re.compile(r"(^|/)(seq_)?(k2|k3|chi2)$|/C_mean$|approx_kl$")
_PER_SEQUENCE = re.compile(r"(^|/)seq_k1$|/prefix$|^(prefix_(turn0|last)|drift_last)$"
                           r"|^correction/weight_(mean|min|max)$|^loss/(ratio|weight)_mean$")
_PER_TOKEN = re.compile(r"(^|/)(k1|mean_abs_delta)$|^mismatch/turn\d+/current$|^current_last$")


def tolerance(column: str, tokens: np.ndarray) -> tuple[np.ndarray | float, bool]:
    """``(atol, on_sqrt_scale)`` of ``column``; ``tokens`` the policy tokens per trajectory of each row."""
    if _QUADRATIC.search(column):
        per_seq = "seq_" in column
        return (TOKEN_NOISE * tokens if per_seq else TOKEN_NOISE), True
    if _PER_SEQUENCE.search(column):
        return TOKEN_NOISE * tokens, False
    if _PER_TOKEN.search(column):
        return TOKEN_NOISE, False
    return ATOL, False


# the mismatch statistics of quantized rows (module doc): per token, per sequence, ratios
_FLIP_TOKEN = re.compile(r"(^|/)(k1|k2|k3|chi2|mean_abs_delta)$|^k3_|^mismatch/turn\d+/current$|^current_last$")
_FLIP_SEQUENCE = re.compile(r"(^|/)seq_(k1|k2|k3|chi2)$|^mismatch/turn\d+/prefix$"
                            r"|^(prefix_turn0|prefix_last|drift_last)$"
                            r"|^correction/(weight_(mean|min|max)|C_mean)$|^loss/weight_mean$")
_FLIP_RATIO = re.compile(r"^correction/(rho|alpha)_(q\d+|mean)$")


def flip_tolerance(column: str, e_d: np.ndarray, tokens: np.ndarray) -> np.ndarray | None:
    """The tolerance of ``column`` on quantized rows whose dose has per-token quantization error ``e_d``:
    ``e_d`` for a per-token statistic, ``e_d * tokens`` for a per-sequence one (both on the square-root
    scale for quadratic statistics, where :func:`tolerance` puts them), ``inf`` for ``rho``/``alpha``
    (range-checked instead); ``None``: not a mismatch statistic."""
    if _FLIP_RATIO.search(column):
        return np.full(e_d.shape, np.inf)
    if _FLIP_SEQUENCE.search(column):
        return e_d * tokens
    if _FLIP_TOKEN.search(column):
        return e_d
    return None


def assert_rows_match(got: pd.DataFrame, want: pd.DataFrame, keys: list[str], *, max_tokens: float,
                      quantized=None, flip_scale=None) -> None:
    """Stored rows ``got`` equal the golden ``want`` up to float noise (module doc); ``time/*`` columns
    (wall clock) are skipped; ``max_tokens`` caps the policy tokens per trajectory (the token budget);
    ``quantized(frame) -> bool Series`` marks the rows of a quantized engine or learner, and
    ``flip_scale(frame) -> float Series`` gives their dose's quantization error per token ``e_d``."""
    cols = [c for c in want.columns if not c.startswith("time/") and c != "cell_key"]
    missing = sorted(set(cols) - set(got.columns))
    assert not missing, f"columns missing from the stored rows: {missing}"
    assert len(got) == len(want), f"{len(got)} stored rows, {len(want)} in the golden"
    got = got[cols].sort_values(keys, kind="stable", na_position="first").reset_index(drop=True)
    want = want[cols].sort_values(keys, kind="stable", na_position="first").reset_index(drop=True)
    tokens = np.full(len(want), float(max_tokens))
    for per_row in ("episode/policy_tokens", "policy_tokens"):
        if per_row in want:
            tokens = np.minimum(tokens, np.nan_to_num(want[per_row].to_numpy(float), nan=max_tokens))
    quant = np.zeros(len(want), bool) if quantized is None else quantized(want).to_numpy(bool)
    e_d = np.full(len(want), np.nan) if flip_scale is None else flip_scale(want).to_numpy(float)
    assert not (quant & np.isnan(e_d)).any() or flip_scale is None, "a quantized row without its dose's e_d"
    for c in cols:
        g, w = got[c], want[c]
        if not (pd.api.types.is_float_dtype(w) or pd.api.types.is_float_dtype(g)):
            def as_objects(x: pd.Series) -> pd.Series:  # None and NaN are both "missing"
                return x.astype(object).where(x.notna(), None)

            pd.testing.assert_series_equal(as_objects(g), as_objects(w), check_dtype=False, obj=c)
            continue
        g, w = g.to_numpy(float), w.to_numpy(float)
        nan_rows = np.flatnonzero(np.isnan(g) != np.isnan(w))
        assert not len(nan_rows), f"{c}: NaN in other rows ({nan_rows})"
        ok = ~np.isnan(w)
        atol, sqrt_scale = tolerance(c, tokens)
        atol = np.array(np.broadcast_to(atol, w.shape), dtype=float)
        if re.match(r"correction/(rho|alpha)_", c) and "correction/C_mean" in want:
            c_noise = (TOKEN_NOISE * tokens) ** 2
            at_noise = np.sqrt(np.abs(want["correction/C_mean"].to_numpy(float))) <= TOKEN_NOISE * tokens
            atol = np.where(at_noise, c_noise / (c_noise + 1e-8) if c.startswith("correction/rho") else 1.0, atol)
        rtol = np.where(quant, 2 * QUANT_RTOL if sqrt_scale else QUANT_RTOL, RTOL)
        flip = flip_tolerance(c, e_d, tokens) if flip_scale is not None else None
        if flip is not None:  # a mismatch statistic: quantized rows within what rounding flips can move
            atol = np.where(quant, np.maximum(atol, flip), atol)
            rtol = np.where(quant, 0.0, rtol)
            if _FLIP_RATIO.search(c):
                in_range = (g[ok & quant] >= 0) & (g[ok & quant] <= 1)
                assert in_range.all(), f"{c}: a quantized row's value outside [0, 1]: {g[ok & quant][~in_range]}"
        atol, rtol = atol[ok], rtol[ok]
        g, w = g[ok], w[ok]
        if sqrt_scale:
            g, w = np.sqrt(np.abs(g)), np.sqrt(np.abs(w))
        tol = atol + rtol * np.abs(w)
        bad = np.abs(g - w) > tol
        assert not bad.any(), (f"{c}: {int(bad.sum())} of {len(w)} rows differ beyond float noise; first: got "
                               f"{g[bad][0]!r}, want {w[bad][0]!r}, tolerance {tol[bad][0]:.3g}")
    if flip_scale is not None:  # the range-checked ratios keep their order on every quantized row
        for name in ("rho", "alpha"):
            q = [f"correction/{name}_q{p}" for p in (10, 50, 90)]
            if set(q) <= set(got.columns):
                v = got.loc[quant, q].dropna().to_numpy(float)
                assert (np.diff(v, axis=1) >= 0).all(), f"correction/{name} quantiles out of order"


def assert_real_signal_exceeds(frame: pd.DataFrame, column: str, rows: pd.Series, *, factor: float = 10.0,
                               max_tokens: float) -> None:
    """The values of ``column`` on ``rows`` (e.g. the naive arm's K3) are at least ``factor`` times the
    tolerance the comparison allows them: the golden holds a signal that float noise cannot fake."""
    sel = frame[rows & frame[column].notna()]
    assert len(sel), f"no rows hold {column}"
    tokens = np.minimum(sel.get("episode/policy_tokens", pd.Series(max_tokens, index=sel.index)).to_numpy(float),
                        max_tokens)
    atol, sqrt_scale = tolerance(column, tokens)
    v = np.abs(sel[column].to_numpy(float))
    v = np.sqrt(v) if sqrt_scale else v
    assert (v >= factor * np.broadcast_to(atol, v.shape)).all(), (column, v.min())
