"""An arm as a config names it (``parse_correction``), ``mis`` without an upper bound, and the composed arm
``interq_tis`` (InterQ-RL's weight times the truncated token ratio)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from creditlab.core import correction
from creditlab.core.correction import (
    CORRECTIONS,
    correction_params,
    correction_weights,
    get_correction,
    interq_tis_weights,
    interq_weights,
    mis_weights,
    mismatch_metrics,
    parse_correction,
    tis_weights,
)
from creditlab.errors import ConfigError, InputError
from reference.ref_correction import ref_interq_tis

F64 = torch.float64
INTERQ_KEYS = ("eps_low", "eps_high", "alpha_g", "rho_eps", "iters")


def _batch(seed, B=3, L=40, p=0.7, p_valid=0.95, scale=0.05, dtype=F64):
    """Random log-probs with a ragged policy mask and padding; old - rollout ~ N(0, scale^2)."""
    g = torch.Generator().manual_seed(seed)
    pm = torch.rand(B, L, generator=g) < p
    vm = torch.rand(B, L, generator=g) < p_valid
    old = -(torch.randn(B, L, generator=g, dtype=F64) * 0.5 - 1.0).abs().to(dtype)  # log-probs are <= 0
    ro = -(old.to(F64) + torch.randn(B, L, generator=g, dtype=F64) * scale).abs().to(dtype)
    return old, ro, pm, vm


batches = st.tuples(
    st.integers(1, 4),  # B
    st.integers(1, 32),  # L
    st.sampled_from([0.0, 0.3, 0.6, 0.9, 1.0]),  # policy density
    st.sampled_from([0.7, 1.0]),  # valid density
    st.sampled_from([0.005, 0.03, 0.2, 0.6]),  # mismatch scale (0.6: the cap and the envelope bind often)
    st.integers(0, 2**31 - 1),
)
settings_of_the_arm = st.fixed_dictionaries({
    "cap": st.sampled_from([1.05, 1.5, 2.0, 10.0]),
    "alpha_g": st.sampled_from([0.0, 0.3, 0.5, 1.0]),
    "eps_high": st.sampled_from([0.02, 0.05, 0.3]),
})


# --------------------------------------------------------------------------------------------
# parse_correction


def test_parse_correction_reads_arms_parameters_and_inf():
    assert parse_correction("interq_tis:cap=3,alpha_g=0.4") == ("interq_tis", {"cap": 3.0, "alpha_g": 0.4})
    assert parse_correction(" tis ") == ("tis", {})
    assert parse_correction("interq:iters=20, eps_low = 0.01") == ("interq", {"iters": 20, "eps_low": 0.01})
    assert type(parse_correction("interq:iters=20")[1]["iters"]) is int
    arm, params = parse_correction("mis:lo=0.36787944117144233,hi=inf")
    assert arm == "mis" and params == {"lo": math.exp(-1.0), "hi": math.inf}
    assert parse_correction("creditlab_tis:cap=inf", "rollout_is", "creditlab_") == ("tis", {"cap": math.inf})


@pytest.mark.parametrize("spec, where, match", [
    ("", "correction", "^correction: expected '<arm>\\[:key=value,...\\]', got ''$"),
    ("bogus", "GRPOConfig.correction", "^GRPOConfig.correction: unknown arm 'bogus'; valid: interq, prefix, global"),
    ("interq_tis:lo=1", "correction", "^correction: bad parameter 'lo=1' for interq_tis; valid keys: eps_low, "
                                      "eps_high, alpha_g, rho_eps, iters, cap$"),
    ("tis:cap", "correction", "bad parameter 'cap' for tis"),
    ("tis:cap=big", "correction", "^correction:cap: expected a number, got 'big'$"),
    ("interq:iters=2.5", "correction", "^correction:iters: expected a number, got '2.5'$"),
    ("mis:lo=2,hi=1", "correction", "^correction: 'mis:lo=2,hi=1': hi: must be >= 2.0, got 1.0$"),
    ("interq_tis:cap=0", "cfg", "^cfg: 'interq_tis:cap=0': cap: must be > 0.0, got 0.0$"),
    ("interq_tis:alpha_g=2", "cfg", "^cfg: 'interq_tis:alpha_g=2': alpha_g: must be <= 1.0, got 2.0$"),
])
def test_parse_correction_errors_name_where(spec, where, match):
    with pytest.raises(ConfigError, match=match):
        parse_correction(spec, where)


def test_parse_correction_with_a_prefix_and_the_old_name_is_gone():
    with pytest.raises(ConfigError, match="^rollout_is: expected 'creditlab_<arm>.*got 'tis'$"):
        parse_correction("tis", "rollout_is", "creditlab_")
    with pytest.raises(ConfigError, match="unknown arm 'bogus'; valid: creditlab_interq, creditlab_prefix"):
        parse_correction("creditlab_bogus", "rollout_is", "creditlab_")
    import creditlab.integrations._common as common

    assert not hasattr(common, "parse_correction_spec") and "parse_correction_spec" not in common.__all__
    assert "parse_correction" in correction.__all__


# --------------------------------------------------------------------------------------------
# mis with hi = inf: masking below only


def _golden_mis_batch():
    """delta = [-2, -0.5, 0, 3] on the policy tokens, then a tool token (rollout log-prob 0, junk)."""
    rollout = torch.tensor([[-4.0, -4.0, -4.0, -4.0, 0.0]], dtype=F64)
    old = torch.tensor([[-6.0, -4.5, -4.0, -1.0, -0.3]], dtype=F64)
    pm = torch.tensor([[True, True, True, True, False]])
    return old, rollout, pm


def test_mis_without_upper_bound_golden():
    old, rollout, pm = _golden_mis_batch()
    params = {"lo": 0.36787944117144233, "hi": math.inf}  # masks delta < -1 only
    w, m = mis_weights(old, rollout, pm, **params)
    want = torch.tensor([[0.0, math.exp(-0.5), 1.0, math.exp(3.0), 1.0]], dtype=F64)
    torch.testing.assert_close(w, want, rtol=4 * torch.finfo(F64).eps, atol=0)
    assert w[0, 0] == 0.0 and w[0, 2] == 1.0 and w[0, 4] == 1.0  # masked: exactly 0; no mismatch / off policy: 1
    assert m["correction/clip_rate"] == 0.25  # one of four policy tokens masked
    assert m["correction/weight_max"] == pytest.approx(math.exp(3.0), rel=1e-15)
    assert all(math.isfinite(v) for v in m.values())
    # the default upper bound 2 masks e^3 as well
    w2, _ = mis_weights(old, rollout, pm)
    assert w2[0, 3] == 0.0 and w2[0, 0] == 0.0
    # the same through correction_weights and the hot path (no host read), in float32
    w3, _ = correction_weights("mis", old, rollout, pm, params=params)
    torch.testing.assert_close(w3, w, rtol=0, atol=0)
    w4, m4 = correction_weights("mis", old.float(), rollout.float(), pm, params=params, check=False, sync=False)
    torch.testing.assert_close(w4, want.float(), rtol=4 * torch.finfo(torch.float32).eps, atol=0)
    assert m4["correction/clip_rate"] == 0.25


def test_mis_masked_overflowing_ratio_is_zero_not_nan():
    """A ratio beyond float32 (delta = 100: exp overflows to inf) masked by a finite hi weighs exactly 0."""
    old = torch.tensor([[-0.5, -1.0]])
    rollout = torch.tensor([[-100.5, -1.0]])
    pm = torch.tensor([[True, True]])
    w, m = mis_weights(old, rollout, pm, lo=0.5, hi=2.0)
    assert w.tolist() == [[0.0, 1.0]] and m["correction/clip_rate"] == 0.5
    assert all(math.isfinite(v) for k, v in m.items() if not k.startswith("mismatch/"))


def test_mis_bounds_are_checked():
    old, rollout, pm = _golden_mis_batch()
    for bad, match in (({"lo": 0.0}, "lo: must be > 0"), ({"lo": 1.0, "hi": 0.5}, "hi: must be >= 1.0"),
                       ({"hi": math.nan}, "hi: is NaN")):
        with pytest.raises(InputError, match=match):
            mis_weights(old, rollout, pm, **bad)


# --------------------------------------------------------------------------------------------
# interq_tis


def test_interq_tis_is_registered_with_interqs_parameters_and_cap():
    assert get_correction("interq_tis") is interq_tis_weights and "interq_tis" in CORRECTIONS
    assert correction_params("interq_tis") == (*INTERQ_KEYS, "cap")


@given(batches, settings_of_the_arm)
def test_interq_tis_is_the_interq_weight_times_the_tis_weight(batch, params):
    B, L, p, pv, scale, seed = batch
    old, ro, pm, vm = _batch(seed, B, L, p, pv, scale)
    interq = {k: v for k, v in params.items() if k != "cap"}
    w, m = interq_tis_weights(old, ro, pm, vm, **params)
    w_interq, m_interq = interq_weights(old, ro, pm, vm, **interq)
    w_tis, m_tis = tis_weights(old, ro, pm, vm, cap=params["cap"])
    torch.testing.assert_close(w, w_interq * w_tis, rtol=8 * torch.finfo(F64).eps, atol=0)
    eff = pm & vm
    assert bool((w[~eff] == 1).all())
    # the loop reference
    ref = ref_interq_tis(old.tolist(), ro.tolist(), eff.tolist(), **params)
    torch.testing.assert_close(w, torch.tensor(ref, dtype=F64), atol=1e-10, rtol=1e-10)
    # metrics: the InterQ pass's, the weight extremes of the product, and TIS's truncation share
    for key in ("correction/clip_rate", "correction/rho_mean", "correction/alpha_mean", "correction/segments",
                "mismatch/k3", "mismatch/mean_abs_delta"):
        assert m[key] == m_interq[key], key
    assert m["correction/token_clip_rate"] == m_tis["correction/clip_rate"]
    if bool(eff.any()):
        on = w[eff]
        assert m["correction/weight_min"] == pytest.approx(float(on.min()), rel=4 * torch.finfo(F64).eps)
        assert m["correction/weight_max"] == pytest.approx(float(on.max()), rel=4 * torch.finfo(F64).eps)
        assert m["correction/weight_mean"] == pytest.approx(float(on.mean()), rel=1e-12)
    else:
        assert m["correction/weight_mean"] == m["correction/weight_min"] == m["correction/weight_max"] == 1.0
    assert m.keys() == {*m_interq, "correction/token_clip_rate"}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interq_tis_in_low_precision_is_the_product_in_float32(seed, dtype):
    old, ro, pm, vm = _batch(seed, B=4, L=200, scale=0.4, dtype=dtype)
    w, m = interq_tis_weights(old, ro, pm, vm, cap=1.5)
    product = interq_weights(old, ro, pm, vm)[0] * tis_weights(old, ro, pm, vm, cap=1.5)[0]
    assert w.dtype == torch.float32 and bool(torch.isfinite(w).all())
    assert bool((w[pm & vm] == 1.5 * interq_weights(old, ro, pm, vm)[0][pm & vm]).any())  # the cap binds
    torch.testing.assert_close(w, product, rtol=4 * torch.finfo(torch.float32).eps, atol=0)
    assert all(math.isfinite(v) for v in m.values())


@given(batches, settings_of_the_arm)
def test_interq_tis_without_mismatch_is_exactly_one(batch, params):
    B, L, p, pv, _, seed = batch
    old, _, pm, vm = _batch(seed, B, L, p, pv)
    w, m = interq_tis_weights(old, old.clone(), pm, vm, **params)
    assert bool((w == 1).all())
    assert m["mismatch/k3"] == 0.0 and m["correction/clip_rate"] == m["correction/token_clip_rate"] == 0.0
    w2, _ = correction_weights("interq_tis", old, old.clone(), pm, vm, params, check=False, sync=False)
    assert bool((w2 == 1).all())


@pytest.mark.parametrize("seed", [3, 4, 5, 6])
def test_interq_tis_through_correction_weights_is_the_arm_then_mismatch_metrics(seed):
    old, ro, pm, vm = _batch(seed, B=4, L=48, scale=0.3)
    params = {"alpha_g": 0.4, "eps_low": 0.03, "cap": 1.5}
    w, m = correction_weights("interq_tis", old, ro, pm, vm, params)
    w_arm, m_arm = interq_tis_weights(old, ro, pm, vm, **params)
    diag = mismatch_metrics(old, ro, pm, vm, alpha_g=0.4, eps_low=0.03)
    torch.testing.assert_close(w, w_arm, rtol=0, atol=0)
    assert bool((w[pm & vm] != 1).any()) and m_arm["correction/token_clip_rate"] > 0  # both factors at work
    want = {**diag, **m_arm, **{k: v for k, v in diag.items() if k in m_arm and k.startswith("mismatch/")}}
    assert m.keys() == want.keys()
    for key, value in want.items():
        assert m[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    # the hot path: nothing read on the host, the same weights, the metrics once read
    from host_syncs import HostSyncs

    with HostSyncs() as syncs:
        w_hot, m_hot = correction_weights("interq_tis", old, ro, pm, vm, params, check=False, sync=False)
    assert syncs.records == [] and isinstance(m_hot, correction.DeviceMetrics)
    torch.testing.assert_close(w_hot, w, rtol=0, atol=0)
    got = dict(m_hot)
    assert got.pop("correction/nonfinite_tokens") == 0.0 and got.keys() == m.keys()
    for key, value in m.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("params", [{"eps_high": math.inf},
                                    {"eps_low": math.inf, "eps_high": math.inf, "cap": math.inf}])
def test_infinite_envelope_and_cap_on_both_paths(params):
    """``eps = inf`` (no envelope on that side) and ``cap = inf`` (no truncation): finite weights, the same
    on the hot path, whose envelope table starts before a row's first policy token (0 there, not 0 * inf)."""
    old, ro, pm, vm = _batch(9, B=4, L=48, scale=0.3)
    assert not bool(pm[:, 0].all())  # some row starts with a token that is not the policy's
    w, m = correction_weights("interq_tis", old, ro, pm, vm, params)
    w_hot, m_hot = correction_weights("interq_tis", old, ro, pm, vm, params, check=False, sync=False)
    assert bool(torch.isfinite(w).all()) and bool(torch.isfinite(w_hot).all())
    torch.testing.assert_close(w_hot, w, rtol=0, atol=0)
    for key, value in m.items():
        assert math.isfinite(m_hot[key]) and m_hot[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert parse_correction("interq_tis:" + ",".join(f"{k}={v}" for k, v in params.items()))[1] == params
    if "cap" in params:  # neither envelope nor truncation: nothing clipped
        assert m["correction/clip_rate"] == m["correction/token_clip_rate"] == 0.0


def test_interq_tis_checks_its_parameters():
    old, ro, pm, vm = _batch(8)
    with pytest.raises(InputError, match="cap: must be > 0"):
        interq_tis_weights(old, ro, pm, vm, cap=0.0)
    with pytest.raises(InputError, match="alpha_g"):
        correction_weights("interq_tis", old, ro, pm, vm, {"alpha_g": 1.5})
    with pytest.raises(InputError, match="cap"):
        correction_weights("interq_tis", old, ro, pm, vm, {"cap": -1.0}, check=False, sync=False)
    with pytest.raises(ConfigError, match="unknown \\['lo'\\] for arm 'interq_tis'"):
        correction_weights("interq_tis", old, ro, pm, vm, {"lo": 0.5})
