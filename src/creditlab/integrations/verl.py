"""creditlab inside verl (tested with verl 0.9.1): rollout correction, advantage estimators, FORK reward.

Load it in every verl process with verl's external-module mechanism::

    export VERL_USE_EXTERNAL_MODULES=creditlab.integrations.verl

Importing the module registers everything (idempotently; importing or calling :func:`install` again
changes nothing):

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
  current log ratio, clip rates, rho and alpha quantiles).
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
* **FORK reward function** :func:`fork_compute_score` (async, micro-batched).
* **Rollout dumps** for ``creditlab diagnose``: with ``algorithm.creditlab.dump_dir`` set, every
  training step's batch is written in the dump schema (docs/diagnose.md) when verl computes the
  advantages (``ray_trainer.compute_advantage`` is wrapped, :func:`install_dump_hook`): the learner's
  ``old_log_probs``, the engine's ``rollout_log_probs`` (``actor_rollout_ref.rollout.calculate_log_probs``),
  ``response_mask``, the score (row sum of ``token_level_scores``), the ``uid`` and the reward
  function's ``precision`` / ``recall`` when it returned them. :func:`rows_from_dataproto` /
  :func:`dump_batch` do the same for any ``DataProto``.

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

import functools
import inspect
import os
import re
from typing import Any

import numpy as np
import torch
import verl
from verl.trainer.ppo import core_algos, rollout_corr_helper
from verl.utils.skip.skip_manager import SkipManager

from creditlab.core import correction, credit
from creditlab.core._checks import check_tensor
from creditlab.errors import ConfigError, CreditlabError, InputError
from creditlab.integrations._common import (
    BatcherCache,
    CreditSettings,
    MicroBatcher,
    fork_reward,
    turn_credit,
    turn_layout,
)

__all__ = [
    "AGG_MODES",
    "ESTIMATORS",  # noqa: F822  (module __getattr__: a live view of the geometry registry)
    "ROLLOUT_PREFIX",
    "TESTED_VERL_VERSIONS",
    "DUMP_KEYS",
    "compute_policy_loss_creditlab",
    "dump_batch",
    "fork_compute_score",
    "install",
    "install_dump_hook",
    "install_estimators",
    "install_policy_loss",
    "install_rollout_correction",
    "pack_turn_rewards",
    "parse_rollout_is",
    "rollout_weights",
    "rows_from_dataproto",
]

#: verl versions this module was tested against (``CREDITLAB_ALLOW_UNTESTED_VERL=1`` lets another
#: version through when the wrapped function's signature is unchanged).
TESTED_VERL_VERSIONS = ("0.9.1",)
#: ``algorithm.rollout_correction.rollout_is`` values starting with this go to creditlab:
#: ``creditlab_<arm>`` for every arm of :data:`creditlab.core.correction.CORRECTIONS`.
ROLLOUT_PREFIX = "creditlab_"

_WRAPPED_SIGNATURE = ("log_ratio", "response_mask", "rollout_is", "rollout_is_threshold",
                      "rollout_is_batch_normalize")


def __getattr__(name: str):
    if name == "ESTIMATORS":  # a live view: the geometries registered now
        return tuple(ROLLOUT_PREFIX + g for g in credit.GEOMETRIES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------
# rollout correction


def _number_type(param: inspect.Parameter) -> type:
    """``int`` for a parameter declared or defaulting to an int (e.g. ``iters: int | None``), else ``float``."""
    if isinstance(param.default, int) and not isinstance(param.default, bool):
        return int
    ann = param.annotation
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann))
    return int if re.search(r"\bint\b", text) and "float" not in text else float


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
    where = "algorithm.rollout_correction.rollout_is"
    if not isinstance(spec, str) or not spec.startswith(ROLLOUT_PREFIX):
        raise ConfigError(where, f"expected '{ROLLOUT_PREFIX}<arm>[:key=value,...]', got {spec!r}")
    head, _, tail = spec[len(ROLLOUT_PREFIX):].partition(":")
    arm = head.strip()
    if arm not in correction.CORRECTIONS:
        raise ConfigError(where, f"unknown arm {arm!r}; valid: "
                                 f"{', '.join(ROLLOUT_PREFIX + a for a in correction.CORRECTIONS)}")
    valid = correction.correction_params(arm)
    signature = inspect.signature(correction.CORRECTIONS[arm]).parameters
    params: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in tail.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in valid:
            raise ConfigError(where, f"bad parameter {part!r} for {arm}; valid keys: {', '.join(valid) or 'none'}")
        try:
            params[key] = _number_type(signature[key])(value)
        except ValueError:
            raise ConfigError(f"{where}:{key}", f"expected a number, got {value.strip()!r}") from None
    try:  # validate the values now, with the config path in the message
        one = torch.zeros(1, 1)
        correction.correction_weights(arm, one, one, one.bool(), params=params, diagnostics=False)
    except InputError as err:
        raise ConfigError(where, f"{spec!r}: {err}") from None
    return arm, params


def rollout_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, spec: str
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """creditlab's ``rollout_is_weights`` ``(bs, response_length)`` and metrics, in verl's contract.

    ``log_ratio`` is verl's ``old_log_probs - rollout_log_probs`` (junk on tool tokens, where the
    rollout log-prob is 0.0: it is never read); ``response_mask`` is the policy mask. Weights are
    detached, in the dtype of ``log_ratio`` and 0 where ``response_mask`` is 0 (verl's convention for
    its own weights). Metric keys start with ``creditlab/`` (verl adds ``rollout_corr/``): the arm's and
    :func:`~creditlab.core.correction.mismatch_metrics`', from one InterQ pass
    (:func:`~creditlab.core.correction.correction_weights`). Runs once per step, on the driver.
    """
    arm, params = parse_rollout_is(spec)
    dims: dict[str, int] = {}
    check_tensor("response_mask", response_mask, shape=("B", "L"), dims=dims)
    check_tensor("log_ratio", log_ratio, shape=("B", "L"), floating=True, dims=dims)
    pm = response_mask.bool()
    # only old - rollout enters the arms and metrics: split the log ratio into two parts <= 0 (the
    # log-prob check of core) whose difference is the log ratio exactly (one of them is 0)
    old, rollout = log_ratio.clamp(max=0), (-log_ratio).clamp(max=0)
    w, m = correction.correction_weights(arm, old, rollout, pm, params=params)  # one InterQ pass
    metrics = {f"creditlab/{k}": float(v) for k, v in m.items()}
    weights = (w.to(log_ratio.dtype) * response_mask.to(log_ratio.dtype)).detach()
    return weights, metrics


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
    version = getattr(verl, "__version__", "unknown")
    if version not in TESTED_VERL_VERSIONS and os.environ.get("CREDITLAB_ALLOW_UNTESTED_VERL") != "1":
        raise CreditlabError(
            f"creditlab.integrations.verl was tested with verl {', '.join(TESTED_VERL_VERSIONS)}, found {version}: "
            "install a tested version, or set CREDITLAB_ALLOW_UNTESTED_VERL=1 to try anyway")
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


def _group_ids(index: Any) -> torch.Tensor:
    if index is None:
        raise ConfigError("index", "creditlab estimators group rollouts by verl's 'uid' (index), which is missing")
    _, inverse = np.unique(np.asarray(index, dtype=object).astype(str), return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long)


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
        with torch.no_grad():
            r = token_level_rewards.to(torch.float32)
            lay = turn_layout(response_mask.bool())
            gid = _group_ids(index).to(r.device)
            if gid.shape[0] != r.shape[0]:
                raise InputError(f"index: {gid.shape[0]} uids for {r.shape[0]} rows")
            total = r.sum(dim=1)
            if geometry == "prm":
                tail = lay.tail.to(r.dtype)
                scores = lay.span_sums(r * (1 - tail))
                outcome = (r * tail).sum(dim=1)
            else:
                scores = lay.span_sums(r)
                outcome = total
            step = SkipManager.step if SkipManager.step >= 0 else None
            a = turn_credit(geometry, lay.step_mask, gid, rewards=outcome, step_scores=scores, step=step,
                            settings=settings)
            adv = lay.to_tokens(a.to(torch.float32)).to(token_level_rewards.dtype)
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


async def fork_compute_score(data_source: Any = None, solution_str: str = "", ground_truth: Any = None,
                             extra_info: dict | None = None, *, judge: str = "offline", base_url: str | None = None,
                             model: str | None = None, api_key_env: str = "OPENAI_API_KEY", concurrency: int = 16,
                             timeout: float = 60.0, max_retries: int = 4, beta: float = 1.0,
                             tau: str | float = "judge", mode: str = "fork", assume_correct: bool = False,
                             match_threshold: float = 0.55, offline_tau: float = 0.75, cache_path: str | None = None,
                             max_batch: int = 64, max_wait_s: float = 0.05, **kwargs: Any) -> dict[str, float]:
    """verl custom reward function (``reward.custom_reward_function``): FORK of one response.

    Set ``path: pkg://creditlab.integrations.verl`` and ``name: fork_compute_score``; the judge options
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
    reward = fork_reward(judge, base_url=base_url, model=model, api_key_env=api_key_env, concurrency=concurrency,
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


def rows_from_dataproto(data: Any, step: int | None = None) -> list[dict[str, Any]]:
    """Dump rows (docs/diagnose.md) of a verl ``DataProto`` batch, one per response.

    Reads ``response_mask`` (the policy mask: 0 on tool/observation tokens), ``old_log_probs`` (the
    learner at the sampling checkpoint) and ``rollout_log_probs`` (the engine; without it the rows
    have no token columns), the reward as the row sum of ``token_level_scores`` (else
    ``token_level_rewards``), the group from the ``uid`` non-tensor field, and ``precision`` /
    ``recall`` / ``process_reward`` when the reward function returned them. Padding (0 in the
    response part of ``attention_mask``) is dropped. ``step``: default ``meta_info["global_steps"]``,
    else verl's global step (``SkipManager.step``).
    """
    from creditlab.diagnose.schema import rows_from_arrays

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
    pm = rm.bool()
    if "attention_mask" in keys and batch["attention_mask"].shape[1] >= L:
        valid = batch["attention_mask"][:, -L:].detach().cpu().bool() | pm
    else:  # up to the last policy token
        last = L - torch.argmax(pm.flip(1).to(torch.int8), dim=1)
        valid = torch.arange(L)[None, :] < torch.where(pm.any(1), last, 0)[:, None]
    token: dict[str, Any] = {}
    if "old_log_probs" in keys and "rollout_log_probs" in keys:
        token = {"logprobs": batch["old_log_probs"].detach().cpu().double(),
                 "rollout_logprobs": batch["rollout_log_probs"].detach().cpu().double(),
                 "policy_mask": pm, "valid_mask": valid}
    extra = {}
    for name in _EXTRA_COLUMNS:
        v = data.non_tensor_batch.get(name)
        if v is not None and len(v) == B:
            extra[name] = [None if x is None else float(x) for x in np.asarray(v, dtype=object).tolist()]
    return rows_from_arrays(step=int(step), group_ids=[str(u) for u in np.asarray(uid, dtype=object).tolist()],
                            rewards=reward, response_length=pm.sum(1), **token, **extra)


def dump_batch(data: Any, path: str | os.PathLike, step: int | None = None) -> Any:
    """Write :func:`rows_from_dataproto` of ``data`` to ``path`` (a directory gets one parquet part per
    call, a ``*.jsonl`` file is appended to); returns the file written."""
    from creditlab.diagnose.schema import write_dump

    return write_dump(rows_from_dataproto(data, step), path, append=True)


def _dump_dir(config: Any) -> str | None:
    section = config.get("creditlab", None) if config is not None else None
    if section is None:
        return None
    value = section.get("dump_dir", None)
    if value is not None and not isinstance(value, str | os.PathLike):
        raise ConfigError("algorithm.creditlab.dump_dir", f"must be a path, got {value!r}")
    return value or None


def _wrap_compute_advantage(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compute_advantage(data, *args, **kwargs):
        out = original(data, *args, **kwargs)
        path = _dump_dir(signature.bind(data, *args, **kwargs).arguments.get("config"))
        if path is not None:
            dump_batch(out, path)
        return out

    compute_advantage.__creditlab_original__ = original
    return compute_advantage


def install_dump_hook() -> None:
    """Wrap ``verl.trainer.ppo.ray_trainer.compute_advantage`` (once) so that each step's batch is
    dumped when ``algorithm.creditlab.dump_dir`` is set (the call is unchanged otherwise).

    verl's trainers call that function on the driver after the rewards, ``old_log_probs`` and the
    rollout correction, through the module global (the v1 trainer's ``utils`` imports it by name,
    after this module has run, so it gets the wrapper too).
    """
    from verl.trainer.ppo import ray_trainer

    current = ray_trainer.compute_advantage
    if getattr(current, "__creditlab_original__", None) is not None:
        return
    names = tuple(inspect.signature(current).parameters)
    if names[:1] != ("data",) or "config" not in names:
        raise CreditlabError(f"verl: ray_trainer.compute_advantage{names} changed; creditlab's dump hook cannot be "
                             "installed")
    ray_trainer.compute_advantage = _wrap_compute_advantage(current)


# --------------------------------------------------------------------------------------------


def install() -> None:
    """Register creditlab's estimators, policy loss, rollout correction and dump hook with verl (idempotent)."""
    install_rollout_correction()
    install_estimators()
    install_policy_loss()
    install_dump_hook()


install()
