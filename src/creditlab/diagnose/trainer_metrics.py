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

Each is computed from per-row sums (:class:`~creditlab.diagnose._tokens.RowStats`, accumulated as the dump
is read), so a dump of any size is measured in bounded memory; the token-level functions
(:func:`trl_sampling_metrics`, :func:`verl_offpolicy_metrics`) reduce their tokens to the same sums first.
docs/diagnose.md has the table of the definitions that differ (chi-squared, sequence K3) and why
creditlab's checks use theirs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from creditlab.diagnose._tokens import RowStats, trl_row_sums, verl_row_sums
from creditlab.diagnose.readers import Dump

__all__ = ["TRL_DEFAULT_IS", "trainer_metrics", "trl_sampling_metrics", "verl_offpolicy_metrics"]

TRL_DEFAULT_IS = {"mode": "sequence_mask", "clip_min": None, "clip_max": 3.0}
"""TRL 1.16's defaults of ``vllm_importance_sampling_mode``, ``_clip_min`` and ``_clip_max``."""
_SAFETY = 20.0  # verl's SAFETY_BOUND on log ratios
_SEQ_CAP = 80.0  # creditlab's cap on the exponent of the sequence ratio
_EPS = 1e-8  # verl's masked_mean denominator


def _sum(g: np.ndarray, w: np.ndarray, G: int) -> np.ndarray:
    return np.bincount(g, weights=w, minlength=G)


def _extreme(g: np.ndarray, x: np.ndarray, G: int, fn, empty: float, count: np.ndarray | None = None) -> np.ndarray:
    """Per group, the ``fn`` (np.minimum / np.maximum) of the ``x`` of its members; ``empty`` for a group of
    none (``count``: the members per group, when ``x`` holds a placeholder -inf for some)."""
    out = np.full(G, np.inf if fn is np.minimum else -np.inf)
    fn.at(out, g, x)
    n = _sum(g, np.ones_like(x), G) if count is None else count
    return np.where(np.isfinite(out) | (n > 0), out, empty)


def _trl_groups(rs: dict[str, np.ndarray], row_group: np.ndarray, G: int, mode: str, clip_min: float | None,
                clip_max: float | None) -> dict[str, np.ndarray]:
    """TRL's ``sampling/*`` metrics of ``G`` batches from the per-row sums of :func:`trl_row_sums` (sequence
    modes; ``token_*`` modes read tokens: :func:`trl_sampling_metrics`)."""
    n = _sum(row_group, rs["trl_n"].astype(np.float64), G)
    out = {"sampling/sampling_logp_difference/mean": np.where(n > 0, _sum(row_group, rs["trl_sum_abs"], G)
                                                              / np.maximum(n, 1), 0.0),
           "sampling/sampling_logp_difference/max": _extreme(row_group, rs["trl_max_abs"], G, np.maximum, 0.0, n)}
    if mode.startswith("sequence"):
        with np.errstate(over="ignore"):
            ratio = np.exp(rs["trl_sum_diff"])
        out.update(_ratio_stats(ratio, row_group, G, mode, clip_min, clip_max))
    return out


def _ratio_stats(ratio: np.ndarray, at: np.ndarray, G: int, mode: str, clip_min: float | None,
                 clip_max: float | None) -> dict[str, np.ndarray]:
    lo = -np.inf if clip_min is None else clip_min
    hi = np.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        ratio = np.clip(ratio, lo, hi)
    elif mode.endswith("mask"):
        ratio = np.where((ratio < lo) | (ratio > hi), 0.0, ratio)
    cnt = _sum(at, np.ones_like(ratio), G)
    return {"sampling/importance_sampling_ratio/min": _extreme(at, ratio, G, np.minimum, 0.0),
            "sampling/importance_sampling_ratio/mean": np.where(cnt > 0, _sum(at, ratio, G) / np.maximum(cnt, 1), 0.0),
            "sampling/importance_sampling_ratio/max": _extreme(at, ratio, G, np.maximum, 0.0)}


def trl_sampling_metrics(lp: np.ndarray, rlp: np.ndarray, policy: np.ndarray, tok_row: np.ndarray,
                         row_group: np.ndarray, G: int, *, mode: str = "sequence_mask", clip_min: float | None = None,
                         clip_max: float | None = 3.0) -> dict[str, np.ndarray]:
    """TRL's ``sampling/*`` metrics of ``G`` batches: flat tokens (``lp`` learner, ``rlp`` engine, the
    ``policy`` mask, ``tok_row`` the row of each token) and ``row_group`` the batch of each row."""
    R = row_group.shape[0]
    out = _trl_groups(trl_row_sums(lp, rlp, policy, tok_row, R), row_group, G, mode, clip_min, clip_max)
    if not mode.startswith("sequence"):  # one ratio per policy token
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.nan_to_num((lp - rlp) * policy, nan=0.0)
            ratio = np.exp(diff[policy])
        out.update(_ratio_stats(ratio, row_group[tok_row][policy], G, mode, clip_min, clip_max))
    return out


def _verl_groups(rs: dict[str, np.ndarray], row_group: np.ndarray, G: int) -> dict[str, np.ndarray]:
    """verl's ``rollout_corr/*`` of ``G`` batches from the per-row sums of :func:`verl_row_sums`."""
    n_row = rs["verl_n"].astype(np.float64)
    n = _sum(row_group, n_row, G)
    rows = np.bincount(row_group, minlength=G).astype(np.float64)

    def tok_mean(sums):
        return _sum(row_group, sums, G) / (n + _EPS)

    def row_mean(x):  # mean over the batch's rows of a per-row value
        return np.bincount(row_group, weights=x, minlength=G) / np.maximum(rows, 1)

    mean_train = rs["verl_lp"] / (n_row + _EPS)
    mean_roll = rs["verl_rlp"] / (n_row + _EPS)
    diff = mean_roll - mean_train
    seq_k3 = rs["verl_k3_clip"]
    valid = n_row > 0
    vg = row_group[valid]
    n_valid = np.bincount(vg, minlength=G)
    return {
        "rollout_corr/kl": tok_mean(-rs["verl_lr"]),
        "rollout_corr/k3_kl": tok_mean(rs["verl_k3"]),
        "rollout_corr/chi2_token": tok_mean(rs["verl_chi2_clip"]) - 1.0,
        "rollout_corr/chi2_seq": row_mean(np.exp(2.0 * np.clip(rs["verl_lr"], -_SAFETY, _SAFETY))) - 1.0,
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


def verl_offpolicy_metrics(lp: np.ndarray, rlp: np.ndarray, mask: np.ndarray, tok_row: np.ndarray,
                           row_group: np.ndarray, G: int) -> dict[str, np.ndarray]:
    """verl's ``compute_offpolicy_metrics`` and its ``seq_sum_k3`` rejection statistic, per batch, with
    ``mask`` verl's ``response_mask`` (the same flat layout as :func:`trl_sampling_metrics`)."""
    return _verl_groups(verl_row_sums(lp, rlp, mask, tok_row, row_group.shape[0]), row_group, G)


def _creditlab_metrics(r: RowStats, row_group: np.ndarray, G: int) -> dict[str, np.ndarray]:
    """``mismatch_metrics``' token and sequence divergences of ``G`` batches from the rows' sums over their
    usable tokens."""
    n = _sum(row_group, r.usable.astype(np.float64), G)

    def mean(sums):
        return np.where(n > 0, _sum(row_group, sums, G) / np.maximum(n, 1), 0.0)

    S = r.sum_delta
    has = r.usable > 0
    hg = row_group[has]
    n_rows = np.bincount(hg, minlength=G)
    Sc = np.minimum(S[has], _SEQ_CAP)
    r1s = np.expm1(Sc)

    def seq_mean(x):
        return np.where(n_rows > 0, np.bincount(hg, weights=x, minlength=G) / np.maximum(n_rows, 1), 0.0)

    return {"mismatch/k1": mean(-S), "mismatch/k2": mean(r.sum_k2), "mismatch/k3": mean(r.sum_k3),
            "mismatch/chi2": mean(r.sum_chi2), "mismatch/mean_abs_delta": mean(r.sum_abs),
            "mismatch/seq_k1": seq_mean(-S[has]), "mismatch/seq_k2": seq_mean(S[has] ** 2 / 2),
            "mismatch/seq_k3": seq_mean(r1s - Sc), "mismatch/seq_chi2": seq_mean(r1s * r1s)}


def trainer_metrics(dump: Dump) -> dict[str, Any] | None:
    """``{"steps", "definitions", "creditlab", "trl", "verl"}``: each metric as ``{"all", "by_step"}``
    (the dump as one batch; each step's rows as one; None where a value is NaN or infinite). None when
    the dump has no token columns."""
    if dump.rows is None or not bool(dump.rows.has_tokens.any()):
        return None
    r = dump.mismatch().rows  # copied files left out of the usable tokens
    rows = np.flatnonzero(r.has_tokens)  # rows with token columns, in order
    r = r.take(rows)
    steps, code = np.unique(dump.step[rows], return_inverse=True)
    S = steps.size
    sums = {k: getattr(r, k) for k in ("trl_n", "trl_sum_abs", "trl_max_abs", "trl_sum_diff", "verl_n", "verl_lp",
                                        "verl_rlp", "verl_lr", "verl_k3", "verl_k3_clip", "verl_chi2_clip")}
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
    for name, fn in (("creditlab", lambda g, G: _creditlab_metrics(r, g, G)),
                     ("trl", lambda g, G: _trl_groups(sums, g, G, **TRL_DEFAULT_IS)),
                     ("verl", lambda g, G: _verl_groups(sums, g, G))):
        whole = fn(np.zeros(rows.size, dtype=np.int64), 1)
        by = fn(code.astype(np.int64), S)
        out[name] = {k: {"all": _number(whole[k][0]), "by_step": [_number(x) for x in by[k]]} for k in whole}
    return out


def _number(x: float) -> float | None:
    """A JSON number (None for NaN/inf, e.g. an overflowing ratio)."""
    x = float(x)
    return x if np.isfinite(x) else None
