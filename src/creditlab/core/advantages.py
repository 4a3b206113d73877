"""Advantage estimators over trajectories (``B``) grouped by prompt (``group_ids``).

GRPO outcome advantage (Shao et al., DeepSeekMath, 2024), computed within each group g:

    A_i = (R_i - mean_g R) / (std_g R + eps)

``std`` is the unbiased (n-1) standard deviation, as in verl's ``compute_grpo_outcome_advantage``
and TRL's ``GRPOTrainer``; a group of one trajectory gets advantage 0.
"""

from __future__ import annotations

import torch

from creditlab.core._checks import check_scalar, check_tensor

__all__ = ["grpo_advantages", "group_stats"]


def group_stats(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-trajectory group mean, unbiased group std and group size, each ``(B,)``.

    ``values``: ``(B,)`` float; ``group_ids``: ``(B,)`` integer labels (any values, not
    necessarily contiguous). Groups of size 1 get std 0.
    """
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
    check_scalar("eps", eps, low=0.0)
    mean, std, _ = group_stats(rewards, group_ids)
    return (rewards - mean) / (std + eps)
