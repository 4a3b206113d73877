"""Batched GRPO training of many small chain policies at once (the engine of the coverage lab).

One call trains ``M`` models — every (configuration, arm, seed) of a sweep cell — as one tensor
program: a batched MLP policy per model, ``G`` rollouts per update, GRPO outcome advantages, one of
the credit geometries of :mod:`creditlab.core.credit` per model, a per-model global grad-norm clip
and Adam. Every arm gets the same total credit ``sum_t |a[i,t]| = |A_i|`` per rollout.

Randomness is drawn from one stream per seed (action noise, shuffle keys, random-step keys), shared by
every model with that seed, so the arms of a seed are paired (same task, same initial weights, same
noise) and a model's result does not depend on which other models share its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

import torch

from creditlab.core import credit as cr
from creditlab.core.advantages import grpo_advantages
from creditlab.envs.chain import (
    ChainTasks,
    chain_outcome,
    exact_completion,
    exact_score,
    make_tasks,
    obs_dim,
    observe,
    validate,
)
from creditlab.errors import ConfigError
from creditlab.models.batched_mlp import BatchedAdam, BatchedMLP
from creditlab.train.common import generator, single_thread

__all__ = ["ChainTrainConfig", "ModelSpec", "chain_step_batch", "pretrain_to_completion", "single_update",
           "single_update_from", "train_chain"]

# A model's credit arm is any geometry registered in creditlab.core.credit.GEOMETRIES. The chain
# world feeds every geometry the same StepBatch: the GRPO advantage A_i, the outcome reward, the
# progress the verifier can see as ``step_scores`` (dS on exposed causal steps), the exposed steps
# as ``selected`` and one stream of random keys; three arms read the world differently:
#   concentrated: ``selected`` = the first k causal steps;
#   targeted:     ``step_scores`` = local correctness of each step (seen on the exposed steps);
#   random_k:     ``keys`` from their own stream and ``k`` from the model spec.

EXPOSURES = ("independent", "prefix", "final")


@dataclass(frozen=True)
class ChainTrainConfig:
    """Training configuration shared by every model of a batch."""

    T: int = 12
    """Steps per episode."""
    K: int = 4
    """Actions per step."""
    hidden: int = 32
    """Hidden width of the MLP policy."""
    group: int = 16
    """Rollouts per update (one GRPO group per model)."""
    updates: int = 400
    """Policy updates."""
    lr: float = 0.03
    """Adam learning rate."""
    max_grad_norm: float = 1.0
    """Global grad-norm clip, per model."""
    adam_eps: float = 1e-8
    """Adam's epsilon."""
    state_dependent: bool = False
    """Policy also observes the correct-prefix length and a broken-chain bit."""
    eval_points: int = 20
    """Number of (noise-free, exact) evaluations over training, the last one at the end."""

    def validate(self) -> None:
        for name in ("T", "hidden", "group", "updates", "eval_points"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.K < 2:
            raise ConfigError("K", f"needs at least 2 actions per step, got {self.K}")
        if self.group < 2:
            raise ConfigError("group", f"GRPO needs at least 2 rollouts per group, got {self.group}")
        if not self.lr > 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr}")


@dataclass(frozen=True)
class ModelSpec:
    """One model of a batch: its task, its credit arm and the arm's parameters."""

    seed: int
    C: int
    arm: str
    k: int = 0
    """Steps that receive credit (``concentrated``: first k causal steps; ``random_k``: k random steps)."""
    vd: float = 1.0
    """Verifier density for ``targeted`` and ``per_turn``/``shuffled``: share of causal steps the
    verifier can judge (``targeted`` gets a local signal there; ``per_turn`` sees progress there)."""
    exposure: str = "independent"
    """``independent``: each causal step exposed with probability vd; ``prefix``: the first round(vd*C);
    ``final``: only the last causal step (a real tool agent's verifier sees the final write: V_d = 1/C;
    ``vd`` is ignored)."""

    def validate(self, T: int, K: int) -> None:
        if self.arm not in cr.GEOMETRIES:
            raise ConfigError("arm", f"unknown arm {self.arm!r}; valid (the registered credit geometries): "
                                     f"{', '.join(cr.GEOMETRIES)}")
        validate(T, self.C, K)
        if self.arm in ("concentrated", "random_k"):
            if self.k < 1:
                raise ConfigError("k", f"must be >= 1 for arm {self.arm!r}, got {self.k}")
            if self.k > T:
                raise ConfigError("k", f"must be <= T={T}, got {self.k}")
        if not 0.0 <= self.vd <= 1.0:
            raise ConfigError("vd", f"verifier density must be in [0, 1], got {self.vd}")
        if self.exposure not in EXPOSURES:
            raise ConfigError("exposure", f"unknown exposure {self.exposure!r}; valid: {', '.join(EXPOSURES)}")

    def row(self) -> dict:
        return asdict(self)


def _exposed_steps(tasks: ChainTasks, specs: list[ModelSpec]) -> torch.Tensor:
    """``(M, T)`` bool: causal steps the verifier can judge, fixed per (seed, C). Independent
    exposure uses one uniform draw per causal step, so exposure sets are nested in vd."""
    M, T = tasks.M, tasks.T
    exposed = torch.zeros(M, T, dtype=torch.bool)
    for m, s in enumerate(specs):
        C = s.C
        if s.exposure == "independent":
            ok = torch.rand(C, generator=generator("chain/exposure", s.seed, C)) < s.vd
        elif s.exposure == "final":
            ok = torch.arange(C) == C - 1
        else:
            ok = torch.arange(C) < round(s.vd * C)
        exposed[m, tasks.causal_pos[m, :C][ok]] = True
    return exposed


def train_chain(specs: list[ModelSpec], cfg: ChainTrainConfig) -> dict[str, torch.Tensor]:
    """Train one model per spec; returns ``final_score`` ``(M,)``, ``curve`` ``(M, E)`` (exact expected
    reward at ``eval_at``), ``eval_at`` ``(E,)`` and ``train_reward`` ``(M, updates)``."""
    with single_thread():
        return _train_chain(specs, cfg)


def _check(specs: list[ModelSpec], cfg: ChainTrainConfig, what: str) -> None:
    cfg.validate()
    if not specs:
        raise ConfigError("specs", f"no model to {what}")
    for s in specs:
        s.validate(cfg.T, cfg.K)


class _Noise(NamedTuple):
    """The uniforms of one update, ``(M, G, T)`` each, drawn from the model's seed stream."""

    act: torch.Tensor
    """Action sampling (inverse CDF)."""
    shuffle_keys: torch.Tensor
    """Keys of the ``shuffled`` arm (and of every other arm's ``keys`` field)."""
    step_keys: torch.Tensor
    """Keys of the ``random_k`` arm."""


def _draw_noise(streams: list[torch.Generator], stream_idx: torch.Tensor, G: int, T: int) -> _Noise:
    noise = torch.stack([torch.rand(3, G, T, generator=g) for g in streams])[stream_idx]  # (M, 3, G, T)
    return _Noise(noise[:, 0], noise[:, 1], noise[:, 2])


class _Rollouts(NamedTuple):
    """``G`` rollouts of every model and what the policy gradient needs of them."""

    x: torch.Tensor
    """Observations the policy saw: ``(M, T, T)`` (independent steps) or ``(M, G*T, obs)``."""
    h: torch.Tensor
    """Hidden activations of the policy at ``x`` (for :meth:`BatchedMLP.backward`)."""
    probs: torch.Tensor
    """Action probabilities at ``x``."""
    actions: torch.Tensor
    """``(M, G, T)`` sampled actions."""
    reward: torch.Tensor
    """``(M, G)`` outcome reward."""
    step_correct: torch.Tensor
    """``(M, G, T)`` local correctness of each step."""
    progress: torch.Tensor
    """``(M, G, T)`` progress of each step."""


def _rollouts(policy: BatchedMLP, tasks: ChainTasks, act_noise: torch.Tensor, x_static: torch.Tensor | None
              ) -> _Rollouts:
    """Sample ``G`` rollouts per model by inverse-CDF sampling from ``act_noise`` ``(M, G, T)``;
    ``x_static`` the step-index observations of independent-step chains (None: state-dependent)."""
    M, G, T = act_noise.shape
    if x_static is not None:
        logits, h = policy.forward(x_static)  # (M, T, K): the observation is the step index only
        probs = torch.softmax(logits, -1)
        cdf = probs.cumsum(-1).unsqueeze(1)  # (M, 1, T, K)
        actions = (act_noise.unsqueeze(-1) > cdf[..., :-1]).sum(-1)  # inverse-CDF sampling
        x_used = x_static
    else:
        prefix = torch.zeros(M, G, dtype=torch.long)
        broken = torch.zeros(M, G, dtype=torch.bool)
        xs, acts = [], []
        for t in range(T):
            x_t = observe(T, torch.full((M, G), t), prefix, broken)
            lg, _ = policy.forward(x_t)
            cdf = torch.softmax(lg, -1).cumsum(-1)
            a_t = (act_noise[:, :, t].unsqueeze(-1) > cdf[..., :-1]).sum(-1)
            causal_t = tasks.is_causal[:, t].unsqueeze(1)
            ok = a_t == tasks.correct[:, t].unsqueeze(1)
            prefix = prefix + (causal_t & ok & ~broken).long()
            broken = broken | (causal_t & ~ok)
            xs.append(x_t)
            acts.append(a_t)
        x_used = torch.stack(xs, 2).reshape(M, G * T, -1)
        actions = torch.stack(acts, 2)
        logits, h = policy.forward(x_used)
        probs = torch.softmax(logits, -1)
    reward, step_correct, progress = chain_outcome(tasks, actions)
    return _Rollouts(x_used, h, probs, actions, reward, step_correct, progress)


class _Arms(NamedTuple):
    """The models of each credit arm and the per-model world tensors the arms read."""

    rows: dict[str, torch.Tensor]
    """Model indices of each arm, arms in first-seen order."""
    k_col: torch.Tensor
    """``(M, 1, 1)`` each model's ``k``."""
    first_k: torch.Tensor
    """``(M, T)`` the first ``k`` causal steps (``concentrated``)."""
    exposed: torch.Tensor
    """``(M, T)`` the causal steps the verifier can judge."""


def _arms(specs: list[ModelSpec], tasks: ChainTasks) -> _Arms:
    M = len(specs)
    arms = [s.arm for s in specs]
    rows = {a: torch.tensor([i for i, x in enumerate(arms) if x == a]) for a in dict.fromkeys(arms)}
    k_col = torch.tensor([s.k for s in specs]).view(M, 1, 1)
    first_k = tasks.is_causal & (tasks.order < k_col.view(M, 1))  # concentrated selection
    return _Arms(rows, k_col, first_k, _exposed_steps(tasks, specs))


def _credit(arms: _Arms, advantages: torch.Tensor, ro: _Rollouts, noise: _Noise) -> torch.Tensor:
    """``(M, G, T)`` credit of every model: its arm's geometry over the GRPO ``advantages`` ``(M*G,)``."""
    M, G, T = ro.actions.shape
    credit = torch.zeros(M, G, T)
    for arm, rows in arms.rows.items():
        batch, params = chain_step_batch(arm, rows, G, advantages.view(M, G)[rows].reshape(-1), reward=ro.reward,
                                         progress=ro.progress, step_correct=ro.step_correct, exposed=arms.exposed,
                                         first_k=arms.first_k, k_col=arms.k_col, shuffle_keys=noise.shuffle_keys,
                                         step_keys=noise.step_keys)
        credit[rows] = cr.get_geometry(arm)(batch, **params).view(len(rows), G, T)
    return credit


def _train_chain(specs: list[ModelSpec], cfg: ChainTrainConfig,
                 watch: Callable[[int, BatchedMLP], bool] | None = None) -> dict[str, torch.Tensor]:
    """``watch(u, policy)``: called before the first update (``u = 0``) and after update ``u``;
    training stops when it returns True (it must not draw from the seed streams)."""
    _check(specs, cfg, "train")
    T, K, G = cfg.T, cfg.K, cfg.group
    M = len(specs)
    tasks = make_tasks(T, K, [s.C for s in specs], [s.seed for s in specs])
    seeds = sorted({s.seed for s in specs})
    seed_idx = torch.tensor([seeds.index(s.seed) for s in specs])
    streams = [generator("chain/train", sd) for sd in seeds]
    policy = BatchedMLP.init([s.seed for s in specs], obs_dim(T, cfg.state_dependent), cfg.hidden, K)
    opt = BatchedAdam(policy, cfg.lr, cfg.max_grad_norm, eps=cfg.adam_eps)
    arms = _arms(specs, tasks)
    group_ids = torch.arange(M).repeat_interleave(G)
    eval_at = torch.unique(torch.linspace(0, cfg.updates, cfg.eval_points + 1).round().long()[1:])
    curve = torch.zeros(M, len(eval_at))
    train_reward = torch.zeros(M, cfg.updates)
    x_static = observe(T, torch.arange(T)).expand(M, T, T) if not cfg.state_dependent else None

    e = 0
    stop = watch is not None and watch(0, policy)
    for u in range(0 if stop else cfg.updates):
        noise = _draw_noise(streams, seed_idx, G, T)
        # --- rollouts
        ro = _rollouts(policy, tasks, noise.act, x_static)
        # --- scores
        train_reward[:, u] = ro.reward.mean(1)
        # --- advantages (flattened B = M * G rollouts)
        A = grpo_advantages(ro.reward.reshape(-1), group_ids)
        # --- weights: each model's credit geometry
        credit = _credit(arms, A, ro, noise)
        # --- step: the policy gradient of L = -(1/G) sum_{g,t} a[g,t] log pi(a_gt | s_gt), one Adam step
        opt.step(policy.backward(ro.x, ro.h, _dlogits(credit, ro.actions, ro.probs, cfg.state_dependent)))
        # --- metrics: exact evaluation at the eval points
        if e < len(eval_at) and u + 1 == int(eval_at[e]):
            curve[:, e] = _exact_eval(policy, tasks, cfg.state_dependent)
            e += 1
        if watch is not None and watch(u + 1, policy):
            break
    return {"final_score": curve[:, -1].clone(), "curve": curve, "eval_at": eval_at, "train_reward": train_reward,
            "policy": policy}


def _exact_eval(policy: BatchedMLP, tasks: ChainTasks, state_dependent: bool) -> torch.Tensor:
    """Exact expected reward ``(M,)`` of each model's (sampling) policy: no rollout noise."""
    return exact_score(tasks, _p_causal(policy, tasks, state_dependent))


def _exact_completion(policy: BatchedMLP, tasks: ChainTasks) -> torch.Tensor:
    """Exact chain completion ``(M,)`` (probability of reward 1) of each independent-step policy."""
    return exact_completion(tasks, _p_causal(policy, tasks, False))


def _p_causal(policy: BatchedMLP, tasks: ChainTasks, state_dependent: bool) -> torch.Tensor:
    """``(M, Cmax)`` probability of the correct action at each causal step on the still-correct path."""
    M, T = tasks.M, tasks.T
    if not state_dependent:
        logits, _ = policy.forward(observe(T, torch.arange(T)).expand(M, T, T))
        p = torch.softmax(logits, -1).gather(2, tasks.correct.unsqueeze(-1)).squeeze(-1)  # (M, T)
        p_causal = p.gather(1, tasks.causal_pos)
    else:  # on the still-correct path, causal step j is seen with prefix j and unbroken
        j = torch.arange(tasks.causal_pos.shape[1]).expand(M, -1)
        x = observe(T, tasks.causal_pos, j, torch.zeros_like(j, dtype=torch.bool))
        logits, _ = policy.forward(x)
        corr = tasks.correct.gather(1, tasks.causal_pos)
        p_causal = torch.softmax(logits, -1).gather(2, corr.unsqueeze(-1)).squeeze(-1)
    return p_causal


def _dlogits(credit: torch.Tensor, actions: torch.Tensor, probs: torch.Tensor, state_dependent: bool) -> torch.Tensor:
    """Gradient w.r.t. the logits of ``L = -(1/G) sum_{g,t} a[g,t] log pi(a_gt | s_gt)``.

    ``credit``/``actions`` ``(M, G, T)``; ``probs`` ``(M, T, K)`` (independent-step observations: one
    distribution per step, shared by the rollouts) or ``(M, G*T, K)`` (state-dependent)."""
    M, G, T = credit.shape
    K = probs.shape[-1]
    onehot = torch.nn.functional.one_hot(actions, K).to(probs.dtype)  # (M, G, T, K)
    if not state_dependent:
        return -(torch.einsum("mgt,mgtk->mtk", credit, onehot) - probs * credit.sum(1).unsqueeze(-1)) / G
    dl = -(credit.unsqueeze(-1) * (onehot - probs.view(M, G, T, K))) / G
    return dl.reshape(M, G * T, K)


def single_update(specs: list[ModelSpec], cfg: ChainTrainConfig, *, base_updates: int, step: float,
                  clip: float, rollouts: int | None = None) -> dict[str, torch.Tensor]:
    """One policy update per spec from shared rollouts of a partly trained base policy.

    The protocol of a single-update comparison of credit geometries: for each (seed, C) a base policy
    is trained with uniform credit for ``base_updates`` updates (Adam, ``cfg``); every spec of that
    (seed, C) starts from the same base weights and sees the same ``rollouts`` rollouts (default
    ``cfg.group``: the same actions, rewards and group-normalised advantages); only the credit
    geometry differs. Each arm's
    gradient is clipped to the global norm ``clip`` (when it binds for every arm, every update has the
    same size and only its direction differs) and applied as one SGD step of size ``step``.
    Independent-step chains only.

    Returns ``before`` / ``after`` ``(M,)`` exact expected reward of each spec's policy before and
    after its update, ``grad_norm`` ``(M,)`` before clipping and ``binding`` ``(M,)`` (``norm > clip``).
    """
    with single_thread():
        return _single_update(specs, cfg, base_updates, step, clip, rollouts or cfg.group)


def _single_update(specs, cfg, base_updates, step, clip, G):
    _check(specs, cfg, "update")
    if cfg.state_dependent:
        raise ConfigError("state_dependent", "single_update supports independent-step chains only")
    if base_updates < 1 or not step > 0 or not clip > 0:
        raise ConfigError("single_update", f"needs base_updates >= 1, step > 0, clip > 0; got "
                                           f"{base_updates}, {step}, {clip}")
    if G < 2:
        raise ConfigError("rollouts", f"GRPO needs at least 2 rollouts, got {G}")
    bases = sorted({(s.seed, s.C) for s in specs})
    base = _train_chain([ModelSpec(seed=sd, C=C, arm="uniform") for sd, C in bases],
                        replace(cfg, updates=base_updates, eval_points=1))["policy"]
    return _one_update(base, bases, specs, cfg, step, clip, G)


def single_update_from(base: BatchedMLP, base_keys: list[tuple[int, int]], specs: list[ModelSpec],
                       cfg: ChainTrainConfig, *, step: float, clip: float, rollouts: int | None = None
                       ) -> dict[str, torch.Tensor]:
    """:func:`single_update` from given base policies: row ``b`` of ``base`` is the base of every spec
    with ``(seed, C) == base_keys[b]`` (e.g. the snapshots of :func:`pretrain_to_completion`).

    The rollouts of a base are drawn from the same stream as :func:`single_update`'s for its
    ``(seed, C)``; the returned dict also has ``completion_before`` / ``completion_after`` ``(M,)``,
    the exact chain completion."""
    with single_thread():
        _check(specs, cfg, "update")
        G = rollouts or cfg.group
        if cfg.state_dependent:
            raise ConfigError("state_dependent", "single_update supports independent-step chains only")
        if not step > 0 or not clip > 0 or G < 2:
            raise ConfigError("single_update", f"needs step > 0, clip > 0, rollouts >= 2; got {step}, {clip}, {G}")
        keys = [(int(sd), int(C)) for sd, C in base_keys]
        if len(set(keys)) != len(keys) or len(keys) != base.W1.shape[0]:
            raise ConfigError("base_keys", f"needs one distinct (seed, C) per base row ({base.W1.shape[0]}), "
                                           f"got {len(keys)} ({len(set(keys))} distinct)")
        missing = sorted({(s.seed, s.C) for s in specs} - set(keys))
        if missing:
            raise ConfigError("base_keys", f"no base policy for (seed, C) {missing[:3]}")
        return _one_update(base, keys, specs, cfg, step, clip, G)


def _one_update(base: BatchedMLP, bases: list[tuple[int, int]], specs: list[ModelSpec], cfg: ChainTrainConfig,
                step: float, clip: float, G: int) -> dict[str, torch.Tensor]:
    """One clipped SGD step per spec from the base row of its (seed, C), on shared rollouts."""
    T = cfg.T
    M = len(specs)
    idx = torch.tensor([bases.index((s.seed, s.C)) for s in specs])
    policy = BatchedMLP(**{k: v[idx].clone() for k, v in base.params().items()})
    tasks = make_tasks(T, cfg.K, [s.C for s in specs], [s.seed for s in specs])
    # one stream per (seed, C), distinct from the training streams: the arms of a base share rollouts
    noise = _draw_noise([generator("chain/single_update", sd, C) for sd, C in bases], idx, G, T)
    before, completion_before = _exact_eval(policy, tasks, False), _exact_completion(policy, tasks)
    # --- rollouts and scores
    ro = _rollouts(policy, tasks, noise.act, observe(T, torch.arange(T)).expand(M, T, T))
    # --- advantages
    A = grpo_advantages(ro.reward.reshape(-1), torch.arange(M).repeat_interleave(G))
    # --- weights: each spec's credit geometry
    credit = _credit(_arms(specs, tasks), A, ro, noise)
    # --- step: one clipped SGD step per spec
    grads = policy.backward(ro.x, ro.h, _dlogits(credit, ro.actions, ro.probs, False))
    norm = torch.sqrt(sum((g.reshape(M, -1) ** 2).sum(-1) for g in grads.values()))
    coef = (clip / norm.clamp_min(1e-12)).clamp(max=1.0)
    for k, g in grads.items():
        getattr(policy, k).sub_(g * (step * coef).view(M, *([1] * (g.dim() - 1))))
    # --- metrics
    return {"before": before, "after": _exact_eval(policy, tasks, False), "grad_norm": norm, "binding": norm > clip,
            "completion_before": completion_before, "completion_after": _exact_completion(policy, tasks),
            "rollout_completion": (ro.reward >= 1).float().mean(1)}


def pretrain_to_completion(seeds: list[int], C: int, cfg: ChainTrainConfig, *, targets: tuple[float, ...],
                           max_updates: int) -> dict:
    """Base policies at fixed capability points: for each seed, the uniform-credit GRPO run of
    :func:`train_chain` (Adam, ``cfg``, the seed's own training stream) on the chain ``(seed, C)``,
    its policy snapshotted at the first update after which the exact chain completion (probability
    of reward 1; no rollout noise) is ``>= target``, for each of ``targets``.

    The rule stops at the first crossing, so each snapshot's completion is at or just above its
    target (by at most one update's change). A seed that does not reach a target within
    ``max_updates`` updates keeps its final policy there, with ``updates = -1``.

    Returns ``policies`` (one :class:`BatchedMLP` per target, one row per seed), ``updates``
    ``(n_targets, S)`` long (pre-training updates the snapshot took; 0: the initial policy),
    ``completion`` and ``score`` ``(n_targets, S)`` (exact completion and expected reward of the
    snapshot) and ``reached`` ``(n_targets, S)`` bool.
    """
    if not targets or any(not 0.0 < t <= 1.0 for t in targets):
        raise ConfigError("targets", f"completion targets must be in (0, 1], got {targets}")
    if max_updates < 1:
        raise ConfigError("max_updates", f"must be >= 1, got {max_updates}")
    specs = [ModelSpec(seed=int(sd), C=C, arm="uniform") for sd in seeds]
    _check(specs, cfg, "pre-train")
    if cfg.state_dependent:
        raise ConfigError("state_dependent", "pretrain_to_completion supports independent-step chains only")
    tasks = make_tasks(cfg.T, cfg.K, [C] * len(specs), [s.seed for s in specs])
    updates = torch.full((len(targets), len(specs)), -1, dtype=torch.long)
    snaps: list[dict[str, torch.Tensor]] = []

    def watch(u: int, policy: BatchedMLP) -> bool:
        if not snaps:
            snaps.extend({k: v.clone() for k, v in policy.params().items()} for _ in targets)
        completion = _exact_completion(policy, tasks)
        for i, target in enumerate(targets):
            new = (updates[i] < 0) & (completion >= target)
            for k, v in policy.params().items():
                snaps[i][k][new] = v[new]
            updates[i][new] = u
        return bool((updates >= 0).all())

    with single_thread():
        final = _train_chain(specs, replace(cfg, updates=max_updates, eval_points=1), watch)["policy"]
        policies = []
        for i, snap in enumerate(snaps):
            for k, v in final.params().items():
                snap[k][updates[i] < 0] = v[updates[i] < 0]
            policies.append(BatchedMLP(**snap))
        completion = torch.stack([_exact_completion(p, tasks) for p in policies])
        score = torch.stack([_exact_eval(p, tasks, False) for p in policies])
    return {"policies": policies, "updates": updates, "completion": completion, "score": score,
            "reached": updates >= 0}


def chain_step_batch(arm: str, rows: torch.Tensor, G: int, advantages: torch.Tensor, *, reward: torch.Tensor,
                     progress: torch.Tensor, step_correct: torch.Tensor, exposed: torch.Tensor,
                     first_k: torch.Tensor, k_col: torch.Tensor, shuffle_keys: torch.Tensor,
                     step_keys: torch.Tensor) -> tuple[cr.StepBatch, dict]:
    """The :class:`~creditlab.core.credit.StepBatch` (and geometry parameters) of the models ``rows``
    that share credit arm ``arm``: ``R = len(rows)`` models x ``G`` rollouts, flattened to ``R*G`` rows
    in contiguous groups of ``G`` (see the comment at the top of this module for what each arm reads).

    World tensors: ``reward`` ``(M, G)``, ``progress`` / ``step_correct`` / keys ``(M, G, T)``,
    ``exposed`` / ``first_k`` ``(M, T)``, ``k_col`` ``(M, 1, 1)``.
    """
    R, T = len(rows), exposed.shape[1]
    n = R * G
    step_mask = torch.ones(n, T, dtype=torch.bool)
    group_ids = torch.arange(R).repeat_interleave(G)
    seen = progress[rows] * exposed[rows].unsqueeze(1)  # (R, G, T) progress the verifier can see
    fields = {"advantages": advantages, "rewards": reward[rows].reshape(n), "step_scores": seen.reshape(n, T),
              "selected": exposed[rows].repeat_interleave(G, 0), "keys": shuffle_keys[rows].reshape(n, T)}
    params: dict = {}
    if arm == "concentrated":
        fields["selected"] = first_k[rows].repeat_interleave(G, 0)
    elif arm == "targeted":
        fields["step_scores"] = step_correct[rows].float().reshape(n, T)
    elif arm == "random_k":
        fields["keys"] = step_keys[rows].reshape(n, T)
        params["k"] = k_col[rows].reshape(R).repeat_interleave(G)
    return cr.StepBatch(step_mask, group_ids, **fields), params
