"""Masked aggregation, PPO/GRPO policy loss and OPSD losses."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from creditlab.core.correction import interq_weights
from creditlab.core.losses import (
    AGG_MODES,
    aggregate,
    opsd_loss,
    opsd_sampled_advantages,
    opsd_sampled_loss,
    policy_loss,
)
from creditlab.errors import ConfigError, InputError
from reference.ref_losses import ref_aggregate, ref_jsd_tokens, ref_policy_token_losses

F64 = torch.float64


def _tokens(seed, B, L, p=0.7, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, L, generator=g) < p
    lp = -(torch.randn(B, L, generator=g, dtype=F64) * 0.3 - 1.0).abs().to(dtype)  # log-probs are <= 0
    old = -(lp.to(F64) + torch.randn(B, L, generator=g, dtype=F64) * 0.2).abs().to(dtype)
    adv = torch.randn(B, generator=g, dtype=F64).to(dtype)
    return lp, old, adv, mask


def _floats(metrics):
    return {k: float(v) for k, v in metrics.items()}


shapes = st.tuples(st.integers(1, 5), st.integers(1, 20), st.sampled_from([0.0, 0.3, 0.8, 1.0]),
                   st.integers(0, 2**31 - 1))


# --------------------------------------------------------------------------------------------
# aggregate


def test_aggregate_golden():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    assert float(aggregate(loss, mask, "token_mean")) == 3.0  # 15 / 5 tokens
    assert float(aggregate(loss, mask, "seq_mean_token_mean")) == 3.25  # (6/3 + 9/2) / 2 non-empty rows
    assert float(aggregate(loss, mask, "seq_mean_token_sum")) == 7.5  # (6 + 9) / 2
    assert float(aggregate(loss, mask, "seq_mean_token_sum_norm")) == 2.5  # (6 + 9) / 2 rows / L=3
    assert float(aggregate(loss, mask, "seq_mean_token_sum_norm", norm=10)) == 0.75


@pytest.mark.parametrize("mode", AGG_MODES)
def test_fully_masked_gives_zero_not_nan(mode):
    loss = torch.full((3, 4), float("nan"))
    out = aggregate(loss, torch.zeros(3, 4, dtype=torch.bool), mode)
    assert float(out) == 0.0
    assert float(aggregate(torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool), mode)) == 0.0


@given(shapes, st.sampled_from(AGG_MODES))
def test_aggregate_matches_reference(shape, mode):
    B, L, p, seed = shape
    lp, _, _, mask = _tokens(seed, B, L, p)
    assert float(aggregate(lp, mask, mode)) == pytest.approx(ref_aggregate(lp.tolist(), mask.tolist(), mode),
                                                             rel=1e-12, abs=1e-12)


@given(shapes, st.sampled_from(AGG_MODES))
def test_aggregate_junk_and_gradient_only_on_mask(shape, mode):
    B, L, p, seed = shape
    lp, _, _, mask = _tokens(seed, B, L, p)
    junk = lp.masked_fill(~mask, float("nan")).requires_grad_(True)
    out = aggregate(junk, mask, mode)
    assert float(out.detach()) == float(aggregate(lp, mask, mode))
    out.backward()
    assert bool(torch.isfinite(junk.grad).all())
    assert bool((junk.grad[~mask] == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_aggregate_low_precision_computes_in_float32(dtype):
    loss = torch.full((2, 3000), 1.001).to(dtype)
    out = aggregate(loss, torch.ones(2, 3000, dtype=torch.bool), "seq_mean_token_sum")
    assert out.dtype == torch.float32
    assert float(out) == pytest.approx(3000 * float(loss[0, 0]), rel=1e-5)


# --------------------------------------------------------------------------------------------
# policy loss


@given(shapes, st.sampled_from(AGG_MODES), st.booleans(), st.booleans())
def test_policy_loss_matches_reference(shape, mode, token_adv, weighted):
    B, L, p, seed = shape
    lp, old, adv, mask = _tokens(seed, B, L, p)
    if token_adv:
        adv = adv[:, None] * torch.linspace(-1, 1, L, dtype=F64)
    w = torch.rand(B, L, generator=torch.Generator().manual_seed(seed), dtype=F64) + 0.5 if weighted else None
    loss, m = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, weights=w, agg=mode)
    tok, clipped = ref_policy_token_losses(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28,
                                           None if w is None else w.tolist())
    assert float(loss) == pytest.approx(ref_aggregate(tok, mask.tolist(), mode), rel=1e-10, abs=1e-12)
    flags = [c for row, mrow in zip(clipped, mask.tolist(), strict=True) for c, k in zip(row, mrow, strict=True) if k]
    assert m["loss/clip_frac"] == pytest.approx(sum(flags) / len(flags) if flags else 0.0)
    ratio_terms = [old[b, t] - lp[b, t] for b in range(B) for t in range(L) if mask[b, t]]
    assert m["loss/approx_kl"] == pytest.approx(float(sum(ratio_terms)) / len(ratio_terms) if ratio_terms else 0.0,
                                                abs=1e-12)


@given(shapes, st.sampled_from([None, 3.0, 1.5]))
def test_dual_clip_matches_reference(shape, c):
    B, L, p, seed = shape
    lp, old, adv, mask = _tokens(seed, B, L, p)
    lp = lp + torch.randn(B, L, generator=torch.Generator().manual_seed(seed), dtype=F64)  # ratios up to ~e^3
    loss, _ = policy_loss(lp, old, adv, mask, clip_ratio_c=c)
    tok, _ = ref_policy_token_losses(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), clip_ratio_c=c)
    assert float(loss) == pytest.approx(ref_aggregate(tok, mask.tolist(), "token_mean"), rel=1e-10, abs=1e-12)


def test_dual_clip_golden():
    """A = -1, ratio e^2 = 7.39: PPO loss 7.39, dual clip caps it at 3 (and its gradient at 0)."""
    lp = torch.tensor([[2.0]], requires_grad=True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, _ = policy_loss(lp, torch.zeros(1, 1), torch.tensor([-1.0]), mask)
    assert float(loss.detach()) == pytest.approx(math.exp(2.0))
    loss_c, _ = policy_loss(lp, torch.zeros(1, 1), torch.tensor([-1.0]), mask, clip_ratio_c=3.0)
    assert float(loss_c.detach()) == pytest.approx(3.0)
    loss_c.backward()
    assert float(lp.grad) == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(lp, torch.zeros(1, 1), torch.tensor([-1.0]), mask, clip_ratio_c=0.5)


def test_policy_loss_golden():
    """Two tokens, A = 1: ratio e^0.5 = 1.6487 is clipped at 1.2 (loss -1.2); ratio 1 gives -1."""
    lp = torch.tensor([[0.5, 0.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = policy_loss(lp, old, torch.tensor([1.0]), mask)
    assert float(loss.detach()) == pytest.approx((-1.2 - 1.0) / 2)
    assert m["loss/clip_frac"] == 0.5
    assert m["loss/approx_kl"] == pytest.approx(-0.25)
    loss.backward()
    # clipped token: no gradient; unclipped: d(-r)/dlp / 2 = -1/2
    assert lp.grad[0].tolist() == pytest.approx([0.0, -0.5])
    # negative advantage: the ratio below 1 - clip is clipped, above is not (pessimistic bound)
    lp2 = torch.tensor([[-0.5, 0.5]])
    loss2, m2 = policy_loss(lp2, old, torch.tensor([-1.0]), mask, agg="seq_mean_token_sum")
    assert float(loss2) == pytest.approx(0.8 + math.exp(0.5))
    assert m2["loss/clip_frac"] == 0.5


def test_weights_scale_token_losses_and_gradients():
    lp, old, adv, mask = _tokens(3, 4, 30)
    lp.requires_grad_(True)
    w, _ = interq_weights(old, old - 0.03, mask)  # old <= 0: old - 0.03 < 0 too
    loss_w, m = policy_loss(lp, old, adv, mask, weights=w)
    loss_w.backward()
    g_w = lp.grad.clone()
    lp.grad = None
    loss, _ = policy_loss(lp, old, adv, mask)
    loss.backward()
    ratio = torch.where(mask, g_w / lp.grad, torch.ones_like(g_w))
    nz = mask & (lp.grad != 0)
    torch.testing.assert_close(ratio[nz], w[nz].to(F64), rtol=1e-6, atol=0)
    assert m["loss/weight_mean"] == pytest.approx(float(w[mask].to(F64).mean()))
    # unit weights give the base loss exactly
    loss_1, _ = policy_loss(lp, old, adv, mask, weights=torch.ones_like(lp))
    assert float(loss_1.detach()) == float(loss.detach())


def test_policy_loss_junk_at_masked_positions():
    lp, old, adv, mask = _tokens(4, 3, 25)
    lp_j = lp.masked_fill(~mask, float("nan")).requires_grad_(True)
    old_j = old.masked_fill(~mask, float("inf"))
    w_j = torch.ones_like(lp).masked_fill(~mask, float("nan"))
    adv_tok = adv[:, None].expand(3, 25).masked_fill(~mask, float("nan"))
    loss_j, m_j = policy_loss(lp_j, old_j, adv_tok, mask, weights=w_j)
    loss, m = policy_loss(lp, old, adv, mask)
    assert float(loss_j.detach()) == pytest.approx(float(loss), rel=1e-15)
    assert _floats(m_j) == pytest.approx(_floats(m))
    loss_j.backward()
    assert bool(torch.isfinite(lp_j.grad).all()) and bool((lp_j.grad[~mask] == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_policy_loss_low_precision(dtype):
    lp, old, adv, mask = _tokens(5, 4, 500, dtype=dtype)
    lp.requires_grad_(True)
    loss, m = policy_loss(lp, old, adv, mask)
    assert loss.dtype == torch.float32 and math.isfinite(float(loss.detach()))
    loss.backward()
    assert lp.grad.dtype == dtype and bool(torch.isfinite(lp.grad.float()).all())


def test_policy_loss_bad_input():
    lp, old, adv, mask = _tokens(0, 2, 5)
    with pytest.raises(InputError, match="logprobs"):
        policy_loss(lp.masked_fill(mask, float("nan")), old, adv, mask)
    with pytest.raises(InputError, match="old_logprobs"):
        policy_loss(lp, old[:, :4], adv, mask)
    with pytest.raises(InputError, match="advantages"):
        policy_loss(lp, old, adv[:1], mask)
    with pytest.raises(InputError, match="mask"):
        policy_loss(lp, old, adv, mask.float())
    with pytest.raises(InputError, match="weights"):
        policy_loss(lp, old, adv, mask, weights=torch.ones(2, 4))
    with pytest.raises(ConfigError, match="agg"):
        policy_loss(lp, old, adv, mask, agg="token-mean")
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(lp, old, adv, mask, clip_low=-0.1)


# --------------------------------------------------------------------------------------------
# OPSD


def _logits(seed, B=2, L=5, V=7):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, L, V, generator=g, dtype=F64)
    t = s + torch.randn(B, L, V, generator=g, dtype=F64)
    mask = torch.rand(B, L, generator=g) < 0.7
    return s, t, mask


@given(st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
def test_opsd_matches_reference(seed, beta):
    s, t, mask = _logits(seed)
    loss, m = opsd_loss(s, t, mask, beta)
    tok = ref_jsd_tokens(s.tolist(), t.tolist(), mask.tolist(), beta)
    assert float(loss) == pytest.approx(ref_aggregate(tok, mask.tolist(), "token_mean"), rel=1e-9, abs=1e-12)
    fwd = ref_jsd_tokens(s.tolist(), t.tolist(), mask.tolist(), 0.0)
    assert m["opsd/forward_kl"] == pytest.approx(ref_aggregate(fwd, mask.tolist(), "token_mean"), rel=1e-9, abs=1e-12)


def test_opsd_golden_two_token_vocabulary():
    """Student (1/2, 1/2), teacher (3/4, 1/4): forward KL = 3/4 ln(3/2) + 1/4 ln(1/2)."""
    s = torch.zeros(1, 1, 2, dtype=F64)
    t = torch.tensor([[[math.log(3.0), 0.0]]], dtype=F64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    fwd = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    rev = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert float(opsd_loss(s, t, mask, 0.0)[0]) == pytest.approx(fwd)
    assert float(opsd_loss(s, t, mask, 1.0)[0]) == pytest.approx(rev)
    # beta = 1/2: M = (5/8, 3/8); JSD = 1/2 KL(T||M) + 1/2 KL(S||M)
    jsd = 0.5 * (0.75 * math.log(0.75 / 0.625) + 0.25 * math.log(0.25 / 0.375)) + 0.5 * (
        0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375))
    assert float(opsd_loss(s, t, mask, 0.5)[0]) == pytest.approx(jsd)


def test_opsd_zero_when_equal_gradient_to_student_only():
    s, t, mask = _logits(1)
    loss, _ = opsd_loss(s, s.clone(), mask, 0.5)
    assert float(loss) == pytest.approx(0.0, abs=1e-12)
    s = s.requires_grad_(True)
    t = t.requires_grad_(True)
    loss, _ = opsd_loss(s, t, mask, 0.3)
    loss.backward()
    assert t.grad is None
    assert bool((s.grad[~mask] == 0).all()) and float(s.grad.abs().sum()) > 0


def test_opsd_masked_vocabulary_and_junk():
    s, t, mask = _logits(2)
    s2, t2 = s.clone(), t.clone()
    s2[..., 0] = -math.inf  # a vocabulary entry both models exclude
    t2[..., 0] = -math.inf
    s2[~mask] = math.nan
    s2.requires_grad_(True)
    loss, m = opsd_loss(s2, t2, mask, 0.5)
    assert math.isfinite(float(loss.detach()))
    loss.backward()
    assert bool(torch.isfinite(s2.grad).all())
    with pytest.raises(InputError, match="student_logits"):
        opsd_loss(s.masked_fill(mask[..., None], math.nan), t, mask, 0.5)
    with pytest.raises(ValueError, match="beta"):
        opsd_loss(s, t, mask, 1.5)
    with pytest.raises(InputError, match="teacher_logits"):
        opsd_loss(s, t[..., :3], mask, 0.5)


def test_opsd_sampled_variant():
    g = torch.Generator().manual_seed(0)
    student = (torch.randn(3, 8, generator=g, dtype=F64) - 2).requires_grad_(True)
    teacher = torch.randn(3, 8, generator=g, dtype=F64) - 2
    mask = torch.rand(3, 8, generator=g) < 0.6
    adv = opsd_sampled_advantages(student, teacher, mask)
    assert not adv.requires_grad
    torch.testing.assert_close(adv, torch.where(mask, teacher - student.detach(), 0.0))
    loss, m = opsd_sampled_loss(student, teacher, mask)
    loss.backward()
    # d/d student of -adv * student (adv detached) is -adv / n_tokens
    torch.testing.assert_close(student.grad, -adv / mask.sum())
    assert m["opsd/reverse_kl"] == pytest.approx(float((student - teacher).detach()[mask].mean()))


# --------------------------------------------------------------------------------------------
# the trainer hot path: no host reads, tensors out


def _meta_inputs(B=4, L=7, V=None):
    meta = {"device": "meta"}
    lp = torch.empty(B, L, **meta, requires_grad=True)
    old, adv, w = torch.empty(B, L, **meta), torch.empty(B, L, **meta), torch.empty(B, L, **meta)
    mask = torch.empty(B, L, dtype=torch.bool, **meta)
    return lp, old, adv, w, mask


@pytest.mark.parametrize("check_finite", [False, True])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_policy_loss_runs_on_meta_tensors_and_returns_tensors(agg, check_finite):
    """Any host read raises on ``meta`` tensors, so running to the end proves there is none."""
    lp, old, adv, w, mask = _meta_inputs()
    loss, m = policy_loss(lp, old, adv, mask, weights=w, agg=agg, clip_ratio_c=3.0, check_finite=check_finite)
    assert loss.device.type == "meta" and loss.shape == () and loss.requires_grad
    assert all(isinstance(v, torch.Tensor) and v.shape == () and v.device.type == "meta" and not v.requires_grad
               for v in m.values())
    assert ("loss/nonfinite_tokens" in m) is not check_finite
    loss, _ = policy_loss(lp, old, adv[:, 0], mask, agg=agg, check_finite=check_finite)  # (B,) advantages
    assert loss.device.type == "meta"
    assert aggregate(lp, mask, agg, check_finite=check_finite).device.type == "meta"


def test_opsd_losses_run_on_meta_tensors():
    B, L, V = 3, 5, 11
    s = torch.empty(B, L, V, device="meta", requires_grad=True)
    t = torch.empty(B, L, V, device="meta")
    mask = torch.empty(B, L, dtype=torch.bool, device="meta")
    for beta in (0.0, 0.5, 1.0):
        loss, m = opsd_loss(s, t, mask, beta, check_finite=False)
        assert loss.device.type == "meta" and all(v.device.type == "meta" for v in m.values())
        assert "opsd/nonfinite_tokens" in m
    lp = torch.empty(B, L, device="meta", requires_grad=True)
    loss, m = opsd_sampled_loss(lp, torch.empty(B, L, device="meta"), mask, check_finite=False)
    assert loss.device.type == "meta" and all(v.device.type == "meta" for v in m.values())


def test_policy_loss_reads_nothing_on_the_host_with_check_finite_false(host_reads):
    lp, old, adv, mask = _tokens(3, 6, 30, dtype=torch.float32)
    w = torch.rand(6, 30)
    with host_reads:
        loss, m = policy_loss(lp.requires_grad_(True), old, adv, mask, weights=w, agg="seq_mean_token_mean",
                              check_finite=False)
        opsd_sampled_loss(lp, old, mask, check_finite=False)
        aggregate(old, mask, check_finite=False)
    assert host_reads.calls == []
    with host_reads:
        policy_loss(lp, old, adv, mask, weights=w)
    assert host_reads.calls == ["__bool__"] * 4  # one NaN/inf scan per input when asked (the default)


@given(shapes, st.sampled_from(AGG_MODES), st.booleans())
def test_metrics_are_the_same_numbers_either_way(shape, mode, weighted):
    B, L, p, seed = shape
    lp, old, adv, mask = _tokens(seed, B, L, p)
    w = torch.rand(B, L, generator=torch.Generator().manual_seed(seed), dtype=F64) + 0.5 if weighted else None
    loss_a, m_a = policy_loss(lp, old, adv, mask, weights=w, agg=mode)
    loss_b, m_b = policy_loss(lp, old, adv, mask, weights=w, agg=mode, check_finite=False)
    assert float(loss_a) == float(loss_b)
    assert float(m_b.pop("loss/nonfinite_tokens")) == 0.0
    assert _floats(m_a) == _floats(m_b)
    assert all(v.dtype == F64 for v in m_a.values())


def test_policy_loss_metrics_golden():
    # two tokens, A = 1, log ratio (0.5, 0): ratio (e^0.5, 1); clip at 1.2 binds on token 0
    lp = torch.tensor([[0.5, 0.0]], dtype=F64)
    loss, m = policy_loss(lp, torch.zeros(1, 2, dtype=F64), torch.tensor([1.0], dtype=F64),
                          torch.ones(1, 2, dtype=torch.bool), weights=torch.tensor([[2.0, 1.0]], dtype=F64))
    # token losses w * max(-r, -clip(r)) = (2 * -1.2, 1 * -1): mean -1.7
    assert float(loss) == pytest.approx(-1.7)
    assert {k: round(float(v), 10) for k, v in m.items()} == {
        "loss/policy": -1.7, "loss/clip_frac": 0.5, "loss/approx_kl": -0.25,
        "loss/ratio_mean": round((math.exp(0.5) + 1) / 2, 10), "loss/weight_mean": 1.5}


def test_nonfinite_inputs_are_counted_not_read_when_check_finite_is_false():
    lp, old, adv, mask = _tokens(4, 3, 10, p=1.0)
    mask[2, 5:] = False
    lp = lp.clone()
    lp[0, 1] = float("nan")  # a policy token
    lp[2, 7] = float("nan")  # masked: junk, not counted
    adv_tok = adv[:, None].expand(3, 10).clone()
    adv_tok[1, 3] = float("inf")
    w = torch.ones(3, 10, dtype=F64)
    w[1, 3] = float("nan")  # the same token as the inf advantage: counted once
    w[0, 4] = float("-inf")
    loss, m = policy_loss(lp, old, adv_tok, mask, weights=w, check_finite=False)
    assert float(m["loss/nonfinite_tokens"]) == 3.0 and not math.isfinite(float(loss))
    with pytest.raises(InputError, match="logprobs"):
        policy_loss(lp, old, adv_tok, mask, weights=w)
    with pytest.raises(InputError, match="student_logits"):
        opsd_loss(torch.full((1, 2, 3), float("nan")), torch.zeros(1, 2, 3), torch.ones(1, 2, dtype=torch.bool))
    _, m = opsd_loss(torch.full((1, 2, 3), float("nan")), torch.zeros(1, 2, 3), torch.tensor([[True, False]]),
                     check_finite=False)
    assert float(m["opsd/nonfinite_tokens"]) == 1.0


def test_inputs_on_another_device_are_refused():
    lp, old, adv, mask = _tokens(5, 2, 4)
    with pytest.raises(InputError, match="old_logprobs: is on device meta"):
        policy_loss(lp, old.to("meta"), adv, mask)
    with pytest.raises(InputError, match="weights: is on device meta"):
        policy_loss(lp, old, adv, mask, weights=torch.empty(2, 4, device="meta"))
