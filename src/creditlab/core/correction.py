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
5. ``alpha_s = min(c*rho_s, 1)`` with ``c`` set so that the batch budget
   ``sum_s C_s alpha_s^2 = alpha_g^2 sum_s C_s`` binds (exact breakpoint search, or a fixed
   number of bisection steps; see :func:`allocate_budget`).
6. ``W_t = 1 + alpha_seg(t) * (W~_t - 1)`` on policy tokens, 1 elsewhere; used detached as a
   per-token coefficient of the PPO/GRPO token loss.

The idea of bounding a cumulative importance ratio by an envelope that grows like a random walk
and shrinking it per action follows the truncated/per-decision importance sampling literature
(Precup et al., 2000; Ionides, 2008); the application to quantized multi-turn rollouts is the
InterQ-RL design of this library (docs/design.md section 7).

Baselines under the same signature ``fn(old_logprobs, rollout_logprobs, policy_mask,
valid_mask=None, **params) -> (weights, metrics)``: :func:`tis_weights` (truncated token IS),
:func:`mis_weights` (masked token IS), :func:`seq_is_weights` (truncated sequence IS),
:func:`geo_weights` (geometric mean of the sequence ratio), :func:`none_weights`.

Every arm is registered by name in :data:`CORRECTIONS` (``interq``, ``prefix``, ``global``, ``tis``,
``mis``, ``seq_is``, ``geo``, ``none``); the trainer integrations and the labs look arms up there at
call time (:func:`get_correction`, :func:`correction_params`), so an arm added with
:func:`register_correction` works everywhere without touching them. :func:`correction_weights`
computes an arm's weights together with :func:`mismatch_metrics`, with one InterQ pass per batch.

Everything runs on the device of the inputs, with no Python loop over tokens or segments, using
only dense passes over ``(B, L)`` (arithmetic with the mask as 0/1 numbers, row-wise cumulative
sums, a gather) and ``(S,)``-sized work per segment. Prefix sums and segment sums accumulate in
float64; per-token arithmetic runs in float32 for float32/bfloat16/float16 inputs and in float64
for float64 inputs; the returned weights are float32 (float64 for float64 inputs) and detached.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch

from creditlab.core._checks import any_true, check_scalar, check_tensor
from creditlab.core.masks import (
    SegmentBounds,
    Segments,
    effective_policy_mask,
    segment_bounds,
    segments_from_bounds,
)
from creditlab.core.registry import Registry
from creditlab.errors import ConfigError, InputError

__all__ = [
    "CORRECTIONS",
    "INTERQ",
    "INTERQ_MODES",
    "CorrectionFn",
    "InterQParams",
    "InterQTerms",
    "allocate_budget",
    "correction_params",
    "correction_weights",
    "geo_weights",
    "get_correction",
    "interq_terms",
    "interq_weights",
    "mis_weights",
    "mismatch_metrics",
    "none_weights",
    "register_correction",
    "registered_correction",
    "seq_is_weights",
    "tis_weights",
    "unregister_correction",
]

#: Modes of :func:`interq_weights` (each is also a registered arm of the same name).
INTERQ_MODES = ("interq", "prefix", "global")

_F64 = torch.float64


# --------------------------------------------------------------------------------------------
# the registry of correction arms

#: A correction arm: ``fn(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, **params)
#: -> (weights, metrics)`` with ``weights`` ``(B, L)`` detached and ``metrics`` a dict of floats.
CorrectionFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]

#: Every registered arm by name (read it, register with :func:`register_correction`).
CORRECTIONS: Registry[CorrectionFn] = Registry("correction", validate=lambda fn: _arm_parameters(fn, "correction"))

_F = TypeVar("_F", bound=Callable[..., Any])
_NAME = re.compile(r"^[A-Za-z0-9_]+$")
_POSITIONAL = 4  # old_logprobs, rollout_logprobs, policy_mask, valid_mask


def _arm_parameters(fn: Callable[..., Any], where: str) -> tuple[str, ...]:
    """Names of the keyword parameters of an arm; :class:`ConfigError` if its signature is not an arm's."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise ConfigError(where, f"{fn!r} has no inspectable signature") from None
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < _POSITIONAL or any(p.default is p.empty for p in positional[3:_POSITIONAL]):
        raise ConfigError(where, "an arm takes (old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, "
                                 f"*, params...), got {fn.__name__}{sig}")
    rest = positional[_POSITIONAL:] + [p for p in params if p.kind is p.KEYWORD_ONLY]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise ConfigError(where, f"{fn.__name__}{sig}: declare the arm's parameters by name (no *args / **kwargs): "
                                 "trainer configs are validated against them")
    missing = [p.name for p in rest if p.default is p.empty]
    if missing:
        raise ConfigError(where, f"{fn.__name__}: parameter(s) {missing} need a default")
    return tuple(p.name for p in rest)


def register_correction(name: str) -> Callable[[_F], _F]:
    """Decorator registering an arm under ``name`` in :data:`CORRECTIONS`.

    The arm has the common signature ``fn(old_logprobs, rollout_logprobs, policy_mask,
    valid_mask=None, *, param=default, ...) -> (weights (B, L) detached, metrics dict)``; its
    parameters must be named, with defaults (they are what trainer configs may set). ``name`` is
    letters, digits and ``_`` (it becomes verl's ``creditlab_<name>``). Registering the same function
    again is a no-op; another function under a taken name raises :class:`ConfigError`. Use a
    module-level function (not a lambda) so that the arm pickles.
    """
    _arm_name(name)

    def register(fn: _F) -> _F:
        CORRECTIONS.register(name, fn)
        return fn

    return register


def _arm_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError("correction", f"arm names are letters, digits and '_', got {name!r}")
    return name


def unregister_correction(name: str) -> CorrectionFn:
    """Remove the arm ``name`` from :data:`CORRECTIONS` and return it (tests, notebooks)."""
    return CORRECTIONS.unregister(name)


def registered_correction(name: str, fn: CorrectionFn) -> contextlib.AbstractContextManager[CorrectionFn]:
    """``with registered_correction("half_tis", fn):`` registers ``fn`` for the block, then removes it."""
    return CORRECTIONS.registered(_arm_name(name), fn)


def get_correction(name: str) -> CorrectionFn:
    """The arm registered as ``name``; :class:`ConfigError` listing every registered name otherwise.

    >>> get_correction("tis") is tis_weights
    True
    """
    return CORRECTIONS.get(name)


def correction_params(name: str) -> tuple[str, ...]:
    """The keyword parameters the arm ``name`` accepts, from its signature.

    >>> correction_params("interq")
    ('eps_low', 'eps_high', 'alpha_g', 'rho_eps', 'iters')
    >>> correction_params("tis"), correction_params("geo")
    (('cap',), ())
    """
    return _arm_parameters(get_correction(name), "correction")


class InterQTerms(NamedTuple):
    """Intermediate quantities of the InterQ-RL weights (all detached).

    Attributes:
        weights: ``(B, L)`` final ``W_t`` (1 off policy tokens), in the working dtype (float64 for
            float64 inputs, else float32).
        displacement: ``(B, L)`` ``d_t = W~_t - 1`` on policy tokens, 0 elsewhere.
        clipped_high / clipped_low: ``(B, L)`` bool, policy tokens whose prefix ``E_t`` left the
            envelope above / below.
        C, rho, alpha: ``(S,)`` float64 per-segment correction magnitude, support and alpha.
        segments: the :class:`~creditlab.core.masks.Segments` of the batch.
        bounds: the :class:`~creditlab.core.masks.SegmentBounds` of the batch (what
            :func:`mismatch_metrics` reuses when given these terms).
    """

    weights: torch.Tensor
    displacement: torch.Tensor
    clipped_high: torch.Tensor
    clipped_low: torch.Tensor
    C: torch.Tensor
    rho: torch.Tensor
    alpha: torch.Tensor
    segments: Segments
    bounds: SegmentBounds


# --------------------------------------------------------------------------------------------
# input handling


def logprob_tolerance(dtype: torch.dtype) -> float:
    """How far above 0 a log-prob of ``dtype`` may round (``log_softmax`` of the top token):
    ``max(1e-4, 16 eps)``, e.g. 1e-4 for float32, 0.125 for bfloat16."""
    return max(1e-4, 16 * torch.finfo(dtype).eps)


def _check_finite(name: str, x: torch.Tensor, pm: torch.Tensor) -> None:
    """NaN/inf or a positive value (beyond :func:`logprob_tolerance`) at a policy token raises;
    junk elsewhere is allowed.

    Fast path: one host read of two reductions over the policy tokens, their sum (finite when no
    NaN/inf is there) and their largest value; only when one is off are the positions inspected.
    """
    if x.device.type == "meta":
        return
    on = torch.where(pm, x, torch.zeros((), dtype=x.dtype, device=x.device))
    total, top = torch.stack([on.sum(), on.max() if on.numel() else on.new_zeros(())]).tolist()
    if total != total or abs(total) == float("inf"):
        check_tensor(name, x, finite=True, finite_where=pm)
    if top > logprob_tolerance(x.dtype):
        bad = (x > logprob_tolerance(x.dtype)) & pm
        idx = tuple(int(i) for i in bad.nonzero()[0].tolist())
        probs = bool(((on >= 0) & (on <= 1) | ~pm).all())
        hint = ("they look like probabilities: pass their log (torch.log)" if probs else
                "pass log-probs of the sampled tokens (log_softmax(logits).gather(...))")
        raise InputError(f"{name}: log-probs are <= 0, got {x[idx].item():.4g} at index {idx} (a policy token); "
                         f"{hint}")


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
        _check_finite(name, x, pm)
    return pm


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return _F64 if x.dtype == _F64 else torch.float32


def _prepare(old_logprobs, rollout_logprobs, pm) -> tuple[torch.Tensor, torch.Tensor]:
    """``(delta, m)``: ``old - rollout`` on policy tokens and exactly 0 elsewhere, and the 0/1 mask.

    Junk (even NaN/inf) at non-policy positions is zeroed by ``nan_to_num`` and the 0/1 mask,
    without boolean ``where`` passes.
    """
    wd = _work_dtype(old_logprobs)
    m = pm.view(torch.uint8).to(wd)
    delta = old_logprobs.to(wd) - rollout_logprobs.to(wd)
    delta = torch.nan_to_num_(delta, nan=0.0, posinf=0.0, neginf=0.0).mul_(m)
    return delta, m


def _safe_mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return total.to(_F64) / count.to(_F64).clamp_min(1)


def _to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """One host synchronisation for all metrics."""
    if not metrics:
        return {}
    values = torch.stack([v.detach().to(_F64).reshape(()) for v in metrics.values()]).tolist()
    return dict(zip(metrics.keys(), values, strict=True))


def _token_metrics(delta: torch.Tensor, n: torch.Tensor) -> dict[str, torch.Tensor]:
    """K3 and mean |delta| over the ``n`` policy tokens (``delta`` is 0 elsewhere)."""
    k3 = torch.expm1(delta).sub_(delta).sum()  # plain sums: sum(dtype=float64) would copy (B, L)
    return {
        "mismatch/k3": _safe_mean(k3, n),
        "mismatch/mean_abs_delta": _safe_mean(delta.abs().sum(), n),
    }


def _weight_metrics(w: torch.Tensor, m: torch.Tensor, n: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean/min/max of ``w`` over policy tokens (``w`` is exactly 1 elsewhere; 1 when none).

    ``w - 1`` is 0 off policy, so its extremes over the batch are the policy extremes whenever
    they straddle 0 (the usual case); only otherwise is a masked pass needed.
    """
    if w.numel() == 0:
        one = w.new_ones((), dtype=_F64)
        return {"correction/weight_mean": one, "correction/weight_min": one, "correction/weight_max": one}
    dev = torch.sub(w, 1.0)
    lo, hi = torch.aminmax(dev)
    if bool(lo >= 0) or bool(hi <= 0):  # masked extremes by arithmetic, no boolean where over (B, L)
        big = (1.0 - m).mul_(1e30)
        lo = torch.where(lo < 0, lo, torch.add(dev, big).amin())
        hi = torch.where(hi > 0, hi, torch.sub(dev, big).amax())
    return {
        "correction/weight_mean": 1.0 + _safe_mean(dev.sum(), n),
        "correction/weight_min": 1.0 + torch.where(lo < 1e29, lo.to(_F64), 0.0),
        "correction/weight_max": 1.0 + torch.where(hi > -1e29, hi.to(_F64), 0.0),
    }


# --------------------------------------------------------------------------------------------
# the parameters of InterQ-RL


def _check_iters(iters) -> None:
    if iters is not None and (isinstance(iters, bool) or int(iters) != iters or iters < 1):
        raise ConfigError("iters", f"must be None (exact) or a positive integer, got {iters!r}")


@dataclass(frozen=True)
class InterQParams:
    """The parameters of InterQ-RL, checked when the record is made.

    :data:`INTERQ` (this record with no arguments) is the one source of their defaults: every
    function of this module that takes them (:func:`interq_weights`, :func:`interq_terms`,
    :func:`mismatch_metrics`, :func:`allocate_budget`, the ``interq`` / ``prefix`` / ``global`` arms)
    declares ``param: type = INTERQ.param``.
    """

    eps_low: float = 0.025
    """Lower slope of the envelope: the prefix log ratio ``E_t`` is clipped below at
    ``-eps_low * sqrt(n_t)`` (``>= 0``)."""
    eps_high: float = 0.05
    """Upper slope of the envelope: ``E_t`` is clipped above at ``eps_high * sqrt(n_t)`` (``>= 0``)."""
    alpha_g: float = 0.5
    """Global shrinkage in ``[0, 1]``: the batch budget ``sum_s C_s alpha_s^2 = alpha_g^2 sum_s C_s``
    (and every segment's alpha in the ``global`` arm)."""
    rho_eps: float = 1e-8
    """``eps`` of the support's magnitude gate ``C_s / (C_s + eps)`` (``>= 0``; 0 turns the gate off)."""
    iters: int | None = None
    """None for the exact budget allocation, or a number of bisection steps (:func:`allocate_budget`)."""

    def __post_init__(self) -> None:
        check_scalar("eps_low", self.eps_low, low=0.0)
        check_scalar("eps_high", self.eps_high, low=0.0)
        check_scalar("alpha_g", self.alpha_g, low=0.0, high=1.0)
        check_scalar("rho_eps", self.rho_eps, low=0.0)
        _check_iters(self.iters)


#: The default InterQ-RL parameters.
INTERQ = InterQParams()


# --------------------------------------------------------------------------------------------
# budget allocation


def _budget_log_scale_exact(C: torch.Tensor, rho: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``log c`` of ``alpha_s = min(c rho_s, 1)`` spending ``target`` exactly (+inf if it cannot).

    Water-filling over the breakpoints: sort by ``rho`` descending; if the ``k`` largest are
    capped at 1, the rest spend ``c^2 Q_k`` with ``Q_k = sum_{j>=k} C_j rho_j^2``, so
    ``c_k = sqrt((target - A_k) / Q_k)`` with ``A_k`` the capped mass. The answer is the first
    ``k`` whose uncapped segments stay below the cap (``c_k rho_k <= 1``): ``O(S log S)``, no
    iteration. ``Q_k`` is a reversed ``logcumsumexp`` so supports down to denormals work.
    """
    rs, order = torch.sort(rho, descending=True, stable=True)
    Cs = C[order]
    capped = torch.cumsum(Cs, 0) - Cs  # A_k
    log_rs = torch.log(rs)
    log_rest = torch.flip(torch.logcumsumexp(torch.flip(torch.log(Cs) + 2.0 * log_rs, (0,)), 0), (0,))
    log_c = 0.5 * (torch.log((target - capped).clamp_min(0.0)) - log_rest)
    ok = torch.isfinite(log_rest) & (log_c + log_rs <= 0.0)
    k = torch.argmax(ok.to(torch.int32))  # first True (argmax returns the first maximum)
    at_k = log_c.gather(0, k.reshape(1).to(torch.int64)).reshape(())  # not log_c[k]: a 0-dim index syncs
    return torch.where(ok.any(), at_k, torch.full_like(target, math.inf))


def _budget_log_scale_bisection(C, rho, target, pos, iters: int) -> torch.Tensor:
    """The same ``log c`` by ``iters`` steps of bisection on ``log c`` (the method of docs/design.md section 7).

    Bracket: ``c0 = sqrt(target / sum C rho^2)`` (no segment capped; ``f(c0) <= target``) and
    ``1 / min rho`` (every positive-support segment capped). Working on ``log c`` keeps the
    bracket finite for supports down to denormals.
    """
    log_rho = torch.log(rho)  # -inf where rho = 0
    log_hi = -torch.where(pos, log_rho, torch.zeros_like(log_rho)).amin()
    log_quad = torch.logsumexp(torch.log(C) + 2.0 * log_rho, 0)
    log_lo = 0.5 * (torch.log(target) - log_quad)
    log_lo = torch.where(torch.isfinite(log_lo), torch.minimum(log_lo, log_hi), torch.full_like(log_hi, -800.0))
    for _ in range(iters):
        mid = 0.5 * (log_lo + log_hi)
        spent = (C * torch.exp(2.0 * torch.clamp(mid + log_rho, max=0.0))).sum()
        below = spent < target
        log_lo = torch.where(below, mid, log_lo)
        log_hi = torch.where(below, log_hi, mid)
    return log_hi


def allocate_budget(
    C_s: torch.Tensor, rho_s: torch.Tensor, alpha_g: float = INTERQ.alpha_g, iters: int | None = INTERQ.iters
) -> torch.Tensor:
    """Per-segment shrinkage ``alpha_s`` ``(S,)`` under a fixed correction budget.

    Solves ``max sum_s C_s rho_s alpha_s`` s.t. ``sum_s C_s alpha_s^2 <= alpha_g^2 sum_s C_s``,
    ``0 <= alpha_s <= 1``. By the KKT conditions the solution is ``alpha_s = min(c rho_s, 1)``
    with ``c`` such that the budget binds whenever it can. ``c`` comes from an exact breakpoint
    search (``iters=None``, default: sort + prefix sums, no iteration) or from ``iters`` steps of
    bisection on ``log c`` (fixed count); both are vectorised and never synchronise with the host.
    When the budget cannot bind (``sum_{rho>0} C_s < alpha_g^2 sum C_s``) every segment with
    positive support gets ``alpha_s = 1``. Segments with ``rho_s = 0`` get 0 while another segment
    has support; if no segment has both ``C_s > 0`` and ``rho_s > 0`` the objective is flat and
    every segment gets ``alpha_g`` (the ``global`` arm). Equal ``rho`` gives ``alpha_g`` everywhere.

    Args:
        C_s: ``(S,)`` non-negative correction magnitudes.
        rho_s: ``(S,)`` supports in ``[0, 1]`` (clamped).
        alpha_g: global shrinkage in ``[0, 1]`` defining the budget.
        iters: None for the exact search, or a number of bisection steps.

    Returns:
        ``(S,)`` float64 ``alpha_s``.

    >>> allocate_budget(torch.tensor([1.0, 1.0]), torch.tensor([0.3, 0.3]), alpha_g=0.5)
    tensor([0.5000, 0.5000], dtype=torch.float64)
    >>> [round(a, 6) for a in allocate_budget(torch.tensor([1.0, 1.0]), torch.tensor([0.2, 0.4])).tolist()]
    [0.316228, 0.632456]

    (``c^2 (0.2^2 + 0.4^2) = 0.5^2 * 2`` gives ``c = sqrt(2.5)``, ``alpha = (sqrt(0.1), sqrt(0.4))``.)
    """
    dims: dict[str, int] = {}
    check_tensor("C_s", C_s, shape=("S",), floating=True, finite=True, dims=dims)
    check_tensor("rho_s", rho_s, shape=("S",), floating=True, finite=True, dims=dims)
    check_scalar("alpha_g", alpha_g, low=0.0, high=1.0)
    _check_iters(iters)
    if any_true(C_s < 0):
        raise InputError("C_s: must be non-negative")
    return _allocate(C_s.to(_F64), rho_s.to(_F64).clamp(0.0, 1.0), alpha_g, iters)


def _allocate(C: torch.Tensor, rho: torch.Tensor, alpha_g: float, iters: int | None) -> torch.Tensor:
    if C.numel() == 0:
        return C.clone()
    target = alpha_g**2 * C.sum()
    pos = (C > 0) & (rho > 0)
    if iters is None:
        log_c = _budget_log_scale_exact(torch.where(pos, C, 0.0), torch.where(pos, rho, 0.0), target)
    else:
        log_c = _budget_log_scale_bisection(C, rho, target, pos, int(iters))
    alpha = torch.where(rho > 0, torch.exp(torch.clamp(log_c + torch.log(rho), max=0.0)), 0.0)
    alpha = torch.where(target > 0, alpha, 0.0)
    return torch.where(pos.any(), alpha, torch.full_like(alpha, alpha_g))


# --------------------------------------------------------------------------------------------
# InterQ-RL


def _check_mode(mode: str) -> None:
    if mode not in INTERQ_MODES:
        raise ConfigError("mode", f"unknown mode {mode!r}; valid: {', '.join(INTERQ_MODES)}")


def _segment_sums(x: torch.Tensor, b: SegmentBounds) -> torch.Tensor:
    """Per-segment sums ``(S,)`` float64 of ``(B, L)`` ``x`` (0 off policy) by row-wise cumsums.

    Segments never cross rows, so a segment's sum is the row's running sum at its last token
    minus the running sum just before its first (zero at the row start). Accumulated in float64;
    the absolute rounding error is ~1e-16 times the row's running total.
    """
    B, L = x.shape
    run = torch.cumsum(x, 1, dtype=_F64).view(-1)
    before = torch.where(b.start % L == 0, 0.0, run[(b.start - 1).clamp_min(0)])
    return run[b.end] - before


class _InterQ(NamedTuple):
    """What one InterQ pass computes (:func:`_interq`; the public view is :class:`InterQTerms`)."""

    weights: torch.Tensor  # (B, L) W_t, 1 off policy, working dtype
    displacement: torch.Tensor  # (B, L) d_t = W~_t - 1, 0 off policy
    clip: torch.Tensor  # (B, L) +1 / -1 where the prefix was clipped high / low, 0 elsewhere
    C: torch.Tensor  # (S,) float64
    rho: torch.Tensor  # (S,) float64
    alpha: torch.Tensor  # (S,) float64, as the mode chose it


def _interq(delta, m, b: SegmentBounds, p: InterQParams, mode: str) -> _InterQ:
    """Core of InterQ-RL on ``delta`` / ``m`` from :func:`_prepare` (neither is modified)."""
    wd = delta.dtype
    B, L = delta.shape
    E = torch.cumsum(delta, 1, dtype=_F64)  # (B, L) prefix log ratio, carried over tool tokens
    del delta
    if wd != _F64:
        E = E.to(wd)
    bound = torch.cumsum(m, 1).sqrt_()  # (B, L) sqrt(n_t)
    hi = bound * p.eps_high
    lo = bound.mul_(-p.eps_low)
    logw = torch.clamp(E, min=lo, max=hi)
    del hi, lo
    clip = E.sub_(logw).sign_().mul_(m)
    d = logw.expm1_().mul_(m)  # (B, L) displacement W~ - 1, exactly 0 off policy

    n_s = (b.end - b.start + 1).to(_F64)
    sum_abs = _segment_sums(d.abs(), b)
    sum_sq = _segment_sums(d.square(), b)
    C = sum_sq / n_s
    ess = torch.where(sum_sq > 0, sum_abs.square() / sum_sq.clamp_min(1e-300), 1.0)
    spread = torch.where(n_s > 1, (ess - 1.0) / (n_s - 1.0).clamp_min(1.0), 0.0)
    rho = spread * (C / (C + p.rho_eps)) if p.rho_eps > 0 else spread
    rho = torch.where(C > 0, rho.clamp(0.0, 1.0), 0.0)

    if mode == "interq":
        alpha = _allocate(C, rho, p.alpha_g, p.iters)
        run = torch.cumsum(b.starts.view(torch.uint8).reshape(-1), 0)  # (B*L,) segments started so far
        alpha_pad = torch.cat([alpha.new_zeros(1), alpha]).to(wd)
        weights = alpha_pad.index_select(0, run).view(B, L).mul_(d).add_(1.0)
    else:
        a = 1.0 if mode == "prefix" else p.alpha_g
        alpha = torch.full_like(C, a)
        weights = torch.add(d, 1.0) if a == 1.0 else torch.mul(d, a).add_(1.0)
    return _InterQ(weights, d, clip, C, rho, alpha)


class _Pass(NamedTuple):
    """The checked inputs of a batch and its InterQ pass (:func:`_interq_pass`)."""

    policy: torch.Tensor  # (B, L) bool effective policy mask
    bounds: SegmentBounds
    delta: torch.Tensor  # (B, L) from _prepare, unconsumed
    m: torch.Tensor  # (B, L) 0/1 policy mask in the working dtype
    interq: _InterQ


def _interq_pass(old_logprobs, rollout_logprobs, policy_mask, valid_mask, p: InterQParams, mode: str) -> _Pass:
    """Checks, segment bounds, ``delta`` and one InterQ pass.

    ``delta`` is returned unconsumed (the pass works on a copy only where it must: it never writes
    into ``delta``)."""
    _check_mode(mode)
    pm = _checked(old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    b = segment_bounds(pm)
    delta, m = _prepare(old_logprobs, rollout_logprobs, pm)
    return _Pass(pm, b, delta, m, _interq(delta, m, b, p, mode))


def _interq_metrics(run: _Pass) -> dict[str, torch.Tensor]:
    """The metrics of :func:`interq_weights` from one pass (tensors; see :func:`_to_floats`)."""
    q, m, n = run.interq, run.m, run.policy.sum()
    metrics = _token_metrics(run.delta, n)
    S = torch.tensor(float(run.bounds.num_segments), dtype=_F64, device=m.device)
    metrics["correction/clip_rate"] = _safe_mean(q.clip.abs().sum(), n)
    metrics["correction/rho_mean"] = _safe_mean(q.rho.sum(), S)
    metrics["correction/alpha_mean"] = _safe_mean(q.alpha.sum(), S)
    metrics.update(_weight_metrics(q.weights, m, n))
    metrics["correction/segments"] = S
    return metrics


def interq_terms(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    policy_mask: torch.Tensor,
    valid_mask: torch.Tensor | None = None,
    *,
    eps_low: float = INTERQ.eps_low,
    eps_high: float = INTERQ.eps_high,
    alpha_g: float = INTERQ.alpha_g,
    rho_eps: float = INTERQ.rho_eps,
    iters: int | None = INTERQ.iters,
    mode: str = "interq",
) -> InterQTerms:
    """All intermediate quantities of :func:`interq_weights` (for diagnostics, labs and tests).

    Pass them to :func:`mismatch_metrics` (``terms=``) to get the mismatch fingerprints of the same
    batch without a second InterQ pass.
    """
    p = InterQParams(eps_low, eps_high, alpha_g, rho_eps, iters)
    with torch.no_grad():
        run = _interq_pass(old_logprobs, rollout_logprobs, policy_mask, valid_mask, p, mode)
    q, b = run.interq, run.bounds
    return InterQTerms(q.weights, q.displacement, q.clip > 0, q.clip < 0, q.C, q.rho, q.alpha,
                       segments_from_bounds(b), b)


def interq_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    policy_mask: torch.Tensor,
    valid_mask: torch.Tensor | None = None,
    *,
    eps_low: float = INTERQ.eps_low,
    eps_high: float = INTERQ.eps_high,
    alpha_g: float = INTERQ.alpha_g,
    rho_eps: float = INTERQ.rho_eps,
    iters: int | None = INTERQ.iters,
    mode: str = "interq",
) -> tuple[torch.Tensor, dict[str, float]]:
    """InterQ-RL execution-prefix weights ``W`` ``(B, L)`` (detached) and metrics.

    Args:
        old_logprobs: ``(B, L)`` float, learner log-probs of the sampling checkpoint (q_old).
        rollout_logprobs: ``(B, L)`` float, log-probs the rollout engine reported (r_exec).
        policy_mask: ``(B, L)`` bool, True on tokens the policy generated (verl's
            ``response_mask`` with tool tokens at 0, as bool).
        valid_mask: ``(B, L)`` bool or None, True on non-padding.
        eps_low, eps_high: envelope of the prefix log ratio, ``[-eps_low, eps_high] * sqrt(n_t)``.
        alpha_g: global shrinkage that sets the batch correction budget.
        rho_eps: ``eps`` of the support's magnitude gate ``C/(C+eps)``.
        iters: None (exact budget allocation) or a number of bisection steps, see
            :func:`allocate_budget`.
        mode: ``interq`` (support allocation), ``prefix`` (alpha = 1: the clipped prefix weight
            itself) or ``global`` (alpha = alpha_g for every segment). Each mode is also a registered
            arm of the same name (:data:`CORRECTIONS`).

    Returns:
        ``weights`` ``(B, L)`` float32 (float64 for float64 inputs), 1 off policy tokens, exactly
        1 everywhere when ``old_logprobs == rollout_logprobs``; and metrics ``correction/…``
        (``clip_rate``, ``rho_mean``, ``alpha_mean``, ``weight_mean/min/max`` over policy tokens,
        ``segments``),
        ``mismatch/k3`` and ``mismatch/mean_abs_delta``.

    >>> old = torch.tensor([[-1.0, -1.0, 0.0, -1.0]]); pm = torch.tensor([[True, True, False, True]])
    >>> w, m = interq_weights(old, old - 0.01, pm, mode="prefix")
    >>> w
    tensor([[1.0101, 1.0202, 1.0000, 1.0305]])
    """
    p = InterQParams(eps_low, eps_high, alpha_g, rho_eps, iters)
    with torch.no_grad():
        run = _interq_pass(old_logprobs, rollout_logprobs, policy_mask, valid_mask, p, mode)
        metrics = _interq_metrics(run)
    return run.interq.weights, _to_floats(metrics)


def _mode_arm(mode: str) -> CorrectionFn:
    """The registered arm ``mode``: :func:`interq_weights` with that ``mode``, under the module-level name
    ``_<mode>_arm`` (so that it pickles)."""

    def arm(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, eps_low: float = INTERQ.eps_low,
            eps_high: float = INTERQ.eps_high, alpha_g: float = INTERQ.alpha_g, rho_eps: float = INTERQ.rho_eps,
            iters: int | None = INTERQ.iters):
        return interq_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask, eps_low=eps_low,
                              eps_high=eps_high, alpha_g=alpha_g, rho_eps=rho_eps, iters=iters, mode=mode)

    arm.__name__ = arm.__qualname__ = f"_{mode}_arm"
    arm.__doc__ = (f"Registered arm ``{mode}``: :func:`interq_weights` with ``mode=\"{mode}\"`` (same "
                   "parameters, same result).")
    return register_correction(mode)(arm)


#: The InterQ mode of each mode arm: :func:`correction_weights` shares such an arm's pass with
#: :func:`mismatch_metrics`.
_ARM_MODES: dict[CorrectionFn, str] = {_mode_arm(mode): mode for mode in INTERQ_MODES}
_interq_arm, _prefix_arm, _global_arm = _ARM_MODES


# --------------------------------------------------------------------------------------------
# baselines


def _baseline(old_logprobs, rollout_logprobs, policy_mask, valid_mask, weigh):
    """Shared body of the baselines: ``weigh(delta, m) -> (w, clipped 0/1)``; metrics included."""
    pm = _checked(old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    with torch.no_grad():
        delta, m = _prepare(old_logprobs, rollout_logprobs, pm)
        n = pm.sum()
        w, clipped = weigh(delta, m)
        metrics = _token_metrics(delta, n)
        metrics["correction/clip_rate"] = _safe_mean((clipped * m).sum(), n)
        metrics.update(_weight_metrics(w, m, n))
    return w, _to_floats(metrics)


@register_correction("tis")
def tis_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, cap: float = 2.0):
    """Truncated token IS: ``min(exp(delta_t), cap)`` on policy tokens, 1 elsewhere.

    Token-level truncated importance sampling (Ionides 2008; used against rollout/learner
    mismatch by Yao et al., 2025, and as verl's token ``rollout_is``). ``(B, L)`` in and out;
    ``clip_rate`` is the share of policy tokens truncated.
    """
    check_scalar("cap", cap, low=0.0, low_open=True)
    log_cap = math.log(cap)

    def weigh(delta, m):
        return torch.exp(delta.clamp(max=log_cap)), (delta > log_cap).to(delta.dtype)

    return _baseline(old_logprobs, rollout_logprobs, policy_mask, valid_mask, weigh)


@register_correction("mis")
def mis_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, lo: float = 0.5,
                hi: float = 2.0):
    """Masked token IS: ``r_t = exp(delta_t)`` if ``lo <= r_t <= hi`` else 0 (1 off policy tokens).

    Tokens whose ratio leaves ``[lo, hi]`` drop out of the loss instead of being truncated
    (IcePop-style masking). ``(B, L)`` in and out; ``clip_rate`` is the share masked.
    """
    check_scalar("lo", lo, low=0.0, low_open=True)
    check_scalar("hi", hi, low=lo)

    def weigh(delta, m):
        r = torch.exp(delta)
        outside = ((r < lo) | (r > hi)).to(delta.dtype).mul_(m)
        return r * (1.0 - outside) + (1.0 - m) * outside, outside  # off policy r = 1 exactly

    return _baseline(old_logprobs, rollout_logprobs, policy_mask, valid_mask, weigh)


@register_correction("seq_is")
def seq_is_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, cap: float = 2.0):
    """Truncated sequence IS: ``min(exp(sum_t delta_t), cap)`` broadcast over the row's policy tokens.

    Computed in log space (no overflow for long sequences); the sum accumulates in float64.
    ``clip_rate`` counts tokens of rows whose ratio was truncated. ``(B, L)`` in and out.
    """
    check_scalar("cap", cap, low=0.0, low_open=True)
    log_cap = math.log(cap)

    def weigh(delta, m):
        total = delta.sum(dim=1, keepdim=True, dtype=_F64)  # (B, 1)
        w_row = torch.exp(total.clamp(max=log_cap)).to(delta.dtype)
        return 1.0 + m * (w_row - 1.0), (total > log_cap).to(delta.dtype).expand_as(m)

    return _baseline(old_logprobs, rollout_logprobs, policy_mask, valid_mask, weigh)


@register_correction("geo")
def geo_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None):
    """Geometric-mean sequence IS: ``exp(mean_t delta_t)`` over the row's policy tokens, broadcast.

    The length-normalised sequence ratio (as in GSPO's sequence ratio). ``(B, L)`` in and out.
    """

    def weigh(delta, m):
        mean = delta.sum(dim=1, keepdim=True, dtype=_F64) / m.sum(dim=1, keepdim=True, dtype=_F64).clamp_min(1)
        return 1.0 + m * (torch.exp(mean).to(delta.dtype) - 1.0), torch.zeros_like(m)

    return _baseline(old_logprobs, rollout_logprobs, policy_mask, valid_mask, weigh)


@register_correction("none")
def none_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None):
    """No correction: all-ones ``(B, L)`` (metrics still report the mismatch)."""
    return _baseline(old_logprobs, rollout_logprobs, policy_mask, valid_mask,
                     lambda delta, m: (torch.ones_like(delta), torch.zeros_like(m)))


# --------------------------------------------------------------------------------------------
# metrics

#: Defaults of :func:`mismatch_metrics` (``max_turns``, ``quantiles``), which :func:`correction_weights`
#: uses too.
_MAX_TURNS = 8
_QUANTILES = (0.1, 0.5, 0.9)


def mismatch_metrics(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    policy_mask: torch.Tensor,
    valid_mask: torch.Tensor | None = None,
    *,
    eps_low: float = INTERQ.eps_low,
    eps_high: float = INTERQ.eps_high,
    alpha_g: float = INTERQ.alpha_g,
    rho_eps: float = INTERQ.rho_eps,
    iters: int | None = INTERQ.iters,
    max_turns: int = _MAX_TURNS,
    quantiles: tuple[float, ...] = _QUANTILES,
    terms: InterQTerms | None = None,
) -> dict[str, float]:
    """Fingerprints of rollout/learner mismatch, as a dict of floats.

    With ``r_t = exp(delta_t)``, ``delta_t = old - rollout`` (samples drawn by the engine):

    - ``mismatch/k1 = E[-log r]``, ``k2 = E[(log r)^2 / 2]``, ``k3 = E[r - 1 - log r]`` (Schulman's
      estimators of KL(rollout || learner)), ``chi2 = E[(r - 1)^2]``, ``mean_abs_delta``: means over
      policy tokens; ``mismatch/seq_k1 … seq_chi2`` the same on the sequence log ratio
      ``sum_t delta_t`` (mean over rows with a policy token; the exponent is capped at 80).
    - ``mismatch/turn{k}/current``: mean ``delta_t`` over tokens of the ``k``-th action of a
      trajectory, ``mismatch/turn{k}/prefix``: mean prefix log ratio ``E_t`` over the same tokens,
      and ``mismatch/turn{k}/tokens``, for ``k < max_turns`` (turns no row reaches are absent). A
      flat ``current`` with a growing ``prefix`` is the fingerprint of compounding mismatch.
    - ``correction/clip_rate`` (``_high`` / ``_low``): share of policy tokens whose prefix left the
      InterQ envelope; ``correction/rho_q{q}``, ``correction/alpha_q{q}`` quantiles over segments
      (q in percent), ``correction/C_mean``, ``correction/segments``. ``alpha`` is always the
      ``interq`` allocation of the budget ``alpha_g``.

    ``terms``: the :func:`interq_terms` of the same inputs with the same ``eps_low``, ``eps_high`` and
    ``rho_eps`` (any ``mode``): their segments, clip flags, ``C`` and ``rho`` are used instead of a
    second InterQ pass (only the ``(S,)``-sized budget allocation is redone). Same numbers.
    """
    p = InterQParams(eps_low, eps_high, alpha_g, rho_eps, iters)
    if isinstance(max_turns, bool) or int(max_turns) != max_turns or max_turns < 0:
        raise ConfigError("max_turns", f"must be a non-negative integer, got {max_turns!r}")
    for q in quantiles:
        check_scalar("quantiles", q, low=0.0, high=1.0)
    pm = _checked(old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    with torch.no_grad():
        delta, m = _prepare(old_logprobs, rollout_logprobs, pm)
        if terms is None:
            b = segment_bounds(pm)
            iq = _interq(delta, m, b, p, "interq")
            C, rho = iq.C, iq.rho
            high, low = _clip_counts(iq.clip)
        else:
            if not isinstance(terms, InterQTerms):
                raise InputError(f"terms: expected the InterQTerms of interq_terms, got {type(terms).__name__}")
            if terms.weights.shape != pm.shape or terms.bounds.policy.shape != pm.shape:
                raise InputError(f"terms: computed for shape {tuple(terms.weights.shape)}, the inputs are "
                                 f"{tuple(pm.shape)}")
            b, C, rho = terms.bounds, terms.C, terms.rho
            high = terms.clipped_high.sum(dtype=_F64)
            low = terms.clipped_low.sum(dtype=_F64)
        alpha = _allocate(C, rho, alpha_g, iters)
        out = _mismatch(delta, m, b, high, low, C, rho, alpha, int(max_turns), quantiles)
    return _to_floats(out)


def _clip_counts(clip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 counts of the tokens clipped high and low, from the ``clip`` of :class:`_InterQ`."""
    return clip.clamp(min=0.0).sum(dtype=_F64), (-clip).clamp(min=0.0).sum(dtype=_F64)


def _mismatch(delta, m, b: SegmentBounds, high, low, C, rho, alpha, T: int, quantiles) -> dict[str, torch.Tensor]:
    """Body of :func:`mismatch_metrics` once the InterQ quantities are known."""
    dev = m.device
    delta64 = delta.to(_F64)
    n = m.sum(dtype=_F64)
    r1 = torch.expm1(delta64)
    out: dict[str, torch.Tensor] = {
        "mismatch/k1": _safe_mean(0.0 - delta64.sum(), n),
        "mismatch/k2": _safe_mean((delta64.square() / 2).sum(), n),
        "mismatch/k3": _safe_mean((r1 - delta64).sum(), n),
        "mismatch/chi2": _safe_mean(r1.square().sum(), n),
        "mismatch/mean_abs_delta": _safe_mean(delta64.abs().sum(), n),
    }
    del r1
    rows = (m.sum(dim=1) > 0).to(_F64)
    n_rows = rows.sum()
    total = delta64.sum(dim=1)
    capped = total.clamp(max=80.0)
    r1s = torch.expm1(capped)
    out.update({
        "mismatch/seq_k1": _safe_mean((rows * -total).sum(), n_rows),
        "mismatch/seq_k2": _safe_mean((rows * total.square() / 2).sum(), n_rows),
        "mismatch/seq_k3": _safe_mean((rows * (r1s - capped)).sum(), n_rows),
        "mismatch/seq_chi2": _safe_mean((rows * r1s.square()).sum(), n_rows),
    })
    # by turn: per-segment sums of delta and of the prefix E, then summed over segments by turn
    if T > 0 and b.num_segments:
        E = torch.cumsum(delta64, 1)
        seg_delta = _segment_sums(delta64, b)
        seg_prefix = _segment_sums(E.mul_(m.to(_F64)), b)
        del E
        seg_len = (b.end - b.start + 1).to(_F64)
        bucket = b.turn.clamp(max=T)  # turns >= T go to a dropped bucket
        count = torch.zeros(T + 1, dtype=_F64, device=dev).index_add_(0, bucket, seg_len)
        cur = torch.zeros_like(count).index_add_(0, bucket, seg_delta)
        pre = torch.zeros_like(count).index_add_(0, bucket, seg_prefix)
        present = (count[:T] > 0).tolist()
        for k in range(T):
            if present[k]:
                out[f"mismatch/turn{k}/current"] = cur[k] / count[k]
                out[f"mismatch/turn{k}/prefix"] = pre[k] / count[k]
                out[f"mismatch/turn{k}/tokens"] = count[k]
    out.update({
        "correction/clip_rate": _safe_mean(high + low, n),
        "correction/clip_rate_high": _safe_mean(high, n),
        "correction/clip_rate_low": _safe_mean(low, n),
        "correction/segments": torch.tensor(float(b.num_segments), dtype=_F64, device=dev),
    })
    if b.num_segments:
        out["correction/C_mean"] = C.mean()
        if quantiles:
            qs = torch.tensor(list(quantiles), dtype=_F64, device=dev)
            rq, aq = torch.quantile(rho, qs), torch.quantile(alpha, qs)
            for i, q in enumerate(quantiles):
                out[f"correction/rho_q{round(100 * q)}"] = rq[i]
                out[f"correction/alpha_q{round(100 * q)}"] = aq[i]
    return out


# --------------------------------------------------------------------------------------------
# an arm and its diagnostics in one call


def _merged(arm: dict, diagnostic: dict) -> dict:
    """The arm's metrics and the diagnostic's in one dict: on a shared key, ``mismatch/*`` from the
    diagnostic, anything else (``correction/*``) from the arm."""
    out = {**diagnostic, **arm}
    out.update({k: diagnostic[k] for k in arm if k in diagnostic and k.startswith("mismatch/")})
    return out


def correction_weights(
    name: str,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    policy_mask: torch.Tensor,
    valid_mask: torch.Tensor | None = None,
    params: Mapping[str, Any] | None = None,
    *,
    diagnostics: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weights ``(B, L)`` of the registered arm ``name`` and its metrics merged with
    :func:`mismatch_metrics`, computing the InterQ pass once per batch. Where both define a key, the
    arm's ``correction/*`` value is kept (it describes the weights returned) and the diagnostic's
    ``mismatch/*`` value (an arm's quick ``mismatch/k3`` is float32; the diagnostic's is the one
    definition every arm shares).

    This is what the trainer integrations call once per batch. ``params`` are the arm's keyword
    parameters (:func:`correction_params`; an unknown key raises :class:`ConfigError` naming the
    valid ones). For the ``interq`` / ``prefix`` / ``global`` arms, ``mismatch_metrics`` gets the
    same InterQ parameters and reuses the arm's pass (:func:`interq_terms`); for every other arm it
    runs with its defaults, as a separate diagnostic. The numbers equal those of calling the arm and
    then ``mismatch_metrics``. ``diagnostics=False`` returns the arm's own metrics only.

    >>> old = torch.tensor([[-1.0, -1.0, 0.0, -1.0]]); pm = torch.tensor([[True, True, False, True]])
    >>> w, m = correction_weights("prefix", old, old - 0.01, pm)
    >>> w
    tensor([[1.0101, 1.0202, 1.0000, 1.0305]])
    >>> round(m["mismatch/turn1/prefix"], 4), m["correction/segments"]
    (0.03, 2.0)
    """
    fn = get_correction(name)
    params = dict(params or {})
    valid = _arm_parameters(fn, "correction")
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ConfigError("correction_params",
                          f"unknown {unknown} for arm {name!r}; valid: {', '.join(valid) or 'none'}")
    mode = _ARM_MODES.get(fn)
    if mode is None or not diagnostics:
        w, metrics = fn(old_logprobs, rollout_logprobs, policy_mask, valid_mask, **params)
        if diagnostics:
            metrics = _merged(metrics, mismatch_metrics(old_logprobs, rollout_logprobs, policy_mask, valid_mask))
        return w, metrics
    p = InterQParams(**params)
    with torch.no_grad():
        run = _interq_pass(old_logprobs, rollout_logprobs, policy_mask, valid_mask, p, mode)
        q = run.interq
        arm = _interq_metrics(run)
        alloc = q.alpha if mode == "interq" else _allocate(q.C, q.rho, p.alpha_g, p.iters)
        diag = _mismatch(run.delta, run.m, run.bounds, *_clip_counts(q.clip), q.C, q.rho, alloc, _MAX_TURNS,
                         _QUANTILES)
    return q.weights, _to_floats(_merged(arm, diag))
