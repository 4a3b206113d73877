"""creditlab inside OpenRLHF (tested with OpenRLHF 0.11.2, against its own modules without its GPU stack):
rollout correction through its ``PolicyLoss``, FORK as its ``reward_func``, rollout dumps and live checks
from its ``Experience`` objects.

OpenRLHF has no registry: its loss is ``openrlhf.models.loss.PolicyLoss``, built by the actor from the
command line; its advantage estimators are an if/elif in ``RemoteExperienceMaker``; rewards come from a
Python file given as ``--reward.remote_url`` (its ``reward_func(queries, prompts, labels)``), agents from
``--train.agent_func_path``. Its command line takes no option it does not define, so creditlab's settings
are environment variables, and :func:`install` patches two of OpenRLHF's methods (idempotently) in the
process it runs in:

* ``PolicyLoss.forward``: with ``CREDITLAB_OPENRLHF_CORRECTION=<arm>[:key=value,...]`` (an arm of
  :data:`creditlab.core.correction.CORRECTIONS`: ``interq``, ``tis``, ``mis``, ``seq_is``, ``prefix``,
  ``global``, ``geo``, ``none``, or one added with ``register_correction``; the keys are its parameters),
  the arm's weights ``W`` from ``old_log_probs - rollout_log_probs`` on ``action_mask`` (OpenRLHF's
  multi-turn ``action_mask`` is 0 on environment feedback tokens) replace OpenRLHF's own correction:
  OpenRLHF's loss code runs with its correction off and the advantages ``A_t W_t`` (the same loss as
  ``W_t`` times each token's clipped surrogate, dual clip included, since ``W_t >= 0``; tested against
  OpenRLHF's own token TIS with ``creditlab`` ``tis``). It is computed per micro-batch, where OpenRLHF
  calls its loss, without a host read (``correction_weights(..., check=False, sync=False)``). OpenRLHF
  collects vLLM's log-probs only when its own correction is on, so ``--algo.advantage.is_correction_level
  token`` is needed (a :class:`ConfigError` says so otherwise); the loss's 4th and 5th outputs, which
  OpenRLHF logs as ``vllm_kl`` and ``is_filter_ratio``, are the mean ``rollout - old`` log ratio (as
  OpenRLHF computes it) and the share of policy tokens whose weight is 0. The arm's own metrics stay on
  the loss object (``loss_fn.creditlab_metrics``, a :class:`~creditlab.core.correction.DeviceMetrics`):
  OpenRLHF's actor does not log them. Unset: OpenRLHF's own loss, unchanged.
* ``RemoteExperienceMaker.compute_advantages_and_returns``: after it returns, with
  ``CREDITLAB_OPENRLHF_DUMP_DIR`` set, the batch is written in the dump schema of ``creditlab diagnose``
  (:func:`dump_rows`: the learner's ``action_log_probs``, vLLM's ``rollout_log_probs``, ``action_mask``,
  the reward, the group), one parquet part per call; and, unless ``CREDITLAB_LIVE_CHECKS=0``, the live
  check values (:func:`live_metrics`) go into each experience's ``info`` (one value per sample, the
  batch's value), which OpenRLHF's actor logs with its own metrics, and a check crossing its warn
  threshold logs one warning line. OpenRLHF passes no step number to it: the dump's ``step`` counts the
  calls in the process (from 0; a resumed run starts again at 0).

OpenRLHF runs its trainer, actors and vLLM engines as Ray actors, so :func:`install` has to run in each of
them: give it to Ray as the ``worker_process_setup_hook`` of the job (``ray job submit --runtime-env-json
'{"worker_process_setup_hook": "creditlab.integrations.openrlhf.install", "env_vars": {...}}'``); Ray merges
the job's runtime environment with the ``env_vars`` OpenRLHF's driver passes to ``ray.init``.

* :func:`fork_reward` builds the ``reward_func`` of a ``--reward.remote_url`` file: FORK of each response
  (the query minus its prompt) against the rubrics in the sample's label (``--data.label_key``).

Per-turn credit geometries are not offered: OpenRLHF's estimators are a fixed if/elif with no hook.

The names of the integration contract (:data:`creditlab.integrations.CONTRACT`): :data:`TESTED_VERSIONS`,
:data:`ALLOW_UNTESTED_ENV`, :func:`check_version`, :func:`install`, :func:`dump_rows`, :func:`fork_reward`,
:func:`live_metrics`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Sequence
from typing import Any

import torch

from creditlab.integrations import import_trainer, installed_version

openrlhf = import_trainer("openrlhf")

from creditlab.core import correction
from creditlab.errors import ConfigError, CreditlabError, InputError
from creditlab.integrations import _live
from creditlab.integrations._common import (
    ParsedSpecs,
    cached_fork_reward,
    check_tested_version,
    run_sync,
)

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "CORRECTION_ENV",
    "DUMP_ENV",
    "LIVE_ENV",
    "TESTED_VERSIONS",
    "WRAPPED",
    "check_version",
    "dump_rows",
    "fork_reward",
    "install",
    "live_metrics",
    "parse_correction",
    "rollout_weights",
]

#: OpenRLHF versions this module was tested against (``CREDITLAB_ALLOW_UNTESTED_OPENRLHF=1`` lets another through).
TESTED_VERSIONS = ("0.11.2",)
#: Set to ``1`` to let an untested OpenRLHF version through (:func:`check_version`).
ALLOW_UNTESTED_ENV = "CREDITLAB_ALLOW_UNTESTED_OPENRLHF"
#: ``<arm>[:key=value,...]``: the correction the patched ``PolicyLoss`` applies (unset: OpenRLHF's own loss).
CORRECTION_ENV = "CREDITLAB_OPENRLHF_CORRECTION"
#: Where the patched experience maker writes each batch (a directory: one parquet part per batch; or a
#: ``*.jsonl`` file, appended to). Unset: no dump.
DUMP_ENV = "CREDITLAB_OPENRLHF_DUMP_DIR"
#: Set to ``0`` to turn the live checks off (read at every batch; the same variable as verl's).
LIVE_ENV = "CREDITLAB_LIVE_CHECKS"
#: The OpenRLHF methods :func:`install` wraps.
WRAPPED = ("openrlhf.models.loss.PolicyLoss.forward",
           "openrlhf.trainer.ppo_utils.experience_maker.RemoteExperienceMaker.compute_advantages_and_returns")
_LOSS_SIGNATURE = ("self", "log_probs", "old_log_probs", "advantages", "action_mask", "rollout_log_probs",
                   "dp_size", "batch_num_tokens", "global_batch_size")
_LIVE_WARNINGS = _live.LiveWarnings()


def _openrlhf_version() -> str:
    return installed_version("openrlhf")


def check_version(version: str | None = None) -> str:
    """``version`` (default: the installed OpenRLHF's) when it is in :data:`TESTED_VERSIONS` or
    ``CREDITLAB_ALLOW_UNTESTED_OPENRLHF=1`` is set; otherwise a one-line :class:`CreditlabError` naming it
    (:func:`install` checks it)."""
    found = _openrlhf_version() if version is None else version
    return check_tested_version(__name__, "OpenRLHF", found, TESTED_VERSIONS, ALLOW_UNTESTED_ENV)


# --------------------------------------------------------------------------------------------
# rollout correction through OpenRLHF's PolicyLoss


def parse_correction(spec: str) -> tuple[str, dict[str, float]]:
    """Parse ``<arm>[:key=value,...]`` (the value of ``CREDITLAB_OPENRLHF_CORRECTION``) into the arm and its
    keyword parameters; the arm is looked up in :data:`creditlab.core.correction.CORRECTIONS` now and the
    values are checked on a one-token batch.

    >>> parse_correction("interq:alpha_g=0.3,eps_high=0.05")
    ('interq', {'alpha_g': 0.3, 'eps_high': 0.05})
    >>> parse_correction("tis:cap=3")
    ('tis', {'cap': 3.0})
    """
    return correction.parse_correction(spec, CORRECTION_ENV)


#: :func:`parse_correction` once per spec (OpenRLHF builds its loss with the same one every step)
_parsed = ParsedSpecs(parse_correction)


def rollout_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, action_mask: torch.Tensor,
                    spec: str) -> tuple[torch.Tensor, correction.DeviceMetrics]:
    """The arm's weights ``(B, A)`` (detached, 0 off ``action_mask``) and its metrics (``creditlab/...``, a
    :class:`~creditlab.core.correction.DeviceMetrics`) for one OpenRLHF micro-batch, read nothing on the host:
    NaN/inf log ratios are counted in ``creditlab/correction/nonfinite_tokens`` instead of raising."""
    arm, params = _parsed(spec)
    pm = action_mask.bool()
    w, m = correction.correction_weights(arm, old_log_probs.detach(), rollout_log_probs.detach(), pm, params=params,
                                         check=False, sync=False)
    weights = torch.where(pm, w.to(old_log_probs.dtype), torch.zeros((), dtype=old_log_probs.dtype,
                                                                      device=old_log_probs.device))
    return weights.detach(), correction.DeviceMetrics().add(m, prefix="creditlab/")


def _wrap_forward(original):
    @functools.wraps(original)
    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                batch_num_tokens=None, global_batch_size=None):
        kwargs = {"dp_size": dp_size, "batch_num_tokens": batch_num_tokens, "global_batch_size": global_batch_size}
        spec = os.environ.get(CORRECTION_ENV, "").strip()
        if not spec:
            return original(self, log_probs, old_log_probs, advantages, action_mask=action_mask,
                            rollout_log_probs=rollout_log_probs, **kwargs)
        if self.policy_loss_type != "ppo":
            raise ConfigError("--actor.policy_loss_type", f"{CORRECTION_ENV}={spec!r} needs ppo (the token loss), got "
                                                          f"{self.policy_loss_type!r}")
        if rollout_log_probs is None or action_mask is None:
            raise ConfigError("--algo.advantage.is_correction_level",
                              f"{CORRECTION_ENV}={spec!r} needs vLLM's log-probs, which OpenRLHF collects only with "
                              "its own correction on: set it to token (creditlab's correction replaces it)")
        w, metrics = rollout_weights(old_log_probs, rollout_log_probs, action_mask, spec)
        level = self.is_correction_level
        self.is_correction_level = "off"  # OpenRLHF's loss code, without its own correction
        try:
            weighted = advantages * w.to(advantages.dtype)
            loss, clip_ratio, ppo_kl, _, _ = original(self, log_probs, old_log_probs, weighted, action_mask=action_mask,
                                                      rollout_log_probs=rollout_log_probs, **kwargs)
        finally:
            self.is_correction_level = level
        self.creditlab_metrics = metrics
        pm = action_mask.to(old_log_probs.dtype)
        n = pm.sum().clamp(min=1)
        vllm_kl = ((rollout_log_probs - old_log_probs).detach() * pm).sum() / n
        dropped = ((w == 0) & action_mask.bool()).to(old_log_probs.dtype).sum() / n
        return loss, clip_ratio, ppo_kl, vllm_kl, dropped

    forward.__creditlab_original__ = original
    return forward


# --------------------------------------------------------------------------------------------
# rollout dumps and live checks from Experience objects


def _experiences(batch: Any) -> list[Any]:
    items = list(batch) if isinstance(batch, list | tuple) else [batch]
    if not items:
        raise InputError("experiences: an empty list")
    for e in items:
        if getattr(e, "action_mask", None) is None:
            raise InputError("experience: needs 'action_mask' (the policy mask) to be read")
    return items


def _pad(tensors: Sequence[torch.Tensor], value: float = 0.0) -> torch.Tensor:
    """Right-pad ``(B_i, A_i)`` tensors to the longest and stack their rows."""
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors], 0)


def _groups(e: Any, n_samples_per_prompt: int) -> torch.Tensor:
    index = getattr(e, "index", None)
    B = e.action_mask.shape[0]
    if index is None or len(index) != B:
        raise InputError("experience.index: needs the sample index of each row (set by OpenRLHF's experience maker; "
                         "the group of sample i is i // n_samples_per_prompt)")
    return torch.as_tensor([int(i) for i in index], dtype=torch.long) // int(n_samples_per_prompt)


def _rewards(e: Any) -> torch.Tensor:
    r = getattr(e, "rewards", None)
    if r is None:
        r = (getattr(e, "info", None) or {}).get("reward")
    if r is None:
        raise InputError("experience: needs 'rewards' (or info['reward'])")
    return torch.as_tensor(r).reshape(-1)


def _check_n(n_samples_per_prompt: Any) -> int:
    if isinstance(n_samples_per_prompt, bool) or not isinstance(n_samples_per_prompt, int) or n_samples_per_prompt < 1:
        raise ConfigError("n_samples_per_prompt", f"expected an int >= 1 (--rollout.n_samples_per_prompt), got "
                                                  f"{n_samples_per_prompt!r}")
    return n_samples_per_prompt


def dump_rows(experiences: Any, n_samples_per_prompt: int, step: int = 0) -> list[dict[str, Any]]:
    """Dump rows (docs/diagnose.md) of OpenRLHF ``Experience`` objects (one, or a list: what its
    ``RemoteExperienceMaker`` returns), one per sample.

    The action tensors of an ``Experience`` cover the sequence from its second token (``(B, T - 1)``):
    ``action_mask`` (1 on tokens the policy generated, 0 on the prompt, on environment feedback between
    turns and on padding) is the policy mask, ``action_log_probs`` the learner's log-probs at the sampling
    checkpoint, ``rollout_log_probs`` vLLM's (without both, the rows have no token columns). A row keeps its
    tokens from the first action token to the end of ``attention_mask``. The reward is ``rewards`` (what the
    advantage used; else ``info["reward"]``), the group ``index // n_samples_per_prompt`` (OpenRLHF's own
    grouping), ``truncated`` and the FORK ``precision`` / ``recall`` of :func:`fork_reward` when present.
    """
    from creditlab.diagnose.schema import LEARNER, rows_from_arrays

    n = _check_n(n_samples_per_prompt)
    rows: list[dict[str, Any]] = []
    for e in _experiences(experiences):
        pm = e.action_mask.detach().cpu().bool()
        B, A = pm.shape
        started = torch.cumsum(pm.to(torch.int64), 1) > 0
        att = getattr(e, "attention_mask", None)
        if att is not None and att.shape[1] >= A:
            valid = (att[:, -A:].detach().cpu().bool() & started) | pm
        else:  # up to the last policy token
            last = A - torch.argmax(pm.flip(1).to(torch.int8), dim=1)
            valid = (torch.arange(A)[None, :] < torch.where(pm.any(1), last, 0)[:, None]) & started
        token: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        old, rollout = getattr(e, "action_log_probs", None), getattr(e, "rollout_log_probs", None)
        if old is not None and rollout is not None:
            token = {"logprobs": old.detach().cpu().double(), "rollout_logprobs": rollout.detach().cpu().double(),
                     "policy_mask": pm, "valid_mask": valid}
            extra["logprobs_source"] = [LEARNER] * B
        truncated = getattr(e, "truncated", None)
        if truncated is not None and len(truncated) == B:
            extra["truncated"] = [bool(x) for x in torch.as_tensor(truncated).reshape(-1).tolist()]
        info = getattr(e, "info", None) or {}
        for name in ("precision", "recall"):
            v = info.get(f"fork/{name}")
            if v is not None and len(v) == B:
                extra[name] = [float(x) for x in torch.as_tensor(v).reshape(-1).tolist()]
        rows += rows_from_arrays(step=int(step), group_ids=_groups(e, n).tolist(),
                                 rewards=_rewards(e).detach().cpu().double(), response_length=pm.sum(1), **token,
                                 **extra)
    return rows


def _live_tensors(experiences: list[Any], n: int) -> dict[str, torch.Tensor]:
    pm = _pad([e.action_mask.bool() for e in experiences], value=False)
    dev = pm.device
    groups = torch.cat([_groups(e, n) for e in experiences]).to(dev)
    rewards = torch.cat([_rewards(e).to(dev, torch.float32) for e in experiences])
    old = rollout = None
    if all(getattr(e, "action_log_probs", None) is not None and getattr(e, "rollout_log_probs", None) is not None
           for e in experiences):
        old = _pad([e.action_log_probs.float() for e in experiences])
        rollout = _pad([e.rollout_log_probs.float() for e in experiences])
    return _live.batch_values(old, rollout, pm, group_ids=groups, rewards=rewards)


def live_metrics(experiences: Any, n_samples_per_prompt: int) -> dict[str, float]:
    """The live check values (:mod:`creditlab.integrations._live`) of OpenRLHF ``Experience`` objects (one,
    or a list: a training batch), as ``creditlab/<check>`` floats read in one host read (NaN ones left out).

    The mismatch checks read ``action_log_probs`` (the learner's) and ``rollout_log_probs`` (vLLM's) on
    ``action_mask``; ``baseline/degenerate_groups`` the rewards and the groups ``index //
    n_samples_per_prompt`` (the rows of a list of experiences are taken together: a group may span them).
    """
    n = _check_n(n_samples_per_prompt)
    values = _live.to_floats(_live_tensors(_experiences(experiences), n))
    return {k: v for k, v in values.items() if v == v}


def _wrap_advantages(original):
    @functools.wraps(original)
    def compute_advantages_and_returns(self, experiences, *args, **kwargs):
        out = original(self, experiences, *args, **kwargs)
        step = getattr(self, "_creditlab_step", 0)
        self._creditlab_step = step + 1
        path = os.environ.get(DUMP_ENV, "").strip()
        live = os.environ.get(LIVE_ENV, "1") != "0"
        if not out or not (path or live):
            return out
        n = int(self.strategy.args.rollout.n_samples_per_prompt)
        if path:
            from creditlab.diagnose.schema import write_dump

            write_dump(dump_rows(out, n, step=step), path, append=True)
        if live:
            values = live_metrics(out, n)
            for e in out:  # one value per sample: OpenRLHF splits and merges info tensors by sample
                for key, value in values.items():
                    e.info[key] = torch.full((e.action_mask.shape[0],), value, dtype=torch.float32)
            _LIVE_WARNINGS.observe(values, step=step)
        return out

    compute_advantages_and_returns.__creditlab_original__ = original
    return compute_advantages_and_returns


# --------------------------------------------------------------------------------------------
# install


def _patch(cls: Any, name: str, wrap, expected: tuple[str, ...], where: str) -> None:
    current = cls.__dict__[name]
    if getattr(current, "__creditlab_original__", None) is not None:
        return
    names = tuple(inspect.signature(current).parameters)
    if names[:len(expected)] != expected:
        raise CreditlabError(f"OpenRLHF {_openrlhf_version()}: {where}{names} no longer starts with {expected}; "
                             "creditlab cannot be installed")
    setattr(cls, name, wrap(current))


def install() -> dict[str, tuple[str, ...]]:
    """Patch OpenRLHF's ``PolicyLoss.forward`` and ``RemoteExperienceMaker.compute_advantages_and_returns``
    in this process (after :func:`check_version`; idempotent). Give it to Ray as the job's
    ``worker_process_setup_hook`` (``"creditlab.integrations.openrlhf.install"``) so that it runs in every
    OpenRLHF actor. Imports both OpenRLHF modules (the loss module imports deepspeed, as OpenRLHF does).

    Returns ``{"CREDITLAB_OPENRLHF_CORRECTION": the arms it takes, "wrapped": the methods wrapped}``
    (:data:`WRAPPED`).
    """
    check_version()
    loss = importlib.import_module("openrlhf.models.loss")
    maker = importlib.import_module("openrlhf.trainer.ppo_utils.experience_maker")
    _patch(loss.PolicyLoss, "forward", _wrap_forward, _LOSS_SIGNATURE, "PolicyLoss.forward")
    _patch(maker.RemoteExperienceMaker, "compute_advantages_and_returns", _wrap_advantages, ("self", "experiences"),
           "RemoteExperienceMaker.compute_advantages_and_returns")
    return {CORRECTION_ENV: tuple(correction.CORRECTIONS), "wrapped": WRAPPED}


# --------------------------------------------------------------------------------------------
# FORK as OpenRLHF's reward_func


def fork_reward(judge: str = "offline", **options: Any):
    """OpenRLHF's ``reward_func(queries, prompts, labels)`` computing FORK; put it in the file given to
    ``--reward.remote_url`` (OpenRLHF passes no options to it, so the judge options go here)::

        from creditlab.integrations.openrlhf import fork_reward
        reward_func = fork_reward("openai", base_url="http://judge:8000/v1", model="judge")

    ``options`` are those of :func:`creditlab.integrations._common.cached_fork_reward` (``base_url``,
    ``model``, ``beta``, ``tau``, ``mode``...). Each query is the prompt followed by the response (OpenRLHF
    decodes the whole sequence): the response is the query after its prompt. The rubrics are the label (the
    dataset field ``--data.label_key``: a list of ``{"criterion", "points"}`` records, or its JSON text).
    Returns ``{"rewards", "scores", "extra_logs": {"fork/precision", "fork/recall"}}`` (tensors, one value
    per query). A query that does not start with its prompt, or a judge failure, raises
    :class:`CreditlabError` naming the sample: never a score of 0 (OpenRLHF's executor then logs
    ``Failed to fetch reward`` and the sample has no reward).
    """
    reward = cached_fork_reward(judge, **options)

    def reward_func(queries: Sequence[str], prompts: Sequence[Any], labels: Sequence[Any]) -> dict[str, Any]:
        from creditlab.rewards.items import ForkItem, parse_rubrics, render_messages

        if not (len(queries) == len(prompts) == len(labels)):
            raise InputError(f"reward_func: {len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels")
        items = []
        for k, (query, prompt, label) in enumerate(zip(queries, prompts, labels, strict=True)):
            where = f"sample {k}"
            text = render_messages(prompt, where, "prompt")
            if not str(query).startswith(text):
                raise CreditlabError(f"FORK reward of {where}: the query does not start with its prompt (OpenRLHF "
                                     "passes prompt + response); cannot tell the response apart")
            items.append(ForkItem(str(k), text, str(query)[len(text):], parse_rubrics(label, where, "label")))
        results = run_sync(reward.score(items))
        failed = [(k, r) for k, r in enumerate(results) if r.reward is None]
        if failed:
            k, r = failed[0]
            raise CreditlabError(f"FORK reward of sample {k}: {r.error}")
        scores = torch.tensor([float(r.reward) for r in results], dtype=torch.float32)
        return {"rewards": scores, "scores": scores.clone(),
                "extra_logs": {"fork/precision": torch.tensor([float(r.precision) for r in results]),
                               "fork/recall": torch.tensor([float(r.recall) for r in results])}}

    reward_func.fork_reward = reward
    return reward_func
