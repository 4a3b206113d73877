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
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from creditlab.envs.toolshop import EOA, PAD, Task, ToolshopEnv, TurnRecord, make_task, verify
from creditlab.errors import ConfigError
from creditlab.models.quant import check_precision
from creditlab.models.tiny_lm import StackedTinyLM, TinyLM

__all__ = [
    "EVAL_SEED_OFFSET",
    "RolloutBatch",
    "evaluate",
    "StackedRollout",
    "make_tasks",
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

    def __len__(self) -> int:
        return self.tokens.size(0)

    @property
    def n_turns_max(self) -> int:
        return int(self.n_calls.max().item()) if len(self) else 0


def make_tasks(seeds: Sequence[int], chain_lengths: Sequence[int]) -> list[Task]:
    """One task per seed; the chain length cycles through ``chain_lengths`` (seeded choice)."""
    return [make_task(s, chain_lengths[random.Random(s).randrange(len(chain_lengths))]) for s in seeds]


@torch.no_grad()
def rollout(model: TinyLM, tasks: Sequence[Task], *, precision: str = "fp32", max_len: int = 160,
            max_turns: int | None = None, max_action_len: int = 8, temperature: float = 1.0,
            generator: torch.Generator | None = None, group_ids: Sequence[int] | None = None
            ) -> RolloutBatch:
    """Sample one trajectory per task with the engine of ``precision`` (see module doc)."""
    check_precision(precision)
    if temperature <= 0:
        raise ConfigError("temperature", f"must be > 0, got {temperature}")
    B = len(tasks)
    envs = [ToolshopEnv(t, max_turns) for t in tasks]
    queues = [deque(env.reset()) for env in envs]
    tokens = np.full((B, max_len), PAD, dtype=np.int64)
    policy = np.zeros((B, max_len), dtype=bool)
    valid = np.zeros((B, max_len), dtype=bool)
    turn = np.full((B, max_len), -1, dtype=np.int64)
    logp = np.zeros((B, max_len), dtype=np.float32)
    action: list[list[int]] = [[] for _ in range(B)]
    finished = [False] * B
    for b in range(B):
        tokens[b, 0] = queues[b].popleft()
        valid[b, 0] = True
    cache = model.init_cache(B, precision, max_len)
    cur = torch.as_tensor(tokens[:, 0])
    for t in range(max_len - 1):
        logits = model.step(cur, cache).float()  # (B, V): next-token distribution at position t+1
        lp = torch.log_softmax(logits / temperature, dim=-1)
        need = [b for b in range(B) if not finished[b] and not queues[b]]
        if need:
            idx = torch.as_tensor(need)
            draw = torch.multinomial(lp[idx].exp(), 1, generator=generator).squeeze(1)
            draw_lp = lp[idx, draw]
            for j, b in enumerate(need):
                tok = int(draw[j])
                tokens[b, t + 1] = tok
                policy[b, t + 1] = valid[b, t + 1] = True
                logp[b, t + 1] = float(draw_lp[j])
                turn[b, t + 1] = len(envs[b].records)
                action[b].append(tok)
                if tok == EOA or len(action[b]) >= max_action_len:
                    res = envs[b].step(action[b])
                    action[b] = []
                    queues[b].extend(res.observation)
        for b in range(B):
            if finished[b] or not queues[b] or policy[b, t + 1]:
                continue
            tokens[b, t + 1] = queues[b].popleft()
            valid[b, t + 1] = True
            turn[b, t + 1] = len(envs[b].records) - 1 if envs[b].records else -1
            if not queues[b] and envs[b].done:
                finished[b] = True
        if all(finished):
            break
        cur = torch.as_tensor(tokens[:, t + 1])
    L = int(valid.any(0).nonzero()[0].max()) + 1 if valid.any() else 1
    succ, prog, trunc = [], [], []
    for env in envs:
        ok, pr = env.result()
        succ.append(float(ok))
        prog.append(pr)
        trunc.append(not env.wrote)
    gids = torch.arange(B) if group_ids is None else torch.as_tensor(list(group_ids), dtype=torch.long)
    return RolloutBatch(
        tokens=torch.as_tensor(tokens[:, :L]), policy_mask=torch.as_tensor(policy[:, :L]),
        valid_mask=torch.as_tensor(valid[:, :L]), rollout_logprobs=torch.as_tensor(logp[:, :L]),
        turn_ids=torch.as_tensor(turn[:, :L]), records=[env.records for env in envs],
        success=torch.tensor(succ), progress=torch.tensor(prog), truncated=torch.tensor(trunc),
        n_calls=torch.tensor([len(env.records) for env in envs]), tasks=list(tasks), group_ids=gids)


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


@torch.no_grad()
def rollout_stacked(model: StackedTinyLM, tasks: Sequence[Sequence[Task]], uniforms: torch.Tensor, *,
                    precision: str | Sequence[str] = "fp32", max_len: int = 160, max_turns: int | None = None,
                    max_action_len: int = 8, temperature: float = 1.0, compact: float | None = None
                    ) -> StackedRollout:
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
    R = M * B
    envs = [ToolshopEnv(t, max_turns) for row in tasks for t in row]
    prompts = [env.reset() for env in envs]
    qmax = max(64, max(len(p) for p in prompts))
    qbuf = np.zeros((R, qmax), dtype=np.int64)  # forced tokens still to feed (prompt, then each observation)
    qhead = np.zeros(R, dtype=np.int64)
    qlen = np.zeros(R, dtype=np.int64)
    tokens = np.full((R, max_len), PAD, dtype=np.int64)
    for r, p in enumerate(prompts):
        tokens[r, 0] = p[0]
        qbuf[r, :len(p) - 1] = p[1:]
        qlen[r] = len(p) - 1
    policy = np.zeros((R, max_len), dtype=bool)
    valid = np.zeros((R, max_len), dtype=bool)
    valid[:, 0] = True
    turn = np.full((R, max_len), -1, dtype=np.int64)
    logp = np.zeros((R, max_len), dtype=np.float32)
    abuf = np.zeros((R, max_action_len), dtype=np.int64)
    alen = np.zeros(R, dtype=np.int64)
    nrec = np.zeros(R, dtype=np.int64)
    done = np.zeros(R, dtype=bool)  # the environment's episode is over
    finished = np.zeros(R, dtype=bool)  # ... and its last observation was fed
    u_all = uniforms.reshape(R, max_len).to(torch.float64)
    cache = model.init_cache(B, precision, max_len)
    live = np.arange(R).reshape(M, B)  # the engine's batch: global row of each (model, slot)
    pos = np.arange(R)  # slot of each global row in the flattened batch (valid while the row runs)
    cur = torch.as_tensor(tokens[:, 0]).view(M, B)
    steps = rows_done = 0
    for t in range(max_len - 1):
        logits = model.step(cur, cache).float().view(live.size, -1)  # next-token distribution at t+1
        steps += 1
        rows_done += live.size
        need = ~finished & (qlen == 0)
        if need.any():
            idx = np.flatnonzero(need)
            it = torch.as_tensor(idx)
            lp = torch.log_softmax(logits[torch.as_tensor(pos[idx])] / temperature, dim=-1)
            cdf = lp.exp().to(torch.float64).cumsum(-1)
            u = u_all[it, t + 1] * cdf[:, -1]
            draw = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp(max=cdf.size(1) - 1)
            draw_lp = lp.gather(1, draw[:, None]).squeeze(1).numpy()
            draw = draw.numpy()
            tokens[idx, t + 1] = draw
            policy[idx, t + 1] = valid[idx, t + 1] = True
            logp[idx, t + 1] = draw_lp
            turn[idx, t + 1] = nrec[idx]
            abuf[idx, alen[idx]] = draw
            alen[idx] += 1
            for r in idx[(draw == EOA) | (alen[idx] >= max_action_len)]:
                res = envs[r].step(abuf[r, :alen[r]].tolist())
                alen[r] = 0
                obs = res.observation
                if len(obs) > qbuf.shape[1]:
                    qbuf = np.concatenate([qbuf, np.zeros((R, len(obs)), dtype=np.int64)], axis=1)
                qbuf[r, :len(obs)] = obs
                qhead[r], qlen[r] = 0, len(obs)
                nrec[r] += 1
                done[r] = res.done
        forced = ~finished & (qlen > 0) & ~need
        if forced.any():
            idx = np.flatnonzero(forced)
            tokens[idx, t + 1] = qbuf[idx, qhead[idx]]
            qhead[idx] += 1
            qlen[idx] -= 1
            valid[idx, t + 1] = True
            turn[idx, t + 1] = np.where(nrec[idx] > 0, nrec[idx] - 1, -1)
            finished[idx] = (qlen[idx] == 0) & done[idx]
        if finished.all():
            break
        if compact is not None:
            busy = (~finished[live]).sum(1)  # (M,) running trajectories of each model
            width = max(int(busy.max()), 1)
            if width <= compact * live.shape[1]:
                keep = np.argsort(finished[live], axis=1, kind="stable")[:, :width]  # running rows first
                flat = torch.as_tensor((np.arange(M)[:, None] * live.shape[1] + keep).reshape(-1))
                cache.k, cache.v = cache.k.index_select(1, flat), cache.v.index_select(1, flat)
                cache.last = cache.last.gather(1, torch.as_tensor(keep))
                live = np.take_along_axis(live, keep, axis=1)
                pos[live.reshape(-1)] = np.arange(live.size)
        cur = torch.as_tensor(tokens[live, t + 1])
    L = int(np.flatnonzero(valid.any(0)).max()) + 1
    res = [env.result() for env in envs]

    def mb(a, dtype=None):
        return torch.as_tensor(a, dtype=dtype).reshape(M, B, *np.shape(a)[1:])

    return StackedRollout(
        tokens=mb(tokens[:, :L]), policy_mask=mb(policy[:, :L]), valid_mask=mb(valid[:, :L]),
        rollout_logprobs=mb(logp[:, :L]), turn_ids=mb(turn[:, :L]),
        records=[[envs[m * B + b].records for b in range(B)] for m in range(M)],
        success=mb([float(ok) for ok, _ in res], torch.float32), progress=mb([p for _, p in res], torch.float32),
        truncated=mb([not env.wrote for env in envs]), n_calls=mb([len(env.records) for env in envs]),
        budget=mb([env.max_turns for env in envs]), tasks=[list(row) for row in tasks], decode_steps=steps,
        decode_rows=rows_done)


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
