"""Vectorised hard-prerequisite chain: the smallest world where the shape of credit matters.

An episode has ``T`` steps; at each step the policy picks one of ``K`` actions. ``C`` of the steps
(at random positions, fixed per task) are *causal*, each with one correct action; the others do not
matter. The causal steps form a hard-prerequisite chain: causal step ``j`` only counts if causal
steps ``1..j-1`` were all correct. The reward is the length of the correct prefix of the chain
divided by ``C``.

Everything is batched over ``M`` independent tasks (one per model of a sweep: seeds x arms x
configurations) and ``G`` rollouts per task. Tasks are drawn from ``(seed, C)`` alone, so every arm
of a seed sees the same task (paired comparisons), whatever else shares its batch.

Two observation variants: *independent* (the policy sees only the step index) and *state-dependent*
(it also sees the current correct-prefix length and whether the chain is already broken).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from creditlab.errors import ConfigError

__all__ = ["ChainTasks", "chain_outcome", "exact_completion", "exact_score", "make_tasks", "obs_dim", "observe"]


@dataclass(frozen=True)
class ChainTasks:
    """A batch of ``M`` chain tasks (tensors on one device)."""

    T: int
    K: int
    C: torch.Tensor  # (M,) long: chain length of each task
    causal_pos: torch.Tensor  # (M, Cmax) long: positions of causal steps in chain order (padding: 0)
    causal_valid: torch.Tensor  # (M, Cmax) bool: real entries of causal_pos
    is_causal: torch.Tensor  # (M, T) bool
    order: torch.Tensor  # (M, T) long: index j of the causal step at t, -1 elsewhere
    correct: torch.Tensor  # (M, T) long: correct action at each step (only causal steps matter)

    @property
    def M(self) -> int:
        return int(self.C.shape[0])


def validate(T: int, C: int, K: int, k: int | None = None) -> None:
    """Raise :class:`ConfigError` naming the parameter for an impossible chain configuration."""
    if int(T) < 1:
        raise ConfigError("T", f"must be >= 1, got {T}")
    if int(C) < 1:
        raise ConfigError("C", f"must be >= 1, got {C}")
    if int(C) > int(T):
        raise ConfigError("C", f"the chain (C={C}) cannot be longer than the episode (T={T})")
    if int(K) < 2:
        raise ConfigError("K", f"needs at least 2 actions per step, got {K}")
    if k is not None and int(k) < 1:
        raise ConfigError("k", f"must be >= 1, got {k}")


def make_tasks(T: int, K: int, Cs: list[int], seeds: list[int]) -> ChainTasks:
    """Draw one task per ``(C, seed)`` pair; the draw depends only on ``(seed, C, T, K)``."""
    if len(Cs) != len(seeds):
        raise ConfigError("Cs", f"{len(Cs)} chain lengths for {len(seeds)} seeds")
    for C in Cs:
        validate(T, C, K)
    M, Cmax = len(Cs), max(Cs)
    causal_pos = torch.zeros(M, Cmax, dtype=torch.long)
    causal_valid = torch.zeros(M, Cmax, dtype=torch.bool)
    correct = torch.zeros(M, T, dtype=torch.long)
    for m, (C, seed) in enumerate(zip(Cs, seeds, strict=True)):
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(C) * 7919 + T * 31 + K)
        pos = torch.randperm(T, generator=g)[:C].sort().values
        causal_pos[m, :C] = pos
        causal_valid[m, :C] = True
        correct[m] = torch.randint(K, (T,), generator=g)
    is_causal = torch.zeros(M, T, dtype=torch.bool)
    order = torch.full((M, T), -1, dtype=torch.long)
    rows = torch.arange(M).unsqueeze(-1).expand(M, Cmax)
    idx = torch.arange(Cmax).expand(M, Cmax)
    is_causal[rows[causal_valid], causal_pos[causal_valid]] = True
    order[rows[causal_valid], causal_pos[causal_valid]] = idx[causal_valid]
    return ChainTasks(T=T, K=K, C=torch.tensor(Cs, dtype=torch.long), causal_pos=causal_pos,
                      causal_valid=causal_valid, is_causal=is_causal, order=order, correct=correct)


def chain_outcome(tasks: ChainTasks, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score rollouts.

    Args:
        actions: ``(M, G, T)`` long.

    Returns:
        reward ``(M, G)`` = correct-prefix length / C; ``step_correct`` ``(M, G, T)`` bool (causal step
        done right, regardless of the prefix: the *independent local* signal); ``progress``
        ``(M, G, T)`` float, 1 on the causal steps that extended the correct prefix (the state-diff
        verifier's progress delta), else 0.
    """
    M, G, T = actions.shape
    step_correct = (actions == tasks.correct.unsqueeze(1)) & tasks.is_causal.unsqueeze(1)
    at_causal = torch.gather(step_correct, 2, tasks.causal_pos.unsqueeze(1).expand(M, G, -1))
    at_causal = at_causal | ~tasks.causal_valid.unsqueeze(1)
    alive = torch.cumprod(at_causal.to(torch.int8), dim=2).bool() & tasks.causal_valid.unsqueeze(1)
    prefix = alive.sum(-1)  # (M, G)
    reward = prefix.to(torch.float32) / tasks.C.unsqueeze(1).to(torch.float32)
    progress = tasks.is_causal.unsqueeze(1) & (tasks.order.unsqueeze(1) < prefix.unsqueeze(-1))
    return reward, step_correct, progress.to(torch.float32)


def obs_dim(T: int, state_dependent: bool) -> int:
    """Observation size: one-hot step index, plus (state-dependent) one-hot prefix length 0..T and
    a broken-chain bit."""
    return T + (T + 2 if state_dependent else 0)


def observe(T: int, t: torch.Tensor, prefix: torch.Tensor | None = None,
            broken: torch.Tensor | None = None) -> torch.Tensor:
    """Observation vectors for step indices ``t`` (any shape ``S``), optionally with the state.
    Returns ``S + (obs_dim,)`` float32."""
    x = torch.nn.functional.one_hot(t, T).to(torch.float32)
    if prefix is None:
        return x
    p = torch.nn.functional.one_hot(prefix, T + 1).to(torch.float32)
    return torch.cat([x, p, broken.to(torch.float32).unsqueeze(-1)], dim=-1)


def exact_score(tasks: ChainTasks, p_correct_causal: torch.Tensor) -> torch.Tensor:
    """Expected reward ``(1/C) sum_j prod_{i<=j} p_i`` of a policy, from the probability ``p_j``
    ``(M, Cmax)`` that it takes the correct action at causal step ``j`` on the still-correct path
    (noise-free evaluation; padding entries are ignored)."""
    p = torch.where(tasks.causal_valid, p_correct_causal, torch.ones_like(p_correct_causal))
    alive = torch.cumprod(p, dim=-1) * tasks.causal_valid
    return alive.sum(-1) / tasks.C.to(p.dtype)


def exact_completion(tasks: ChainTasks, p_correct_causal: torch.Tensor) -> torch.Tensor:
    """Probability ``prod_j p_j`` ``(M,)`` that a policy completes the whole chain (reward 1: what a
    verifier of the final write sees), from the same ``p_j`` ``(M, Cmax)`` as :func:`exact_score`
    (padding entries are ignored)."""
    p = torch.where(tasks.causal_valid, p_correct_causal, torch.ones_like(p_correct_causal))
    return p.prod(-1)
