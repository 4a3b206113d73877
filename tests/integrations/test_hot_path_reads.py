"""The trainers' per-micro-batch paths through creditlab read nothing on the host.

* SkyRL calls a ``creditlab_<arm>`` policy loss once per micro-batch: the call makes no host read
  (values or data-dependent shapes, :class:`host_syncs.HostSyncs`); its metrics are a
  ``DeviceMetrics``, read in one transfer where SkyRL's worker reads them, after the backward pass.
* verl's bypass mode computes the rollout correction inside its loss, once per micro-batch: creditlab's
  ``rollout_weights`` makes no host read there; verl reads its metrics in its own merge (one transfer
  for all of creditlab's), beside its own reads of that function. In decoupled mode (once per step, on
  the driver) creditlab takes the path with host reads, whose checks raise.
* verl's loss ``creditlab_ppo``: tests/integrations/test_verl_hot_path.py. TRL's trainer computes the
  correction once per generation batch (``_generate_and_score_completions``), not per micro-batch.

The same paths also run to the end on ``meta`` tensors, where any read would raise.
"""

from __future__ import annotations

import pytest
import torch
from integration_helpers import agent_batch
from omegaconf import OmegaConf

from creditlab.core import correction
from host_syncs import HostSyncs

ARMS = ("interq", "prefix", "global", "tis", "mis", "seq_is", "geo", "none", "interq_tis")


# --------------------------------------------------------------------------------------------
# SkyRL


def _skyrl():
    """SkyRL's policy-loss registry with creditlab installed (SkyRL 0.3.0's ``skyrl.backends`` package
    ``__init__`` fails under pydantic on Python < 3.12: its submodules are loaded without it, as in
    tests/integrations/test_skyrl.py)."""
    pytest.importorskip("skyrl", reason='SkyRL is not installed (pip install "creditlab[skyrl]")')
    from skyrl_ray_worker import load_backends_without_init

    load_backends_without_init()
    from skyrl.backends.skyrl_train.utils import ppo_utils

    import creditlab.integrations.skyrl  # noqa: F401  (registers the losses)

    return ppo_utils.PolicyLossRegistry


def _skyrl_config(**creditlab):
    return OmegaConf.create({
        "eps_clip_low": 0.2, "eps_clip_high": 0.2, "clip_ratio_c": 3.0,
        "off_policy_correction": {"tis_ratio_type": None, "sequence_mask_metric": None,
                                  "outlier_token_is_threshold_low": None, "outlier_token_is_threshold_high": None,
                                  "token_mask_is_threshold_low": None, "token_mask_is_threshold_high": None},
        "creditlab": creditlab})


def _skyrl_batch(device="cpu"):
    old, rollout, rm = agent_batch(11, B=6, L=32, mismatch=0.1)
    g = torch.Generator().manual_seed(12)
    lp = (old + 0.1 * torch.randn(old.shape, generator=g)).clamp(max=0)
    adv = torch.randn(old.shape[0], 1, generator=g).expand_as(old) * rm / rm.sum()
    if device == "meta":
        old, rollout, rm, lp, adv = (torch.empty_like(x, device="meta") for x in (old, rollout, rm, lp, adv))
    return lp.requires_grad_(True), old, rollout, rm, adv


@pytest.mark.parametrize("arm", ARMS)
def test_skyrl_losses_read_nothing_and_hand_over_their_metrics_in_one_read(arm):
    registry = _skyrl()
    lp, old, rollout, rm, adv = _skyrl_batch()
    loss_fn = registry.get(f"creditlab_{arm}")
    with HostSyncs() as syncs:
        loss, metrics = loss_fn(lp, old, adv, config=_skyrl_config(), loss_mask=rm, rollout_logprobs=rollout)
    assert syncs.records == []
    loss.backward()
    with HostSyncs() as syncs:  # what SkyRL's worker does after its backward pass
        status = {"loss_metrics/" + k: v for k, v in metrics.items()}
    assert [(r.what, r.caller) for r in syncs.records] == [
        ("tolist", "creditlab.core.correction:DeviceMetrics._read")]
    assert all(isinstance(v, float) for v in status.values())
    # the numbers of the synced path
    d = (old - rollout).double()
    _, want = correction.correction_weights(arm, d.clamp(max=0), (-d).clamp(max=0), rm > 0)
    for key, value in want.items():
        assert metrics[f"creditlab/{key}"] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    assert metrics["creditlab/nonfinite_tokens"] == metrics["creditlab/correction/nonfinite_tokens"] == 0.0


def test_skyrl_loss_runs_on_meta_tensors():
    registry = _skyrl()
    lp, old, rollout, rm, adv = _skyrl_batch("meta")
    for arm in ARMS:
        loss, _ = registry.get(f"creditlab_{arm}")(lp, old, adv, config=_skyrl_config(), loss_mask=rm,
                                                   rollout_logprobs=rollout)
        assert loss.device.type == "meta" and loss.requires_grad


def test_skyrl_loss_counts_nonfinite_rollout_logprobs_instead_of_reading():
    registry = _skyrl()
    lp, old, rollout, rm, adv = _skyrl_batch()
    rollout = rollout.clone()
    b, t = (rm > 0).nonzero()[0].tolist()
    rollout[b, t] = float("nan")
    with HostSyncs() as syncs:
        loss, metrics = registry.get("creditlab_interq")(lp, old, adv, config=_skyrl_config(), loss_mask=rm,
                                                         rollout_logprobs=rollout)
    assert syncs.records == [] and bool(torch.isfinite(loss))
    assert metrics["creditlab/correction/nonfinite_tokens"] == 1.0


# --------------------------------------------------------------------------------------------
# verl


def _verl():
    pytest.importorskip("verl", reason='verl is not installed (pip install "creditlab[verl]")')
    import creditlab.integrations.verl as cv

    return cv


def _bypass_config(arm, loss_type):
    return OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
                             "global_batch_info": {}, "policy_loss": {"rollout_correction": {
                                 "loss_type": loss_type, "rollout_is": f"creditlab_{arm}", "rollout_rs": None}}})


@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_verl_bypass_mode_correction_reads_nothing_but_its_metrics_handover(arm, loss_type):
    _verl()
    from verl.trainer.ppo import core_algos

    old, rollout, rm = agent_batch(13, mismatch=0.1)
    logp = old.clone().requires_grad_(True)
    adv = torch.randn(old.shape[0], 1, generator=torch.Generator().manual_seed(3)).expand_as(old) * rm
    loss_fn = core_algos.get_policy_loss_fn("bypass_mode")
    kw = dict(old_log_prob=rollout, log_prob=logp, advantages=adv, response_mask=rm, loss_agg_mode="token-mean",
              config=_bypass_config(arm, loss_type))
    loss_fn(**kw)  # the spec is parsed (and checked) at the first call
    with HostSyncs() as syncs:
        loss, metrics = loss_fn(**kw)
    # creditlab's only read: verl merging creditlab's metrics into its dict (one transfer for all)
    handover = ("tolist", "creditlab.core.correction:DeviceMetrics._read")
    assert [(r.what, r.caller) for r in syncs.creditlab] == [handover]
    assert len(syncs.records) > len(syncs.creditlab)  # verl's own reads in the same function are seen
    assert isinstance(metrics["rollout_corr/creditlab/mismatch/k3"], float)
    loss.backward()
    assert bool(torch.isfinite(logp.grad).all())


@pytest.mark.parametrize("arm", ARMS)
def test_verl_rollout_weights_per_micro_batch_read_nothing_and_equal_the_driver_path(arm):
    cv = _verl()
    old, rollout, rm = agent_batch(14, mismatch=0.1)
    spec = f"creditlab_{arm}"
    cv.rollout_weights(old - rollout, rm, spec)  # parsed once
    with HostSyncs() as syncs:
        w, metrics = cv.rollout_weights(old - rollout, rm, spec)
    assert syncs.records == [] and isinstance(metrics, correction.DeviceMetrics)
    w_ref, want = cv.rollout_weights(old - rollout, rm, spec, sync=True)
    assert torch.equal(w, w_ref) and isinstance(want, dict)
    got = dict(metrics)
    assert got.pop("creditlab/correction/nonfinite_tokens") == 0.0 and got.keys() == want.keys()
    for key, value in want.items():  # float32 sums in another order
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    meta = torch.device("meta")
    w_meta, _ = cv.rollout_weights(torch.empty(rm.shape, device=meta), torch.empty(rm.shape, dtype=rm.dtype,
                                                                                    device=meta), spec)
    assert w_meta.device == meta


def test_verl_decoupled_mode_takes_the_checked_path_once_per_batch():
    cv = _verl()
    from verl import DataProto
    from verl.trainer.ppo import rollout_corr_helper

    old, rollout, rm = agent_batch(15, mismatch=0.1)
    cfg = OmegaConf.create({"rollout_is": "creditlab_interq", "rollout_is_threshold": 2.0, "rollout_rs": None,
                            "rollout_rs_threshold": None, "rollout_is_batch_normalize": False, "bypass_mode": False})

    def run(o):
        batch = DataProto.from_dict(tensors={"old_log_probs": o, "rollout_log_probs": rollout, "response_mask": rm})
        return rollout_corr_helper.compute_rollout_correction_and_add_to_batch(batch, cfg)

    run(old)
    with HostSyncs() as syncs:
        _, metrics = run(old)
    assert any("nonzero" in r.what for r in syncs.creditlab)  # the synced path: the segment count
    assert "rollout_corr/creditlab/correction/nonfinite_tokens" not in metrics
    assert not cv._PER_BATCH.get()
    bad = old.clone()
    bad[(rm > 0).nonzero()[0].tolist()] = float("nan")
    with pytest.raises(ValueError, match="old_logprobs: contains NaN or inf"):
        run(bad)
