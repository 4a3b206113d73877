"""creditlab.core.credit and core.advantages against loop references, goldens and invariants."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from creditlab.core import credit as cr
from creditlab.core.advantages import grpo_advantages
from creditlab.errors import InputError
from reference import ref_credit as ref


def ragged(B, T, seed, p=0.7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < p
    mask[0] = False  # a row with no real step
    if B > 1:
        mask[1] = True
    return mask, g


@pytest.mark.parametrize("seed", range(6))
def test_grpo_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 20, (1,), generator=g))
    r = torch.rand(B, generator=g, dtype=torch.float64)
    gid = torch.randint(0, 4, (B,), generator=g) * 7  # non-contiguous labels
    torch.testing.assert_close(grpo_advantages(r, gid), ref.grpo(r, gid))


@pytest.mark.parametrize("seed", range(8))
def test_geometries_match_loop(seed):
    B, T = 5 + seed, 3 + seed % 5
    mask, g = ragged(B, T, seed)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    dS = torch.rand(B, T, generator=g, dtype=torch.float64) * (torch.rand(B, T, generator=g) < 0.5)
    sel = torch.rand(B, T, generator=g) < 0.3
    keys = torch.rand(B, T, generator=g, dtype=torch.float64)
    junk = torch.where(mask, dS, torch.full_like(dS, 1e9))  # junk at masked positions changes nothing
    torch.testing.assert_close(cr.uniform(adv, mask), ref.uniform(adv, mask))
    torch.testing.assert_close(cr.uniform(adv, mask, conserve=False), ref.uniform(adv, mask, conserve=False))
    torch.testing.assert_close(cr.per_turn(adv, junk, mask), ref.per_turn(adv, dS, mask))
    torch.testing.assert_close(cr.concentrated(adv, sel, mask), ref.concentrated(adv, sel, mask))
    c = cr.per_turn(adv, dS, mask)
    torch.testing.assert_close(cr.shuffled(c, mask, keys=keys), ref.shuffled(c, mask, keys))
    gid = torch.arange(B) % 3
    r = torch.rand(B, T, generator=g, dtype=torch.float64)
    torch.testing.assert_close(cr.reward_to_go(r, gid, mask), ref.reward_to_go(r, gid, mask))


def test_golden_geometries():
    adv = torch.tensor([2.0, -3.0])
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    torch.testing.assert_close(cr.uniform(adv, mask), torch.tensor([[0.5, 0.5, 0.5, 0.5], [-1.0, -1.0, -1.0, 0.0]]))
    dS = torch.tensor([[0.0, 1.0, 0.0, 3.0], [0.0, 0.0, 0.0, 5.0]])  # row 2: progress only on a masked step
    torch.testing.assert_close(cr.per_turn(adv, dS, mask),
                               torch.tensor([[0.0, 0.5, 0.0, 1.5], [-1.0, -1.0, -1.0, 0.0]]))
    sel = torch.tensor([[True, False, False, True], [False, True, False, False]])
    torch.testing.assert_close(cr.concentrated(adv, sel, mask),
                               torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, -3.0, 0.0, 0.0]]))
    # reward-to-go by hand: returns R = [1, 3], group mean 2, std sqrt(2)
    r = torch.tensor([[0.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    a = cr.reward_to_go(r, torch.tensor([0, 0]), torch.ones(2, 2, dtype=torch.bool), eps=1e-12)
    s2 = 2**0.5
    torch.testing.assert_close(a, torch.tensor([[-1 / s2, -1 / s2], [1 / s2, 0.0]], dtype=torch.float64))


def test_binary_and_discretized_golden():
    r = torch.tensor([1.0, 0.9, 0.3, 0.7])
    gid = torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 2, dtype=torch.bool)
    b = cr.binary(r, gid, mask, eps=1e-12)  # outcomes 1, 0 | 0, 0
    s = 2**-0.5
    torch.testing.assert_close(b, torch.tensor([[s / 2, s / 2], [-s / 2, -s / 2], [0.0, 0.0], [0.0, 0.0]]))
    d = cr.discretized(r, gid, mask, eps=1e-12)  # levels 1, 1 | 0.5, 0.5 -> all ties -> zero advantages
    torch.testing.assert_close(d, torch.zeros(4, 2))
    d2 = cr.discretized(torch.tensor([0.2, 0.8]), torch.tensor([0, 0]), torch.ones(2, 1, dtype=torch.bool), eps=1e-12)
    torch.testing.assert_close(d2, torch.tensor([[-s], [s]]))


def test_reward_to_go_terminal_only_is_uniform_broadcast():
    g = torch.Generator().manual_seed(0)
    B, T = 8, 5
    R = torch.rand(B, generator=g, dtype=torch.float64)
    r = torch.zeros(B, T, dtype=torch.float64)
    r[:, -1] = R
    gid = torch.arange(B) // 4
    mask = torch.ones(B, T, dtype=torch.bool)
    torch.testing.assert_close(cr.reward_to_go(r, gid, mask), cr.uniform(grpo_advantages(R, gid), mask, conserve=False))


@given(st.integers(1, 6), st.integers(1, 9), st.integers(0, 10_000))
def test_credit_is_conserved(B, T, seed):
    mask, g = ragged(B, T, seed, p=0.6)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    has = mask.any(-1)
    want = torch.where(has, adv.abs(), torch.zeros_like(adv))
    dS = torch.rand(B, T, generator=g, dtype=torch.float64) * (torch.rand(B, T, generator=g) < 0.4)
    sel = torch.rand(B, T, generator=g) < 0.3
    for c in (cr.uniform(adv, mask), cr.per_turn(adv, dS, mask), cr.concentrated(adv, sel, mask),
              cr.shuffled(cr.per_turn(adv, dS, mask), mask, torch.Generator().manual_seed(seed)),
              cr.conserve_credit(torch.randn(B, T, generator=g, dtype=torch.float64), adv, mask)):
        torch.testing.assert_close(c.abs().sum(-1), want)
        assert (c[~mask] == 0).all()
        # the sign of every step's credit is the sign of the trajectory's advantage (geometries
        # reshape credit, they never flip it), except conserve_credit of an arbitrary tensor
    for c in (cr.uniform(adv, mask), cr.per_turn(adv, dS, mask), cr.concentrated(adv, sel, mask)):
        assert (c * adv.unsqueeze(-1) >= 0).all()


@given(st.integers(1, 5), st.integers(1, 8), st.integers(0, 10_000))
def test_shuffle_keeps_the_multiset_of_each_row(B, T, seed):
    mask, g = ragged(B, T, seed)
    c = torch.randn(B, T, generator=g)
    s = cr.shuffled(c, mask, torch.Generator().manual_seed(seed))
    for i in range(B):
        assert sorted(s[i][mask[i]].tolist()) == sorted(c[i][mask[i]].tolist())
        assert (s[i][~mask[i]] == 0).all()


def test_shuffle_is_uniform_over_positions():
    c = torch.tensor([[1.0, 0.0, 0.0, 0.0]]).expand(4000, 4)
    s = cr.shuffled(c, torch.ones(4000, 4, dtype=torch.bool), torch.Generator().manual_seed(0))
    freq = (s == 1).double().mean(0)
    assert torch.allclose(freq, torch.full((4,), 0.25, dtype=torch.float64), atol=0.03)


def test_bad_inputs_name_the_argument():
    adv, mask = torch.zeros(2), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(InputError, match="step_mask"):
        cr.uniform(adv, mask.float())
    with pytest.raises(InputError, match="advantages"):
        cr.uniform(torch.zeros(3), mask)
    with pytest.raises(InputError, match="advantages"):
        cr.uniform(torch.tensor([0.0, float("nan")]), mask)
    with pytest.raises(InputError, match="progress_deltas"):
        cr.per_turn(adv, -torch.ones(2, 3), mask)
    with pytest.raises(InputError, match="selected_mask"):
        cr.concentrated(adv, torch.ones(2, 3), mask)
    with pytest.raises(InputError, match="group_ids"):
        grpo_advantages(torch.zeros(2), torch.zeros(2))
