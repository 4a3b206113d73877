"""Our ``policy_loss`` against verl's ``vanilla`` policy loss and TRL's GRPO loss, in every aggregation
mode they share, on the same tensors; and the advantage-folding identity our TRL trainer relies on."""

from __future__ import annotations

import pytest
import torch
from integration_helpers import agent_batch, tiny_model, tiny_tokenizer
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import get_policy_loss_fn

import creditlab.integrations.verl  # noqa: F401  (registers creditlab_ppo)
from creditlab.core.correction import interq_weights
from creditlab.core.losses import policy_loss

VERL_MODES = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean",
              "seq-mean-token-sum": "seq_mean_token_sum", "seq-mean-token-sum-norm": "seq_mean_token_sum_norm"}


def _verl_cfg(clip_ratio_c=3.0):
    return OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                             "clip_ratio_c": clip_ratio_c, "global_batch_info": {}})


def _tensors(seed, spread=0.3):
    old, rollout, rm = agent_batch(seed, B=8, L=20, mismatch=0.1)
    rm[3] = 0  # a fully masked row
    g = torch.Generator().manual_seed(seed + 100)
    logp = (old + torch.randn(old.shape, generator=g) * spread).requires_grad_(True)
    adv = torch.randn(old.shape[0], generator=g)[:, None].expand_as(old).contiguous()
    return logp, old, rollout, adv, rm


@pytest.mark.parametrize("verl_mode", list(VERL_MODES))
@pytest.mark.parametrize("weighted", [False, True])
def test_policy_loss_equals_verl_vanilla(verl_mode, weighted):
    logp, old, rollout, adv, rm = _tensors(0)
    pm = rm.bool()
    w = interq_weights(old, rollout, pm)[0] if weighted else None
    lv, mv = get_policy_loss_fn("vanilla")(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=pm,
                                           loss_agg_mode=verl_mode, config=_verl_cfg(), rollout_is_weights=w)
    (g_verl,) = torch.autograd.grad(lv, logp)
    mode = VERL_MODES[verl_mode]
    # verl 0.9.1's seq-mean-token-sum-norm is a mean over non-empty rows of token sums / L, as ours
    lo, mo = policy_loss(logp, old, adv, pm, clip_low=0.2, clip_high=0.28, weights=w, agg=mode)
    (g_ours,) = torch.autograd.grad(lo, logp)
    torch.testing.assert_close(lo, lv, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_ours, g_verl, rtol=1e-6, atol=1e-8)
    assert mo["loss/clip_frac"] == pytest.approx(mv["actor/pg_clipfrac"], abs=1e-7)
    assert mo["loss/approx_kl"] == pytest.approx(mv["actor/ppo_kl"], rel=1e-5)


@pytest.mark.parametrize("verl_mode", list(VERL_MODES))
@pytest.mark.parametrize("global_info", [{}, {"dp_size": 2, "batch_num_tokens": 150, "global_batch_size": 13,
                                              "loss_scale_factor": 32}])
def test_registered_creditlab_ppo_equals_vanilla_with_verls_normalisation(verl_mode, global_info):
    logp, old, rollout, adv, rm = _tensors(2)
    pm = rm.bool()
    w = interq_weights(old, rollout, pm)[0]
    cfg = _verl_cfg()
    cfg.global_batch_info = global_info
    args = dict(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=pm, loss_agg_mode=verl_mode,
                config=cfg, rollout_is_weights=w)
    lv, mv = get_policy_loss_fn("vanilla")(**args)
    lo, mo = get_policy_loss_fn("creditlab_ppo")(**args)
    torch.testing.assert_close(lo, lv, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.autograd.grad(lo, logp)[0], torch.autograd.grad(lv, logp)[0], rtol=1e-6,
                               atol=1e-8)
    assert mo["actor/pg_clipfrac"] == pytest.approx(mv["actor/pg_clipfrac"], abs=1e-7)


def test_dual_clip_with_large_ratios():
    logp, old, rollout, adv, rm = _tensors(1, spread=2.0)  # ratios far above clip_ratio_c = 3
    pm = rm.bool()
    dual, _ = get_policy_loss_fn("vanilla")(old, logp, adv, pm, "token-mean", _verl_cfg(3.0), None)
    no_dual, _ = get_policy_loss_fn("vanilla")(old, logp, adv, pm, "token-mean", _verl_cfg(1e9), None)
    ours_dual, _ = policy_loss(logp, old, adv, pm, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    ours, _ = policy_loss(logp, old, adv, pm, clip_low=0.2, clip_high=0.28)
    registered, _ = get_policy_loss_fn("creditlab_ppo")(old, logp, adv, pm, "token-mean", _verl_cfg(3.0), None)
    torch.testing.assert_close(ours_dual, dual, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(registered, dual, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours, no_dual, rtol=1e-6, atol=1e-7)
    assert abs(float(dual) - float(no_dual)) > 1e-3  # the dual clip (Ye et al., 2020) binds here


# --------------------------------------------------------------------------------------------
# TRL


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=8, epsilon=0.2, epsilon_high=0.28, report_to=[],
                      use_cpu=True, save_strategy="no", disable_tqdm=True)
    tr = GRPOTrainer(model=tiny_model(), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                     args=args, train_dataset=Dataset.from_dict({"prompt": ["take aspirin"] * 4}),
                     processing_class=tiny_tokenizer())
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    return tr


def _trl_inputs(trainer, seed):
    g = torch.Generator().manual_seed(seed)
    B, P, C = 4, 3, 8
    prompt_ids = torch.randint(4, 20, (B, P), generator=g)
    completion_ids = torch.randint(4, 20, (B, C), generator=g)
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[1, 5:] = 0
    completion_mask[2, 2:] = 0
    tool_mask = torch.ones(B, C, dtype=torch.long)
    tool_mask[0, 2:4] = 0
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([torch.ones(B, P, dtype=torch.long), completion_mask], 1), C)
    old = -(logp + torch.randn(B, C, generator=g) * 0.3).abs()  # log-probs are <= 0
    rollout = -(old + torch.randn(B, C, generator=g) * 0.1).abs()
    mask = (completion_mask * tool_mask).bool()
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones(B, P, dtype=torch.long),
              "completion_ids": completion_ids, "completion_mask": completion_mask, "tool_mask": tool_mask,
              "advantages": torch.randn(B, generator=g), "old_per_token_logps": old,
              "num_items_in_batch": mask.sum()}
    return inputs, logp, rollout, mask


# TRL loss type -> (our aggregation, our norm given (rows, max_completion_length))
TRL_MODES = {"bnpo": ("token_mean", None), "dapo": ("token_mean", None), "grpo": ("seq_mean_token_mean", None),
             "luspo": ("seq_mean_token_sum", None), "dr_grpo": ("seq_mean_token_sum_norm", lambda B, C: C)}


@pytest.mark.parametrize("loss_type", list(TRL_MODES))
def test_policy_loss_equals_trl_and_weights_fold_into_advantages(trainer, loss_type):
    inputs, logp, rollout, mask = _trl_inputs(trainer, 0)
    trainer.loss_type = loss_type
    agg, norm = TRL_MODES[loss_type]
    norm = norm(*mask.shape) if norm else None
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    ours, _ = policy_loss(logp, inputs["old_per_token_logps"], inputs["advantages"], mask, clip_low=0.2,
                          clip_high=0.28, agg=agg, norm=norm)
    torch.testing.assert_close(trl_loss.detach(), ours, rtol=1e-5, atol=1e-6)

    # InterQ weights, given to TRL folded into per-token advantages A_t W_t (what CreditlabGRPOTrainer
    # does without vLLM), give our weighted loss ...
    w, _ = interq_weights(inputs["old_per_token_logps"], rollout, mask, mode="prefix")
    folded = dict(inputs, advantages=inputs["advantages"][:, None] * w)
    trl_folded = trainer._compute_loss(trainer.model, folded)
    ours_w, _ = policy_loss(logp, inputs["old_per_token_logps"], inputs["advantages"], mask, clip_low=0.2,
                            clip_high=0.28, weights=w, agg=agg, norm=norm)
    torch.testing.assert_close(trl_folded.detach(), ours_w, rtol=1e-5, atol=1e-6)
    assert abs(float(ours_w) - float(ours)) > 1e-6
    # ... and the same as TRL's own importance-sampling path with the ratio replaced by W (with vLLM)
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    try:
        trl_ratio = trainer._compute_loss(trainer.model, dict(inputs, importance_sampling_ratio=w))
    finally:
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = False
    torch.testing.assert_close(trl_ratio.detach(), ours_w, rtol=1e-5, atol=1e-6)
