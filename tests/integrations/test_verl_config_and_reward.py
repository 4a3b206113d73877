"""The verl snippets of docs/integrations.md against verl's real config, external-module loading and
reward loop (FORK through ``RewardLoopWorker`` with the loopback judge server)."""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch
import verl
import yaml
from hydra import compose, initialize_config_dir
from integration_helpers import agent_batch, doc_block, tiny_tokenizer
from omegaconf import OmegaConf, open_dict
from verl import DataProto
from verl.trainer.ppo import rollout_corr_helper
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.utils.skip.skip_manager import SkipManager

import creditlab.integrations.verl as cv
from creditlab.errors import CreditlabError
from creditlab.integrations._common import cached_fork_reward
from creditlab.judge.testing import ChatServer
from creditlab.rewards.items import ForkItem, parse_rubrics

CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def _compose(overrides=()):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


@pytest.fixture(scope="module")
def yaml_config():
    """verl's full PPO config with the documented YAML merged in (as a user's config file would be)."""
    cfg = _compose()
    OmegaConf.set_struct(cfg, False)
    return OmegaConf.merge(cfg, OmegaConf.create(yaml.safe_load(doc_block("verl-yaml"))))


@pytest.mark.slow
def test_env_block_loads_creditlab_in_a_fresh_verl_process():
    line = doc_block("verl-env").strip()
    assert line.startswith("export ")
    key, value = line[len("export "):].split("=", 1)
    code = ("import verl\nfrom verl.trainer.ppo import core_algos, rollout_corr_helper as h\n"
            "assert h.compute_rollout_correction_weights.__creditlab_original__ is not None\n"
            "assert 'creditlab_prm' in core_algos.ADV_ESTIMATOR_REGISTRY\nprint('loaded')\n")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env={**os.environ, key: value},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr[-2000:]


def test_cli_block_composes_with_verls_config():
    cmd = " ".join(doc_block("verl-cli").split("\\\n"))
    args = shlex.split(cmd)
    overrides = args[args.index("verl.trainer.main_ppo") + 1:]
    cfg = _compose(overrides)
    assert cfg.algorithm.adv_estimator == "creditlab_per_turn"
    assert cfg.algorithm.creditlab.conserve is True
    assert cv.parse_rollout_is(cfg.algorithm.rollout_correction.rollout_is) == ("interq", {"alpha_g": 0.5})
    assert cfg.reward.custom_reward_function.reward_kwargs.judge == "openai"


def test_yaml_block_drives_verls_rollout_correction_and_advantage(yaml_config):
    algo = yaml_config.algorithm
    old, rollout, rm = agent_batch(7, mismatch=0.1)
    batch = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": rm})
    batch, metrics = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(batch, algo.rollout_correction)
    assert metrics["rollout_corr/creditlab/mismatch/k3"] > 0
    w = batch.batch["rollout_is_weights"]
    assert bool((w[rm > 0] != 1).any()) and bool((w[rm == 0] == 0).all())

    r = cv.pack_turn_rewards(rm, torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.4]))
    data = DataProto.from_dict(tensors={"token_level_rewards": r, "response_mask": rm},
                               non_tensors={"uid": np.array(["a"] * 3 + ["b"] * 3, dtype=object)})
    SkipManager.set_step(1)
    out = compute_advantage(data, adv_estimator=algo.adv_estimator, config=algo)
    grpo = compute_advantage(data, adv_estimator="grpo", config=algo)
    torch.testing.assert_close(out.batch["advantages"], grpo.batch["advantages"])  # no process scores: GRPO


def test_pack_block_runs():
    exec(compile(doc_block("verl-pack"), "docs/integrations.md:verl-pack", "exec"), {})


# --------------------------------------------------------------------------------------------
# FORK through verl's reward loop


RUBRICS = [{"criterion": "aspirin water", "points": 2}, {"criterion": "rest", "points": 1}]
SAMPLES = [("take aspirin with water . rest .", 0), ("take aspirin with water . aspirin WRONG cures cancer .", 1),
           ("drink tea .", 2), ("rest . take aspirin with water . sleep .", 3)]


def _reward_data(tokenizer):
    B, P, R = len(SAMPLES), 2, 12
    prompts = torch.full((B, P), tokenizer.pad_token_id)
    responses = torch.full((B, R), tokenizer.pad_token_id)
    attention = torch.zeros(B, P + R, dtype=torch.long)
    for i, (text, _) in enumerate(SAMPLES):
        ids = tokenizer(text)["input_ids"]
        responses[i, :len(ids)] = torch.tensor(ids)
        attention[i, :P] = 1
        attention[i, P:P + len(ids)] = 1
    non_tensors = {
        "data_source": np.array(["medqa"] * B, dtype=object),
        "reward_model": np.array([{"ground_truth": RUBRICS} for _ in SAMPLES], dtype=object),
        "extra_info": np.array([{"prompt": "How do I treat a headache?", "index": i} for _, i in SAMPLES],
                               dtype=object),
    }
    return DataProto.from_dict(tensors={"prompts": prompts, "responses": responses, "attention_mask": attention},
                               non_tensors=non_tensors)


def test_fork_through_verls_reward_loop_is_batched(yaml_config, tmp_path):
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    cfg = OmegaConf.create(OmegaConf.to_container(yaml_config))
    with ChatServer() as srv, open_dict(cfg):
        cfg.actor_rollout_ref.model.path = str(tmp_path / "tok")
        cfg.actor_rollout_ref.model.tokenizer_path = str(tmp_path / "tok")
        cfg.reward.custom_reward_function.reward_kwargs.base_url = srv.url
        cfg.reward.custom_reward_function.reward_kwargs.max_retries = 0
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            worker = RewardLoopWorker(cfg)  # verl's real worker: loads our function through pkg://
            data = _reward_data(tok)
            outputs = loop.run_until_complete(worker.compute_score_batch(data))
            batches = [b for b in cv._BATCHERS.values() if b.batches]
            # verl's reward loop calls once per sample; the judge saw them as one batch
            assert [b.batches for b in batches][-1] == [len(SAMPLES)]
            kw = cfg.reward.custom_reward_function.reward_kwargs
            reward = cached_fork_reward("openai", base_url=srv.url, model=kw.model, max_retries=0)
            items = [ForkItem(str(i), "user: How do I treat a headache?", tok.decode(tok(t)["input_ids"]),
                              parse_rubrics(RUBRICS, "test")) for t, i in SAMPLES]
            direct = loop.run_until_complete(reward.score(items))
            srv.push_faults(["500"])
            failing = _reward_data(tok)[:1]
            with pytest.raises(CreditlabError, match="FORK reward of sample 0"):
                loop.run_until_complete(worker.compute_score_batch(failing))
        finally:
            loop.close()
            asyncio.set_event_loop(None)
    for out, d in zip(outputs, direct, strict=True):
        info = out["reward_extra_info"]
        assert out["reward_score"] == pytest.approx(d.reward)
        assert info["precision"] == pytest.approx(d.precision) and info["recall"] == pytest.approx(d.recall)
    scores = [o["reward_score"] for o in outputs]
    assert scores[0] > scores[1]  # the padded, partly wrong answer is penalised by precision
    assert scores[2] == 0.0
