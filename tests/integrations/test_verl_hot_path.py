"""The registered verl loss ``creditlab_ppo`` reads no tensor value on the host (verl calls it once per
micro-batch) and returns 0-dim tensor metrics that verl 0.9.1's ``Metric`` aggregates."""

from __future__ import annotations

import pytest
import torch
from integration_helpers import agent_batch
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils.metric.utils import AggregationType, Metric

import creditlab.integrations.verl  # noqa: F401  (registers creditlab_ppo)
from creditlab.core.correction import interq_weights

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _cfg(info=None):
    return OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                             "global_batch_info": info or {}})


INFO = {"dp_size": 2, "batch_num_tokens": 150, "global_batch_size": 13, "loss_scale_factor": 32}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("weighted", [False, True])
def test_creditlab_ppo_runs_on_meta_tensors(mode, weighted):
    B, L = 6, 24
    meta = torch.device("meta")
    logp = torch.empty(B, L, device=meta, requires_grad=True)
    old, adv = torch.empty(B, L, device=meta), torch.empty(B, L, device=meta)
    rm = torch.empty(B, L, dtype=torch.bool, device=meta)
    w = torch.empty(B, L, device=meta) if weighted else None
    loss, metrics = get_policy_loss_fn("creditlab_ppo")(old_log_prob=old, log_prob=logp, advantages=adv,
                                                        response_mask=rm, loss_agg_mode=mode, config=_cfg(INFO),
                                                        rollout_is_weights=w)
    assert loss.device == meta and loss.shape == () and loss.requires_grad
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/creditlab_weight_mean",
                            "actor/creditlab_nonfinite_tokens"}
    assert all(isinstance(v, torch.Tensor) and v.shape == () and v.device == meta for v in metrics.values())


@pytest.mark.parametrize("mode", MODES)
def test_creditlab_ppo_reads_nothing_on_the_host_and_verl_aggregates_its_metrics(mode, host_reads):
    old, rollout, rm = agent_batch(3, B=8, L=20, mismatch=0.1)
    pm = rm.bool()
    logp = (old + 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))).requires_grad_(True)
    adv = torch.randn(8, generator=torch.Generator().manual_seed(2))[:, None].expand_as(old).contiguous()
    w = interq_weights(old, rollout, pm)[0]
    fn = get_policy_loss_fn("creditlab_ppo")
    args = dict(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=pm, loss_agg_mode=mode,
                config=_cfg(INFO), rollout_is_weights=w)
    with host_reads:
        loss, metrics = fn(**args)
    assert host_reads.calls == []
    # the numbers verl's vanilla loss reports (as floats), from our tensors, through verl's own Metric
    _, vanilla = get_policy_loss_fn("vanilla")(**args)
    for ours, theirs in (("actor/pg_clipfrac", "actor/pg_clipfrac"), ("actor/ppo_kl", "actor/ppo_kl")):
        per_step = Metric(AggregationType.MEAN)
        for _ in range(3):  # three micro-batches of one step
            per_step.extend(Metric.from_dict({ours: metrics[ours]}, AggregationType.MEAN)[ours])
        assert float(per_step.aggregate()) == pytest.approx(vanilla[theirs], rel=1e-5, abs=1e-7)
    assert float(metrics["actor/creditlab_nonfinite_tokens"]) == 0.0
    loss.backward()
    assert bool(torch.isfinite(logp.grad).all())


def test_nonfinite_inputs_are_counted():
    old, _, rm = agent_batch(4, B=4, L=12)
    pm = rm.bool()
    logp = old.clone().requires_grad_(True)
    adv = torch.ones_like(old)
    bad = old.clone()
    first = pm.nonzero()[0]
    bad[first[0], first[1]] = float("nan")
    bad[~pm] = float("nan")  # junk off the response mask is not counted
    _, metrics = get_policy_loss_fn("creditlab_ppo")(bad, logp, adv, pm, "token-mean", _cfg(), None)
    assert float(metrics["actor/creditlab_nonfinite_tokens"]) == 1.0
