"""Multi-turn GRPO on toolshop: the trainer, its advantages and its per-token correction weights.

:func:`train_grpo` is built on ``core``: groups of ``group_size`` rollouts of one task
(:func:`creditlab.train.toolshop_rollout.rollout`), a pluggable advantage and pluggable per-token
weights, one row of metrics per update. It touches no global state: the task stream comes from
:func:`task_seeds` (seeded by ``cfg.seed`` and the update index), the sampling and the minibatch
order from one ``torch.Generator`` seeded with ``cfg.seed``.

:func:`train_grpo_stacked` trains ``M`` models as one tensor program
(:class:`creditlab.models.tiny_lm.StackedTinyLM`), each with its own :class:`GRPOConfig` (its own
engine and learner precision, correction arm and seed; every other field shared), with common
random numbers: models with the same seed get the same tasks, the same sampling uniforms and the
same minibatch order, so arms are paired draw for draw.

Advantages (:data:`AdvantageFn`, ``(batch, rewards, update) -> (B,) | (B, L)``): the built-ins of
:func:`make_advantage`: outcome GRPO broadcast and every registered credit geometry over turns, PRM
mixing (``prm``) with a fixed or scheduled weight among them. Weights (:data:`WeightFn`): the
execution-mismatch correction arms of :func:`make_weights`.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from creditlab.envs.toolshop import thought_mask
from creditlab.errors import ConfigError
from creditlab.models.quant import EngineFormat
from creditlab.models.tiny_lm import StackedTinyLM, TinyLM
from creditlab.train.common import adamw, generator, seed_stream, task_rng
from creditlab.train.toolshop_rollout import (
    EVAL_SEED_OFFSET,
    RolloutBatch,
    StackedRollout,
    evaluate,
    make_tasks,
    rollout,
    rollout_stacked,
    sequence_logprobs,
    stacked_logprobs,
    turn_mask_of,
    turn_progress_deltas,
    turns_to_tokens,
)

__all__ = [
    "AdvantageFn",
    "GRPOConfig",
    "WeightFn",
    "advantage_names",
    "make_advantage",
    "make_weights",
    "task_seeds",
    "train_grpo",
    "train_grpo_stacked",
]

AdvantageFn = Callable[["RolloutBatch", torch.Tensor, int], torch.Tensor]
WeightFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]


def advantage_names() -> tuple[str, ...]:
    """The names :func:`make_advantage` accepts now: ``grpo`` and every geometry registered in
    :data:`creditlab.core.credit.GEOMETRIES` (``uniform``, ``per_turn``, ``shuffled``, ...)."""
    from creditlab.core.credit import GEOMETRIES

    return ("grpo", *GEOMETRIES)


def make_advantage(name: str, *, generator: torch.Generator | None = None, conserve: bool = True,
                   step_scores: Callable[[RolloutBatch], torch.Tensor] | None = None,
                   **params) -> AdvantageFn:
    """A built-in advantage by name: ``grpo`` (outcome GRPO on every policy token, the plain
    broadcast), or a credit geometry of :data:`creditlab.core.credit.GEOMETRIES` over turns,
    looked up with :func:`~creditlab.core.credit.get_geometry`: ``uniform`` (equal credit per
    turn), ``per_turn`` (credit where the verifier's progress rose), ``shuffled`` (the per-turn
    credit moved to random turns), ``prm`` (the outcome advantage plus a weighted process advantage),
    or any other registered geometry.

    The geometry sees a :class:`~creditlab.core.credit.StepBatch` of turns: ``step_mask`` the turns
    taken (:func:`turn_mask_of`), ``advantages`` the GRPO advantage of the rewards, ``rewards``, and
    ``step_scores`` a per-turn score: ``step_scores(batch)``
    when given (e.g. a process reward for ``prm``), else the progress the verifier gained at each turn
    (the positive part of :func:`turn_progress_deltas`: a write that undoes progress gets no credit,
    not negative credit). ``conserve`` (equal total credit per rollout) and ``params`` go to the
    geometry (checked against :func:`~creditlab.core.credit.geometry_params`); a parameter given as a
    :class:`~creditlab.core.schedules.Schedule` (e.g. ``prm``'s ``lam``) is evaluated at the update
    index, as the integrations evaluate theirs at the trainer's step. ``generator`` goes to the geometry
    when it takes one (``shuffled``, ``random_k``). The per-turn credit is spread on each turn's policy
    tokens. The returned function's ``params_at(update)`` gives the scheduled values it used (the
    trainer reports them as ``adv/<name>``, e.g. ``adv/lam``).
    """
    from creditlab.core.advantages import grpo_advantages
    from creditlab.core.credit import StepBatch, geometry_params, get_geometry
    from creditlab.core.schedules import Schedule

    if name == "grpo":
        given = sorted(params) + (["step_scores"] if step_scores is not None else [])
        if given:
            raise ConfigError("advantage", f"grpo takes no parameters, got {given}")

        def outcome(batch: RolloutBatch, rewards: torch.Tensor, update: int) -> torch.Tensor:
            return grpo_advantages(rewards, batch.group_ids)

        return outcome
    try:
        geometry = get_geometry(name)
    except ConfigError:
        raise ConfigError("advantage", f"unknown advantage {name!r}; valid: {', '.join(advantage_names())}"
                          ) from None
    accepted = geometry_params(name)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ConfigError("advantage", f"{name} takes {', '.join(accepted) or 'no parameters'}, got {unknown}")
    if "generator" in accepted:
        params = {**params, "generator": generator}
    scheduled = {n: v for n, v in params.items() if isinstance(v, Schedule)}

    def params_at(update: int) -> dict[str, float]:
        return {n: float(v(update)) for n, v in scheduled.items()}

    def scores_of(batch: RolloutBatch) -> torch.Tensor:
        if step_scores is not None:
            return step_scores(batch).float()
        return turn_progress_deltas(batch).clamp(min=0)

    def credit(batch: RolloutBatch, rewards: torch.Tensor, update: int) -> torch.Tensor:
        steps = StepBatch(turn_mask_of(batch), batch.group_ids, advantages=grpo_advantages(rewards, batch.group_ids),
                          rewards=rewards, step_scores=scores_of(batch))
        return turns_to_tokens(geometry(steps, conserve=conserve, **{**params, **params_at(update)}), batch)

    credit.params_at = params_at  # type: ignore[attr-defined]
    return credit


def make_weights(arm: str, **params) -> WeightFn:
    """Per-token correction weights of the arm registered as ``arm`` in
    :data:`creditlab.core.correction.CORRECTIONS` (looked up with
    :func:`~creditlab.core.correction.get_correction`: ``interq``, ``prefix``, ``global``, ``tis``,
    ``mis``, ``seq_is``, ``geo``, ``none``, or any registered arm), with ``params`` bound (checked
    against :func:`~creditlab.core.correction.correction_params`). An unknown name or parameter
    raises :class:`ConfigError`."""
    from creditlab.core.correction import correction_params, get_correction

    fn = get_correction(arm)
    unknown = sorted(set(params) - set(correction_params(arm)))
    if unknown:
        accepted = ", ".join(correction_params(arm)) or "no parameters"
        raise ConfigError("correction", f"{arm} takes {accepted}, got {unknown}")

    def weights(old, rollout_lp, pm, vm=None):
        return fn(old, rollout_lp, pm, vm, **params)

    return weights


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
    """Advantage by name: grpo or a registered credit geometry (see make_advantage); a callable can be
    passed to train_grpo instead."""
    reward: str = "success"
    """Outcome reward: "success" (binary) or "progress" (field-level score)."""
    correction: str = "none"
    """Per-token weights: an arm of creditlab.core.correction.CORRECTIONS with its parameters, as the trainer
    integrations name one (``"tis"``, ``"mis:lo=0.3679,hi=inf"``: creditlab.core.correction.parse_correction);
    a callable can be passed to train_grpo instead."""
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
    clip_ratio_c: float | None = field(default=3.0, metadata={"absent": None})
    """Dual clip (verl's ``clip_ratio_c``, default 3 as verl's): for negative advantages the token loss is
    capped at ``-A * clip_ratio_c``, so a token the learner now finds far likelier than the sampler did cannot
    dominate the update. None: off (the protocol of runs stored before the field existed: a stored config
    without it reads as None)."""
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
    plant: float = field(default=0.0, metadata={"absent": 0.0})
    """Strength of the planted engine (0: none): the rollout engine shifts the logits of tool-call tokens at
    turn k by ``plant * (k + 1) * z`` (creditlab.train.toolshop_rollout.planted_direction), a mismatch of
    known size that grows with the turn; see :func:`~creditlab.train.toolshop_rollout.rollout`."""

    def __post_init__(self) -> None:
        from creditlab.core.correction import parse_correction

        for name in ("rollout_precision", "learner_precision"):  # parsed here, once; the error names the field
            object.__setattr__(self, name, EngineFormat.parse(getattr(self, name), name))
        if isinstance(self.correction, str):
            parse_correction(self.correction, "correction")
        if self.clip_ratio_c is not None and not float(self.clip_ratio_c) > 1.0:
            raise ConfigError("clip_ratio_c", f"must be > 1 (or None: off), got {self.clip_ratio_c}")
        if not (math.isfinite(float(self.plant)) and float(self.plant) >= 0):
            raise ConfigError("plant", f"must be a finite strength >= 0, got {self.plant}")
        if self.reward not in ("success", "progress"):
            raise ConfigError("reward", f"must be 'success' or 'progress', got {self.reward!r}")
        for name in ("updates", "tasks_per_update", "group_size", "minibatches", "epochs"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ConfigError("group_size", "GRPO needs at least 2 rollouts per task")


def task_seeds(cfg: GRPOConfig, update: int) -> list[int]:
    """The task seeds of one update (deterministic in ``cfg.seed`` and ``update``)."""
    rng = task_rng(cfg.seed, update)
    return [rng.randrange(EVAL_SEED_OFFSET) for _ in range(cfg.tasks_per_update)]


def train_grpo(model: TinyLM, cfg: GRPOConfig, *, advantage: AdvantageFn | None = None,
               weights: WeightFn | None = None,
               on_update: Callable[[dict[str, float]], None] | None = None,
               on_rollouts: Callable[[int, RolloutBatch, torch.Tensor, torch.Tensor], None] | None = None
               ) -> list[dict[str, float]]:
    """Train ``model`` in place with multi-turn GRPO; returns one metrics row per update.

    ``on_rollouts(update, batch, rewards, old_logprobs)`` is called with each update's rollouts
    before the update uses them (e.g. :func:`creditlab.train.toolshop_dump.dump_rollouts` for
    ``creditlab diagnose``).

    Each update: sample ``tasks_per_update`` tasks x ``group_size`` rollouts with the engine of
    ``rollout_precision``; ``old_logprobs`` from the learner (``learner_precision``, no grad);
    advantages from ``advantage`` (default: ``cfg.advantage``); per-token weights from ``weights``
    (default: ``cfg.correction``) applied as detached coefficients of the clipped token loss
    (:func:`creditlab.core.losses.policy_loss`); ``minibatches`` AdamW steps per epoch.
    Row keys: ``update``, ``reward/success``, ``reward/progress``, ``episode/*``, ``mismatch/*``
    (engine vs learner, :func:`creditlab.core.correction.mismatch_metrics`), ``correction/*``,
    ``loss/*``, ``grad_norm``, ``time/*`` and ``eval/*`` when evaluated.
    """
    adv_fn = advantage or make_advantage(cfg.advantage, generator=generator("grpo/sampling", cfg.seed))
    correction = weights or cfg.correction
    gen = generator("grpo/sampling", cfg.seed)  # the rollouts and minibatch order
    opt = adamw(model.parameters(), cfg.lr)
    rows: list[dict[str, float]] = []
    for k in range(cfg.updates):
        row: dict[str, float] = {"update": float(k)}
        if cfg.eval_every and k % cfg.eval_every == 0:
            row.update(_eval_grpo(model, cfg))
        t0 = time.perf_counter()
        # --- rollouts
        model.eval()
        batch = _rollouts(model, cfg, k, gen)
        t1 = time.perf_counter()
        pm, vm = batch.policy_mask, batch.valid_mask
        with torch.no_grad():
            old = sequence_logprobs(model, batch.tokens, cfg.learner_precision, cfg.temperature)
        # --- scores
        rewards = (batch.success if cfg.reward == "success" else batch.progress).float()
        if on_rollouts is not None:
            on_rollouts(k, batch, rewards, old)
        # --- advantages
        adv = adv_fn(batch, rewards, k)
        used = getattr(adv_fn, "params_at", None)
        row.update({f"adv/{n}": v for n, v in (used(k) if used is not None else {}).items()})
        if adv.dim() == 1:
            adv = adv[:, None].expand_as(old)
        # --- weights
        w, w_metrics = _correction(correction, old, batch.rollout_logprobs, pm, vm)
        row.update(w_metrics)
        # --- minibatch steps
        steps = _minibatch_steps(model, opt, cfg, batch, old, adv, w, gen)
        t2 = time.perf_counter()
        # --- metrics
        row.update({n: float(np.mean(v)) for n, v in steps.losses.items()})
        row.update(_update_metrics(batch, adv, float(np.mean(steps.grad_norms))))
        row.update({"time/rollout_s": t1 - t0, "time/update_s": t2 - t0,
                    "time/rollout_tokens_per_s": float(vm.sum()) / max(t1 - t0, 1e-9)})
        rows.append(row)
        if on_update is not None:
            on_update(row)
    return rows


def _eval_grpo(model: TinyLM, cfg: GRPOConfig) -> dict[str, float]:
    """``eval/*`` of :func:`train_grpo`: the held-out tasks, sampled with the rollout engine."""
    model.eval()
    ev = evaluate(model, range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + cfg.eval_tasks), cfg.chain_lengths,
                  precision=cfg.rollout_precision, seed=seed_stream("grpo/eval", cfg.seed), max_len=cfg.max_len,
                  max_turns=cfg.max_turns, max_action_len=cfg.max_action_len, temperature=cfg.temperature,
                  plant=cfg.plant)
    return {f"eval/{n}": v for n, v in ev.items()}


def _rollouts(model: TinyLM, cfg: GRPOConfig, update: int, gen: torch.Generator) -> RolloutBatch:
    """The rollouts of one update: ``group_size`` per task of :func:`task_seeds`, in contiguous groups."""
    G = cfg.group_size
    tasks = [t for t in make_tasks(task_seeds(cfg, update), cfg.chain_lengths) for _ in range(G)]
    return rollout(model, tasks, precision=cfg.rollout_precision, max_len=cfg.max_len, max_turns=cfg.max_turns,
                   max_action_len=cfg.max_action_len, temperature=cfg.temperature, generator=gen,
                   group_ids=[j // G for j in range(len(tasks))], plant=cfg.plant)


def _correction(correction: str | WeightFn, old: torch.Tensor, rollout_lp: torch.Tensor, pm: torch.Tensor,
                vm: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights and the row's ``mismatch/*`` and ``correction/*`` metrics of one batch.

    A registered arm (by name) runs :func:`creditlab.core.correction.correction_weights`: one call,
    one InterQ pass, ``correction/*`` from the arm and ``mismatch/*`` from
    :func:`~creditlab.core.correction.mismatch_metrics`. A callable :data:`WeightFn` gets
    ``mismatch_metrics`` beside it, merged by the same rule."""
    from creditlab.core.correction import correction_weights, mismatch_metrics, parse_correction

    if isinstance(correction, str):
        arm, params = parse_correction(correction, "correction")
        w, metrics = correction_weights(arm, old, rollout_lp, pm, vm, params=params)
        return w, {n: float(v) for n, v in metrics.items() if n.startswith(("mismatch/", "correction/"))}
    w, metrics = correction(old, rollout_lp, pm, vm)
    return w, {**mismatch_metrics(old, rollout_lp, pm, vm),
               **{n: v for n, v in metrics.items() if n.startswith("correction/")}}


class _StepStats(NamedTuple):
    """What the minibatch steps of one update report."""

    losses: dict[str, list[float]]
    """Each loss metric, one value per optimizer step."""
    grad_norms: list[float]
    """The gradient norm before clipping, one per optimizer step."""


def _minibatch_steps(model: TinyLM, opt: torch.optim.Optimizer, cfg: GRPOConfig, batch: RolloutBatch,
                     old: torch.Tensor, adv: torch.Tensor, w: torch.Tensor, gen: torch.Generator) -> _StepStats:
    """``epochs`` passes of ``minibatches`` clipped AdamW steps on the weighted clipped token loss."""
    from creditlab.core.losses import policy_loss

    pm = batch.policy_mask
    model.train()
    losses: dict[str, list[float]] = {}
    gnorms = []
    for _ in range(cfg.epochs):
        perm = torch.randperm(len(batch), generator=gen)
        for chunk in perm.chunk(cfg.minibatches):
            lp = sequence_logprobs(model, batch.tokens[chunk], cfg.learner_precision, cfg.temperature)
            loss, lm = policy_loss(lp, old[chunk], adv[chunk], pm[chunk], clip_low=cfg.clip_low,
                                   clip_high=cfg.clip_high, weights=w[chunk].to(lp.dtype), agg=cfg.agg,
                                   clip_ratio_c=cfg.clip_ratio_c)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)))
            opt.step()
            for n, v in lm.items():
                losses.setdefault(n, []).append(v)
    model.eval()
    return _StepStats(losses, gnorms)


def _update_metrics(batch: RolloutBatch, adv: torch.Tensor, grad_norm: float) -> dict[str, float]:
    """The per-update row of both trainers: rewards, episode shape, advantage size, gradient norm
    (``adv`` ``(B, L)`` per token)."""
    pm, vm = batch.policy_mask, batch.valid_mask
    n_policy = int(pm.sum())
    return {
        "reward/success": float(batch.success.mean()),
        "reward/progress": float(batch.progress.mean()),
        "episode/truncation_rate": float(batch.truncated.float().mean()),
        "episode/tool_calls": float(batch.n_calls.float().mean()),
        "episode/length": float(vm.sum(1).float().mean()),
        "episode/policy_tokens": float(n_policy) / len(batch),
        "adv/abs_mean": float(adv[pm].abs().mean()) if n_policy else 0.0,
        "grad_norm": grad_norm,
        **_entropy_metrics(batch),
    }


def _entropy_metrics(batch: RolloutBatch) -> dict[str, float]:
    """The engine's mean entropy (nats) on the sampled tokens; with thought tokens in the batch, also
    on the thoughts and on the rest (the tool calls) separately."""
    if batch.entropy is None or not bool(batch.policy_mask.any()):
        return {}
    pm, ent = batch.policy_mask, batch.entropy.float()
    out = {"policy/entropy": float(ent[pm].mean())}
    th = pm & thought_mask(batch.tokens)
    if bool(th.any()):
        out["policy/thought_entropy"] = float(ent[th].mean())
        out["policy/action_entropy"] = float(ent[pm & ~th].mean()) if bool((pm & ~th).any()) else float("nan")
        out["episode/thought_tokens"] = float(th.sum()) / len(batch)
    return out


# ----------------------------------------------------------------------------------------------
# M models as one program
# ----------------------------------------------------------------------------------------------

#: GRPOConfig fields each stacked model may set for itself; all others must agree (lock step).
PER_MODEL_FIELDS = ("rollout_precision", "learner_precision", "correction", "seed", "plant")


def _model_batch(batch: StackedRollout, m: int, group_size: int) -> RolloutBatch:
    """Model ``m``'s trajectories of a stacked rollout as a :class:`RolloutBatch` (groups of ``group_size``)."""
    B = batch.tokens.size(1)
    return RolloutBatch(tokens=batch.tokens[m], policy_mask=batch.policy_mask[m], valid_mask=batch.valid_mask[m],
                        rollout_logprobs=batch.rollout_logprobs[m], turn_ids=batch.turn_ids[m],
                        records=batch.records[m], success=batch.success[m], progress=batch.progress[m],
                        truncated=batch.truncated[m], n_calls=batch.n_calls[m], tasks=list(batch.tasks[m]),
                        group_ids=torch.arange(B) // group_size,
                        entropy=None if batch.entropy is None else batch.entropy[m])


def _uniforms(seeds: list[int], tag: str, update: int, B: int, L: int) -> torch.Tensor:
    """``(M, B, L)`` sampling uniforms: one stream per distinct seed, shared by the models that have it."""
    per = {s: torch.rand(B, L, generator=generator("grpo/uniforms", tag, s, update), dtype=torch.float64)
           for s in dict.fromkeys(seeds)}
    return torch.stack([per[s] for s in seeds])


def _stacked_eval(stack: StackedTinyLM, cfg: GRPOConfig, engine: _EvalEngine) -> dict[str, torch.Tensor]:
    """Held-out evaluation of every model on the same tasks with the same uniforms (common random
    numbers): per model success, progress, truncation, tool calls and their per-episode values."""
    M = stack.n_models
    seeds = list(range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + cfg.eval_tasks))
    tasks = make_tasks(seeds, cfg.chain_lengths)
    u = torch.rand(cfg.eval_tasks, cfg.max_len, generator=generator("grpo/eval_uniforms"), dtype=torch.float64)
    b = rollout_stacked(stack, [tasks] * M, u.expand(M, -1, -1), precision=engine.precision, max_len=cfg.max_len,
                        max_turns=cfg.max_turns, max_action_len=cfg.max_action_len, temperature=cfg.temperature,
                        plant=engine.plant)
    return {"success": b.success, "progress": b.progress, "truncated": b.truncated.float(),
            "n_calls": b.n_calls.float(), "budget": b.budget.float()}


class _EvalEngine(NamedTuple):
    """The engine a held-out evaluation samples with: one precision or one per model, and the planted
    strength(s); ``prefix`` of its row keys (``eval/``, or ``eval_fp32/`` for the one beside it)."""

    precision: str | tuple[str, ...]
    plant: float | tuple[float, ...]
    prefix: str


def _eval_row(ev: dict[str, torch.Tensor], m: int, prefix: str = "eval/") -> dict[str, float]:
    succ, calls = ev["success"][m], ev["n_calls"][m]
    fail = succ < 0.5
    row = {f"{prefix}{k}": float(ev[k][m].mean()) for k in ("success", "progress", "truncated", "n_calls")}
    # interaction cost: mean turns of the successful episodes; cap exhaustion: share of the failures
    # that used the whole action budget
    row[f"{prefix}interaction_cost"] = float(calls[~fail].mean()) if bool((~fail).any()) else float("nan")
    row[f"{prefix}cap_exhaustion"] = float((calls[fail] >= ev["budget"][m][fail]).float().mean()) \
        if bool(fail.any()) else float("nan")
    return row


def train_grpo_stacked(stack: StackedTinyLM, configs: list[GRPOConfig], *, eval_precision: str | None = "fp32",
                       eval_also: str | None = None,
                       on_update: Callable[[int, list[dict[str, float]]], None] | None = None,
                       on_rollouts: Callable[[int, int, RolloutBatch, torch.Tensor, torch.Tensor], None] | None = None,
                       checkpoint: str | os.PathLike[str] | None = None, checkpoint_every: int = 0
                       ) -> list[list[dict[str, float]]]:
    """Train the ``M`` models of ``stack`` in place with multi-turn GRPO, model ``m`` under
    ``configs[m]``; returns one list of rows per model (the keys of :func:`train_grpo`).

    ``on_rollouts(update, m, batch, rewards, old_logprobs)`` is called for each model with its
    rollouts of the update (a :class:`RolloutBatch`) before the update uses them, e.g.
    :func:`creditlab.train.toolshop_dump.dump_rollouts` for ``creditlab diagnose``.

    The configs may differ only in :data:`PER_MODEL_FIELDS`. Per update, every model runs what
    :func:`train_grpo` runs (rollouts with its engine, old log-probs with its learner, outcome GRPO
    advantages, its correction weights, ``minibatches`` AdamW steps with its own gradient-norm
    clip), all models in each tensor operation. Sampling is by inversion of the CDF from uniforms
    keyed by (seed, update), so it draws other trajectories than :func:`train_grpo`'s multinomial;
    models with the same seed share tasks, uniforms and minibatch order.

    Held-out evaluation every ``eval_every`` updates and after the last one (row ``update =
    updates``): every model on the same ``eval_tasks`` tasks with the same uniforms, with the
    engine of ``eval_precision`` (``fp32`` by default: the learned policy, not its engine; None:
    each model's rollout engine, its planted shift included: the paper's quantized endpoint).
    ``eval_also`` (e.g. ``"fp32"``): a second evaluation beside it at every point, on the same tasks and
    uniforms with that engine, in the keys ``eval_<eval_also>/*``; ``"engine"``: each model's own rollout
    engine (``eval_engine/*``). Eval rows add ``eval/interaction_cost`` (mean turns of
    successful episodes) and ``eval/cap_exhaustion`` (share of failures that used the whole action
    budget). ``time/*`` splits the update into rollout, learner log-probs, weights and metrics, and
    the optimisation; ``time/decode_steps`` counts the engine's positions.

    ``checkpoint`` (a file) with ``checkpoint_every = n``: every ``n`` updates the models, the
    optimizer and the rows so far are saved there (atomically), and a call that finds the file
    continues from it; every random draw is keyed by (seed, update), so an interrupted and resumed
    run gives the rows of an uninterrupted one (tested). The file names the configs it was saved
    with, and one saved with others is refused.
    """
    M = stack.n_models
    cfg = _check_stacked(configs, M, eval_precision)
    run = _StackedRun(stack, configs, cfg, eval_precision, eval_also)
    rows: list[list[dict[str, float]]] = [[] for _ in range(M)]
    start = 0
    if checkpoint is not None and Path(checkpoint).exists():
        start, rows = _load_checkpoint(checkpoint, stack, run.opt, configs)
    for k in range(start, cfg.updates):
        new = run.update(k, on_rollouts)
        for m in range(M):
            rows[m].append(new[m])
        if on_update is not None:
            on_update(k, new)
        if checkpoint is not None and checkpoint_every and (k + 1) % checkpoint_every == 0 and k + 1 < cfg.updates:
            _save_checkpoint(checkpoint, k + 1, rows, stack, run.opt, configs)
    final = [{"update": float(cfg.updates)} for _ in range(M)]
    _eval_into(final, stack, cfg, run.eval_engines)
    return [r + [f] for r, f in zip(rows, final, strict=True)]


class _StackedRun:
    """What every update of :func:`train_grpo_stacked` shares: the stack, its configs, the optimizer."""

    def __init__(self, stack: StackedTinyLM, configs: list[GRPOConfig], cfg: GRPOConfig, eval_precision: str | None,
                 eval_also: str | None = None):
        self.stack, self.configs, self.cfg, self.M = stack, configs, cfg, stack.n_models
        self.engines = tuple(c.rollout_precision for c in configs)
        self.learners = tuple(c.learner_precision for c in configs)
        self.seeds = [c.seed for c in configs]
        self.plants = tuple(float(c.plant) for c in configs)
        own = _EvalEngine(self.engines, self.plants, "eval/")
        self.eval_engines = [own if eval_precision is None else _EvalEngine(eval_precision, 0.0, "eval/")]
        if eval_also == "engine":
            self.eval_engines.append(own._replace(prefix="eval_engine/"))
        elif eval_also is not None:
            self.eval_engines.append(_EvalEngine(EngineFormat.parse(eval_also, "eval_also"), 0.0,
                                                 f"eval_{eval_also}/"))
        self.opt = adamw(stack.parameters(), cfg.lr)
        G, n_tasks = cfg.group_size, cfg.tasks_per_update
        self.B = G * n_tasks
        # groups never span models
        self.gids = (torch.arange(self.M)[:, None] * n_tasks + torch.arange(self.B)[None, :] // G).reshape(-1)

    def update(self, k: int, on_rollouts) -> list[dict[str, float]]:
        """Update ``k`` of every model: its rows (with the held-out evaluation when it is due)."""
        from creditlab.core.advantages import grpo_advantages

        stack, cfg, M, B, G = self.stack, self.cfg, self.M, self.B, self.cfg.group_size
        new = [{"update": float(k)} for _ in range(M)]
        t_eval = _eval_into(new, stack, cfg, self.eval_engines) if cfg.eval_every and k % cfg.eval_every == 0 else 0.0
        t0 = time.perf_counter()
        # --- rollouts
        batch = _stacked_rollouts(stack, cfg, self.seeds, k, self.engines, self.plants)
        t1 = time.perf_counter()
        pm, vm, rlp = batch.policy_mask, batch.valid_mask, batch.rollout_logprobs
        orders = _minibatch_orders(self.seeds, k, B, cfg)
        old = _stacked_old_logprobs(stack, batch.tokens, orders, self.learners, cfg)
        t2 = time.perf_counter()
        # --- scores
        rewards = (batch.success if cfg.reward == "success" else batch.progress).float()
        if on_rollouts is not None:
            for m in range(M):
                on_rollouts(k, m, _model_batch(batch, m, G), rewards[m], old.all[m])
        # --- advantages
        adv = grpo_advantages(rewards.reshape(-1), self.gids).view(M, B)
        # --- weights
        w = torch.ones_like(old.all)
        for m in range(M):  # one correction_weights call per model and batch
            w[m], w_metrics = _correction(self.configs[m].correction, old.all[m], rlp[m], pm[m], vm[m])
            new[m].update(w_metrics)
        t3 = time.perf_counter()
        # --- minibatch steps
        adv_tok = adv[:, :, None].expand_as(old.all)
        steps = _stacked_steps(stack, self.opt, cfg, batch.tokens, orders, old, adv_tok, pm, w, self.learners)
        t4 = time.perf_counter()
        # --- metrics
        gn = torch.stack(steps.grad_norms).mean(0)
        times = {"time/eval_s": t_eval, "time/rollout_s": t1 - t0, "time/old_logprobs_s": t2 - t1,
                 "time/weights_metrics_s": t3 - t2, "time/optimize_s": t4 - t3, "time/update_s": t4 - t0,
                 "time/decode_steps": float(batch.decode_steps)}
        for m in range(M):
            new[m].update({n: float(np.mean(v)) for n, v in steps.losses[m].items()})
            new[m].update({**_update_metrics(_model_batch(batch, m, G), adv_tok[m], float(gn[m])), **times})
        return new


def _configs_blob(configs: list[GRPOConfig]) -> str:
    return json.dumps([asdict(c) for c in configs], sort_keys=True, default=str)


def _save_checkpoint(path, k: int, rows, stack: StackedTinyLM, opt, configs: list[GRPOConfig]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save({"update": k, "rows": rows, "stack": stack.state_dict(), "opt": opt.state_dict(),
                "configs": _configs_blob(configs)}, tmp)
    os.replace(tmp, path)


def _load_checkpoint(path, stack: StackedTinyLM, opt, configs: list[GRPOConfig]):
    state = torch.load(path, weights_only=True)
    if state["configs"] != _configs_blob(configs):
        raise ConfigError("checkpoint", f"{path} was saved by a run with other configs; remove it to start over")
    stack.load_state_dict(state["stack"])
    opt.load_state_dict(state["opt"])
    return int(state["update"]), state["rows"]


def _stacked_rollouts(stack: StackedTinyLM, cfg: GRPOConfig, seeds: list[int], update: int,
                      engines: tuple[str, ...], plants: tuple[float, ...] = ()) -> StackedRollout:
    """One update's rollouts of every model: ``group_size`` per task of its seed's :func:`task_seeds`,
    sampled from the uniforms of its seed (common random numbers), the stack in eval mode."""
    stack.eval()
    G = cfg.group_size
    tasks = [[t for t in make_tasks(task_seeds(replace(cfg, seed=s), update), cfg.chain_lengths) for _ in range(G)]
             for s in seeds]
    B = G * cfg.tasks_per_update
    return rollout_stacked(stack, tasks, _uniforms(seeds, "train", update, B, cfg.max_len), precision=engines,
                           max_len=cfg.max_len, max_turns=cfg.max_turns, max_action_len=cfg.max_action_len,
                           temperature=cfg.temperature, plant=plants or 0.0)


def _eval_into(rows: list[dict[str, float]], stack: StackedTinyLM, cfg: GRPOConfig,
               engines: list[_EvalEngine]) -> float:
    """Add the held-out ``eval/*`` (and ``eval_<engine>/*``) of every model to its row of ``rows``; returns
    the seconds it took."""
    t0 = time.perf_counter()
    for engine in engines:
        ev = _stacked_eval(stack, cfg, engine)
        for m, row in enumerate(rows):
            row.update(_eval_row(ev, m, engine.prefix))
    return time.perf_counter() - t0


def _check_stacked(configs: list[GRPOConfig], M: int, eval_precision: str | None) -> GRPOConfig:
    """The shared config of a stack (``configs[0]``) once ``configs`` are valid for :func:`train_grpo_stacked`."""
    if len(configs) != M:
        raise ConfigError("configs", f"expected one GRPOConfig per stacked model ({M}), got {len(configs)}")
    base = configs[0]
    shared = [f for f in base.__dataclass_fields__ if f not in PER_MODEL_FIELDS]
    for c in configs[1:]:
        diff = [f for f in shared if getattr(c, f) != getattr(base, f)]
        if diff:
            raise ConfigError(diff[0], f"stacked models must agree on {diff}")
    if base.advantage != "grpo":
        raise ConfigError("advantage", "train_grpo_stacked runs outcome GRPO (advantage='grpo')")
    if eval_precision is not None:
        EngineFormat.parse(eval_precision, "eval_precision")
    return base


def _minibatch_orders(seeds: list[int], update: int, B: int, cfg: GRPOConfig) -> list[torch.Tensor]:
    """The ``(M, B / minibatches)`` row indices of every optimizer step of one update: one order per
    seed (models with the same seed share it), ``epochs`` permutations each cut into ``minibatches``."""
    perm_gen = {s: generator("grpo/perm", s, update) for s in dict.fromkeys(seeds)}
    orders = []
    for _ in range(cfg.epochs):
        perm = {s: torch.randperm(B, generator=g) for s, g in perm_gen.items()}
        orders += list(torch.stack([perm[s] for s in seeds]).chunk(cfg.minibatches, dim=1))
    return orders


def _take(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` ``(M, R)`` of each model of ``x`` ``(M, B, ...)``."""
    return x.gather(1, rows.view(rows.size(0), -1, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))


class _OldLogprobs(NamedTuple):
    """The learner's log-probs at the sampling checkpoint."""

    all: torch.Tensor
    """``(M, B, L)`` of every row, detached."""
    first: torch.Tensor
    """``(M, R, L)`` of the first minibatch's rows, with grad (its forward is the first step's)."""


def _stacked_old_logprobs(stack: StackedTinyLM, tokens: torch.Tensor, orders: list[torch.Tensor],
                          learners: tuple[str, ...], cfg: GRPOConfig) -> _OldLogprobs:
    """The first minibatch's forward runs before any step, so its log-probs are old_logprobs of
    those rows: only the other rows need a separate no-grad pass (same values, less work). Leaves the
    stack in train mode."""
    stack.train()
    first = orders[0]
    lp_first = stacked_logprobs(stack, _take(tokens, first), learners, cfg.temperature)
    rest = torch.cat(orders[1:cfg.minibatches], dim=1) if cfg.minibatches > 1 else None
    old = torch.zeros(tokens.shape, dtype=lp_first.dtype)
    old.scatter_(1, first[..., None].expand(-1, -1, old.size(2)), lp_first.detach())
    if rest is not None:
        with torch.no_grad():
            old.scatter_(1, rest[..., None].expand(-1, -1, old.size(2)),
                         stacked_logprobs(stack, _take(tokens, rest), learners, cfg.temperature))
    return _OldLogprobs(old, lp_first)


class _StackedStepStats(NamedTuple):
    """What the minibatch steps of one stacked update report."""

    losses: list[dict[str, list[float]]]
    """Per model, each loss metric, one value per optimizer step."""
    grad_norms: list[torch.Tensor]
    """Per optimizer step, the ``(M,)`` gradient norms before clipping."""


def _stacked_steps(stack: StackedTinyLM, opt: torch.optim.Optimizer, cfg: GRPOConfig, tokens: torch.Tensor,
                   orders: list[torch.Tensor], old: _OldLogprobs, adv_tok: torch.Tensor, pm: torch.Tensor,
                   w: torch.Tensor, learners: tuple[str, ...]) -> _StackedStepStats:
    """One AdamW step per minibatch order on the sum of the models' weighted clipped token losses,
    each model's gradient clipped to its own norm."""
    from creditlab.core.losses import policy_loss

    M = stack.n_models
    losses: list[dict[str, list[float]]] = [{} for _ in range(M)]
    gnorms: list[torch.Tensor] = []
    for j, rows in enumerate(orders):
        lp = old.first if j == 0 else stacked_logprobs(stack, _take(tokens, rows), learners, cfg.temperature)
        old_c, adv_c, pm_c, w_c = _take(old.all, rows), _take(adv_tok, rows), _take(pm, rows), _take(w, rows)
        total = lp.new_zeros(())
        for m in range(M):
            loss, lm = policy_loss(lp[m], old_c[m], adv_c[m], pm_c[m], clip_low=cfg.clip_low,
                                   clip_high=cfg.clip_high, weights=w_c[m].to(lp.dtype), agg=cfg.agg,
                                   clip_ratio_c=cfg.clip_ratio_c)
            total = total + loss
            for n, v in lm.items():
                losses[m].setdefault(n, []).append(float(v))
        opt.zero_grad(set_to_none=True)
        total.backward()
        gnorms.append(stack.clip_grad_norm_(cfg.grad_clip))
        opt.step()
    stack.eval()
    return _StackedStepStats(losses, gnorms)
