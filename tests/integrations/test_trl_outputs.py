"""What ``CreditlabGRPOTrainer`` refuses when it is built: a ``credit`` TRL cannot use (the error lists only the
values that TRL's own loss then takes, each run here through TRL's loss), and a ``dump`` path its first
training step would fail on or that would replace a file it did not write."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from integration_helpers import make_rollout_func, tiny_model, tiny_tokenizer  # noqa: E402
from trl import GRPOConfig  # noqa: E402

import creditlab.integrations.trl as ct  # noqa: E402
from creditlab.errors import ConfigError  # noqa: E402
from creditlab.integrations.trl import CreditlabGRPOTrainer  # noqa: E402

G = 4


def _args(tmp_path):
    return GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=G, max_steps=1,
                      learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                      max_completion_length=16, disable_tqdm=True, seed=0)


def _reward(completions, **kwargs):
    return [float(len(c.split()) % 3) for c in completions]


def _dataset():
    return Dataset.from_dict({"prompt": ["take aspirin", "drink tea"]})


def test_the_credit_error_lists_only_what_trls_loss_takes(tmp_path):
    with pytest.raises(ConfigError) as err:
        CreditlabGRPOTrainer(model=None, credit="bogus")  # refused before TRL builds anything
    listed = str(err.value).split("valid: ", 1)[1].removesuffix(" or None").split(", ")
    assert str(err.value).startswith("credit: unknown 'bogus'")
    assert listed == list(ct.CREDITS) and not {"binary", "discretized", "reward_to_go"} & set(listed)
    with pytest.raises(ConfigError, match=r"credit: 'binary' needs \['rewards'\].*valid: uniform, per_turn"):
        CreditlabGRPOTrainer(model=None, credit="binary")
    # every value listed goes through TRL's own loss and backward pass (the installed TRL's, 1.15.0 or 1.16.0)
    tok = tiny_tokenizer()
    tr = CreditlabGRPOTrainer(model=tiny_model(), reward_funcs=_reward, args=_args(tmp_path), train_dataset=_dataset(),
                              processing_class=tok, rollout_func=make_rollout_func(tok), correction=None,
                              credit="uniform", live_checks=False)
    tr.model.train()
    tr.current_gradient_accumulation_steps = tr.args.gradient_accumulation_steps  # what TRL's training loop sets
    inputs = [dict(r) for r in _dataset() for _ in range(G)]
    for name in listed:
        tr.creditlab_credit = name
        out = tr._generate_and_score_completions(inputs)
        assert out["advantages"].shape == out["completion_mask"].shape, name  # per-token advantages
        loss = tr.compute_loss(tr.model, out)
        loss.backward()
        grads = [p.grad for p in tr.model.parameters() if p.grad is not None]
        assert math.isfinite(float(loss.detach())) and grads and all(bool(g.isfinite().all()) for g in grads), name
        tr.model.zero_grad()


def test_a_dump_the_first_step_would_fail_on_is_refused_when_the_trainer_is_built(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    foreign = tmp_path / "results.jsonl"
    foreign.write_text('{"id": 1, "score": 0.5}\n')
    cases = [(notes, "is a file but not a dump file"), (tmp_path / "dump.json", "names neither a dump file"),
             (foreign, "is not a rollout dump")]
    for path, match in cases:
        with pytest.raises(ConfigError, match=f"dump: {path}.*{match}"):
            CreditlabGRPOTrainer(model=None, dump=str(path))
    assert notes.read_text() == "my notes\n" and foreign.read_text() == '{"id": 1, "score": 0.5}\n'
    assert not (tmp_path / "dump.json").exists()
