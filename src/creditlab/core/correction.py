"""Execution-mismatch correction: InterQ-RL bounded execution-prefix weights and baselines.

Rollouts come from an engine (quantized, different kernels) whose log-probs ``rollout_logprobs``
differ from the learner's ``old_logprobs`` for the same tokens. In a multi-turn agent the
difference compounds along the interaction history: the probability of reaching turn ``k`` under
the learner differs from the engine's by the product of all earlier token ratios. InterQ-RL
reweights each policy token by a *bounded* estimate of that execution-prefix ratio, shrunk toward
1 per action segment according to how broad the evidence for correcting it is (its support).

Per batch (``B`` trajectories x ``L`` tokens, ``S`` segments):

1. ``delta_t = old_logprobs_t - rollout_logprobs_t`` on policy tokens, 0 elsewhere (tool and
   observation tokens never enter the ratio: the environment factors cancel).
2. ``E_t = sum_{u<=t} delta_u`` and ``n_t = sum_{u<=t} policy_u`` (prefix sums in the row).
3. ``W~_t = exp(clip(E_t, -eps_low*sqrt(n_t), eps_high*sqrt(n_t)))``.
4. per segment ``s`` of ``n_s`` tokens, ``d_t = W~_t - 1``: ``C_s = mean d_t^2``,
   ``ESS_s = (sum |d_t|)^2 / sum d_t^2`` (Kish's effective sample size of the absolute
   displacements, 1 when ``C_s = 0``), support
   ``rho_s = (ESS_s - 1)/(n_s - 1) * C_s/(C_s + rho_eps)`` (0 for one-token segments).
5. ``alpha_s = min(c*rho_s, 1)`` with ``c`` set by bisection so that the batch budget
   ``sum_s C_s alpha_s^2 = alpha_g^2 sum_s C_s`` binds (see :func:`allocate_budget`).
6. ``W_t = 1 + alpha_seg(t) * (W~_t - 1)`` on policy tokens, 1 elsewhere; used detached as a
   per-token coefficient of the PPO/GRPO token loss.

Baselines under the same signature ``fn(old_logprobs, rollout_logprobs, policy_mask,
valid_mask=None, **params) -> (weights, metrics)``: :func:`tis_weights` (truncated token IS),
:func:`mis_weights` (masked token IS), :func:`seq_is_weights` (truncated sequence IS),
:func:`geo_weights` (geometric mean of the sequence ratio), :func:`none_weights`.

Everything runs on the device of the inputs, with no Python loop over tokens or segments (the
bisection has a fixed iteration count); prefix sums and segment statistics are computed in
float64, the returned weights are float32 (float64 for float64 inputs) and detached.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from creditlab.core._checks import check_scalar, check_tensor
from creditlab.core.masks import Segments, effective_policy_mask, segment_sum, segments
from creditlab.errors import ConfigError, InputError

__all__ = [
    "ARMS",
    "InterQTerms",
    "allocate_budget",
    "geo_weights",
    "interq_terms",
    "interq_weights",
    "mis_weights",
    "mismatch_metrics",
    "none_weights",
    "seq_is_weights",
    "tis_weights",
]

#: Names of every correction arm (``interq``/``prefix``/``global`` are modes of
#: :func:`interq_weights`; the others are functions ``<name>_weights``).
ARMS = ("interq", "prefix", "global", "tis", "mis", "seq_is", "geo", "none")
INTERQ_MODES = ("interq", "prefix", "global")

_F64 = torch.float64


class InterQTerms(NamedTuple):
    """Intermediate quantities of the InterQ-RL weights (all detached, float64).

    Attributes:
        weights: ``(B, L)`` final ``W_t`` (1 off policy tokens), float64.
        displacement: ``(B, L)`` ``d_t = W~_t - 1`` on policy tokens, 0 elsewhere.
        clipped_high / clipped_low: ``(B, L)`` bool, policy tokens whose prefix ``E_t`` left the
            envelope above / below.
        C, rho, alpha: ``(S,)`` per-segment correction magnitude, support and allocated alpha.
        segments: the :class:`~creditlab.core.masks.Segments` of the batch.
    """

    weights: torch.Tensor
    displacement: torch.Tensor
    clipped_high: torch.Tensor
    clipped_low: torch.Tensor
    C: torch.Tensor
    rho: torch.Tensor
    alpha: torch.Tensor
    segments: Segments


# --------------------------------------------------------------------------------------------
# input handling


def _checked(old_logprobs, rollout_logprobs, policy_mask, valid_mask) -> torch.Tensor:
    """Check the four standard inputs; return the effective policy mask ``(B, L)``."""
    dims: dict[str, int] = {}
    check_tensor("policy_mask", policy_mask, shape=("B", "L"), boolean=True, dims=dims)
    if valid_mask is not None:
        check_tensor("valid_mask", valid_mask, shape=("B", "L"), boolean=True, dims=dims)
    pm = effective_policy_mask(policy_mask, valid_mask)
    check_tensor("old_logprobs", old_logprobs, shape=("B", "L"), floating=True, dims=dims)
    check_tensor("rollout_logprobs", rollout_logprobs, shape=("B", "L"), floating=True, dims=dims)
    for name, x in (("old_logprobs", old_logprobs), ("rollout_logprobs", rollout_logprobs)):
        if x.device != pm.device:
            raise InputError(f"{name}: is on device {x.device} but policy_mask is on {pm.device}")
        check_tensor(name, x, finite=True, finite_where=pm)
    return pm


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    return _F64 if x.dtype == _F64 else torch.float32


def _delta(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, pm: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` float64 ``old - rollout`` on policy tokens, exactly 0 elsewhere (junk ignored)."""
    delta = old_logprobs.to(_F64, copy=True)
    delta.sub_(rollout_logprobs)
    return delta.masked_fill_(~pm, 0.0)


def _safe_mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return total.to(_F64) / count.to(_F64).clamp_min(1)


def _to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """One host synchronisation for all metrics."""
    if not metrics:
        return {}
    values = torch.stack([v.detach().to(_F64).reshape(()) for v in metrics.values()]).tolist()
    return dict(zip(metrics.keys(), values, strict=True))


def _finite_or_one(x: torch.Tensor) -> torch.Tensor:
    """``x`` if finite else 1 (the min/max weight of a batch without policy tokens)."""
    return torch.where(torch.isfinite(x), x, torch.ones_like(x))


def _token_metrics(delta: torch.Tensor, pm: torch.Tensor) -> dict[str, torch.Tensor]:
    n = pm.sum()
    return {
        "mismatch/k3": _safe_mean((torch.expm1(delta) - delta).sum(), n),
        "mismatch/mean_abs_delta": _safe_mean(delta.abs().sum(), n),
    }


# --------------------------------------------------------------------------------------------
# budget allocation


def allocate_budget(
    C_s: torch.Tensor, rho_s: torch.Tensor, alpha_g: float = 0.5, iters: int = 80
) -> torch.Tensor:
    """Per-segment shrinkage ``alpha_s`` ``(S,)`` under a fixed correction budget.

    Solves ``max sum_s C_s rho_s alpha_s`` s.t. ``sum_s C_s alpha_s^2 <= alpha_g^2 sum_s C_s``,
    ``0 <= alpha_s <= 1``. By the KKT conditions the solution is ``alpha_s = min(c rho_s, 1)``;
    ``c`` is found by ``iters`` steps of bisection on ``log c`` between ``c0 = sqrt(budget /
    sum C rho^2)`` (no segment capped) and ``1/min rho`` (every positive-support segment capped),
    so the budget binds whenever it can. When it cannot (``sum_{rho>0} C_s < alpha_g^2 sum C_s``) every segment
    with positive support gets ``alpha_s = 1``. Segments with ``rho_s = 0`` get 0 while another
    segment has support; if no segment has both ``C_s > 0`` and ``rho_s > 0`` the objective is
    flat and every segment gets ``alpha_g`` (the ``global`` arm). Equal ``rho`` gives
    ``alpha_s = alpha_g`` everywhere.

    Args:
        C_s: ``(S,)`` non-negative correction magnitudes.
        rho_s: ``(S,)`` supports in ``[0, 1]``.
        alpha_g: global shrinkage in ``[0, 1]`` defining the budget.
        iters: number of bisection steps (fixed; no host synchronisation).

    Returns:
        ``(S,)`` float64 ``alpha_s``.

    >>> allocate_budget(torch.tensor([1.0, 1.0]), torch.tensor([0.3, 0.3]), alpha_g=0.5)
    tensor([0.5000, 0.5000], dtype=torch.float64)
    >>> allocate_budget(torch.tensor([1.0, 1.0]), torch.tensor([0.2, 0.4]), alpha_g=0.5).tolist()
    [0.31622776601683794, 0.6324555320336759]
    """
    dims: dict[str, int] = {}
    check_tensor("C_s", C_s, shape=("S",), floating=True, finite=True, dims=dims)
    check_tensor("rho_s", rho_s, shape=("S",), floating=True, finite=True, dims=dims)
    check_scalar("alpha_g", alpha_g, low=0.0, high=1.0)
    if int(iters) != iters or iters < 1:
        raise ConfigError("iters", f"must be a positive integer, got {iters!r}")
    if bool((C_s < 0).any()):
        raise ConfigError("C_s", "must be non-negative")
    C = C_s.to(_F64)
    rho = rho_s.to(_F64).clamp(0.0, 1.0)
    target = alpha_g**2 * C.sum()
    pos = (C > 0) & (rho > 0)
    # bisect on log c: alpha_s = exp(min(log c + log rho_s, 0)); works for rho down to denormals
    log_rho = torch.log(rho)  # -inf where rho = 0 (alpha = 0)
    log_hi = -torch.where(pos, log_rho, torch.zeros_like(log_rho)).amin() if C.numel() else C.new_zeros(())
    log_hi = torch.where(pos.any(), log_hi, torch.zeros_like(log_hi))  # every positive-support seg capped
    quad = (C * rho * rho).sum()
    log_lo = 0.5 * (torch.log(target) - torch.log(quad))  # c0: no segment capped; inf/nan if degenerate
    log_lo = torch.where(torch.isfinite(log_lo), torch.minimum(log_lo, log_hi), torch.full_like(log_hi, -800.0))
    for _ in range(int(iters)):
        mid = 0.5 * (log_lo + log_hi)
        spent = (C * torch.exp(2.0 * torch.clamp(mid + log_rho, max=0.0))).sum()
        below = spent < target
        log_lo = torch.where(below, mid, log_lo)
        log_hi = torch.where(below, log_hi, mid)
    alpha = torch.exp(torch.clamp(log_hi + log_rho, max=0.0))
    alpha = torch.where(target > 0, alpha, torch.zeros_like(alpha))
    flat = ~pos.any()
    return torch.where(flat, torch.full_like(alpha, alpha_g), alpha)


# --------------------------------------------------------------------------------------------
# InterQ-RL


def _check_params(eps_low, eps_high, alpha_g, rho_eps, iters, mode) -> None:
    check_scalar("eps_low", eps_low, low=0.0)
    check_scalar("eps_high", eps_high, low=0.0)
    check_scalar("alpha_g", alpha_g, low=0.0, high=1.0)
    check_scalar("rho_eps", rho_eps, low=0.0)
    if int(iters) != iters or iters < 1:
        raise ConfigError("iters", f"must be a positive integer, got {iters!r}")
    if mode not in INTERQ_MODES:
        raise ConfigError("mode", f"unknown mode {mode!r}; valid: {', '.join(INTERQ_MODES)}")


def _interq(delta: torch.Tensor, seg: Segments, *, eps_low, eps_high, alpha_g, rho_eps, iters, mode,
            keep_prefix: bool = False):
    """Core of InterQ-RL on a float64 ``delta`` that is consumed (overwritten) in place.

    Returns ``(weights f64, displacement f64, clipped_high, clipped_low, C, rho, alpha, E)``;
    ``E`` (the unclipped prefix log ratio) is None unless ``keep_prefix``.
    """
    pm = seg.policy
    E = delta.cumsum_(dim=1)  # (B, L) prefix log ratio over policy tokens
    bound = torch.cumsum(pm, dim=1, dtype=_F64).sqrt_()  # (B, L) sqrt(n_t)
    hi = bound * eps_high
    clipped_high = (E > hi) & pm
    logw = torch.minimum(E, hi, out=hi)
    lo = bound.mul_(-eps_low)
    clipped_low = (E < lo) & pm
    logw = torch.maximum(logw, lo, out=logw)
    del lo, bound
    prefix = E.clone() if keep_prefix else None
    del E, delta
    d = logw.expm1_().masked_fill_(~pm, 0.0)  # (B, L) displacement W~ - 1

    S = seg.num_segments
    n_s = seg.lengths.to(_F64)
    sum_abs = segment_sum(d.abs(), seg.seg_id, S)
    sum_sq = segment_sum(d.square(), seg.seg_id, S)
    C = sum_sq / n_s.clamp_min(1)
    ess = torch.where(sum_sq > 0, sum_abs.square() / sum_sq.clamp_min(1e-300), torch.ones_like(sum_sq))
    spread = torch.where(n_s > 1, (ess - 1) / (n_s - 1).clamp_min(1), torch.zeros_like(ess))
    rho = (spread * (C / (C + rho_eps)) if rho_eps > 0 else spread).clamp_(0.0, 1.0)
    rho = torch.where(C > 0, rho, torch.zeros_like(rho))

    if mode == "interq":
        alpha = allocate_budget(C, rho, alpha_g, iters) if S else C.new_zeros(0)
    elif mode == "prefix":
        alpha = torch.ones_like(C)
    else:
        alpha = torch.full_like(C, alpha_g)

    # gather alpha per token through a spare slot S (value 0) for non-policy tokens
    alpha_pad = torch.cat([alpha, alpha.new_zeros(1)])
    idx = torch.where(seg.seg_id < 0, torch.full_like(seg.seg_id, S), seg.seg_id)
    weights = alpha_pad[idx].mul_(d).add_(1.0)
    return weights, d, clipped_high, clipped_low, C, rho, alpha, prefix


def interq_terms(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    policy_mask: torch.Tensor,
    valid_mask: torch.Tensor | None = None,
    *,
    eps_low: float = 0.025,
    eps_high: float = 0.05,
    alpha_g: float = 0.5,
    rho_eps: float = 1e-8,
    iters: int = 80,
    mode: str = "interq",
) -> InterQTerms:
    """All intermediate quantities of :func:`interq_weights` (for diagnostics, labs and tests)."""
    _check_params(eps_low, eps_high, alpha_g, rho_eps, iters, mode)
    pm = _checked(old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    with torch.no_grad():
        seg = segments(pm)
        delta = _delta(old_logprobs, rollout_logprobs, pm)
        w, d, ch, cl, C, rho, alpha, _ = _interq(
            delta, seg, eps_low=eps_low, eps_high=eps_high, alpha_g=alpha_g, rho_eps=rho_eps,
            iters=iters, mode=mode,
        )
    return InterQTerms(w, d, ch, cl, C, rho, alpha, seg)


def interq_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    policy_mask: torch.Tensor,
    valid_mask: torch.Tensor | None = None,
    *,
    eps_low: float = 0.025,
    eps_high: float = 0.05,
    alpha_g: float = 0.5,
    rho_eps: float = 1e-8,
    iters: int = 80,
    mode: str = "interq",
) -> tuple[torch.Tensor, dict[str, float]]:
    """InterQ-RL execution-prefix weights ``W`` ``(B, L)`` (detached) and metrics.

    Args:
        old_logprobs: ``(B, L)`` float, learner log-probs of the sampling checkpoint (q_old).
        rollout_logprobs: ``(B, L)`` float, log-probs the rollout engine reported (r_exec).
        policy_mask: ``(B, L)`` bool, True on tokens the policy generated (verl's
            ``response_mask`` with tool tokens at 0).
        valid_mask: ``(B, L)`` bool or None, True on non-padding.
        eps_low, eps_high: envelope of the prefix log ratio, ``[-eps_low, eps_high] * sqrt(n_t)``.
        alpha_g: global shrinkage that sets the batch correction budget.
        rho_eps: ``eps`` of the support's magnitude gate ``C/(C+eps)``.
        iters: bisection steps of :func:`allocate_budget`.
        mode: ``interq`` (support allocation), ``prefix`` (alpha = 1: the clipped prefix weight
            itself) or ``global`` (alpha = alpha_g for every segment).

    Returns:
        ``weights`` ``(B, L)`` float32 (float64 for float64 inputs), 1 off policy tokens, exactly
        1 everywhere when ``old_logprobs == rollout_logprobs``; and a metrics dict
        (``correction/…``, ``mismatch/k3``, ``mismatch/mean_abs_delta``).

    >>> old = torch.tensor([[-1.0, -1.0, 0.0, -1.0]]); pm = torch.tensor([[True, True, False, True]])
    >>> w, m = interq_weights(old, old - 0.01, pm, mode="prefix")
    >>> w
    tensor([[1.0101, 1.0202, 1.0000, 1.0305]])
    """
    _check_params(eps_low, eps_high, alpha_g, rho_eps, iters, mode)
    pm = _checked(old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    with torch.no_grad():
        seg = segments(pm)
        delta = _delta(old_logprobs, rollout_logprobs, pm)
        metrics = _token_metrics(delta, pm)
        w, d, ch, cl, C, rho, alpha, _ = _interq(
            delta, seg, eps_low=eps_low, eps_high=eps_high, alpha_g=alpha_g, rho_eps=rho_eps,
            iters=iters, mode=mode,
        )
        n_tok = pm.sum()
        S = torch.tensor(float(seg.num_segments), dtype=_F64, device=pm.device)
        metrics.update({
            "correction/clip_rate": _safe_mean((ch | cl).sum(), n_tok),
            "correction/rho_mean": _safe_mean(rho.sum(), S),
            "correction/alpha_mean": _safe_mean(alpha.sum(), S),
            "correction/weight_mean": _safe_mean(torch.where(pm, w, 0.0).sum(), n_tok),
            "correction/weight_min": _finite_or_one(torch.where(pm, w, math.inf).amin()),
            "correction/weight_max": _finite_or_one(torch.where(pm, w, -math.inf).amax()),
            "correction/segments": S,
        })
        out = w.to(_out_dtype(old_logprobs))
    return out, _to_floats(metrics)


# --------------------------------------------------------------------------------------------
# baselines


def _baseline_metrics(w: torch.Tensor, delta: torch.Tensor, pm: torch.Tensor, clipped: torch.Tensor):
    n = pm.sum()
    metrics = _token_metrics(delta, pm)
    metrics["correction/clip_rate"] = _safe_mean((clipped & pm).sum(), n)
    metrics["correction/weight_mean"] = _safe_mean(torch.where(pm, w, 0.0).sum(), n)
    return metrics


def tis_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, cap: float = 2.0):
    """Truncated token IS: ``min(exp(delta_t), cap)`` on policy tokens, 1 elsewhere.

    Token-level truncated importance sampling (Ionides 2008; used against rollout/learner
    mismatch by Yao et al., 2025, and as verl's token ``rollout_is``). ``(B, L)`` in and out.
    """
    check_scalar("cap", cap, low=0.0, low_open=True)
    pm = _checked(old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    with torch.no_grad():
        delta = _delta(old_logprobs, rollout_logprobs, pm)
        log_cap = math.log(cap)
        w = torch.exp(delta.clamp(max=log_cap))
        metrics = _baseline_metrics(w, delta, pm, delta > log_cap)
    return w.to(_out_dtype(old_logprobs)), _to_floats(metrics)


def mis_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, lo: float = 0.5,
                hi: float = 2.0):
    """Masked token IS: ``r_t = exp(delta_t)`` if ``lo <= r_t <= hi`` else 0 (1 off policy tokens).

    Tokens whose ratio leaves ``[lo, hi]`` drop out of the loss instead of being truncated
    (IcePop-style masking). ``(B, L)`` in and out.
    """
    check_scalar("lo", lo, low=0.0, low_open=True)
    check_scalar("hi", hi, low=lo)
    pm = _checked(old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    with torch.no_grad():
        delta = _delta(old_logprobs, rollout_logprobs, pm)
        r = torch.exp(delta)
        outside = (r < lo) | (r > hi)
        w = torch.where(outside & pm, torch.zeros_like(r), r)
        metrics = _baseline_metrics(w, delta, pm, outside)
    return w.to(_out_dtype(old_logprobs)), _to_floats(metrics)


def _row_delta_sum(delta: torch.Tensor) -> torch.Tensor:
    return delta.sum(dim=1, keepdim=True)  # (B, 1)


def seq_is_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, cap: float = 2.0):
    """Truncated sequence IS: ``min(exp(sum_t delta_t), cap)`` broadcast over the row's policy tokens.

    Computed in log space (no overflow for long sequences). ``clip_rate`` counts tokens of rows
    whose ratio was truncated. ``(B, L)`` in and out.
    """
    check_scalar("cap", cap, low=0.0, low_open=True)
    pm = _checked(old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    with torch.no_grad():
        delta = _delta(old_logprobs, rollout_logprobs, pm)
        log_cap = math.log(cap)
        total = _row_delta_sum(delta)
        w = torch.where(pm, torch.exp(total.clamp(max=log_cap)), 1.0)
        metrics = _baseline_metrics(w, delta, pm, (total > log_cap).expand_as(pm))
    return w.to(_out_dtype(old_logprobs)), _to_floats(metrics)


def geo_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None):
    """Geometric-mean sequence IS: ``exp(mean_t delta_t)`` over the row's policy tokens, broadcast.

    The length-normalised sequence ratio (as in GSPO's sequence ratio). ``(B, L)`` in and out.
    """
    pm = _checked(old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    with torch.no_grad():
        delta = _delta(old_logprobs, rollout_logprobs, pm)
        mean = _row_delta_sum(delta) / pm.sum(dim=1, keepdim=True).clamp_min(1)
        w = torch.where(pm, torch.exp(mean), 1.0)
        metrics = _baseline_metrics(w, delta, pm, torch.zeros_like(pm))
    return w.to(_out_dtype(old_logprobs)), _to_floats(metrics)


def none_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None):
    """No correction: all-ones ``(B, L)`` (metrics still report the mismatch)."""
    pm = _checked(old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    with torch.no_grad():
        delta = _delta(old_logprobs, rollout_logprobs, pm)
        w = torch.ones(pm.shape, dtype=_out_dtype(old_logprobs), device=pm.device)
        metrics = _baseline_metrics(w, delta, pm, torch.zeros_like(pm))
    return w, _to_floats(metrics)


# --------------------------------------------------------------------------------------------
# metrics


def mismatch_metrics(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    policy_mask: torch.Tensor,
    valid_mask: torch.Tensor | None = None,
    *,
    eps_low: float = 0.025,
    eps_high: float = 0.05,
    alpha_g: float = 0.5,
    rho_eps: float = 1e-8,
    iters: int = 80,
    max_turns: int = 8,
    quantiles: tuple[float, ...] = (0.1, 0.5, 0.9),
) -> dict[str, float]:
    """Fingerprints of rollout/learner mismatch, as a dict of floats.

    With ``r_t = exp(delta_t)``, ``delta_t = old - rollout`` (samples drawn by the engine):

    - ``mismatch/k1 = E[-log r]``, ``k2 = E[(log r)^2 / 2]``, ``k3 = E[r - 1 - log r]`` (Schulman's
      estimators of KL(rollout || learner)), ``chi2 = E[(r - 1)^2]``, ``mean_abs_delta``: means over
      policy tokens; ``mismatch/seq_k1 … seq_chi2`` the same on the sequence log ratio
      ``sum_t delta_t`` (mean over rows with a policy token; the exponent is capped at 80).
    - ``mismatch/turn{k}/current``: mean ``delta_t`` over tokens of the ``k``-th action of a
      trajectory, and ``mismatch/turn{k}/prefix``: mean prefix log ratio ``E_t`` over the same
      tokens, for ``k < max_turns`` (turns that no row reaches are absent). A flat ``current``
      with a growing ``prefix`` is the fingerprint of compounding mismatch.
    - ``correction/clip_rate`` (``_high`` / ``_low``): share of policy tokens whose prefix left the
      InterQ envelope; ``correction/rho_q{q}``, ``correction/alpha_q{q}`` quantiles over segments
      (q in percent), ``correction/C_mean``.
    """
    _check_params(eps_low, eps_high, alpha_g, rho_eps, iters, "interq")
    if int(max_turns) != max_turns or max_turns < 0:
        raise ConfigError("max_turns", f"must be a non-negative integer, got {max_turns!r}")
    for q in quantiles:
        check_scalar("quantiles", q, low=0.0, high=1.0)
    pm = _checked(old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    with torch.no_grad():
        seg = segments(pm)
        delta = _delta(old_logprobs, rollout_logprobs, pm)
        n = pm.sum()
        r1 = torch.expm1(delta)
        m: dict[str, torch.Tensor] = {
            "mismatch/k1": _safe_mean(-delta.sum(), n),
            "mismatch/k2": _safe_mean((delta.square() / 2).sum(), n),
            "mismatch/k3": _safe_mean((r1 - delta).sum(), n),
            "mismatch/chi2": _safe_mean(r1.square().sum(), n),
            "mismatch/mean_abs_delta": _safe_mean(delta.abs().sum(), n),
        }
        del r1
        rows = pm.any(dim=1)
        n_rows = rows.sum()
        total = delta.sum(dim=1)
        r1s = torch.expm1(total.clamp(max=80.0))
        m.update({
            "mismatch/seq_k1": _safe_mean(torch.where(rows, -total, 0.0).sum(), n_rows),
            "mismatch/seq_k2": _safe_mean(torch.where(rows, total.square() / 2, 0.0).sum(), n_rows),
            "mismatch/seq_k3": _safe_mean(torch.where(rows, r1s - total.clamp(max=80.0), 0.0).sum(), n_rows),
            "mismatch/seq_chi2": _safe_mean(torch.where(rows, r1s.square(), 0.0).sum(), n_rows),
        })
        # per turn: current (delta) and prefix (E) log ratio, bucketed by turn index
        T = int(max_turns)
        if T > 0:
            tix = seg.turn_index.reshape(-1)
            tix = torch.where((tix < 0) | (tix >= T), torch.full_like(tix, T), tix)
            count = torch.zeros(T + 1, dtype=_F64, device=pm.device).index_add_(
                0, tix, pm.reshape(-1).to(_F64))
            cur = torch.zeros_like(count).index_add_(0, tix, delta.reshape(-1))
            prefix_all = delta.cumsum(dim=1)
            prefix_all.masked_fill_(~pm, 0.0)
            pre = torch.zeros_like(count).index_add_(0, tix, prefix_all.reshape(-1))
            del prefix_all
            present = (count[:T] > 0).tolist()
            for k in range(T):
                if present[k]:
                    m[f"mismatch/turn{k}/current"] = cur[k] / count[k]
                    m[f"mismatch/turn{k}/prefix"] = pre[k] / count[k]
                    m[f"mismatch/turn{k}/tokens"] = count[k]
        _, d, ch, cl, C, rho, alpha, _ = _interq(
            delta, seg, eps_low=eps_low, eps_high=eps_high, alpha_g=alpha_g, rho_eps=rho_eps,
            iters=iters, mode="interq",
        )
        m.update({
            "correction/clip_rate": _safe_mean((ch | cl).sum(), n),
            "correction/clip_rate_high": _safe_mean(ch.sum(), n),
            "correction/clip_rate_low": _safe_mean(cl.sum(), n),
            "correction/segments": torch.tensor(float(seg.num_segments), dtype=_F64, device=pm.device),
        })
        if seg.num_segments:
            qs = torch.tensor(list(quantiles), dtype=_F64, device=pm.device)
            rq = torch.quantile(rho, qs) if len(quantiles) else rho.new_zeros(0)
            aq = torch.quantile(alpha, qs) if len(quantiles) else alpha.new_zeros(0)
            m["correction/C_mean"] = C.mean()
            for i, q in enumerate(quantiles):
                m[f"correction/rho_q{round(100 * q)}"] = rq[i]
                m[f"correction/alpha_q{round(100 * q)}"] = aq[i]
    return _to_floats(m)
