"""The toolshop rollout engine: batched multi-turn sampling, learner log-probs, evaluation, turn helpers.

Rollout (:func:`rollout`). All trajectories of a batch advance in lock step, one token position per
model call, through :meth:`creditlab.models.tiny_lm.TinyLM.step` with a KV cache in the *engine*
precision. At each position a trajectory either consumes a forced token (its prompt or the
environment's observation, queued) or samples one from the policy; when it samples ``EOA`` (or its
action reaches ``max_action_len`` tokens) the action goes to its :class:`ToolshopEnv` and the
observation is queued. Because every trajectory sits at the same position, the learner's
full-sequence forward over the padded batch (:func:`sequence_logprobs`) computes exactly the same
function (tested).

Alignment: ``rollout_logprobs[b, t]`` and ``logprobs[b, t]`` are the log-probabilities of token
``tokens[b, t]`` given ``tokens[b, :t]``; ``policy_mask[b, t]`` is True on sampled tokens.

Tasks: :func:`make_tasks` builds one task per seed; held-out evaluation (:func:`evaluate`) uses the
seeds from :data:`EVAL_SEED_OFFSET` on, training tasks are drawn below it.

Stacked rollout (:func:`rollout_stacked`): the same engine for ``M`` models at once
(:class:`creditlab.models.tiny_lm.StackedTinyLM`), one batch of tasks per model, in lock step over
all ``M x B`` trajectories, with the bookkeeping vectorised (Python runs only for the trajectories
whose action ended at that position). It samples by inversion of the CDF from uniforms given by the
caller, so models that get the same uniforms see common random numbers: two nearly equal policies
draw nearly the same trajectories, which is what paired comparisons between arms need.

Turn helpers: a :class:`RolloutBatch` knows which turn each token belongs to, so per-turn values
``(B, T)`` go to tokens with :func:`turns_to_tokens`; :func:`turn_mask_of` (the turns taken),
:func:`turn_progress_deltas` (the verifier's progress change per turn) and :func:`successful_read_scores`
(a deliberately hackable process score) feed the advantages of :mod:`creditlab.train.toolshop_grpo`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from creditlab.envs.toolshop import EOA, PAD, SPECIALS, THOUGHT0, Task, ToolshopEnv, TurnRecord, make_task, verify
from creditlab.errors import ConfigError
from creditlab.models.quant import EngineFormat
from creditlab.models.tiny_lm import KVCache, StackedKVCache, StackedTinyLM, TinyLM

__all__ = [
    "EVAL_SEED_OFFSET",
    "RolloutBatch",
    "evaluate",
    "StackedRollout",
    "make_tasks",
    "planted_direction",
    "rollout",
    "rollout_stacked",
    "sequence_logprobs",
    "stacked_logprobs",
    "successful_read_scores",
    "turn_mask_of",
    "turn_progress_deltas",
    "turns_to_tokens",
]

EVAL_SEED_OFFSET = 5_000_000  # evaluation tasks; training tasks are drawn below this
#: Seed of the fixed direction of the planted engine's logit shift (:func:`planted_direction`).
PLANT_SEED = 20261205


def planted_direction(vocab_size: int) -> torch.Tensor:
    """The fixed direction ``z`` ``(vocab_size,)`` of the planted engine (``plant`` of :func:`rollout`):
    independent standard normal values on the tool-call tokens (every token of the toolshop vocabulary
    that is neither a special token, ``EOA`` included, nor a thought), 0 on the others, drawn once from
    :data:`PLANT_SEED`. The planted engine samples turn ``k`` (0-based) of a trajectory from
    ``softmax(logits + s (k + 1) z)`` at strength ``s``: it changes which call the engine writes (a
    shift common to all call tokens would change nothing), more at every later turn, and leaves
    thoughts, ``EOA`` and forced tokens alone. Its log-probs are what the engine reports, so
    the behaviour policy ``mu`` of a planted batch is known exactly."""
    z = torch.randn(vocab_size, generator=torch.Generator().manual_seed(PLANT_SEED), dtype=torch.float64)
    keep = torch.zeros(vocab_size, dtype=torch.bool)
    keep[len(SPECIALS):min(THOUGHT0, vocab_size)] = True
    return (z * keep).float()


@dataclass
class RolloutBatch:
    """A batch of ``B`` multi-turn trajectories padded to ``L`` tokens.

    ``turn_ids``: the turn each token belongs to (action and its observation), -1 on the prompt and
    padding. ``records[b]``: the per-turn :class:`TurnRecord` list (tool, arguments, returned values,
    is_write). ``success``/``progress``: the terminal verifier's outcome and field-level score.
    """

    tokens: torch.Tensor            # (B, L) long
    policy_mask: torch.Tensor       # (B, L) bool
    valid_mask: torch.Tensor        # (B, L) bool
    rollout_logprobs: torch.Tensor  # (B, L) float, 0 off policy tokens
    turn_ids: torch.Tensor          # (B, L) long
    records: list[list[TurnRecord]]
    success: torch.Tensor           # (B,) float 0/1
    progress: torch.Tensor          # (B,) float in [0, 1]
    truncated: torch.Tensor         # (B,) bool: ended by the action budget or max_len, no write
    n_calls: torch.Tensor           # (B,) long: tool calls (turns)
    tasks: list[Task]
    group_ids: torch.Tensor         # (B,) long
    entropy: torch.Tensor | None = None  # (B, L) float: the engine's entropy at sampled tokens, 0 elsewhere

    def __len__(self) -> int:
        return self.tokens.size(0)

    @property
    def n_turns_max(self) -> int:
        return int(self.n_calls.max().item()) if len(self) else 0


def make_tasks(seeds: Sequence[int], chain_lengths: Sequence[int]) -> list[Task]:
    """One task per seed; the chain length cycles through ``chain_lengths`` (seeded choice). The code
    :data:`~creditlab.envs.toolshop.MULTI_EXCHANGE` in ``chain_lengths`` stands for a multi-exchange
    task (:func:`~creditlab.envs.toolshop.make_multi_task`)."""
    from creditlab.envs.toolshop import MULTI_EXCHANGE, make_multi_task

    out = []
    for s in seeds:
        C = chain_lengths[random.Random(s).randrange(len(chain_lengths))]
        out.append(make_multi_task(s) if C == MULTI_EXCHANGE else make_task(s, C))
    return out


# ----------------------------------------------------------------------------------------------
# The lock-step decode engine of rollout and rollout_stacked
# ----------------------------------------------------------------------------------------------


@dataclass
class _Draw:
    """Tokens sampled for some rows at one position and their log-probabilities under the engine."""

    tokens: np.ndarray    # (n,) int64
    logprobs: np.ndarray  # (n,) float32
    entropy: np.ndarray | None = None  # (n,) float32: the engine distribution's entropy (nats)


def _multinomial_draw(logits: torch.Tensor, rows: np.ndarray, temperature: float,
                      generator: torch.Generator | None) -> _Draw:
    """Sample the rows ``rows`` of ``logits`` ``(B, V)`` with ``torch.multinomial`` (:func:`rollout`)."""
    lp = torch.log_softmax(logits / temperature, dim=-1)
    idx = torch.as_tensor(rows)
    p = lp[idx].exp()
    draw = torch.multinomial(p, 1, generator=generator).squeeze(1)
    return _Draw(tokens=draw.numpy(), logprobs=lp[idx, draw].numpy(), entropy=-(p * lp[idx]).sum(-1).numpy())


def _inverse_cdf_draw(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float) -> _Draw:
    """One token per row of ``logits`` ``(n, V)``: the first whose cumulative probability exceeds
    ``uniforms`` ``(n,)`` (float64) times the total (:func:`rollout_stacked`)."""
    lp = torch.log_softmax(logits / temperature, dim=-1)
    p = lp.exp()
    cdf = p.to(torch.float64).cumsum(-1)
    u = uniforms * cdf[:, -1]
    draw = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp(max=cdf.size(1) - 1)
    return _Draw(tokens=draw.numpy(), logprobs=lp.gather(1, draw[:, None]).squeeze(1).numpy(),
                 entropy=-(p * lp).sum(-1).numpy())


@dataclass
class _Outcome:
    """The terminal verifier's outcome of one episode."""

    success: float
    progress: float

    @classmethod
    def of(cls, env: ToolshopEnv) -> _Outcome:
        ok, progress = env.result()
        return cls(success=float(ok), progress=progress)


@dataclass
class _Rows:
    """The per-row state of a lock-step decode of ``R`` trajectories over ``max_len`` positions.

    ``tokens``/``policy``/``valid``/``turn``/``logp`` ``(R, max_len)``: the batch being written (the
    fields of :class:`RolloutBatch`). ``qbuf[r, qhead[r]:qhead[r] + qlen[r]]``: the forced tokens row
    ``r`` still has to feed (its prompt, then each observation); ``abuf[r, :alen[r]]``: its action so
    far; ``nrec[r]``: the turns it took; ``done[r]``: its episode is over; ``finished[r]``: ... and its
    last observation was fed. ``live``: the engine's batch, the global row of each slot (``(B,)``, or
    ``(M, B)`` for a stacked model, narrower after :meth:`compact`); ``pos[r]``: the flat slot of row
    ``r`` in it (valid while the row runs). ``decode_steps``/``decode_rows``: the model calls and the
    rows they computed.
    """

    envs: list[ToolshopEnv]
    max_action_len: int
    tokens: np.ndarray     # (R, max_len) int64
    policy: np.ndarray     # (R, max_len) bool
    valid: np.ndarray      # (R, max_len) bool
    turn: np.ndarray       # (R, max_len) int64
    logp: np.ndarray       # (R, max_len) float32
    qbuf: np.ndarray       # (R, >= 64) int64, widened for a longer observation
    qhead: np.ndarray      # (R,) int64
    qlen: np.ndarray       # (R,) int64
    abuf: np.ndarray       # (R, max_action_len) int64
    alen: np.ndarray       # (R,) int64
    nrec: np.ndarray       # (R,) int64
    done: np.ndarray       # (R,) bool
    finished: np.ndarray   # (R,) bool
    live: np.ndarray       # (B,) or (M, W) int64
    pos: np.ndarray        # (R,) int64
    ent: np.ndarray | None = None  # (R, max_len) float32: the engine's entropy where a token was sampled
    plant: np.ndarray | None = None  # (R,) float64: the planted engine's strength of each row (None: no plant)
    decode_steps: int = 0
    decode_rows: int = 0

    @classmethod
    def start(cls, envs: list[ToolshopEnv], max_len: int, max_action_len: int, shape: tuple[int, ...]) -> _Rows:
        """Reset every environment: the first prompt token at position 0, the rest queued; ``shape``
        the engine's batch, ``(B,)`` or ``(M, B)``."""
        R = len(envs)
        prompts = [env.reset() for env in envs]
        qbuf = np.zeros((R, max(64, max((len(p) for p in prompts), default=0))), dtype=np.int64)
        qlen = np.zeros(R, dtype=np.int64)
        tokens = np.full((R, max_len), PAD, dtype=np.int64)
        for r, p in enumerate(prompts):
            tokens[r, 0] = p[0]
            qbuf[r, :len(p) - 1] = p[1:]
            qlen[r] = len(p) - 1
        valid = np.zeros((R, max_len), dtype=bool)
        valid[:, 0] = True
        return cls(envs=envs, max_action_len=max_action_len, tokens=tokens, policy=np.zeros((R, max_len), dtype=bool),
                   valid=valid, turn=np.full((R, max_len), -1, dtype=np.int64),
                   logp=np.zeros((R, max_len), dtype=np.float32), qbuf=qbuf, qhead=np.zeros(R, dtype=np.int64),
                   qlen=qlen, abuf=np.zeros((R, max(max_action_len, 1)), dtype=np.int64),
                   alen=np.zeros(R, dtype=np.int64), nrec=np.zeros(R, dtype=np.int64), done=np.zeros(R, dtype=bool),
                   finished=np.zeros(R, dtype=bool), live=np.arange(R).reshape(shape), pos=np.arange(R),
                   ent=np.zeros((R, max_len), dtype=np.float32))

    def engine_logits(self, model: TinyLM | StackedTinyLM, cache: KVCache | StackedKVCache, t: int) -> torch.Tensor:
        """Feed position ``t`` of the engine's batch: the next-token logits ``(live.size, V)`` (fp32) of
        its slots, the distribution of position ``t + 1``."""
        logits = model.step(torch.as_tensor(self.tokens[self.live, t]), cache).float()
        self.decode_steps += 1
        self.decode_rows += self.live.size
        logits = logits.view(self.live.size, logits.size(-1))
        if self.plant is not None:
            rows = self.live.reshape(-1)
            scale = self.plant[rows] * (self.nrec[rows] + 1)  # the turn a row samples is nrec (0-based)
            on = np.flatnonzero(scale != 0)
            if on.size:
                z = planted_direction(logits.size(-1))
                idx = torch.as_tensor(on)
                logits[idx] = logits[idx] + torch.as_tensor(scale[on], dtype=torch.float32)[:, None] * z
        return logits

    def to_sample(self) -> np.ndarray:
        """The rows that sample their next token from the policy: running, with no forced token queued."""
        return np.flatnonzero(~self.finished & (self.qlen == 0))

    def take_draw(self, t: int, rows: np.ndarray, draw: _Draw) -> None:
        """Write the tokens ``rows`` sampled at position ``t + 1``; an action that ended (``EOA``, or
        ``max_action_len`` tokens) goes to its environment."""
        self.tokens[rows, t + 1] = draw.tokens
        self.policy[rows, t + 1] = self.valid[rows, t + 1] = True
        self.logp[rows, t + 1] = draw.logprobs
        if draw.entropy is not None:
            self.ent[rows, t + 1] = draw.entropy
        self.turn[rows, t + 1] = self.nrec[rows]
        self.abuf[rows, self.alen[rows]] = draw.tokens
        self.alen[rows] += 1
        for r in rows[(draw.tokens == EOA) | (self.alen[rows] >= self.max_action_len)]:
            self._act(r)

    def _act(self, r: int) -> None:
        """Row ``r``'s action to its environment; the observation is queued."""
        res = self.envs[r].step(self.abuf[r, :self.alen[r]].tolist())
        self.alen[r] = 0
        obs = res.observation
        if len(obs) > self.qbuf.shape[1]:
            self.qbuf = np.concatenate([self.qbuf, np.zeros((len(self.envs), len(obs)), dtype=np.int64)], axis=1)
        self.qbuf[r, :len(obs)] = obs
        self.qhead[r], self.qlen[r] = 0, len(obs)
        self.nrec[r] += 1
        self.done[r] = res.done

    def feed_forced(self, t: int) -> None:
        """Position ``t + 1`` of the running rows that did not sample it: their next queued token (the
        prompt's, or the last observation's); a row whose episode is over finishes with its queue."""
        idx = np.flatnonzero(~self.finished & (self.qlen > 0) & ~self.policy[:, t + 1])
        if not idx.size:
            return
        self.tokens[idx, t + 1] = self.qbuf[idx, self.qhead[idx]]
        self.qhead[idx] += 1
        self.qlen[idx] -= 1
        self.valid[idx, t + 1] = True
        self.turn[idx, t + 1] = np.where(self.nrec[idx] > 0, self.nrec[idx] - 1, -1)
        self.finished[idx] = (self.qlen[idx] == 0) & self.done[idx]

    def compact(self, cache: StackedKVCache, share: float) -> None:
        """Drop the finished rows from the engine's ``(M, W)`` batch (and their KV cache rows) when the
        running ones fill at most ``share`` of its width in every model (see :func:`rollout_stacked`)."""
        M, W = self.live.shape
        width = max(int((~self.finished[self.live]).sum(1).max()), 1)  # most running rows of one model
        if width > share * W:
            return
        keep = np.argsort(self.finished[self.live], axis=1, kind="stable")[:, :width]  # running rows first
        flat = torch.as_tensor((np.arange(M)[:, None] * W + keep).reshape(-1))
        cache.k, cache.v = cache.k.index_select(1, flat), cache.v.index_select(1, flat)
        cache.last = cache.last.gather(1, torch.as_tensor(keep))
        self.live = np.take_along_axis(self.live, keep, axis=1)
        self.pos[self.live.reshape(-1)] = np.arange(self.live.size)

    def length(self) -> int:
        """The batch's length: up to the last position any row wrote."""
        return int(np.flatnonzero(self.valid.any(0)).max()) + 1

    def rollout_batch(self, tasks: Sequence[Task], group_ids: Sequence[int] | None) -> RolloutBatch:
        """The :class:`RolloutBatch` of a :func:`rollout`."""
        L = self.length() if self.valid.any() else 1
        envs = self.envs
        outcome = [_Outcome.of(env) for env in envs]
        gids = torch.arange(len(envs)) if group_ids is None else torch.as_tensor(list(group_ids), dtype=torch.long)
        return RolloutBatch(
            tokens=torch.as_tensor(self.tokens[:, :L]), policy_mask=torch.as_tensor(self.policy[:, :L]),
            valid_mask=torch.as_tensor(self.valid[:, :L]), rollout_logprobs=torch.as_tensor(self.logp[:, :L]),
            turn_ids=torch.as_tensor(self.turn[:, :L]), records=[env.records for env in envs],
            success=torch.tensor([o.success for o in outcome]), progress=torch.tensor([o.progress for o in outcome]),
            truncated=torch.tensor([not env.wrote for env in envs]),
            n_calls=torch.tensor([len(env.records) for env in envs]), tasks=list(tasks), group_ids=gids,
            entropy=torch.as_tensor(self.ent[:, :L]))

    def stacked_rollout(self, tasks: Sequence[Sequence[Task]]) -> StackedRollout:
        """The :class:`StackedRollout` of a :func:`rollout_stacked` (``tasks[m]``: the ``B`` tasks of model ``m``)."""
        M, B = len(tasks), len(tasks[0])
        L = self.length()
        envs = self.envs
        outcome = [_Outcome.of(env) for env in envs]

        def mb(a, dtype=None):
            return torch.as_tensor(a, dtype=dtype).reshape(M, B, *np.shape(a)[1:])

        return StackedRollout(
            tokens=mb(self.tokens[:, :L]), policy_mask=mb(self.policy[:, :L]), valid_mask=mb(self.valid[:, :L]),
            rollout_logprobs=mb(self.logp[:, :L]), turn_ids=mb(self.turn[:, :L]),
            records=[[envs[m * B + b].records for b in range(B)] for m in range(M)],
            success=mb([o.success for o in outcome], torch.float32),
            progress=mb([o.progress for o in outcome], torch.float32),
            truncated=mb([not env.wrote for env in envs]), n_calls=mb([len(env.records) for env in envs]),
            budget=mb([env.max_turns for env in envs]), tasks=[list(row) for row in tasks],
            decode_steps=self.decode_steps, decode_rows=self.decode_rows, entropy=mb(self.ent[:, :L]))


def _plant_of(plant: float | Sequence[float], M: int, B: int) -> np.ndarray | None:
    """Each row's planted strength ``(M * B,)`` from one strength or one per model; None when all are 0."""
    per = np.full(M, float(plant)) if isinstance(plant, int | float) else np.asarray(list(plant), dtype=np.float64)
    if per.shape != (M,) or not np.isfinite(per).all() or (per < 0).any():
        raise ConfigError("plant", f"expected one finite strength >= 0 (or one per model, {M}), got {plant!r}")
    return np.repeat(per, B) if (per > 0).any() else None


@torch.no_grad()
def rollout(model: TinyLM, tasks: Sequence[Task], *, precision: str = "fp32", max_len: int = 160,
            max_turns: int | None = None, max_action_len: int = 8, temperature: float = 1.0,
            generator: torch.Generator | None = None, group_ids: Sequence[int] | None = None,
            plant: float = 0.0, exact: bool = False) -> RolloutBatch:
    """Sample one trajectory per task with the engine of ``precision`` (see module doc).

    ``plant`` (> 0): the planted engine, whose logits of tool-call tokens at turn ``k`` are shifted by
    ``plant * (k + 1) * z`` (:func:`planted_direction`), a mismatch of known size that grows with the turn
    and changes which states later turns reach; ``rollout_logprobs`` are the shifted distribution's.
    ``exact``: the engine computes as the learner does (:meth:`~creditlab.models.tiny_lm.TinyLM.init_cache`),
    so it samples from the learner's distribution of ``precision``."""
    precision = EngineFormat.parse(precision)
    if temperature <= 0:
        raise ConfigError("temperature", f"must be > 0, got {temperature}")
    rows = _Rows.start([ToolshopEnv(t, max_turns) for t in tasks], max_len, max_action_len, (len(tasks),))
    rows.plant = _plant_of(plant, 1, len(tasks))
    cache = model.init_cache(len(tasks), precision, max_len, exact)
    for t in range(max_len - 1):
        logits = rows.engine_logits(model, cache, t)  # (B, V): next-token distribution at position t+1
        need = rows.to_sample()
        if need.size:
            rows.take_draw(t, need, _multinomial_draw(logits, need, temperature, generator))
        rows.feed_forced(t)
        if rows.finished.all():
            break
    return rows.rollout_batch(tasks, group_ids)


@dataclass
class StackedRollout:
    """``M x B`` trajectories of :func:`rollout_stacked`: tensors ``(M, B, L)`` / ``(M, B)`` with the
    meaning of :class:`RolloutBatch`; ``records[m][b]``, ``tasks[m][b]``; ``budget`` ``(M, B)`` the
    action budget of each episode."""

    tokens: torch.Tensor            # (M, B, L) long
    policy_mask: torch.Tensor       # (M, B, L) bool
    valid_mask: torch.Tensor        # (M, B, L) bool
    rollout_logprobs: torch.Tensor  # (M, B, L) float, 0 off policy tokens
    turn_ids: torch.Tensor          # (M, B, L) long
    records: list[list[list[TurnRecord]]]
    success: torch.Tensor           # (M, B) float 0/1
    progress: torch.Tensor          # (M, B) float
    truncated: torch.Tensor         # (M, B) bool
    n_calls: torch.Tensor           # (M, B) long
    budget: torch.Tensor            # (M, B) long
    tasks: list[list[Task]]
    decode_steps: int = 0           # model calls (positions) the engine ran
    decode_rows: int = 0            # rows x positions it computed (less than M * B * decode_steps when compacting)
    entropy: torch.Tensor | None = None  # (M, B, L) float: the engine's entropy at sampled tokens, 0 elsewhere


@torch.no_grad()
def rollout_stacked(model: StackedTinyLM, tasks: Sequence[Sequence[Task]], uniforms: torch.Tensor, *,
                    precision: str | Sequence[str] = "fp32", max_len: int = 160, max_turns: int | None = None,
                    max_action_len: int = 8, temperature: float = 1.0, compact: float | None = None,
                    plant: float | Sequence[float] = 0.0, exact: bool = False) -> StackedRollout:
    """Sample one trajectory per task for each of the ``M`` stacked models (``tasks[m]``: ``B`` tasks
    of model ``m``), the engine of ``precision`` (one, or one per model).

    ``uniforms`` ``(M, B, max_len)`` in ``[0, 1)``: the token sampled at position ``t`` of trajectory
    ``(m, b)`` is the first whose cumulative probability exceeds ``uniforms[m, b, t]`` times the
    total (inversion of the CDF). Same uniforms, same policy: same trajectory.

    ``compact`` (e.g. 0.75): when the finished trajectories leave at most that share of the current
    batch width busy in every model, the engine drops them from its batch (gathering the KV cache
    rows of the others), so the last decode steps cost only the trajectories still running (10-27%
    less rollout time measured). The matrix products then run on fewer rows, which moves log-probs
    by float rounding (about 1e-6; the sampled tokens were the same in the test), so it is off by
    default (None) and the lab leaves it off to keep its stored runs reproducible.
    """
    M = model.n_models
    if len(tasks) != M or len({len(t) for t in tasks}) != 1:
        raise ConfigError("tasks", f"expected {M} lists of tasks of one length")
    B = len(tasks[0])
    if tuple(uniforms.shape) != (M, B, max_len):
        raise ConfigError("uniforms", f"expected shape {(M, B, max_len)}, got {tuple(uniforms.shape)}")
    if temperature <= 0:
        raise ConfigError("temperature", f"must be > 0, got {temperature}")
    rows = _Rows.start([ToolshopEnv(t, max_turns) for row in tasks for t in row], max_len, max_action_len, (M, B))
    rows.plant = _plant_of(plant, M, B)
    u_all = uniforms.reshape(M * B, max_len).to(torch.float64)
    cache = model.init_cache(B, precision, max_len, exact)
    for t in range(max_len - 1):
        logits = rows.engine_logits(model, cache, t)  # (engine's batch, V): next-token distribution at t+1
        need = rows.to_sample()
        if need.size:
            draw = _inverse_cdf_draw(logits[torch.as_tensor(rows.pos[need])], u_all[torch.as_tensor(need), t + 1],
                                     temperature)
            rows.take_draw(t, need, draw)
        rows.feed_forced(t)
        if rows.finished.all():
            break
        if compact is not None:
            rows.compact(cache, compact)
    return rows.stacked_rollout(tasks)


def stacked_logprobs(model: StackedTinyLM, tokens: torch.Tensor, precision: str | Sequence[str] = "fp32",
                     temperature: float = 1.0) -> torch.Tensor:
    """Learner log-probs ``(M, B, L)`` of ``tokens`` ``(M, B, L)`` (position 0 gets 0), full forward,
    as :func:`sequence_logprobs` per model."""
    logits = model(tokens, precision)[:, :, :-1].float() / temperature  # (M, B, L-1, V)
    lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, :, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[..., :1]), lp], dim=-1)


def sequence_logprobs(model: TinyLM, tokens: torch.Tensor, precision: str = "fp32",
                      temperature: float = 1.0) -> torch.Tensor:
    """Learner log-probs ``(B, L)`` of ``tokens`` ``(B, L)`` (position 0 gets 0), full forward."""
    logits = model(tokens, precision)[:, :-1].float() / temperature  # (B, L-1, V)
    lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


@torch.no_grad()
def evaluate(model: TinyLM, seeds: Sequence[int], chain_lengths: Sequence[int], *, precision: str = "fp32",
             seed: int = 0, batch: int = 256, **kw) -> dict[str, float]:
    """Success, progress, truncation and tool calls of the policy on fixed tasks (sampled, seeded)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list[float]] = {"success": [], "progress": [], "truncated": [], "n_calls": []}
    seeds = list(seeds)
    for i in range(0, len(seeds), batch):
        rb = rollout(model, make_tasks(seeds[i:i + batch], chain_lengths), precision=precision,
                     generator=gen, **kw)
        out["success"] += rb.success.tolist()
        out["progress"] += rb.progress.tolist()
        out["truncated"] += rb.truncated.float().tolist()
        out["n_calls"] += rb.n_calls.float().tolist()
    return {k: float(np.mean(v)) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------
# Turn helpers: per-turn values of a batch, and per-turn values to tokens
# ----------------------------------------------------------------------------------------------


def turn_mask_of(batch: RolloutBatch) -> torch.Tensor:
    """``(B, T)`` bool: True on the turns each trajectory took."""
    T = max(batch.n_turns_max, 1)
    return torch.arange(T)[None, :] < batch.n_calls[:, None]


def turns_to_tokens(turn_values: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """Spread a per-turn ``(B, T)`` tensor onto the policy tokens of each turn, ``(B, L)`` (0 elsewhere)."""
    tid = batch.turn_ids.clamp(min=0, max=turn_values.size(1) - 1)
    out = turn_values.gather(1, tid)
    return torch.where(batch.policy_mask & (batch.turn_ids >= 0), out, torch.zeros_like(out))


def turn_progress_deltas(batch: RolloutBatch) -> torch.Tensor:
    """``(B, T)`` change of the verifier's progress score at each turn (non-zero only at a write)."""
    T = max(batch.n_turns_max, 1)
    out = torch.zeros(len(batch), T)
    for b, (task, recs) in enumerate(zip(batch.tasks, batch.records, strict=True)):
        before = verify(task.store, task)[1]
        for t, r in enumerate(recs):
            if r.is_write:
                out[b, t] = float(batch.progress[b]) - before
    return out


def successful_read_scores(batch: RolloutBatch) -> torch.Tensor:
    """A turn-level process score ``(B, T)`` that likes evidence gathering: 1 for every successful
    read, 0 for errors and writes. Hackable on purpose: repeated reads score 1 too (unlike
    :func:`creditlab.rewards.process.evidence_scores`, which scores a repeat ``repeat``)."""
    T = max(batch.n_turns_max, 1)
    out = torch.zeros(len(batch), T)
    for b, recs in enumerate(batch.records):
        for t, r in enumerate(recs):
            out[b, t] = float(r.ok and not r.is_write)
    return out
