"""What ``creditlab diagnose`` makes of TRL's own files and numbers, produced by TRL's code (1.16.0;
1.15.0 in test_trl_versions.py): the
``log_completions`` parquet files and wandb tables of a real ``GRPOTrainer`` run, a NaN engine log-prob
carried through TRL's generation path into a ``CreditlabGRPOTrainer(dump=...)`` dump, and TRL's own
``sampling/*`` metrics against the ones ``diagnose.json`` computes from the dump of the same batches."""

from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd
import pytest
import torch
from datasets import Dataset
from integration_helpers import assert_engine_differs, make_rollout_func, tiny_model, tiny_tokenizer
from trl import GRPOConfig, GRPOTrainer

from creditlab.diagnose import read_dump, run_checks
from creditlab.diagnose.report import diagnose
from creditlab.diagnose.trainer_metrics import trl_sampling_metrics
from creditlab.errors import InputError
from creditlab.integrations.trl import CreditlabGRPOTrainer

G = 4
MISMATCH = ("mismatch.k3", "mismatch.prefix_drift", "mismatch.one_sided", "mismatch.placeholder_logprobs",
            "mismatch.nonfinite_logprobs", "mismatch.sequence_ratio_length")


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=G, max_steps=2,
                learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                max_completion_length=16, disable_tqdm=True, seed=0)
    return GRPOConfig(**{**base, **kw})


def _dataset():
    return Dataset.from_dict({"prompt": ["take aspirin", "drink tea"]})


def length_reward(completions, **kwargs):
    return [float(len(c.split()) % 3) for c in completions]


def water_reward(completions, **kwargs):  # None (unscored) for completions without "tea"
    return [0.5 * c.count("water") if "tea" in c else None for c in completions]


def _inputs():
    return [{"prompt": p} for p in ("take aspirin", "drink tea") for _ in range(G)]


def test_trl_completion_logs_are_read_and_say_how_to_get_logprobs(tmp_path, monkeypatch, capsys):
    """TRL's log_completions parquet (and the same table TRL logs to wandb), from a real GRPOTrainer run."""
    import wandb

    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(k, v)
    tok = tiny_tokenizer()
    tr = GRPOTrainer(model=tiny_model(), reward_funcs=[length_reward, water_reward], train_dataset=_dataset(),
                     args=_args(tmp_path, log_completions=True, report_to="wandb"), processing_class=tok,
                     rollout_func=make_rollout_func(tok))
    try:
        tr.train()
    finally:
        wandb.finish()
    logs = tmp_path / "out" / "completions"
    frames = [pd.read_parquet(f) for f in sorted(logs.glob("*.parquet"))]
    assert len(frames) == 2 and list(frames[0].columns) == ["step", "prompt", "completion", "length_reward",
                                                             "water_reward", "advantage"]
    assert frames[0]["water_reward"].isna().any()  # TRL logs an unscored completion as NaN
    d = read_dump(logs)
    assert d.formats == ["TRL log_completions"] * 2 and len(d) == 16
    want = pd.concat(frames)
    assert np.allclose(d.reward, want["length_reward"] + want["water_reward"].fillna(0.0))  # TRL's nansum, weight 1
    assert d.texts["response"] == want["completion"].tolist()
    assert np.array_equal(d.scalars["response_length"], want["completion"].str.len().to_numpy(dtype=float))
    assert [d.group_labels[g] for g in d.group] == want["prompt"].tolist()
    res = {r.id: r for r in run_checks(d)}
    assert res["baseline.degenerate_groups"].status != "skipped"
    assert res["baseline.degenerate_groups"].details["groups"] == 4  # (step, prompt)
    for cid in MISMATCH:
        assert res[cid].status == "skipped"
        assert "TRL's completion logs (log_completions) hold no log-probs: dump the rollouts with " \
               "creditlab.integrations.trl.CreditlabGRPOTrainer(dump=...)" in res[cid].message
    out = diagnose([logs], tmp_path / "diag")
    assert out.exit_code == 0 and out.trainer_metrics is None
    js = json.loads((tmp_path / "diag" / "diagnose.json").read_text())
    assert js["input"]["formats"] == ["TRL log_completions"] and js["trainer_metrics"] is None

    # the tables TRL logged to wandb hold the same rows: one line pointing to the parquet files and the dump
    tables = sorted(tmp_path.glob("wandb/*/files/media/table/*.table.json"))
    assert tables, "TRL logged no completions table to wandb"
    rows = json.loads(tables[0].read_text())
    assert rows["columns"] == list(frames[0].columns)
    for path in (tables[0], tables[0].parent):
        with pytest.raises(InputError, match=r"TRL's logged completions table.*output_dir/completions/\*\.parquet.*"
                                             r"CreditlabGRPOTrainer\(dump=\.\.\.\)") as err:
            read_dump(path)
        assert "\n" not in str(err.value)


def test_a_nan_engine_logprob_is_its_own_finding(tmp_path, caplog):
    """The engine reports no log-prob for one policy token (vLLM's None): TRL reads it as NaN and keeps it;
    diagnose reports it as mismatch.nonfinite_logprobs, not as a placeholder, and the live check warns."""
    tok = tiny_tokenizer()
    rf = make_rollout_func(tok, missing=(2, 6))  # token 6: the second turn's second token (a policy token)
    dump = tmp_path / "dump.jsonl"
    tr = CreditlabGRPOTrainer(model=tiny_model(), reward_funcs=length_reward, args=_args(tmp_path, max_steps=1),
                              train_dataset=_dataset(), processing_class=tok, rollout_func=rf, correction="interq",
                              dump=dump)
    with caplog.at_level(logging.WARNING, logger="creditlab.integrations"):
        tr.train()
    assert_engine_differs(rf)
    d = read_dump(dump)
    a = d.tokens.offsets[2]
    assert np.isnan(d.tokens.rollout_logprobs[a + 6]) and d.tokens.policy_mask[a + 6]  # kept by TRL, as NaN
    res = {r.id: r for r in run_checks(d)}
    nf = res["mismatch.nonfinite_logprobs"]
    P = int(d.tokens.policy_mask.sum())
    assert nf.details["rollout_logprobs"] == 1 and nf.details["logprobs"] == 0
    assert nf.value == pytest.approx(1 / P) and nf.status == "fail"  # 1 of 48 tokens: above the fail share 1e-3
    assert "line 3, token 6" in nf.message and "the engine could not score" in nf.message
    ph = res["mismatch.placeholder_logprobs"]
    assert ph.status == "ok" and "1 NaN/inf log-probs are reported by mismatch.nonfinite_logprobs" in ph.message
    assert "NaN/inf log-prob (mismatch.nonfinite_logprobs) left out" in res["mismatch.k3"].message
    logged = [h for h in tr.state.log_history if "creditlab/mismatch/nonfinite_logprobs" in h]
    assert logged and logged[0]["creditlab/mismatch/nonfinite_logprobs"] == pytest.approx(1 / P)
    lines = [r.getMessage() for r in caplog.records if "mismatch.nonfinite_logprobs" in r.getMessage()]
    assert len(lines) == 1 and "crossed its warn threshold" in lines[0]


@pytest.mark.parametrize("mode, clip", [("sequence_mask", (None, 3.0)), ("token_truncate", (0.9, 1.1))])
def test_trainer_metrics_equal_trls_own_sampling_metrics(tmp_path, mode, clip):
    """TRL's vLLM importance-sampling path (switched on on the trainer object: TRL's own code computes the
    learner's log-probs, the ratio and ``sampling/*``) against the dump of the same batches."""
    tok = tiny_tokenizer()
    rf = make_rollout_func(tok)
    dump = tmp_path / "dump.jsonl"
    tr = CreditlabGRPOTrainer(model=tiny_model(), reward_funcs=length_reward, args=_args(tmp_path),
                              train_dataset=_dataset(), processing_class=tok, rollout_func=rf, correction=None,
                              dump=dump)
    tr.use_vllm = tr.vllm_importance_sampling_correction = True  # vLLM's path minus the server
    tr.vllm_importance_sampling_mode = mode
    tr.vllm_importance_sampling_clip_min, tr.vllm_importance_sampling_clip_max = clip
    for step in range(2):
        tr.state.global_step = tr._last_loaded_step = step  # weights "synced"
        torch.manual_seed(step)
        tr._generate_and_score_completions(_inputs())
    assert_engine_differs(rf)
    d = read_dump(dump)
    t = d.tokens
    rows = np.repeat(np.arange(len(d)), t.lengths)
    ours = trl_sampling_metrics(t.logprobs, t.rollout_logprobs, t.policy_mask, rows, d.step, 2, mode=mode,
                                clip_min=clip[0], clip_max=clip[1])
    for name, values in ours.items():
        assert values.tolist() == pytest.approx(tr._metrics["train"][name], rel=1e-5), name
    assert 0 < ours["sampling/sampling_logp_difference/mean"].min()
    if mode == "token_truncate":  # the clip binds: TRL's truncation is part of what is compared
        assert ours["sampling/importance_sampling_ratio/max"].max() == pytest.approx(clip[1])
    if mode == "sequence_mask":  # TRL's default mode: what diagnose.json reports
        js = diagnose([dump], tmp_path / "diag").trainer_metrics
        for name, values in ours.items():
            assert js["trl"][name]["by_step"] == pytest.approx(values.tolist(), rel=1e-12), name
        assert js["creditlab"]["mismatch/k3"]["all"] > 1e-3


# -- the dumped groups are TRL's groups, under every setting of its batch arithmetic ------------------

PROMPTS = ["take aspirin", "drink tea", "take water", "drink honey", "rest sleep", "lemon honey", "fever cough",
           "take lemon tea"]  # "take lemon tea": prompts of different lengths are fine here


def _echo_rollout_func(tokenizer):
    """A ``rollout_func`` whose completion repeats the prompt (then EOS): the response text names the prompt.
    Each call's prompts (TRL's generation batch, in its order) are kept in ``calls``."""
    def rollout_func(prompts, trainer):
        rollout_func.calls.append(list(prompts))
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        completion_ids = [ids + [tokenizer.eos_token_id] for ids in prompt_ids]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
                "logprobs": [[-0.5] * len(c) for c in completion_ids]}

    rollout_func.calls = []
    return rollout_func


def prompt_reward(prompts, completions, **kwargs):  # one value per prompt: every TRL group is degenerate
    return [float(PROMPTS.index(p)) for p in prompts]


# (per_device_train_batch_size, num_generations, the rest of TRL's batch arithmetic)
GROUPINGS = {
    "2 generations per step": (4, 4, dict(gradient_accumulation_steps=2, steps_per_generation=1)),
    "one generation per step": (8, 4, {}),
    "a group over 2 micro-batches": (2, 4, dict(gradient_accumulation_steps=2)),
    "3 generations per step, 2 groups each": (4, 2, dict(gradient_accumulation_steps=3, steps_per_generation=1)),
    "one generation for 4 steps": (2, 4, dict(generation_batch_size=8, max_steps=4)),
    "2 generations per step of 2 micro-batches": (4, 4, dict(gradient_accumulation_steps=4, steps_per_generation=2)),
    "batches reused (num_iterations 2)": (4, 2, dict(gradient_accumulation_steps=2, steps_per_generation=1,
                                                     num_iterations=2)),
}


@pytest.mark.parametrize("name", list(GROUPINGS))
def test_dumped_groups_are_trls_groups(tmp_path, name):
    """TRL forms its groups (the advantage baseline) from ``num_generations`` consecutive completions of each
    generation batch; with several generation batches at one global step (``steps_per_generation`` <
    ``gradient_accumulation_steps``) the dump used to give each batch's groups the same numbers, merging two
    prompts into one (step, group): ``baseline.degenerate_groups`` read 0.0 where every group is degenerate."""
    bs, G, rest = GROUPINGS[name]
    tok = tiny_tokenizer()
    rf = _echo_rollout_func(tok)
    dump = tmp_path / "dump.jsonl"
    tr = CreditlabGRPOTrainer(model=tiny_model(), reward_funcs=prompt_reward, processing_class=tok,
                              args=_args(tmp_path, **{"per_device_train_batch_size": bs, "num_generations": G, **rest}),
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}), rollout_func=rf, correction=None,
                              dump=dump)
    tr.train()
    d = read_dump(dump)
    prompts = [p for call in rf.calls for p in call]  # TRL's generation batches, in the dump's order
    assert len(d) == len(prompts) and d.texts["response"] == prompts  # the response repeats the prompt
    # TRL's grouping: blocks of G consecutive completions of each generation batch
    want, start = set(), 0
    for call in rf.calls:
        assert len(call) % G == 0
        want |= {frozenset(range(start + k, start + k + G)) for k in range(0, len(call), G)}
        start += len(call)
    got: dict[tuple, set] = {}
    for i, (step, g) in enumerate(zip(d.step.tolist(), d.group.tolist(), strict=True)):
        got.setdefault((step, d.group_labels[g]), set()).add(i)
    assert {frozenset(rows) for rows in got.values()} == want
    assert all(len(rows) == G and len({prompts[i] for i in rows}) == 1 for rows in got.values())
    several = len(rf.calls) > len(set(d.step.tolist()))  # generation batches sharing a step: what it was about
    assert several == name[0].isdigit(), name  # "N generations per step" cases, and only them
    res = {r.id: r for r in run_checks(d)}["baseline.degenerate_groups"]
    assert res.value == 1.0 and res.details["groups"] == len(want)
