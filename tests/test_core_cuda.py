"""The core suite's key functions on a CUDA device: same numbers as on the CPU, outputs on the device.

Marked ``cuda`` and skipped (with the reason) when ``torch.cuda.is_available()`` is False.
``CREDITLAB_TEST_DEVICE=cpu`` runs the same checks on the CPU (to exercise this module without a GPU;
the comparisons are then trivially CPU against CPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from creditlab.core import correction, credit, losses, masks, precision
from creditlab.core.advantages import grpo_advantages, prm_mixed_advantages
from creditlab.core.credit import StepBatch

_DEVICE = os.environ.get("CREDITLAB_TEST_DEVICE", "cuda")
_AVAILABLE = _DEVICE == "cpu" or (_DEVICE.startswith("cuda") and torch.cuda.is_available())
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not _AVAILABLE, reason=f"no CUDA device ({_DEVICE!r} unavailable: "
                                                                          "torch.cuda.is_available() is False)")]
DEV = torch.device(_DEVICE)
F64 = torch.float64


def _on(x):
    return x.to(DEV) if isinstance(x, torch.Tensor) else x


def _close(got, want, **kw):
    """``got`` (on DEV) equals ``want`` (on the CPU), recursively."""
    if isinstance(want, torch.Tensor):
        assert got.device.type == DEV.type, got.device
        torch.testing.assert_close(got.cpu(), want, **kw)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            _close(got[k], want[k], **kw)
    elif isinstance(want, tuple | list):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _close(g, w, **kw)
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    else:
        assert got == want


def _tokens(seed=0, B=6, L=40, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    pm = torch.rand(B, L, generator=g) < 0.7
    vm = torch.rand(B, L, generator=g) < 0.95
    old = (torch.randn(B, L, generator=g, dtype=F64) * 0.5 - 1.0).to(dtype)
    ro = (old.to(F64) + torch.randn(B, L, generator=g, dtype=F64) * 0.08).to(dtype)
    return old, ro, pm, vm


@pytest.mark.parametrize("arm", list(correction.CORRECTIONS)[:8])
def test_correction_arms_and_mismatch_metrics(arm):
    old, ro, pm, vm = _tokens()
    want = correction.correction_weights(arm, old, ro, pm, vm)
    got = correction.correction_weights(arm, _on(old), _on(ro), _on(pm), _on(vm))
    _close(got, want, rtol=1e-5, atol=1e-6)
    t = correction.interq_terms(_on(old), _on(ro), _on(pm), _on(vm))
    assert all(x.device.type == DEV.type for x in (t.weights, t.C, t.rho, t.alpha, t.segments.seg_id))
    m = correction.mismatch_metrics(_on(old), _on(ro), _on(pm), _on(vm), terms=t)
    _close(m, correction.mismatch_metrics(old, ro, pm, vm))


@pytest.mark.parametrize("iters", [None, 30])
def test_allocate_budget(iters):
    g = torch.Generator().manual_seed(1)
    C, rho = torch.rand(50, generator=g, dtype=F64), torch.rand(50, generator=g, dtype=F64)
    _close(correction.allocate_budget(_on(C), _on(rho), 0.4, iters), correction.allocate_budget(C, rho, 0.4, iters))


def test_segments():
    _, _, pm, vm = _tokens(2)
    _close(tuple(masks.segments(_on(pm), _on(vm))), tuple(masks.segments(pm, vm)))


@pytest.mark.parametrize("name", list(credit.GEOMETRIES)[:10])
@pytest.mark.parametrize("contiguous", [True, False])
def test_registered_geometries(name, contiguous):
    B, T, G = 12, 6, 4
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(B, T, dtype=torch.bool) if contiguous else torch.rand(B, T, generator=g) < 0.8
    gid = torch.arange(B) // G if contiguous else torch.randint(0, 3, (B,), generator=g)
    R = torch.rand(B, generator=g)
    batch = StepBatch(mask, gid, grpo_advantages(R, gid), R, torch.rand(B, T, generator=g),
                      torch.rand(B, T, generator=g) < 0.5, torch.rand(B, T, generator=g))
    on = StepBatch(*(_on(x) for x in batch))
    _close(credit.get_geometry(name)(on), credit.get_geometry(name)(batch), rtol=1e-5, atol=1e-6)


def test_grpo_and_prm_mixing():
    g = torch.Generator().manual_seed(4)
    R, gid = torch.rand(10, generator=g), torch.randint(0, 3, (10,), generator=g) * 7
    s, mask = torch.rand(10, 4, generator=g), torch.rand(10, 4, generator=g) < 0.8
    _close(grpo_advantages(_on(R), _on(gid)), grpo_advantages(R, gid))
    _close(prm_mixed_advantages(_on(R), _on(s), _on(mask), _on(gid), 0.3), prm_mixed_advantages(R, s, mask, gid, 0.3))


@pytest.mark.parametrize("check_finite", [True, False])
@pytest.mark.parametrize("agg", losses.AGG_MODES)
def test_policy_loss_and_its_gradient(agg, check_finite):
    old, ro, pm, _ = _tokens(5)
    w, _ = correction.interq_weights(old, ro, pm)
    adv = torch.randn(old.shape[0], generator=torch.Generator().manual_seed(5))
    lp = (old + 0.1).requires_grad_(True)
    lp_d = _on(old + 0.1).requires_grad_(True)
    loss, m = losses.policy_loss(lp, ro, adv, pm, weights=w, agg=agg, clip_ratio_c=3.0, check_finite=check_finite)
    loss_d, m_d = losses.policy_loss(lp_d, _on(ro), _on(adv), _on(pm), weights=_on(w), agg=agg, clip_ratio_c=3.0,
                                     check_finite=check_finite)
    _close(loss_d.detach(), loss.detach(), rtol=1e-5, atol=1e-6)
    _close(m_d, m, rtol=1e-5, atol=1e-6)
    loss.backward()
    loss_d.backward()
    _close(lp_d.grad, lp.grad, rtol=1e-5, atol=1e-7)


def test_opsd_losses():
    g = torch.Generator().manual_seed(6)
    s, t = torch.randn(3, 5, 11, generator=g), torch.randn(3, 5, 11, generator=g)
    mask = torch.rand(3, 5, generator=g) < 0.7
    _close(losses.opsd_loss(_on(s), _on(t), _on(mask), 0.5), losses.opsd_loss(s, t, mask, 0.5), rtol=1e-5, atol=1e-6)
    lp, lq = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    _close(losses.opsd_sampled_loss(_on(lp), _on(lq), _on(mask)), losses.opsd_sampled_loss(lp, lq, mask))


def test_fork_math_with_a_float_tau_and_the_deletion_curve():
    g = torch.Generator().manual_seed(7)
    B, J, U = 4, 3, 5
    match = torch.rand(B, J, U, generator=g) < 0.4
    cov, rmask = torch.rand(B, J, generator=g) < 0.5, torch.rand(B, J, generator=g) < 0.9
    umask, correct = torch.rand(B, U, generator=g) < 0.9, torch.rand(B, U, generator=g) < 0.8
    w = torch.randn(B, J, generator=g)
    want = precision.fork_scores(match, cov, w, correct, rmask, umask, 0.5)
    got = precision.fork_scores(*(_on(x) for x in (match, cov, w, correct, rmask, umask)), 0.5)
    _close(tuple(got), tuple(want))
    scores = torch.rand(B, U, generator=g)
    _close(precision.deletion_curve(*(_on(x) for x in (match, w, rmask, umask, scores))),
           precision.deletion_curve(match, w, rmask, umask, scores))
