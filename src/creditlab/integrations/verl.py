"""creditlab inside verl (tested with verl 0.9.1): rollout correction, advantage estimators, FORK reward.

Load it in every verl process with verl's external-module mechanism::

    export VERL_USE_EXTERNAL_MODULES=creditlab.integrations.verl

Importing the module registers everything (idempotently; importing or calling :func:`install` again
changes nothing). The names of the integration contract (:data:`creditlab.integrations.CONTRACT`):
:data:`TESTED_VERSIONS`, :data:`ALLOW_UNTESTED_ENV`, :func:`check_version`, :func:`install`,
:func:`dump_rows`, :func:`fork_reward`, :func:`live_metrics`.

* **Rollout correction** (InterQ-RL and the baselines of :mod:`creditlab.core.correction`):
  ``algorithm.rollout_correction.rollout_is: creditlab_<arm>[:key=value,...]`` with ``<arm>`` any arm
  registered in :data:`creditlab.core.correction.CORRECTIONS` (``interq``, ``prefix``, ``global``,
  ``tis``, ``mis``, ``seq_is``, ``geo``, ``none``, and any added with ``register_correction``: the
  registry is read when verl calls, and the keys are the arm's parameters). verl computes
  ``rollout_is_weights`` on the driver from ``old_log_probs - rollout_log_probs`` and
  ``response_mask`` (0 on tool/observation tokens, whose rollout log-probs are 0.0) in
  ``rollout_corr_helper.compute_rollout_correction_weights``; verl has no registry for that step,
  so this module wraps that one function (:func:`install_rollout_correction`): a ``rollout_is``
  value starting with ``creditlab_`` is computed by creditlab, every other value goes to verl's
  own function unchanged. The wrapper refuses to install on a verl version it was not tested with
  or whose function signature changed (:class:`~creditlab.errors.CreditlabError` at import).
  Metrics arrive in verl's logs as ``rollout_corr/creditlab/...`` (K3, per-turn prefix vs
  current log ratio, clip rates, rho and alpha quantiles). In decoupled mode verl computes the weights
  once per step on the driver; in bypass mode (``rollout_correction.bypass_mode``) inside its loss, once
  per micro-batch, where creditlab's part reads no tensor value on the host (:func:`rollout_weights`).
* **Advantage estimators** in verl's registry (``algorithm.adv_estimator``): ``creditlab_<geometry>``
  for every geometry registered in :data:`creditlab.core.credit.GEOMETRIES` when :func:`install` runs
  (``creditlab_uniform``, ``creditlab_per_turn``, ``creditlab_concentrated``, ``creditlab_shuffled``,
  ``creditlab_binary``, ``creditlab_discretized``, ``creditlab_reward_to_go``, ``creditlab_prm`` (PRM
  mixing with a schedule of verl's global step), ``creditlab_random_k``, ``creditlab_targeted``; call
  :func:`install` again after registering another). Their knobs live in ``algorithm.creditlab``
  (:class:`~creditlab.integrations._common.CreditSettings`).
* **Policy loss** ``creditlab_ppo`` in verl's loss registry (``actor_rollout_ref.actor.policy_loss.loss_mode``):
  :func:`creditlab.core.losses.policy_loss` (clipped PPO/GRPO surrogate times ``rollout_is_weights``)
  with verl's four aggregation modes, its dual clip (``clip_ratio_c``) and its data-parallel
  normalisation: the same loss as verl's ``vanilla`` (tested), from creditlab's implementation. It
  reads no tensor value on the host (verl calls it once per micro-batch): metrics are 0-dim tensors
  and non-finite inputs are counted in ``actor/creditlab_nonfinite_tokens`` instead of raising.
* **FORK reward function** :func:`fork_reward` (async, micro-batched).
* **Rollout dumps** for ``creditlab diagnose``: with ``algorithm.creditlab.dump_dir`` set, every
  training step's batch is written in the dump schema (docs/diagnose.md) right after verl computes the
  advantages, before the actor update (``ray_trainer.compute_advantage`` is wrapped, and in the v1
  trainer ``compute_advantage_for_multi_trajectories``, so every output of a session is dumped:
  :func:`install_dump_hook`): the learner's ``old_log_probs``, the engine's ``rollout_log_probs``
  (``actor_rollout_ref.rollout.calculate_log_probs``), ``logprobs_source`` (``rollout (verl bypass
  mode)`` when ``bypass_mode`` put the engine's log-probs in ``old_log_probs``), the ``response_mask``
  from before rejection sampling with the tokens ``rollout_rs`` rejected in ``rejected``, the score
  (row sum of ``token_level_scores``), the ``uid`` and the reward function's ``precision`` /
  ``recall`` when they reach the batch (the legacy trainer puts them there; the v1 trainer does not).
  :func:`dump_rows` / :func:`dump_batch` do the same for any ``DataProto``.
* **Live checks**: every step's ``compute_data_metrics`` (wrapped, :func:`install_live_checks`) carries
  the values of ``creditlab diagnose``'s batch checks as ``rollout_corr/creditlab/<check>``
  (:func:`live_metrics`, computed without a host read and read once per step), and a check crossing
  its warn threshold logs one warning line, once per run and check; ``CREDITLAB_LIVE_CHECKS=0`` turns
  them off.

Convention for per-turn scores in ``token_level_rewards``
--------------------------------------------------------
A *turn* is a maximal run of 1s in ``response_mask``. Its *span* runs from its first token to the
token before the next turn (so it includes the tool/observation tokens after it).

* Outcome-only estimators (``uniform``, ``binary``, ``discretized``) use the row sum of
  ``token_level_rewards`` as the outcome ``R_i``, as verl's GRPO does (verl's reward managers put a
  scalar score on the last valid response token).
* ``per_turn`` / ``concentrated`` / ``shuffled`` / ``reward_to_go``: the score of turn ``t`` is the sum
  of ``token_level_rewards`` over its span (put it on any token of the turn or of the observation
  that follows); the outcome is the row sum (so progress increments summing to the final score
  work as they are).
* ``prm``: the **outcome** is the reward on the last policy token of the row and on every position
  after it (where verl's reward managers put a trajectory's scalar score); the **process score**
  of turn ``t`` is the sum over its span *before* that final token (:func:`pack_turn_rewards` puts
  it on the turn's first token). So a plain verl score is the outcome and all-zero process scores
  give plain GRPO. The one case the layout cannot hold (a process score for a final turn that is
  one token long) is refused by :func:`pack_turn_rewards`.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.abc
import inspect
import os
import sys
from typing import Any

import numpy as np
import torch

from creditlab.integrations import import_trainer

verl = import_trainer("verl")
from verl.trainer.ppo import core_algos, rollout_corr_helper
from verl.utils.skip.skip_manager import SkipManager

from creditlab.core import correction, credit
from creditlab.core._checks import check_tensor
from creditlab.errors import ConfigError, CreditlabError, InputError
from creditlab.integrations import _live
from creditlab.integrations._common import (
    BatcherCache,
    CreditSettings,
    MicroBatcher,
    ParsedSpecs,
    cached_fork_reward,
    check_tested_version,
    group_ids,
    token_reward_advantages,
    turn_layout,
)

__all__ = [
    "AGG_MODES",
    "ALLOW_UNTESTED_ENV",
    "ESTIMATORS",  # noqa: F822  (module __getattr__: a live view of the geometry registry)
    "ROLLOUT_PREFIX",
    "TESTED_VERSIONS",
    "DUMP_KEYS",
    "LIVE_ENV",
    "VERL_PREFIX",
    "WRAPPED",
    "check_version",
    "compute_policy_loss_creditlab",
    "dump_batch",
    "dump_rows",
    "fork_reward",
    "install",
    "install_dump_hook",
    "install_estimators",
    "install_live_checks",
    "install_policy_loss",
    "install_rollout_correction",
    "live_metrics",
    "pack_turn_rewards",
    "parse_rollout_is",
    "rollout_weights",
]

#: verl versions this module was tested against (``CREDITLAB_ALLOW_UNTESTED_VERL=1`` lets another
#: version through when the wrapped function's signature is unchanged).
TESTED_VERSIONS = ("0.9.1",)
#: Set to ``1`` to let an untested verl version through (:func:`check_version`).
ALLOW_UNTESTED_ENV = "CREDITLAB_ALLOW_UNTESTED_VERL"
#: ``algorithm.rollout_correction.rollout_is`` values starting with this go to creditlab:
#: ``creditlab_<arm>`` for every arm of :data:`creditlab.core.correction.CORRECTIONS`.
ROLLOUT_PREFIX = "creditlab_"

_WRAPPED_SIGNATURE = ("log_ratio", "response_mask", "rollout_is", "rollout_is_threshold",
                      "rollout_is_batch_normalize")


def __getattr__(name: str):
    if name == "ESTIMATORS":  # a live view: the geometries registered now
        return tuple(ROLLOUT_PREFIX + g for g in credit.GEOMETRIES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_version(version: str | None = None) -> str:
    """``version`` (default: the installed verl's) when it is in :data:`TESTED_VERSIONS` or
    ``CREDITLAB_ALLOW_UNTESTED_VERL=1`` is set; otherwise a one-line :class:`CreditlabError` naming it."""
    found = getattr(verl, "__version__", "unknown") if version is None else version
    return check_tested_version(__name__, "verl", found, TESTED_VERSIONS, ALLOW_UNTESTED_ENV)


# --------------------------------------------------------------------------------------------
# rollout correction


def parse_rollout_is(spec: str) -> tuple[str, dict[str, float]]:
    """Parse ``creditlab_<arm>[:key=value,...]`` into the arm and its keyword parameters.

    ``<arm>`` is looked up in :data:`creditlab.core.correction.CORRECTIONS` now, so an arm registered
    after import is accepted, and the keys are its parameters (:func:`~creditlab.core.correction.correction_params`).
    The values are checked by running the arm on a one-token batch.

    >>> parse_rollout_is("creditlab_interq:alpha_g=0.3,eps_high=0.05")
    ('interq', {'alpha_g': 0.3, 'eps_high': 0.05})
    >>> parse_rollout_is("creditlab_tis:cap=3")
    ('tis', {'cap': 3.0})
    """
    return correction.parse_correction(spec, "algorithm.rollout_correction.rollout_is", ROLLOUT_PREFIX)


#: :func:`parse_rollout_is` once per spec: verl calls with the same spec every micro-batch
_parsed = ParsedSpecs(parse_rollout_is)


def rollout_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, spec: str, *, sync: bool | None = None
                    ) -> tuple[torch.Tensor, dict[str, float] | correction.DeviceMetrics]:
    """creditlab's ``rollout_is_weights`` ``(bs, response_length)`` and metrics, in verl's contract.

    ``log_ratio`` is verl's ``old_log_probs - rollout_log_probs`` (junk on tool tokens, where the
    rollout log-prob is 0.0: it is never read); ``response_mask`` is the policy mask. Weights are
    detached, in the dtype of ``log_ratio`` and 0 where ``response_mask`` is 0 (verl's convention for
    its own weights). Metric keys start with ``creditlab/`` (verl adds ``rollout_corr/``): the arm's and
    :func:`~creditlab.core.correction.mismatch_metrics`', from one InterQ pass
    (:func:`~creditlab.core.correction.correction_weights`).

    verl calls it once per step on the driver in decoupled mode (from
    ``compute_rollout_correction_and_add_to_batch``), and inside its ``bypass_mode`` loss, once per
    micro-batch, in bypass mode. ``sync``: None (default) takes the first way in decoupled mode (the
    input checks raise on NaN/inf, the metrics are floats) and the second otherwise: no host read
    (``correction_weights(..., check=False, sync=False)``: NaN/inf tokens are counted in
    ``creditlab/correction/nonfinite_tokens``, weight 1) and the metrics a
    :class:`~creditlab.core.correction.DeviceMetrics`, read in one transfer where verl merges them.
    """
    arm, params = _parsed(spec)
    if sync is None:
        sync = _PER_BATCH.get()
    dims: dict[str, int] = {}
    check_tensor("response_mask", response_mask, shape=("B", "L"), dims=dims)
    check_tensor("log_ratio", log_ratio, shape=("B", "L"), floating=True, dims=dims)
    pm = response_mask.bool()
    # only old - rollout enters the arms and metrics: split the log ratio into two parts <= 0 (the
    # log-prob check of core) whose difference is the log ratio exactly (one of them is 0)
    old, rollout = log_ratio.clamp(max=0), (-log_ratio).clamp(max=0)
    w, m = correction.correction_weights(arm, old, rollout, pm, params=params, check=sync, sync=sync)
    weights = (w.to(log_ratio.dtype) * response_mask.to(log_ratio.dtype)).detach()
    if sync:
        return weights, {f"creditlab/{k}": float(v) for k, v in m.items()}
    return weights, correction.DeviceMetrics().add(m, prefix="creditlab/")


#: True while verl computes the rollout correction once per batch on the driver (decoupled mode):
#: set by the wrapper of ``compute_rollout_correction_and_add_to_batch`` (:func:`install_dump_hook`).
_PER_BATCH: contextvars.ContextVar[bool] = contextvars.ContextVar("creditlab_verl_per_batch", default=False)


def _wrap(original):
    @functools.wraps(original)
    def compute_rollout_correction_weights(log_ratio, response_mask, rollout_is="token", rollout_is_threshold=2.0,
                                           rollout_is_batch_normalize=False):
        if isinstance(rollout_is, str) and rollout_is.startswith(ROLLOUT_PREFIX):
            if rollout_is_batch_normalize:
                raise ConfigError("algorithm.rollout_correction.rollout_is_batch_normalize",
                                  f"must be false with {rollout_is!r} (creditlab weights are not renormalised)")
            return rollout_weights(log_ratio, response_mask, rollout_is)
        return original(log_ratio, response_mask, rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold,
                        rollout_is_batch_normalize=rollout_is_batch_normalize)

    compute_rollout_correction_weights.__creditlab_original__ = original
    return compute_rollout_correction_weights


def install_rollout_correction() -> None:
    """Wrap ``verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_weights`` (once).

    Every verl trainer reaches that function through the module global (``ray_trainer`` and the
    v1 trainer via ``compute_rollout_correction_and_add_to_batch``, bypass mode via
    ``compute_policy_loss_bypass_mode``), so replacing the global is enough. Raises
    :class:`CreditlabError` on an untested verl version or a changed signature.
    """
    current = rollout_corr_helper.compute_rollout_correction_weights
    if getattr(current, "__creditlab_original__", None) is not None:
        return
    version = check_version()
    names = tuple(inspect.signature(current).parameters)
    if names != _WRAPPED_SIGNATURE:
        raise CreditlabError(
            f"verl {version}: rollout_corr_helper.compute_rollout_correction_weights{names} no longer has the "
            f"signature {_WRAPPED_SIGNATURE}; creditlab's rollout correction cannot be installed")
    rollout_corr_helper.compute_rollout_correction_weights = _wrap(current)


# --------------------------------------------------------------------------------------------
# advantage estimators


def pack_turn_rewards(response_mask: torch.Tensor, outcome: torch.Tensor | None = None,
                      turn_scores: torch.Tensor | None = None) -> torch.Tensor:
    """``token_level_rewards`` ``(bs, L)`` in the ``creditlab_prm`` layout.

    ``outcome`` ``(bs,)`` goes on the last policy token of each row, ``turn_scores`` ``(bs, T)`` on the
    first token of each turn (junk beyond a row's turns is ignored). A row whose last turn is one
    token long has no place for that turn's process score (its only token holds the outcome): a
    non-zero score there raises :class:`InputError`.

    >>> rm = torch.tensor([[1, 1, 0, 1, 1, 0]])
    >>> pack_turn_rewards(rm, torch.tensor([1.0]), torch.tensor([[0.2, 0.5]])).tolist()
    [[0.20000000298023224, 0.0, 0.0, 0.5, 1.0, 0.0]]
    """
    check_tensor("response_mask", response_mask, ndim=2)
    pm = response_mask.bool()
    lay = turn_layout(pm)
    B, L = pm.shape
    out = torch.zeros(B, L, dtype=torch.float32, device=pm.device)
    if turn_scores is not None:
        check_tensor("turn_scores", turn_scores, shape=(B, None), floating=True)
        T = lay.num_turns
        scores = torch.zeros(B, T, dtype=out.dtype, device=pm.device)
        k = min(T, turn_scores.shape[1])
        scores[:, :k] = turn_scores[:, :k].to(out.dtype)
        scores = torch.where(lay.step_mask, scores, torch.zeros_like(scores))
        check_tensor("turn_scores", scores, finite=True)
        out = torch.where(lay.first, torch.gather(scores, 1, lay.span), out)
    has = pm.any(dim=1)
    last = (L - 1 - torch.argmax(pm.flip(1).to(torch.int8), dim=1)).clamp_min(0)
    rows = torch.arange(B, device=pm.device)
    clash = has & lay.first[rows, last] & (out[rows, last] != 0)
    if bool(clash.any()):
        i = int(clash.nonzero()[0, 0])
        raise InputError(f"turn_scores: row {i}: the last turn is one token long, so it has no token for a "
                         "process score (its only token holds the outcome)")
    if outcome is not None:
        check_tensor("outcome", outcome, shape=(B,), floating=True, finite=True)
        if bool((has == 0).any() & (outcome[~has] != 0).any()):
            raise InputError("outcome: a row without policy tokens cannot carry an outcome")
        out[rows[has], last[has]] += outcome[has].to(out.dtype)
    return out


def _settings(config: Any) -> CreditSettings:
    if config is None:
        return CreditSettings()
    if config.get("norm_adv_by_std_in_grpo", True) is False:
        raise ConfigError("algorithm.norm_adv_by_std_in_grpo",
                          "creditlab estimators always normalise by the group std; set it to true")
    section = config.get("creditlab", None)
    if section is not None:  # the dump settings live beside the estimators' knobs
        section = {k: v for k, v in section.items() if k not in DUMP_KEYS}
    return CreditSettings.from_mapping(section, "algorithm.creditlab")


def _estimator(geometry: str):
    def estimator(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: Any = None,
                  index: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        settings = _settings(config)
        dims: dict[str, int] = {}
        check_tensor("response_mask", response_mask, shape=("B", "L"), dims=dims)
        check_tensor("token_level_rewards", token_level_rewards, shape=("B", "L"), floating=True, finite=True,
                     dims=dims)
        step = SkipManager.step if SkipManager.step >= 0 else None
        adv = token_reward_advantages(geometry, token_level_rewards, response_mask.bool(),
                                      group_ids(index, "verl's 'uid'"), step=step, settings=settings)
        return adv, adv.clone()

    estimator.__name__ = estimator.__qualname__ = f"compute_creditlab_{geometry}_advantage"
    estimator.__doc__ = (f"verl advantage estimator ``creditlab_{geometry}``: per-turn credit geometry "
                         f"``{geometry}`` broadcast to the tokens of each turn (see the module docstring).")
    return estimator


_ESTIMATOR_FNS: dict[str, Any] = {}  # verl name -> estimator, one per geometry (stable identity)


def install_estimators() -> None:
    """Register ``creditlab_<geometry>`` in verl's ``ADV_ESTIMATOR_REGISTRY`` for every geometry registered
    in :data:`creditlab.core.credit.GEOMETRIES` now (idempotent: call again after registering one)."""
    for geometry in credit.GEOMETRIES:
        name = ROLLOUT_PREFIX + geometry
        fn = _ESTIMATOR_FNS.get(name)
        if fn is None:
            fn = _ESTIMATOR_FNS[name] = _estimator(geometry)
        registered = core_algos.ADV_ESTIMATOR_REGISTRY.get(name)
        if registered is fn:
            continue
        if registered is not None and not getattr(registered, "__module__", "").startswith("creditlab."):
            raise CreditlabError(f"verl advantage estimator {name!r} is already registered by {registered.__module__}")
        core_algos.ADV_ESTIMATOR_REGISTRY[name] = fn


# --------------------------------------------------------------------------------------------
# policy loss

#: verl ``loss_agg_mode`` -> :func:`creditlab.core.losses.aggregate` mode.
AGG_MODES = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean",
             "seq-mean-token-sum": "seq_mean_token_sum", "seq-mean-token-sum-norm": "seq_mean_token_sum_norm"}


def compute_policy_loss_creditlab(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                  response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                                  rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """verl policy loss ``creditlab_ppo``: :func:`creditlab.core.losses.policy_loss` on a micro-batch.

    Clip range from ``config.clip_ratio_low`` / ``clip_ratio_high`` (``clip_ratio`` when unset), dual
    clip from ``config.clip_ratio_c`` (3.0 when unset, as verl; null turns it off);
    ``rollout_is_weights`` (e.g. creditlab's InterQ-RL weights) multiply the token losses. The
    micro-batch value is rescaled to verl's global normalisation (``config.global_batch_info``:
    ``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``) exactly as verl's
    ``agg_loss`` does, so gradients add up across micro-batches and data-parallel ranks.

    No tensor value is read on the host (verl calls this once per micro-batch): the metrics are 0-dim
    tensors (verl 0.9.1's ``Metric`` accepts them and aggregates once per step), and instead of a
    NaN/inf check the number of response tokens with a non-finite input is reported as
    ``actor/creditlab_nonfinite_tokens`` (:func:`~creditlab.core.losses.policy_loss` with
    ``check_finite=False``; the loss is NaN then, and verl skips the step on a non-finite gradient norm).
    """
    from creditlab.core.losses import policy_loss

    if config is None:
        raise ConfigError("actor_rollout_ref.actor", "the creditlab_ppo loss needs the actor config")
    if loss_agg_mode not in AGG_MODES:
        raise ConfigError("actor_rollout_ref.actor.loss_agg_mode",
                          f"{loss_agg_mode!r} is not supported by creditlab_ppo; valid: {', '.join(AGG_MODES)}")
    clip = config.get("clip_ratio", 0.2)
    clip_low = config.get("clip_ratio_low", None)
    clip_high = config.get("clip_ratio_high", None)
    clip_low = clip if clip_low is None else clip_low
    clip_high = clip if clip_high is None else clip_high
    info = dict(config.get("global_batch_info", None) or {})
    dp = info.get("dp_size") or 1
    pm = response_mask.bool()
    L = pm.shape[1]
    n_tok = pm.sum()
    n_seq = pm.any(dim=1).sum()
    mode = AGG_MODES[loss_agg_mode]
    norm = None
    scale = None
    if mode == "token_mean":
        total = info.get("batch_num_tokens")
        if total is not None:
            scale = n_tok.clamp_min(1).double() / float(total) * dp
    else:
        total = info.get("global_batch_size")
        if mode == "seq_mean_token_sum_norm":
            factor = info.get("loss_scale_factor") or L
            norm = float(factor)  # verl: mean over non-empty rows of token sums, / factor
        if total is not None:
            scale = n_seq.clamp_min(1).double() / float(total) * dp
    if dp > 1 and total is None:
        raise ConfigError("global_batch_info", f"dp_size={dp} needs the global token / sequence count")
    loss, metrics = policy_loss(log_prob, old_log_prob, advantages, pm, clip_low=clip_low, clip_high=clip_high,
                                clip_ratio_c=config.get("clip_ratio_c", 3.0), weights=rollout_is_weights, agg=mode,
                                norm=norm, check_finite=False)
    if scale is not None:
        loss = loss * scale.to(loss.dtype)
    return loss, {"actor/pg_clipfrac": metrics["loss/clip_frac"], "actor/ppo_kl": metrics["loss/approx_kl"],
                  "actor/creditlab_weight_mean": metrics["loss/weight_mean"],
                  "actor/creditlab_nonfinite_tokens": metrics["loss/nonfinite_tokens"]}


def install_policy_loss() -> None:
    """Register ``creditlab_ppo`` in verl's ``POLICY_LOSS_REGISTRY`` (once)."""
    registered = core_algos.POLICY_LOSS_REGISTRY.get("creditlab_ppo")
    if registered is compute_policy_loss_creditlab:
        return
    if registered is not None and not getattr(registered, "__module__", "").startswith("creditlab."):
        raise CreditlabError(f"verl policy loss 'creditlab_ppo' is already registered by {registered.__module__}")
    core_algos.POLICY_LOSS_REGISTRY["creditlab_ppo"] = compute_policy_loss_creditlab


# --------------------------------------------------------------------------------------------
# FORK reward function


#: One MicroBatcher per (event loop, reward, max_batch, max_wait_s), dropped with its loop.
_BATCHERS = BatcherCache()


async def fork_reward(data_source: Any = None, solution_str: str = "", ground_truth: Any = None,
                      extra_info: dict | None = None, *, judge: str = "offline", base_url: str | None = None,
                      model: str | None = None, api_key_env: str = "OPENAI_API_KEY", concurrency: int = 16,
                      timeout: float = 60.0, max_retries: int = 4, beta: float | None = None,
                      tau: str | float = "judge", mode: str = "fork", assume_correct: bool = False,
                      match_threshold: float = 0.55, offline_tau: float = 0.75, cache_path: str | None = None,
                      max_batch: int = 64, max_wait_s: float = 0.05, **kwargs: Any) -> dict[str, float]:
    """verl custom reward function (``reward.custom_reward_function``): FORK of one response.

    Set ``path: pkg://creditlab.integrations.verl`` and ``name: fork_reward``; the judge options
    go in ``reward_kwargs``. verl calls it once per sample, concurrently; calls are coalesced into
    batches of at most ``max_batch`` (waiting at most ``max_wait_s``) that the judge scores together.

    The rubrics are ``ground_truth`` (a list of ``{"criterion", "points"}`` records, or its JSON text);
    the prompt is ``extra_info["prompt"]`` (or ``extra_info["question"]``). Returns ``{"score",
    "precision", "recall"}``. A judge failure (after the judge's own retries) raises
    :class:`CreditlabError` naming the stage: a silent 0 would train on a wrong reward.
    """
    from creditlab.rewards.items import ForkItem, parse_rubrics, render_messages

    info = extra_info or {}
    prompt = info.get("prompt", info.get("question"))
    if prompt is None:
        raise InputError("extra_info: needs 'prompt' (or 'question'): FORK judges the response against its prompt")
    item_id = str(info.get("index", info.get("id", "")))
    where = f"sample {item_id or '?'} ({data_source})"
    item = ForkItem(item_id, render_messages(prompt, where, "prompt"), str(solution_str),
                    parse_rubrics(ground_truth, where, "ground_truth"))
    reward = cached_fork_reward(judge, base_url=base_url, model=model, api_key_env=api_key_env, concurrency=concurrency,
                                timeout=timeout, max_retries=max_retries, beta=beta, tau=tau, mode=mode,
                                assume_correct=assume_correct, match_threshold=match_threshold, offline_tau=offline_tau,
                                cache_path=cache_path)
    import asyncio

    batcher = _BATCHERS.get(asyncio.get_running_loop(), (id(reward), int(max_batch), float(max_wait_s)),
                            lambda: MicroBatcher(reward.score, max_batch=max_batch, max_wait_s=max_wait_s))
    res = await batcher.submit(item)
    if res.reward is None:
        raise CreditlabError(f"FORK reward of {where}: {res.error}")
    return {"score": float(res.reward), "precision": float(res.precision), "recall": float(res.recall)}


# --------------------------------------------------------------------------------------------
# rollout dumps for `creditlab diagnose`

#: Keys of ``algorithm.creditlab`` read by the dump hook: ``dump_dir`` (a directory: one
#: ``part-NNNNN.parquet`` per step; or a ``*.jsonl`` file, appended to).
DUMP_KEYS = ("dump_dir",)
_EXTRA_COLUMNS = ("precision", "recall", "process_reward")
#: Attribute of a ``DataProto`` holding its ``response_mask`` from before verl's rejection sampling
#: (``rollout_rs``), set by the wrapper of ``compute_rollout_correction_and_add_to_batch``.
MASK_BEFORE_REJECTION = "_creditlab_response_mask_before_rejection"
_V1_UTILS = "verl.trainer.ppo.v1.utils"
_V1_TRAINER = "verl.trainer.ppo.v1.trainer_base"
_SUPPRESS_DUMP: contextvars.ContextVar[bool] = contextvars.ContextVar("creditlab_verl_dump_suppressed",
                                                                     default=False)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()


def dump_rows(data: Any, step: int | None = None, *, logprobs_source: str | None = None,
              mask_before_rejection: torch.Tensor | None = None) -> list[dict[str, Any]]:
    """Dump rows (docs/diagnose.md) of a verl ``DataProto`` batch, one per response.

    Reads ``response_mask`` (the policy mask: 0 on tool/observation tokens), ``old_log_probs`` (the
    learner at the sampling checkpoint) and ``rollout_log_probs`` (the engine; without it the rows
    have no token columns), the reward as the row sum of ``token_level_scores`` (else
    ``token_level_rewards``), the group from the ``uid`` non-tensor field, and ``precision`` /
    ``recall`` / ``process_reward`` when the reward function returned them. Padding (0 in the
    response part of ``attention_mask``) is dropped. ``step``: default ``meta_info["global_steps"]``,
    else verl's global step (``SkipManager.step``).

    ``logprobs_source`` (written in every row with token columns): ``"learner"``, or
    ``"rollout (verl bypass mode)"`` when ``old_log_probs`` are the engine's (verl's bypass mode sets
    ``old_log_probs := rollout_log_probs`` and never computes the learner's); default: the latter when
    the two tensors share their storage, as ``apply_bypass_mode`` leaves them.

    ``mask_before_rejection`` (default: the one the rollout-correction wrapper kept on ``data``): the
    ``response_mask`` before verl's rejection sampling (``rollout_rs``) zeroed the rejected tokens.
    With it, ``policy_mask`` is that mask (the rejected tokens were generated by the policy) and the
    token column ``rejected`` marks the tokens rejection sampling dropped from the loss.
    """
    from creditlab.diagnose.schema import LEARNER, VERL_BYPASS, rows_from_arrays

    batch = data.batch
    keys = set(batch.keys())
    if "response_mask" not in keys:
        raise InputError("data.batch: needs 'response_mask' (the policy mask) to dump a verl batch")
    rm = batch["response_mask"].detach().cpu()
    B, L = rm.shape
    score_key = "token_level_scores" if "token_level_scores" in keys else "token_level_rewards"
    if score_key not in keys:
        raise InputError("data.batch: needs 'token_level_scores' or 'token_level_rewards' for the reward")
    reward = batch[score_key].detach().cpu().double().sum(-1)
    uid = data.non_tensor_batch.get("uid")
    if uid is None:
        raise InputError("data.non_tensor_batch: needs 'uid' (the GRPO group of each response)")
    if step is None:
        step = data.meta_info.get("global_steps", SkipManager.step if SkipManager.step >= 0 else 0)
    kept = rm.bool()
    if mask_before_rejection is None:
        mask_before_rejection = getattr(data, MASK_BEFORE_REJECTION, None)
    rejected = None
    pm = kept
    if mask_before_rejection is not None:
        before = mask_before_rejection.detach().cpu()
        if tuple(before.shape) != (B, L):
            raise InputError(f"mask_before_rejection: expected {(B, L)} (the response_mask), got {tuple(before.shape)}")
        pm = before.bool() | kept
        rejected = pm & ~kept
    if "attention_mask" in keys and batch["attention_mask"].shape[1] >= L:
        valid = batch["attention_mask"][:, -L:].detach().cpu().bool() | pm
    else:  # up to the last policy token
        last = L - torch.argmax(pm.flip(1).to(torch.int8), dim=1)
        valid = torch.arange(L)[None, :] < torch.where(pm.any(1), last, 0)[:, None]
    token: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if "old_log_probs" in keys and "rollout_log_probs" in keys:
        old, rollout = batch["old_log_probs"], batch["rollout_log_probs"]
        if logprobs_source is None:
            logprobs_source = VERL_BYPASS if _same_storage(old, rollout) else LEARNER
        token = {"logprobs": old.detach().cpu().double(), "rollout_logprobs": rollout.detach().cpu().double(),
                 "policy_mask": pm, "valid_mask": valid, "rejected": rejected}
        extra["logprobs_source"] = [logprobs_source] * B
    for name in _EXTRA_COLUMNS:
        v = data.non_tensor_batch.get(name)
        if v is not None and len(v) == B:
            extra[name] = [None if x is None else float(x) for x in np.asarray(v, dtype=object).tolist()]
    return rows_from_arrays(step=int(step), group_ids=[str(u) for u in np.asarray(uid, dtype=object).tolist()],
                            rewards=reward, response_length=pm.sum(1), **token, **extra)


def dump_batch(data: Any, path: str | os.PathLike, step: int | None = None, *, logprobs_source: str | None = None,
               mask_before_rejection: torch.Tensor | None = None) -> Any:
    """Write :func:`dump_rows` of ``data`` to ``path`` (a directory gets one parquet part per
    call, a ``*.jsonl`` file is appended to); returns the file written."""
    from creditlab.diagnose.schema import write_dump

    rows = dump_rows(data, step, logprobs_source=logprobs_source,
                     mask_before_rejection=mask_before_rejection)
    return write_dump(rows, path, append=True)


def _dump_dir(config: Any) -> str | None:
    section = config.get("creditlab", None) if config is not None else None
    if section is None:
        return None
    value = section.get("dump_dir", None)
    if value is not None and not isinstance(value, str | os.PathLike):
        raise ConfigError("algorithm.creditlab.dump_dir", f"must be a path, got {value!r}")
    return value or None


def _source(config: Any) -> str:
    """``logprobs_source`` of a batch trained under the algorithm ``config``: verl's bypass mode
    (``rollout_correction.bypass_mode``) puts the engine's log-probs in ``old_log_probs``."""
    from creditlab.diagnose.schema import LEARNER, VERL_BYPASS

    rc = config.get("rollout_correction", None) if config is not None else None
    return VERL_BYPASS if rc is not None and rc.get("bypass_mode", False) else LEARNER


def _dump_after(original):
    """Wrap ``original`` (one of verl's advantage functions) to dump the batch it returns when
    ``algorithm.creditlab.dump_dir`` is set; nested calls (the v1 helper calling ``compute_advantage``
    on a selection of its rows) do not dump again."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        token = _SUPPRESS_DUMP.set(True)
        try:
            out = original(*args, **kwargs)
        finally:
            _SUPPRESS_DUMP.reset(token)
        if not _SUPPRESS_DUMP.get():
            config = signature.bind(*args, **kwargs).arguments.get("config")
            path = _dump_dir(config)
            if path is not None:
                dump_batch(out, path, logprobs_source=_source(config))
        return out

    wrapper.__creditlab_original__ = original
    return wrapper


def _wrap_compute_advantage(original):
    return _dump_after(original)


def _wrap_rejection(original):
    @functools.wraps(original)
    def compute_rollout_correction_and_add_to_batch(batch, rollout_corr_config):
        before = batch.batch["response_mask"] if "response_mask" in batch.batch.keys() else None
        token = _PER_BATCH.set(True)  # once per batch, on the driver: rollout_weights may read the host
        try:
            out, metrics = original(batch, rollout_corr_config)
        finally:
            _PER_BATCH.reset(token)
        rs = rollout_corr_config.get("rollout_rs", None) if rollout_corr_config is not None else None
        # verl replaced response_mask by the mask after rejection: keep the one before, for the dump
        object.__setattr__(out, MASK_BEFORE_REJECTION, before if rs is not None else None)
        return out, metrics

    compute_rollout_correction_and_add_to_batch.__creditlab_original__ = original
    return compute_rollout_correction_and_add_to_batch


def _replace_global(module: Any, name: str, wrapped: Any) -> None:
    """``module.name = wrapped`` when the module holds the function ``wrapped`` wraps (it imported the
    name before creditlab was loaded)."""
    if module is not None and getattr(module, name, None) is getattr(wrapped, "__creditlab_original__", None):
        setattr(module, name, wrapped)


def _patch_v1_utils(module: Any) -> None:
    """Dump every output the v1 trainer trains on: wrap ``compute_advantage_for_multi_trajectories``,
    which hands ``compute_advantage`` only each session's final output (GRPO) and broadcasts its
    advantage to the session's other outputs."""
    from verl.trainer.ppo import ray_trainer

    _replace_global(module, "compute_advantage", ray_trainer.compute_advantage)
    current = module.compute_advantage_for_multi_trajectories
    if getattr(current, "__creditlab_original__", None) is None:
        names = tuple(inspect.signature(current).parameters)
        if names[:2] != ("data", "batch_keys") or "config" not in names:
            raise CreditlabError(f"verl: v1.utils.compute_advantage_for_multi_trajectories{names} changed; "
                                 "creditlab's dump hook cannot be installed")
        module.compute_advantage_for_multi_trajectories = _dump_after(current)
    trainer = sys.modules.get(_V1_TRAINER)
    _replace_global(trainer, "compute_advantage_for_multi_trajectories",
                    module.compute_advantage_for_multi_trajectories)
    _replace_global(trainer, "compute_rollout_correction_and_add_to_batch",
                    rollout_corr_helper.compute_rollout_correction_and_add_to_batch)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after ``name`` is imported, before any other module can import
    names from it (the v1 trainer imports them by name; importing v1 here would load all of it, and
    transfer_queue, in every verl process)."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module, patch = loader.exec_module, self.patch

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        loader.exec_module = exec_and_patch  # this spec's own loader instance
        return spec


def install_dump_hook() -> None:
    """Wrap verl's advantage functions (once) so that each step's batch is dumped when
    ``algorithm.creditlab.dump_dir`` is set (the calls are unchanged otherwise).

    * ``ray_trainer.compute_advantage``, which verl's trainers call on the driver after the rewards,
      ``old_log_probs`` and the rollout correction, through the module global; the batch is dumped
      after it returns, before the actor update.
    * the v1 trainer's ``v1.utils.compute_advantage_for_multi_trajectories`` (patched when that module
      is imported), so that a v1 dump holds every output it trains, not only each session's final one.
    * ``rollout_corr_helper.compute_rollout_correction_and_add_to_batch``, to keep the
      ``response_mask`` from before rejection sampling (``rollout_rs``) for the dump.
    """
    from verl.trainer.ppo import ray_trainer

    current = ray_trainer.compute_advantage
    if getattr(current, "__creditlab_original__", None) is None:
        names = tuple(inspect.signature(current).parameters)
        if names[:1] != ("data",) or "config" not in names:
            raise CreditlabError(f"verl: ray_trainer.compute_advantage{names} changed; creditlab's dump hook cannot "
                                 "be installed")
        ray_trainer.compute_advantage = _wrap_compute_advantage(current)
    current = rollout_corr_helper.compute_rollout_correction_and_add_to_batch
    if getattr(current, "__creditlab_original__", None) is None:
        names = tuple(inspect.signature(current).parameters)
        if names != ("batch", "rollout_corr_config"):
            raise CreditlabError(f"verl: rollout_corr_helper.compute_rollout_correction_and_add_to_batch{names} "
                                 "changed; creditlab's dump hook cannot be installed")
        rollout_corr_helper.compute_rollout_correction_and_add_to_batch = _wrap_rejection(current)
    if _V1_UTILS in sys.modules:
        _patch_v1_utils(sys.modules[_V1_UTILS])
    elif not any(isinstance(f, _AfterImport) and f.name == _V1_UTILS for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_V1_UTILS, _patch_v1_utils))


# --------------------------------------------------------------------------------------------
# live checks in verl's step metrics

#: Set to ``0`` to turn the live checks off (read at every step).
LIVE_ENV = "CREDITLAB_LIVE_CHECKS"
#: Prefix of creditlab's metrics in verl's logs (the rollout correction's get it from verl).
VERL_PREFIX = "rollout_corr/" + _live.PREFIX
_LIVE_WARNINGS = _live.LiveWarnings(prefix=VERL_PREFIX)


def live_metrics(data: Any) -> dict[str, float]:
    """The live check values of a verl ``DataProto`` batch (:mod:`creditlab.integrations._live`), as
    ``rollout_corr/creditlab/<check>`` floats read in one host read (NaN ones left out).

    From ``old_log_probs``, ``rollout_log_probs`` and the ``response_mask`` (the one from before
    rejection sampling when verl's ``rollout_rs`` changed it), and ``baseline/degenerate_groups`` from
    the ``uid`` and the row sums of ``token_level_scores``. In bypass mode ``old_log_probs`` are the
    engine's own (no learner log-prob of the sampling checkpoint exists), so only the groups are checked.
    """
    batch = data.batch
    keys = set(batch.keys())
    if "response_mask" not in keys:
        return {}
    rm = getattr(data, MASK_BEFORE_REJECTION, None)
    pm = (batch["response_mask"] if rm is None else rm).bool()
    old = batch["old_log_probs"] if "old_log_probs" in keys else None
    rollout = batch["rollout_log_probs"] if "rollout_log_probs" in keys else None
    if old is not None and rollout is not None and (old is rollout or (
            old.shape == rollout.shape and old.data_ptr() == rollout.data_ptr())):
        old = rollout = None  # bypass mode: the engine's log-probs twice
    score_key = next((k for k in ("token_level_scores", "token_level_rewards") if k in keys), None)
    uid = data.non_tensor_batch.get("uid")
    groups = rewards = None
    if score_key is not None and uid is not None and len(uid) == pm.shape[0]:
        codes = np.unique(np.asarray(uid, dtype=object).astype(str), return_inverse=True)[1].reshape(-1)
        groups = torch.as_tensor(codes, dtype=torch.long).to(pm.device)
        rewards = batch[score_key].sum(-1)
    values = _live.to_floats(_live.batch_values(old, rollout, pm, group_ids=groups, rewards=rewards))
    return {VERL_PREFIX + k[len(_live.PREFIX):]: v for k, v in values.items() if v == v}


def _wrap_data_metrics(original):
    @functools.wraps(original)
    def compute_data_metrics(batch, *args, **kwargs):
        out = original(batch, *args, **kwargs)
        if os.environ.get(LIVE_ENV, "1") != "0":
            live = live_metrics(batch)
            out.update(live)
            _LIVE_WARNINGS.observe(live, step=SkipManager.step if SkipManager.step >= 0 else None)
        return out

    compute_data_metrics.__creditlab_original__ = original
    return compute_data_metrics


def install_live_checks() -> None:
    """Wrap ``verl.trainer.ppo.metric_utils.compute_data_metrics`` (once), which verl's trainers call on
    the driver once per step with the step's batch, so that its metrics carry the live check values
    (:func:`live_metrics`) and a check crossing its warn threshold logs one warning line
    (:class:`~creditlab.integrations._live.LiveWarnings`: once per run and check, again after it cleared).
    The trainers import the function by name: the ones already imported get the wrapper too."""
    from verl.trainer.ppo import metric_utils

    current = metric_utils.compute_data_metrics
    if getattr(current, "__creditlab_original__", None) is None:
        names = tuple(inspect.signature(current).parameters)
        if names[:1] != ("batch",):
            raise CreditlabError(f"verl: metric_utils.compute_data_metrics{names} changed; creditlab's live checks "
                                 "cannot be installed")
        metric_utils.compute_data_metrics = _wrap_data_metrics(current)
    for name in ("verl.trainer.ppo.ray_trainer", _V1_TRAINER, "verl.experimental.separation.ray_trainer"):
        _replace_global(sys.modules.get(name), "compute_data_metrics", metric_utils.compute_data_metrics)


# --------------------------------------------------------------------------------------------


#: The verl functions :func:`install` wraps (by dotted path; the v1 trainer's
#: ``compute_advantage_for_multi_trajectories`` too, when ``verl.trainer.ppo.v1.utils`` is imported).
WRAPPED = ("verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_weights",
           "verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_add_to_batch",
           "verl.trainer.ppo.ray_trainer.compute_advantage",
           "verl.trainer.ppo.metric_utils.compute_data_metrics")


def install() -> dict[str, tuple[str, ...]]:
    """Register creditlab's estimators, policy loss, rollout correction, dump hook and live checks with verl
    (after :func:`check_version`; idempotent: call again after registering an arm or a geometry).

    Returns what verl now takes from creditlab, by config field: ``algorithm.rollout_correction.rollout_is``
    (``creditlab_<arm>`` for every registered arm), ``algorithm.adv_estimator`` (``creditlab_<geometry>``
    in verl's ``ADV_ESTIMATOR_REGISTRY``), ``actor_rollout_ref.actor.policy_loss.loss_mode``
    (``creditlab_ppo`` in its ``POLICY_LOSS_REGISTRY``), and ``wrapped``: the verl functions wrapped
    (:data:`WRAPPED`).
    """
    check_version()
    install_rollout_correction()
    install_estimators()
    install_policy_loss()
    install_dump_hook()
    install_live_checks()
    return {"algorithm.rollout_correction.rollout_is": tuple(ROLLOUT_PREFIX + a for a in correction.CORRECTIONS),
            "algorithm.adv_estimator": tuple(ROLLOUT_PREFIX + g for g in credit.GEOMETRIES),
            "actor_rollout_ref.actor.policy_loss.loss_mode": ("creditlab_ppo",),
            "wrapped": WRAPPED}


install()
