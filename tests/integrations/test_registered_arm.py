"""An arm registered by a user module, unchanged, through verl's real rollout correction and TRL's real
``GRPOTrainer``: the edges read :data:`creditlab.core.correction.CORRECTIONS` at call time, so a new
arm needs no edit anywhere else (and an unknown one is a ``ConfigError``, never a ``KeyError``). So does a
built-in arm added in core alone: the composed ``interq_tis``."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from integration_helpers import agent_batch, assert_engine_differs, make_rollout_func, tiny_model, tiny_tokenizer
from omegaconf import OmegaConf
from trl import GRPOConfig, GRPOTrainer
from verl import DataProto
from verl.trainer.ppo import rollout_corr_helper

import creditlab.integrations.verl  # noqa: F401  (installs the rollout correction)
from creditlab.core.correction import (
    CORRECTIONS,
    interq_weights,
    register_correction,
    tis_weights,
    unregister_correction,
)
from creditlab.errors import ConfigError
from creditlab.integrations.trl import CreditlabGRPOTrainer


def half_tis(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, cap: float = 2.0):
    """Truncated token IS shrunk halfway to 1: ``1 + (min(r, cap) - 1) / 2``."""
    w, metrics = tis_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask, cap=cap)
    return 1.0 + 0.5 * (w - 1.0), {**metrics, "correction/half_tis": 1.0}


@pytest.fixture(autouse=True, scope="module")
def _half_tis_registered():
    register_correction("half_tis")(half_tis)  # what a user module does at import, with @register_correction
    yield
    unregister_correction("half_tis")
    assert "half_tis" not in CORRECTIONS


# --------------------------------------------------------------------------------------------
# verl


def _verl(old, rollout, rm, rollout_is):
    """verl's driver-side entry point on a DataProto (as tests/integrations/test_verl_rollout_correction.py)."""
    batch = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": rm})
    cfg = OmegaConf.create({"rollout_is": rollout_is, "rollout_is_threshold": 2.0, "rollout_rs": None,
                            "rollout_rs_threshold": None, "rollout_is_batch_normalize": False,
                            "bypass_mode": False})
    out, metrics = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(batch, cfg)
    return out.batch["rollout_is_weights"], metrics


def test_verl_rollout_correction_runs_a_registered_arm():
    old, rollout, rm = agent_batch(7, mismatch=0.6)  # large mismatch: the cap binds
    pm = rm.bool()
    w, metrics = _verl(old, rollout, rm, "creditlab_half_tis:cap=1.5")
    direct, _ = half_tis(old, rollout, pm, cap=1.5)
    torch.testing.assert_close(w[pm], direct.to(w.dtype)[pm])
    assert bool((w[~pm] == 0).all())  # verl's convention off the response mask
    assert bool((w[pm] == 1.25).any())  # 1 + (1.5 - 1) / 2: truncated, then shrunk
    assert metrics["rollout_corr/creditlab/correction/half_tis"] == 1.0  # the arm's own metric
    assert "rollout_corr/creditlab/mismatch/k3" in metrics  # and the mismatch diagnostics
    with pytest.raises(ConfigError, match="bad parameter 'lo=1'.*valid keys: cap"):
        _verl(old, rollout, rm, "creditlab_half_tis:lo=1")


def test_verl_rollout_correction_runs_the_composed_builtin_arm():
    """``interq_tis`` was added in core only: verl's entry point computes InterQ's weight times TIS's."""
    old, rollout, rm = agent_batch(9, mismatch=0.6)  # large mismatch: the cap binds
    pm = rm.bool()
    w, metrics = _verl(old, rollout, rm, "creditlab_interq_tis:cap=1.5,alpha_g=0.4")
    product = interq_weights(old, rollout, pm, alpha_g=0.4)[0] * tis_weights(old, rollout, pm, cap=1.5)[0]
    torch.testing.assert_close(w[pm], product.to(w.dtype)[pm], rtol=1e-5, atol=1e-6)
    assert bool((w[~pm] == 0).all()) and bool((w[pm] != 1).any())
    assert metrics["rollout_corr/creditlab/correction/token_clip_rate"] > 0  # the cap bound some tokens
    assert "rollout_corr/creditlab/correction/rho_mean" in metrics and "rollout_corr/creditlab/mismatch/k3" in metrics
    with pytest.raises(ConfigError, match="bad parameter 'lo=1'.*valid keys: eps_low, .*, iters, cap"):
        _verl(old, rollout, rm, "creditlab_interq_tis:lo=1")


def test_verl_refuses_an_arm_once_unregistered():
    old, rollout, rm = agent_batch(8)
    fn = unregister_correction("half_tis")
    try:
        with pytest.raises(ConfigError, match="unknown arm 'half_tis'; valid: creditlab_interq"):
            _verl(old, rollout, rm, "creditlab_half_tis")
    finally:
        register_correction("half_tis")(fn)


# --------------------------------------------------------------------------------------------
# TRL (the setup of tests/integrations/test_trl_trainer.py)

G = 4
RUBRICS = [{"criterion": "aspirin water", "points": 2}, {"criterion": "rest", "points": 1}]


def _dataset(n=2):
    return Dataset.from_dict({"prompt": ["take aspirin", "drink tea"][:n], "rubrics": [RUBRICS] * n})


def _inputs(n=2):
    return [dict(r) for r in _dataset(n) for _ in range(G)]


def _length_reward(completions, **kwargs):
    return [float(len(c.split()) % 3) for c in completions]


def test_trl_trainer_runs_a_registered_arm(tmp_path):
    tok = tiny_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=G,
                      max_steps=1, learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no",
                      use_cpu=True, max_completion_length=16, disable_tqdm=True, seed=0)
    rf = make_rollout_func(tok)
    tr = CreditlabGRPOTrainer(model=tiny_model(), reward_funcs=_length_reward, args=args, train_dataset=_dataset(),
                              processing_class=tok, rollout_func=rf, correction="half_tis",
                              correction_params={"cap": 1.02})
    torch.manual_seed(0)
    base = GRPOTrainer._generate_and_score_completions(tr, _inputs())  # TRL's own output
    torch.manual_seed(0)
    out = tr._generate_and_score_completions(_inputs())
    assert_engine_differs(rf)  # the weights below differ from 1 because the engine does
    pm = (out["completion_mask"] * out["tool_mask"]).bool()
    direct, _ = half_tis(out["old_per_token_logps"], out["sampling_per_token_logps"], pm, cap=1.02)
    assert bool((direct[pm] != 1).any())
    # no vLLM importance sampling here: W is folded into per-token advantages A_i W_t
    expected = base["advantages"][:, None] * direct.to(base["advantages"].dtype)
    torch.testing.assert_close(out["advantages"], expected, rtol=1e-6, atol=1e-7)
    logged = tr._metrics["train"]
    assert logged["creditlab/correction/half_tis"] == [1.0]
    assert "creditlab/mismatch/k3" in tr._creditlab_live["train"]  # a live check value: read at TRL's next log
    with pytest.raises(ConfigError, match="correction_params: unknown \\['alpha_g'\\] for arm 'half_tis'"):
        CreditlabGRPOTrainer(model=tiny_model(), reward_funcs=_length_reward, args=args, train_dataset=_dataset(),
                             processing_class=tok, correction="half_tis", correction_params={"alpha_g": 0.5})


def test_trl_trainer_runs_the_composed_builtin_arm(tmp_path):
    tok = tiny_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=G,
                      max_steps=1, learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no",
                      use_cpu=True, max_completion_length=16, disable_tqdm=True, seed=0)
    rf = make_rollout_func(tok)
    tr = CreditlabGRPOTrainer(model=tiny_model(), reward_funcs=_length_reward, args=args, train_dataset=_dataset(),
                              processing_class=tok, rollout_func=rf, correction="interq_tis",
                              correction_params={"cap": 1.02, "alpha_g": 0.4})
    torch.manual_seed(0)
    base = GRPOTrainer._generate_and_score_completions(tr, _inputs())  # TRL's own output
    torch.manual_seed(0)
    out = tr._generate_and_score_completions(_inputs())
    assert_engine_differs(rf)
    pm = (out["completion_mask"] * out["tool_mask"]).bool()
    old, rollout = out["old_per_token_logps"], out["sampling_per_token_logps"]
    w = interq_weights(old, rollout, pm, alpha_g=0.4)[0] * tis_weights(old, rollout, pm, cap=1.02)[0]
    assert bool((w[pm] != 1).any())
    expected = base["advantages"][:, None] * w.to(base["advantages"].dtype)  # A_i W_t, as for any arm
    torch.testing.assert_close(out["advantages"], expected, rtol=1e-5, atol=1e-7)
    assert "creditlab/correction/token_clip_rate" in tr._metrics["train"]
