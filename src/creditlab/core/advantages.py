"""Advantage estimators over trajectories (``B``) grouped by prompt (``group_ids``).

GRPO outcome advantage (Shao et al., DeepSeekMath, 2024), computed within each group g:

    A_i = (R_i - mean_g R) / (std_g R + eps)

``std`` is the unbiased (n-1) standard deviation, as in verl's ``compute_grpo_outcome_advantage``
and TRL's ``GRPOTrainer``; a group of one trajectory gets advantage 0.
"""

from __future__ import annotations

import sys

import torch

from creditlab.core._checks import check_scalar, check_tensor, require_values

__all__ = ["grpo_advantages", "group_stats", "mix_process_advantage", "prm_mixed_advantages"]


def group_stats(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-trajectory group mean, unbiased group std and group size, each ``(B,)``.

    ``values``: ``(B,)`` float; ``group_ids``: ``(B,)`` integer labels (any values, not
    necessarily contiguous). Groups of size 1 get std 0.
    """
    require_values("group_stats", "the group count comes from the data (torch.unique)", values, group_ids)
    dims: dict[str, int] = {}
    check_tensor("values", values, shape=("B",), floating=True, finite=True, dims=dims)
    check_tensor("group_ids", group_ids, shape=("B",), integer=True, dims=dims)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    v = values.to(torch.float64)
    count = torch.zeros(n_groups, dtype=torch.float64, device=v.device).index_add_(
        0, inverse, torch.ones_like(v)
    )
    total = torch.zeros_like(count).index_add_(0, inverse, v)
    mean = total / count.clamp_min(1)
    sq = torch.zeros_like(count).index_add_(0, inverse, (v - mean[inverse]) ** 2)
    var = sq / (count - 1).clamp_min(1)
    std = torch.where(count > 1, var.sqrt(), torch.zeros_like(var))
    dt = values.dtype
    return mean[inverse].to(dt), std[inverse].to(dt), count[inverse].to(dt)


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantages ``(B,)``: ``(R_i - mean_g R) / (std_g R + eps)``.

    Args:
        rewards: ``(B,)`` float, one scalar outcome reward per trajectory.
        group_ids: ``(B,)`` integer group label (trajectories of the same prompt share one).
        eps: added to the group std.

    >>> grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1]))
    tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
    """
    require_values("grpo_advantages", "the group count comes from the data (torch.unique)", rewards, group_ids)
    check_scalar("eps", eps, low=0.0, low_open=True)  # eps > 0: a group with identical rewards gets 0, not NaN
    mean, std, _ = group_stats(rewards, group_ids)
    return (rewards - mean) / (std + eps)


def prm_mixed_advantages(
    outcome_rewards: torch.Tensor,
    turn_scores: torch.Tensor,
    turn_mask: torch.Tensor,
    group_ids: torch.Tensor,
    lam: float,
    *,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Turn-level advantages mixing the GRPO outcome advantage with a process reward, ``(B, T)``.

    ``A[i, t] = A_out[i] + lam * A_proc[i, t]`` where ``A_out`` is :func:`grpo_advantages` of the
    outcome rewards and ``A_proc[i, t] = (s[i, t] - mean_g s) / (std_g s + eps)`` normalises the
    process score over *all valid turns of the group* ``g`` of trajectory ``i`` (unbiased std; a
    group with a single valid turn gets ``A_proc = 0``). ``lam`` is usually a schedule evaluated
    at the update index (:mod:`creditlab.core.schedules`), decayed to 0 so that a hackable process
    reward only shapes early training. Masked turns get 0.

    Args:
        outcome_rewards: ``(B,)`` float, terminal reward per trajectory.
        turn_scores: ``(B, T)`` float, process reward per turn (junk allowed where masked).
        turn_mask: ``(B, T)`` bool, True on real turns.
        group_ids: ``(B,)`` integer group label.
        lam: mixing weight of the process advantage.
        eps: added to both group standard deviations.

    >>> prm_mixed_advantages(torch.tensor([1.0, 0.0]), torch.tensor([[1.0, 0.0], [0.0, 0.0]]),
    ...                      torch.tensor([[True, True], [True, False]]), torch.tensor([0, 0]), 0.5)
    tensor([[ 1.2845,  0.4184],
            [-0.9958,  0.0000]])

    (``A_out = +-0.7071``; the group's three turn scores 1, 0, 0 have mean 1/3 and std
    ``sqrt(1/3)``, so ``A_proc = 1.1547, -0.5774, -0.5774``.)
    """
    require_values("prm_mixed_advantages", "the group counts come from the data (torch.unique)",
                   outcome_rewards, turn_scores, turn_mask, group_ids)
    dims: dict[str, int] = {}
    check_tensor("outcome_rewards", outcome_rewards, shape=("B",), floating=True, finite=True, dims=dims)
    check_tensor("turn_mask", turn_mask, shape=("B", "T"), boolean=True, dims=dims)
    check_tensor("group_ids", group_ids, shape=("B",), integer=True, dims=dims)
    check_scalar("eps", eps, low=0.0, low_open=True)
    a_out = grpo_advantages(outcome_rewards, group_ids, eps)
    return mix_process_advantage(a_out, turn_scores, turn_mask, group_ids, lam, eps=eps, what="outcome_rewards")


def mix_process_advantage(
    advantages: torch.Tensor,
    turn_scores: torch.Tensor,
    turn_mask: torch.Tensor,
    group_ids: torch.Tensor,
    lam: float,
    *,
    eps: float = 1e-6,
    what: str = "advantages",
) -> torch.Tensor:
    """``A[i, t] = advantages[i] + lam * A_proc[i, t]``, ``(B, T)``: a given outcome advantage plus the
    group-normalised process advantage of :func:`prm_mixed_advantages` (the sum taken in float64, so the
    two agree bit for bit when ``advantages`` is the GRPO advantage of the outcome rewards). ``what``
    names the first argument in errors. Masked turns get 0.

    >>> mix_process_advantage(torch.tensor([1.0, -1.0]), torch.tensor([[1.0, 0.0], [0.0, 0.0]]),
    ...                       torch.tensor([[True, True], [True, False]]), torch.tensor([0, 0]), 0.5)
    tensor([[ 1.5773,  0.7113],
            [-1.2887,  0.0000]])
    """
    require_values("mix_process_advantage", "the group counts come from the data (torch.unique)",
                   advantages, turn_scores, turn_mask, group_ids)
    dims: dict[str, int] = {}
    check_tensor(what, advantages, shape=("B",), floating=True, finite=True, dims=dims)
    check_tensor("turn_mask", turn_mask, shape=("B", "T"), boolean=True, dims=dims)
    check_tensor("turn_scores", turn_scores, shape=("B", "T"), floating=True, finite=True,
                 finite_where=turn_mask, dims=dims)
    check_tensor("group_ids", group_ids, shape=("B",), integer=True, dims=dims)
    check_scalar("lam", lam, low=-sys.float_info.max, high=sys.float_info.max)
    check_scalar("eps", eps, low=0.0, low_open=True)  # eps > 0: a group with identical rewards gets 0, not NaN
    a_out = advantages.to(torch.float64)  # (B,)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    zero = torch.zeros((), dtype=torch.float64, device=turn_scores.device)
    s = torch.where(turn_mask, turn_scores.to(torch.float64), zero)  # (B, T)
    count = torch.zeros(n_groups, dtype=torch.float64, device=s.device).index_add_(
        0, inverse, turn_mask.sum(dim=1).to(torch.float64)
    )
    mean = torch.zeros_like(count).index_add_(0, inverse, s.sum(dim=1)) / count.clamp_min(1)
    centred = torch.where(turn_mask, s - mean[inverse][:, None], zero)  # (B, T)
    sq = torch.zeros_like(count).index_add_(0, inverse, centred.square().sum(dim=1))
    std = torch.where(count > 1, (sq / (count - 1).clamp_min(1)).sqrt(), torch.zeros_like(sq))
    a_proc = centred / (std[inverse][:, None] + eps)
    out = torch.where(turn_mask, a_out[:, None] + lam * a_proc, zero)
    return out.to(torch.promote_types(advantages.dtype, torch.float32))
