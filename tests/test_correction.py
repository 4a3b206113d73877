"""InterQ-RL weights, budget allocation, baselines and mismatch metrics."""

from __future__ import annotations

import torch

from creditlab.core.correction import interq_weights
from reference.ref_correction import ref_interq


def _batch(seed, B=3, L=40, p=0.7, scale=0.05, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    pm = torch.rand(B, L, generator=g) < p
    vm = torch.rand(B, L, generator=g) < 0.95
    old = (torch.randn(B, L, generator=g) * 0.5 - 1.0).to(dtype)
    ro = old + (torch.randn(B, L, generator=g) * scale).to(dtype)
    return old, ro, pm, vm


def test_matches_reference_smoke():
    for seed in range(5):
        old, ro, pm, vm = _batch(seed)
        w, _ = interq_weights(old, ro, pm, vm)
        ref_w = ref_interq(old.tolist(), ro.tolist(), (pm & vm).tolist())[0]
        torch.testing.assert_close(w, torch.tensor(ref_w, dtype=torch.float64), atol=1e-9, rtol=0)
