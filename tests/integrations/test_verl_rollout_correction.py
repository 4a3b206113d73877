"""creditlab's rollout correction inside verl's real ``rollout_corr_helper`` (verl 0.9.1)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from integration_helpers import agent_batch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo import core_algos, rollout_corr_helper

import creditlab.integrations.verl as cv
from creditlab.core import correction
from creditlab.errors import ConfigError, CreditlabError


def _verl(old, rollout, rm, rollout_is, threshold=2.0):
    """verl's driver-side entry point on a DataProto, with a plain dict config as in the YAML."""
    batch = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": rm})
    cfg = OmegaConf.create({"rollout_is": rollout_is, "rollout_is_threshold": threshold, "rollout_rs": None,
                            "rollout_rs_threshold": None, "rollout_is_batch_normalize": False,
                            "bypass_mode": False})
    out, metrics = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(batch, cfg)
    return out.batch["rollout_is_weights"], metrics


def test_import_installs_once_and_is_idempotent():
    wrapped = rollout_corr_helper.compute_rollout_correction_weights
    original = wrapped.__creditlab_original__
    assert inspect.getmodule(original) is rollout_corr_helper
    est = dict(core_algos.ADV_ESTIMATOR_REGISTRY)
    cv.install()
    cv.install()
    importlib.import_module("creditlab.integrations.verl")
    assert rollout_corr_helper.compute_rollout_correction_weights is wrapped
    assert dict(core_algos.ADV_ESTIMATOR_REGISTRY) == est
    for name in cv.ESTIMATORS:
        assert core_algos.get_adv_estimator_fn(name) is est[name]
    assert core_algos.get_policy_loss_fn("creditlab_ppo") is cv.compute_policy_loss_creditlab


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_verl_own_modes_are_untouched(mode):
    old, rollout, rm = agent_batch(1)
    original = rollout_corr_helper.compute_rollout_correction_weights.__creditlab_original__
    w_ref, m_ref = original(old - rollout, rm, rollout_is=mode, rollout_is_threshold=2.0)
    w, metrics = _verl(old, rollout, rm, mode)
    torch.testing.assert_close(w, w_ref, rtol=0, atol=0)
    assert metrics["rollout_corr/rollout_is_mean"] == m_ref["rollout_is_mean"]


def test_interq_weights_equal_core_and_ignore_tool_tokens():
    old, rollout, rm = agent_batch(2, mismatch=0.08)
    pm = rm.bool()
    w, metrics = _verl(old, rollout, rm, "creditlab_interq:alpha_g=0.4,eps_low=0.03")
    w_core, _ = correction.interq_weights(old, rollout, pm, alpha_g=0.4, eps_low=0.03)
    torch.testing.assert_close(w[pm], w_core[pm])
    assert bool((w[~pm] == 0).all())  # verl's convention: weights are 0 off the response mask
    assert not w.requires_grad
    # junk at tool / padding positions (both log-probs) changes nothing
    g = torch.Generator().manual_seed(0)
    junk_old = torch.where(pm, old, torch.randn(old.shape, generator=g) * 50)
    junk_roll = torch.where(pm, rollout, torch.randn(old.shape, generator=g) * 50)
    w2, _ = _verl(junk_old, junk_roll, rm, "creditlab_interq:alpha_g=0.4,eps_low=0.03")
    torch.testing.assert_close(w2, w, rtol=0, atol=0)
    for key in ("mismatch/k3", "mismatch/turn0/prefix", "mismatch/turn1/current", "correction/rho_q50",
                "correction/alpha_q50", "correction/clip_rate"):
        assert f"rollout_corr/creditlab/{key}" in metrics, key


@pytest.mark.parametrize("arm", ["interq", "prefix", "global"])
def test_no_mismatch_gives_exactly_one(arm):
    old, _, rm = agent_batch(3)
    rollout = torch.where(rm > 0, old, torch.zeros_like(old))
    w, _ = _verl(old, rollout, rm, f"creditlab_{arm}")
    assert bool((w[rm > 0] == 1).all())


def test_token_tis_seq_is_mis_and_k3_match_verl():
    old, rollout, rm = agent_batch(4, mismatch=0.6)  # large mismatch: the caps bind
    pm = rm.bool()
    w_verl, m_verl = _verl(old, rollout, rm, "token", threshold=2.0)
    w_ours, m_ours = _verl(old, rollout, rm, "creditlab_tis:cap=2")
    torch.testing.assert_close(w_ours[pm], w_verl[pm])
    assert bool((w_ours[pm] == 2.0).any()) and bool((w_ours[pm] < 1).any())
    # the same K3 (E[r - log r - 1] over response tokens), from two implementations
    assert m_ours["rollout_corr/creditlab/mismatch/k3"] == pytest.approx(m_verl["rollout_corr/k3_kl"], rel=1e-5)
    assert m_verl["rollout_corr/k3_kl"] > 0.05

    w_verl, _ = _verl(old, rollout, rm, "sequence", threshold=2.0)
    w_ours, _ = _verl(old, rollout, rm, "creditlab_seq_is:cap=2")
    torch.testing.assert_close(w_ours[pm], w_verl[pm])

    w_verl, _ = _verl(old, rollout, rm, "token", threshold="0.5_2.0")  # IcePop: 0 outside [0.5, 2]
    w_ours, _ = _verl(old, rollout, rm, "creditlab_mis:lo=0.5,hi=2")
    torch.testing.assert_close(w_ours[pm], w_verl[pm])
    assert bool((w_ours[pm] == 0).any())


def test_bypass_mode_loss_uses_creditlab_weights():
    """verl's bypass-mode loss (REINFORCE) calls the same wrapped function per micro-batch."""
    old, rollout, rm = agent_batch(5, mismatch=0.1)
    logp = old.clone().requires_grad_(True)
    adv = torch.randn(old.shape[0], 1).expand_as(old) * rm
    cfg = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
                            "global_batch_info": {}, "policy_loss": {"rollout_correction": {
                                "loss_type": "reinforce", "rollout_is": "creditlab_prefix", "rollout_rs": None}}})
    loss_fn = core_algos.get_policy_loss_fn("bypass_mode")
    loss, metrics = loss_fn(old_log_prob=rollout, log_prob=logp, advantages=adv, response_mask=rm,
                            loss_agg_mode="token-mean", config=cfg)
    assert torch.isfinite(loss) and "rollout_corr/creditlab/mismatch/k3" in metrics
    w, _ = correction.interq_weights(old, rollout, rm.bool(), mode="prefix")
    # verl's REINFORCE loss: token-mean of -A * log pi * w, with w our prefix weights
    expected = -(adv * logp.detach() * w)[rm > 0].sum() / rm.sum()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    loss.backward()
    assert logp.grad is not None and bool(torch.isfinite(logp.grad).all())


@pytest.mark.parametrize("spec, match", [
    ("creditlab_bogus", "unknown arm 'bogus'.*creditlab_interq"),
    ("creditlab_interq:alpha=0.3", "bad parameter 'alpha=0.3'.*alpha_g"),
    ("creditlab_tis:cap=big", "expected a number"),
    ("creditlab_interq:alpha_g=2", "alpha_g"),
])
def test_bad_specs_raise_config_errors(spec, match):
    old, rollout, rm = agent_batch(6)
    with pytest.raises(ConfigError, match=match):
        _verl(old, rollout, rm, spec)


def test_batch_normalize_is_refused():
    old, rollout, rm = agent_batch(6)
    with pytest.raises(ConfigError, match="rollout_is_batch_normalize"):
        rollout_corr_helper.compute_rollout_correction_weights(old - rollout, rm, rollout_is="creditlab_interq",
                                                              rollout_is_batch_normalize=True)


def test_wrapper_fails_loudly_on_unknown_version_or_signature(monkeypatch):
    original = rollout_corr_helper.compute_rollout_correction_weights.__creditlab_original__
    monkeypatch.setattr(rollout_corr_helper, "compute_rollout_correction_weights", original)
    monkeypatch.setattr(cv.verl, "__version__", "0.10.0")
    monkeypatch.delenv("CREDITLAB_ALLOW_UNTESTED_VERL", raising=False)
    with pytest.raises(CreditlabError, match="tested with verl 0.9.1, found 0.10.0"):
        cv.install_rollout_correction()
    assert rollout_corr_helper.compute_rollout_correction_weights is original

    def changed(log_ratio, response_mask, rollout_is="token", threshold=2.0):
        return None

    monkeypatch.setenv("CREDITLAB_ALLOW_UNTESTED_VERL", "1")
    monkeypatch.setattr(rollout_corr_helper, "compute_rollout_correction_weights", changed)
    with pytest.raises(CreditlabError, match="no longer has the signature"):
        cv.install_rollout_correction()
    monkeypatch.setattr(rollout_corr_helper, "compute_rollout_correction_weights", original)
    cv.install_rollout_correction()  # an untested version with the same signature installs when allowed
    assert rollout_corr_helper.compute_rollout_correction_weights.__creditlab_original__ is original
