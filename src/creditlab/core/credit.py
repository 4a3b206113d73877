"""Credit geometries: how a trajectory's terminal advantage is spread over its steps.

Every function works on a ``(B, T)`` step tensor with a boolean ``step_mask`` (True on real
steps; a step is a turn or an action segment) and returns ``(B, T)`` per-step credit that is 0 on
masked steps. ``advantages`` is ``(B,)`` (e.g. :func:`creditlab.core.advantages.grpo_advantages`).

With ``conserve=True`` each rollout's credit satisfies ``sum_t |a[i,t]| = |A_i|`` (all arms get the
same total credit, so comparisons between shapes are at equal budget); with ``conserve=False`` the
unnormalised shape is returned (e.g. plain GRPO broadcast, ``A_i`` on every step).

Shapes follow DESIGN.md section 1:

* uniform: ``a[i,t] = A_i / T_i``  (``conserve=False``: ``A_i``)
* per_turn: ``a[i,t] = A_i dS[i,t] / sum_u dS[i,u]``, uniform fallback when ``sum dS = 0``
* concentrated(selected): ``a[i,t] = A_i / k_i`` on the ``k_i`` selected steps (uniform fallback
  when none is selected)
* shuffled: a row's credit permuted to random real steps of the same row (same concentration, no
  targeting information) — the control for any "targeted credit aims well" claim
* binary / discretized: outcome rounded to {0,1} / to a few levels, then GRPO, then uniform
* reward_to_go: ``a[i,t] = (sum_{u>=t} r[i,u] - mean_g R) / (std_g R + eps)`` with
  ``R_i = sum_u r[i,u]``; with terminal-only reward it is constant over t, i.e. uniform.
"""

from __future__ import annotations

import torch

from creditlab.core._checks import check_scalar, check_tensor
from creditlab.core.advantages import group_stats, grpo_advantages
from creditlab.errors import InputError

__all__ = [
    "binary",
    "concentrated",
    "conserve_credit",
    "discretized",
    "per_turn",
    "reward_to_go",
    "shuffled",
    "uniform",
]


def _check_adv_mask(advantages: torch.Tensor, step_mask: torch.Tensor) -> dict[str, int]:
    dims: dict[str, int] = {}
    check_tensor("step_mask", step_mask, shape=("B", "T"), boolean=True, dims=dims)
    check_tensor("advantages", advantages, shape=("B",), floating=True, finite=True, dims=dims)
    return dims


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x))


def _spread(advantages: torch.Tensor, weights: torch.Tensor, step_mask: torch.Tensor) -> torch.Tensor:
    """``A_i * w[i,t] / sum_u w[i,u]`` on real steps, uniform where the row's weight sum is 0."""
    w = torch.where(step_mask, weights, torch.zeros_like(weights))
    total = w.sum(-1, keepdim=True)
    n = step_mask.sum(-1, keepdim=True).clamp_min(1).to(w.dtype)
    share = torch.where(total > 0, w / torch.where(total > 0, total, torch.ones_like(total)), step_mask / n)
    return _masked(advantages.unsqueeze(-1) * share, step_mask)


def uniform(advantages: torch.Tensor, step_mask: torch.Tensor, *, conserve: bool = True) -> torch.Tensor:
    """Same credit on every real step: ``A_i / T_i`` (``conserve``) or ``A_i`` (GRPO broadcast).

    >>> uniform(torch.tensor([2.0, -1.0]), torch.tensor([[True, True], [True, False]]))
    tensor([[ 1.,  1.],
            [-1.,  0.]])
    """
    _check_adv_mask(advantages, step_mask)
    if conserve:
        return _spread(advantages, step_mask.to(advantages.dtype), step_mask)
    return _masked(advantages.unsqueeze(-1).expand_as(step_mask).clone(), step_mask)


def per_turn(advantages: torch.Tensor, progress_deltas: torch.Tensor, step_mask: torch.Tensor, *,
             conserve: bool = True) -> torch.Tensor:
    """Credit only where the verifier saw progress: ``A_i dS[i,t] / sum_u dS[i,u]``.

    ``progress_deltas`` ``(B, T)``: non-negative progress gained at each step (e.g. the increase of a
    state-diff verifier's score). Rows with no progress fall back to uniform. With
    ``conserve=False`` the weights are ``dS`` itself (``A_i dS[i,t]``), uniform ``A_i`` fallback.
    """
    dims = _check_adv_mask(advantages, step_mask)
    check_tensor("progress_deltas", progress_deltas, shape=("B", "T"), floating=True, finite=True,
                 finite_where=step_mask, dims=dims)
    dS = torch.where(step_mask, progress_deltas, torch.zeros_like(progress_deltas)).to(advantages.dtype)
    if bool((dS < 0).any()):
        raise InputError("progress_deltas: must be >= 0 on real steps (take the positive part of the progress)")
    if conserve:
        return _spread(advantages, dS, step_mask)
    has = dS.sum(-1, keepdim=True) > 0
    return _masked(advantages.unsqueeze(-1) * torch.where(has, dS, step_mask.to(dS.dtype)), step_mask)


def concentrated(advantages: torch.Tensor, selected_mask: torch.Tensor, step_mask: torch.Tensor, *,
                 conserve: bool = True) -> torch.Tensor:
    """Credit only on the selected steps (``A_i / k_i`` each), uniform fallback when none is selected.

    >>> concentrated(torch.tensor([3.0]), torch.tensor([[True, False, True]]), torch.tensor([[True] * 3]))
    tensor([[1.5000, 0.0000, 1.5000]])
    """
    dims = _check_adv_mask(advantages, step_mask)
    check_tensor("selected_mask", selected_mask, shape=("B", "T"), boolean=True, dims=dims)
    sel = (selected_mask & step_mask).to(advantages.dtype)
    if conserve:
        return _spread(advantages, sel, step_mask)
    has = sel.sum(-1, keepdim=True) > 0
    return _masked(advantages.unsqueeze(-1) * torch.where(has, sel, step_mask.to(sel.dtype)), step_mask)


def shuffled(credit: torch.Tensor, step_mask: torch.Tensor, generator: torch.Generator | None = None, *,
             keys: torch.Tensor | None = None) -> torch.Tensor:
    """Permute each row's credit among that row's real steps, uniformly at random.

    Matches the concentration (the multiset of per-step values, hence ``sum |a|``) of ``credit``
    and removes its targeting information. Masked steps stay 0. ``keys`` ``(B, T)``: optional
    uniform random keys to use instead of drawing from ``generator`` (so a caller can keep one
    random stream per seed); the permutation sorts the real steps by key.
    """
    dims: dict[str, int] = {}
    check_tensor("step_mask", step_mask, shape=("B", "T"), boolean=True, dims=dims)
    check_tensor("credit", credit, shape=("B", "T"), floating=True, finite=True, finite_where=step_mask, dims=dims)
    B, T = step_mask.shape
    # source order: real steps first, in order; destination order: real steps first, at random
    idx = torch.arange(T, device=credit.device).expand(B, T)
    src = torch.argsort((~step_mask).to(torch.int64) * T + idx, dim=-1)
    if keys is None:
        gen_device = credit.device if generator is None else generator.device
        keys = torch.rand(B, T, generator=generator, device=gen_device).to(credit.device)
    else:
        check_tensor("keys", keys, shape=("B", "T"), floating=True, finite=True, dims=dims)
    dst = torch.argsort(torch.where(step_mask, keys, torch.full_like(keys, float("inf"))), dim=-1)
    vals = torch.gather(torch.where(step_mask, credit, torch.zeros_like(credit)), -1, src)
    out = torch.zeros_like(credit).scatter(-1, dst, vals)
    return _masked(out, step_mask)


def binary(rewards: torch.Tensor, group_ids: torch.Tensor, step_mask: torch.Tensor, *, threshold: float = 1.0,
           eps: float = 1e-6, conserve: bool = True) -> torch.Tensor:
    """Outcome reduced to success ``1[R_i >= threshold]``, GRPO-normalised, spread uniformly."""
    check_tensor("rewards", rewards, shape=(None,), floating=True, finite=True)
    check_scalar("threshold", threshold)
    outcome = (rewards >= threshold).to(rewards.dtype)
    return uniform(grpo_advantages(outcome, group_ids, eps), step_mask, conserve=conserve)


def discretized(rewards: torch.Tensor, group_ids: torch.Tensor, step_mask: torch.Tensor, *,
                levels: tuple[float, ...] = (0.0, 0.5, 1.0), eps: float = 1e-6,
                conserve: bool = True) -> torch.Tensor:
    """Outcome rounded to the nearest of ``levels`` (ties go to the lower level), GRPO-normalised,
    spread uniformly."""
    check_tensor("rewards", rewards, shape=(None,), floating=True, finite=True)
    if len(levels) < 1:
        raise InputError("levels: needs at least one level")
    lv = torch.tensor(sorted(levels), dtype=rewards.dtype, device=rewards.device)
    nearest = lv[(rewards.unsqueeze(-1) - lv).abs().argmin(-1)]
    return uniform(grpo_advantages(nearest, group_ids, eps), step_mask, conserve=conserve)


def reward_to_go(step_rewards: torch.Tensor, group_ids: torch.Tensor, step_mask: torch.Tensor, *,
                 eps: float = 1e-6, conserve: bool = False) -> torch.Tensor:
    """``a[i,t] = (G[i,t] - mean_g R) / (std_g R + eps)`` with ``G[i,t] = sum_{u>=t} r[i,u]`` and
    ``R_i = G[i,0]`` (the group statistics of the full return, as GRPO).

    With a terminal-only reward ``G[i,t] = R_i`` for every t: the GRPO broadcast (uniform). With
    ``conserve=True`` each row is rescaled so ``sum_t |a[i,t]| = |A_i|`` (``A_i`` the GRPO advantage
    of ``R_i``).
    """
    dims: dict[str, int] = {}
    check_tensor("step_mask", step_mask, shape=("B", "T"), boolean=True, dims=dims)
    check_tensor("step_rewards", step_rewards, shape=("B", "T"), floating=True, finite=True,
                 finite_where=step_mask, dims=dims)
    r = torch.where(step_mask, step_rewards, torch.zeros_like(step_rewards))
    togo = r.flip(-1).cumsum(-1).flip(-1)
    R = r.sum(-1)
    mean, std, _ = group_stats(R, group_ids)
    a = _masked((togo - mean.unsqueeze(-1)) / (std.unsqueeze(-1) + eps), step_mask)
    if conserve:
        return conserve_credit(a, (R - mean) / (std + eps), step_mask)
    return a


def conserve_credit(credit: torch.Tensor, advantages: torch.Tensor, step_mask: torch.Tensor) -> torch.Tensor:
    """Rescale each row so ``sum_t |a[i,t]| = |A_i|``; a row with no credit gets ``A_i`` spread uniformly."""
    _check_adv_mask(advantages, step_mask)
    c = torch.where(step_mask, credit, torch.zeros_like(credit))
    mass = c.abs().sum(-1, keepdim=True)
    scaled = c * (advantages.abs().unsqueeze(-1) / torch.where(mass > 0, mass, torch.ones_like(mass)))
    return torch.where(mass > 0, scaled, uniform(advantages, step_mask, conserve=True))
