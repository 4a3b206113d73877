"""Masked aggregation, PPO/GRPO policy loss and OPSD losses."""

from __future__ import annotations

import torch

from creditlab.core.losses import aggregate


def test_aggregate_golden():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    assert float(aggregate(loss, mask, "token_mean")) == 3.0  # 15 / 5
    assert float(aggregate(loss, mask, "seq_mean_token_mean")) == 3.25  # (2 + 4.5) / 2
    assert float(aggregate(loss, mask, "seq_mean_token_sum")) == 7.5  # (6 + 9) / 2
    assert float(aggregate(loss, mask, "seq_mean_token_sum_norm")) == 5.0  # 15 / L
