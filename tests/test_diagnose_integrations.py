"""Dumps from verl and TRL, through their real data structures: a verl DataProto through verl's own
``compute_advantage`` with ``algorithm.creditlab.dump_dir``, verl's ``rollout_data_dir`` JSONL written by
verl's own writer, and a TRL GRPO run with ``CreditlabGRPOTrainer(dump=...)``."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "integrations"))  # the shared builders of the integration tests
from integration_helpers import (  # noqa: E402
    agent_batch,
    assert_engine_differs,
    make_rollout_func,
    tiny_model,
    tiny_tokenizer,
)

from creditlab.core.correction import mismatch_metrics  # noqa: E402
from creditlab.diagnose import read_dump, run_checks  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]


def _verl_batch(seed=0, B=6, L=24):
    from verl import DataProto

    old, rollout, rm = agent_batch(seed, B=B, L=L, mismatch=0.05)
    last = L - 1 - torch.argmax(rm.flip(1), dim=1)
    scores = torch.zeros(B, L)
    scores[torch.arange(B), last] = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.5, 0.5])[:B]
    attn = torch.cat([torch.ones(B, 5), (torch.arange(L)[None, :] <= last[:, None]).float()], 1)  # prompt + response
    return DataProto.from_dict(
        tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": rm,
                 "token_level_scores": scores, "token_level_rewards": scores, "attention_mask": attn},
        non_tensors={"uid": np.array(["p0"] * 3 + ["p1"] * 3, dtype=object),
                     "precision": np.array([0.9, 0.5, 0.8, 0.7, 0.6, 0.7])},
        meta_info={"global_steps": 3})


@pytest.mark.parametrize("estimator", ["grpo", "creditlab_uniform"])
def test_verl_compute_advantage_dumps_each_batch_when_asked(tmp_path, estimator):
    from omegaconf import OmegaConf
    from verl.trainer.ppo import ray_trainer

    import creditlab.integrations.verl  # noqa: F401  (installs the hook, as VERL_USE_EXTERNAL_MODULES does)

    data = _verl_batch()
    dump_dir = tmp_path / "dump"
    algo = OmegaConf.create({"adv_estimator": estimator, "norm_adv_by_std_in_grpo": True,
                             "creditlab": {"dump_dir": str(dump_dir), "conserve": False}})
    out = ray_trainer.compute_advantage(data, adv_estimator=estimator, config=algo)  # verl's function, wrapped
    assert "advantages" in out.batch.keys()
    ray_trainer.compute_advantage(_verl_batch(1), estimator, 1.0, 1.0, 1, True, algo)  # positional config too
    d = read_dump(dump_dir)
    assert len(d) == 12 and sorted(p.name for p in dump_dir.iterdir()) == ["part-00000.parquet", "part-00001.parquet"]
    old = data.batch["old_log_probs"]
    rm = data.batch["response_mask"].bool()
    for i in range(6):  # the first batch, row by row: padding dropped, tool tokens kept with mask 0
        a, b = d.tokens.offsets[i], d.tokens.offsets[i + 1]
        n = int(data.batch["attention_mask"][i, 5:].sum())
        assert b - a == n
        assert np.allclose(d.tokens.logprobs[a:b], old[i, :n].double().numpy())
        assert np.array_equal(d.tokens.policy_mask[a:b], rm[i, :n].numpy())
    assert d.step.tolist() == [3] * 12 and d.group_labels == ["p0", "p1"]
    assert np.allclose(d.reward[:6], [1.0, 0.0, 1.0, 0.5, 0.5, 0.5])
    assert np.allclose(d.scalars["precision"][:6], [0.9, 0.5, 0.8, 0.7, 0.6, 0.7])
    res = {r.id: r for r in run_checks(d)}
    # the engine's 0.0 on tool tokens is masked out: no placeholder; K3 is creditlab's, on the same batch
    assert res["mismatch.placeholder_logprobs"].status == "ok"
    want = mismatch_metrics(old.double(), data.batch["rollout_log_probs"].double(), rm)["mismatch/k3"]
    first = d.row_file == 0
    assert res["mismatch.k3"].series["k3"][0] > 0 and want > 0
    k3_first = run_checks(read_dump(dump_dir / "part-00000.parquet"), only=["mismatch.k3"])[0].value
    assert k3_first == pytest.approx(want, rel=1e-6) and first.sum() == 6
    # without dump_dir nothing is written, and the estimator's own settings still parse
    algo2 = OmegaConf.create({"adv_estimator": estimator, "norm_adv_by_std_in_grpo": True})
    ray_trainer.compute_advantage(_verl_batch(2), adv_estimator=estimator, config=algo2)
    assert len(list(dump_dir.iterdir())) == 2


def test_verl_rollout_data_dir_is_read_with_the_checks_it_allows(tmp_path):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    rng = np.random.default_rng(0)
    prompts = [f"question {i}" for i in range(4)]
    for step in range(1, 9):  # verl's own writer, as trainer.rollout_data_dir uses it
        inputs = [p for p in prompts for _ in range(4)]
        outputs = ["word " * int(rng.integers(5, 10) * (1 + step / 4)) for _ in inputs]
        scores = [float(rng.integers(0, 2)) if i % 4 else float(step > 4) for i in range(len(inputs))]
        RayPPOTrainer._write_generations(inputs, outputs, [None] * len(inputs), scores,
                                         {"precision": [0.9 - 0.05 * step] * len(inputs)}, str(tmp_path), step)
    d = read_dump(tmp_path)
    assert d.formats == ["verl rollout_data_dir"] * 8 and len(d) == 128
    assert d.files[0].endswith("1.jsonl") and d.files[-1].endswith("8.jsonl")  # natural order
    res = {r.id: r for r in run_checks(d)}
    assert res["reward.length_hacking"].status == "fail"  # length up, precision down
    assert res["reward.length_hacking"].details["unit"] == "characters"
    assert res["baseline.degenerate_groups"].status in ("ok", "warn")
    for cid in ("mismatch.k3", "mismatch.prefix_drift", "credit.coverage"):
        assert res[cid].status == "skipped"
    assert "verl's rollout_data_dir holds no log-probs" in res["mismatch.k3"].message


def test_trl_grpo_run_dumps_through_the_trainer_option(tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig

    from creditlab.integrations.trl import CreditlabGRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    tok = tiny_tokenizer()
    ds = Dataset.from_dict({"prompt": ["take aspirin", "drink tea"]})
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4, max_steps=2,
                      learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                      max_completion_length=16, disable_tqdm=True, seed=0)

    def reward(completions, **kwargs):
        return [float(len(c.split()) % 3) for c in completions]

    dump = tmp_path / "dump.jsonl"
    rf = make_rollout_func(tok)
    tr = CreditlabGRPOTrainer(model=tiny_model(), reward_funcs=reward, args=args, train_dataset=ds,
                              processing_class=tok, rollout_func=rf, correction="interq", dump=dump)
    tr.train()
    assert_engine_differs(rf)  # the engine really differs: the K3 compared below is not zero by construction
    d = read_dump(dump)
    assert len(d) == 16 and sorted(set(d.step.tolist())) == [0, 1]
    assert d.tokens is not None and d.has("response")
    # tool tokens (<tool> water, 2 per gap) are in the rows with policy_mask false
    lengths = np.diff(d.tokens.offsets)
    assert (lengths - d.scalars["response_length"] == 2).all()
    # the dump's K3 per step is the K3 the trainer logged from the same log-probs and mask
    logged = [h["creditlab/mismatch/k3"] for h in tr.state.log_history if "creditlab/mismatch/k3" in h]
    k3 = run_checks(d, only=["mismatch.k3"])[0]
    assert k3.series["k3"] == pytest.approx(logged, rel=1e-4)
    rewards = [float(len(c.split()) % 3) for c in d.texts["response"]]
    assert d.reward.tolist() == rewards
    assert all(math.isfinite(x) for x in d.reward)
