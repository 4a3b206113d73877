"""The toolshop agent engine: batched multi-turn rollout, a supervised base policy, multi-turn GRPO.

Rollout (:func:`rollout`). All trajectories of a batch advance in lock step, one token position per
model call, through :meth:`creditlab.models.tiny_lm.TinyLM.step` with a KV cache in the *engine*
precision. At each position a trajectory either consumes a forced token (its prompt or the
environment's observation, queued) or samples one from the policy; when it samples ``EOA`` (or its
action reaches ``max_action_len`` tokens) the action goes to its :class:`ToolshopEnv` and the
observation is queued. Because every trajectory sits at the same position, the learner's
full-sequence forward over the padded batch computes exactly the same function (tested).

Alignment: ``rollout_logprobs[b, t]`` and ``logprobs[b, t]`` are the log-probabilities of token
``tokens[b, t]`` given ``tokens[b, :t]``; ``policy_mask[b, t]`` is True on sampled tokens.

Base policy (:func:`base_policy`). Supervised warm start on noisy scripted demonstrations
(:class:`creditlab.envs.toolshop.ScriptedAgent`): the imitation learns the demonstrator's mistakes
too, so RL starts from a middling success rate. Deterministic from the config's seed, cached as
safetensors in the user's cache directory (``$CREDITLAB_CACHE`` overrides it).

Trainer (:func:`train_grpo`). Multi-turn GRPO built on ``core``: groups of ``group_size`` rollouts
of one task, a pluggable advantage (outcome GRPO broadcast, credit geometries over turns, PRM
mixing) and pluggable per-token weights (the execution-mismatch correction arms), one row of
metrics per update.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from creditlab.envs.toolshop import (
    EOA,
    PAD,
    VOCAB,
    Task,
    ToolshopEnv,
    TurnRecord,
    make_task,
    run_scripted,
)
from creditlab.errors import ConfigError
from creditlab.models.quant import check_precision
from creditlab.models.tiny_lm import TinyLM, TinyLMConfig

__all__ = [
    "ADVANTAGES",
    "BaseConfig",
    "GRPOConfig",
    "RolloutBatch",
    "base_policy",
    "cache_dir",
    "evaluate",
    "make_tasks",
    "rollout",
    "sequence_logprobs",
    "evidence_scores",
    "make_advantage",
    "make_prm_advantage",
    "make_weights",
    "task_seeds",
    "train_base",
    "train_grpo",
    "turns_to_tokens",
]


# ----------------------------------------------------------------------------------------------
# Rollout
# ----------------------------------------------------------------------------------------------


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


def sequence_logprobs(model: TinyLM, tokens: torch.Tensor, precision: str = "fp32",
                      temperature: float = 1.0) -> torch.Tensor:
    """Learner log-probs ``(B, L)`` of ``tokens`` ``(B, L)`` (position 0 gets 0), full forward."""
    logits = model(tokens, precision)[:, :-1].float() / temperature  # (B, L-1, V)
    lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


# ----------------------------------------------------------------------------------------------
# Base policy: supervised warm start on noisy scripted demonstrations, cached
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BaseConfig:
    """Supervised warm start of the base policy (deterministic from ``seed``)."""

    chain_lengths: tuple[int, ...] = (4,)
    """Chain lengths of the demonstration tasks (each task draws one)."""
    noise: float = 0.2
    """Demonstrator noise: probability of a wrong choice at each selection (see ScriptedAgent)."""
    n_demos: int = 4000
    """Demonstration episodes (tasks seeded from ``seed``, disjoint from RL task seeds)."""
    steps: int = 1000
    """Optimizer steps."""
    batch_size: int = 128
    """Demonstrations per step."""
    lr: float = 3e-3
    """AdamW peak learning rate (linear warm-up over 5% of steps, cosine decay)."""
    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads."""
    d_model: int = 64
    """Model width."""
    max_len: int = 192
    """Model context length."""
    seed: int = 0
    """Seed of the model init, the demonstrations and the batches."""

    def model_config(self) -> TinyLMConfig:
        return TinyLMConfig(vocab_size=len(VOCAB), n_layer=self.n_layer, n_head=self.n_head,
                            d_model=self.d_model, max_len=self.max_len)

    def key(self) -> str:
        # the model's full config and a format version: a changed architecture never loads old weights
        blob = json.dumps({**asdict(self), "model": asdict(self.model_config()), "v": 2}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


DEMO_SEED_OFFSET = 10_000_000  # base-policy demo tasks; RL and evaluation use seeds below this


def cache_dir() -> Path:
    """Where base policies are cached: ``$CREDITLAB_CACHE`` or the user cache dir."""
    env = os.environ.get("CREDITLAB_CACHE")
    if env:
        return Path(env)
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("creditlab"))
    except ImportError:  # pragma: no cover - platformdirs is a dependency
        return Path.home() / ".cache" / "creditlab"


def train_base(cfg: BaseConfig, progress: Callable[[int, float], None] | None = None, *,
               checkpoint: Callable[[int, TinyLM], None] | None = None, checkpoint_every: int = 0) -> TinyLM:
    """Train the base policy from scratch (no cache). Cross-entropy on the demonstrator's tokens.

    ``checkpoint(k, model)`` is called every ``checkpoint_every`` steps (e.g. to evaluate)."""
    torch.manual_seed(cfg.seed)
    model = TinyLM(cfg.model_config())
    seqs, masks = [], []
    for j in range(cfg.n_demos):
        s = DEMO_SEED_OFFSET + cfg.seed * cfg.n_demos + j
        task = make_tasks([s], cfg.chain_lengths)[0]
        ids, mask, _ = run_scripted(task, seed=s, noise=cfg.noise)
        seqs.append(ids)
        masks.append(mask)
    L = min(max(len(s) for s in seqs), cfg.max_len)
    X = torch.full((cfg.n_demos, L), PAD, dtype=torch.long)
    M = torch.zeros((cfg.n_demos, L), dtype=torch.bool)
    for j, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        X[j, :len(s)] = torch.tensor(s[:L])
        M[j, :len(m)] = torch.tensor(m[:L])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = max(1, cfg.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / warm) * 0.5 * (1 + np.cos(np.pi * min(1.0, k / cfg.steps))))
    gen = torch.Generator().manual_seed(cfg.seed)
    model.train()
    for k in range(cfg.steps):
        idx = torch.randint(0, cfg.n_demos, (cfg.batch_size,), generator=gen)
        x, m = X[idx], M[idx]
        n = int(m.any(0).nonzero().max()) + 1
        x, m = x[:, :n], m[:, :n]
        logits = model(x)[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1),
                                                 reduction="none").view(x.size(0), -1)
        loss = (loss * m[:, 1:]).sum() / m[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if progress is not None:
            progress(k, float(loss.detach()))
        if checkpoint is not None and checkpoint_every and (k + 1) % checkpoint_every == 0:
            model.eval()
            checkpoint(k + 1, model)
            model.train()
    model.eval()
    return model


def base_policy(cfg: BaseConfig = BaseConfig(), *, cache: str | os.PathLike[str] | None = None,
                refresh: bool = False, progress: Callable[[int, float], None] | None = None) -> TinyLM:
    """The cached base policy for ``cfg`` (trained and saved on first use).

    Loaded with safetensors (no pickle); the file name carries a hash of the config.
    """
    from safetensors.torch import load_model, save_model

    root = Path(cache) if cache is not None else cache_dir()
    path = root / f"toolshop-base-{cfg.key()}.safetensors"
    model = TinyLM(cfg.model_config())
    if path.exists() and not refresh:
        load_model(model, str(path))  # safetensors: no pickle; handles the tied head
        model.eval()
        return model
    model = train_base(cfg, progress)
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_model(model, str(tmp), metadata={"config": json.dumps(asdict(cfg))})
    os.replace(tmp, path)
    return model


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
# Multi-turn GRPO
# ----------------------------------------------------------------------------------------------

AdvantageFn = Callable[["RolloutBatch", torch.Tensor, int], torch.Tensor]
WeightFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
ADVANTAGES = ("grpo", "uniform", "per_turn", "shuffled")


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
    from creditlab.envs.toolshop import verify

    T = max(batch.n_turns_max, 1)
    out = torch.zeros(len(batch), T)
    for b, (task, recs) in enumerate(zip(batch.tasks, batch.records, strict=True)):
        before = verify(task.store, task)[1]
        for t, r in enumerate(recs):
            if r.is_write:
                out[b, t] = float(batch.progress[b]) - before
    return out


def make_advantage(name: str, *, generator: torch.Generator | None = None) -> AdvantageFn:
    """A built-in advantage by name: ``grpo`` (outcome GRPO on every policy token, the plain
    broadcast), or a credit geometry of :mod:`creditlab.core.credit` over turns (equal total credit
    per rollout): ``uniform``, ``per_turn`` (credit where the verifier's progress changed),
    ``shuffled`` (the per-turn credit moved to random turns)."""
    from creditlab.core import credit
    from creditlab.core.advantages import grpo_advantages

    if name not in ADVANTAGES:
        raise ConfigError("advantage", f"unknown advantage {name!r}; valid: {', '.join(ADVANTAGES)}")

    def fn(batch: RolloutBatch, rewards: torch.Tensor, update: int) -> torch.Tensor:
        adv = grpo_advantages(rewards, batch.group_ids)
        if name == "grpo":
            return adv
        tm = turn_mask_of(batch)
        if name == "uniform":
            a = credit.uniform(adv, tm)
        else:
            a = credit.per_turn(adv, turn_progress_deltas(batch), tm)
            if name == "shuffled":
                a = credit.shuffled(a, tm, generator)
        return turns_to_tokens(a, batch)

    return fn


def evidence_scores(batch: RolloutBatch) -> torch.Tensor:
    """A turn-level process score ``(B, T)`` that likes evidence gathering: 1 for every successful
    read, 0 for errors and writes. Hackable on purpose: repeated reads score too."""
    T = max(batch.n_turns_max, 1)
    out = torch.zeros(len(batch), T)
    for b, recs in enumerate(batch.records):
        for t, r in enumerate(recs):
            out[b, t] = float(r.ok and not r.is_write)
    return out


def make_prm_advantage(process_scores: Callable[[RolloutBatch], torch.Tensor] = evidence_scores,
                       lam: Callable[[int], float] | float = 0.5) -> AdvantageFn:
    """PRM mixing: ``A[i,t] = A_out[i] + lam(k) A_proc[i,t]`` per turn
    (:func:`creditlab.core.advantages.prm_mixed_advantages`), spread on each turn's policy tokens;
    ``lam`` a number or a schedule of the update index (:mod:`creditlab.core.schedules`)."""
    from creditlab.core.advantages import prm_mixed_advantages

    def fn(batch: RolloutBatch, rewards: torch.Tensor, update: int) -> torch.Tensor:
        lam_k = float(lam(update)) if callable(lam) else float(lam)
        a = prm_mixed_advantages(rewards, process_scores(batch).float(), turn_mask_of(batch), batch.group_ids,
                                 lam_k)
        return turns_to_tokens(a, batch)

    return fn


def make_weights(arm: str, **params) -> WeightFn:
    """Per-token correction weights of an arm of :data:`creditlab.core.correction.ARMS`
    (``interq``, ``prefix``, ``global`` are modes of ``interq_weights``; ``tis``, ``mis``, ``seq_is``,
    ``geo``, ``none`` the baselines), with its parameters bound."""
    from creditlab.core import correction

    if arm not in correction.ARMS:
        raise ConfigError("correction", f"unknown arm {arm!r}; valid: {', '.join(correction.ARMS)}")
    if arm in correction.INTERQ_MODES:
        def fn(old, rollout_lp, pm, vm=None):
            return correction.interq_weights(old, rollout_lp, pm, vm, mode=arm, **params)
        return fn
    base = getattr(correction, f"{arm}_weights")

    def fn2(old, rollout_lp, pm, vm=None):
        return base(old, rollout_lp, pm, vm, **params)
    return fn2


@dataclass(frozen=True)
class GRPOConfig:
    """Multi-turn GRPO on toolshop."""

    updates: int = 100
    """Policy updates (one rollout batch each)."""
    tasks_per_update: int = 32
    """Distinct tasks per update (fresh seeded tasks every update)."""
    group_size: int = 8
    """Rollouts per task (the GRPO group)."""
    chain_lengths: tuple[int, ...] = (4,)
    """Chain lengths C of the tasks."""
    rollout_precision: str = "fp32"
    """Rollout engine precision: fp32, bf16, fp8 (W8A8-KV8) or int8 (W8A8)."""
    learner_precision: str = "fp32"
    """Learner precision: fp32, or the rollout's for a quantization-aware (QAT) learner."""
    advantage: str = "grpo"
    """Built-in advantage (see make_advantage); a callable can be passed to train_grpo instead."""
    reward: str = "success"
    """Outcome reward: "success" (binary) or "progress" (field-level score)."""
    correction: str = "none"
    """Per-token weights arm (creditlab.core.correction.ARMS); a callable can be passed instead."""
    lr: float = 3e-4
    """AdamW learning rate."""
    minibatches: int = 2
    """Optimizer steps per update (the batch split into this many minibatches)."""
    epochs: int = 1
    """Passes over the batch per update."""
    clip_low: float = 0.2
    """PPO ratio clip below."""
    clip_high: float = 0.28
    """PPO ratio clip above (DAPO-style asymmetric clip)."""
    agg: str = "token_mean"
    """Loss aggregation mode (creditlab.core.losses.aggregate)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    max_len: int = 160
    """Token budget of a trajectory."""
    max_turns: int | None = None
    """Action budget (default C + 2)."""
    max_action_len: int = 8
    """Tokens per action before it is cut and sent as is."""
    temperature: float = 1.0
    """Sampling temperature of the engine (and of the learner's log-probs)."""
    eval_every: int = 0
    """Evaluate on a fixed task set every this many updates (0: never)."""
    eval_tasks: int = 256
    """Size of the fixed evaluation set (seeds disjoint from training)."""
    seed: int = 0
    """Seed of the task stream and the sampling."""

    def __post_init__(self) -> None:
        check_precision(self.rollout_precision)
        check_precision(self.learner_precision)
        if self.reward not in ("success", "progress"):
            raise ConfigError("reward", f"must be 'success' or 'progress', got {self.reward!r}")
        for name in ("updates", "tasks_per_update", "group_size", "minibatches", "epochs"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ConfigError("group_size", "GRPO needs at least 2 rollouts per task")


EVAL_SEED_OFFSET = 5_000_000  # evaluation tasks; training tasks are drawn below this


def task_seeds(cfg: GRPOConfig, update: int) -> list[int]:
    """The task seeds of one update (deterministic in ``cfg.seed`` and ``update``)."""
    rng = random.Random(f"grpo-{cfg.seed}-{update}")
    return [rng.randrange(EVAL_SEED_OFFSET) for _ in range(cfg.tasks_per_update)]


def train_grpo(model: TinyLM, cfg: GRPOConfig, *, advantage: AdvantageFn | None = None,
               weights: WeightFn | None = None,
               on_update: Callable[[dict[str, float]], None] | None = None) -> list[dict[str, float]]:
    """Train ``model`` in place with multi-turn GRPO; returns one metrics row per update.

    Each update: sample ``tasks_per_update`` tasks x ``group_size`` rollouts with the engine of
    ``rollout_precision``; ``old_logprobs`` from the learner (``learner_precision``, no grad);
    advantages from ``advantage`` (default: ``cfg.advantage``); per-token weights from ``weights``
    (default: ``cfg.correction``) applied as detached coefficients of the clipped token loss
    (:func:`creditlab.core.losses.policy_loss`); ``minibatches`` AdamW steps per epoch.
    Row keys: ``update``, ``reward/success``, ``reward/progress``, ``episode/*``, ``mismatch/*``
    (engine vs learner, :func:`creditlab.core.correction.mismatch_metrics`), ``correction/*``,
    ``loss/*``, ``grad_norm``, ``time/*`` and ``eval/*`` when evaluated.
    """
    from creditlab.core.correction import mismatch_metrics
    from creditlab.core.losses import policy_loss

    adv_fn = advantage or make_advantage(cfg.advantage, generator=torch.Generator().manual_seed(cfg.seed))
    w_fn = weights or make_weights(cfg.correction)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.99))
    eval_seeds = range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + cfg.eval_tasks)
    G = cfg.group_size
    rows: list[dict[str, float]] = []
    for k in range(cfg.updates):
        row: dict[str, float] = {"update": float(k)}
        if cfg.eval_every and k % cfg.eval_every == 0:
            model.eval()
            ev = evaluate(model, eval_seeds, cfg.chain_lengths, precision=cfg.rollout_precision,
                          seed=cfg.seed + 1, max_len=cfg.max_len, max_turns=cfg.max_turns,
                          max_action_len=cfg.max_action_len, temperature=cfg.temperature)
            row.update({f"eval/{n}": v for n, v in ev.items()})
        t0 = time.perf_counter()
        model.eval()
        seeds = task_seeds(cfg, k)
        tasks = [t for t in make_tasks(seeds, cfg.chain_lengths) for _ in range(G)]
        batch = rollout(model, tasks, precision=cfg.rollout_precision, max_len=cfg.max_len,
                        max_turns=cfg.max_turns, max_action_len=cfg.max_action_len,
                        temperature=cfg.temperature, generator=gen,
                        group_ids=[j // G for j in range(len(tasks))])
        t1 = time.perf_counter()
        pm, vm = batch.policy_mask, batch.valid_mask
        with torch.no_grad():
            old = sequence_logprobs(model, batch.tokens, cfg.learner_precision, cfg.temperature)
        rewards = batch.success if cfg.reward == "success" else batch.progress
        adv = adv_fn(batch, rewards.float(), k)
        if adv.dim() == 1:
            adv = adv[:, None].expand_as(old)
        w, wm = w_fn(old, batch.rollout_logprobs, pm, vm)
        row.update(mismatch_metrics(old, batch.rollout_logprobs, pm, vm))
        row.update({n: v for n, v in wm.items() if n.startswith("correction/")})
        model.train()
        B = len(batch)
        loss_m: dict[str, list[float]] = {}
        gnorms = []
        for _ in range(cfg.epochs):
            perm = torch.randperm(B, generator=gen)
            for chunk in perm.chunk(cfg.minibatches):
                lp = sequence_logprobs(model, batch.tokens[chunk], cfg.learner_precision, cfg.temperature)
                loss, lm = policy_loss(lp, old[chunk], adv[chunk], pm[chunk], clip_low=cfg.clip_low,
                                       clip_high=cfg.clip_high, weights=w[chunk].to(lp.dtype), agg=cfg.agg)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                gnorms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)))
                opt.step()
                for n, v in lm.items():
                    loss_m.setdefault(n, []).append(v)
        model.eval()
        t2 = time.perf_counter()
        n_policy = int(pm.sum())
        row.update({n: float(np.mean(v)) for n, v in loss_m.items()})
        row.update({
            "reward/success": float(batch.success.mean()),
            "reward/progress": float(batch.progress.mean()),
            "episode/truncation_rate": float(batch.truncated.float().mean()),
            "episode/tool_calls": float(batch.n_calls.float().mean()),
            "episode/length": float(vm.sum(1).float().mean()),
            "episode/policy_tokens": float(n_policy) / B,
            "adv/abs_mean": float(adv[pm].abs().mean()) if n_policy else 0.0,
            "grad_norm": float(np.mean(gnorms)),
            "time/rollout_s": t1 - t0,
            "time/update_s": t2 - t0,
            "time/rollout_tokens_per_s": float(vm.sum()) / max(t1 - t0, 1e-9),
        })
        rows.append(row)
        if on_update is not None:
            on_update(row)
    return rows
