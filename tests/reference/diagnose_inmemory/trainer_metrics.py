"""The mismatch quantities trainers log, computed from a dump with each trainer's own definition.

``diagnose.json`` reports them beside creditlab's (``trainer_metrics``), so a number on the trainer's
dashboard can be found in the report. Each is computed per step (the step's rows as one batch: what
the trainer logged for that step on one process) and over the whole dump as one batch:

* ``creditlab``: :func:`creditlab.core.correction.mismatch_metrics`' ``mismatch/k1 | k2 | k3 | chi2 |
  mean_abs_delta`` and ``mismatch/seq_k1 | seq_k2 | seq_k3 | seq_chi2``, on the usable policy tokens of the
  checks (flagged tokens left out);
* ``trl``: TRL 1.16 ``GRPOTrainer``'s ``sampling/sampling_logp_difference/mean | max`` (``|old - rollout|``
  over policy tokens, NaN left out) and ``sampling/importance_sampling_ratio/min | mean | max`` (the
  vLLM importance-sampling ratio, in TRL's default ``vllm_importance_sampling_mode="sequence_mask"``
  with ``clip_max=3.0``: one ratio per completion, 0 above the cap; NaN log-probs give a difference of
  0), on every policy token;
* ``verl``: verl 0.9.1's ``rollout_corr/kl``, ``k3_kl``, ``chi2_token`` (``E[r^2] - 1``), ``chi2_seq``
  (``E[prod_t r_t^2] - 1``), ``ppl_ratio``, ``training_ppl``, ``rollout_ppl``, ``log_ppl_diff``,
  ``log_ppl_abs_diff`` (``compute_offpolicy_metrics``) and the sequence K3 of its rejection sampling,
  the per-token K3 summed over a sequence (``rollout_rs_seq_sum_k3_mean | seq_mean | max``), on the
  policy tokens with finite log-probs (verl would get NaN from the others).

docs/diagnose.md has the table of the definitions that differ (chi-squared, sequence K3) and why
creditlab's checks use theirs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from reference.diagnose_inmemory._tokens import token_stats
from reference.diagnose_inmemory.readers import Dump

__all__ = ["TRL_DEFAULT_IS", "trainer_metrics", "trl_sampling_metrics", "verl_offpolicy_metrics"]

TRL_DEFAULT_IS = {"mode": "sequence_mask", "clip_min": None, "clip_max": 3.0}
"""TRL 1.16's defaults of ``vllm_importance_sampling_mode``, ``_clip_min`` and ``_clip_max``."""
_SAFETY = 20.0  # verl's SAFETY_BOUND on log ratios
_SEQ_CAP = 80.0  # creditlab's cap on the exponent of the sequence ratio
_EPS = 1e-8  # verl's masked_mean denominator


def _sum(g: np.ndarray, w: np.ndarray, G: int) -> np.ndarray:
    return np.bincount(g, weights=w, minlength=G)


def _extreme(g: np.ndarray, x: np.ndarray, G: int, fn, empty: float) -> np.ndarray:
    out = np.full(G, np.inf if fn is np.minimum else -np.inf)
    fn.at(out, g, x)
    return np.where(np.isfinite(out) | (_sum(g, np.ones_like(x), G) > 0), out, empty)


def trl_sampling_metrics(lp: np.ndarray, rlp: np.ndarray, policy: np.ndarray, tok_row: np.ndarray,
                         row_group: np.ndarray, G: int, *, mode: str = "sequence_mask", clip_min: float | None = None,
                         clip_max: float | None = 3.0) -> dict[str, np.ndarray]:
    """TRL's ``sampling/*`` metrics of ``G`` batches: flat tokens (``lp`` learner, ``rlp`` engine, the
    ``policy`` mask, ``tok_row`` the row of each token) and ``row_group`` the batch of each row."""
    tok_g = row_group[tok_row]
    with np.errstate(invalid="ignore"):
        delta = np.abs(lp - rlp)
    keep = policy & ~np.isnan(delta)
    n = _sum(tok_g[keep], np.ones(int(keep.sum())), G)
    mean = np.where(n > 0, _sum(tok_g[keep], delta[keep], G) / np.maximum(n, 1), 0.0)
    out = {"sampling/sampling_logp_difference/mean": mean,
           "sampling/sampling_logp_difference/max": _extreme(tok_g[keep], delta[keep], G, np.maximum, 0.0)}
    with np.errstate(invalid="ignore"):
        diff = np.nan_to_num((lp - rlp) * policy, nan=0.0)  # TRL: (old - sampling) * mask, NaN -> 0
    lo = -np.inf if clip_min is None else clip_min
    hi = np.inf if clip_max is None else clip_max
    if mode.startswith("sequence"):
        R = row_group.shape[0]
        with np.errstate(over="ignore"):
            ratio = np.exp(np.bincount(tok_row, weights=diff, minlength=R))
        at = row_group
    else:
        with np.errstate(over="ignore"):
            ratio = np.exp(diff[policy])
        at = tok_g[policy]
    if mode.endswith("truncate"):
        ratio = np.clip(ratio, lo, hi)
    elif mode.endswith("mask"):
        ratio = np.where((ratio < lo) | (ratio > hi), 0.0, ratio)
    cnt = _sum(at, np.ones_like(ratio), G)
    out["sampling/importance_sampling_ratio/min"] = _extreme(at, ratio, G, np.minimum, 0.0)
    out["sampling/importance_sampling_ratio/mean"] = np.where(cnt > 0, _sum(at, ratio, G) / np.maximum(cnt, 1), 0.0)
    out["sampling/importance_sampling_ratio/max"] = _extreme(at, ratio, G, np.maximum, 0.0)
    return out


def verl_offpolicy_metrics(lp: np.ndarray, rlp: np.ndarray, mask: np.ndarray, tok_row: np.ndarray,
                           row_group: np.ndarray, G: int) -> dict[str, np.ndarray]:
    """verl's ``compute_offpolicy_metrics`` and its ``seq_sum_k3`` rejection statistic, per batch, with
    ``mask`` verl's ``response_mask`` (the same flat layout as :func:`trl_sampling_metrics`)."""
    R = row_group.shape[0]
    m = mask.astype(np.float64)
    lp0, rlp0 = np.where(mask, lp, 0.0), np.where(mask, rlp, 0.0)
    lr = lp0 - rlp0
    tok_g = row_group[tok_row]
    n = _sum(tok_g, m, G)
    rows = np.bincount(row_group, minlength=G).astype(np.float64)

    def tok_mean(x):
        return _sum(tok_g, x * m, G) / (n + _EPS)

    def row_sum(x):
        return np.bincount(tok_row, weights=x * m, minlength=R)

    def row_mean(x):  # mean over the batch's rows of a per-row value
        return np.bincount(row_group, weights=x, minlength=G) / np.maximum(rows, 1)

    n_row = np.bincount(tok_row, weights=m, minlength=R)
    mean_train = row_sum(lp0) / (n_row + _EPS)
    mean_roll = row_sum(rlp0) / (n_row + _EPS)
    diff = mean_roll - mean_train
    lrc = np.clip(lr, -_SAFETY, _SAFETY)
    k3 = np.exp(lrc) - 1.0 - lrc
    seq_k3 = row_sum(k3)
    valid = n_row > 0
    vg = row_group[valid]
    n_valid = np.bincount(vg, minlength=G)
    out = {
        "rollout_corr/kl": tok_mean(rlp0 - lp0),
        "rollout_corr/k3_kl": tok_mean(np.exp(lr) - lr - 1),
        "rollout_corr/chi2_token": tok_mean(np.exp(lrc) ** 2) - 1.0,
        "rollout_corr/chi2_seq": row_mean(np.exp(2.0 * np.clip(row_sum(lr), -_SAFETY, _SAFETY))) - 1.0,
        "rollout_corr/ppl_ratio": row_mean(np.exp(diff)),
        "rollout_corr/training_ppl": row_mean(np.exp(-mean_train)),
        "rollout_corr/rollout_ppl": row_mean(np.exp(-mean_roll)),
        "rollout_corr/log_ppl_diff": row_mean(diff),
        "rollout_corr/log_ppl_abs_diff": row_mean(np.abs(diff)),
        "rollout_corr/rollout_rs_seq_sum_k3_mean": _sum(row_group, seq_k3 * n_row, G) / (n + _EPS),
        "rollout_corr/rollout_rs_seq_sum_k3_seq_mean": np.where(
            n_valid > 0, np.bincount(vg, weights=seq_k3[valid], minlength=G) / np.maximum(n_valid, 1), 0.0),
        "rollout_corr/rollout_rs_seq_sum_k3_max": _extreme(vg, seq_k3[valid], G, np.maximum, 0.0),
    }
    return out


def _creditlab_metrics(delta: np.ndarray, usable: np.ndarray, tok_row: np.ndarray, row_group: np.ndarray,
                       G: int) -> dict[str, np.ndarray]:
    R = row_group.shape[0]
    tok_g = row_group[tok_row]
    n = _sum(tok_g, usable.astype(np.float64), G)
    r1 = np.expm1(delta)

    def mean(x):
        return np.where(n > 0, _sum(tok_g, np.where(usable, x, 0.0), G) / np.maximum(n, 1), 0.0)

    S = np.bincount(tok_row, weights=delta, minlength=R)
    has = np.bincount(tok_row, weights=usable, minlength=R) > 0
    hg = row_group[has]
    n_rows = np.bincount(hg, minlength=G)
    Sc = np.minimum(S[has], _SEQ_CAP)
    r1s = np.expm1(Sc)

    def seq_mean(x):
        return np.where(n_rows > 0, np.bincount(hg, weights=x, minlength=G) / np.maximum(n_rows, 1), 0.0)

    return {"mismatch/k1": mean(-delta), "mismatch/k2": mean(delta * delta / 2), "mismatch/k3": mean(r1 - delta),
            "mismatch/chi2": mean(r1 * r1), "mismatch/mean_abs_delta": mean(np.abs(delta)),
            "mismatch/seq_k1": seq_mean(-S[has]), "mismatch/seq_k2": seq_mean(S[has] ** 2 / 2),
            "mismatch/seq_k3": seq_mean(r1s - Sc), "mismatch/seq_chi2": seq_mean(r1s * r1s)}


def trainer_metrics(dump: Dump) -> dict[str, Any] | None:
    """``{"steps", "definitions", "creditlab", "trl", "verl"}``: each metric as ``{"all", "by_step"}``
    (the dump as one batch; each step's rows as one; None where a value is NaN or infinite). None when
    the dump has no token columns."""
    if dump.tokens is None or not bool(dump.tokens.has_tokens.any()):
        return None
    t = dump.tokens
    ts = token_stats(dump)
    rows = np.flatnonzero(t.has_tokens)  # rows with token columns, in order
    R = rows.size
    steps, code = np.unique(dump.step[rows], return_inverse=True)
    S = steps.size
    lengths = t.lengths
    tok_sel = np.repeat(t.has_tokens, lengths)
    tok_row = np.repeat(np.arange(R), lengths[rows])  # row index among `rows` of each token kept
    lp, rlp, pm = t.logprobs[tok_sel], t.rollout_logprobs[tok_sel], t.policy_mask[tok_sel]
    usable, delta = ts.usable[tok_sel], ts.delta[tok_sel]
    finite = np.isfinite(lp) & np.isfinite(rlp)
    out: dict[str, Any] = {
        "steps": steps.tolist(),
        "definitions": {
            "creditlab": "creditlab.core.correction.mismatch_metrics on the usable policy tokens of the checks",
            "trl": (f"TRL 1.16 GRPOTrainer sampling/* on every policy token, importance ratio in its default "
                    f"vllm_importance_sampling_mode={TRL_DEFAULT_IS['mode']!r}, clip_max={TRL_DEFAULT_IS['clip_max']}"),
            "verl": ("verl 0.9.1 rollout_corr/* (compute_offpolicy_metrics, and the seq_sum_k3 statistic of its "
                     "rejection sampling) on the policy tokens with finite log-probs"),
        },
    }
    for name, fn in (("creditlab", lambda g, G: _creditlab_metrics(delta, usable, tok_row, g, G)),
                     ("trl", lambda g, G: trl_sampling_metrics(lp, rlp, pm, tok_row, g, G, **TRL_DEFAULT_IS)),
                     ("verl", lambda g, G: verl_offpolicy_metrics(lp, rlp, pm & finite, tok_row, g, G))):
        whole = fn(np.zeros(R, dtype=np.int64), 1)
        by = fn(code.astype(np.int64), S)
        out[name] = {k: {"all": _number(whole[k][0]), "by_step": [_number(x) for x in by[k]]} for k in whole}
    return out


def _number(x: float) -> float | None:
    """A JSON number (None for NaN/inf, e.g. an overflowing ratio)."""
    x = float(x)
    return x if np.isfinite(x) else None
