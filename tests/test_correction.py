"""InterQ-RL weights, budget allocation, baselines and mismatch metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from creditlab.core import correction
from creditlab.core.correction import (
    CORRECTIONS,
    allocate_budget,
    correction_params,
    correction_weights,
    geo_weights,
    get_correction,
    interq_terms,
    interq_tis_weights,
    interq_weights,
    mis_weights,
    mismatch_metrics,
    none_weights,
    register_correction,
    registered_correction,
    seq_is_weights,
    tis_weights,
    unregister_correction,
)
from creditlab.errors import ConfigError, InputError
from reference.ref_correction import (
    ref_allocate_budget,
    ref_geo,
    ref_interq,
    ref_mis,
    ref_mismatch,
    ref_seq_is,
    ref_tis,
)

F64 = torch.float64
BASELINES = {
    "tis": (tis_weights, ref_tis),
    "mis": (mis_weights, ref_mis),
    "seq_is": (seq_is_weights, ref_seq_is),
    "geo": (geo_weights, ref_geo),
}


def _batch(seed, B=3, L=40, p=0.7, p_valid=0.95, scale=0.05, dtype=F64):
    """Random log-probs with a ragged policy mask and padding; old - rollout ~ N(0, scale^2)."""
    g = torch.Generator().manual_seed(seed)
    pm = torch.rand(B, L, generator=g) < p
    vm = torch.rand(B, L, generator=g) < p_valid
    old = -(torch.randn(B, L, generator=g, dtype=F64) * 0.5 - 1.0).abs().to(dtype)  # log-probs are <= 0
    ro = -(old.to(F64) + torch.randn(B, L, generator=g, dtype=F64) * scale).abs().to(dtype)
    return old, ro, pm, vm


def _structured_batch():
    """One-token segments, a row without policy tokens, a fully padded row, a long segment."""
    old, ro, _, _ = _batch(7, B=5, L=12, scale=0.08)
    pm = torch.tensor([
        [True, False] * 6,  # six one-token segments
        [False] * 12,  # no policy token (prompt + tool output only)
        [True] * 12,  # padded away entirely by valid_mask below
        [True] * 12,  # one 12-token segment
        [False, True, True, False, False, True, True, True, False, True, False, False],
    ])
    vm = torch.ones(5, 12, dtype=torch.bool)
    vm[2] = False
    vm[4, 10:] = False
    return old, ro, pm, vm


batches = st.tuples(
    st.integers(1, 4),  # B
    st.integers(1, 32),  # L
    st.sampled_from([0.0, 0.3, 0.6, 0.9, 1.0]),  # policy density
    st.sampled_from([0.7, 1.0]),  # valid density
    st.sampled_from([0.005, 0.03, 0.2]),  # mismatch scale (0.2 hits the envelope often)
    st.integers(0, 2**31 - 1),
)


# --------------------------------------------------------------------------------------------
# loop reference


def _assert_matches_reference(old, ro, pm, vm, mode, **kw):
    eff = (pm & vm).tolist()
    t = interq_terms(old, ro, pm, vm, mode=mode, **kw)
    w_ref, C_ref, rho_ref, alpha_ref, clip_ref = ref_interq(old.tolist(), ro.tolist(), eff, mode=mode, **kw)
    torch.testing.assert_close(t.weights, torch.tensor(w_ref, dtype=F64), atol=1e-10, rtol=0)
    torch.testing.assert_close(t.C, torch.tensor(C_ref, dtype=F64).reshape(-1), atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(t.rho, torch.tensor(rho_ref, dtype=F64).reshape(-1), atol=1e-9, rtol=0)
    torch.testing.assert_close(t.alpha, torch.tensor(alpha_ref, dtype=F64).reshape(-1), atol=1e-8, rtol=0)
    assert (t.clipped_high | t.clipped_low).tolist() == clip_ref
    w, _ = interq_weights(old, ro, pm, vm, mode=mode, **kw)
    torch.testing.assert_close(w, t.weights, atol=0, rtol=0)


@given(batches, st.sampled_from(["interq", "prefix", "global"]))
def test_interq_matches_reference_random(batch, mode):
    B, L, p, pv, scale, seed = batch
    old, ro, pm, vm = _batch(seed, B, L, p, pv, scale)
    _assert_matches_reference(old, ro, pm, vm, mode)


@pytest.mark.parametrize("mode", ["interq", "prefix", "global"])
def test_interq_matches_reference_structured(mode):
    old, ro, pm, vm = _structured_batch()
    _assert_matches_reference(old, ro, pm, vm, mode, alpha_g=0.3, eps_low=0.05, eps_high=0.1)


@given(batches, st.sampled_from(sorted(BASELINES)))
def test_baselines_match_reference(batch, name):
    B, L, p, pv, scale, seed = batch
    old, ro, pm, vm = _batch(seed, B, L, p, pv, scale * 10)
    fn, ref = BASELINES[name]
    w, _ = fn(old, ro, pm, vm)
    expected = ref(old.tolist(), ro.tolist(), (pm & vm).tolist())
    torch.testing.assert_close(w, torch.tensor(expected, dtype=F64), atol=1e-12, rtol=1e-12)


@given(batches)
def test_mismatch_metrics_match_reference(batch):
    B, L, p, pv, scale, seed = batch
    old, ro, pm, vm = _batch(seed, B, L, p, pv, scale)
    got = mismatch_metrics(old, ro, pm, vm, max_turns=4)
    want = ref_mismatch(old.tolist(), ro.tolist(), (pm & vm).tolist(), max_turns=4)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert {k for k in got if k.startswith("mismatch/turn")} == {k for k in want if "turn" in k}


def test_mismatch_metrics_quantiles_and_clip_rate():
    old, ro, pm, vm = _batch(3, B=4, L=64, scale=0.1)
    m = mismatch_metrics(old, ro, pm, vm, quantiles=(0.0, 0.5, 1.0))
    t = interq_terms(old, ro, pm, vm)
    assert m["correction/rho_q0"] == pytest.approx(float(t.rho.min()))
    assert m["correction/rho_q100"] == pytest.approx(float(t.rho.max()))
    assert m["correction/alpha_q50"] == pytest.approx(float(t.alpha.median()), abs=0.05)
    eff = pm & vm
    clip = float(((t.clipped_high | t.clipped_low) & eff).sum()) / float(eff.sum())
    assert m["correction/clip_rate"] == pytest.approx(clip)
    assert m["correction/clip_rate"] == pytest.approx(m["correction/clip_rate_high"] + m["correction/clip_rate_low"])
    assert 0 < m["correction/clip_rate"] < 1


def test_compounding_fingerprint():
    """A constant per-token bias: current log ratio flat by turn, prefix log ratio growing."""
    B, T, n = 8, 5, 6  # 5 turns of 6 policy tokens separated by 4 tool tokens
    unit = [True] * n + [False] * 4
    pm = torch.tensor([unit * T] * B)
    old = torch.full(pm.shape, -1.0, dtype=F64)
    ro = old - 0.01
    m = mismatch_metrics(old, ro, pm, max_turns=T)
    cur = [m[f"mismatch/turn{k}/current"] for k in range(T)]
    pre = [m[f"mismatch/turn{k}/prefix"] for k in range(T)]
    assert cur == pytest.approx([0.01] * T)
    # mean of E_t over turn k's tokens: 0.01 * (6k + 3.5)
    assert pre == pytest.approx([0.01 * (6 * k + 3.5) for k in range(T)])
    assert m["mismatch/seq_k1"] == pytest.approx(-0.3)


# --------------------------------------------------------------------------------------------
# golden


def test_golden_hand_computed():
    """One row: action (2 tokens), tool token, action (2 tokens); a second row with no action.

    delta = (0.01, 0.01, -, 0.03, -0.20): E = (0.01, 0.02, 0.05, -0.15), n = (1, 2, 3, 4).
    Envelope [-0.025, 0.05] * sqrt(n): only the last token is clipped, to -0.025 * 2 = -0.05.
    d = e^logW - 1 = (0.0100502, 0.0202013, 0.0512711, -0.0487706).
    Segment 1: C = 2.5455e-4, ESS = (0.0302515)^2 / 5.0910e-4 = 1.797591, rho = 0.797560.
    Segment 2: C = 2.50365e-3, ESS = 1.998751, rho = 0.998747.
    Budget: c^2 (C1 rho1^2 + C2 rho2^2) = 0.25 (C1 + C2)  ->  c = 0.509213,
    alpha = (0.406128, 0.508575), W = 1 + alpha d.
    """
    old = torch.tensor([[-1.00, -2.00, 0.0, -0.50, -1.20], [-1.0, -1.0, -1.0, -1.0, -1.0]], dtype=F64)
    ro = torch.tensor([[-1.01, -2.01, 5.0, -0.53, -1.00], [-3.0, -3.0, -3.0, -3.0, -3.0]], dtype=F64)
    pm = torch.tensor([[True, True, False, True, True], [False] * 5])
    t = interq_terms(old, ro, pm)
    torch.testing.assert_close(t.rho, torch.tensor([0.7975599, 0.9987473], dtype=F64), atol=1e-6, rtol=0)
    torch.testing.assert_close(t.alpha, torch.tensor([0.4061275, 0.5085747], dtype=F64), atol=1e-6, rtol=0)
    assert t.clipped_low.tolist() == [[False, False, False, False, True], [False] * 5]
    w, m = interq_weights(old, ro, pm)
    expected = [[1.0040816, 1.0082043, 1.0, 1.0260752, 0.9751965], [1.0] * 5]
    torch.testing.assert_close(w, torch.tensor(expected, dtype=F64), atol=1e-6, rtol=0)
    assert m["correction/clip_rate"] == pytest.approx(0.25)
    assert m["correction/segments"] == 2
    assert m["correction/weight_min"] == pytest.approx(0.9751965, abs=1e-6)
    assert m["correction/weight_max"] == pytest.approx(1.0260752, abs=1e-6)
    assert m["correction/weight_mean"] == pytest.approx((1.0040816 + 1.0082043 + 1.0260752 + 0.9751965) / 4)

    wp, _ = interq_weights(old, ro, pm, mode="prefix")
    expected_p = [[1.0100502, 1.0202013, 1.0, 1.0512711, 0.9512294], [1.0] * 5]
    torch.testing.assert_close(wp, torch.tensor(expected_p, dtype=F64), atol=1e-6, rtol=0)
    wg, _ = interq_weights(old, ro, pm, mode="global")
    expected_g = [[1.0050251, 1.0101007, 1.0, 1.0256355, 0.9756147], [1.0] * 5]
    torch.testing.assert_close(wg, torch.tensor(expected_g, dtype=F64), atol=1e-6, rtol=0)


def _deltas_for_displacements(d):
    """Per-token deltas whose prefix weights (inside the envelope) are 1 + d."""
    E = [math.log1p(x) for x in d]
    return [E[0]] + [E[i] - E[i - 1] for i in range(1, len(E))]


def test_design_example_concentration_lowers_support():
    """Two 24-token segments with the same C_s; six tokens carry 76% of the squared displacement.

    Even: d = 0.02 everywhere -> ESS = 24, rho ~= 1. Concentrated: six tokens a = 0.02 sqrt(3.04),
    eighteen b = 0.02 sqrt(0.32): same C_s = 4e-4, ESS = (6a + 18b)^2 / (24 C_s) = 17.757,
    rho = 16.757 / 23 = 0.7286.
    """
    n = 24
    a, b = 0.02 * math.sqrt(24 * 0.76 / 6), 0.02 * math.sqrt(24 * 0.24 / 18)
    heavy = {3, 7, 11, 15, 19, 23}
    even = [0.02] * n
    conc = [a if i in heavy else b for i in range(n)]
    assert sum(x * x for i, x in enumerate(conc) if i in heavy) / sum(x * x for x in conc) == pytest.approx(0.76)
    gap = 4  # the two actions sit in one trajectory, separated by a tool observation
    rows = []
    for d in (even, conc):
        delta = _deltas_for_displacements(d)
        rows.append(delta)
    # second segment must start from E = 0 again: put each in its own row, and also both in one row
    old = torch.full((2, n), -1.0, dtype=F64)  # log-probs are <= 0; only old - rollout matters
    ro = old - torch.tensor(rows, dtype=F64)
    pm = torch.ones(2, n, dtype=torch.bool)
    t = interq_terms(old, ro, pm)
    assert float(t.C[0]) == pytest.approx(float(t.C[1]), rel=1e-3)
    assert not bool(t.clipped_high.any() | t.clipped_low.any())
    assert float(t.rho[0]) == pytest.approx(1.0, abs=1e-4)
    assert float(t.rho[1]) == pytest.approx(0.7286, abs=1e-3)
    assert float(t.alpha[0]) > float(t.alpha[1])
    # the same pair as consecutive actions of one trajectory with a tool observation between them:
    # the second action's deltas are relative to the prefix the first one left behind.
    E_end = math.log1p(even[-1])
    delta_row = rows[0] + [0.0] * gap + [rows[1][0] - E_end] + rows[1][1:]
    old1 = torch.full((1, len(delta_row)), -1.0, dtype=F64)
    ro1 = old1 - torch.tensor([delta_row], dtype=F64)
    pm1 = torch.tensor([[True] * n + [False] * gap + [True] * n])
    t1 = interq_terms(old1, ro1, pm1, eps_high=0.1)
    torch.testing.assert_close(t1.rho, t.rho, atol=1e-9, rtol=0)


# --------------------------------------------------------------------------------------------
# properties


@given(batches, st.sampled_from(["interq", "prefix", "global", "tis", "mis", "seq_is", "geo", "none", "interq_tis"]))
def test_no_mismatch_gives_unit_weights(batch, arm):
    B, L, p, pv, _, seed = batch
    old, _, pm, vm = _batch(seed, B, L, p, pv)
    ro = old.clone()
    if arm in ("interq", "prefix", "global"):
        w, m = interq_weights(old, ro, pm, vm, mode=arm)
        assert m["correction/clip_rate"] == 0.0
    else:
        w, m = {"tis": tis_weights, "mis": mis_weights, "seq_is": seq_is_weights, "geo": geo_weights,
                "none": none_weights, "interq_tis": interq_tis_weights}[arm](old, ro, pm, vm)
    assert bool((w == 1).all())
    assert m["mismatch/k3"] == 0.0


@given(batches, st.floats(0.0, 0.2), st.floats(0.0, 0.2))
def test_prefix_weight_inside_envelope(batch, eps_low, eps_high):
    B, L, p, pv, scale, seed = batch
    old, ro, pm, vm = _batch(seed, B, L, p, pv, scale)
    eff = pm & vm
    n = torch.cumsum(eff, dim=1).to(F64)
    for mode in ("prefix", "interq", "global"):
        w, _ = interq_weights(old, ro, pm, vm, eps_low=eps_low, eps_high=eps_high, mode=mode)
        logw = torch.log(w)
        assert bool((logw <= eps_high * n.sqrt() + 1e-12)[eff].all())
        assert bool((logw >= -eps_low * n.sqrt() - 1e-12)[eff].all())
        assert bool((w[~eff] == 1).all())


finite_pos = st.floats(1e-6, 10.0, allow_nan=False)
instances = st.integers(1, 12).flatmap(
    lambda S: st.tuples(
        st.lists(finite_pos, min_size=S, max_size=S),
        st.lists(st.one_of(st.just(0.0), st.floats(1e-9, 1.0)), min_size=S, max_size=S),
        st.floats(0.0, 1.0),
    )
)


@given(instances, st.sampled_from([None, 80]))
def test_budget_holds_and_binds(inst, iters):
    C_list, rho_list, alpha_g = inst
    C, rho = torch.tensor(C_list, dtype=F64), torch.tensor(rho_list, dtype=F64)
    alpha = allocate_budget(C, rho, alpha_g, iters=iters)
    assert bool(((alpha >= 0) & (alpha <= 1)).all())
    budget = alpha_g**2 * float(C.sum())
    spent = float((C * alpha**2).sum())
    assert spent <= budget * (1 + 1e-9) + 1e-15
    reachable = float(C[rho > 0].sum())
    if (rho > 0).any() and reachable >= budget:
        assert spent == pytest.approx(budget, rel=1e-9, abs=1e-15)
    torch.testing.assert_close(alpha, torch.tensor(ref_allocate_budget(C_list, rho_list, alpha_g), dtype=F64),
                               atol=1e-8, rtol=0)


@given(st.lists(finite_pos, min_size=1, max_size=10), st.floats(1e-3, 1.0), st.floats(0.0, 1.0))
def test_equal_rho_gives_alpha_g(C_list, rho, alpha_g):
    C = torch.tensor(C_list, dtype=F64)
    alpha = allocate_budget(C, torch.full_like(C, rho), alpha_g)
    torch.testing.assert_close(alpha, torch.full_like(C, alpha_g), atol=1e-12, rtol=0)


@given(instances)
def test_higher_rho_never_lower_alpha(inst):
    C_list, rho_list, alpha_g = inst
    rho = torch.tensor(rho_list, dtype=F64)
    alpha = allocate_budget(torch.tensor(C_list, dtype=F64), rho, alpha_g)
    order = torch.argsort(rho)
    assert bool((alpha[order].diff() >= -1e-12).all())


@pytest.mark.parametrize("iters", [None, 80])
def test_tiny_supports_do_not_overflow(iters):
    # 1 / 5e-324 and 5e-324^2 overflow / underflow: both solvers work on log c
    C, rho = torch.tensor([1.0, 1.0], dtype=F64), torch.tensor([0.0, 5e-324], dtype=F64)
    assert allocate_budget(C, rho, 1.0, iters).tolist() == [0.0, 1.0]
    assert allocate_budget(C[1:], rho[1:], 0.5, iters).tolist() == pytest.approx([0.5])
    # a tiny support next to a normal one: the budget still binds exactly
    rho = torch.tensor([1.0, 1e-200], dtype=F64)
    alpha = allocate_budget(C, rho, 0.9, iters)
    assert float((C * alpha**2).sum()) == pytest.approx(0.81 * 2)
    assert alpha.tolist() == pytest.approx([1.0, math.sqrt(0.62)])


@given(instances)
def test_exact_and_bisection_agree(inst):
    C_list, rho_list, alpha_g = inst
    C, rho = torch.tensor(C_list, dtype=F64), torch.tensor(rho_list, dtype=F64)
    torch.testing.assert_close(allocate_budget(C, rho, alpha_g), allocate_budget(C, rho, alpha_g, iters=100),
                               atol=1e-9, rtol=0)


def test_no_support_anywhere_falls_back_to_alpha_g():
    alpha = allocate_budget(torch.tensor([1.0, 2.0, 0.0]), torch.zeros(3), 0.4)
    assert alpha.tolist() == pytest.approx([0.4, 0.4, 0.4])
    assert allocate_budget(torch.zeros(0), torch.zeros(0), 0.5).numel() == 0


@settings(max_examples=15)
@given(st.integers(0, 2**31 - 1))
def test_allocate_budget_matches_scipy_optimiser(seed):
    from scipy.optimize import minimize

    rng = np.random.default_rng(seed)
    S = int(rng.integers(2, 9))
    C = rng.uniform(0.1, 2.0, S)
    rho = rng.uniform(0.05, 1.0, S)
    alpha_g = float(rng.uniform(0.1, 0.9))
    budget = alpha_g**2 * C.sum()
    res = minimize(
        lambda a: -(C * rho * a).sum(),
        x0=np.full(S, alpha_g * 0.5),
        jac=lambda a: -(C * rho),
        bounds=[(0.0, 1.0)] * S,
        constraints=[{"type": "ineq", "fun": lambda a: budget - (C * a * a).sum(), "jac": lambda a: -2 * C * a}],
        method="SLSQP",
        options={"ftol": 1e-12, "maxiter": 500},
    )
    # status 8 ("positive directional derivative for linesearch"): SLSQP stopped at the optimum to the
    # precision of its line search (ftol 1e-12 is below what it can resolve on some draws)
    assert res.success or res.status == 8, res.message
    assert (C * res.x**2).sum() <= budget + 1e-8
    ours = allocate_budget(torch.tensor(C), torch.tensor(rho), alpha_g).numpy()
    assert (C * rho * ours).sum() >= -res.fun - 1e-7  # at least as good as the optimiser
    np.testing.assert_allclose(ours, res.x, atol=2e-4)


@given(batches, st.sampled_from(["interq", "tis", "seq_is", "geo", "interq_tis"]))
def test_junk_at_masked_positions_and_extra_padding_change_nothing(batch, arm):
    B, L, p, pv, scale, seed = batch
    old, ro, pm, vm = _batch(seed, B, L, p, pv, scale)
    fn = {"interq": interq_weights, "tis": tis_weights, "seq_is": seq_is_weights, "geo": geo_weights,
          "interq_tis": interq_tis_weights}[arm]
    w, m = fn(old, ro, pm, vm)
    off = ~(pm & vm)
    old_j, ro_j = old.clone(), ro.clone()
    old_j[off] = float("nan")
    ro_j[off] = torch.where(torch.arange(int(off.sum())) % 2 == 0, math.inf, 123.0).to(F64)
    w_j, m_j = fn(old_j, ro_j, pm, vm)
    torch.testing.assert_close(w_j, w, atol=0, rtol=0)
    assert m_j == m
    # extra padding columns (tensors and masks) leave the original columns unchanged
    pad = 5
    old_p = torch.cat([old, torch.full((B, pad), float("nan"), dtype=F64)], dim=1)
    ro_p = torch.cat([ro, torch.zeros(B, pad, dtype=F64)], dim=1)
    pm_p = torch.cat([pm, torch.ones(B, pad, dtype=torch.bool)], dim=1)
    vm_p = torch.cat([vm, torch.zeros(B, pad, dtype=torch.bool)], dim=1)
    w_p, m_p = fn(old_p, ro_p, pm_p, vm_p)
    torch.testing.assert_close(w_p[:, :L], w, atol=1e-15, rtol=0)
    assert bool((w_p[:, L:] == 1).all())
    assert m_p == pytest.approx(m, rel=1e-12, abs=1e-15)


@given(batches)
def test_batch_permutation_permutes_weights(batch):
    B, L, p, pv, scale, seed = batch
    old, ro, pm, vm = _batch(seed, B, L, p, pv, scale)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(seed))
    w, _ = interq_weights(old, ro, pm, vm)
    w_perm, _ = interq_weights(old[perm], ro[perm], pm[perm], vm[perm])
    torch.testing.assert_close(w_perm, w[perm], atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("arm", ["interq", "prefix", "tis", "mis", "seq_is", "geo"])
def test_low_precision_inputs_give_finite_float32(dtype, arm):
    old, ro, pm, vm = _batch(11, B=4, L=300, scale=0.05, dtype=dtype)
    if arm in ("interq", "prefix"):
        w, m = interq_weights(old, ro, pm, vm, mode=arm)
        w64, _ = interq_weights(old.to(F64), ro.to(F64), pm, vm, mode=arm)
        torch.testing.assert_close(w.to(F64), w64, atol=1e-6, rtol=0)  # same inputs, computed in f64
    else:
        fn = {"tis": tis_weights, "mis": mis_weights, "seq_is": seq_is_weights, "geo": geo_weights}[arm]
        w, m = fn(old, ro, pm, vm)
    assert w.dtype == torch.float32
    assert bool(torch.isfinite(w).all())
    assert all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_weight_extremes_are_over_policy_tokens(sign):
    """All policy weights on one side of 1: the 1s of tool tokens must not leak into min/max."""
    old = torch.tensor([[-1.0, -1.0, 0.0, -1.0]], dtype=F64)
    pm = torch.tensor([[True, True, False, True]])
    w, m = interq_weights(old, old - sign * 0.01, pm, mode="prefix")
    assert m["correction/weight_min"] == pytest.approx(float(w[pm].min()))
    assert m["correction/weight_max"] == pytest.approx(float(w[pm].max()))
    assert m["correction/weight_mean"] == pytest.approx(float(w[pm].mean()))


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_empty_batches(shape):
    zeros, pm = torch.zeros(shape), torch.zeros(shape, dtype=torch.bool)
    for fn in (interq_weights, tis_weights, mis_weights, seq_is_weights, geo_weights, none_weights):
        w, m = fn(zeros, zeros, pm)
        assert w.shape == shape and m["correction/weight_mean"] == 1.0
    m = mismatch_metrics(zeros, zeros, pm)
    assert m["mismatch/k3"] == 0.0 and m["correction/segments"] == 0.0


def test_weights_are_detached():
    old, ro, pm, vm = _batch(1)
    old.requires_grad_(True)
    w, _ = interq_weights(old, ro, pm, vm)
    assert not w.requires_grad


def test_large_mismatch_stays_bounded_and_finite():
    old, ro, pm, vm = _batch(5, B=2, L=2000, scale=3.0, dtype=torch.float32)
    for arm in ("interq", "prefix", "global"):
        w, _ = interq_weights(old, ro, pm, vm, mode=arm)
        n = torch.cumsum(pm & vm, 1).float()
        assert bool(torch.isfinite(w).all())
        assert float(w.max()) <= math.exp(0.05 * math.sqrt(2000)) + 1e-4
    w, _ = seq_is_weights(old, ro, pm, vm, cap=2.0)
    assert float(w.max()) <= 2.0 + 1e-6
    m = mismatch_metrics(old, ro, pm, vm)
    assert all(math.isfinite(v) for v in m.values())
    del n


# --------------------------------------------------------------------------------------------
# bad input


def _good():
    old, ro, pm, vm = _batch(0, B=2, L=6)
    return {"old_logprobs": old, "rollout_logprobs": ro, "policy_mask": pm, "valid_mask": vm}


@pytest.mark.parametrize("fn", [interq_weights, tis_weights, mis_weights, seq_is_weights, geo_weights,
                                none_weights, mismatch_metrics])
@pytest.mark.parametrize("arg,value", [
    ("old_logprobs", float("nan")),
    ("rollout_logprobs", float("inf")),
    ("old_logprobs", "shape"),
    ("rollout_logprobs", "shape"),
    ("policy_mask", "float"),
    ("valid_mask", "int"),
    ("valid_mask", "shape"),
])
def test_bad_input_names_the_argument(fn, arg, value):
    kw = _good()
    x = kw[arg]
    if value == "shape":
        kw[arg] = torch.cat([x, x[:, :1]], dim=1)
    elif value == "float":
        kw[arg] = x.to(torch.float32)
    elif value == "int":
        kw[arg] = x.to(torch.int64)
    else:
        x = x.clone()
        x[kw["policy_mask"] & kw["valid_mask"]] = value  # at a policy token
        kw[arg] = x
    with pytest.raises(ValueError, match=arg):
        fn(**kw)


def test_nan_at_masked_position_is_fine_but_not_at_policy_token():
    kw = _good()
    eff = kw["policy_mask"] & kw["valid_mask"]
    kw["old_logprobs"] = kw["old_logprobs"].masked_fill(~eff, float("nan"))
    interq_weights(**kw)
    with pytest.raises(InputError, match="old_logprobs"):
        interq_weights(**{**kw, "valid_mask": None, "policy_mask": torch.ones_like(eff)})


def test_bad_parameters():
    kw = _good()
    with pytest.raises(ConfigError, match="mode"):
        interq_weights(**kw, mode="prefixx")
    with pytest.raises(ValueError, match="alpha_g"):
        interq_weights(**kw, alpha_g=1.5)
    with pytest.raises(ValueError, match="eps_low"):
        interq_weights(**kw, eps_low=-0.1)
    with pytest.raises(ValueError, match="iters"):
        interq_weights(**kw, iters=0)
    with pytest.raises(ValueError, match="iters"):
        allocate_budget(torch.ones(2), torch.ones(2), iters=2.5)
    with pytest.raises(ValueError, match="cap"):
        tis_weights(**kw, cap=0.0)
    with pytest.raises(ValueError, match="hi"):
        mis_weights(**kw, lo=2.0, hi=1.0)
    with pytest.raises(ValueError, match="C_s"):
        allocate_budget(torch.tensor([-1.0]), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="rho_s"):
        allocate_budget(torch.tensor([1.0]), torch.tensor([0.5, 0.5]))


# --------------------------------------------------------------------------------------------
# the registry


def test_registry_holds_every_arm_with_its_parameters():
    assert list(CORRECTIONS)[:9] == ["interq", "prefix", "global", "tis", "mis", "seq_is", "geo", "none",
                                     "interq_tis"]
    assert not hasattr(correction, "ARMS")
    for mode in correction.INTERQ_MODES:
        assert correction_params(mode) == ("eps_low", "eps_high", "alpha_g", "rho_eps", "iters")
    assert correction_params("interq_tis") == ("eps_low", "eps_high", "alpha_g", "rho_eps", "iters", "cap")
    assert correction_params("tis") == ("cap",) and correction_params("mis") == ("lo", "hi")
    assert correction_params("seq_is") == ("cap",) and correction_params("none") == ()
    assert get_correction("tis") is tis_weights and get_correction("none") is none_weights


@pytest.mark.parametrize("mode", ["interq", "prefix", "global"])
def test_registered_interq_modes_are_interq_weights(mode):
    old, ro, pm, vm = _batch(11, scale=0.1)
    w, m = get_correction(mode)(old, ro, pm, vm, alpha_g=0.3)
    w_ref, m_ref = interq_weights(old, ro, pm, vm, alpha_g=0.3, mode=mode)
    torch.testing.assert_close(w, w_ref, rtol=0, atol=0)
    assert m == m_ref


def test_interq_terms_and_the_mode_arms_take_the_keywords_of_interq_weights():
    """The seven keywords are written once, in interq_weights' signature (its defaults those of the record
    the functions make); interq_terms and the arms (all but ``mode``) take the same, an unknown one is a
    TypeError as for any function, and each keyword reaches the record."""
    import inspect
    from dataclasses import fields

    def keywords(fn):
        return [(p.name, p.default, p.annotation) for p in inspect.signature(fn).parameters.values()
                if p.kind is p.KEYWORD_ONLY]

    want = keywords(interq_weights)
    assert [k[0] for k in want] == ["eps_low", "eps_high", "alpha_g", "rho_eps", "iters", "mode", "check"]
    assert [(f.name, f.default, f.type) for f in fields(correction._InterQSettings)] == want
    assert keywords(interq_terms) == want
    for mode in correction.INTERQ_MODES:
        assert keywords(get_correction(mode)) == [k for k in want if k[0] != "mode"]
    old, ro, pm, vm = _batch(5, scale=0.1)
    with pytest.raises(TypeError, match="^interq_terms\\(\\) got an unexpected keyword argument 'eps_lo'$"):
        interq_terms(old, ro, pm, vm, eps_lo=0.1)
    with pytest.raises(TypeError, match="^_prefix_arm\\(\\) got an unexpected keyword argument 'mode'$"):
        get_correction("prefix")(old, ro, pm, vm, mode="interq")
    with pytest.raises(TypeError, match="positional"):
        interq_terms(old, ro, pm, vm, 0.1)
    with pytest.raises(InputError, match="alpha_g"):
        interq_terms(old, ro, pm, vm, alpha_g=2.0)
    with pytest.raises(ConfigError, match="mode"):
        interq_terms(old, ro, pm, vm, mode="bogus")
    with pytest.raises(ConfigError, match="check"):
        get_correction("global")(old, ro, pm, vm, check=1)
    t = interq_terms(old, ro, pm, vm, eps_low=0.01, eps_high=0.02, alpha_g=0.3, rho_eps=0.0, iters=20,
                     mode="global", check=False)
    w, _ = interq_weights(old, ro, pm, vm, eps_low=0.01, eps_high=0.02, alpha_g=0.3, rho_eps=0.0, iters=20,
                          mode="global", check=False)
    torch.testing.assert_close(t.weights, w, rtol=0, atol=0)
    assert not torch.equal(w, interq_weights(old, ro, pm, vm)[0])  # the keywords were used


def test_registered_arms_pickle():
    import pickle

    for name, fn in CORRECTIONS.items():
        assert pickle.loads(pickle.dumps(fn)) is fn, name


def test_unknown_arm_lists_every_registered_name():
    with pytest.raises(ConfigError, match="correction: unknown 'bogus'; valid: interq, prefix, global, tis, mis, "
                                          "seq_is, geo, none, interq_tis"):  # and any registered after them
        get_correction("bogus")
    with pytest.raises(ConfigError, match="unknown"):
        correction_params("bogus")


def _half_tis(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, cap: float = 2.0):
    w, m = tis_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask, cap=cap)
    return 1.0 + 0.5 * (w - 1.0), m


def _other(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None):
    return none_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask)


def test_register_is_idempotent_refuses_a_taken_name_and_unregisters():
    with registered_correction("half_tis_test", _half_tis):
        assert register_correction("half_tis_test")(_half_tis) is _half_tis  # the same function: a no-op
        with pytest.raises(ConfigError, match="already registered"):
            register_correction("half_tis_test")(_other)
        with pytest.raises(ConfigError, match="already registered"):
            register_correction("tis")(_half_tis)
        assert correction_params("half_tis_test") == ("cap",)
        assert "half_tis_test" in str(pytest.raises(ConfigError, get_correction, "x").value)
    assert "half_tis_test" not in CORRECTIONS
    register_correction("half_tis_test")(_half_tis)
    assert unregister_correction("half_tis_test") is _half_tis and "half_tis_test" not in CORRECTIONS
    with pytest.raises(ConfigError, match="unknown"):
        unregister_correction("half_tis_test")


def test_register_refuses_what_no_trainer_could_call():
    def no_default(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, cap):
        return tis_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask, cap=cap)

    def var_kw(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, **params):
        return tis_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask, **params)

    def three(old_logprobs, rollout_logprobs, policy_mask):
        return none_weights(old_logprobs, rollout_logprobs, policy_mask)

    for fn, match in [(no_default, "need a default"), (var_kw, "no \\*args"), (three, "valid_mask")]:
        with pytest.raises(ConfigError, match=match):
            register_correction("bad_arm_test")(fn)
    with pytest.raises(ConfigError, match="letters, digits"):
        register_correction("bad:name")
    assert "bad_arm_test" not in CORRECTIONS


@pytest.mark.parametrize("arm, params", [("interq", {"alpha_g": 0.4, "eps_low": 0.03}), ("prefix", {}),
                                         ("global", {"alpha_g": 0.2, "iters": 30}), ("tis", {"cap": 1.5}),
                                         ("mis", {}), ("seq_is", {}), ("geo", {}), ("none", {}),
                                         ("mis", {"lo": 0.36787944117144233, "hi": math.inf}),
                                         ("interq_tis", {"alpha_g": 0.4, "cap": 1.05}), ("interq_tis", {})])
def test_correction_weights_equals_the_arm_then_mismatch_metrics(arm, params):
    """One InterQ pass per batch, the same numbers as the two calls it replaces."""
    old, ro, pm, vm = _batch(12, B=4, L=48, scale=0.08)
    w, m = correction_weights(arm, old, ro, pm, vm, params)
    w_ref, m_arm = get_correction(arm)(old, ro, pm, vm, **params)
    interq_params = ({k: v for k, v in params.items() if k != "cap"} if arm in (*correction.INTERQ_MODES, "interq_tis")
                     else {})
    diag = mismatch_metrics(old, ro, pm, vm, **interq_params)
    want = {**diag, **m_arm, **{k: v for k, v in diag.items() if k in m_arm and k.startswith("mismatch/")}}
    torch.testing.assert_close(w, w_ref, rtol=0, atol=0)
    assert m.keys() == want.keys()
    for key, value in want.items():
        assert m[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    w2, m2 = correction_weights(arm, old, ro, pm, vm, params, diagnostics=False)
    torch.testing.assert_close(w2, w_ref, rtol=0, atol=0)
    assert m2 == m_arm
    with pytest.raises(ConfigError, match="correction_params: unknown \\['bogus'\\]"):
        correction_weights(arm, old, ro, pm, vm, {"bogus": 1})


@pytest.mark.parametrize("mode", ["interq", "prefix", "global"])
def test_mismatch_metrics_from_terms_are_the_same_numbers(mode):
    old, ro, pm, vm = _batch(13, B=3, L=64, scale=0.1)
    kw = {"alpha_g": 0.35, "eps_high": 0.04}
    t = interq_terms(old, ro, pm, vm, mode=mode, **kw)
    got = mismatch_metrics(old, ro, pm, vm, terms=t, **kw)
    want = mismatch_metrics(old, ro, pm, vm, **kw)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    with pytest.raises(InputError, match="terms"):
        mismatch_metrics(old[:, :10], ro[:, :10], pm[:, :10], terms=t)


@pytest.mark.parametrize("fn", ["interq_weights", "correction_weights", "mismatch_metrics"])
def test_probabilities_or_positive_numbers_instead_of_log_probs_are_named(fn):
    import creditlab.core.correction as corr

    old, ro, pm, vm = _batch(3)
    call = (lambda o, r: corr.correction_weights("interq", o, r, pm, vm)) if fn == "correction_weights" else \
        (lambda o, r: getattr(corr, fn)(o, r, pm, vm))
    call(old, ro)  # log-probs: fine
    with pytest.raises(InputError, match=r"old_logprobs: log-probs are <= 0, .*look like probabilities"):
        call(old.exp(), ro)
    with pytest.raises(InputError, match=r"rollout_logprobs: log-probs are <= 0, got 3\.5.*a policy token"):
        call(old, torch.where(pm & vm, torch.full_like(ro, 3.5), ro))
    # positive junk where the mask is off changes nothing; float rounding just above 0 is allowed
    junk = torch.where(pm & vm, ro, torch.full_like(ro, 7.0))
    call(old, junk)
    call(old, torch.where(pm & vm, torch.full_like(ro, 5e-5), ro))
    assert corr.logprob_tolerance(torch.bfloat16) > corr.logprob_tolerance(torch.float32) == 1e-4


# --------------------------------------------------------------------------------------------
# the input checks: one pass and one host read; check=False; sync=False (no host read at all)

ARMS = ("interq", "prefix", "global", "tis", "mis", "seq_is", "geo", "none", "interq_tis")
CHECKED = {
    **{f"arm {a}": (lambda kw, check, a=a: get_correction(a)(**kw, check=check)) for a in ARMS},
    **{f"correction_weights {a}": (lambda kw, check, a=a: correction_weights(a, **kw, check=check)) for a in ARMS},
    "mismatch_metrics": lambda kw, check: mismatch_metrics(**kw, check=check),
    "interq_terms": lambda kw, check: interq_terms(**kw, check=check),
}


def _kw(seed=5, B=4, L=48, dtype=torch.float32, **batch):
    old, ro, pm, vm = _batch(seed, B=B, L=L, dtype=dtype, **batch)
    return {"old_logprobs": old, "rollout_logprobs": ro, "policy_mask": pm, "valid_mask": vm}


def _assert_identical(a, b):
    """Bit-identical results: tensors equal, metric dicts equal (``b`` may add nonfinite_tokens = 0)."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        b = dict(b)
        assert b.pop("correction/nonfinite_tokens", 0.0) == 0.0
        assert a == b
    elif isinstance(a, tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_identical(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("junk", [False, True])
@pytest.mark.parametrize("name", sorted(CHECKED))
def test_the_checks_cost_at_most_one_host_read_and_turning_them_off_changes_no_number(name, junk):
    """The InterQ pass reads the extremes of both log-probs with the packed width; only when they show
    junk (NaN / positive values off the policy tokens, allowed) do the checks read again."""
    from host_syncs import HostSyncs

    kw = _kw()
    if junk:
        off_policy = ~(kw["policy_mask"] & kw["valid_mask"])
        kw["old_logprobs"] = kw["old_logprobs"].masked_fill(off_policy, float("nan"))
        kw["rollout_logprobs"] = kw["rollout_logprobs"].masked_fill(off_policy, 3.0)
    with HostSyncs() as on:
        checked = CHECKED[name](kw, True)
    with HostSyncs() as off:
        unchecked = CHECKED[name](kw, False)
    extra = len(on.records) - len(off.records)
    assert extra in (0, 1), (on.records, off.records)
    assert extra == 1 or not junk and (name.startswith("interq") or name.startswith("mismatch") or
                                       any(a in name for a in correction.INTERQ_MODES))
    assert not [r for r in on.records if "scalar" in r.what]  # one transfer each, no item() / bool()
    _assert_identical(checked, unchecked)


@pytest.mark.parametrize("arm", ARMS)
def test_check_false_counts_nonfinite_tokens_instead_of_raising(arm):
    kw = _kw(6, dtype=F64)
    pm = kw["policy_mask"] & kw["valid_mask"]
    (b0, t0), (b1, t1) = pm.nonzero()[[0, -1]].tolist()
    old, ro = kw["old_logprobs"].clone(), kw["rollout_logprobs"].clone()
    old[b0, t0], ro[b1, t1] = float("nan"), float("-inf")
    old[~pm] = float("nan")  # junk off the policy tokens is not counted
    bad = {**kw, "old_logprobs": old, "rollout_logprobs": ro}
    fn = get_correction(arm)
    with pytest.raises(InputError, match="old_logprobs: contains NaN or inf"):
        fn(**bad)
    with pytest.raises(InputError, match="old_logprobs: contains NaN or inf"):
        correction_weights(arm, **bad, check=True)
    w, m = fn(**bad, check=False)
    assert m.pop("correction/nonfinite_tokens") == 2.0
    # those two tokens count as tokens without mismatch
    fixed = {**kw, "old_logprobs": kw["old_logprobs"].clone(), "rollout_logprobs": kw["rollout_logprobs"].clone()}
    for b, t in ((b0, t0), (b1, t1)):
        fixed["old_logprobs"][b, t] = fixed["rollout_logprobs"][b, t] = -1.0
    w_ref, m_ref = fn(**fixed)
    assert torch.equal(w, w_ref) and bool(torch.isfinite(w).all())
    _assert_identical(m_ref, m)
    _, mm = correction_weights(arm, **bad, check=False)
    assert mm["correction/nonfinite_tokens"] == 2.0


def test_check_false_still_checks_shapes_dtypes_and_its_own_type():
    kw = _kw()
    with pytest.raises(InputError, match="policy_mask"):
        interq_weights(**{**kw, "policy_mask": kw["policy_mask"].float()}, check=False)
    with pytest.raises(InputError, match="rollout_logprobs: dimension 1"):
        tis_weights(**{**kw, "rollout_logprobs": kw["rollout_logprobs"][:, :5]}, check=False)
    with pytest.raises(ConfigError, match="check: must be True or False"):
        interq_weights(**kw, check="no")
    with pytest.raises(ConfigError, match="check: .*pass check=False with sync=False"):
        correction_weights("interq", **kw, sync=False)
    assert "check" not in correction_params("tis") and "check" not in correction_params("interq")


@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("diagnostics", [True, False])
@pytest.mark.parametrize("shape", [(4, 48), (3, 7), (2, 1)])
def test_sync_false_reads_nothing_then_once_and_gives_the_same_numbers(arm, diagnostics, shape):
    from host_syncs import HostSyncs

    B, L = shape
    kw = _kw(7, B=B, L=L, scale=0.08)
    with HostSyncs() as syncs:
        w, m = correction_weights(arm, **kw, diagnostics=diagnostics, check=False, sync=False)
    assert syncs.records == []
    assert isinstance(m, correction.DeviceMetrics)
    with HostSyncs() as syncs:
        got = dict(m)
    assert [r.what for r in syncs.records] == ["tolist"]
    w_ref, want = correction_weights(arm, **kw, diagnostics=diagnostics, check=False)
    assert torch.equal(w, w_ref)
    assert got.keys() == want.keys()  # the same turns and quantiles present
    for key, value in want.items():  # sums of float32 terms in another order: float32 rounding apart
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_sync_false_without_segments_drops_the_segment_metrics():
    kw = _kw(8)
    kw["policy_mask"] = torch.zeros_like(kw["policy_mask"])
    w, m = correction_weights("interq", **kw, check=False, sync=False)
    _, want = correction_weights("interq", **kw)
    assert bool((w == 1).all()) and dict(m).keys() - {"correction/nonfinite_tokens"} == want.keys()
    assert not any(k.startswith(("mismatch/turn", "correction/rho_q", "correction/C_mean")) for k in m)
    assert m["correction/segments"] == 0.0


def test_device_metrics_read_once_keep_what_exists_and_pickle():
    import pickle

    from host_syncs import HostSyncs

    m = correction.DeviceMetrics({"a": torch.tensor(1.5), "b": 2.0},
                                 present={"a": torch.tensor(True)})
    m.add(correction.DeviceMetrics({"c": torch.tensor(3.0), "gone": torch.tensor(9.0)},
                                   present={"gone": torch.tensor(False)}), prefix="x/")
    assert "not read yet" in repr(m)
    with HostSyncs() as syncs:
        assert m["x/c"] == 3.0 and "x/gone" not in m and len(m) == 3
        assert dict(m) == {"a": 1.5, "b": 2.0, "x/c": 3.0}
    assert [r.what for r in syncs.records] == ["tolist"]
    back = pickle.loads(pickle.dumps(m))
    assert isinstance(back, correction.DeviceMetrics) and back == {"a": 1.5, "b": 2.0, "x/c": 3.0}


def test_the_host_sync_counter_sees_every_kind_of_read():
    """The counter the hot-path tests rely on is not blind: the synced paths are seen reading."""
    from host_syncs import HostSyncs

    kw = _kw()
    x = kw["old_logprobs"]
    with HostSyncs() as syncs:
        x.sum().item()
        bool(x.sum() < 0)
        x[kw["policy_mask"]]
        x.nonzero()
        x.tolist()
        x.numpy()
    assert len(syncs.records) == 6, syncs.records
    with HostSyncs() as syncs:
        correction_weights("interq", **kw, check=False)  # sync=True: the segment count and the floats
    assert [r.what for r in syncs.records if "nonzero" in r.what] and syncs.creditlab == syncs.records
