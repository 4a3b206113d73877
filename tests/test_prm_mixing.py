"""Turn-level PRM mixing: A[i, t] = A_out[i] + lambda * A_proc[i, t]."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from creditlab.core.advantages import grpo_advantages, prm_mixed_advantages
from creditlab.core.schedules import decay
from reference.ref_losses import ref_prm_mixed

F64 = torch.float64


def _batch(seed, B, T, G, p=0.8):
    g = torch.Generator().manual_seed(seed)
    outcome = torch.randint(0, 2, (B,), generator=g).to(F64)
    scores = torch.rand(B, T, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) < p
    groups = torch.randint(0, G, (B,), generator=g) * 7 + 3  # arbitrary, non-contiguous labels
    return outcome, scores, mask, groups


@given(st.integers(1, 8), st.integers(1, 6), st.integers(1, 3), st.sampled_from([0.0, 0.5, 1.0]),
       st.floats(-2.0, 2.0), st.integers(0, 2**31 - 1))
def test_matches_reference(B, T, G, p, lam, seed):
    outcome, scores, mask, groups = _batch(seed, B, T, G, p)
    got = prm_mixed_advantages(outcome, scores, mask, groups, lam)
    want = ref_prm_mixed(outcome.tolist(), scores.tolist(), mask.tolist(), groups.tolist(), lam)
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64), atol=1e-9, rtol=1e-9)


def test_golden():
    """Group 0: outcomes 1, 0 -> A_out = +-1/sqrt(1/2) = +-0.70711; turn scores (1, 0 | 0) have mean
    1/3 and std sqrt(1/3) -> A_proc = (1.15470, -0.57735 | -0.57735). Group 5 (one trajectory):
    A_out = 0, its turn scores (0.2, 0.6) -> mean 0.4, std 0.28284 -> A_proc = -+0.70711."""
    outcome = torch.tensor([1.0, 0.0, 1.0], dtype=F64)
    scores = torch.tensor([[1.0, 0.0], [0.0, 99.0], [0.2, 0.6]], dtype=F64)
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    A = prm_mixed_advantages(outcome, scores, mask, torch.tensor([0, 0, 5]), 0.5)
    expected = [[0.70711 + 0.5 * 1.15470, 0.70711 - 0.5 * 0.57735],
                [-0.70711 - 0.5 * 0.57735, 0.0],
                [-0.5 * 0.70711, 0.5 * 0.70711]]
    torch.testing.assert_close(A, torch.tensor(expected, dtype=F64), atol=2e-5, rtol=0)


def test_lambda_zero_is_grpo_broadcast():
    outcome, scores, mask, groups = _batch(0, 12, 5, 3)
    A = prm_mixed_advantages(outcome, scores, mask, groups, 0.0)
    base = grpo_advantages(outcome, groups)
    torch.testing.assert_close(A, torch.where(mask, base[:, None], 0.0))


def test_process_advantage_sums_to_zero_per_group_and_decayed_lambda():
    outcome, scores, mask, groups = _batch(1, 16, 6, 2)
    lam_a, lam_b = 1.0, 3.0
    A_a = prm_mixed_advantages(outcome, scores, mask, groups, lam_a)
    A_b = prm_mixed_advantages(outcome, scores, mask, groups, lam_b)
    proc = (A_b - A_a) / (lam_b - lam_a)  # the normalised process advantage
    for g in groups.unique():
        rows = groups == g
        assert float(proc[rows][mask[rows]].sum()) == pytest.approx(0.0, abs=1e-9)
        assert float(proc[rows][mask[rows]].std()) == pytest.approx(1.0, abs=1e-5)
    lam = decay(1.0, start=20, end=30, power=3)
    late = prm_mixed_advantages(outcome, scores, mask, groups, lam(30))
    torch.testing.assert_close(late, prm_mixed_advantages(outcome, scores, mask, groups, 0.0))


def test_junk_at_masked_turns_and_dtype():
    outcome, scores, mask, groups = _batch(2, 6, 4, 2)
    A = prm_mixed_advantages(outcome.float(), scores.float(), mask, groups, 0.7)
    assert A.dtype == torch.float32
    junk = scores.float().masked_fill(~mask, math.nan)
    torch.testing.assert_close(prm_mixed_advantages(outcome.float(), junk, mask, groups, 0.7), A)
    assert bool((A[~mask] == 0).all())


def test_bad_input():
    outcome, scores, mask, groups = _batch(3, 4, 3, 2)
    with pytest.raises(ValueError, match="turn_scores"):
        prm_mixed_advantages(outcome, scores.masked_fill(mask, math.nan), mask, groups, 0.5)
    with pytest.raises(ValueError, match="turn_mask"):
        prm_mixed_advantages(outcome, scores, mask.float(), groups, 0.5)
    with pytest.raises(ValueError, match="group_ids"):
        prm_mixed_advantages(outcome, scores, mask, groups.float(), 0.5)
    with pytest.raises(ValueError, match="outcome_rewards"):
        prm_mixed_advantages(outcome.masked_fill(outcome == outcome[0], math.inf), scores, mask, groups, 0.5)
    with pytest.raises(ValueError, match="turn_mask.*B=3"):  # B is fixed by outcome_rewards
        prm_mixed_advantages(outcome[:3], scores, mask, groups, 0.5)
    with pytest.raises(ValueError, match="lam"):
        prm_mixed_advantages(outcome, scores, mask, groups, math.inf)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 6), st.integers(1, 3), st.floats(-2.0, 2.0), st.integers(0, 2**31 - 1))
def test_the_registered_prm_geometry_equals_prm_mixing_bit_for_bit(B, T, G, lam, seed):
    """The path a trainer takes (the registered ``prm`` geometry given the GRPO advantage) and core's PRM
    mixing of the outcome rewards are the same numbers, not merely close: a lab trained through the
    registered component reproduces one trained through core's function."""
    from creditlab.core.advantages import grpo_advantages
    from creditlab.core.credit import StepBatch, get_geometry

    g = torch.Generator().manual_seed(seed)
    R = torch.rand(B, generator=g)
    scores, mask = torch.rand(B, T, generator=g), torch.rand(B, T, generator=g) < 0.7
    gid = torch.randint(0, G, (B,), generator=g)
    A = grpo_advantages(R, gid)
    batch = StepBatch(mask, gid, advantages=A, rewards=R, step_scores=scores)
    got = get_geometry("prm")(batch, conserve=False, lam=lam)
    want = prm_mixed_advantages(R, scores, mask, gid, lam)
    assert got.dtype == want.dtype and torch.equal(got, want)
