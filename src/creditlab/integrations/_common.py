"""Pieces shared by the integrations (no trainer library is imported here).

* :class:`TurnLayout`: the turns of a ``(B, L)`` token batch (a turn is a maximal run of policy
  tokens, i.e. of 1s in verl's ``response_mask`` or in TRL's ``completion_mask * tool_mask``),
  and the two ways a per-token reward tensor maps onto turns (span sums, first-token values).
* :func:`turn_credit`: any credit geometry registered in :data:`creditlab.core.credit.GEOMETRIES`
  (uniform, per_turn, ..., PRM mixing) on a ``(B, T)`` turn tensor, with its parameters taken from
  :class:`CreditSettings`.
* :func:`cached_fork_reward`: one cached :class:`~creditlab.rewards.fork.FORKReward` per judge config, and
  :class:`MicroBatcher`, which coalesces concurrent single-sample calls into one batched
  ``FORKReward.score`` call (verl calls its reward function once per sample, concurrently).
* :func:`check_tested_version`: the ``check_version`` of the integration contract
  (:data:`creditlab.integrations.CONTRACT`).
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from creditlab.core import correction, credit
from creditlab.core._checks import check_scalar, check_tensor
from creditlab.core.masks import Segments, segments
from creditlab.core.schedules import SCHEDULES, Schedule
from creditlab.errors import ConfigError, CreditlabError, InputError

__all__ = [
    "run_sync",
    "ParsedSpecs",
    "BatcherCache",
    "CreditSettings",
    "MicroBatcher",
    "TurnLayout",
    "cached_fork_reward",
    "check_tested_version",
    "group_ids",
    "token_reward_advantages",
    "turn_credit",
    "turn_layout",
]

# --------------------------------------------------------------------------------------------
# turns


class TurnLayout(NamedTuple):
    """Turn structure of a ``(B, L)`` token batch.

    Attributes:
        seg: :class:`~creditlab.core.masks.Segments` of the policy mask (``seg.turn_index`` is the
            turn of each policy token, -1 elsewhere).
        span: ``(B, L)`` int64 turn whose *span* holds each position: a turn's span runs from its
            first token up to the token before the next turn starts (so it includes the tool /
            observation tokens that follow it); positions before the first turn belong to turn 0.
        first: ``(B, L)`` bool, the first token of each turn.
        step_mask: ``(B, T)`` bool, True on the turns a row really has (``T`` = most turns of a row,
            at least 1).
        tail: ``(B, L)`` bool, the last policy token of each row and every position after it (the
            whole row when it has no policy token): where a trainer puts a trajectory's final score.
    """

    seg: Segments
    span: torch.Tensor
    first: torch.Tensor
    step_mask: torch.Tensor
    tail: torch.Tensor

    @property
    def num_turns(self) -> int:
        return self.step_mask.shape[1]

    def span_sums(self, values: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` sum of ``(B, L)`` ``values`` over each turn's span (all positions count)."""
        out = torch.zeros(self.step_mask.shape, dtype=values.dtype, device=values.device)
        return out.scatter_add_(1, self.span, values)

    def first_values(self, values: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` value of ``(B, L)`` ``values`` at the first token of each turn (0 elsewhere)."""
        out = torch.zeros(self.step_mask.shape, dtype=values.dtype, device=values.device)
        return out.scatter_add_(1, self.span, torch.where(self.first, values, torch.zeros_like(values)))

    def to_tokens(self, step_values: torch.Tensor) -> torch.Tensor:
        """``(B, L)`` with each policy token carrying its turn's value of ``(B, T)`` ``step_values``
        (0 on non-policy tokens)."""
        idx = self.seg.turn_index.clamp_min(0)
        out = torch.gather(step_values, 1, idx)
        return torch.where(self.seg.policy, out, torch.zeros_like(out))


def turn_layout(policy_mask: torch.Tensor) -> TurnLayout:
    """The :class:`TurnLayout` of a ``(B, L)`` bool policy mask.

    >>> lay = turn_layout(torch.tensor([[True, True, False, True, False], [True, False, False, False, False]]))
    >>> lay.span.tolist(), lay.step_mask.tolist(), lay.tail.tolist()[0]
    ([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]], [[True, True], [True, False]], [False, False, False, True, True])
    """
    check_tensor("policy_mask", policy_mask, ndim=2, boolean=True)
    seg = segments(policy_mask)
    B, L = policy_mask.shape
    first = policy_mask.clone()
    if L > 1:
        first[:, 1:] &= ~policy_mask[:, :-1]
    span = (torch.cumsum(first, dim=1) - 1).clamp_min(0)
    T = max(int(seg.n_segments.max().item()) if B else 0, 1)
    step_mask = torch.arange(T, device=policy_mask.device)[None, :] < seg.n_segments[:, None]
    # positions from the last policy token on: no policy token strictly after them
    pm64 = policy_mask.to(torch.int64)
    tail = (torch.flip(torch.cumsum(torch.flip(pm64, [1]), 1), [1]) - pm64) == 0
    return TurnLayout(seg, span, first, step_mask, tail)


# --------------------------------------------------------------------------------------------
# credit geometries on turns


@dataclass(frozen=True)
class CreditSettings:
    """Knobs of :func:`turn_credit` (the same names are the keys of the trainer configs)."""

    conserve: bool = False
    """Rescale each rollout so ``sum_t |a[i,t]| = |A_i|`` (equal total credit for every geometry).
    False (default): GRPO scale, e.g. ``uniform`` puts ``A_i`` on every turn."""
    eps: float = 1e-6
    """Added to the group standard deviation of GRPO advantages."""
    threshold: float = 1.0
    """``binary``: success is ``R_i >= threshold``."""
    levels: tuple[float, ...] = (0.0, 0.5, 1.0)
    """``discretized``: the outcome is rounded to the nearest level."""
    seed: int = 0
    """``shuffled`` / ``random_k``: seed of the random keys (combined with the training step)."""
    k: int = 1
    """``random_k``: steps credited per rollout."""
    prm_lambda: float = 0.5
    """``prm``: the mixing weight ``lambda`` (``l0`` of the schedule)."""
    prm_schedule: str = "constant"
    """``prm``: ``constant`` or ``decay`` (``l0`` until ``prm_start``, then ``l0 (1-s)^prm_power`` to 0 at
    ``prm_end``), evaluated at the trainer's global step."""
    prm_start: float = 20
    """``prm`` decay: first step of the decay."""
    prm_end: float = 30
    """``prm`` decay: step from which lambda is 0."""
    prm_power: float = 3
    """``prm`` decay: exponent of the decay."""

    @classmethod
    def from_mapping(cls, mapping: Any, where: str) -> CreditSettings:
        """Build from a dict-like config section; unknown keys raise :class:`ConfigError`."""
        if mapping is None:
            return cls()
        items = dict(mapping.items())
        valid = [f for f in cls.__dataclass_fields__]
        unknown = sorted(set(items) - set(valid))
        if unknown:
            raise ConfigError(where, f"unknown key(s) {unknown}; valid: {', '.join(valid)}")
        if "levels" in items:
            items["levels"] = tuple(float(v) for v in items["levels"])
        if "conserve" in items and not isinstance(items["conserve"], bool):
            raise ConfigError(f"{where}.conserve", f"must be true or false, got {items['conserve']!r}")
        out = cls(**items)
        if out.prm_schedule not in SCHEDULES:
            raise ConfigError(f"{where}.prm_schedule", f"unknown {out.prm_schedule!r}; valid: {', '.join(SCHEDULES)}")
        out.schedule()  # validates the schedule parameters
        return out

    def schedule(self) -> Schedule:
        """The ``prm`` weight as the :class:`~creditlab.core.schedules.Schedule` record the labs hold too
        (kind ``prm_schedule`` of :data:`~creditlab.core.schedules.SCHEDULES`), evaluated at the step."""
        return Schedule(self.prm_schedule, self.prm_lambda, self.prm_start, self.prm_end, self.prm_power)


def group_ids(index: Any, what: str) -> torch.Tensor:
    """``(B,)`` int64 group labels from a trainer's per-row group keys (``index``: uids of any type);
    ``what`` names them in the error when they are missing (e.g. "verl's 'uid'")."""
    if index is None:
        raise ConfigError("index", f"creditlab estimators group rollouts by {what} (index), which is missing")
    _, inverse = np.unique(np.asarray(index, dtype=object).astype(str), return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long)


def token_reward_advantages(geometry: str, token_level_rewards: torch.Tensor, policy_mask: torch.Tensor,
                            group: torch.Tensor, *, step: int | None, settings: CreditSettings) -> torch.Tensor:
    """Token advantages ``(B, L)`` of a credit geometry from a trainer's token-level rewards.

    The outcome of a row is the sum of its token rewards (for ``prm``: the reward on its last policy
    token and after, :attr:`TurnLayout.tail`, while the rewards inside each turn's span are that turn's
    process score); the per-turn credit of :func:`turn_credit` is broadcast to each turn's tokens.
    ``group`` ``(B,)``: :func:`group_ids`. No gradient.
    """
    with torch.no_grad():
        r = token_level_rewards.to(torch.float32)
        lay = turn_layout(policy_mask)
        gid = group.to(r.device)
        if gid.shape[0] != r.shape[0]:
            raise InputError(f"index: {gid.shape[0]} uids for {r.shape[0]} rows")
        if geometry == "prm":
            tail = lay.tail.to(r.dtype)
            scores = lay.span_sums(r * (1 - tail))
            outcome = (r * tail).sum(dim=1)
        else:
            scores = lay.span_sums(r)
            outcome = r.sum(dim=1)
        a = turn_credit(geometry, lay.step_mask, gid, rewards=outcome, step_scores=scores, step=step,
                        settings=settings)
        return lay.to_tokens(a.to(torch.float32)).to(token_level_rewards.dtype)


def turn_credit(
    geometry: str,
    step_mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    advantages: torch.Tensor | None = None,
    rewards: torch.Tensor | None = None,
    step_scores: torch.Tensor | None = None,
    step: int | None = None,
    settings: CreditSettings = CreditSettings(),
) -> torch.Tensor:
    """Per-turn credit ``(B, T)`` of the geometry registered as ``geometry``.

    Args:
        geometry: a name in :data:`creditlab.core.credit.GEOMETRIES` (looked up at call time;
            unknown: :class:`ConfigError` listing the registered ones).
        step_mask: ``(B, T)`` bool real turns.
        group_ids: ``(B,)`` integer group labels.
        advantages: ``(B,)`` outcome advantage ``A_i``; the GRPO advantage of ``rewards`` when None.
        rewards: ``(B,)`` outcome reward ``R_i`` (needed by ``binary`` / ``discretized``, and when
            ``advantages`` is None).
        step_scores: ``(B, T)`` per-turn score: progress ``dS`` for ``per_turn`` (must be >= 0),
            selection ``score > 0`` for ``concentrated`` and ``shuffled`` (which permutes the
            ``per_turn`` credit), process score for ``prm``, step reward for ``reward_to_go``, local
            signal for ``targeted`` (every turn exposed).
        step: the trainer's update index (``prm`` schedule, seed of the random keys).
        settings: :class:`CreditSettings`: ``conserve``, and each geometry parameter
            (:func:`~creditlab.core.credit.geometry_params`) that is a field of the settings;
            ``lam`` is ``settings.schedule()`` at ``step``. The random keys of ``shuffled`` /
            ``random_k`` come from ``seed * 1_000_003 + step``.
    """
    s = settings
    fn = credit.get_geometry(geometry)
    needs = credit.geometry_needs(geometry)
    if "step_scores" in needs and step_scores is None:
        raise InputError(f"step_scores: geometry {geometry!r} needs a per-turn score")
    if "rewards" in needs and rewards is None:
        raise InputError(f"rewards: geometry {geometry!r} needs the outcome rewards")
    if "advantages" in needs and advantages is None and rewards is None:
        raise InputError("advantages: pass the outcome advantages or the outcome rewards")
    params: dict[str, Any] = {}
    for name in credit.geometry_params(geometry):
        if name == "lam":
            if s.prm_schedule == "decay" and (step is None or step < 0):
                raise ConfigError("prm_schedule",
                                  "the decay schedule needs the trainer's global step, which is not set")
            params["lam"] = s.schedule()(max(int(step or 0), 0))
        elif name in _SETTING_PARAMS:
            params[name] = getattr(s, name)
    gen = torch.Generator().manual_seed(int(s.seed) * 1_000_003 + max(int(step or 0), 0))
    keys = torch.rand(step_mask.shape, generator=gen, dtype=torch.float64).to(step_mask.device)
    batch = credit.StepBatch(step_mask, group_ids, advantages=advantages, rewards=rewards, step_scores=step_scores,
                             keys=keys)
    return fn(batch, conserve=s.conserve, **params)


_SETTING_PARAMS = frozenset(f for f in CreditSettings.__dataclass_fields__ if f not in ("conserve", "seed"))


# --------------------------------------------------------------------------------------------
# version check


def check_tested_version(module: str, trainer: str, found: str, tested: tuple[str, ...], env: str) -> str:
    """``found`` when it is in ``tested`` or the environment variable ``env`` is ``1``; otherwise a
    :class:`CreditlabError` of one line naming ``found``, the tested versions and ``env`` (``module``: the
    integration, ``trainer``: the trainer's name as users write it)."""
    if found not in tested and os.environ.get(env) != "1":
        raise CreditlabError(f"{module} was tested with {trainer} {', '.join(tested)}, found {found}: install a "
                             f"tested version, or set {env}=1 to try anyway")
    return found


# --------------------------------------------------------------------------------------------
# FORK judge construction and micro-batching


_REWARDS: dict[tuple, Any] = {}
_REWARDS_LOCK = threading.Lock()


def cached_fork_reward(judge: str = "offline", *, base_url: str | None = None, model: str | None = None,
                api_key_env: str = "OPENAI_API_KEY", concurrency: int = 16, timeout: float = 60.0,
                max_retries: int = 4, beta: float | None = None, tau: str | float = "judge", mode: str = "fork",
                assume_correct: bool = False, match_threshold: float = 0.55, offline_tau: float = 0.75,
                cache_path: str | None = None):
    """A :class:`~creditlab.rewards.fork.FORKReward` for a judge described by plain values, built once
    per process and configuration (trainer configs carry strings and numbers, not objects).

    ``judge="openai"``: :class:`~creditlab.judge.openai_compat.OpenAIJudge` at ``base_url`` serving
    ``model`` (key read from the environment variable ``api_key_env``). ``judge="offline"``: the
    embedding judge, which cannot judge correctness, so ``assume_correct=True`` is required.
    """
    key = (judge, base_url, model, api_key_env, concurrency, timeout, max_retries, beta, str(tau), mode,
           assume_correct, match_threshold, offline_tau, cache_path)
    with _REWARDS_LOCK:
        if key in _REWARDS:
            return _REWARDS[key]
        from creditlab.rewards.fork import FORKReward

        if judge == "openai":
            from creditlab.judge.openai_compat import OpenAIJudge

            if not base_url or not model:
                raise ConfigError("base_url", "judge 'openai' needs base_url and model")
            cache = None
            if cache_path:
                from creditlab.judge.cache import JudgeCache

                cache = JudgeCache(cache_path)
            j = OpenAIJudge(base_url, model, api_key=os.environ.get(api_key_env), concurrency=concurrency,
                            timeout=timeout, max_retries=max_retries, cache=cache)
        elif judge == "offline":
            from creditlab.judge.offline import EmbeddingJudge

            j = EmbeddingJudge(match_threshold=match_threshold, tau=offline_tau)
        else:
            raise ConfigError("judge", f"unknown judge {judge!r}; valid: openai, offline")
        reward = FORKReward(j, beta=beta, tau=tau, mode=mode, assume_correct=assume_correct)
        _REWARDS[key] = reward
        return reward


class MicroBatcher:
    """Coalesce concurrent single-item requests into batched calls of ``fn(items) -> results``.

    The first request of a batch waits at most ``max_wait_s`` for others to join; a batch is sent
    at once when it reaches ``max_batch`` items. One batcher serves one event loop (verl runs each
    reward worker's samples as concurrent tasks of one loop).
    """

    def __init__(self, fn, *, max_batch: int = 64, max_wait_s: float = 0.05):
        check_scalar("max_batch", max_batch, low=1)
        check_scalar("max_wait_s", max_wait_s, low=0.0)
        self.fn = fn
        self.max_batch = int(max_batch)
        self.max_wait_s = float(max_wait_s)
        self.batches: list[int] = []  # sizes of the batches sent (for logs and tests)
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    async def submit(self, item: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((item, fut))
        if len(self._pending) >= self.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.max_wait_s, self._flush)
        return await fut

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if not batch:
            return
        self.batches.append(len(batch))
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[Any, asyncio.Future]]) -> None:
        try:
            results = await self.fn([item for item, _ in batch])
        except BaseException as err:  # every waiter sees the failure
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(err)
            return
        for (_, fut), res in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(res)


class BatcherCache:
    """One :class:`MicroBatcher` per event loop and key, forgotten when its event loop is garbage collected.

    Keyed weakly by the loop: a process that runs many short-lived loops (``asyncio.run`` per batch)
    does not accumulate batchers, and a batcher never outlives the loop its futures belong to.
    """

    def __init__(self) -> None:
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, MicroBatcher]] = (
            weakref.WeakKeyDictionary())
        self._lock = threading.Lock()

    def get(self, loop: asyncio.AbstractEventLoop, key: Any, make: Callable[[], MicroBatcher]) -> MicroBatcher:
        """The batcher of ``(loop, key)``, made with ``make()`` the first time."""
        with self._lock:
            per_loop = self._by_loop.setdefault(loop, {})
            batcher = per_loop.get(key)
            if batcher is None:
                batcher = per_loop[key] = make()
            return batcher

    def values(self) -> list[MicroBatcher]:
        """Every batcher of a live loop (for logs and tests)."""
        with self._lock:
            return [b for per_loop in list(self._by_loop.values()) for b in per_loop.values()]

    def __len__(self) -> int:
        return len(self.values())


# --------------------------------------------------------------------------------------------
# correction arms named in a trainer's config


class ParsedSpecs:
    """``parse(spec)`` once per spec (again only if its arm was registered anew since): trainers call with the
    same spec every micro-batch, and the check on a one-token batch need not run each time."""

    def __init__(self, parse: Callable[[str], tuple[str, dict[str, float]]]):
        self.parse = parse
        self._seen: dict[str, tuple[str, dict[str, float], Any]] = {}

    def __call__(self, spec: str) -> tuple[str, dict[str, float]]:
        hit = self._seen.get(spec) if isinstance(spec, str) else None
        if hit is not None and correction.CORRECTIONS.get(hit[0], None) is hit[2]:
            return hit[0], dict(hit[1])
        arm, params = self.parse(spec)
        self._seen[spec] = (arm, dict(params), correction.CORRECTIONS[arm])
        return arm, params


def run_sync(coro):
    """Run ``coro`` to completion from synchronous code, also where an event loop is already running (a
    trainer calling a reward function from async code or from a thread): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as err:  # re-raised in the caller
            box["error"] = err

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
