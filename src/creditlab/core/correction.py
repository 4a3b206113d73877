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
:func:`geo_weights` (geometric mean of the sequence ratio), :func:`none_weights`; and one composed arm,
:func:`interq_tis_weights` (the InterQ weight times the truncated token ratio).

Every arm is registered by name in :data:`CORRECTIONS` (``interq``, ``prefix``, ``global``, ``tis``,
``mis``, ``seq_is``, ``geo``, ``none``, ``interq_tis``); the trainer integrations and the labs look arms
up there at call time (:func:`get_correction`, :func:`correction_params`), so an arm added with
:func:`register_correction` works everywhere without touching them. :func:`correction_weights`
computes an arm's weights together with :func:`mismatch_metrics`, with one InterQ pass per batch.
:func:`parse_correction` reads an arm as a trainer config names it (``interq_tis:cap=3,alpha_g=0.4``).

Everything runs on the device of the inputs, with no Python loop over tokens or segments, using
only dense passes (arithmetic with the mask as 0/1 numbers, row-wise cumulative sums, gathers) and
``(S,)``-sized work per segment. The InterQ pass runs on the policy tokens packed to the front of
their rows (``(B, Pmax)``, ``Pmax`` the most policy tokens of a row; the same bits as on ``(B, L)``:
the other tokens have ``delta = 0``), so its cost follows the policy tokens, not the padding and tool
outputs around them. Prefix sums and segment sums accumulate in float64; per-token arithmetic runs
in float32 for float32/bfloat16/float16 inputs and in float64 for float64 inputs; the returned
weights are float32 (float64 for float64 inputs) and detached.

Input checks (``check=True``, the default everywhere): one fused pass and one host read per call;
``check=False`` counts NaN/inf tokens instead (``correction/nonfinite_tokens``), with the same numbers.
:func:`correction_weights` with ``sync=False`` reads nothing on the host (a trainer's hot path, once
per micro-batch) and returns its metrics as a :class:`DeviceMetrics`, read once when looked at.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, ParamSpec, TypeVar

import torch

from creditlab.core._checks import any_true, check_scalar, check_tensor, require_values
from creditlab.core.masks import (
    SegmentBounds,
    Segments,
    _bounds_of_effective_mask,
    _starts_ends,
    effective_policy_mask,
    segments_from_bounds,
)
from creditlab.core.registry import Registry, check_name, keyword_parameters, signature_of
from creditlab.errors import ConfigError, InputError

__all__ = [
    "CORRECTIONS",
    "INTERQ",
    "INTERQ_MODES",
    "CorrectionFn",
    "DeviceMetrics",
    "InterQParams",
    "InterQTerms",
    "allocate_budget",
    "correction_params",
    "correction_weights",
    "geo_weights",
    "get_correction",
    "interq_terms",
    "interq_tis_weights",
    "interq_weights",
    "mis_weights",
    "mismatch_metrics",
    "none_weights",
    "parse_correction",
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
_P = ParamSpec("_P")
_R = TypeVar("_R")
_POSITIONAL = 4  # old_logprobs, rollout_logprobs, policy_mask, valid_mask
#: Keyword an arm may declare that is not one of its parameters: ``check`` (the input checks,
#: :func:`correction_weights` passes it on). Trainer configs cannot set it.
_RESERVED = ("check",)


def _arm_parameters(fn: Callable[..., Any], where: str) -> tuple[str, ...]:
    """Names of the keyword parameters of an arm (``check`` left out: it is not a parameter of the
    correction); :class:`ConfigError` if its signature is not an arm's."""
    sig = signature_of(fn, where)
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < _POSITIONAL or any(p.default is p.empty for p in positional[3:_POSITIONAL]):
        raise ConfigError(where, "an arm takes (old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, "
                                 f"*, params...), got {fn.__name__}{sig}")
    rest = positional[_POSITIONAL:] + [p for p in params if p.kind is p.KEYWORD_ONLY]
    return tuple(n for n in keyword_parameters(fn, sig, rest, where, "arm") if n not in _RESERVED)


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
    return check_name(name, "correction", "arm")


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


class _Inputs(NamedTuple):
    """The checked inputs of a batch (:func:`_inputs`)."""

    policy: torch.Tensor  # (B, L) bool effective policy mask
    delta: torch.Tensor  # (B, L) old - rollout on policy tokens, exactly 0 elsewhere, working dtype
    m: torch.Tensor  # (B, L) 0/1 policy mask in the working dtype
    nonfinite: torch.Tensor | None  # 0-dim int64 count of policy tokens with old - rollout NaN/inf (check=False)


def _check_flag(check: object) -> bool:
    if not isinstance(check, bool):
        raise ConfigError("check", f"must be True or False, got {check!r}")
    return check


def _inputs(old_logprobs, rollout_logprobs, policy_mask, valid_mask, check: bool) -> _Inputs:
    """Check the four standard inputs; the effective policy mask, ``delta`` and the 0/1 mask.

    Shapes, dtypes and devices are always checked (no tensor value is read). ``check=True``: so are the
    values at policy tokens: NaN/inf, or a log-prob above 0 (beyond :func:`logprob_tolerance`), raises
    :class:`InputError` naming the argument; junk elsewhere is allowed. One fused pass: the two
    log-probs with every non-policy position zeroed (which ``delta`` is then computed from, so junk,
    even NaN, never reaches it) and their extremes, read on the host in one read (none on ``meta``
    tensors, which have no values). ``check=False``: nothing is read; the policy tokens where
    ``old - rollout`` is NaN/inf are counted (``nonfinite``) and get ``delta = 0`` (weight 1).
    """
    pm = _effective_mask(old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    wd = _work_dtype(old_logprobs)
    m = pm.view(torch.uint8).to(wd)
    if _check_flag(check):
        old = torch.where(pm, old_logprobs, 0.0)
        rollout = torch.where(pm, rollout_logprobs, 0.0)
        _check_values(old, rollout, old_logprobs, rollout_logprobs, pm)
        return _Inputs(pm, old.to(wd).sub_(rollout.to(wd)), m, None)
    delta = old_logprobs.to(wd) - rollout_logprobs.to(wd)
    nonfinite = (torch.mul(delta, 0.0) != 0.0).logical_and_(pm).sum()  # x * 0 is NaN exactly for NaN/inf x
    delta = torch.nan_to_num_(delta, nan=0.0, posinf=0.0, neginf=0.0).mul_(m)
    return _Inputs(pm, delta, m, nonfinite)


def _effective_mask(old_logprobs, rollout_logprobs, policy_mask, valid_mask) -> torch.Tensor:
    """The shape, dtype and device checks of the four standard inputs (no value read); the effective
    policy mask."""
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
    return pm


def _check_values(old, rollout, old_logprobs, rollout_logprobs, pm) -> None:
    """Raise on NaN/inf or a log-prob above 0 at a policy token, from the extremes of ``old`` /
    ``rollout`` (the inputs with every non-policy position at 0), read in one host read; only when one
    is off are the positions inspected (to name the first)."""
    if pm.device.type == "meta" or pm.numel() == 0:
        return
    stats = torch.stack([v.to(_F64) for v in (*torch.aminmax(old), *torch.aminmax(rollout))]).tolist()
    for (name, x, on), (lo, hi) in zip((("old_logprobs", old_logprobs, old), ("rollout_logprobs", rollout_logprobs,
                                                                               rollout)),
                                       (stats[:2], stats[2:]), strict=True):
        if not (math.isfinite(lo) and math.isfinite(hi)):
            check_tensor(name, x, finite=True, finite_where=pm)  # raises, naming the first position
        tol = logprob_tolerance(x.dtype)
        if hi > tol:
            idx = tuple(int(i) for i in (on > tol).nonzero()[0].tolist())
            probs = bool(((on >= 0) & (on <= 1)).all())  # 0 off policy
            hint = ("they look like probabilities: pass their log (torch.log)" if probs else
                    "pass log-probs of the sampled tokens (log_softmax(logits).gather(...))")
            raise InputError(f"{name}: log-probs are <= 0, got {x[idx].item():.4g} at index {idx} (a policy "
                             f"token); {hint}")


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return _F64 if x.dtype == _F64 else torch.float32


def _safe_mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return total.to(_F64) / count.to(_F64).clamp_min(1)


# --------------------------------------------------------------------------------------------
# metrics read once


class DeviceMetrics(Mapping[str, float]):
    """Metrics computed on the inputs' device and read on the host in one transfer, when first looked at.

    What :func:`correction_weights` returns with ``sync=False`` (a trainer's hot path, once per
    micro-batch): computing the metrics reads nothing, and the one read happens where the trainer reads
    them (``m["correction/clip_rate"]``, ``dict(m)``, iterating), for all of them at once. Keys whose
    presence depends on the data (``mismatch/turn{k}/...`` of a turn no row reaches, the segment
    quantiles of a batch without segments) are settled at that read. Afterwards it holds plain floats
    (the tensors are released) and pickles as them. :meth:`add` merges more metrics in (tensors or
    floats), still without reading.

    >>> m = DeviceMetrics({"a": torch.tensor(1.5), "b": 2.0})
    >>> m.add({"c": torch.tensor(3)}, prefix="x/")["x/c"], dict(m)
    (3.0, {'a': 1.5, 'b': 2.0, 'x/c': 3.0})
    """

    __slots__ = ("_present", "_values")

    def __init__(self, values: Mapping[str, torch.Tensor | float] | None = None, *,
                 present: Mapping[str, torch.Tensor] | None = None):
        self._values: dict[str, torch.Tensor | float] = dict(values or {})
        #: key -> 0-dim tensor: the key is kept at the read only where it is nonzero
        self._present: dict[str, torch.Tensor] = dict(present or {})

    def add(self, metrics: Mapping[str, torch.Tensor | float], prefix: str = "") -> DeviceMetrics:
        """Add ``metrics`` (a dict or another :class:`DeviceMetrics`, its keys prefixed with ``prefix``),
        replacing entries of the same name; returns ``self``. Nothing is read."""
        if isinstance(metrics, DeviceMetrics):
            values, present = metrics._values, metrics._present
        else:
            values, present = metrics, {}
        for k, v in values.items():
            self._values[prefix + k] = v
            self._present.pop(prefix + k, None)
        self._present.update({prefix + k: v for k, v in present.items()})
        return self

    def _read(self) -> dict[str, float]:
        keys = [k for k, v in self._values.items() if isinstance(v, torch.Tensor)]
        flags = list(self._present)
        if keys or flags:
            parts = [self._values[k] for k in keys] + [self._present[k] for k in flags]
            by_device: dict[torch.device, list[int]] = {}
            for i, t in enumerate(parts):
                by_device.setdefault(t.device, []).append(i)
            numbers = [0.0] * len(parts)
            for idx in by_device.values():  # one read (per device: one in practice)
                got = torch.stack([parts[i].detach().reshape(()).to(_F64) for i in idx]).tolist()
                for i, x in zip(idx, got, strict=True):
                    numbers[i] = x
            for k, x in zip(keys, numbers, strict=False):
                self._values[k] = x
            for k, ok in zip(flags, numbers[len(keys):], strict=True):
                if not ok:
                    self._values.pop(k, None)
            self._present = {}
        return self._values  # type: ignore[return-value]

    def __getitem__(self, key: str) -> float:
        return self._read()[key]

    def __iter__(self):
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())

    def __contains__(self, key: object) -> bool:
        return key in self._read()

    def __reduce__(self):
        return (DeviceMetrics, (dict(self._read()),))

    def __repr__(self) -> str:
        pending = sum(isinstance(v, torch.Tensor) for v in self._values.values()) + len(self._present)
        if pending:
            return f"DeviceMetrics({len(self._values)} metrics, not read yet)"
        return f"DeviceMetrics({self._values!r})"


def _to_floats(metrics: Mapping[str, torch.Tensor | float], present: Mapping[str, torch.Tensor] | None = None
               ) -> dict[str, float]:
    """One host read for all metrics (the keys of ``present`` kept where their flag is nonzero)."""
    return dict(DeviceMetrics(metrics, present=present))


def _token_metrics(delta: torch.Tensor, n: torch.Tensor) -> dict[str, torch.Tensor]:
    """K3 and mean |delta| over the ``n`` policy tokens (``delta`` is 0 elsewhere)."""
    k3 = torch.expm1(delta).sub_(delta).sum()  # plain sums: sum(dtype=float64) would copy (B, L)
    return {
        "mismatch/k3": _safe_mean(k3, n),
        "mismatch/mean_abs_delta": _safe_mean(delta.abs().sum(), n),
    }


def _first_policy_token(pm: torch.Tensor) -> torch.Tensor:
    """``(1,)`` int64 flat index of the first policy token (0 when there is none), without a host read."""
    return torch.argmax(pm.reshape(-1).view(torch.uint8)).reshape(1)


def _weight_metrics(w: torch.Tensor, pm: torch.Tensor, n: torch.Tensor, first: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
    """Mean/min/max of ``w`` over policy tokens (``w`` is exactly 1 elsewhere; 1 when none), no host read.

    The extremes come from one pass over ``w - 1`` with the non-policy positions set to the value at a
    policy token (``first``: its flat index, found here when not given), so they never count.
    """
    one = w.new_ones((), dtype=_F64)
    if w.numel() == 0:
        return {"correction/weight_mean": one, "correction/weight_min": one, "correction/weight_max": one}
    dev = torch.sub(w, 1.0)
    if first is None:
        first = _first_policy_token(pm)
    fill = dev.reshape(-1).index_select(0, first).reshape(())
    lo, hi = torch.aminmax(torch.where(pm, dev, fill))
    some = n > 0
    return {
        "correction/weight_mean": 1.0 + _safe_mean(dev.sum(), n),
        "correction/weight_min": torch.where(some, 1.0 + lo.to(_F64), one),
        "correction/weight_max": torch.where(some, 1.0 + hi.to(_F64), one),
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
    function of this module that declares them (:func:`interq_weights`, :func:`mismatch_metrics`,
    :func:`allocate_budget`) declares ``param: type = INTERQ.param``, and :func:`interq_terms` and the
    ``interq`` / ``prefix`` / ``global`` arms take the keyword parameters of :func:`interq_weights`.
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


@dataclass(frozen=True)
class _InterQSettings(InterQParams):
    """What a call of :func:`interq_weights` sets: InterQ-RL's parameters (checked when the record is
    made), then ``mode`` and ``check`` (checked where they are used). :func:`interq_weights` declares
    them as its keyword parameters, with these defaults; :func:`interq_terms` and the mode arms take
    its keyword parameters (:func:`_keywords_of`) and make this record of them."""

    mode: str = "interq"
    check: bool = True


def _with_keywords_of(fn: Callable[..., Any], model: Callable[..., Any], leave_out: tuple[str, ...] = ()) -> None:
    """Give ``fn(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, **settings)`` the keyword-only
    parameters of ``model`` (but ``leave_out``) instead of ``**settings`` in its signature: what
    ``inspect``, ``help`` and the registry (:func:`correction_params`) read. ``fn`` checks the names it
    is given with :func:`_known_keywords`."""
    sig = inspect.signature(fn)
    fixed = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    keywords = [p for p in inspect.signature(model).parameters.values()
                if p.kind is p.KEYWORD_ONLY and p.name not in leave_out]
    fn.__signature__ = sig.replace(parameters=[*fixed, *keywords])  # type: ignore[attr-defined]


def _keywords_of(model: Callable[_P, Any]) -> Callable[[Callable[..., _R]], Callable[_P, _R]]:
    """Decorator: the function takes the parameters of ``model``, for type checkers (``_P``) and at run
    time (:func:`_with_keywords_of`)."""

    def take(fn: Callable[..., _R]) -> Callable[_P, _R]:
        _with_keywords_of(fn, model)
        return fn

    return take


def _known_keywords(fn: Callable[..., Any], settings: Mapping[str, Any]) -> None:
    """The :class:`TypeError` of a call of ``fn`` (see :func:`_with_keywords_of`) with a keyword its
    signature does not name."""
    names = fn.__signature__.parameters  # type: ignore[attr-defined]
    unknown = [k for k in settings if k not in names]
    if unknown:
        raise TypeError(f"{fn.__name__}() got an unexpected keyword argument {unknown[0]!r}")


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


class _Bounds(NamedTuple):
    """The segments of a batch for one InterQ pass (:func:`_bounds`).

    With a host read (``sync=True``): the :class:`SegmentBounds` arrays, ``size = S`` read from
    ``nonzero``. Without (``sync=False``): the same arrays padded to the most segments the batch can
    hold, ``size = B * ceil(L / 2)``, the ``S`` real segments first (``valid``), the padding with
    zero sums (so ``C = rho = 0``) and never gathered back onto a token.
    """

    segments: SegmentBounds | None  # the synced bounds (InterQTerms, mismatch_metrics(terms=)); None if padded
    policy: torch.Tensor  # (B, L) bool
    starts: torch.Tensor  # (B, L) bool, first token of each segment
    start: torch.Tensor  # (size,) int64 flat index of the first token
    end: torch.Tensor  # (size,) int64 flat index of the last token
    turn: torch.Tensor  # (size,) int64 turn of the segment in its row
    run: torch.Tensor  # (B * L,) int64 segments started so far: the segment of a policy token is run - 1
    size: int
    count: torch.Tensor  # 0-dim float64 S
    valid: torch.Tensor | None  # (size,) bool real segments; None when size == S


def _bounds(pm: torch.Tensor, sync: bool) -> _Bounds:
    """The segments of the effective policy mask ``pm``: one host read (``nonzero``) or none."""
    B, L = pm.shape
    if sync:
        b = _bounds_of_effective_mask(pm)
        run = torch.cumsum(b.starts.view(torch.uint8).reshape(-1), 0)
        count = torch.tensor(float(b.num_segments), dtype=_F64, device=pm.device)
        return _Bounds(b, pm, b.starts, b.start, b.end, b.turn, run, b.num_segments, count, None)
    starts, ends = _starts_ends(pm)
    size = B * ((L + 1) // 2)  # segments are separated by at least one token
    run = torch.cumsum(starts.view(torch.uint8).reshape(-1), 0)
    dev = pm.device
    if size == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return _Bounds(None, pm, starts, empty, empty, empty, run, 0, torch.zeros((), dtype=_F64, device=dev),
                       torch.zeros(0, dtype=torch.bool, device=dev))
    flat = torch.arange(B * L, device=dev)
    seg = run - 1
    spare = torch.full_like(seg, size)  # non-start (non-end) tokens go to a spare slot, dropped

    def place(flags: torch.Tensor) -> torch.Tensor:
        slot = torch.where(flags.reshape(-1), seg, spare)
        return torch.zeros(size + 1, dtype=torch.int64, device=dev).index_add_(0, slot, flat)[:size]

    start, end = place(starts), place(ends)
    count = run[-1]
    valid = torch.arange(size, device=dev) < count
    row = torch.div(start, L, rounding_mode="floor")
    n_segments = starts.sum(dim=1)
    offsets = torch.cumsum(n_segments, 0) - n_segments
    turn = torch.where(valid, torch.arange(size, device=dev) - offsets[row], size)
    return _Bounds(None, pm, starts, start, end, turn, run, size, count.to(_F64), valid)


def _segment_sums(x: torch.Tensor, b: _Bounds) -> torch.Tensor:
    """Per-segment sums ``(size,)`` float64 of ``(B, L)`` ``x`` (0 off policy) by row-wise cumsums.

    Segments never cross rows, so a segment's sum is the row's running sum at its last token
    minus the running sum just before its first (zero at the row start). Accumulated in float64;
    the absolute rounding error is ~1e-16 times the row's running total. Padding slots get 0.
    """
    B, L = x.shape
    if b.size == 0:
        return torch.zeros(0, dtype=_F64, device=x.device)
    run = torch.cumsum(x.to(_F64), 1).view(-1)
    before = torch.where(b.start % L == 0, 0.0, run[(b.start - 1).clamp_min(0)])
    out = run[b.end] - before
    return out if b.valid is None else torch.where(b.valid, out, 0.0)


class _InterQ(NamedTuple):
    """What one InterQ pass computes (:func:`_interq`; the public view is :class:`InterQTerms`)."""

    weights: torch.Tensor  # (B, L) W_t, 1 off policy, working dtype
    displacement: torch.Tensor  # (B, L) d_t = W~_t - 1, 0 off policy
    clip: torch.Tensor  # (B, L) +1 / -1 where the prefix was clipped high / low, 0 elsewhere
    C: torch.Tensor  # (size,) float64
    rho: torch.Tensor  # (size,) float64
    alpha: torch.Tensor  # (size,) float64, as the mode chose it


def _envelope(pm: torch.Tensor, p: InterQParams, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(-eps_low sqrt(n_t), eps_high sqrt(n_t))`` ``(B, L)`` in ``dtype``, ``n_t`` the policy tokens of the
    row so far: gathered from two ``(L + 1,)`` tables by the integer count (no per-token square root;
    the same values: the table entries are the same float operations on the same integers)."""
    B, L = pm.shape
    n_t = torch.cumsum(pm.view(torch.uint8), 1).view(-1)  # int64
    root = torch.arange(L + 1, dtype=dtype, device=pm.device).sqrt_()
    hi_table, lo_table = root * p.eps_high, root.mul_(-p.eps_low)
    hi_table[0] = lo_table[0] = 0.0  # before a row's first policy token; not 0 * eps, NaN for eps = inf
    hi = hi_table.index_select(0, n_t).view(B, L)
    lo = lo_table.index_select(0, n_t).view(B, L)
    return lo, hi


def _interq(delta, m, b: _Bounds, p: InterQParams, mode: str,
            envelope: tuple[torch.Tensor, torch.Tensor] | None = None) -> _InterQ:
    """Core of InterQ-RL on ``delta`` / ``m`` (neither is modified), in the batch's layout or the packed
    one (:func:`_packed_inputs`, whose ``envelope`` is given: column ``j`` has ``n_t = j + 1``)."""
    wd = delta.dtype
    B, L = delta.shape
    E = torch.cumsum(delta.to(_F64), 1)  # (B, L) prefix log ratio, carried over tool tokens
    if wd != _F64:
        E = E.to(wd)
    lo, hi = _envelope(b.policy, p, wd) if envelope is None else envelope
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
        alpha_pad = torch.cat([alpha.new_zeros(1), alpha]).to(wd)
        weights = alpha_pad.index_select(0, b.run).view(B, L).mul_(d).add_(1.0)
    else:
        a = 1.0 if mode == "prefix" else p.alpha_g
        alpha = torch.full_like(C, a)
        weights = torch.add(d, 1.0) if a == 1.0 else torch.mul(d, a).add_(1.0)
    return _InterQ(weights, d, clip, C, rho, alpha)


class _Packing(NamedTuple):
    """Where the packed layout's values go in the batch (:func:`_packed_inputs`)."""

    target: torch.Tensor  # (B * Pmax,) flat (B, L) index of each packed position; B * L (a spare slot) on padding
    shape: tuple[int, int]  # (B, L)

    def unpack(self, packed: torch.Tensor, fill: float) -> torch.Tensor:
        """The ``(B, L)`` tensor with ``packed``'s values at the policy tokens and ``fill`` elsewhere."""
        B, L = self.shape
        out = torch.full((B * L + 1,), fill, dtype=packed.dtype, device=packed.device)
        return out.scatter_(0, self.target, packed.reshape(-1))[:B * L].view(B, L)


def _packed_inputs(old_logprobs, rollout_logprobs, policy_mask, valid_mask, check: bool
                   ) -> tuple[_Inputs, _Bounds, _Packing]:
    """The inputs of an InterQ pass with host reads, packed: each row's policy tokens moved to its front,
    in order, ``(B, Pmax)`` with ``Pmax`` the most policy tokens of a row, zero after them.

    Every InterQ quantity of a policy token depends only on the policy tokens before it in its row (the
    others have ``delta = 0``): the row-wise running sums add the same numbers in the same order, so the
    packed pass gives the same bits at every policy token, on about as many elements as there are
    policy tokens. Host reads: the segment bounds' ``nonzero``, then ``Pmax`` read with the extremes
    of both log-probs over all tokens; only when those show NaN/inf or a positive value somewhere (junk
    off the policy tokens is allowed) do the checks read the policy tokens' own, as :func:`_inputs`
    (so the checks cost at most one host read).
    """
    pm = _effective_mask(old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    check = _check_flag(check)
    B, L = pm.shape
    dev, wd = pm.device, _work_dtype(old_logprobs)
    seg = _bounds_of_effective_mask(pm)
    S = seg.num_segments
    length = seg.end - seg.start + 1
    counts = torch.zeros(B, dtype=torch.int64, device=dev).index_add_(0, seg.row, length)  # policy tokens per row
    # one read: the widest row and, for the checks, the extremes of both log-probs over every token
    stats = [counts.max().to(_F64)] if S else []
    if check and pm.numel():
        stats += [v.to(_F64) for v in (*torch.aminmax(old_logprobs), *torch.aminmax(rollout_logprobs))]
    stats = torch.stack(stats).tolist() if stats else []
    width = int(stats[0]) if S else 0
    clean = not check or not pm.numel() or (all(math.isfinite(v) for v in stats[-4:])
                                            and stats[-3] <= logprob_tolerance(old_logprobs.dtype)
                                            and stats[-1] <= logprob_tolerance(rollout_logprobs.dtype))
    # delta over the batch, flat, and a spare slot at the end (0) where the packing's padding points
    delta = torch.empty(B * L + 1, dtype=wd, device=dev)
    if clean:  # no junk anywhere (or no check): from the log-probs as they are
        old, rollout = old_logprobs, rollout_logprobs
    else:  # NaN/inf or a positive value somewhere: check the policy tokens only (one more read)
        old, rollout = torch.where(pm, old_logprobs, 0.0), torch.where(pm, rollout_logprobs, 0.0)
        _check_values(old, rollout, old_logprobs, rollout_logprobs, pm)  # raises, naming argument and position
    torch.sub(old.reshape(-1).to(wd), rollout.reshape(-1).to(wd), out=delta[:B * L])
    delta[B * L] = 0.0
    # each segment's first token in the packed layout: its row, after the row's earlier segments
    earlier = torch.cumsum(length, 0) - length - (torch.cumsum(counts, 0) - counts).index_select(0, seg.row)
    start = seg.row * width + earlier
    end = start + length - 1
    starts = torch.zeros(B * width, dtype=torch.bool, device=dev).index_fill_(0, start, True)
    run = torch.cumsum(starts.view(torch.uint8), 0)  # segments started so far, flat (B, Pmax)
    policy = torch.arange(width, device=dev) < counts[:, None]
    target = _packing_target(seg, start, counts, width, B * L, policy)
    delta = delta.index_select(0, target).view(B, width)  # padding: 0 from the spare slot
    m = policy.view(torch.uint8).to(wd)
    nonfinite = None
    if not check:
        nonfinite = (torch.mul(delta, 0.0) != 0.0).sum()  # x * 0 is NaN for NaN/inf x; the padding is 0
        delta = torch.nan_to_num_(delta, nan=0.0, posinf=0.0, neginf=0.0)
    count = torch.tensor(float(S), dtype=_F64, device=dev)
    b = _Bounds(seg, policy, starts.view(B, width), start, end, seg.turn, run, S, count, None)
    return _Inputs(policy, delta, m, nonfinite), b, _Packing(target, (B, L))


def _packing_target(seg: SegmentBounds, start: torch.Tensor, counts: torch.Tensor, width: int, spare: int,
                    policy: torch.Tensor) -> torch.Tensor:
    """``(B * width,)`` flat batch index of each packed position (``spare`` on the padding), by one
    running sum: +1 from token to token of a segment, 0 along the padding, and at each segment's first
    position (and each row's first padding position) the jump from the value before it."""
    B = counts.shape[0]
    dev = counts.device
    n = B * width
    rows = torch.arange(B, device=dev)
    # anchors: the segments' first positions and the rows' first padding positions (a full row has none:
    # its anchor goes to the spare slot n, past every real one)
    pad = torch.where(counts < width, rows * width + counts, n)
    at = torch.cat([start, pad])
    value = torch.cat([seg.start, torch.full_like(pad, spare)])  # the target at the anchor
    last = torch.cat([seg.end, torch.full_like(pad, spare)])  # the target at the end of its stretch
    order = torch.argsort(at, stable=True)
    at, value, last = at[order], value[order], last[order]
    jump = value - torch.cat([last.new_zeros(1), last[:-1]])
    step = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    step[:n] = policy.view(-1)
    step.scatter_(0, at, jump)  # only the spare slot n can be written twice
    return torch.cumsum(step[:n], 0)


def _packed_envelope(width: int, p: InterQParams, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_envelope` of the packed layout: column ``j`` holds a row's ``(j + 1)``-th policy token."""
    root = torch.arange(1, width + 1, dtype=dtype, device=device).sqrt_()
    hi = (root * p.eps_high)[None, :]
    return root.mul_(-p.eps_low)[None, :], hi


class _Pass(NamedTuple):
    """The checked inputs of a batch and its InterQ pass (:func:`_interq_pass`), in the packed layout
    (``packing`` set) or the batch's own."""

    inputs: _Inputs
    bounds: _Bounds
    interq: _InterQ
    packing: _Packing | None

    def full(self, t: torch.Tensor, fill: float) -> torch.Tensor:
        """``t`` (a ``(B, L)``-layout quantity of the pass) in the batch's layout."""
        return t if self.packing is None else self.packing.unpack(t, fill)


def _interq_pass(old_logprobs, rollout_logprobs, policy_mask, valid_mask, p: InterQParams, mode: str, *,
                 check: bool = True, sync: bool = True) -> _Pass:
    """Checks, segment bounds, ``delta`` and one InterQ pass (``delta`` is left unconsumed): packed
    (:func:`_packed_inputs`) with host reads, in the batch's layout without (``sync=False``)."""
    _check_mode(mode)
    if sync:
        x, b, packing = _packed_inputs(old_logprobs, rollout_logprobs, policy_mask, valid_mask, check)
        envelope = _packed_envelope(x.delta.shape[1], p, x.delta.dtype, x.delta.device)
        return _Pass(x, b, _interq(x.delta, x.m, b, p, mode, envelope), packing)
    x = _inputs(old_logprobs, rollout_logprobs, policy_mask, valid_mask, check)
    b = _bounds(x.policy, False)
    return _Pass(x, b, _interq(x.delta, x.m, b, p, mode), None)


def _masked_sum(v: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    return v.sum() if valid is None else torch.where(valid, v, 0.0).sum()


def _interq_metrics(run: _Pass, weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The metrics of :func:`interq_weights` from one pass (tensors, nothing read); the
    ``correction/weight_*`` ones describe ``weights`` (in the pass's layout) when given, else ``W_t``."""
    q, x, b = run.interq, run.inputs, run.bounds
    n = x.policy.sum()
    metrics = _token_metrics(x.delta, n)
    metrics["correction/clip_rate"] = _safe_mean(q.clip.abs().sum(), n)
    metrics["correction/rho_mean"] = _safe_mean(q.rho.sum(), b.count)
    metrics["correction/alpha_mean"] = _safe_mean(_masked_sum(q.alpha, b.valid), b.count)
    metrics.update(_weight_metrics(q.weights if weights is None else weights, x.policy, n,
                                   b.start[:1] if b.size else None))
    metrics["correction/segments"] = b.count
    if x.nonfinite is not None:
        metrics["correction/nonfinite_tokens"] = x.nonfinite
    return metrics


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
    check: bool = True,
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
        check: True (default): NaN/inf or a positive log-prob at a policy token raises
            :class:`InputError` naming the argument (one fused pass, one host read). False: no
            value check; such tokens get weight 1 and are counted in ``correction/nonfinite_tokens``
            (a trainer's hot path, as ``policy_loss(check_finite=False)``). The weights and the
            other metrics are the same either way.

    Returns:
        ``weights`` ``(B, L)`` float32 (float64 for float64 inputs), 1 off policy tokens, exactly
        1 everywhere when ``old_logprobs == rollout_logprobs``; and metrics ``correction/…``
        (``clip_rate``, ``rho_mean``, ``alpha_mean``, ``weight_mean/min/max`` over policy tokens,
        ``segments``, and ``nonfinite_tokens`` with ``check=False``), ``mismatch/k3`` and
        ``mismatch/mean_abs_delta``, read on the host in one read.

    >>> old = torch.tensor([[-1.0, -1.0, 0.0, -1.0]]); pm = torch.tensor([[True, True, False, True]])
    >>> w, m = interq_weights(old, old - 0.01, pm, mode="prefix")
    >>> w
    tensor([[1.0101, 1.0202, 1.0000, 1.0305]])
    """
    require_values("interq_weights", "it reads the segment count and its metrics on the host" + _NO_READS,
                   old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    p = _InterQSettings(eps_low, eps_high, alpha_g, rho_eps, iters, mode, check)
    with torch.no_grad():
        run = _interq_pass(old_logprobs, rollout_logprobs, policy_mask, valid_mask, p, p.mode, check=p.check)
        metrics = _interq_metrics(run)
        weights = run.full(run.interq.weights, 1.0)
    return weights, _to_floats(metrics)


@_keywords_of(interq_weights)
def interq_terms(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    policy_mask: torch.Tensor,
    valid_mask: torch.Tensor | None = None,
    **settings: Any,
) -> InterQTerms:
    """All intermediate quantities of :func:`interq_weights` (for diagnostics, labs and tests).

    Takes the keyword parameters of :func:`interq_weights`. Pass them to :func:`mismatch_metrics`
    (``terms=``) to get the mismatch fingerprints of the same batch without a second InterQ pass.
    """
    _known_keywords(interq_terms, settings)
    require_values("interq_terms", "it reads the segment count on the host" + _NO_READS,
                   old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    p = _InterQSettings(**settings)
    with torch.no_grad():
        run = _interq_pass(old_logprobs, rollout_logprobs, policy_mask, valid_mask, p, p.mode, check=p.check)
        q, b = run.interq, run.bounds.segments
        clip = run.full(q.clip, 0.0)
        return InterQTerms(run.full(q.weights, 1.0), run.full(q.displacement, 0.0), clip > 0, clip < 0, q.C,
                           q.rho, q.alpha, segments_from_bounds(b), b)


def _mode_arm(mode: str) -> CorrectionFn:
    """The registered arm ``mode``: :func:`interq_weights` with that ``mode``, under the module-level name
    ``_<mode>_arm`` (so that it pickles)."""

    def arm(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, **params):
        _known_keywords(arm, params)
        return interq_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask, **params, mode=mode)

    arm.__name__ = arm.__qualname__ = f"_{mode}_arm"
    arm.__doc__ = (f"Registered arm ``{mode}``: :func:`interq_weights` with ``mode=\"{mode}\"`` (same "
                   "parameters, same result).")
    _with_keywords_of(arm, interq_weights, leave_out=("mode",))
    return register_correction(mode)(arm)


#: The InterQ mode of each mode arm: :func:`correction_weights` shares such an arm's pass with
#: :func:`mismatch_metrics`.
_ARM_MODES: dict[CorrectionFn, str] = {_mode_arm(mode): mode for mode in INTERQ_MODES}
_interq_arm, _prefix_arm, _global_arm = _ARM_MODES


# --------------------------------------------------------------------------------------------
# baselines

#: ``weigh(delta, m) -> (w, clipped 0/1)`` of a baseline, from its parameters.
_Weigh = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _baseline(x: _Inputs, weigh: _Weigh) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Shared body of the baselines: weights and metrics (tensors, nothing read)."""
    with torch.no_grad():
        n = x.policy.sum()
        w, clipped = weigh(x.delta, x.m)
        metrics = _token_metrics(x.delta, n)
        metrics["correction/clip_rate"] = _safe_mean((clipped * x.m).sum(), n)
        metrics.update(_weight_metrics(w, x.policy, n))
        if x.nonfinite is not None:
            metrics["correction/nonfinite_tokens"] = x.nonfinite
    return w, metrics


#: how to run without host reads, for the errors of the functions that need values
_NO_READS = "; for a run without host reads use correction_weights(..., check=False, sync=False)"


def _run_baseline(old_logprobs, rollout_logprobs, policy_mask, valid_mask, weigh: _Weigh, check: bool, name: str):
    require_values(name, "it returns its metrics as Python floats (read on the host)" + _NO_READS,
                   old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    w, metrics = _baseline(_inputs(old_logprobs, rollout_logprobs, policy_mask, valid_mask, check), weigh)
    return w, _to_floats(metrics)


def _tis(cap: float = 2.0) -> _Weigh:
    check_scalar("cap", cap, low=0.0, low_open=True)
    log_cap = math.log(cap)

    def weigh(delta, m):
        return torch.exp(delta.clamp(max=log_cap)), (delta > log_cap).to(delta.dtype)

    return weigh


def _mis(lo: float = 0.5, hi: float = 2.0) -> _Weigh:
    check_scalar("lo", lo, low=0.0, low_open=True)
    check_scalar("hi", hi, low=lo)  # hi = inf: nothing is masked above

    def weigh(delta, m):
        r = torch.exp(delta)  # off policy delta = 0: r = 1 exactly
        outside = ((r < lo) | (r > hi)).to(delta.dtype).mul_(m)
        # where, not r * (1 - outside): a masked ratio that overflowed to inf still weighs 0, not NaN
        return torch.where(outside > 0, 0.0, r), outside

    return weigh


def _seq_is(cap: float = 2.0) -> _Weigh:
    check_scalar("cap", cap, low=0.0, low_open=True)
    log_cap = math.log(cap)

    def weigh(delta, m):
        total = delta.sum(dim=1, keepdim=True, dtype=_F64)  # (B, 1)
        w_row = torch.exp(total.clamp(max=log_cap)).to(delta.dtype)
        return 1.0 + m * (w_row - 1.0), (total > log_cap).to(delta.dtype).expand_as(m)

    return weigh


def _geo() -> _Weigh:
    def weigh(delta, m):
        mean = delta.sum(dim=1, keepdim=True, dtype=_F64) / m.sum(dim=1, keepdim=True, dtype=_F64).clamp_min(1)
        return 1.0 + m * (torch.exp(mean).to(delta.dtype) - 1.0), torch.zeros_like(m)

    return weigh


def _none() -> _Weigh:
    return lambda delta, m: (torch.ones_like(delta), torch.zeros_like(m))


@register_correction("tis")
def tis_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, cap: float = 2.0,
                check: bool = True):
    """Truncated token IS: ``min(exp(delta_t), cap)`` on policy tokens, 1 elsewhere.

    Token-level truncated importance sampling (Ionides 2008; used against rollout/learner
    mismatch by Yao et al., 2025, and as verl's token ``rollout_is``). ``(B, L)`` in and out;
    ``clip_rate`` is the share of policy tokens truncated. ``check``: as in :func:`interq_weights`.
    """
    return _run_baseline(old_logprobs, rollout_logprobs, policy_mask, valid_mask, _tis(cap), check, "tis_weights")


@register_correction("mis")
def mis_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, lo: float = 0.5,
                hi: float = 2.0, check: bool = True):
    """Masked token IS: ``r_t = exp(delta_t)`` if ``lo <= r_t <= hi`` else 0 (1 off policy tokens).

    Tokens whose ratio leaves ``[lo, hi]`` drop out of the loss instead of being truncated
    (IcePop-style masking). With ``hi=math.inf`` only ratios below ``lo`` are masked:
    ``lo=exp(-1)`` (``0.36787944117144233``), ``hi=inf`` drops the tokens with ``delta_t < -1`` and keeps
    every other ratio untruncated (it overflows float32 only past ``delta_t`` of about 88). ``(B, L)`` in
    and out; ``clip_rate`` is the share masked. ``check``: as in :func:`interq_weights`.
    """
    return _run_baseline(old_logprobs, rollout_logprobs, policy_mask, valid_mask, _mis(lo, hi), check, "mis_weights")


@register_correction("seq_is")
def seq_is_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, cap: float = 2.0,
                   check: bool = True):
    """Truncated sequence IS: ``min(exp(sum_t delta_t), cap)`` broadcast over the row's policy tokens.

    Computed in log space (no overflow for long sequences); the sum accumulates in float64.
    ``clip_rate`` counts tokens of rows whose ratio was truncated. ``(B, L)`` in and out. ``check``: as
    in :func:`interq_weights`.
    """
    return _run_baseline(old_logprobs, rollout_logprobs, policy_mask, valid_mask, _seq_is(cap), check, "seq_is_weights")


@register_correction("geo")
def geo_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, check: bool = True):
    """Geometric-mean sequence IS: ``exp(mean_t delta_t)`` over the row's policy tokens, broadcast.

    The length-normalised sequence ratio (as in GSPO's sequence ratio). ``(B, L)`` in and out.
    ``check``: as in :func:`interq_weights`.
    """
    return _run_baseline(old_logprobs, rollout_logprobs, policy_mask, valid_mask, _geo(), check, "geo_weights")


@register_correction("none")
def none_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, check: bool = True):
    """No correction: all-ones ``(B, L)`` (metrics still report the mismatch). ``check``: as in
    :func:`interq_weights`."""
    return _run_baseline(old_logprobs, rollout_logprobs, policy_mask, valid_mask, _none(), check, "none_weights")


#: The ``weigh`` factory of each baseline arm (its parameters as keywords): :func:`correction_weights`
#: runs them on inputs checked once, and without a host read when asked.
_BASELINES: dict[CorrectionFn, Callable[..., _Weigh]] = {
    tis_weights: _tis, mis_weights: _mis, seq_is_weights: _seq_is, geo_weights: _geo, none_weights: _none,
}


# --------------------------------------------------------------------------------------------
# composed arms: an InterQ pass times a token factor

#: The parameters of :class:`InterQParams`, which a composed arm's parameters start with.
_INTERQ_KEYS = tuple(f.name for f in fields(InterQParams))


class _Composed(NamedTuple):
    """A composed arm: the weights of the InterQ ``mode`` times the per-token factor of a baseline's
    ``weigh`` (its factory, from the arm's parameters other than :data:`_INTERQ_KEYS`)."""

    mode: str
    token: Callable[..., _Weigh]


def _composed_weights(run: _Pass, weigh: _Weigh) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``W_t * w_t`` in the pass's layout (both factors are exactly 1 off policy tokens) and its metrics:
    the InterQ pass's, with ``correction/weight_*`` of the product and ``correction/token_clip_rate``, the
    share of policy tokens whose token factor was clipped (tensors, nothing read)."""
    x = run.inputs
    token, clipped = weigh(x.delta, x.m)
    w = torch.mul(run.interq.weights, token)
    metrics = _interq_metrics(run, w)
    metrics["correction/token_clip_rate"] = _safe_mean((clipped * x.m).sum(), x.policy.sum())
    return w, metrics


@register_correction("interq_tis")
def interq_tis_weights(
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
    cap: float = 2.0,
    check: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The bounded execution-prefix weight composed with the truncated current-token ratio:
    ``W_t * min(exp(delta_t), cap)`` on policy tokens, 1 elsewhere.

    ``W_t`` is InterQ-RL's weight (:func:`interq_weights`, mode ``interq``): the prefix ratio ``exp(E_t)``
    bounded by the envelope and shrunk toward 1 per segment by its support under the batch budget. The
    second factor is the token ratio of :func:`tis_weights`, truncated at ``cap``. ``E_t`` includes
    ``delta_t``, so the current token enters both: bounded and shrunk with its history in the first,
    truncated alone in the second.

    Takes InterQ-RL's parameters (``eps_low``, ``eps_high``, ``alpha_g``, ``rho_eps``, ``iters``, as in
    :func:`interq_weights`), TIS's ``cap`` and ``check`` (as in :func:`interq_weights`). ``(B, L)`` in and
    out, one InterQ pass. Metrics: those of :func:`interq_weights` (``correction/clip_rate`` is the
    envelope's, ``rho_mean``, ``alpha_mean``, ``segments``, ``mismatch/k3``, ...) with
    ``correction/weight_mean/min/max`` of the product, and ``correction/token_clip_rate``, the share of
    policy tokens truncated at ``cap``.

    >>> old = torch.tensor([[-1.0, -1.0, 0.0, -1.0]]); pm = torch.tensor([[True, True, False, True]])
    >>> w, m = interq_tis_weights(old, old - 1.0, pm, cap=2.0)  # delta = 1: each token ratio e, truncated at 2
    >>> w / interq_weights(old, old - 1.0, pm)[0], m["correction/token_clip_rate"]
    (tensor([[2., 2., 1., 2.]]), 1.0)
    """
    require_values("interq_tis_weights", "it reads the segment count and its metrics on the host" + _NO_READS,
                   old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    p = InterQParams(eps_low, eps_high, alpha_g, rho_eps, iters)
    weigh = _tis(cap)
    with torch.no_grad():
        run = _interq_pass(old_logprobs, rollout_logprobs, policy_mask, valid_mask, p, "interq", check=check)
        w, metrics = _composed_weights(run, weigh)
        weights = run.full(w, 1.0)
    return weights, _to_floats(metrics)


#: The composed arms: :func:`correction_weights` runs their InterQ pass once, shared with
#: :func:`mismatch_metrics`, and multiplies by the token factor.
_COMPOSED: dict[CorrectionFn, _Composed] = {interq_tis_weights: _Composed("interq", _tis)}


# --------------------------------------------------------------------------------------------
# metrics

#: Defaults of :func:`mismatch_metrics` (``max_turns``, ``quantiles``), which :func:`correction_weights`
#: uses too.
_MAX_TURNS = 8
_QUANTILES = (0.1, 0.5, 0.9)


def _check_metric_options(max_turns: int, quantiles: tuple[float, ...]) -> None:
    if isinstance(max_turns, bool) or int(max_turns) != max_turns or max_turns < 0:
        raise ConfigError("max_turns", f"must be a non-negative integer, got {max_turns!r}")
    for q in quantiles:
        check_scalar("quantiles", q, low=0.0, high=1.0)


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
    check: bool = True,
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
    ``check``: as in :func:`interq_weights` (``correction/nonfinite_tokens`` with ``check=False``).
    """
    require_values("mismatch_metrics", "it reads the segment count and which turns exist on the host" + _NO_READS,
                   old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    p = InterQParams(eps_low, eps_high, alpha_g, rho_eps, iters)
    _check_metric_options(max_turns, quantiles)
    with torch.no_grad():
        if terms is None:
            run = _interq_pass(old_logprobs, rollout_logprobs, policy_mask, valid_mask, p, "interq", check=check)
            q = run.interq
            values, present = _mismatch(run.inputs, run.bounds, *_clip_counts(q.clip), q.C, q.rho, q.alpha,
                                        int(max_turns), quantiles)
            return _to_floats(values, present)
        x = _inputs(old_logprobs, rollout_logprobs, policy_mask, valid_mask, check)
        if not isinstance(terms, InterQTerms):
            raise InputError(f"terms: expected the InterQTerms of interq_terms, got {type(terms).__name__}")
        if terms.weights.shape != x.policy.shape or terms.bounds.policy.shape != x.policy.shape:
            raise InputError(f"terms: computed for shape {tuple(terms.weights.shape)}, the inputs are "
                             f"{tuple(x.policy.shape)}")
        tb = terms.bounds
        run = torch.cumsum(tb.starts.view(torch.uint8).reshape(-1), 0)
        b = _Bounds(tb, tb.policy, tb.starts, tb.start, tb.end, tb.turn, run, tb.num_segments,
                    torch.tensor(float(tb.num_segments), dtype=_F64, device=x.policy.device), None)
        high = terms.clipped_high.sum(dtype=_F64)
        low = terms.clipped_low.sum(dtype=_F64)
        alpha = _allocate(terms.C, terms.rho, alpha_g, iters)
        values, present = _mismatch(x, b, high, low, terms.C, terms.rho, alpha, int(max_turns), quantiles)
    return _to_floats(values, present)


def _mismatch_metrics(x: _Inputs, p: InterQParams, sync: bool, T: int, quantiles
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """:func:`mismatch_metrics` of checked inputs, with its own InterQ pass (tensors, nothing read)."""
    b = _bounds(x.policy, sync)
    q = _interq(x.delta, x.m, b, p, "interq")
    return _mismatch(x, b, *_clip_counts(q.clip), q.C, q.rho, q.alpha, T, quantiles)


def _clip_counts(clip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 counts of the tokens clipped high and low, from the ``clip`` of :class:`_InterQ`."""
    return clip.clamp(min=0.0).sum(dtype=_F64), (-clip).clamp(min=0.0).sum(dtype=_F64)


def _quantiles(v: torch.Tensor, qs: torch.Tensor, b: _Bounds) -> torch.Tensor:
    """``torch.quantile(v[:S], qs)`` (linear interpolation, the same operations) of the ``S`` real
    segments of ``v``, with ``S`` a device count (no host read); meaningless when ``S = 0``."""
    if b.valid is not None:
        v = torch.where(b.valid, v, math.inf)  # padding sorts last
    ordered = torch.sort(v).values
    ranks = qs * (b.count - 1.0).clamp_min(0.0)
    below = ranks.to(torch.int64)
    above = ranks.ceil().to(torch.int64)
    low = ordered.gather(0, below)
    return low.lerp_(ordered.gather(0, above), ranks - below.to(ranks.dtype))


def _mismatch(x: _Inputs, b: _Bounds, high, low, C, rho, alpha, T: int, quantiles
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Body of :func:`mismatch_metrics` once the InterQ quantities are known: the metrics and, for the
    keys that exist only for some data, their presence flags (tensors, nothing read)."""
    delta, m, dev = x.delta, x.m, x.m.device
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
    present: dict[str, torch.Tensor] = {}
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
    if T > 0 and b.size:
        E = torch.cumsum(delta64, 1)
        seg_delta = _segment_sums(delta64, b)
        seg_prefix = _segment_sums(E.mul_(m.to(_F64)), b)
        del E
        seg_len = (b.end - b.start + 1).to(_F64)
        if b.valid is not None:
            seg_len = torch.where(b.valid, seg_len, 0.0)
        bucket = b.turn.clamp(max=T)  # turns >= T (and padding) go to a dropped bucket
        count = torch.zeros(T + 1, dtype=_F64, device=dev).index_add_(0, bucket, seg_len)
        cur = torch.zeros_like(count).index_add_(0, bucket, seg_delta)
        pre = torch.zeros_like(count).index_add_(0, bucket, seg_prefix)
        for k in range(T):
            keys = (f"mismatch/turn{k}/current", f"mismatch/turn{k}/prefix", f"mismatch/turn{k}/tokens")
            out.update(zip(keys, (cur[k] / count[k], pre[k] / count[k], count[k]), strict=True))
            present.update(dict.fromkeys(keys, count[k] > 0))
    out.update({
        "correction/clip_rate": _safe_mean(high + low, n),
        "correction/clip_rate_high": _safe_mean(high, n),
        "correction/clip_rate_low": _safe_mean(low, n),
        "correction/segments": b.count,
    })
    if b.size:
        some = b.count > 0
        out["correction/C_mean"] = _safe_mean(_masked_sum(C, b.valid), b.count)
        present["correction/C_mean"] = some
        if quantiles:
            qs = torch.tensor(list(quantiles), dtype=_F64, device=dev)
            rq = _quantiles(rho, qs, b)
            aq = _quantiles(alpha, qs, b)
            for i, q in enumerate(quantiles):
                for name, values in (("rho", rq), ("alpha", aq)):
                    key = f"correction/{name}_q{round(100 * q)}"
                    out[key] = values[i]
                    present[key] = some
    if x.nonfinite is not None:
        out["correction/nonfinite_tokens"] = x.nonfinite
    return out, present


# --------------------------------------------------------------------------------------------
# an arm and its diagnostics in one call


def _merged(arm: Mapping, diagnostic: Mapping) -> dict:
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
    check: bool = True,
    sync: bool = True,
) -> tuple[torch.Tensor, dict[str, float] | DeviceMetrics]:
    """Weights ``(B, L)`` of the registered arm ``name`` and its metrics merged with
    :func:`mismatch_metrics`, computing the InterQ pass once per batch. Where both define a key, the
    arm's ``correction/*`` value is kept (it describes the weights returned) and the diagnostic's
    ``mismatch/*`` value (an arm's quick ``mismatch/k3`` is float32; the diagnostic's is the one
    definition every arm shares).

    This is what the trainer integrations call. ``params`` are the arm's keyword parameters
    (:func:`correction_params`; an unknown key raises :class:`ConfigError` naming the valid ones). For
    the ``interq`` / ``prefix`` / ``global`` / ``interq_tis`` arms, ``mismatch_metrics`` gets the same
    InterQ parameters and reuses the arm's pass (:func:`interq_terms`); for every other arm it runs with
    its defaults, as a separate diagnostic on the same checked inputs. The numbers equal those of calling
    the arm and then ``mismatch_metrics``. ``diagnostics=False`` returns the arm's own metrics only.

    ``check``: the input checks, as in :func:`interq_weights` (an arm registered with a ``check``
    keyword gets it passed on). ``sync=False`` (with ``check=False``; a trainer's hot path, once per
    micro-batch) reads nothing on the host: the segments are counted on the device (their arrays
    padded to the most the batch can hold, ``B * ceil(L / 2)``; the budget allocation then sorts that
    many values) and the metrics come back as a :class:`DeviceMetrics`, read in one transfer where they
    are first looked at. Same numbers, up to float summation order. The built-in arms support it; an arm
    registered by you returns floats, so it reads what it reads.

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
    if not isinstance(sync, bool):
        raise ConfigError("sync", f"must be True or False, got {sync!r}")
    if not sync and _check_flag(check):
        raise ConfigError("check", "the input checks read the inputs on the host: pass check=False with "
                                   "sync=False (NaN/inf tokens are then counted in correction/nonfinite_tokens)")
    if sync:
        require_values("correction_weights", "with sync=True (the default) it reads the segment count and its "
                       "metrics on the host; pass check=False, sync=False for a run without host reads",
                       old_logprobs, rollout_logprobs, policy_mask, valid_mask)
    mode = _ARM_MODES.get(fn)
    composed = _COMPOSED.get(fn)
    weigh = _BASELINES.get(fn)
    with torch.no_grad():
        if mode is not None or composed is not None:
            token = None
            if composed is not None:  # its InterQ parameters for the pass, the rest for the token factor
                mode = composed.mode
                token = composed.token(**{k: v for k, v in params.items() if k not in _INTERQ_KEYS})
                params = {k: v for k, v in params.items() if k in _INTERQ_KEYS}
            p = InterQParams(**params)
            run = _interq_pass(old_logprobs, rollout_logprobs, policy_mask, valid_mask, p, mode, check=check,
                               sync=sync)
            q, x, b = run.interq, run.inputs, run.bounds
            w, arm = (q.weights, _interq_metrics(run)) if token is None else _composed_weights(run, token)
            w, present = run.full(w, 1.0), {}
            if diagnostics:
                alloc = q.alpha if mode == "interq" else _allocate(q.C, q.rho, p.alpha_g, p.iters)
                diag, present = _mismatch(x, b, *_clip_counts(q.clip), q.C, q.rho, alloc, _MAX_TURNS, _QUANTILES)
                arm = _merged(arm, diag)
        elif weigh is not None:
            x = _inputs(old_logprobs, rollout_logprobs, policy_mask, valid_mask, check)
            w, arm = _baseline(x, weigh(**params))
            present = {}
            if diagnostics:
                diag, present = _mismatch_metrics(x, INTERQ, sync, _MAX_TURNS, _QUANTILES)
                arm = _merged(arm, diag)
        else:  # an arm registered by the user: its own checks and floats
            takes_check = "check" in inspect.signature(fn).parameters
            w, arm = fn(old_logprobs, rollout_logprobs, policy_mask, valid_mask, **params,
                        **({"check": check} if takes_check else {}))
            present = {}
            if diagnostics:
                x = _inputs(old_logprobs, rollout_logprobs, policy_mask, valid_mask, check)
                diag, present = _mismatch_metrics(x, INTERQ, sync, _MAX_TURNS, _QUANTILES)
                arm = _merged(arm, diag)
    metrics = DeviceMetrics(arm, present=present)
    return w, (metrics if not sync else dict(metrics))


# --------------------------------------------------------------------------------------------
# an arm as a trainer config names it


def _number_type(param: inspect.Parameter) -> type:
    """``int`` for a parameter declared or defaulting to an int (e.g. ``iters: int | None``), else ``float``."""
    if isinstance(param.default, int) and not isinstance(param.default, bool):
        return int
    ann = param.annotation
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann))
    return int if re.search(r"\bint\b", text) and "float" not in text else float


def parse_correction(spec: str, where: str = "correction", prefix: str = "") -> tuple[str, dict[str, float]]:
    """Parse ``<prefix><arm>[:key=value,...]`` (a correction arm as a trainer config names it) into the arm and
    its keyword parameters; errors are :class:`ConfigError` naming ``where`` (the config key).

    The arm is looked up in :data:`CORRECTIONS` now (an arm registered after import is accepted), the keys are
    its parameters (:func:`correction_params`), a value is a number as Python's ``float`` (or ``int``, for a
    parameter declared as one) reads it, ``inf`` included, and the values are checked by running the arm on
    a one-token batch. ``prefix`` is what the trainer puts before arm names (verl's ``creditlab_``).

    >>> parse_correction("interq_tis:cap=3,alpha_g=0.4")
    ('interq_tis', {'cap': 3.0, 'alpha_g': 0.4})
    >>> parse_correction("creditlab_mis:lo=0.36787944117144233,hi=inf", "rollout_is", "creditlab_")
    ('mis', {'lo': 0.36787944117144233, 'hi': inf})
    """
    if not isinstance(spec, str) or not spec.strip() or not spec.strip().startswith(prefix):
        raise ConfigError(where, f"expected '{prefix}<arm>[:key=value,...]', got {spec!r}")
    head, _, tail = spec.strip()[len(prefix):].partition(":")
    arm = head.strip()
    if arm not in CORRECTIONS:
        raise ConfigError(where, f"unknown arm {arm!r}; valid: {', '.join(prefix + a for a in CORRECTIONS)}")
    valid = correction_params(arm)
    signature = inspect.signature(CORRECTIONS[arm]).parameters
    params: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in tail.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in valid:
            raise ConfigError(where, f"bad parameter {part!r} for {arm}; valid keys: {', '.join(valid) or 'none'}")
        if key in params:
            raise ConfigError(where, f"{spec!r} sets {key} twice")
        try:
            params[key] = _number_type(signature[key])(value)
        except ValueError:
            raise ConfigError(f"{where}:{key}", f"expected a number, got {value.strip()!r}") from None
    try:  # validate the values now, with the config key in the message
        one = torch.zeros(1, 1)
        correction_weights(arm, one, one, one.bool(), params=params, diagnostics=False)
    except InputError as err:
        raise ConfigError(where, f"{spec!r}: {err}") from None
    return arm, params
