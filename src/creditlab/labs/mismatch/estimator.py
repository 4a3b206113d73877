"""The mismatch lab's estimator experiment: a known-answer test of the correction weightings (``-e estimator``).

Question: does each weighting reduce the bias of the policy-gradient estimate computed from engine samples,
against the true policy gradient of the learner? No arm trains; every weighting is scored on the same batches.

For each (dose, checkpoint). A dose is an engine precision ``P`` (the quantized engines of the lab), with
checkpoint ``base`` (the lab's base policy) or ``qat`` (the base after ``qat_updates`` updates of the lab's own
trainer at ``P`` with the QAT learner and no correction):

* the learner is the QAT learner at ``P``: ``log pi_t = sequence_logprobs(model, tokens, P)``, with grad;
* a batch is the trainer's: ``tasks_per_update`` tasks x ``group_size`` rollouts (groups of ``G`` consecutive
  rows), reward = success (the config's ``grpo.reward``, which the lab leaves at success), ``A`` = the GRPO
  advantage broadcast on the policy tokens;
* the gradient of one batch under per-token weights ``w`` is

      g_w = grad_theta  sum_{b,t} m_bt w_bt A_b log pi_theta(y_bt | y_b,<t) / sum_{b,t} m_bt

  (``m`` the policy mask: :func:`creditlab.core.losses.policy_loss`'s ``token_mean``), flattened over every
  parameter of the model. At the sampling checkpoint the PPO ratio is 1, so the clipped (and dual-clipped)
  surrogate's gradient is exactly ``-g_w``: both branches of the clip have the ratio's gradient at ratio 1, and
  the dual clip (``clip_ratio_c > 1``) is inactive there (tested against ``policy_loss``);
* **true gradient**: the mean of ``g_1`` over ``batches`` batches drawn by the exact sampler (the engine
  computing as the learner does: :func:`~creditlab.train.toolshop_rollout.rollout_stacked` with ``exact=True``,
  the learner's own distribution at ``P`` up to summation order: the ``estimator_sampler`` table checks it);
* **engine estimates**: ``batches`` batches drawn by the engine at ``P``, each scored under every weighting of
  :data:`WEIGHTINGS`: the registered arms ``none``, ``tis``, ``interq``, ``global``, ``prefix``, ``seq_is``
  (defaults; ``seq_is`` truncates at 2) and the oracle ``seq``, the untruncated sequence importance ratio
  ``exp(sum_t delta_t)`` over the row's policy tokens (:func:`sequence_ratio_weights`, float64).

**Planted doses** (``planted:<s>``, ``s > 0``): at NVFP4 and MXFP4 the quantized mismatch is too small against
the sampling noise of 64 batches for any weighting's bias to be resolved (bias/SE ~1 for every weighting), so the
test also runs where a bias exists by construction: the planted engine of the planted experiment
(:mod:`creditlab.labs.mismatch.planted`), which shifts the logits of tool-call tokens at turn ``k`` by
``s (k + 1) z`` and reports the shifted distribution's log-probs exactly. There, in the planted experiment's
thought-free world (``PLANTED_WORLDS["thought_free"]``: its base policy, and the lab's ``grpo`` with that world's
chain lengths, ``max_len`` and ``max_action_len``):

* the learner is fp32 (``sequence_logprobs(model, tokens, "fp32")``), the engine the fp32 engine with ``plant=s``,
  the exact sampler the fp32 engine without a plant (``exact=True`` too: harmless at fp32; its K3 against the
  learner is float noise, which the ``estimator_sampler`` table checks as at the other doses);
* the checkpoints are ``base`` (the world's base policy) and ``trained``: the base after ``qat_updates`` updates
  of uncorrected GRPO on the planted engine (fp32 learner, ``plant=s``, no correction). It is not called ``qat``:
  nothing is quantized; it is the checkpoint that the uncorrected trainer reaches on that engine, as ``qat`` is at
  a precision.

Prediction E1 judges planted doses by the same rule as the others (its text speaks of every dose and checkpoint).

Common random numbers: batch ``b`` of both samplers has the same tasks and the same sampling uniforms (inversion
of the CDF at every position, :func:`rollout_stacked`), so an engine trajectory follows its exact twin until the
first token the two distributions split on. The bias ``mean(g_w) - mean(g_1)`` is therefore estimated from
paired batches, and its standard error from the paired differences (``se_paired``) beside the brief's unpaired
formula (``se``: the two means as if independent, which overstates the error when the pairs are correlated).

What a ratio ``||bias|| / SE`` means here: ``bias`` is a vector of ~1e5 coordinates, so even with no bias its
norm is about its standard error, ``E ||bias_hat||^2 = ||bias||^2 + SE^2``: the ratio sits near 1 (not 0) for an
unbiased weighting, and exceeds 2 only when ``||bias|| > sqrt(3) SE``. ``rel_bias_excess`` removes that noise
floor: ``sqrt(max(||bias_hat||^2 - SE^2, 0)) / ||true||`` (with ``||true||^2`` corrected the same way).

The oracle is unbiased for any function of one trajectory. The batch gradient is not quite one: the GRPO
advantage uses the group's other rollouts and ``token_mean`` divides by the batch's policy tokens, both drawn by
the engine, so a per-row ratio leaves a small coupling bias (second order in the mismatch); the prediction reads
the oracle's measured bias/SE before it reads InterQ's.

Cells: one per (dose, checkpoint), each seeded by its arguments alone. Config fields (of
:class:`~creditlab.labs.mismatch.config.MismatchConfig`, passed to the cells): ``estimator_doses`` (precisions and
``planted:<s>`` doses), ``estimator_batches`` (per sampler, at a precision), ``estimator_planted_batches`` (at a
planted dose), ``estimator_qat_updates`` (the updates of the ``qat`` and of the ``trained`` checkpoint).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

from creditlab.errors import ConfigError
from creditlab.lab.experiment import Experiment, Prediction, Tables, Verdict
from creditlab.lab.protocol import Table
from creditlab.lab.runner import Cell
from creditlab.labs.mismatch.config import DOSES, MismatchConfig

__all__ = ["CHECKPOINTS", "E1_STATED", "EXPERIMENT",
           "ORACLE", "PLANTED", "PLANTED_CHECKPOINTS", "PLANTED_WORLD", "PREDICTIONS", "SAMPLER_SHARE", "THRESHOLD",
           "WEIGHTINGS", "Estimator", "EstimatorResult", "Moments", "checkpoints_of", "estimate", "estimator_table",
           "estimator_world", "parse_dose", "qat_checkpoint", "read_estimator", "run_estimator_cell", "sampler_table",
           "sequence_ratio_weights", "surrogate_gradients", "token_mean_coefficients", "weightings_of"]

#: The registered arms scored (default parameters), then the oracle.
REGISTERED = ("none", "tis", "interq", "global", "prefix", "seq_is")
#: The untruncated sequence importance ratio (:func:`sequence_ratio_weights`): the unbiased oracle.
ORACLE = "seq"
WEIGHTINGS = (*REGISTERED, ORACLE)
#: Checkpoints of an engine-precision dose, and of a planted dose (module docstring: ``trained`` is the base after
#: uncorrected training on the planted engine; nothing is quantized there).
CHECKPOINTS = ("base", "qat")
PLANTED_CHECKPOINTS = ("base", "trained")
#: A planted dose is written ``PLANTED + str(strength)``, e.g. ``planted:0.2``.
PLANTED = "planted:"
#: The world of the planted doses (:data:`creditlab.labs.mismatch.planted.PLANTED_WORLDS`): thought-free, cheap.
PLANTED_WORLD = "thought_free"
#: The bias/SE level of prediction E1 (a ratio near 1 is what no bias gives: module docstring).
THRESHOLD = 2.0
#: The exact sampler passes its check when its K3 per policy token against the learner is at most this share of
#: the engine's: its own mismatch then moves the "true" gradient by far less than the engine's moves the estimates.
#: Measured: rounding flips (a quantized activation, or an MXFP4 block's power-of-two scale, on the other side of a
#: boundary) move about 0.1% of the tokens, a few by up to 0.3 nat, for a K3 of 3.7e-7 against the engine's 3.7e-3
#: (2-core base at MXFP4) and 2.9e-8 against 1.9e-3 (quick base after one QAT update at NVFP4).
SAMPLER_SHARE = 0.01
#: Tokens whose |delta| exceeds this are counted as the exact sampler's rounding flips.
FLIP = 1e-4
_F64 = torch.float64


# ----------------------------------------------------------------------------------------------
# the weights and the gradients of one batch


def sequence_ratio_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                           policy_mask: torch.Tensor) -> torch.Tensor:
    """The oracle: the untruncated sequence importance ratio ``exp(sum_t m_t (old_t - rollout_t))`` of each row,
    on its policy tokens, 1 elsewhere; ``(B, L)`` float64 in and out (the sum and the exponential in float64:
    no truncation, so a row whose learner likes it far more than the engine gets a large weight).

    >>> old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    >>> roll = torch.tensor([[-1.5, -2.0, 0.0], [-0.5, -0.7, -0.1]])
    >>> pm = torch.tensor([[True, True, False], [True, True, True]])
    >>> sequence_ratio_weights(old, roll, pm)
    tensor([[1.6487, 1.6487, 1.0000],
            [0.8187, 0.8187, 0.8187]], dtype=torch.float64)
    """
    _check_batch(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, policy_mask=policy_mask)
    delta = (old_logprobs.to(_F64) - rollout_logprobs.to(_F64)).masked_fill(~policy_mask, 0.0)
    total = delta.sum(1, keepdim=True)  # (B, 1)
    return torch.where(policy_mask, total.exp().expand_as(delta), torch.ones_like(delta))


def weightings_of(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, policy_mask: torch.Tensor,
                  valid_mask: torch.Tensor, names: Sequence[str] = WEIGHTINGS) -> torch.Tensor:
    """Per-token weights ``(K, B, L)`` float64 of each weighting in ``names``: a registered arm of
    :data:`creditlab.core.correction.CORRECTIONS` with its default parameters
    (:func:`~creditlab.core.correction.correction_weights`), or :data:`ORACLE`."""
    from creditlab.core.correction import correction_weights

    _check_batch(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, policy_mask=policy_mask,
                 valid_mask=valid_mask)
    out = []
    for name in names:
        if name == ORACLE:
            out.append(sequence_ratio_weights(old_logprobs, rollout_logprobs, policy_mask))
        else:
            w, _ = correction_weights(name, old_logprobs, rollout_logprobs, policy_mask, valid_mask,
                                      diagnostics=False)
            out.append(w.to(_F64))
    return torch.stack(out)


def token_mean_coefficients(weights: torch.Tensor, advantages: torch.Tensor, policy_mask: torch.Tensor
                            ) -> torch.Tensor:
    """``c_kbt = m_bt w_kbt A_b / sum m``, ``(K, B, L)`` float64: ``g_w = grad sum_bt c_bt log pi_bt`` is the
    gradient of ``token_mean`` of ``w A log pi`` (a batch without policy tokens gives 0).

    Args:
        weights: ``(K, B, L)`` per-token weights of ``K`` weightings (junk allowed off policy tokens).
        advantages: ``(B,)`` one advantage per row (broadcast on its tokens) or ``(B, L)``.
        policy_mask: ``(B, L)`` bool.
    """
    if weights.dim() != 3 or tuple(weights.shape[1:]) != tuple(policy_mask.shape):
        raise ConfigError("weights", f"expected (K, B, L) with (B, L) = {tuple(policy_mask.shape)}, "
                                     f"got {tuple(weights.shape)}")
    _check_batch(policy_mask=policy_mask)
    adv = advantages.to(_F64)
    if adv.dim() == 1:
        adv = adv[:, None].expand(policy_mask.shape)
    if tuple(adv.shape) != tuple(policy_mask.shape):
        raise ConfigError("advantages", f"expected (B,) or (B, L) = {tuple(policy_mask.shape)}, "
                                        f"got {tuple(advantages.shape)}")
    n = policy_mask.sum().clamp_min(1).to(_F64)
    return torch.where(policy_mask, weights.to(_F64) * adv / n, 0.0)


def surrogate_gradients(logprobs: torch.Tensor, params: Sequence[torch.nn.Parameter],
                        coefficients: torch.Tensor) -> torch.Tensor:
    """``(K, P)`` float64: row ``k`` is ``grad_params sum_bt coefficients[k, b, t] * logprobs[b, t]``, flattened
    in the order of ``params``; one forward (``logprobs`` ``(B, L)`` carries the graph), one backward per
    weighting with the graph retained (measured faster on a CPU than one batched backward,
    ``torch.autograd.grad(..., is_grads_batched=True)``: 1.9 s against 4.1 s for 7 weightings of 32 rows of
    the 2-core protocol). A parameter the log-probs do not reach gets 0."""
    K = coefficients.size(0)
    coef = coefficients.to(logprobs.dtype)
    out = torch.zeros(K, sum(p.numel() for p in params), dtype=_F64)
    for k in range(K):
        grads = torch.autograd.grad((coef[k] * logprobs).sum(), params, retain_graph=k < K - 1, allow_unused=True)
        out[k] = torch.cat([(torch.zeros(p.numel()) if g is None else g.reshape(-1)).to(_F64)
                            for p, g in zip(params, grads, strict=True)])
    return out


def _check_batch(**tensors: torch.Tensor) -> None:
    from creditlab.core._checks import check_tensor

    dims: dict[str, int] = {}
    for name, x in tensors.items():
        if name.endswith("_mask"):
            check_tensor(name, x, shape=("B", "L"), boolean=True, dims=dims)
        else:
            check_tensor(name, x, shape=("B", "L"), floating=True, dims=dims)


# ----------------------------------------------------------------------------------------------
# running moments of per-batch gradients


@dataclass
class Moments:
    """Running sums of vectors ``g_1 .. g_n`` ``(P,)``: their mean and the trace of their covariance, without
    keeping them (float64)."""

    total: torch.Tensor | None = None
    sumsq: float = 0.0
    n: int = 0

    def add(self, g: torch.Tensor) -> None:
        g = g.to(_F64)
        self.total = g.clone() if self.total is None else self.total + g
        self.sumsq += float(g.square().sum())
        self.n += 1

    @property
    def mean(self) -> torch.Tensor:
        return self.total / self.n

    @property
    def trace_var(self) -> float:
        """Trace of the unbiased sample covariance, ``(sum ||g||^2 - n ||mean||^2) / (n - 1)``; NaN below 2."""
        if self.n < 2:
            return math.nan
        return max(self.sumsq - self.n * float(self.mean.square().sum()), 0.0) / (self.n - 1)


@dataclass
class _Weighting:
    """One weighting's sums over the engine batches."""

    grads: Moments = field(default_factory=Moments)
    diffs: Moments = field(default_factory=Moments)  # g_w(engine batch b) - g_1(exact batch b)
    shifts: Moments = field(default_factory=Moments)  # g_w(engine batch b) - g_none(engine batch b)
    abs_w1: float = 0.0


@dataclass
class EstimatorResult:
    """What :func:`estimate` measured: one row per weighting (:meth:`rows`)."""

    true: Moments
    weightings: dict[str, _Weighting]
    engine_k3: float
    sampler: dict[str, float]

    def rows(self) -> list[dict[str, float]]:
        """Per weighting: ``n_true``, ``n_engine``, ``bias_norm`` (``||mean_w - true||``), ``se`` (the brief's
        ``sqrt(tr Var_w / n_w + tr Var_true / n_true)``), ``se_paired`` (from the paired differences),
        ``bias_se_ratio`` (``bias_norm / se_paired``) and ``bias_se_unpaired`` (``bias_norm / se``), ``variance``
        (trace of the per-batch covariance of ``g_w``), ``cosine`` (of ``mean_w`` to the true gradient),
        ``rel_bias`` (``bias_norm / ||true||``), ``rel_bias_excess`` (with the noise floor removed),
        ``true_norm``, ``k3`` (the engine batches' K3 per policy token), ``mean_abs_w1`` (mean ``|w - 1|`` on
        policy tokens), ``shift_se_ratio`` and ``shift_cosine_oracle`` (:func:`_shift_columns`), and the exact
        sampler's check (``sampler_*``)."""
        t = self.true
        true_mean, var_t = t.mean, t.trace_var
        true_sq = float(true_mean.square().sum())
        oracle = self.weightings.get(ORACLE)
        oracle_shift = oracle.shifts.mean if oracle is not None and oracle.shifts.n else None
        out = []
        for name, w in self.weightings.items():
            bias = w.grads.mean - true_mean
            b_sq = float(bias.square().sum())
            se = math.sqrt(w.grads.trace_var / w.grads.n + var_t / t.n)
            se_p = math.sqrt(w.diffs.trace_var / w.diffs.n)
            mean_sq = float(w.grads.mean.square().sum())
            signal = true_sq - var_t / t.n
            out.append({
                "weighting": name, "n_true": t.n, "n_engine": w.grads.n, "bias_norm": math.sqrt(b_sq), "se": se,
                "se_paired": se_p, "bias_se_ratio": math.sqrt(b_sq) / se_p if se_p > 0 else math.nan,
                "bias_se_unpaired": math.sqrt(b_sq) / se if se > 0 else math.nan,
                "variance": w.grads.trace_var,
                "cosine": float(w.grads.mean @ true_mean) / math.sqrt(mean_sq * true_sq) if mean_sq * true_sq > 0
                else math.nan,
                "rel_bias": math.sqrt(b_sq / true_sq) if true_sq > 0 else math.nan,
                "rel_bias_excess": math.sqrt(max(b_sq - se_p ** 2, 0.0) / signal) if signal > 0 else math.nan,
                "true_norm": math.sqrt(true_sq), "k3": self.engine_k3, "mean_abs_w1": w.abs_w1 / w.grads.n,
                **_shift_columns(w.shifts, oracle_shift),
                **{f"sampler_{k}": v for k, v in self.sampler.items()}})
        return out


def _shift_columns(shifts: Moments, oracle_shift: torch.Tensor | None) -> dict[str, float]:
    """``shift_se_ratio``: ``||mean(g_w - g_none)||`` over its standard error, both from the same engine batches
    (what the weighting changes, against the noise of that change: ~1 when it changes nothing detectable);
    ``shift_cosine_oracle``: the cosine of that change to the oracle's (``g_seq - g_none``), the direction that
    removes the uncorrected bias when the oracle is unbiased. NaN without ``none`` (or the oracle) scored, and
    for ``none`` itself."""
    if not shifts.n or float(shifts.mean.abs().max()) == 0.0:
        return {"shift_se_ratio": math.nan, "shift_cosine_oracle": math.nan}
    m = shifts.mean
    se = math.sqrt(shifts.trace_var / shifts.n)
    m_sq = float(m.square().sum())
    o_sq = float(oracle_shift.square().sum()) if oracle_shift is not None else 0.0
    return {"shift_se_ratio": math.sqrt(m_sq) / se if se > 0 else math.nan,
            "shift_cosine_oracle": float(m @ oracle_shift) / math.sqrt(m_sq * o_sq) if o_sq > 0 else math.nan}


# ----------------------------------------------------------------------------------------------
# the doses


def parse_dose(dose: str) -> tuple[str, float]:
    """``(precision, plant)`` of a dose: an engine precision of :data:`DOSES` -> ``(dose, 0.0)``; a planted dose
    ``planted:<s>`` (``s`` a finite float > 0) -> ``("fp32", s)``. Anything else raises a
    :class:`~creditlab.errors.ConfigError` naming ``estimator_doses``.

    >>> parse_dose("mxfp4"), parse_dose("planted:0.2")
    (('mxfp4', 0.0), ('fp32', 0.2))
    """
    if isinstance(dose, str) and dose in DOSES:
        return dose, 0.0
    if isinstance(dose, str) and dose.startswith(PLANTED):
        try:
            s = float(dose[len(PLANTED):])
        except ValueError:
            s = math.nan
        if math.isfinite(s) and s > 0:
            return "fp32", s
    raise ConfigError("estimator_doses", f"got {dose!r}; valid: {', '.join(DOSES)}, or {PLANTED}<strength> with a "
                                         "finite strength > 0 (e.g. planted:0.2)")


def checkpoints_of(dose: str) -> tuple[str, str]:
    """The checkpoints of ``dose``: :data:`CHECKPOINTS` at an engine precision, :data:`PLANTED_CHECKPOINTS` at a
    planted dose."""
    return PLANTED_CHECKPOINTS if parse_dose(dose)[1] > 0 else CHECKPOINTS


def estimator_world(cfg: MismatchConfig, dose: str):
    """``(base, grpo)`` of ``dose``: the lab's base policy config and ``cfg.grpo`` at an engine precision; at a
    planted dose the planted experiment's thought-free world (:data:`PLANTED_WORLD`): its base, and ``cfg.grpo``
    with its chain lengths, ``max_len`` and ``max_action_len`` (the precisions, correction and plant of the grpo
    are not read by :func:`estimate`, which takes them from the dose)."""
    if parse_dose(dose)[1] == 0:
        return cfg.base, cfg.grpo
    from creditlab.labs.mismatch.planted import PLANTED_WORLDS

    w = PLANTED_WORLDS[PLANTED_WORLD]
    return w.base, replace(cfg.grpo, chain_lengths=tuple(w.chain_lengths), max_len=w.max_len,
                           max_action_len=w.max_action_len)


# ----------------------------------------------------------------------------------------------
# the measurement


def _task_seeds(b: int, n: int) -> list[int]:
    from creditlab.train.common import generator
    from creditlab.train.toolshop_rollout import EVAL_SEED_OFFSET

    # the stacked trainer's uniform stream with the tag "estimator/tasks": disjoint from its "train" draws
    gen = generator("grpo/uniforms", "estimator/tasks", 0, b)
    return torch.randint(EVAL_SEED_OFFSET, (n,), generator=gen).tolist()


def _uniforms(b: int, B: int, L: int) -> torch.Tensor:
    from creditlab.train.common import generator

    return torch.rand(1, B, L, generator=generator("grpo/uniforms", "estimator", 0, b), dtype=_F64)


class _Progress:
    """A long cell's progress on stderr: after the first step, then at least every ``every_s`` seconds and after
    the last, with the steps done, the time so far and the time left."""

    def __init__(self, label: str, total: int, every_s: float = 60.0, stream=None, clock=time.monotonic):
        self.label, self.total, self.every_s, self.clock = label, total, every_s, clock
        self.stream = stream if stream is not None else sys.stderr
        self.t0, self.last = clock(), -math.inf

    def __call__(self, done: int) -> None:
        from creditlab.train.toolshop_base import _duration

        now = self.clock()
        if 1 < done < self.total and now - self.last < self.every_s:
            return
        self.last = now
        left = "" if done >= self.total else \
            f", about {_duration((now - self.t0) / done * (self.total - done))} left"
        print(f"{self.label}: batch {done}/{self.total}, {_duration(now - self.t0)} so far{left}",
              file=self.stream, flush=True)


class _Scored(NamedTuple):
    """One batch scored: each weighting's gradient and what the tables report about the batch."""

    grads: torch.Tensor   # (K, P) float64, one row per weighting
    weights: torch.Tensor  # (K, B, L) float64
    delta: torch.Tensor   # (n,) float64: learner - sampler log-prob on the policy tokens
    policy_mask: torch.Tensor  # (B, L) bool
    success: float


def _score_batch(model, stack, params, tasks, uniforms, precision: str, plant: float, grpo, exact: bool,
                 names: Sequence[str]) -> _Scored:
    """Sample ``tasks`` (groups of ``group_size`` consecutive rows) from ``uniforms`` ``(1, B, L)`` with the exact
    sampler at ``precision`` (``exact``: no plant) or the engine at ``precision`` planted with ``plant``, then one
    learner forward at ``precision`` and one backward per weighting of ``names`` (the exact batch: ``g_1`` only)."""
    from creditlab.core.advantages import grpo_advantages
    from creditlab.train.toolshop_rollout import rollout_stacked, sequence_logprobs

    g = grpo
    r = rollout_stacked(stack, [tasks], uniforms, precision=precision, max_len=g.max_len, max_turns=g.max_turns,
                        max_action_len=g.max_action_len, temperature=g.temperature, exact=exact,
                        plant=0.0 if exact else plant)
    pm, vm, rlp = r.policy_mask[0], r.valid_mask[0], r.rollout_logprobs[0]
    lp = sequence_logprobs(model, r.tokens[0], precision, g.temperature)  # (B, L), with grad
    old = lp.detach()
    reward = r.success[0] if g.reward == "success" else r.progress[0]  # the trainer's reward (the lab's: success)
    adv = grpo_advantages(reward.float(), torch.arange(len(tasks)) // g.group_size)
    w = torch.ones(1, *pm.shape, dtype=_F64) if exact else weightings_of(old, rlp, pm, vm, names)
    grads = surrogate_gradients(lp, params, token_mean_coefficients(w, adv, pm))
    return _Scored(grads, w, (old - rlp).to(_F64)[pm], pm, float(r.success.mean()))


def _k3(delta: torch.Tensor) -> float:
    """K3 ``E[exp(d) - 1 - d]`` per policy token (0 without one)."""
    return float((delta.exp() - 1 - delta).mean()) if delta.numel() else 0.0


def estimate(model, grpo, dose: str, batches: int, *, names: Sequence[str] = WEIGHTINGS,
             progress: Callable[[int], None] | None = None) -> EstimatorResult:
    """The known-answer measurement (module docstring) on ``model`` (a :class:`~creditlab.models.tiny_lm.TinyLM`:
    its QAT learner at an engine-precision ``dose``, its fp32 learner at a planted dose ``planted:<s>``, whose
    engine is the fp32 engine planted with ``s``: :func:`parse_dose`) with the batches of ``grpo`` (a
    :class:`~creditlab.train.toolshop_grpo.GRPOConfig`: tasks per update, group size, chain lengths, lengths,
    temperature, reward): ``batches`` pairs of an exact and an engine batch, pair ``b`` on the same tasks and
    sampling uniforms. Deterministic given its arguments. ``progress(b)`` after each pair."""
    from creditlab.models.tiny_lm import StackedTinyLM
    from creditlab.train.toolshop_rollout import make_tasks

    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 2:
        raise ConfigError("estimator_batches", f"needs at least 2 batches (a variance), got {batches!r}")
    precision, plant = parse_dose(dose)
    names = list(names)
    G = grpo.group_size
    model.eval()
    stack = StackedTinyLM([model])  # the sampler: per-row uniforms, so the two samplers share random numbers
    params = [p for p in model.parameters() if p.requires_grad]
    true, per = Moments(), {n: _Weighting() for n in names}
    s = {"k3": 0.0, "max_abs_delta": 0.0, "flips": 0.0, "tokens": 0.0, "success_exact": 0.0, "success_engine": 0.0}
    engine_k3 = 0.0
    for b in range(batches):
        # --- pair b: the same tasks and uniforms for both samplers
        tasks = [t for t in make_tasks(_task_seeds(b, grpo.tasks_per_update), grpo.chain_lengths) for _ in range(G)]
        u = _uniforms(b, len(tasks), grpo.max_len)
        # --- the exact batch: the true gradient's sample, and the sampler's check
        ex = _score_batch(model, stack, params, tasks, u, precision, plant, grpo, True, names)
        g_true = ex.grads[0]
        true.add(g_true)
        s["k3"] += _k3(ex.delta)
        s["max_abs_delta"] = max(s["max_abs_delta"], float(ex.delta.abs().max()) if ex.delta.numel() else 0.0)
        s["flips"] += float((ex.delta.abs() > FLIP).sum())
        s["tokens"] += float(ex.delta.numel())
        s["success_exact"] += ex.success
        # --- the engine batch: every weighting's estimate
        en = _score_batch(model, stack, params, tasks, u, precision, plant, grpo, False, names)
        engine_k3 += _k3(en.delta)
        s["success_engine"] += en.success
        g_none = en.grads[names.index("none")] if "none" in names else None
        n_pol = max(int(en.policy_mask.sum()), 1)
        for k, name in enumerate(names):
            acc = per[name]
            acc.grads.add(en.grads[k])
            acc.diffs.add(en.grads[k] - g_true)
            if g_none is not None:
                acc.shifts.add(en.grads[k] - g_none)
            acc.abs_w1 += float((en.weights[k] - 1).abs()[en.policy_mask].sum()) / n_pol
        if progress is not None:
            progress(b + 1)
    sampler = {"k3": s["k3"] / batches, "max_abs_delta": s["max_abs_delta"],
               "flip_share": s["flips"] / max(s["tokens"], 1.0), "success_exact": s["success_exact"] / batches,
               "success_engine": s["success_engine"] / batches}
    return EstimatorResult(true, per, engine_k3 / batches, sampler)


def qat_checkpoint(base, grpo, dose: str, updates: int, progress: Callable | None = None):
    """The base after ``updates`` updates of the lab's trainer with no correction
    (:func:`~creditlab.train.toolshop_grpo.train_grpo_stacked`, seed 0, no held-out evaluation during training;
    its one evaluation after the last update runs on a single task, the least it accepts): at an engine precision
    ``dose``, with the QAT learner at it (the ``qat`` checkpoint); at a planted dose ``planted:<s>``, with the
    fp32 learner and the fp32 engine planted with ``s`` (the ``trained`` checkpoint). ``base`` is not changed."""
    from creditlab.models.tiny_lm import StackedTinyLM
    from creditlab.train.toolshop_grpo import train_grpo_stacked

    precision, plant = parse_dose(dose)
    stack = StackedTinyLM([base])
    c = replace(grpo, rollout_precision=precision, learner_precision=precision, plant=plant, correction="none",
                seed=0, updates=updates, eval_every=0, eval_tasks=1)
    train_grpo_stacked(stack, [c], on_update=progress)
    return stack.unstack(0).eval()


def run_estimator_cell(config: dict, dose: str, checkpoint: str, batches: int, qat_updates: int,
                       cache_dir: str) -> list[dict]:
    """One cell: the estimator's rows (:meth:`EstimatorResult.rows`) at ``dose`` (an engine precision, or a planted
    dose ``planted:<s>`` in the thought-free world: :func:`estimator_world`) for the checkpoint ``base``, or
    ``qat`` (engine precision) / ``trained`` (planted dose): ``qat_updates`` updates of uncorrected training from
    the base (:func:`qat_checkpoint`; 0 for ``base``)."""
    from creditlab.labs.mismatch.cells import UpdateProgress
    from creditlab.train.toolshop_base import base_policy

    cfg = MismatchConfig.from_dict(config)
    valid = checkpoints_of(dose)  # checks the dose
    if checkpoint not in valid:
        raise ConfigError("checkpoint", f"got {checkpoint!r} at dose {dose!r}; valid: {', '.join(valid)}")
    base_cfg, grpo = estimator_world(cfg, dose)
    model = base_policy(base_cfg, cache_dir=cache_dir)
    label = f"mismatch estimator {dose}/{checkpoint}"
    if checkpoint != "base":
        if qat_updates < 1:
            raise ConfigError("estimator_qat_updates", f"must be >= 1, got {qat_updates}")
        what = "QAT training" if checkpoint == "qat" else "uncorrected training on the planted engine"
        model = qat_checkpoint(model, grpo, dose, qat_updates, UpdateProgress(f"{label}: {what}", qat_updates))
    res = estimate(model, grpo, dose, batches, progress=_Progress(label, batches))
    return [{"dose": dose, "checkpoint": checkpoint, **r} for r in res.rows()]


# ----------------------------------------------------------------------------------------------
# tables, plot, reading, prediction

ESTIMATOR_COLUMNS = ("dose", "checkpoint", "weighting", "bias_se_ratio", "bias_se_unpaired", "rel_bias",
                     "rel_bias_excess", "cosine", "shift_se_ratio", "shift_cosine_oracle", "bias_norm", "se_paired",
                     "se", "variance", "true_norm", "k3", "mean_abs_w1", "n_true", "n_engine")


def _dose_key(dose: str) -> tuple[int, float, str]:
    """The order of doses in the tables: the engine precisions in :data:`DOSES` order, then the planted doses by
    strength."""
    if dose in DOSES:
        return (0, float(DOSES.index(dose)), dose)
    try:
        return (1, parse_dose(dose)[1], dose)
    except ConfigError:
        return (2, 0.0, str(dose))


def _ordered(rows: pd.DataFrame) -> pd.DataFrame:
    doses = sorted(set(rows["dose"]), key=_dose_key)
    order = ("base", "qat", "trained")
    key = {"dose": doses.index, "checkpoint": lambda c: order.index(c) if c in order else len(order),
           "weighting": lambda w: WEIGHTINGS.index(w) if w in WEIGHTINGS else len(WEIGHTINGS)}
    return rows.sort_values(["dose", "checkpoint", "weighting"],
                            key=lambda c: c.map(key[c.name])).reset_index(drop=True)


def estimator_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (dose, checkpoint, weighting): :data:`ESTIMATOR_COLUMNS`."""
    return _ordered(rows)[[c for c in ESTIMATOR_COLUMNS if c in rows.columns]]


def sampler_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (dose, checkpoint): the exact sampler's K3 and largest |delta| against the learner's
    recomputed log-probs, the share of its tokens moved by more than :data:`FLIP` (rounding flips), the engine's
    K3 beside it, the success of both samplers' batches, and ``exact`` (yes: its K3 is at most
    :data:`SAMPLER_SHARE` of the engine's)."""
    first = _ordered(rows).groupby(["dose", "checkpoint"], sort=False).head(1)
    out = first[["dose", "checkpoint", "sampler_k3", "sampler_max_abs_delta", "sampler_flip_share", "k3",
                 "sampler_success_exact", "sampler_success_engine", "n_true"]].rename(columns={
        "sampler_k3": "exact_k3", "sampler_max_abs_delta": "exact_max_abs_delta",
        "sampler_flip_share": "exact_flip_share", "k3": "engine_k3", "sampler_success_exact": "success_exact",
        "sampler_success_engine": "success_engine", "n_true": "batches"})
    out["exact"] = np.where(out["exact_k3"] <= SAMPLER_SHARE * out["engine_k3"], "yes", "no")
    return out.reset_index(drop=True)


def _points(t: pd.DataFrame) -> list[tuple[str, str, pd.Series]]:
    """``(dose, checkpoint, bias/SE by weighting)`` of each point of an estimator table."""
    return [(d, c, g.set_index("weighting")["bias_se_ratio"])
            for (d, c), g in t.groupby(["dose", "checkpoint"], sort=False)]


def read_estimator(t: pd.DataFrame) -> str:
    """The reading of the estimator table, generated from it."""
    if t.empty:
        return "No estimator cell ran."
    parts = []
    for d, c, r in _points(t):
        if r.isna().all():
            parts.append(f"{d}/{c}: no ratio (every gradient 0: every group's rewards were equal)")
            continue
        best = r.idxmin()
        s = f"{d}/{c}: smallest bias/SE {best} ({r[best]:.2f})"
        if {"interq", "none"} <= set(r.index):
            s += (f"; interq {r['interq']:.2f} {'below' if r['interq'] < r['none'] else 'not below'} none "
                  f"{r['none']:.2f}")
        if ORACLE in r.index and "none" in r.index:
            s += (f"; the oracle {ORACLE} {r[ORACLE]:.2f} {'below' if r[ORACLE] < r['none'] else 'not below'} none "
                  f"({'below' if r[ORACLE] < THRESHOLD else 'not below'} {THRESHOLD:g})")
        parts.append(s)
    n = t[["n_true", "n_engine"]].min().min()
    planted = any(_dose_key(d)[0] == 1 for d in t["dose"])
    doses = ("per dose and checkpoint. A dose is an engine precision (the learner QAT at it; checkpoint qat: the "
             "base after uncorrected QAT training at it) or planted:<s>, the planted engine of strength s in the "
             "planted experiment's thought-free world (fp32 learner, fp32 engine with the tool-call logits shifted "
             "by s (k + 1) z at turn k; checkpoint trained: that world's base after uncorrected fp32 training on "
             "the planted engine, nothing quantized)." if planted else "per engine precision and checkpoint.")
    return (
        "The bias of each weighting's policy-gradient estimate from engine batches against the learner's true "
        "gradient (the mean over batches of the exact sampler), " + doses + " bias_se_ratio "
        "= ||bias|| / SE with SE from the paired batch differences (bias_se_unpaired: the two means' errors as if "
        "independent); with no bias the ratio is about 1, not 0 (the norm of a noise vector of ~1e5 coordinates "
        "is its SE), and it exceeds 2 when ||bias|| > 1.7 SE. rel_bias_excess is ||bias|| / ||true|| with that "
        "noise floor removed. " + "; ".join(parts) + f". At least {n:.0f} batch pairs per point.")


def read_sampler(s: pd.DataFrame) -> str:
    if s.empty:
        return "No estimator cell ran."
    bad = [f"{r.dose}/{r.checkpoint}" for r in s.itertuples() if r.exact != "yes"]
    parts = [f"{r.dose}/{r.checkpoint}: K3 {r.exact_k3:.1e} (engine {r.engine_k3:.1e}), max |delta| "
             f"{r.exact_max_abs_delta:.1e}, {r.exact_flip_share:.1e} of tokens beyond {FLIP:g}"
             for r in s.itertuples()]
    return ("The check of the exact sampler: its reported log-probs against the learner's recomputed ones on its own "
            "batches (should be float noise; a few tokens move more where a quantized activation lands on the other "
            "side of a rounding boundary). " + "; ".join(parts) + ". " +
            (f"NOT EXACT at {', '.join(bad)} (K3 above {SAMPLER_SHARE:.0%} of the engine's): there the 'true' "
             "gradient is not the learner's, and the estimator table is not a known-answer test." if bad else
             f"Exact at every point (K3 at most {SAMPLER_SHARE:.0%} of the engine's)."))


def _plot(t: pd.DataFrame, out: Path) -> Path:
    from creditlab.lab.plotting import new_figure, save

    points = _points(t)
    ncol = min(len(points), 2)
    nrow = math.ceil(len(points) / ncol)
    fig, axes = new_figure(nrow, ncol, figsize=(6.0 * ncol, 3.8 * nrow), squeeze=False, sharey=True)
    colors = {w: ("#888888" if w == "none" else "#d62728" if w == "interq" else "#2ca02c" if w == ORACLE
                  else "#1f77b4") for w in WEIGHTINGS}
    finite = [v for _, _, r in points for v in r.to_numpy(dtype=float) if np.isfinite(v)]
    hi = max(finite, default=1.0)
    for ax, (d, c, r) in zip(axes.flat, points, strict=False):
        x = np.arange(len(r))
        vals = r.to_numpy(dtype=float)
        ax.bar(x, np.nan_to_num(vals, nan=0.0), color=[colors.get(w, "#1f77b4") for w in r.index])
        for xi, v in zip(x, vals, strict=True):
            if np.isfinite(v):
                ax.annotate(f"{v:.2f}", (xi, v), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=8)
        if not np.isfinite(vals).any():
            ax.text(0.5, 0.7, "no gradient: every group's rewards equal", transform=ax.transAxes, ha="center")
        ax.axhline(THRESHOLD, color="black", lw=0.9, ls="--", label=f"{THRESHOLD:g}: prediction E1's level")
        ax.axhline(1.0, color="gray", lw=0.8, ls=":", label="1: no bias (noise floor)")
        ax.set_yscale("log")
        ax.set_ylim(0.3, max(10.0, 2.5 * hi))
        ax.set_xticks(x, list(r.index), fontsize=9)
        info = t[(t["dose"] == d) & (t["checkpoint"] == c)].iloc[0]
        ax.set_title(f"engine {d}, checkpoint {c} (K3 {info['k3']:.1e}, {info['n_engine']:.0f} batch pairs)",
                     fontsize=10)
    for ax in axes.flat[len(points):]:
        ax.set_visible(False)
    for row in axes:
        row[0].set_ylabel("||bias|| / SE (paired)")
    axes.flat[0].legend(fontsize=8, loc="upper left")
    return save(fig, out / "mismatch_estimator.png")


def _eligible(t: pd.DataFrame) -> list[tuple[str, str, pd.Series]]:
    """The points where the oracle's bias/SE is below :data:`THRESHOLD` and the uncorrected one's above it."""
    return [(d, c, r) for d, c, r in _points(t) if {ORACLE, "none"} <= set(r.index)
            and r[ORACLE] < THRESHOLD and r["none"] > THRESHOLD]


def _e1_measured(tables: Tables) -> str | None:
    if "estimator" not in tables or tables["estimator"].frame.empty:
        return None
    return "; ".join(f"{d}/{c}: seq {r.get(ORACLE, math.nan):.2f}, none {r.get('none', math.nan):.2f}, "
                     f"interq {r.get('interq', math.nan):.2f}" for d, c, r in _points(tables["estimator"].frame))


def _e1_verdict(tables: Tables) -> Verdict:
    if "estimator" not in tables:
        return Verdict.NOT_JUDGED
    points = _eligible(tables["estimator"].frame)
    return Verdict.every(Verdict.of(bool(r["interq"] < r["none"]) if "interq" in r.index else None)
                         for _, _, r in points)


def _e1_note(verdict: Verdict, tables: Tables) -> str:
    notes = []
    if "estimator" in tables and not _eligible(tables["estimator"].frame):
        notes.append(f"no dose and checkpoint has the oracle below {THRESHOLD:g} and none above it")
    if "estimator_sampler" in tables:
        bad = tables["estimator_sampler"].frame.query("exact != 'yes'")
        if len(bad):
            notes.append("the exact sampler is not exact at " + ", ".join(f"{r.dose}/{r.checkpoint}"
                                                                           for r in bad.itertuples()))
    return "; ".join(notes)


E1_STATED = ("**(E1)** At every dose and checkpoint where the sequence-IS oracle's bias/SE is below 2 (it is unbiased) "
             "and the uncorrected estimate's bias/SE is above 2 (there is a bias to remove), InterQ's bias/SE is "
             "below the uncorrected one's. Not judged where no (dose, checkpoint) meets both conditions.")
PREDICTIONS = (Prediction(claim="E1: InterQ's bias/SE below the uncorrected one's where the oracle removes a bias",
                          stated=E1_STATED, measured=_e1_measured, verdict=_e1_verdict, note=_e1_note),)


class Estimator(Experiment):
    """The known-answer test of the weightings' policy-gradient bias (module docstring)."""

    name = "estimator"
    groups = ("estimator",)
    fields = ("estimator_doses", "estimator_batches", "estimator_planted_batches", "estimator_qat_updates")

    def predictions_for(self, cfg: MismatchConfig) -> tuple[Prediction, ...]:
        """(E1), registered with the dual-clip protocol (none under the others)."""
        return PREDICTIONS if cfg.protocol == "dual-clip" else ()

    @staticmethod
    def settings(cfg: MismatchConfig) -> tuple[tuple[str, ...], int, int]:
        """(doses, batches at an engine precision, QAT updates) of ``cfg``."""
        return tuple(cfg.estimator_doses), cfg.estimator_batches, cfg.estimator_qat_updates

    @staticmethod
    def batches_of(cfg: MismatchConfig, dose: str) -> int:
        """The batches per sampler of a cell at ``dose``: ``estimator_planted_batches`` at a planted dose (its
        cells are cheap, and its bias needs more batches to resolve), else ``estimator_batches``."""
        return cfg.estimator_planted_batches if parse_dose(dose)[1] > 0 else cfg.estimator_batches

    def validate(self, cfg: MismatchConfig) -> None:
        from creditlab.lab.protocol import check_count

        doses, _, updates = self.settings(cfg)
        parsed = [parse_dose(d) for d in doses]  # raises on a dose that is neither a precision nor planted:<s> > 0
        if not doses or len(set(parsed)) != len(parsed):
            raise ConfigError("estimator_doses", f"needs distinct doses among {', '.join(DOSES)} and "
                                                 f"{PLANTED}<strength>, got {list(doses)}")
        check_count(updates, "estimator_qat_updates")
        for name in ("estimator_batches", "estimator_planted_batches"):
            value = getattr(cfg, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ConfigError(name, f"must be an integer >= 2 (a variance), got {value!r}")

    def cells(self, cfg: MismatchConfig) -> list[Cell]:
        doses, _, updates = self.settings(cfg)
        ident, ctx = cfg.identity(), cfg.context()
        return [Cell("estimator", f"{d}/{c}", run_estimator_cell,
                     {"config": ident, "dose": d, "checkpoint": c, "batches": self.batches_of(cfg, d),
                      "qat_updates": 0 if c == "base" else updates}, ctx)
                for d in doses for c in checkpoints_of(d)]

    def tables(self, rows: dict[str, pd.DataFrame], cfg: MismatchConfig) -> dict[str, Table]:
        if "estimator" not in rows or rows["estimator"].empty:
            return {}
        r = rows["estimator"]
        doses = self.settings(cfg)[0]
        r = r[r["dose"].isin(doses)]
        return {"estimator": Table(estimator_table(r), "Estimator: bias of each weighting's policy gradient from "
                                                       "engine batches against the learner's true gradient", ".3g",
                                   console=True),
                "estimator_sampler": Table(sampler_table(r), "Estimator: the exact sampler against the learner", ".3g")}

    def plots(self, tabs: Tables, cfg: MismatchConfig, out: Path) -> list[Path]:
        if "estimator" not in tabs or tabs["estimator"].frame.empty:
            return []
        return [_plot(tabs["estimator"].frame, out)]

    def interpret(self, tabs: Tables, cfg: MismatchConfig) -> dict[str, str]:
        if "estimator" not in tabs:
            return {}
        return {"estimator": read_estimator(tabs["estimator"].frame),
                "estimator_sampler": read_sampler(tabs["estimator_sampler"].frame)}


EXPERIMENT = Estimator()
