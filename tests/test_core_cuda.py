"""The core suite's functions on a CUDA device: same numbers as on the CPU, outputs on the device.

Every check runs a function once on CPU inputs (the reference) and once on the same inputs moved to
the device, and compares: tensors equal to float rounding and on the device, Python numbers equal.
:data:`CASES` holds the plain ones (one call, one comparison); the functions that need more (a
gradient, a schedule driving a mixing weight, the live check values with NaN where a batch cannot give
a value) have their own tests, named in :data:`ELSEWHERE`. A test checks that every public function of
``creditlab.core`` is in one of them or in :data:`NO_TENSORS` with the reason.

Marked ``cuda`` and skipped (with the reason) when ``torch.cuda.is_available()`` is False.
``CREDITLAB_TEST_DEVICE=cpu`` runs the same checks on the CPU: the comparisons are then CPU against
CPU, but every call, every input check and every data path runs, so the module cannot rot where no GPU
is; ``tests/test_core_cuda_cpu_mode.py`` does that under the plain test command.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from core_listing import public_core_functions
from creditlab.core import correction, credit, diagnostics, losses, masks, precision, schedules
from creditlab.core.advantages import group_stats, grpo_advantages, mix_process_advantage, prm_mixed_advantages
from creditlab.core.credit import StepBatch
from creditlab.errors import InputError

_DEVICE = os.environ.get("CREDITLAB_TEST_DEVICE", "cuda")
_AVAILABLE = _DEVICE == "cpu" or (_DEVICE.startswith("cuda") and torch.cuda.is_available())
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not _AVAILABLE, reason=f"no CUDA device ({_DEVICE!r} unavailable: "
                                                                          "torch.cuda.is_available() is False)")]
DEV = torch.device(_DEVICE)
F64 = torch.float64


def _on(x):
    """``x`` with every tensor inside it (tuples, lists, dicts, NamedTuples) moved to the device."""
    if isinstance(x, torch.Tensor):
        return x.to(DEV)
    if isinstance(x, dict):
        return {k: _on(v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_on(v) for v in x))
    if isinstance(x, tuple | list):
        return type(x)(_on(v) for v in x)
    return x


def _close(got, want, **kw):
    """``got`` (on DEV) equals ``want`` (on the CPU), recursively; Python numbers to 1e-5 (they come
    from float32 arithmetic on both sides), ``nan_ok`` NaN equal to NaN."""
    nan_ok = kw.pop("nan_ok", False)
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), type(got)
        assert got.device.type == DEV.type, got.device
        torch.testing.assert_close(got.cpu(), want, equal_nan=nan_ok, **kw)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            _close(got[k], want[k], nan_ok=nan_ok, **kw)
    elif isinstance(want, tuple | list):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _close(g, w, nan_ok=nan_ok, **kw)
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6, nan_ok=nan_ok)
    else:
        assert got == want


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tokens(seed=0, B=6, L=40, dtype=torch.float32):
    """``old``, ``rollout`` log-probs (log-sigmoids: always < 0, as the input checks require), policy and
    valid masks. The engine's log-probs differ from the learner's by a small noise on the logit."""
    g = _gen(seed)
    pm = torch.rand(B, L, generator=g) < 0.7
    vm = torch.rand(B, L, generator=g) < 0.95
    z = torch.randn(B, L, generator=g, dtype=F64) * 1.5 + 1.0
    old = F.logsigmoid(z).to(dtype)
    ro = F.logsigmoid(z + torch.randn(B, L, generator=g, dtype=F64) * 0.08).to(dtype)
    return old, ro, pm, vm


def _fork_inputs(seed=7, B=4, J=3, U=5):
    g = _gen(seed)
    match = torch.rand(B, J, U, generator=g) < 0.4
    cov, rmask = torch.rand(B, J, generator=g) < 0.5, torch.rand(B, J, generator=g) < 0.9
    umask, correct = torch.rand(B, U, generator=g) < 0.9, torch.rand(B, U, generator=g) < 0.8
    w = torch.randn(B, J, generator=g)
    w[0, 0] = -abs(float(w[0, 0]))  # a pitfall rubric, whatever the draw
    return match, cov, w, correct, rmask, umask


# ------------------------------------------------------------------------------------------------
# the correction arms, segments, geometries, advantages, losses and the FORK math


@pytest.mark.parametrize("arm", list(correction.CORRECTIONS)[:9])
def test_correction_arms_and_mismatch_metrics(arm):
    old, ro, pm, vm = _tokens()
    want = correction.correction_weights(arm, old, ro, pm, vm)
    got = correction.correction_weights(arm, _on(old), _on(ro), _on(pm), _on(vm))
    _close(got, want, rtol=1e-5, atol=1e-6)
    assert arm == "none" or want[0].ne(1).any(), "the mismatch must move some weight off 1"
    t = correction.interq_terms(_on(old), _on(ro), _on(pm), _on(vm))
    assert all(x.device.type == DEV.type for x in (t.weights, t.C, t.rho, t.alpha, t.segments.seg_id))
    _close(t, correction.interq_terms(old, ro, pm, vm), rtol=1e-5, atol=1e-6)
    m = correction.mismatch_metrics(_on(old), _on(ro), _on(pm), _on(vm), terms=t)
    _close(m, correction.mismatch_metrics(old, ro, pm, vm))


@pytest.mark.parametrize("arm", ["interq", "tis", "mis", "seq_is", "geo", "none", "interq_tis"])
def test_each_arm_called_directly(arm):
    old, ro, pm, vm = _tokens(1)
    fn = correction.interq_weights if arm == "interq" else getattr(correction, f"{arm}_weights")
    _close(fn(_on(old), _on(ro), _on(pm), _on(vm)), fn(old, ro, pm, vm), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("iters", [None, 30])
def test_allocate_budget(iters):
    g = _gen(1)
    C, rho = torch.rand(50, generator=g, dtype=F64), torch.rand(50, generator=g, dtype=F64)
    _close(correction.allocate_budget(_on(C), _on(rho), 0.4, iters), correction.allocate_budget(C, rho, 0.4, iters))


def test_segments():
    _, _, pm, vm = _tokens(2)
    _close(tuple(masks.segments(_on(pm), _on(vm))), tuple(masks.segments(pm, vm)))


@pytest.mark.parametrize("name", list(credit.GEOMETRIES)[:10])
@pytest.mark.parametrize("contiguous", [True, False])
def test_registered_geometries(name, contiguous):
    B, T, G = 12, 6, 4
    g = _gen(3)
    mask = torch.ones(B, T, dtype=torch.bool) if contiguous else torch.rand(B, T, generator=g) < 0.8
    gid = torch.arange(B) // G if contiguous else torch.randint(0, 3, (B,), generator=g)
    R = torch.rand(B, generator=g)
    batch = StepBatch(mask, gid, grpo_advantages(R, gid), R, torch.rand(B, T, generator=g),
                      torch.rand(B, T, generator=g) < 0.5, torch.rand(B, T, generator=g))
    _close(credit.get_geometry(name)(_on(batch)), credit.get_geometry(name)(batch), rtol=1e-5, atol=1e-6)


def test_grpo_and_prm_mixing():
    g = _gen(4)
    R, gid = torch.rand(10, generator=g), torch.randint(0, 3, (10,), generator=g) * 7
    s, mask = torch.rand(10, 4, generator=g), torch.rand(10, 4, generator=g) < 0.8
    _close(grpo_advantages(_on(R), _on(gid)), grpo_advantages(R, gid))
    _close(prm_mixed_advantages(_on(R), _on(s), _on(mask), _on(gid), 0.3), prm_mixed_advantages(R, s, mask, gid, 0.3))
    A = grpo_advantages(R, gid)
    _close(mix_process_advantage(_on(A), _on(s), _on(mask), _on(gid), 0.3), mix_process_advantage(A, s, mask, gid, 0.3))


@pytest.mark.parametrize("check_finite", [True, False])
@pytest.mark.parametrize("agg", losses.AGG_MODES)
def test_policy_loss_and_its_gradient(agg, check_finite):
    old, ro, pm, _ = _tokens(5)
    w, _ = correction.interq_weights(old, ro, pm)
    g = _gen(5)
    adv = torch.randn(old.shape[0], generator=g)
    new = (old.double() + torch.randn(old.shape, generator=g, dtype=F64) * 0.3).clamp(max=-1e-3).float()
    lp = new.clone().requires_grad_(True)
    lp_d = _on(new).requires_grad_(True)
    loss, m = losses.policy_loss(lp, ro, adv, pm, weights=w, agg=agg, clip_ratio_c=3.0, check_finite=check_finite)
    loss_d, m_d = losses.policy_loss(lp_d, _on(ro), _on(adv), _on(pm), weights=_on(w), agg=agg, clip_ratio_c=3.0,
                                     check_finite=check_finite)
    assert float(m["loss/clip_frac"]) > 0, "some ratios must reach the clip"
    _close(loss_d.detach(), loss.detach(), rtol=1e-5, atol=1e-6)
    _close(m_d, m, rtol=1e-5, atol=1e-6)
    loss.backward()
    loss_d.backward()
    _close(lp_d.grad, lp.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_opsd_losses_and_gradient(beta):
    g = _gen(6)
    s, t = torch.randn(3, 5, 11, generator=g), torch.randn(3, 5, 11, generator=g)
    t[0, 0, 3] = -math.inf  # a masked vocabulary entry of the teacher
    mask = torch.rand(3, 5, generator=g) < 0.7
    s_c, s_d = s.clone().requires_grad_(True), _on(s).requires_grad_(True)
    want = losses.opsd_loss(s_c, t, mask, beta)
    got = losses.opsd_loss(s_d, _on(t), _on(mask), beta)
    _close((got[0].detach(), got[1]), (want[0].detach(), want[1]), rtol=1e-5, atol=1e-6)
    want[0].backward()
    got[0].backward()
    _close(s_d.grad, s_c.grad, rtol=1e-5, atol=1e-7)
    lp, lq = F.logsigmoid(torch.randn(3, 5, generator=g)), F.logsigmoid(torch.randn(3, 5, generator=g))
    for check_finite in (True, False):
        _close(losses.opsd_sampled_loss(_on(lp), _on(lq), _on(mask), check_finite=check_finite),
               losses.opsd_sampled_loss(lp, lq, mask, check_finite=check_finite))


def test_fork_math_with_a_float_tau_and_the_deletion_curve():
    match, cov, w, correct, rmask, umask = _fork_inputs()
    want = precision.fork_scores(match, cov, w, correct, rmask, umask, 0.5)
    got = precision.fork_scores(*_on((match, cov, w, correct, rmask, umask)), 0.5)
    _close(tuple(got), tuple(want))
    scores = torch.rand(*umask.shape, generator=_gen(8))
    _close(precision.deletion_curve(*_on((match, w, rmask, umask, scores))),
           precision.deletion_curve(match, w, rmask, umask, scores))


# ------------------------------------------------------------------------------------------------
# one call, one comparison: name -> (function, CPU arguments, keyword arguments)


def _diag_counts():
    g = _gen(11)
    T = 12
    C = torch.randint(0, T + 1, (16,), generator=g).to(F64)
    k = torch.randint(0, T + 1, (16,), generator=g).to(F64)
    return T, C, k


def _steps(seed=12, B=8, T=5):
    g = _gen(seed)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[0] = False  # a row without steps
    return g, mask


def _aggregate_inputs():
    old, _, pm, _ = _tokens(13)
    pm[2] = False  # an empty row: not counted in the seq_mean denominators
    loss = old.clone()
    loss[~pm] = math.nan  # junk at masked positions changes nothing
    return loss, pm


def _cases():
    match, cov, w, correct, rmask, umask = _fork_inputs(9)
    g = _gen(10)
    credits = torch.rand(*umask.shape, generator=g) * 1.5
    p, rec = torch.rand(6, generator=g), torch.rand(6, generator=g)
    p[0] = rec[0] = 0.0  # F-beta is 0 where both are
    T, C, k = _diag_counts()
    q = torch.rand(16, generator=g, dtype=F64)
    q[0], q[1] = 1.0, 0.0  # the limit of the closed form, and nothing visible
    scores = torch.rand(5, 9, generator=g)
    n_pos, n_neg = torch.randint(0, 4, (20,), generator=g), torch.randint(0, 4, (20,), generator=g)
    old, ro, pm, vm = _tokens(14)
    segs = masks.segments(pm, vm)
    vals = torch.randn(pm.shape, generator=g, dtype=F64)
    vals[~segs.policy] = math.nan  # junk off the segments is dropped
    gv = torch.randn(11, generator=g, dtype=F64)
    gid = torch.tensor([5, 9, 5, 2, 9, 9, 30, 2, 5, 9, 5])  # labels not contiguous, a group of one (30)
    loss, apm = _aggregate_inputs()
    sg, smask = _steps()
    adv, dS = torch.randn(8, generator=sg), torch.rand(8, 5, generator=sg)
    keys = torch.rand(8, 5, generator=sg)
    gids = torch.arange(8) // 2
    kk = torch.randint(0, 4, (8,), generator=sg)
    rewards = torch.rand(8, generator=sg)
    return {
        "precision.credit_split": (precision.credit_split, (match, rmask, umask), {}),
        "precision.unit_credit": (precision.unit_credit, (match, rmask & (w > 0), umask), {}),
        "precision.necessity[float tau]": (precision.necessity, (credits, 0.5, umask), {}),
        "precision.necessity[tensor tau]": (precision.necessity, (credits, torch.tensor([0.3, 0.5, 1.0, 0.7]),
                                                                  umask), {}),
        "precision.unit_precision": (precision.unit_precision, (credits > 0.5, correct, umask), {}),
        "precision.signed_recall": (precision.signed_recall, (cov, w, rmask), {}),
        "precision.f_beta": (precision.f_beta, (p, rec, 2.0), {}),
        **{f"precision.combine_rewards[{m}]": (precision.combine_rewards, (p, rec, m, 0.5), {})
           for m in precision.COMBINE_MODES},
        "diagnostics.p_cover": (diagnostics.p_cover, (T, C, k), {}),  # a Python T goes on the tensors' device
        "diagnostics.expected_open_fraction": (diagnostics.expected_open_fraction, (q, 4), {}),
        "diagnostics.verifier_density": (diagnostics.verifier_density, (k, C.clamp_min(1)), {}),
        "diagnostics.mixing_score": (diagnostics.mixing_score, (n_pos, n_neg), {}),
        "diagnostics.aulc": (diagnostics.aulc, (scores,), {}),
        "diagnostics.rollback": (diagnostics.rollback, (scores,), {}),
        "diagnostics.trajectory_ess": (diagnostics.trajectory_ess, (scores,), {}),
        "diagnostics.concentration": (diagnostics.concentration, (scores.flatten(), 0.2), {}),  # Python floats
        "masks.effective_policy_mask": (masks.effective_policy_mask, (pm, vm), {}),
        "masks.effective_policy_mask[no valid_mask]": (masks.effective_policy_mask, (pm,), {}),
        "masks.segment_bounds": (masks.segment_bounds, (pm, vm), {}),
        "masks.segments_from_bounds": (masks.segments_from_bounds, (masks.segment_bounds(pm, vm),), {}),
        "masks.segment_sum": (masks.segment_sum, (vals, segs.seg_id, segs.num_segments), {}),
        "advantages.group_stats": (group_stats, (gv, gid), {}),
        "advantages.group_stats[float32]": (group_stats, (gv.float(), gid), {}),
        "losses.opsd_sampled_advantages": (losses.opsd_sampled_advantages, (ro, old, pm), {}),
        "losses.opsd_sampled_advantages[unchecked]": (losses.opsd_sampled_advantages, (ro, old, pm),
                                                      {"check_finite": False}),
        **{f"losses.aggregate[{m}]": (losses.aggregate, (loss, apm, m), {}) for m in losses.AGG_MODES},
        "losses.aggregate[norm]": (losses.aggregate, (loss, apm, "seq_mean_token_sum_norm"), {"norm": 7.0}),
        "credit.uniform": (credit.uniform, (adv, smask), {}),
        "credit.per_turn[unconserved]": (credit.per_turn, (adv, dS, smask), {"conserve": False}),
        "credit.concentrated[unconserved]": (credit.concentrated, (adv, keys > 0.5, smask), {"conserve": False}),
        "credit.shuffled[keys]": (credit.shuffled, (dS, smask), {"keys": keys}),
        "credit.binary": (credit.binary, (rewards, gids, smask), {"threshold": 0.5}),
        "credit.discretized": (credit.discretized, (rewards, gids, smask), {}),
        "credit.reward_to_go[conserved]": (credit.reward_to_go, (dS, gids, smask), {"conserve": True}),
        "credit.conserve_credit": (credit.conserve_credit, (dS - 0.5, adv, smask), {}),
        "credit.random_k_mask[tensor k]": (credit.random_k_mask, (keys, kk, smask), {}),
        "credit.random_k[int k]": (credit.random_k, (adv, keys, 2, smask), {}),
        "credit.targeted": (credit.targeted, (adv, dS, keys > 0.3, gids, smask), {}),
    }


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_numbers_on_the_device(name):
    fn, args, kwargs = CASES[name]
    want = fn(*args, **kwargs)
    got = fn(*_on(args), **_on(kwargs))
    _close(got, want, rtol=1e-5, atol=1e-6)


def test_the_cases_are_not_trivial():
    """The inputs reach the branches the comparisons are about (a comparison of zeros proves little)."""
    match, cov, w, correct, rmask, umask = _fork_inputs(9)
    assert precision.unit_credit(*CASES["precision.unit_credit"][1]).gt(0).any()
    assert precision.necessity(*CASES["precision.necessity[float tau]"][1]).any()
    assert precision.signed_recall(cov, w, rmask).gt(0).any()
    T, C, k = _diag_counts()
    pc = diagnostics.p_cover(T, C, k)
    assert pc.gt(0).any() and pc.eq(0).any()  # k >= C on some, not all
    share, _ = diagnostics.concentration(*CASES["diagnostics.concentration"][1])
    assert 0 < share < 1
    seg_sum = masks.segment_sum(*CASES["masks.segment_sum"][1])
    assert seg_sum.isfinite().all() and seg_sum.ne(0).all()
    mean, std, count = group_stats(*CASES["advantages.group_stats"][1])
    assert count.max() == 4 and count.min() == 1 and std[count == 1].eq(0).all() and std.gt(0).any()
    assert losses.opsd_sampled_advantages(*CASES["losses.opsd_sampled_advantages"][1]).ne(0).any()
    assert credit.random_k_mask(*CASES["credit.random_k_mask[tensor k]"][1]).sum(1).unique().numel() > 1


# ------------------------------------------------------------------------------------------------
# the ones that need more than one call


def test_effective_policy_mask_refuses_a_valid_mask_on_another_device():
    _, _, pm, vm = _tokens(15)
    with pytest.raises(InputError, match="valid_mask: is on device meta"):
        masks.effective_policy_mask(_on(pm), vm.to("meta"))


def test_schedules_at_a_device_step_drive_the_prm_mixing_on_the_device():
    """A schedule maps an update index to a Python float; a step counter kept on the device gives the
    same float, which mixes the process advantage on the device as on the CPU."""
    g = _gen(16)
    R, gid = torch.rand(10, generator=g), torch.arange(10) // 5
    s, mask = torch.rand(10, 4, generator=g), torch.rand(10, 4, generator=g) < 0.8
    for sched in (schedules.constant(0.3), schedules.decay(1.0, start=2, end=6, power=2)):
        for k in (0, 3, 4.5, 6, 9):
            lam = sched(k)
            lam_d = sched(torch.tensor(k, dtype=F64, device=DEV))
            assert isinstance(lam_d, float) and lam_d == lam
            _close(prm_mixed_advantages(_on(R), _on(s), _on(mask), _on(gid), lam_d),
                   prm_mixed_advantages(R, s, mask, gid, lam))
    assert schedules.decay(1.0, start=2, end=6, power=2)(torch.tensor(4.0, device=DEV)) == 0.25


def _live_batch(seed=17, B=16, L=200):
    """A padded multi-turn batch with something for every live check: 2-4 turns of 25-45 policy tokens
    between observations, rows of different lengths, a NaN, a positive and a zero-filled log-prob and a
    run of repeated values (placeholders), and groups of 4 with one of equal rewards and one NaN reward."""
    g = _gen(seed)
    pm = torch.zeros(B, L, dtype=torch.bool)
    for i in range(B):
        pos = 0
        for _ in range(int(torch.randint(2, 5, (1,), generator=g))):
            n = int(torch.randint(25, 46, (1,), generator=g))
            if pos + n > L:
                break
            pm[i, pos:pos + n] = True
            pos += n + 6  # a tool observation
    z = torch.randn(B, L, generator=g, dtype=F64) * 1.5 + 1.0
    old = F.logsigmoid(z)
    roll = F.logsigmoid(z + 0.05 + torch.randn(B, L, generator=g, dtype=F64) * 0.1)  # one-sided, drifting
    first = pm[:, 0].nonzero()[:, 0].tolist()  # rows whose first turn starts at token 0
    roll[first[0], 3] = math.nan
    roll[first[1], 4] = 0.5  # positive: a placeholder
    roll[first[2], 5] = 0.0  # zero-filled where the learner says < -run_gap
    old[first[2], 5] = -3.0
    roll[first[3], 6:12] = -2.0  # a run of one value
    old[first[3], 6:12] = -0.5
    roll = torch.where(pm, roll, torch.zeros((), dtype=F64))  # 0.0 on tool tokens, as verl's agent loop
    groups = torch.arange(B) // 4
    rewards = torch.rand(B, generator=g, dtype=F64)
    rewards[4:8] = 1.0  # a degenerate group
    rewards[-1] = math.nan
    return old.float(), roll.float(), pm, groups, rewards


def test_live_check_values_on_the_device():
    """The values the trainer integrations log each step (``creditlab.integrations._live.batch_values``,
    :func:`creditlab.core.diagnostics.batch_check_values`), and their one host read (``to_floats``)."""
    from creditlab.integrations._live import LIVE_CHECKS, batch_values, metric_name, to_floats

    old, roll, pm, groups, rewards = _live_batch()
    want = batch_values(old, roll, pm, group_ids=groups, rewards=rewards)
    got = batch_values(*_on((old, roll, pm)), group_ids=_on(groups), rewards=_on(rewards))
    _close(got, want, rtol=1e-9, atol=1e-12, nan_ok=False)  # every value is a number on this batch
    assert set(want) >= {metric_name(c) for c in LIVE_CHECKS}
    floats = to_floats(want)
    assert floats[metric_name("mismatch.nonfinite_logprobs")] > 0
    assert floats[metric_name("mismatch.placeholder_logprobs")] > 0
    assert floats[metric_name("baseline.degenerate_groups")] == 0.25
    assert floats[metric_name("mismatch.one_sided")] > 0.5
    _close(to_floats(got), floats, nan_ok=False)
    # without log-probs: the group check alone
    want = batch_values(None, None, pm, group_ids=groups, rewards=rewards)
    _close(batch_values(None, None, _on(pm), group_ids=_on(groups), rewards=_on(rewards)), want)
    assert list(want) == [metric_name("baseline.degenerate_groups")]


def test_live_check_values_that_a_batch_cannot_give_are_nan_on_the_device_too():
    from creditlab.core.diagnostics import batch_check_values
    from creditlab.diagnose.checks import CHECK_PARAMS

    old, roll, pm, _, _ = _live_batch(18, B=4)  # 4 rows: too few for the sequence ratio
    pm[:, 40:] = False  # one turn of 20+ tokens per row: no prefix drift
    want = batch_check_values(old, roll, pm, CHECK_PARAMS)
    assert math.isnan(float(want["mismatch/prefix_drift"]))
    assert math.isnan(float(want["mismatch/sequence_ratio_length"]))
    assert math.isfinite(float(want["mismatch/k3"]))
    _close(batch_check_values(*_on((old, roll, pm)), CHECK_PARAMS), want, nan_ok=True)


#: public functions checked by a test of their own (or through one that calls them) -> that test
ELSEWHERE = {
    "correction.correction_weights": "test_correction_arms_and_mismatch_metrics",
    "correction.interq_terms": "test_correction_arms_and_mismatch_metrics",
    "correction.mismatch_metrics": "test_correction_arms_and_mismatch_metrics",
    **{f"correction.{n}": "test_each_arm_called_directly"
       for n in ("interq_weights", "tis_weights", "mis_weights", "seq_is_weights", "geo_weights", "none_weights",
                 "interq_tis_weights")},
    "correction.allocate_budget": "test_allocate_budget",
    "masks.segments": "test_segments",
    "credit.per_turn": "test_registered_geometries",  # every geometry, both group layouts
    "credit.concentrated": "test_registered_geometries",
    "credit.shuffled": "test_registered_geometries",
    "advantages.grpo_advantages": "test_grpo_and_prm_mixing",
    "advantages.prm_mixed_advantages": "test_grpo_and_prm_mixing",
    "advantages.mix_process_advantage": "test_grpo_and_prm_mixing",
    "losses.policy_loss": "test_policy_loss_and_its_gradient",
    "losses.opsd_loss": "test_opsd_losses_and_gradient",
    "losses.opsd_sampled_loss": "test_opsd_losses_and_gradient",
    "precision.fork_scores": "test_fork_math_with_a_float_tau_and_the_deletion_curve",
    "precision.deletion_curve": "test_fork_math_with_a_float_tau_and_the_deletion_curve",
    "schedules.constant": "test_schedules_at_a_device_step_drive_the_prm_mixing_on_the_device",
    "schedules.decay": "test_schedules_at_a_device_step_drive_the_prm_mixing_on_the_device",
    "diagnostics.batch_check_values": "test_live_check_values_on_the_device",
}

#: public functions with no tensor to put on a device -> why
NO_TENSORS = {
    "correction.parse_correction": "an arm as a config string names it (its check runs on the CPU)",
    "diagnostics.chain_length": "works on Python call records",
    "precision.unit_credit_one": "plain Python lists and floats (the judge client's path)",
    "precision.fork_scores_one": "plain Python lists and floats (the judge client's path)",
}


def test_every_public_core_function_is_checked_here():
    checked = {name.split("[")[0] for name in CASES} | set(ELSEWHERE) | set(NO_TENSORS)
    modules = ("advantages", "correction", "credit", "diagnostics", "losses", "masks", "precision", "schedules")
    missing = [name for name in public_core_functions(modules) if name not in checked]
    assert not missing, f"add these to CASES, ELSEWHERE or NO_TENSORS: {missing}"
    here = globals()
    assert all(callable(here.get(test)) for test in ELSEWHERE.values())
