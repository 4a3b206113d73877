"""Masked aggregation, the PPO/GRPO clipped policy loss and OPSD distillation losses.

Every reduction goes through :func:`aggregate`. Token tensors are ``(B, L)``; ``mask`` is the
``(B, L)`` bool loss mask (policy tokens). Losses are computed in float32 (float64 for float64
inputs) whatever the input precision, and junk (even NaN/inf) at masked positions neither changes
the value nor produces NaN gradients.

These functions run once per micro-batch inside a trainer, so they read no tensor value on the host
when asked not to: metrics are returned as 0-dim detached float64 tensors on the inputs' device
(``float(m["loss/clip_frac"])`` when logging), and ``check_finite=False`` replaces the NaN/inf
check (one host read per argument) by a count of the offending tokens, returned as a metric
(``loss/nonfinite_tokens``, ``opsd/nonfinite_tokens``). Shape, dtype and device checks always run.
``check_finite=True`` is the default for direct calls (a bad value raises at once, naming the
argument); the verl loss passes ``check_finite=False``.
"""

from __future__ import annotations

import math

import torch

from creditlab.core._checks import any_true, check_scalar, check_tensor
from creditlab.errors import ConfigError, InputError

__all__ = [
    "AGG_MODES",
    "aggregate",
    "opsd_loss",
    "opsd_sampled_advantages",
    "opsd_sampled_loss",
    "policy_loss",
]

#: Reduction modes of :func:`aggregate` (verl's ``loss_agg_mode`` with underscores).
AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")

_F64 = torch.float64


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return _F64 if x.dtype == _F64 else torch.float32


def _check_agg(agg: str) -> None:
    if agg not in AGG_MODES:
        raise ConfigError("agg", f"unknown aggregation mode {agg!r}; valid: {', '.join(AGG_MODES)}")


def _masked(x: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` cast to ``dtype`` with masked positions replaced by 0 (value and gradient safe)."""
    return torch.where(mask, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))


def _aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, norm: float | None) -> torch.Tensor:
    """:func:`aggregate` without checks; ``loss`` already zero at masked positions."""
    if mode == "token_mean":
        return loss.sum() / mask.sum().clamp_min(1).to(loss.dtype)
    row_sum = loss.sum(dim=1)  # (B,)
    count = mask.sum(dim=1)  # (B,)
    nonempty = count > 0
    if mode == "seq_mean_token_mean":
        row_sum = row_sum / count.clamp_min(1).to(loss.dtype)
    seq_mean = row_sum.sum() / nonempty.sum().clamp_min(1).to(loss.dtype)
    if mode == "seq_mean_token_sum_norm":
        return seq_mean / (mask.shape[1] if norm is None else norm)
    return seq_mean


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean", *,
              norm: float | None = None, check_finite: bool = True) -> torch.Tensor:
    """Reduce a ``(B, L)`` token loss to a scalar over the True positions of ``mask``.

    Modes (verl's ``agg_loss`` semantics):

    - ``token_mean``: ``sum_{b,t} m l / sum_{b,t} m`` (every token weighs the same; DAPO).
    - ``seq_mean_token_mean``: mean over non-empty rows of the row's token mean (GRPO).
    - ``seq_mean_token_sum``: mean over non-empty rows of the row's token sum.
    - ``seq_mean_token_sum_norm``: ``seq_mean_token_sum / norm`` with the constant ``norm``
      defaulting to ``L`` (Dr. GRPO: a constant instead of each row's length; verl 0.9.1's
      ``seq-mean-token-sum-norm`` and TRL's ``dr_grpo`` when every row is non-empty).

    A fully masked row contributes 0 and is not counted in the ``seq_mean`` denominators; a
    fully masked batch gives 0, never NaN. ``loss`` may hold junk (NaN, inf) at masked positions;
    NaN/inf at a masked-in position raises when ``check_finite`` (one host read), else it propagates.

    >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [9.0, 9.0, 9.0]])
    >>> mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    >>> [round(float(aggregate(loss, mask, m)), 4) for m in AGG_MODES]
    [3.0, 3.25, 7.5, 2.5]
    """
    dims: dict[str, int] = {}
    check_tensor("mask", mask, shape=("B", "L"), boolean=True, dims=dims)
    check_tensor("loss", loss, shape=("B", "L"), floating=True, finite=check_finite, finite_where=mask, dims=dims,
                 device=mask.device)
    _check_agg(mode)
    if norm is not None:
        check_scalar("norm", norm, low=0.0, low_open=True)
    return _aggregate(_masked(loss, mask, _compute_dtype(loss)), mask, mode, norm)


def _mean_metric(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x.detach().to(_F64), 0.0).sum() / mask.sum().clamp_min(1).to(_F64)


def _metric_dict(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """0-dim detached float64 tensors (no host read; verl's ``Metric`` and ``float()`` accept them)."""
    return {k: v.detach().to(_F64).reshape(()) for k, v in metrics.items()}


def _broadcast_advantages(advantages: torch.Tensor, mask: torch.Tensor, check_finite: bool) -> torch.Tensor:
    """``(B, L)`` advantages; a ``(B,)`` input must be finite everywhere, a ``(B, L)`` one on the mask."""
    B, L = mask.shape
    if advantages.dim() == 1:
        check_tensor("advantages", advantages, shape=(B,), floating=True, finite=check_finite, device=mask.device)
        return advantages[:, None].expand(B, L)
    check_tensor("advantages", advantages, shape=(B, L), floating=True, finite=check_finite, finite_where=mask,
                 device=mask.device)
    return advantages


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    weights: torch.Tensor | None = None,
    agg: str = "token_mean",
    norm: float | None = None,
    clip_ratio_c: float | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped surrogate, optionally reweighted per token.

    ``r_t = exp(logprobs_t - old_logprobs_t)`` (log ratio clamped to ``[-20, 20]`` as verl does),
    token loss ``l_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))``
    (Schulman et al., 2017; asymmetric clip as in DAPO), reduced by :func:`aggregate`.

    Args:
        logprobs: ``(B, L)`` learner log-probs (carries the gradient).
        old_logprobs: ``(B, L)`` log-probs of the sampling checkpoint (detached inside).
        advantages: ``(B,)`` (broadcast over tokens) or ``(B, L)``.
        mask: ``(B, L)`` bool loss mask (policy tokens).
        clip_low, clip_high: ratio clip range.
        weights: ``(B, L)`` detached per-token coefficients (e.g. :func:`interq_weights` or verl's
            ``rollout_is_weights``), or None.
        agg: one of :data:`AGG_MODES`; ``norm`` is the constant of ``seq_mean_token_sum_norm``.
        clip_ratio_c: dual clip (Ye et al., 2020; verl's ``clip_ratio_c``, usually 3): for negative
            advantages the token loss is capped at ``-A_t * clip_ratio_c``. None (default): off.
        check_finite: True (default): NaN/inf in an input at a policy token raises
            :class:`InputError` naming it (one host read per input). False (the verl loss, called
            once per micro-batch): no host read at all; the number of policy tokens where an input is
            NaN/inf is returned as ``loss/nonfinite_tokens`` (the loss is then NaN, which verl's
            non-finite gradient-norm guard skips).

    Returns:
        scalar loss (float32, float64 for float64 ``logprobs``) and metrics ``loss/policy``,
        ``loss/clip_frac`` (share of tokens where the clipped branch is active), ``loss/approx_kl``
        (mean ``old - new`` log-prob), ``loss/ratio_mean``, ``loss/weight_mean`` (and
        ``loss/nonfinite_tokens`` when ``check_finite=False``), as 0-dim detached float64 tensors on
        the inputs' device: nothing is read on the host.

    >>> lp = torch.zeros(1, 2, requires_grad=True)
    >>> loss, m = policy_loss(lp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool))
    >>> float(loss.detach()), float(m["loss/clip_frac"])
    (-1.0, 0.0)
    """
    dims: dict[str, int] = {}
    check_tensor("mask", mask, shape=("B", "L"), boolean=True, dims=dims)
    dev = mask.device
    check_tensor("logprobs", logprobs, shape=("B", "L"), floating=True, finite=check_finite, finite_where=mask,
                 dims=dims, device=dev)
    check_tensor("old_logprobs", old_logprobs, shape=("B", "L"), floating=True, finite=check_finite,
                 finite_where=mask, dims=dims, device=dev)
    adv = _broadcast_advantages(advantages, mask, check_finite)
    if weights is not None:
        check_tensor("weights", weights, shape=("B", "L"), floating=True, finite=check_finite, finite_where=mask,
                     dims=dims, device=dev)
    check_scalar("clip_low", clip_low, low=0.0, high=1.0)
    check_scalar("clip_high", clip_high, low=0.0)
    if clip_ratio_c is not None:
        check_scalar("clip_ratio_c", clip_ratio_c, low=1.0, low_open=True)
    _check_agg(agg)
    if norm is not None:
        check_scalar("norm", norm, low=0.0, low_open=True)

    dt = _compute_dtype(logprobs)
    lp = _masked(logprobs, mask, dt)
    old = _masked(old_logprobs.detach(), mask, dt)
    a = _masked(adv.detach(), mask, dt)
    log_ratio = (lp - old).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -a * ratio
    pg_clipped = -a * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    tok = torch.maximum(pg_unclipped, pg_clipped)
    if clip_ratio_c is not None:
        tok = torch.where(a < 0, torch.minimum(tok, -a * clip_ratio_c), tok)
    if weights is not None:
        w = _masked(weights.detach(), mask, dt)
        tok = tok * w
    else:
        w = None
    loss = _aggregate(tok, mask, agg, norm)
    with torch.no_grad():
        metrics = {
            "loss/policy": loss.detach(),
            "loss/clip_frac": _mean_metric((pg_clipped > pg_unclipped).to(dt), mask),
            "loss/approx_kl": _mean_metric(-log_ratio, mask),
            "loss/ratio_mean": _mean_metric(ratio, mask),
            "loss/weight_mean": _mean_metric(w, mask) if w is not None else loss.new_ones((), dtype=_F64),
        }
        if not check_finite:  # one fused pass: NaN/inf in any input makes this sum NaN/inf
            probe = logprobs.detach().to(dt) - old_logprobs.detach().to(dt)
            probe = probe + (adv.detach().to(dt) if weights is None else adv.detach().to(dt) * weights.detach().to(dt))
            metrics["loss/nonfinite_tokens"] = (~torch.isfinite(probe) & mask).sum()
    return loss, _metric_dict(metrics)


# --------------------------------------------------------------------------------------------
# on-policy self-distillation

_LOG_FLOOR = -1e4  # log-prob floor: a -inf logit (masked vocabulary entry) gives p = 0, not NaN


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``sum_v p (log p - log q)`` over the last dimension."""
    return (logp.exp() * (logp - logq)).sum(dim=-1)


def opsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    beta: float = 0.5,
    *,
    agg: str = "token_mean",
    check_finite: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level generalised Jensen-Shannon divergence between teacher and student.

    On-policy self-distillation: the student's own rollouts are scored by a frozen teacher that
    sees privileged information (reference answer, per-turn advice). With
    ``M = beta P_T + (1 - beta) P_S`` (GKD, Agarwal et al. 2024; TRL's ``generalized_jsd_loss``):
    ``JSD_beta = beta KL(P_T || M) + (1 - beta) KL(P_S || M)`` for ``0 < beta < 1``,
    ``beta = 0`` is the forward ``KL(P_T || P_S)`` and ``beta = 1`` the reverse ``KL(P_S || P_T)``.
    Reduced over policy tokens by :func:`aggregate` (``token_mean`` by default).

    Args:
        student_logits: ``(B, L, V)`` (carries the gradient).
        teacher_logits: ``(B, L, V)`` (detached inside).
        mask: ``(B, L)`` bool, policy tokens.
        beta: interpolation in ``[0, 1]``.
        check_finite: True (default): NaN/+inf logits at a policy token raise (one host read per
            input); False: counted in the metric ``opsd/nonfinite_tokens`` instead (no host read).

    Returns:
        scalar loss and metrics ``loss/opsd``, ``opsd/forward_kl``, ``opsd/reverse_kl`` (0-dim float64
        tensors, see the module docstring).
    """
    dims: dict[str, int] = {}
    check_tensor("mask", mask, shape=("B", "L"), boolean=True, dims=dims)
    check_tensor("student_logits", student_logits, shape=("B", "L", "V"), floating=True, dims=dims,
                 device=mask.device)
    check_tensor("teacher_logits", teacher_logits, shape=("B", "L", "V"), floating=True, dims=dims,
                 device=mask.device)
    nonfinite = torch.zeros_like(mask)
    for name, x in (("student_logits", student_logits), ("teacher_logits", teacher_logits)):
        bad = (torch.isnan(x) | (x == math.inf)).any(-1) & mask  # -inf is a legal masked vocabulary entry
        if check_finite and any_true(bad):
            raise InputError(f"{name}: contains NaN or +inf at a policy token")
        nonfinite = nonfinite | bad
    check_scalar("beta", beta, low=0.0, high=1.0)
    _check_agg(agg)

    dt = _compute_dtype(student_logits)
    m3 = mask[..., None]
    zero = torch.zeros((), dtype=dt, device=mask.device)
    log_s = torch.log_softmax(torch.where(m3, student_logits.to(dt), zero), dim=-1).clamp_min(_LOG_FLOOR)
    log_t = torch.log_softmax(torch.where(m3, teacher_logits.detach().to(dt), zero), dim=-1)
    log_t = log_t.clamp_min(_LOG_FLOOR)
    if beta == 0.0:
        tok = _kl(log_t, log_s)
    elif beta == 1.0:
        tok = _kl(log_s, log_t)
    else:
        log_m = torch.logsumexp(torch.stack([log_s + math.log(1.0 - beta), log_t + math.log(beta)]), dim=0)
        tok = beta * _kl(log_t, log_m) + (1.0 - beta) * _kl(log_s, log_m)
    tok = torch.where(mask, tok, zero)
    loss = _aggregate(tok, mask, agg, None)
    with torch.no_grad():
        metrics = {
            "loss/opsd": loss.detach(),
            "opsd/forward_kl": _mean_metric(_kl(log_t, log_s), mask),
            "opsd/reverse_kl": _mean_metric(_kl(log_s, log_t), mask),
        }
        if not check_finite:
            metrics["opsd/nonfinite_tokens"] = nonfinite.sum()
    return loss, _metric_dict(metrics)


def opsd_sampled_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                            mask: torch.Tensor, *, check_finite: bool = True) -> torch.Tensor:
    """Per-token distillation advantage ``teacher - student`` log-prob ``(B, L)``, detached, 0 off mask.

    The sampled-token form of OPSD: on the student's sampled token, ``log p_T - log p_S`` is a
    one-sample estimate of the negative reverse KL, usable as a dense token advantage.
    ``check_finite=False``: no NaN/inf check (no host read).
    """
    dims: dict[str, int] = {}
    check_tensor("mask", mask, shape=("B", "L"), boolean=True, dims=dims)
    check_tensor("student_logprobs", student_logprobs, shape=("B", "L"), floating=True, finite=check_finite,
                 finite_where=mask, dims=dims, device=mask.device)
    check_tensor("teacher_logprobs", teacher_logprobs, shape=("B", "L"), floating=True, finite=check_finite,
                 finite_where=mask, dims=dims, device=mask.device)
    dt = _compute_dtype(student_logprobs)
    with torch.no_grad():
        return _masked(teacher_logprobs, mask, dt) - _masked(student_logprobs, mask, dt)


def opsd_sampled_loss(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: str = "token_mean",
    check_finite: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sampled-token OPSD: ``aggregate(-sg(log p_T - log p_S) * log p_S)``.

    Its gradient is the policy-gradient estimate of ``-grad KL(P_S || P_T)`` restricted to the
    sampled tokens (on-policy distillation with a per-token reverse-KL reward). Returns the
    scalar loss and metrics ``loss/opsd_sampled``, ``opsd/reverse_kl`` (mean ``log p_S - log p_T``)
    as 0-dim float64 tensors; ``check_finite=False`` adds ``opsd/nonfinite_tokens`` instead of the
    NaN/inf check (no host read).
    """
    adv = opsd_sampled_advantages(student_logprobs, teacher_logprobs, mask, check_finite=check_finite)
    _check_agg(agg)
    dt = _compute_dtype(student_logprobs)
    lp = _masked(student_logprobs, mask, dt)
    loss = _aggregate(-adv * lp, mask, agg, None)
    metrics = {"loss/opsd_sampled": loss.detach(), "opsd/reverse_kl": _mean_metric(-adv, mask)}
    if not check_finite:
        metrics["opsd/nonfinite_tokens"] = (~torch.isfinite(adv) & mask).sum()
    return loss, _metric_dict(metrics)
