"""FORK math: golden numbers, loop reference on ragged batches, edge cases, invariants, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from creditlab.core.precision import (
    combine_rewards,
    credit_split,
    deletion_curve,
    f_beta,
    fork_scores,
    necessity,
    signed_recall,
    unit_credit,
    unit_precision,
)
from creditlab.errors import InputError
from reference.ref_precision import ref_fork_one


def _pad(batch, junk_seed=None):
    """Pad a list of (match, coverage, weights, correct) into masked tensors; junk in the padding."""
    B = len(batch)
    J = max(1, max(len(b[1]) for b in batch))
    U = max(1, max(len(b[3]) for b in batch))
    g = torch.Generator().manual_seed(junk_seed or 0)
    match = torch.rand(B, J, U, generator=g) < 0.5
    coverage = torch.rand(B, J, generator=g) < 0.5
    weights = torch.randn(B, J, generator=g) * 100
    if junk_seed is not None:
        weights[0, -1] = float("nan") if len(batch[0][1]) < J else weights[0, -1]
    correct = torch.rand(B, U, generator=g) < 0.5
    rmask = torch.zeros(B, J, dtype=torch.bool)
    umask = torch.zeros(B, U, dtype=torch.bool)
    for b, (m, s, w, c) in enumerate(batch):
        for j in range(len(s)):
            rmask[b, j] = True
            coverage[b, j] = s[j]
            weights[b, j] = w[j]
            for i in range(len(c)):
                match[b, j, i] = m[j][i]
        for i in range(len(c)):
            umask[b, i] = True
            correct[b, i] = c[i]
    return match, coverage, weights, correct, rmask, umask


def test_golden_redundancy_and_wrong_fact():
    # Rubric A (3 pts) served by two paraphrases u0, u1; rubric B (1 pt) by u2; u3 filler; u2 wrong.
    match = [[True, True, False, False], [False, False, True, False]]
    batch = [(match, [True, True], [3.0, 1.0], [True, True, False, True])]
    out = fork_scores(*_pad(batch), tau=0.75, beta=1.0)
    assert out.credits[0].tolist() == pytest.approx([0.5, 0.5, 1.0, 0.0])
    assert out.necessary[0].tolist() == [False, False, True, False]
    # Necessary and correct: none (u2 is necessary but wrong) -> P = 0; Rec = 1; F = 0.
    assert out.precision.tolist() == [0.0]
    assert out.recall.tolist() == [1.0]
    assert out.reward.tolist() == [0.0]
    # tau = 0.5 makes the paraphrases necessary: P = 2/4, F1 = 2 * 0.5 / 1.5 = 2/3.
    out = fork_scores(*_pad(batch), tau=0.5)
    assert out.precision.item() == pytest.approx(0.5)
    assert out.reward.item() == pytest.approx(2 / 3)
    assert out.n_units.tolist() == [4]


def test_golden_signed_recall_healthbench_convention():
    # 5 + 3 positive points; -4 pitfall met: (5 - 4) / 8.
    rec = signed_recall(torch.tensor([[True, False, True]]), torch.tensor([[5.0, 3.0, -4.0]]),
                        torch.tensor([[True, True, True]]))
    assert rec.item() == pytest.approx(1 / 8)
    # Clipped at 0 when pitfalls outweigh what was earned.
    rec = signed_recall(torch.tensor([[False, True]]), torch.tensor([[2.0, -5.0]]), torch.tensor([[True, True]]))
    assert rec.item() == 0.0


def test_edge_cases():
    # No units: P = 0, credits empty; no positive rubric: vacuous recall; K_j = 0: no credit.
    batch = [
        ([[]], [True], [2.0], []),                       # no units, rubric met
        ([[True]], [False], [-1.0], [True]),             # only a pitfall, not met -> Rec 1
        ([[True]], [True], [-1.0], [True]),              # only a pitfall, met -> Rec 0
        ([[False, False]], [False], [1.0], [True, True]),  # K_j = 0, P = Rec = 0 -> F = 0
        ([], [], [], [True]),                            # no rubric at all -> Rec 1, P 0
    ]
    out = fork_scores(*_pad(batch), tau=0.5)
    assert out.precision.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0]
    assert out.recall.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert out.reward.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0]
    assert out.credits[3].tolist() == [0.0, 0.0]
    assert not torch.isnan(out.reward).any()
    assert out.metrics["reward/fork/absence_satisfaction"] == pytest.approx(0.5)


def test_f_beta_golden_and_baselines():
    p = torch.tensor([0.5, 0.0, 1.0, 0.25])
    r = torch.tensor([1.0, 0.0, 0.5, 1.0])
    assert f_beta(p, r).tolist() == pytest.approx([2 / 3, 0.0, 2 / 3, 0.4])
    # F2 = 5 P R / (4 P + R).
    assert combine_rewards(p, r, "f2").tolist() == pytest.approx([5 * 0.5 / 3, 0.0, 2.5 / 4.5, 1.25 / 2])
    assert combine_rewards(p, r, "recall").tolist() == r.tolist()
    assert combine_rewards(p, r, "mean").tolist() == pytest.approx([0.75, 0.0, 0.75, 0.625])
    with pytest.raises(InputError, match="mode"):
        combine_rewards(p, r, "median")


def _random_batch(rng, B, Jmax, Umax):
    batch = []
    for _ in range(B):
        J = rng.randint(0, Jmax)
        n = rng.randint(0, Umax)
        match = [[rng.random() < 0.3 for _ in range(n)] for _ in range(J)]
        cov = [rng.random() < 0.6 for _ in range(J)]
        w = [rng.choice([-3.0, -1.0, 0.5, 1.0, 2.0, 5.0]) for _ in range(J)]
        corr = [rng.random() < 0.8 for _ in range(n)]
        batch.append((match, cov, w, corr))
    return batch


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("mode", ["fork", "recall", "mean", "f2"])
def test_matches_loop_reference_on_ragged_batches(seed, mode):
    import random

    rng = random.Random(seed)
    batch = _random_batch(rng, B=rng.randint(1, 7), Jmax=6, Umax=9)
    taus = [rng.choice([0.3, 0.5, 0.75, 1.0]) for _ in batch]
    beta = rng.choice([0.5, 1.0, 2.0])
    out = fork_scores(*_pad(batch, junk_seed=seed + 1), tau=torch.tensor(taus), beta=beta, mode=mode)
    for b, (m, s, w, c) in enumerate(batch):
        r, p, rec, credits, nec = ref_fork_one(m, s, w, c, taus[b], beta, mode)
        assert out.reward[b].item() == pytest.approx(r, abs=1e-6)
        assert out.precision[b].item() == pytest.approx(p, abs=1e-6)
        assert out.recall[b].item() == pytest.approx(rec, abs=1e-6)
        assert out.credits[b, : len(c)].tolist() == pytest.approx(credits, abs=1e-6)
        assert out.necessary[b, : len(c)].tolist() == nec
        assert not out.necessary[b, len(c):].any()
        assert (out.credits[b, len(c):] == 0).all()


def test_padding_and_batch_permutation_change_nothing():
    import random

    batch = _random_batch(random.Random(3), B=5, Jmax=5, Umax=6)
    a = fork_scores(*_pad(batch), tau=0.5)
    # Extra padding slots filled with junk.
    m, s, w, c, rm, um = _pad(batch, junk_seed=9)
    m2 = torch.cat([m, torch.ones(5, 2, m.shape[2], dtype=torch.bool)], 1)
    m2 = torch.cat([m2, torch.ones(5, m2.shape[1], 3, dtype=torch.bool)], 2)
    s2 = torch.cat([s, torch.ones(5, 2, dtype=torch.bool)], 1)
    w2 = torch.cat([w, torch.full((5, 2), 7.0)], 1)
    c2 = torch.cat([c, torch.ones(5, 3, dtype=torch.bool)], 1)
    rm2 = torch.cat([rm, torch.zeros(5, 2, dtype=torch.bool)], 1)
    um2 = torch.cat([um, torch.zeros(5, 3, dtype=torch.bool)], 1)
    b = fork_scores(m2, s2, w2, c2, rm2, um2, tau=0.5)
    assert torch.equal(a.reward, b.reward)
    perm = [4, 2, 0, 3, 1]
    d = fork_scores(*_pad([batch[i] for i in perm]), tau=0.5)
    assert torch.equal(d.reward, a.reward[perm])


@given(p=st.floats(0, 1), r=st.floats(0, 1), beta=st.floats(0.25, 4))
def test_f_beta_lies_between_min_and_max(p, r, beta):
    f = f_beta(torch.tensor([p], dtype=torch.float64), torch.tensor([r], dtype=torch.float64), beta).item()
    assert min(p, r) - 1e-9 <= f <= max(p, r) + 1e-9
    if p == r:
        assert f == pytest.approx(p)


@given(n_para=st.integers(1, 6), tau=st.sampled_from([0.3, 0.5, 0.75, 1.0]))
def test_redundant_paraphrases_never_raise_precision_and_keep_recall(n_para, tau):
    # One rubric, answered once; adding paraphrases cannot raise P and leaves Rec unchanged.
    base = fork_scores(*_pad([([[True]], [True], [1.0], [True])]), tau=tau)
    more = fork_scores(*_pad([([[True] * n_para], [True], [1.0], [True] * n_para)]), tau=tau)
    assert more.precision.item() <= base.precision.item() + 1e-9
    assert more.recall.item() == base.recall.item()


@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=6))
def test_credit_split_rows_sum_to_one_or_zero(rows):
    m = torch.tensor([[list(r) for r in rows]])
    a = credit_split(m, torch.ones(1, len(rows), dtype=torch.bool), torch.ones(1, 2, dtype=torch.bool))
    for j, r in enumerate(rows):
        assert a[0, j].sum().item() == pytest.approx(1.0 if any(r) else 0.0)


def test_unit_credit_accumulates_across_rubrics():
    m = torch.tensor([[[True, False], [True, True]]])
    c = unit_credit(m, torch.tensor([[True, True]]), torch.tensor([[True, True]]))
    assert c.tolist() == [[1.5, 0.5]]


def test_bad_input_names_the_argument():
    m = torch.zeros(1, 2, 3, dtype=torch.bool)
    rm = torch.ones(1, 2, dtype=torch.bool)
    um = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(InputError, match="match"):
        credit_split(m.float(), rm, um)
    with pytest.raises(InputError, match="unit_mask"):
        credit_split(m, rm, torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(InputError, match="tau"):
        necessity(torch.zeros(1, 3), 0.0, um)
    with pytest.raises(InputError, match="tau"):
        necessity(torch.zeros(1, 3), math.nan, um)
    with pytest.raises(InputError, match="weights"):
        signed_recall(torch.ones(1, 2, dtype=torch.bool), torch.tensor([[1.0, math.nan]]), rm)
    with pytest.raises(InputError, match="correct"):
        unit_precision(torch.ones(1, 3, dtype=torch.bool), torch.ones(1, 3), um)
    with pytest.raises(InputError, match="beta"):
        f_beta(torch.ones(1), torch.ones(1), beta=0.0)


@pytest.mark.parametrize("seed", range(6))
def test_deletion_curve_matches_loop_reference(seed):
    import random

    from reference.ref_precision import ref_deletion_curve

    rng = random.Random(100 + seed)
    batch = _random_batch(rng, B=rng.randint(1, 6), Jmax=5, Umax=8)
    match, _, weights, _, rmask, umask = _pad(batch, junk_seed=seed + 1)
    U = umask.shape[1]
    scores = torch.randn(match.shape[0], U)
    scores[:, ::3] = 0.25  # ties
    curve, metrics = deletion_curve(match, weights, rmask, umask, scores)
    fracs = []
    for b, (m, _s, w, c) in enumerate(batch):
        ref, frac = ref_deletion_curve(m, w, scores[b, : len(c)].tolist(), U)
        assert curve[b].tolist() == pytest.approx(ref, abs=1e-6)
        if frac is not None:
            fracs.append(frac)
    assert metrics["reward/fork/deletion_free_frac"] == pytest.approx(sum(fracs) / len(fracs) if fracs else 0.0)


def test_deletion_curve_golden_credit_order():
    # Filler (credit 0) and a paraphrase go first: two units deleted before recall drops.
    m = torch.tensor([[[True, True, False, False], [False, False, True, False]]])
    credits = unit_credit(m, torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 4, dtype=torch.bool))
    curve, metrics = deletion_curve(m, torch.tensor([[2.0, 1.0]]), torch.ones(1, 2, dtype=torch.bool),
                                    torch.ones(1, 4, dtype=torch.bool), credits)
    assert curve[0].tolist() == pytest.approx([1.0, 1.0, 1.0, 1 / 3, 0.0])
    assert metrics["reward/fork/deletion_free_frac"] == 0.5
