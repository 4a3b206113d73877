"""Dumps of verl's own code paths, read by ``creditlab diagnose``: each batch goes through verl's own
functions (``apply_bypass_mode``, ``compute_rollout_correction_and_add_to_batch`` with ``rollout_rs``,
``compute_advantage``, the v1 trainer's ``_compute_old_log_prob`` / ``_compute_advantage`` on a real
TransferQueue, and both trainers' ``rollout_data_dir`` / ``validation_data_dir`` writers), never rows
written by hand.

* bypass mode: ``old_log_probs := rollout_log_probs``; the dump says so (``logprobs_source``) and the
  mismatch checks are skipped with that reason instead of passing on identical columns;
* rejection sampling: verl zeroes the rejected tokens in ``response_mask`` before the advantage; the
  dump keeps the mask from before and marks them ``rejected``, and ``mismatch.k3`` is verl's own
  ``rollout_corr/k3_kl`` over every policy token, with the kept tokens' K3 beside it;
* the v1 trainer with several outputs per session: every output it trains is dumped, not only each
  session's final one;
* verl's JSONL writers with a ``reward`` extra field (a dict reward's, and every validation dump's) are
  read as verl's format.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from integration_helpers import DOC, agent_batch, tiny_tokenizer
from omegaconf import OmegaConf

import creditlab.integrations.verl as cverl  # installs the hooks, as VERL_USE_EXTERNAL_MODULES does
from creditlab.diagnose import read_dump, run_checks
from creditlab.diagnose.report import diagnose
from creditlab.diagnose.schema import LEARNER, VERL_BYPASS

MISMATCH = ("mismatch.k3", "mismatch.prefix_drift", "mismatch.one_sided", "mismatch.placeholder_logprobs",
            "mismatch.sequence_ratio_length")


def _batch(seed=0, B=8, L=32, mismatch=0.3, step=3):
    """A multi-turn verl batch as the legacy trainer holds it before the rollout correction."""
    from verl import DataProto

    old, rollout, rm = agent_batch(seed, B=B, L=L, mismatch=mismatch)
    last = L - 1 - torch.argmax(rm.flip(1), dim=1)
    scores = torch.zeros(B, L)
    scores[torch.arange(B), last] = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.5])[:B]
    attn = torch.cat([torch.ones(B, 5), (torch.arange(L)[None, :] <= last[:, None]).float()], 1)
    return DataProto.from_dict(
        tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": rm,
                 "token_level_scores": scores, "token_level_rewards": scores, "attention_mask": attn},
        non_tensors={"uid": np.array([f"p{i // 4}" for i in range(B)], dtype=object)},
        meta_info={"global_steps": step})


def _algo(dump, estimator="grpo", **rollout_correction):
    rc = {"rollout_is": None, "rollout_rs": None, "bypass_mode": False, **rollout_correction}
    return OmegaConf.create({"adv_estimator": estimator, "norm_adv_by_std_in_grpo": True, "gamma": 1.0, "lam": 1.0,
                             "use_kl_in_reward": False, "rollout_correction": rc,
                             "creditlab": {"dump_dir": str(dump)}})


# --------------------------------------------------------------------------------------------
# 1. bypass mode


def test_bypass_mode_dump_says_the_logprobs_are_the_engines(tmp_path):
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

    algo = _algo(tmp_path / "bypass", bypass_mode=True)
    batch = _batch()
    rollout = batch.batch["rollout_log_probs"].clone()
    policy_loss = OmegaConf.create({"loss_mode": "vanilla"})
    apply_bypass_mode(batch, rollout_corr_config=algo.rollout_correction, policy_loss_config=policy_loss)  # verl's
    assert policy_loss.loss_mode == "bypass_mode" and torch.equal(batch.batch["old_log_probs"], rollout)
    ray_trainer.compute_advantage(batch, adv_estimator="grpo", config=algo)  # as the legacy trainer calls it
    d = read_dump(tmp_path / "bypass")
    assert d.texts["logprobs_source"] == [VERL_BYPASS] * 8
    assert np.array_equal(d.tokens.logprobs, d.tokens.rollout_logprobs)  # one computation, twice
    res = {r.id: r for r in run_checks(d)}
    for cid in MISMATCH:  # no check says ok (or warns about a copied column): each says why it cannot tell
        assert res[cid].status == "skipped", (cid, res[cid].message)
        assert "bypass mode" in res[cid].message and "never computed" in res[cid].message
    assert res["baseline.degenerate_groups"].status != "skipped"  # the rest of the dump is still read
    # the same batch trained in decoupled mode: the learner's log-probs, the mismatch measured
    learner = _batch()
    ray_trainer.compute_advantage(learner, adv_estimator="grpo", config=_algo(tmp_path / "decoupled"))
    d2 = read_dump(tmp_path / "decoupled")
    assert d2.texts["logprobs_source"] == [LEARNER] * 8
    assert {r.id: r for r in run_checks(d2)}["mismatch.k3"].status in ("warn", "fail")
    # dump_batch called by hand on a bypass batch: the shared storage tells
    b = _batch()
    apply_bypass_mode(b, rollout_corr_config=algo.rollout_correction, policy_loss_config=OmegaConf.create({}))
    assert {r["logprobs_source"] for r in cverl.dump_rows(b)} == {VERL_BYPASS}
    assert {r["logprobs_source"] for r in cverl.dump_rows(_batch())} == {LEARNER}
    # a dump of both runs: the bypass rows are left out of the mismatch checks, and the evidence says so
    k3 = run_checks(read_dump([tmp_path / "bypass", tmp_path / "decoupled"]), only="mismatch.k3")[0]
    assert k3.status in ("warn", "fail") and "8 rows whose logprobs_source says logprobs are the engine's" \
        in k3.message
    assert k3.value == pytest.approx({r.id: r for r in run_checks(d2)}["mismatch.k3"].value)


# --------------------------------------------------------------------------------------------
# 2. rejection sampling


def test_rejection_sampling_dump_keeps_the_rejected_tokens(tmp_path):
    from verl.trainer.ppo import ray_trainer, rollout_corr_helper

    algo = _algo(tmp_path / "rs", rollout_rs="token_k3", rollout_rs_threshold=0.05)
    batch = _batch()
    before = batch.batch["response_mask"].clone().bool()
    # as the legacy trainer: verl's rollout correction (rejection replaces response_mask), then the advantage
    batch, metrics = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(batch, algo.rollout_correction)
    after = batch.batch["response_mask"].bool()
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] > 0.1 and not torch.equal(before, after)
    ray_trainer.compute_advantage(batch, adv_estimator="grpo", config=algo)
    d = read_dump(tmp_path / "rs")
    n = int(batch.batch["attention_mask"][0, 5:].sum())
    a, b = d.tokens.offsets[0], d.tokens.offsets[1]
    assert np.array_equal(d.tokens.policy_mask[a:b], before[0, :n].numpy())  # the policy's tokens, all of them
    assert np.array_equal(d.tokens.rejected[a:b], (before & ~after)[0, :n].numpy())
    assert int(d.tokens.rejected.sum()) == int((before & ~after).sum())
    k3 = run_checks(d, only="mismatch.k3")[0]
    # the value is verl's own K3 (its off-policy metrics use the mask from before rejection) ...
    assert k3.value == pytest.approx(metrics["rollout_corr/k3_kl"], rel=1e-5)
    # ... and the K3 of the kept tokens, which is all a dump of the replaced mask could show, beside it
    old, rollout = batch.batch["old_log_probs"].double(), batch.batch["rollout_log_probs"].double()
    delta = (old - rollout)[after]
    kept = float((torch.expm1(delta) - delta).mean())
    assert k3.details["k3_kept"] == pytest.approx(kept, rel=1e-6)
    assert k3.details["k3_kept"] < 0.6 * k3.value  # the rejected tokens are the worst-mismatch ones
    assert k3.details["tokens_rejected"] == int((before & ~after).sum())
    assert "rejection sampling kept" in k3.message
    # the same rows through JSONL read the same
    cverl.dump_batch(batch, tmp_path / "rs.jsonl")
    j = read_dump(tmp_path / "rs.jsonl")
    assert np.array_equal(j.tokens.rejected, d.tokens.rejected)
    assert np.array_equal(j.tokens.policy_mask, d.tokens.policy_mask)
    # without rollout_rs nothing is marked (and no column is written)
    plain = _batch()
    no_rs = _algo(tmp_path).rollout_correction
    plain, _ = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(plain, no_rs)
    assert all("rejected" not in r for r in cverl.dump_rows(plain))


# --------------------------------------------------------------------------------------------
# 4. the dump is written after compute_advantage returns


def test_dump_is_written_after_compute_advantage_as_documented(tmp_path):
    from verl.trainer.ppo import ray_trainer

    batch = _batch()
    rm = batch.batch.pop("response_mask")  # a trainer that leaves it to compute_advantage (from the responses)
    batch.batch["responses"] = torch.zeros(rm.shape, dtype=torch.long)
    ray_trainer.compute_advantage(batch, adv_estimator="grpo", config=_algo(tmp_path / "d"))
    d = read_dump(tmp_path / "d")
    # compute_advantage filled response_mask from attention_mask; the dump holds what it returned
    assert d.tokens.policy_mask.sum() == int(batch.batch["attention_mask"][:, 5:].sum())
    text = re.sub(r"\s+", " ", DOC.read_text())
    assert "right after verl's `compute_advantage` returns" in text
    assert "before the advantage is computed" not in text


# --------------------------------------------------------------------------------------------
# 5. verl's own JSONL writers with a `reward` extra field


class _LegacyTrainer:
    """The state verl's legacy trainer's dump methods read (``RayPPOTrainer`` needs a cluster to build)."""

    def __init__(self, step):
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer

        self.global_steps, self.tokenizer = step, tiny_tokenizer()
        for name in ("_dump_generations", "_log_rollout_data", "_init_dump_executor", "_shutdown_dump_executor"):
            setattr(self, name, getattr(RayPPOTrainer, name).__get__(self))
        self._write_generations = RayPPOTrainer._write_generations
        self._init_dump_executor()


def _decoded_batch(step, n_prompts=4, n=4, seed=0):
    from verl import DataProto

    tk = tiny_tokenizer()
    rng = np.random.default_rng(seed + step)
    words = ["take", "aspirin", "with", "water", "rest", "sleep", "drink", "tea", "lemon", "honey"]
    prompts, responses, scores = [], [], []
    for p in range(n_prompts):
        for _ in range(n):
            prompts.append(tk(f"fever cough {words[p]}")["input_ids"])
            responses.append(tk(" ".join(rng.choice(words, int(rng.integers(3, 4 + 2 * step)))))["input_ids"])
            scores.append(float(rng.integers(0, 2)))
    P, R = max(map(len, prompts)), max(map(len, responses))
    pt = torch.tensor([[0] * (P - len(x)) + x for x in prompts])
    rt = torch.tensor([x + [0] * (R - len(x)) for x in responses])
    tls = torch.zeros(len(scores), R)
    tls[:, 0] = torch.tensor(scores)
    return DataProto.from_dict(tensors={"prompts": pt, "responses": rt, "token_level_scores": tls},
                               non_tensors={"reward_model": np.array([{"ground_truth": "rest"}] * len(scores))})


def test_verl_rollout_and_validation_dirs_with_a_reward_field_are_read_as_verls(tmp_path):
    train, val = tmp_path / "rollout_data_dir", tmp_path / "validation_data_dir"
    for step in range(1, 9):
        trainer = _LegacyTrainer(step)
        batch = _decoded_batch(step)
        B = len(batch)
        # a dict reward {"score", "reward", "precision"}: verl's trainer passes the extra keys on
        extra = {"reward": np.linspace(0, 1, B), "precision": np.full(B, 0.9 - 0.05 * step)}
        trainer._log_rollout_data(batch, extra, {}, str(train))  # verl's trainer.rollout_data_dir path
        # verl's _validate: reward_extra_infos_dict["reward"] is the score, then the reward function's keys
        inputs = trainer.tokenizer.batch_decode(batch.batch["prompts"], skip_special_tokens=True)
        outputs = trainer.tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
        scores = batch.batch["token_level_scores"].sum(-1).tolist()
        trainer._dump_generations(inputs, outputs, [None] * B, scores, {"reward": scores, "acc": scores}, str(val))
        trainer._shutdown_dump_executor()
    for path in (train, val):
        first = (path / "1.jsonl").read_text().splitlines()[0]
        assert '"reward"' in first and '"gts"' in first
        d = read_dump(path)
        assert d.formats == ["verl rollout_data_dir"] * 8 and len(d) == 128
        assert len(d.group_labels) == 4 and d.group_labels[0] == "fever cough take"
        res = {r.id: r for r in run_checks(d)}
        assert res["reward.length_hacking"].status != "skipped"
        assert res["reward.length_hacking"].details["unit"] == "characters"
        assert res["mismatch.k3"].status == "skipped" and "no log-probs" in res["mismatch.k3"].message
    assert np.allclose(read_dump(train).scalars["precision"][:16], 0.85)
    result = diagnose([train], tmp_path / "report")
    assert result.exit_code in (0, 1)  # read, not exit 2


# --------------------------------------------------------------------------------------------
# 3. the v1 trainer (verl.trainer.ppo.v1) on a real TransferQueue


@pytest.fixture(scope="module")
def transfer_queue():
    """verl's v1 trainer keeps its batch in TransferQueue: a local Ray with its controller and one storage unit."""
    tq = pytest.importorskip("transfer_queue", reason="verl's v1 trainer needs transfer_queue (pip install "
                                                      "transferqueue)")
    import ray

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        mp.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False, raising=False)
        if ray.is_initialized():
            ray.shutdown()
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", object_store_memory=200 * 2**20)
        try:
            tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
            yield tq
        finally:
            tq.close()
            ray.shutdown()


class _V1Trainer:
    """The state verl's v1 ``PPOTrainer`` methods read; the methods are verl's own."""

    def __init__(self, algo, step=5):
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer

        self.config = OmegaConf.create({"algorithm": algo, "trainer": {},
                                        "actor_rollout_ref": {"rollout": {"n": 2, "temperature": 1.0,
                                                                          "calculate_log_probs": True},
                                                              "actor": {"loss_agg_mode": "token-mean",
                                                                        "loss_scale_factor": None}}})
        self.global_steps, self.tokenizer = step, tiny_tokenizer()
        for name in ("_compute_old_log_prob", "_compute_advantage", "_dump_generations", "_log_rollout_data",
                     "_init_dump_executor", "_shutdown_dump_executor"):
            setattr(self, name, getattr(PPOTrainer, name).__get__(self))
        self._write_generations = PPOTrainer._write_generations
        self._init_dump_executor()
        self.actor_rollout_wg = SimpleNamespace(compute_log_prob=self._learner)

    def _learner(self, batch):
        """The actor worker's part: the learner's log-probs, in the worker's layout (over prompt and response,
        shifted by one), put into TransferQueue as verl's engine workers do."""
        import transfer_queue as tq
        from tensordict import TensorDict

        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["prompts", "learner"])
        out = []
        for p, lp in zip(data["prompts"].unbind(), data["learner"].unbind(), strict=True):
            out.append(torch.cat([torch.zeros(p.shape[0] - 1), lp, torch.zeros(1)]))
        nested = torch.nested.as_nested_tensor(out, layout=torch.jagged)
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                        fields=TensorDict({"log_probs": nested, "entropy": nested.abs()}, batch_size=len(out)))
        return batch


def _v1_outputs(tq, partition, seed=0):
    """2 prompts x 2 sessions x 2 outputs, put into TransferQueue as verl's ``AgentLoopWorkerTQ`` does: keys
    ``{uid}_{session}_{output}``, every output of a session carrying its final reward."""
    from transfer_queue import KVBatchMeta
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    tk = tiny_tokenizer()
    g = torch.Generator().manual_seed(seed)
    rewards = {("p0", 0): 1.0, ("p0", 1): 0.0, ("p1", 0): 0.5, ("p1", 1): 0.0}
    keys, fields = [], []
    for (uid, session), reward in rewards.items():
        context = tk("fever cough")["input_ids"]
        for i in range(2):
            R = 5 + int(torch.randint(0, 5, (1,), generator=g)) + 2 * i  # ends with policy tokens (below)
            response = torch.randint(5, 20, (R,), generator=g)
            mask = torch.ones(R, dtype=torch.int64)
            mask[2:4] = 0  # a tool observation inside the output
            learner = -(torch.randn(R, generator=g) * 0.5 - 1.5).abs()
            rollout = torch.where(mask > 0, -(learner - torch.randn(R, generator=g) * 0.3).abs(), torch.zeros(R))
            scores = torch.zeros(R)
            scores[-1] = reward
            keys.append(f"{uid}_{session}_{i}")
            fields.append({"uid": uid, "prompts": torch.tensor(context), "responses": response, "response_mask": mask,
                           "rollout_log_probs": rollout, "learner": learner, "rm_scores": scores,
                           "reward_model": {"ground_truth": "rest"}})
            context = context + response.tolist()  # the next output's prompt holds this one
    batch = tq.kv_batch_put(keys=keys, partition_id=partition, fields=list_of_dict_to_tensordict(fields))
    assert isinstance(batch, KVBatchMeta)
    return batch, fields


def test_v1_trainer_dumps_every_output_it_trains(tmp_path, transfer_queue):
    from verl.trainer.ppo.v1 import trainer_base
    from verl.utils.skip import SkipManager

    assert hasattr(trainer_base.compute_advantage_for_multi_trajectories, "__creditlab_original__")
    assert hasattr(trainer_base.compute_rollout_correction_and_add_to_batch, "__creditlab_original__")
    saved = SkipManager.step
    SkipManager.set_step(5)
    try:
        # decoupled mode with rejection sampling: the learner's log-probs from the (stub) worker, verl's v1 code
        algo = _algo(tmp_path / "v1", rollout_rs="token_k3", rollout_rs_threshold=0.05)
        trainer = _V1Trainer(algo)
        batch, fields = _v1_outputs(transfer_queue, "train")
        metrics: dict = {}
        trainer._compute_old_log_prob(batch, metrics)
        trainer._compute_advantage(batch, metrics)
        d = read_dump(tmp_path / "v1")
        assert len(d) == 8  # every output; compute_advantage itself sees only the 4 final ones
        assert d.step.tolist() == [5] * 8 and d.group_labels == ["p0", "p1"]
        assert d.reward.tolist() == [1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0]
        for i, f in enumerate(fields):  # row by row: the output's tokens, the learner's and the engine's log-probs
            a, b = d.tokens.offsets[i], d.tokens.offsets[i + 1]
            assert b - a == f["responses"].shape[0]
            assert np.allclose(d.tokens.logprobs[a:b], f["learner"].double().numpy(), atol=1e-6)
            assert np.allclose(d.tokens.rollout_logprobs[a:b], f["rollout_log_probs"].double().numpy())
            assert np.array_equal(d.tokens.policy_mask[a:b], f["response_mask"].bool().numpy())
        assert d.texts["logprobs_source"] == [LEARNER] * 8
        assert d.has("rejected") and d.tokens.rejected.any()
        k3 = run_checks(d, only="mismatch.k3")[0]
        assert k3.value == pytest.approx(metrics["rollout_corr/k3_kl"], rel=1e-5)
        assert k3.details["k3_kept"] < k3.value
        assert not d.has("precision")  # the v1 trainer never fetches the reward function's extra fields
        # verl's v1 rollout_data_dir writer: its uid field gives the group, though each output's input differs
        trainer._log_rollout_data(batch, {}, str(tmp_path / "rollout_data_dir"))
        trainer._shutdown_dump_executor()
        v = read_dump(tmp_path / "rollout_data_dir")
        assert v.formats == ["verl rollout_data_dir"] and len(v) == 8
        assert sorted(v.group_labels) == ["p0", "p1"]
        transfer_queue.kv_clear(keys=batch.keys, partition_id="train")

        # bypass mode: verl's v1 _compute_old_log_prob copies rollout_log_probs into old_log_probs
        algo = _algo(tmp_path / "v1-bypass", bypass_mode=True)
        trainer = _V1Trainer(algo)
        batch, fields = _v1_outputs(transfer_queue, "train", seed=1)
        trainer._compute_old_log_prob(batch, {})
        trainer._compute_advantage(batch, {})
        d = read_dump(tmp_path / "v1-bypass")
        assert len(d) == 8 and d.texts["logprobs_source"] == [VERL_BYPASS] * 8
        res = {r.id: r for r in run_checks(d)}
        assert all(res[c].status == "skipped" and "bypass mode" in res[c].message for c in MISMATCH)
        transfer_queue.kv_clear(keys=batch.keys, partition_id="train")
        trainer._shutdown_dump_executor()
    finally:
        SkipManager.step = saved


def test_v1_hook_is_installed_in_either_import_order(monkeypatch):
    """verl's v1 modules import the advantage helpers by name: the hook patches them whether they were
    imported before creditlab (patched in place by install) or after (patched as v1.utils is imported)."""
    pytest.importorskip("transfer_queue", reason="verl's v1 trainer needs transfer_queue")
    import importlib

    from verl.trainer.ppo import ray_trainer, rollout_corr_helper
    from verl.trainer.ppo.v1 import trainer_base, utils

    name = "verl.trainer.ppo.v1.utils"
    assert trainer_base.compute_advantage_for_multi_trajectories is utils.compute_advantage_for_multi_trajectories
    assert hasattr(utils.compute_advantage_for_multi_trajectories, "__creditlab_original__")
    assert trainer_base.compute_rollout_correction_and_add_to_batch is \
        rollout_corr_helper.compute_rollout_correction_and_add_to_batch
    package = sys.modules["verl.trainer.ppo.v1"]
    monkeypatch.setitem(sys.modules, name, utils)  # restored afterwards, with the package attribute
    monkeypatch.setattr(package, "utils", utils)
    # imported before creditlab: no import hook sees it; install() patches the module in place
    hooks = [f for f in sys.meta_path if isinstance(f, cverl._AfterImport)]
    assert hooks
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f not in hooks])
    del sys.modules[name]
    early = importlib.import_module(name)
    assert early is not utils and not hasattr(early.compute_advantage_for_multi_trajectories, "__creditlab_original__")
    cverl.install()
    assert hasattr(early.compute_advantage_for_multi_trajectories, "__creditlab_original__")
    assert early.compute_advantage is ray_trainer.compute_advantage
    # imported after creditlab (as in a verl process: VERL_USE_EXTERNAL_MODULES runs first): patched on import
    monkeypatch.setattr(sys, "meta_path", hooks + list(sys.meta_path))
    del sys.modules[name]
    late = importlib.import_module(name)
    assert late is not early and hasattr(late.compute_advantage_for_multi_trajectories, "__creditlab_original__")
    cverl.install()  # idempotent: one hook, one wrapper
    assert sum(isinstance(f, cverl._AfterImport) for f in sys.meta_path) == 1


def test_new_columns_are_validated(tmp_path):
    from creditlab.diagnose.schema import write_dump
    from creditlab.errors import InputError

    rows = cverl.dump_rows(_batch())
    bad = [dict(r, logprobs_source="engine") for r in rows]
    write_dump(bad, tmp_path / "source.jsonl")
    with pytest.raises(InputError, match=r"line 1: column 'logprobs_source': 'engine': expected 'learner'"):
        read_dump(tmp_path / "source.jsonl")
    short = [dict(r, rejected=[False]) for r in rows]
    write_dump(short, tmp_path / "short.jsonl")
    with pytest.raises(InputError, match=r"line 1: column 'rejected': 1 values, but 'logprobs' has"):
        read_dump(tmp_path / "short.jsonl")
    bare = [{"step": r["step"], "group": r["group"], "reward": r["reward"], "rejected": [True]} for r in rows]
    write_dump(bare, tmp_path / "bare.jsonl")
    with pytest.raises(InputError, match="column 'rejected' without the token columns"):
        read_dump(tmp_path / "bare.jsonl")


def test_docs_describe_each_verl_path():
    text = re.sub(r"\s+", " ", DOC.read_text())
    for phrase in ("logprobs_source", "bypass mode", "rejected", "rollout_rs", "v1 trainer",
                   "precision` / `recall` never reach a v1 dump", "validation_data_dir"):
        assert phrase in text, phrase
    diag = re.sub(r"\s+", " ", (Path(DOC).parent / "diagnose.md").read_text())
    for phrase in ("logprobs_source", "`rejected`", "validation_data_dir", "`gts`"):
        assert phrase in diag, phrase
