"""``CreditlabGRPOTrainer`` and the FORK reward function inside the real GRPOTrainer of TRL (1.16.0 here;
1.15.0 in test_trl_versions.py), on a tiny
random Llama built from a config, with a multi-turn rollout whose engine runs fake-quantized weights."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from datasets import Dataset
from integration_helpers import assert_engine_differs, doc_block, make_rollout_func, tiny_model, tiny_tokenizer
from trl import GRPOConfig, GRPOTrainer

from creditlab.core.advantages import prm_mixed_advantages
from creditlab.core.correction import interq_weights
from creditlab.errors import ConfigError, InputError
from creditlab.integrations._common import turn_layout
from creditlab.integrations.trl import CreditlabGRPOTrainer, fork_reward
from creditlab.judge.testing import ChatServer

RUBRICS = [{"criterion": "aspirin water", "points": 2}, {"criterion": "rest", "points": 1}]
G = 4


def _dataset(n=2):
    return Dataset.from_dict({"prompt": ["take aspirin", "drink tea"][:n] * 1, "rubrics": [RUBRICS] * n})


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=G, max_steps=2,
                learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                max_completion_length=16, disable_tqdm=True, seed=0)
    return GRPOConfig(**{**base, **kw})


def _length_reward(completions, **kwargs):
    return [float(len(c.split()) % 3) for c in completions]


def _inputs(n=2):
    rows = list(_dataset(n))
    return [dict(r) for r in rows for _ in range(G)]


def test_outputs_are_core_weights_and_prm_credit_and_tool_tokens_never_matter(tmp_path):
    tok = tiny_tokenizer()
    rf = make_rollout_func(tok)
    tr = CreditlabGRPOTrainer(model=tiny_model(), reward_funcs=_length_reward, args=_args(tmp_path),
                              train_dataset=_dataset(), processing_class=tok, rollout_func=rf,
                              correction="interq", correction_params={"alpha_g": 0.6}, credit="prm",
                              credit_settings={"prm_lambda": 0.5})
    torch.manual_seed(0)
    base = GRPOTrainer._generate_and_score_completions(tr, _inputs())  # TRL's own output
    torch.manual_seed(0)
    out = tr._generate_and_score_completions(_inputs())
    assert_engine_differs(rf)  # the fp8 engine differs from the learner scored the same way
    pm = (out["completion_mask"] * out["tool_mask"]).bool()
    assert bool((~pm & out["completion_mask"].bool()).any())  # there are tool tokens
    # old log-probs: the learner's, recomputed independently
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    with torch.no_grad():
        old, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, att, out["completion_ids"].size(1))
    torch.testing.assert_close(out["old_per_token_logps"], old)
    rollout = out["sampling_per_token_logps"]
    assert float((old - rollout)[pm].abs().mean()) > 1e-3  # the fp8 engine really differs from the learner
    w, _ = interq_weights(old, rollout, pm, alpha_g=0.6)
    lay = turn_layout(pm)
    scores = torch.zeros(lay.step_mask.shape, dtype=torch.float64)
    inputs = _inputs()
    turn_scores = make_rollout_func(tok)([r["prompt"] for r in inputs], tr)["turn_scores"]  # deterministic
    for i, row in enumerate(turn_scores):
        scores[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
    group = torch.arange(len(inputs)) // G
    a_turn = base["advantages"].double()[:, None] + prm_mixed_advantages(
        torch.zeros(len(inputs), dtype=torch.float64), scores, lay.step_mask, group, 0.5)
    expected = lay.to_tokens(torch.where(lay.step_mask, a_turn, 0.0)) * w
    assert bool((scores > 0).any()) and bool((scores == 0).any())
    torch.testing.assert_close(out["advantages"].double(), expected, rtol=1e-5, atol=1e-6)
    # the live check values (K3 among them) wait on the device for TRL's next log; the arm's metrics are floats
    assert "creditlab/mismatch/k3" in tr._creditlab_live["train"]
    assert "creditlab/correction/alpha_q50" in tr._metrics["train"]

    # the log-probs reported for tool tokens (0.0 here) are junk to us: any other value changes nothing
    tr.rollout_func = make_rollout_func(tok, tool_logprob=-37.5)
    torch.manual_seed(0)
    junk = tr._generate_and_score_completions(_inputs())
    torch.testing.assert_close(junk["advantages"], out["advantages"], rtol=0, atol=0)


def test_a_few_grpo_steps_with_fork_reward_and_interq_weights(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    with ChatServer() as srv:
        fork = fork_reward("openai", base_url=srv.url, model="judge", max_retries=0)
        rf = make_rollout_func(tok)
        tr = CreditlabGRPOTrainer(model=model, reward_funcs=[fork], args=_args(tmp_path, max_steps=3),
                                  train_dataset=_dataset(), processing_class=tok, rollout_func=rf,
                                  correction="interq", credit="per_turn")
        tr.train()
        assert srv.stats["requests"] > 0
    assert_engine_differs(rf)
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(math.isfinite(h["loss"]) for h in logs)
    assert all(h["creditlab/mismatch/k3"] > 0 for h in logs)
    assert all("reward/fork/precision" in h and "rewards/fork/mean" in h for h in logs)
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters(), strict=True))


def test_fork_reward_is_batched_and_gives_none_on_judge_failure():
    logged = {}
    with ChatServer() as srv:
        fork = fork_reward("openai", base_url=srv.url, model="judge-fail", max_retries=0, name="fork")
        prompts = ["How do I treat a headache?"] * 3
        completions = ["take aspirin with water . rest .", "drink tea .", "rest ."]
        srv.push_faults(["500"])
        out = asyncio.run(fork(prompts, completions, rubrics=[RUBRICS] * 3,
                               log_metric=lambda k, v: logged.setdefault(k, v)))
    assert sum(r is None for r in out) == 1 and all(r is None or 0 <= r <= 1 for r in out)
    assert logged["reward/fork/failures"] == pytest.approx(1 / 3)
    with pytest.raises(InputError, match="rubrics"):
        asyncio.run(fork(prompts, completions))


def test_configuration_errors(tmp_path):
    tok = tiny_tokenizer()
    common = dict(model=tiny_model(), reward_funcs=_length_reward, train_dataset=_dataset(), processing_class=tok)
    with pytest.raises(ConfigError, match="correction: unknown 'interq2'"):
        CreditlabGRPOTrainer(args=_args(tmp_path), correction="interq2", **common)
    with pytest.raises(ConfigError, match="correction_params"):
        CreditlabGRPOTrainer(args=_args(tmp_path), correction_params={"alpha": 1}, **common)
    with pytest.raises(ConfigError, match="credit_settings: unknown key"):
        CreditlabGRPOTrainer(args=_args(tmp_path), credit="prm", credit_settings={"lam": 1}, **common)
    # TRL's plain generation gives no engine log-probs: the correction (interq by default) is refused when
    # the trainer is built, not at its first step
    for given in ({}, {"correction": "tis"}):
        with pytest.raises(ConfigError, match=r"^correction: '(interq|tis)' needs the rollout engine's log-probs.*"
                                              r"use_vllm=True.*rollout_func.*correction=None$") as err:
            CreditlabGRPOTrainer(args=_args(tmp_path), **given, **common)
        assert "\n" not in str(err.value)
    assert CreditlabGRPOTrainer(args=_args(tmp_path), correction=None, **common).creditlab_correction is None
    tok = common["processing_class"]
    tr = CreditlabGRPOTrainer(args=_args(tmp_path), rollout_func=make_rollout_func(tok), **common)
    assert tr.creditlab_correction == "interq"
    tr.rollout_func = None  # taken away after the check: the first step still says what is missing
    with pytest.raises(ConfigError, match="rollout engine's log-probs"):
        tr._generate_and_score_completions(_inputs(1))


@pytest.mark.slow
def test_trl_doc_block_runs(tmp_path, monkeypatch):
    import functools

    import trl

    monkeypatch.chdir(tmp_path)
    # the documented config is a GPU config (TRL defaults to bf16): run it on CPU, for two steps
    monkeypatch.setattr(trl, "GRPOConfig", functools.partial(GRPOConfig, use_cpu=True, bf16=False, max_steps=2,
                                                             disable_tqdm=True))
    tok = tiny_tokenizer()
    with ChatServer() as srv:
        ns = {"JUDGE_URL": srv.url, "model": tiny_model(), "tokenizer": tok, "dataset": _dataset(),
              "rollout_func": make_rollout_func(tok)}
        exec(compile(doc_block("trl-trainer"), "docs/integrations.md:trl-trainer", "exec"), ns)
    tr = ns["trainer"]
    assert_engine_differs(ns["rollout_func"])
    assert tr.state.global_step >= 1
    assert any("creditlab/mismatch/k3" in h for h in tr.state.log_history)


def test_untested_trl_version_is_refused_unless_allowed(tmp_path, monkeypatch):
    import trl

    from creditlab.errors import CreditlabError
    from creditlab.integrations.trl import check_version

    monkeypatch.setattr(trl, "__version__", "9.9.9")
    monkeypatch.delenv("CREDITLAB_ALLOW_UNTESTED_TRL", raising=False)
    with pytest.raises(CreditlabError,
                       match="tested with TRL 1.15.0, 1.16.0, found 9.9.9.*CREDITLAB_ALLOW_UNTESTED_TRL=1"):
        CreditlabGRPOTrainer(model=tiny_model(), reward_funcs=_length_reward, args=_args(tmp_path),
                             train_dataset=_dataset(), processing_class=tiny_tokenizer())
    monkeypatch.setenv("CREDITLAB_ALLOW_UNTESTED_TRL", "1")
    check_version()  # allowed now
    tok = tiny_tokenizer()
    tr = CreditlabGRPOTrainer(model=tiny_model(), reward_funcs=_length_reward, args=_args(tmp_path),
                              train_dataset=_dataset(), processing_class=tok, rollout_func=make_rollout_func(tok))
    assert tr.creditlab_correction == "interq"


def test_credit_values_come_from_the_geometry_registry(tmp_path):
    import creditlab.integrations.trl as ct
    from creditlab.core import credit

    assert set(ct.CREDITS) == {"uniform", "per_turn", "concentrated", "shuffled", "prm", "random_k", "targeted"}
    common = dict(model=tiny_model(), reward_funcs=_length_reward, train_dataset=_dataset(),
                  processing_class=tiny_tokenizer())
    for name in ("binary", "reward_to_go"):
        with pytest.raises(ConfigError, match=f"credit: '{name}' needs .*TRL passes its outcome advantages"):
            CreditlabGRPOTrainer(args=_args(tmp_path), credit=name, **common)
    with pytest.raises(ConfigError, match="credit: unknown 'bogus'; valid: uniform, per_turn, concentrated, "
                                          "shuffled, prm, random_k, targeted or None"):
        CreditlabGRPOTrainer(args=_args(tmp_path), credit="bogus", **common)

    def doubled(batch, *, conserve=True):
        return 2 * credit.uniform(batch.advantages, batch.step_mask, conserve=conserve)

    with credit.registered_geometry("doubled_test", doubled):
        assert "doubled_test" in ct.CREDITS
        tok = tiny_tokenizer()
        tr = CreditlabGRPOTrainer(args=_args(tmp_path), model=tiny_model(), reward_funcs=_length_reward,
                                  train_dataset=_dataset(), processing_class=tok, rollout_func=make_rollout_func(tok),
                                  correction=None, credit="doubled_test")
        torch.manual_seed(0)
        base = GRPOTrainer._generate_and_score_completions(tr, _inputs())
        torch.manual_seed(0)
        out = tr._generate_and_score_completions(_inputs())
        pm = (out["completion_mask"] * out["tool_mask"]).bool()
        expected = torch.where(pm, 2 * base["advantages"][:, None], torch.zeros_like(out["advantages"]))
        torch.testing.assert_close(out["advantages"], expected)
    assert "doubled_test" not in ct.CREDITS
