"""The dual-clip protocol of the mismatch lab: the trainer's new knobs, the planted and exact engines, the
evaluation beside the engine's, and the rules that judge the protocol's predictions.

``GRPOConfig.clip_ratio_c`` (verl's dual clip, 3 by default) reaches the loss of both trainers;
``GRPOConfig.correction`` takes an arm with parameters; a field added after runs were stored reads its
absence as the value those runs had. The planted engine reports exactly ``log_softmax(logits + s (k + 1) z)``
of the learner's own logits (so ``mu`` is known), does nothing at strength 0 and acts per model in a stack;
the exact engine samples from the learner's quantized distribution. The verdicts are pure functions of
hand-made tables, and the new experiments run end to end at quick size.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch

from creditlab.envs.toolshop import SPECIALS, THOUGHT0, VOCAB, VOCAB_WITH_THOUGHTS
from creditlab.errors import ConfigError
from creditlab.lab.experiment import Verdict
from creditlab.lab.protocol import Table, run_lab
from creditlab.labs.mismatch import LAB, MismatchConfig
from creditlab.models.tiny_lm import StackedTinyLM, TinyLM, TinyLMConfig
from creditlab.train.toolshop_base import BaseConfig
from creditlab.train.toolshop_grpo import GRPOConfig, train_grpo, train_grpo_stacked
from creditlab.train.toolshop_rollout import (
    make_tasks,
    planted_direction,
    rollout,
    rollout_stacked,
    sequence_logprobs,
    stacked_logprobs,
)

TINY_BASE = BaseConfig(n_demos=64, steps=30, batch_size=16, d_model=32, n_layer=1, max_len=96, chain_lengths=(2, 3))
TINY_GRPO = GRPOConfig(updates=1, tasks_per_update=2, group_size=2, chain_lengths=(2, 3), max_len=48, eval_every=1,
                       eval_tasks=6)
#: The held-out keys of an evaluation point, as the trainer wrote them before the dual-clip protocol.
EVAL_KEYS = ("success", "progress", "truncated", "n_calls", "interaction_cost", "cap_exhaustion")

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int = 0, vocab: int = len(VOCAB_WITH_THOUGHTS), max_len: int = 96) -> TinyLM:
    """A tiny random TinyLM over the toolshop vocabulary (thoughts included), moved off its init so that its
    distributions are far from uniform and quantization matters."""
    m = TinyLM(TinyLMConfig(vocab_size=vocab, d_model=32, n_head=4, max_len=max_len),
               generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + seed)))
    return m.eval()


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _planted_logprobs(logits: torch.Tensor, tokens: torch.Tensor, turns: torch.Tensor, pm: torch.Tensor,
                      strength: float) -> tuple[torch.Tensor, torch.Tensor]:
    """At every policy token ``(b, t)`` of turn ``k``: ``log_softmax(logits[b, t - 1] + s (k + 1) z)`` of its
    token, the planted engine's log-prob computed from the learner's full-forward ``logits`` ``(B, L, V)``;
    and the unshifted one."""
    b, t = torch.nonzero(pm, as_tuple=True)
    z = planted_direction(logits.size(-1))
    x = logits[b, t - 1].double()
    shifted = x + strength * (turns[b, t].double() + 1)[:, None] * z.double()
    tok = tokens[b, t][:, None]
    return (torch.log_softmax(shifted, -1).gather(1, tok).squeeze(1),
            torch.log_softmax(x, -1).gather(1, tok).squeeze(1))


# ---------------------------------------------------------------------------------------------
# the config


def test_grpo_config_dual_clip_correction_spec_and_plant():
    """clip_ratio_c is verl's 3 by default and None turns it off; a value <= 1 would clip every negative
    advantage below the PPO clip. correction takes ``arm[:k=v,...]``; plant is a finite strength >= 0. Each
    error names its field."""
    assert GRPOConfig().clip_ratio_c == 3.0 and GRPOConfig().plant == 0.0
    assert GRPOConfig(clip_ratio_c=None).clip_ratio_c is None and GRPOConfig(clip_ratio_c=1.5).clip_ratio_c == 1.5
    for bad in (1.0, 0.5, 0.0, -3.0, math.nan):
        with pytest.raises(ConfigError, match="clip_ratio_c") as exc:
            GRPOConfig(clip_ratio_c=bad)
        assert exc.value.parameter == "clip_ratio_c"
    for spec in ("tis", "tis:cap=3", "mis:lo=0.36787944117144233,hi=inf", "interq_tis:cap=3,alpha_g=0.4",
                 "prefix:eps_low=1e6,eps_high=1e6"):
        assert GRPOConfig(correction=spec).correction == spec
    for bad in ("magic", "tis:nope=1", "tis:cap=abc", "tis:cap", "mis:lo=2,hi=1"):
        with pytest.raises(ConfigError) as exc:
            GRPOConfig(correction=bad)
        assert exc.value.parameter.split(":")[0] == "correction", bad  # "correction:cap" for a value
    assert GRPOConfig(plant=0.4).plant == 0.4
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ConfigError) as exc:
            GRPOConfig(plant=bad)
        assert exc.value.parameter == "plant"


def test_a_field_added_after_stored_runs_reads_its_absence_as_their_value():
    """``to_dict`` leaves out a field at its ``absent`` value and writes it at any other; ``from_dict`` reads a
    missing one as ``absent`` (what the stored runs had), not as the field's default: a config stored without
    clip_ratio_c had no dual clip, one without eval_on scored on the fp32 engine."""
    cfg = MismatchConfig()
    d = cfg.to_dict()
    assert d["grpo"]["clip_ratio_c"] == 3.0 and d["eval_on"] == "engine" and "plant" not in d["grpo"]
    assert MismatchConfig.from_dict(d) == cfg
    stored = copy.deepcopy(d)
    del stored["grpo"]["clip_ratio_c"], stored["eval_on"]
    old = MismatchConfig.from_dict(stored)
    assert old.grpo.clip_ratio_c is None and old.eval_on == "fp32" and old.grpo.plant == 0.0
    assert old == replace(cfg, grpo=replace(cfg.grpo, clip_ratio_c=None), eval_on="fp32")
    assert old.to_dict() == stored  # and written back without them
    planted = replace(cfg, grpo=replace(cfg.grpo, plant=0.2, clip_ratio_c=None), eval_on="fp32")
    p = planted.to_dict()
    assert p["grpo"]["plant"] == 0.2 and "clip_ratio_c" not in p["grpo"] and "eval_on" not in p
    assert MismatchConfig.from_dict(p) == planted
    with pytest.raises(ConfigError, match="eval_on"):
        replace(cfg, eval_on="bf16").validate()


def test_the_dual_clip_protocol_config_and_its_cells():
    """``--protocol dual-clip``: the 2-core world and budget with clip_ratio_c = 3 and success scored on the
    engine; one dose cell, 8 seeds of the five-arm MXFP4 ablation, a gate and 4 seeds per planted world, one
    per-token sample at MXFP4 and the estimator's cells."""
    c = MismatchConfig.dual_clip()
    c.validate()
    two = MismatchConfig.two_core()
    assert c.protocol == "dual-clip" and c.grpo == replace(two.grpo, clip_ratio_c=3.0) and c.base == two.base
    assert c.eval_on == "engine" and c.seeds == 8
    cells = LAB.cells(c)
    by = {}
    for x in cells:
        by.setdefault(x.group, []).append(x)
    assert [x.name for x in by["dose"]] == ["base"]
    arms = ["qat", "qat_tis", "qat_interq", "qat_mis_low", "qat_interq_tis"]
    assert [(x.kwargs["dose"], x.kwargs["seeds"], x.kwargs["arms"]) for x in by["train"]] == [
        ("mxfp4", [s], arms) for s in range(8)]
    assert sorted(x.name for x in by["planted_gate"]) == ["thought_free", "thoughts"]
    assert sorted(x.name for x in by["planted"]) == [f"{w}/seed={s}" for w in ("thought_free", "thoughts")
                                                     for s in range(4)]
    assert [(x.kwargs["dose"], x.kwargs["arms"]) for x in by["sample"]] == [("mxfp4", arms)]
    assert len(by["estimator"]) >= 1
    assert set(by) == {"dose", "train", "planted_gate", "planted", "sample", "estimator"}
    assert len({x.key for x in cells}) == len(cells)


# ---------------------------------------------------------------------------------------------
# the dual clip in the loss and in both trainers


def test_the_dual_clip_caps_a_negative_advantage_token_loss():
    """A = -1 and r = 5: the PPO token loss max(-A r, -A clip(r)) is 5; the dual clip caps it at -A * 3 = 3.
    A positive advantage, or a ratio under the cap, is unchanged."""
    from creditlab.core.losses import policy_loss

    pm = torch.ones(1, 1, dtype=torch.bool)
    old = torch.zeros(1, 1)
    lp = torch.full((1, 1), math.log(5.0))
    off, _ = policy_loss(lp, old, torch.tensor([-1.0]), pm, clip_ratio_c=None)
    on, _ = policy_loss(lp, old, torch.tensor([-1.0]), pm, clip_ratio_c=3.0)
    assert float(off) == pytest.approx(5.0) and float(on) == pytest.approx(3.0)
    for adv, r in ((1.0, 5.0), (-1.0, 2.0)):
        lp = torch.full((1, 1), math.log(r))
        a, _ = policy_loss(lp, old, torch.tensor([adv]), pm, clip_ratio_c=None)
        b, _ = policy_loss(lp, old, torch.tensor([adv]), pm, clip_ratio_c=3.0)
        assert float(a) == float(b)


@pytest.fixture
def loss_calls(monkeypatch):
    """The ``clip_ratio_c`` of every :func:`creditlab.core.losses.policy_loss` call (the trainers import it
    at call time), the real loss computed."""
    import creditlab.core.losses as losses

    real, seen = losses.policy_loss, []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("clip_ratio_c", "not passed"))
        return real(*args, **kwargs)

    monkeypatch.setattr(losses, "policy_loss", spy)
    return seen


@pytest.mark.parametrize("clip", [3.0, None, 1.5])
def test_both_trainers_pass_clip_ratio_c_to_the_loss(tiny_base, loss_calls, clip):
    cfg = replace(TINY_GRPO, clip_ratio_c=clip, eval_every=0)
    train_grpo(copy.deepcopy(tiny_base), cfg)
    single = list(loss_calls)
    loss_calls.clear()
    train_grpo_stacked(StackedTinyLM([tiny_base] * 2), [cfg, replace(cfg, correction="tis:cap=3")])
    assert single and loss_calls
    assert set(single) == {clip} and set(loss_calls) == {clip}


# ---------------------------------------------------------------------------------------------
# the planted engine


def test_planted_direction_is_fixed_and_lives_on_the_tool_call_tokens():
    V = len(VOCAB_WITH_THOUGHTS)
    z = planted_direction(V)
    assert z.shape == (V,) and z.dtype == torch.float32
    assert torch.equal(z, planted_direction(V))  # deterministic, no global seed involved
    torch.manual_seed(123)
    assert torch.equal(z, planted_direction(V))
    assert (z[:len(SPECIALS)] == 0).all() and (z[THOUGHT0:] == 0).all()
    calls = z[len(SPECIALS):THOUGHT0].double()
    assert (calls != 0).all() and calls.numel() == THOUGHT0 - len(SPECIALS)
    assert abs(float(calls.mean())) < 0.3 and 0.8 < float(calls.std()) < 1.2  # standard normal, 169 draws
    small = planted_direction(len(VOCAB))  # a policy without thoughts: zero on the specials only
    assert (small[:len(SPECIALS)] == 0).all() and (small[len(SPECIALS):] != 0).all()


@pytest.mark.parametrize("strength", [0.2, 0.5])
def test_the_planted_engine_reports_the_shifted_distribution_of_the_learner(strength):
    """At a sampled token of turn k the reported log-prob is log_softmax(logits + s (k + 1) z) of the learner's
    full-forward fp32 logits at that position (several turns, so the (k + 1) factor is tested), and far from
    the unshifted one; forced positions report nothing."""
    m = _model()
    tasks = make_tasks(range(8), (2, 3))
    b = rollout(m, tasks, precision="fp32", max_len=96, max_action_len=6, generator=torch.Generator().manual_seed(0),
                plant=strength)
    pm = b.policy_mask
    assert int(b.turn_ids[pm].max()) >= 2
    with torch.no_grad():
        logits = m(b.tokens, "fp32").float()
    want, unshifted = _planted_logprobs(logits, b.tokens, b.turn_ids, pm, strength)
    got = b.rollout_logprobs[pm].double()
    assert torch.allclose(got, want, atol=1e-4, rtol=0), float((got - want).abs().max())
    assert float((got - unshifted).abs().mean()) > 0.1  # the shift is really there
    assert (b.rollout_logprobs[~pm] == 0).all()
    # the environment saw the planted engine's tokens: the calls are the sampled tokens (forced ones in between)
    from creditlab.envs.toolshop import EOA

    for toks, mask, recs in zip(b.tokens, pm, b.records, strict=True):
        acts = [t for r in recs for t in r.action]
        assert [int(t) for t in toks[mask] if int(t) != EOA][:len(acts)] == acts


def test_plant_zero_is_bit_identical_to_no_plant():
    m = _model()
    tasks = make_tasks(range(6), (2, 3))

    def run(**kw):
        return rollout(m, tasks, precision="nvfp4", max_len=64, generator=torch.Generator().manual_seed(1), **kw)

    a, b = run(), run(plant=0.0)
    for name in ("tokens", "policy_mask", "valid_mask", "rollout_logprobs", "turn_ids", "success", "progress",
                 "n_calls", "entropy"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.records == b.records
    stack = StackedTinyLM([m, m])
    u = torch.rand(1, 6, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64).expand(2, -1, -1)
    s0 = rollout_stacked(stack, [tasks, tasks], u, precision="fp8", max_len=64)
    s1 = rollout_stacked(stack, [tasks, tasks], u, precision="fp8", max_len=64, plant=(0.0, 0.0))
    assert torch.equal(s0.tokens, s1.tokens) and torch.equal(s0.rollout_logprobs, s1.rollout_logprobs)
    assert s0.decode_steps == s1.decode_steps


@pytest.mark.parametrize("plant", [-0.1, math.nan, math.inf])
def test_a_bad_plant_is_a_config_error_naming_it(plant):
    m = _model(max_len=32)
    tasks = make_tasks(range(2), (2,))
    with pytest.raises(ConfigError) as exc:
        rollout(m, tasks, max_len=32, generator=torch.Generator().manual_seed(0), plant=plant)
    assert exc.value.parameter == "plant"
    u = torch.rand(2, 2, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with pytest.raises(ConfigError) as exc:
        rollout_stacked(StackedTinyLM([m, m]), [tasks, tasks], u, max_len=32, plant=(0.0, plant))
    assert exc.value.parameter == "plant"
    with pytest.raises(ConfigError) as exc:  # one strength per model
        rollout_stacked(StackedTinyLM([m, m]), [tasks, tasks], u, max_len=32, plant=(0.1, 0.1, 0.1))
    assert exc.value.parameter == "plant"


def test_per_model_plants_act_per_model():
    """In a stack planted (0, s): model 0 draws what an unplanted single model draws from the same uniforms,
    model 1 what a single model planted at s draws, with the planted log-probs of the learner's logits."""
    m = _model()
    tasks = make_tasks(range(6), (2, 3))
    u = torch.rand(1, 6, 96, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    s = 0.5
    both = rollout_stacked(StackedTinyLM([m, m]), [tasks, tasks], u.expand(2, -1, -1), max_len=96, plant=(0.0, s))
    plain = rollout_stacked(StackedTinyLM([m]), [tasks], u, max_len=96)
    planted = rollout_stacked(StackedTinyLM([m]), [tasks], u, max_len=96, plant=s)
    for i, alone in ((0, plain), (1, planted)):
        L = alone.tokens.size(-1)
        assert torch.equal(both.tokens[i, :, :L], alone.tokens[0]), i
        assert torch.equal(both.success[i], alone.success[0])
        pm = alone.policy_mask[0]
        assert torch.allclose(both.rollout_logprobs[i, :, :L][pm], alone.rollout_logprobs[0][pm], atol=1e-5)
    assert not torch.equal(plain.tokens, planted.tokens)  # the plant changed the trajectories
    pm = both.policy_mask[1]
    with torch.no_grad():
        logits = m(both.tokens[1], "fp32").float()
    want, _ = _planted_logprobs(logits, both.tokens[1], both.turn_ids[1], pm, s)
    assert torch.allclose(both.rollout_logprobs[1][pm].double(), want, atol=1e-4, rtol=0)
    # model 0 reports its own, unshifted distribution
    lp = stacked_logprobs(StackedTinyLM([m]), both.tokens[:1])[0]
    pm0 = both.policy_mask[0]
    assert torch.allclose(lp[pm0], both.rollout_logprobs[0][pm0], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# the exact sampler


@pytest.mark.parametrize("precision", ["nvfp4", "mxfp4"])
def test_the_exact_sampler_reports_the_learners_quantized_logprobs(precision):
    """The default engine writes bf16 between its quantized GEMMs, so its log-probs miss the learner's at the
    same precision; the exact engine computes as the learner does: at least 10x closer (in practice float
    noise), single model and stacked."""
    m = _model()
    tasks = make_tasks(range(8), (2, 3))

    def gap(exact):
        b = rollout(m, tasks, precision=precision, max_len=96, generator=torch.Generator().manual_seed(0),
                    exact=exact)
        with torch.no_grad():
            lp = sequence_logprobs(m, b.tokens, precision)
        return float((lp - b.rollout_logprobs)[b.policy_mask].abs().mean())

    engine, exact = gap(False), gap(True)
    assert engine > 1e-3  # the two sides really differ
    assert exact * 10 <= engine and exact < 1e-4, (engine, exact)

    stack = StackedTinyLM([m, _model(1)])
    u = torch.rand(2, 8, 96, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def stacked_gap(exact):
        b = rollout_stacked(stack, [tasks, tasks], u, precision=precision, max_len=96, exact=exact)
        with torch.no_grad():
            lp = stacked_logprobs(stack, b.tokens, precision)
        return (lp - b.rollout_logprobs).abs()[b.policy_mask].mean().item()

    engine, exact = stacked_gap(False), stacked_gap(True)
    assert engine > 1e-3 and exact * 10 <= engine and exact < 1e-4, (engine, exact)


# ---------------------------------------------------------------------------------------------
# the evaluation beside the engine's


def _eval_rows(rows: list[list[dict]], prefix: str) -> list[list[dict]]:
    return [[{k: v for k, v in r.items() if k.startswith(prefix)} for r in model if f"{prefix}success" in r]
            for model in rows]


def _training(rows: list[list[dict]]) -> list[list[dict]]:
    return [[{k: v for k, v in r.items() if not k.startswith(("eval", "time/"))} for r in model] for model in rows]


def _assert_rows_equal(a: list[list[dict]], b: list[list[dict]], rename: tuple[str, str] = ("", "")) -> None:
    assert len(a) == len(b)
    for ma, mb in zip(a, b, strict=True):
        assert len(ma) == len(mb)
        for ra, rb in zip(ma, mb, strict=True):
            rb = {k.replace(rename[1], rename[0], 1): v for k, v in rb.items()}
            assert set(ra) == set(rb)
            assert all(_same(ra[k], rb[k]) for k in ra), {k: (ra[k], rb[k]) for k in ra if not _same(ra[k], rb[k])}


def test_the_fp32_evaluation_keeps_its_keys(tiny_base):
    """With ``eval_precision="fp32"`` and nothing beside it an evaluation point writes the six ``eval/*`` keys it
    wrote before the dual-clip protocol, and no other ``eval*`` key; the last row is that point alone."""
    rows = train_grpo_stacked(StackedTinyLM([tiny_base] * 2), [TINY_GRPO, replace(TINY_GRPO, plant=0.3)])
    for model in rows:
        assert [r["update"] for r in model] == [0, 1]
        assert {k for k in model[0] if k.startswith("eval")} == {f"eval/{k}" for k in EVAL_KEYS}
        assert set(model[-1]) == {"update", *(f"eval/{k}" for k in EVAL_KEYS)}


def test_eval_also_writes_a_second_evaluation_without_changing_anything_else(tiny_base):
    """eval_precision=None scores each model on its own engine (its plant included) in ``eval/*``;
    ``eval_also="fp32"`` adds ``eval_fp32/*``, equal to the ``eval/*`` of an fp32-scored run, and
    ``eval_also="engine"`` adds ``eval_engine/*``, equal to the ``eval/*`` of an engine-scored run; no other
    number moves (same tasks, same uniforms)."""
    configs = [replace(TINY_GRPO, rollout_precision="nvfp4", learner_precision="nvfp4"),
               replace(TINY_GRPO, plant=0.5)]

    def run(**kw):
        return train_grpo_stacked(StackedTinyLM([tiny_base] * 2), configs, **kw)

    fp32 = run()
    engine = run(eval_precision=None)
    engine_beside = run(eval_precision=None, eval_also="fp32")
    fp32_beside = run(eval_also="engine")
    for rows in (engine, engine_beside, fp32_beside):
        _assert_rows_equal(_training(fp32), _training(rows))
    _assert_rows_equal(_eval_rows(engine, "eval/"), _eval_rows(engine_beside, "eval/"))
    _assert_rows_equal(_eval_rows(fp32, "eval/"), _eval_rows(engine_beside, "eval_fp32/"), ("eval/", "eval_fp32/"))
    _assert_rows_equal(_eval_rows(fp32, "eval/"), _eval_rows(fp32_beside, "eval/"))
    _assert_rows_equal(_eval_rows(engine, "eval/"), _eval_rows(fp32_beside, "eval_engine/"),
                       ("eval/", "eval_engine/"))
    for model in engine_beside:
        assert {k for k in model[-1] if k != "update"} == {f"{p}{k}" for p in ("eval/", "eval_fp32/")
                                                           for k in EVAL_KEYS}
    assert not any(k.startswith("eval_fp32/") for model in engine for r in model for k in r)


def test_the_evaluations_use_each_models_engine_and_plant(tiny_base, monkeypatch):
    """Which engine every held-out evaluation runs: each model's precision and planted strength for ``eval/*``
    with eval_precision=None (and for ``eval_engine/*``), the plain engine of the named precision otherwise."""
    import creditlab.train.toolshop_grpo as grpo

    real, calls = grpo.rollout_stacked, []

    def spy(stack, tasks, uniforms, **kw):
        if len(tasks[0]) == TINY_GRPO.eval_tasks:  # the training batches hold 2 x 2 rollouts
            calls.append((kw["precision"], kw["plant"]))
        return real(stack, tasks, uniforms, **kw)

    monkeypatch.setattr(grpo, "rollout_stacked", spy)
    configs = [replace(TINY_GRPO, rollout_precision="fp8", learner_precision="fp8"), replace(TINY_GRPO, plant=0.5)]
    own = (("fp8", "fp32"), (0.0, 0.5))
    train_grpo_stacked(StackedTinyLM([tiny_base] * 2), configs, eval_precision=None, eval_also="fp32")
    assert calls == [own, ("fp32", 0.0)] * 2  # before the update and after it
    calls.clear()
    train_grpo_stacked(StackedTinyLM([tiny_base] * 2), configs, eval_also="engine")
    assert calls == [("fp32", 0.0), own] * 2
    with pytest.raises(ConfigError, match="eval_also"):
        train_grpo_stacked(StackedTinyLM([tiny_base] * 2), configs, eval_also="fp5")


# ---------------------------------------------------------------------------------------------
# the verdicts, on hand-made tables


def test_verdict_above_zero_and_within():
    from creditlab.labs.mismatch.ablation import verdict_above_zero, verdict_within

    assert verdict_above_zero(0.01, 0.2) is Verdict.HOLDS
    assert verdict_above_zero(-0.2, -0.01) is Verdict.FAILS
    assert verdict_above_zero(-0.05, 0.1) is Verdict.NOT_JUDGED  # spans 0: not resolved
    assert verdict_above_zero(0.0, 0.1) is Verdict.NOT_JUDGED  # touching 0 is not above it
    assert verdict_above_zero(math.nan, math.nan) is Verdict.NOT_JUDGED  # one seed: no interval
    assert verdict_within(-0.04, 0.03) is Verdict.HOLDS
    assert verdict_within(-0.05, 0.05) is Verdict.HOLDS  # the bounds are inside
    assert verdict_within(0.01, 0.2) is Verdict.FAILS and verdict_within(-0.2, -0.01) is Verdict.FAILS
    assert verdict_within(0.01, 0.04) is Verdict.HOLDS  # inside the band wins over excluding 0
    assert verdict_within(-0.1, 0.02) is Verdict.NOT_JUDGED  # includes 0, leaves the band
    assert verdict_within(-0.1, 0.02, bound=0.1) is Verdict.HOLDS
    assert verdict_within(math.nan, 0.01) is Verdict.NOT_JUDGED


def _diff_table(rows):
    return Table(pd.DataFrame(rows, columns=["diff", "dose", "final", "final_lo", "final_hi", "n"]), "t")


def test_the_ablation_predictions_on_hand_made_tables():
    """(A1)-(A4) at the selected dose read final's interval from diff_vs_qat / diff_vs_qat_tis: above 0 holds,
    below 0 fails, spanning 0 is not judged and noted "not resolved"; (A2) holds inside [-0.05, 0.05]. Another
    dose's rows (never selected) and a missing table leave a prediction out."""
    from creditlab.labs.mismatch.ablation import ablation_predictions
    from creditlab.labs.mismatch.config import DOSES

    preds = ablation_predictions(["mxfp4"], DOSES)
    assert len(preds) == 4 * len(DOSES)
    assert [p.claim.split(":")[0] for p in preds[:4]] == [f"({i}) at mxfp4" for i in ("A1", "A2", "A3", "A4")]
    tabs = {"diff_vs_qat": _diff_table([("qat_tis - qat", "mxfp4", 0.10, 0.02, 0.18, 8),
                                        ("qat_interq - qat", "mxfp4", 0.01, -0.05, 0.07, 8),
                                        ("qat_tis - qat", "nvfp4", 0.2, 0.1, 0.3, 8)]),
            "diff_vs_qat_tis": _diff_table([("qat_mis_low - qat_tis", "mxfp4", 0.0, -0.03, 0.04, 8),
                                            ("qat_interq_tis - qat_tis", "mxfp4", -0.1, -0.2, -0.01, 8)])}
    rows = [p.row(tabs) for p in preds[:4]]
    assert [r["verdict"] for r in rows] == ["holds", "holds", "not judged (not resolved: the interval spans 0)",
                                            "fails"]
    assert "+0.100 [+0.020, +0.180], 8 seeds" in rows[0]["measured"]
    assert all(p.row(tabs) is None for p in preds[4:])  # nvfp4's row is there, but nvfp4 was not selected
    # (A2) not resolved, (A2) failing, one seed, and no table
    for lo, hi, want in ((-0.1, 0.02, "not judged (not resolved: the interval includes 0 and leaves [-0.05, +0.05])"),
                         (0.06, 0.2, "fails"), (math.nan, math.nan, "not judged (one seed: no interval)")):
        t = {"diff_vs_qat_tis": _diff_table([("qat_mis_low - qat_tis", "mxfp4", 0.05, lo, hi, 8)])}
        assert preds[1].row(t)["verdict"] == want
    assert preds[0].row({}) is None and preds[0].row({"diff_vs_qat": _diff_table([])}) is None


def test_the_comparison_judges_the_ablation_under_the_dual_clip_protocol():
    """The dual-clip protocol's comparison states (A1)-(A4) at its dose, not (a)-(d); the 2-core one keeps (a)-(d)."""
    from creditlab.labs.mismatch.ablation import ablation_predictions
    from creditlab.labs.mismatch.comparison import predictions

    claims = [p.claim for p in predictions(MismatchConfig.dual_clip())]
    assert claims[:4] == [p.claim for p in ablation_predictions(["mxfp4"], ())]
    assert not any(cl.startswith(("(a)", "(b)", "(c)", "(d)")) for cl in claims)
    assert predictions(MismatchConfig.two_core())[0].claim.startswith("(a) at mxfp4")


def _planted_diffs(rows):
    return pd.DataFrame(rows, columns=["diff", "metric", "world", "strength", "mean", "lo", "hi", "n"])


def test_planted_verdict_on_a_hand_made_table():
    """(P1)/(P2) read final (not final_engine) at the world and strength asked: above 0 holds, below fails,
    spanning 0 or missing is not judged."""
    from creditlab.labs.mismatch.planted import planted_verdict

    d = _planted_diffs([("interq - tis", "final", "thoughts", 0.4, 0.05, 0.01, 0.1, 4),
                        ("interq - tis", "final_engine", "thoughts", 0.4, -0.1, -0.2, -0.05, 4),
                        ("interq - tis", "final", "thought_free", 0.4, 0.0, -0.1, 0.05, 4),
                        ("interq - none", "final", "thoughts", 0.4, -0.1, -0.2, -0.05, 4),
                        ("interq - none", "final", "thoughts", 0.2, 0.1, 0.05, 0.2, 4),
                        ("interq - none", "final", "thought_free", 0.4, 0.0, math.nan, math.nan, 1)])
    assert planted_verdict(d, "interq", "tis", "thoughts", 0.4) is Verdict.HOLDS
    assert planted_verdict(d, "interq", "tis", "thought_free", 0.4) is Verdict.NOT_JUDGED
    assert planted_verdict(d, "interq", "none", "thoughts", 0.4) is Verdict.FAILS
    assert planted_verdict(d, "interq", "none", "thoughts", 0.2) is Verdict.HOLDS
    assert planted_verdict(d, "interq", "none", "thought_free", 0.4) is Verdict.NOT_JUDGED
    assert planted_verdict(d, "tis", "none", "thoughts", 0.4) is Verdict.NOT_JUDGED  # not run
    assert planted_verdict(pd.DataFrame(), "interq", "tis", "thoughts", 0.4) is Verdict.NOT_JUDGED


def test_the_planted_predictions_on_a_hand_made_table():
    """Under the dual-clip protocol: P1 (interq - tis) then P2 (interq - none), in each world, at the strongest
    strength; "not resolved" where the interval spans 0; nothing measured, nothing in the table."""
    from creditlab.labs.mismatch.planted import EXPERIMENT

    c = MismatchConfig.dual_clip()
    preds = EXPERIMENT.predictions_for(c)
    assert [p.claim for p in preds] == [f"{pid} {w}, strength 0.4: interq beats {b}"
                                        for pid, b in (("P1", "tis"), ("P2", "none"))
                                        for w in ("thoughts", "thought_free")]
    d = _planted_diffs([("interq - tis", "final", "thoughts", 0.4, 0.05, 0.01, 0.1, 4),
                        ("interq - tis", "final", "thought_free", 0.4, 0.0, -0.1, 0.05, 4),
                        ("interq - none", "final", "thoughts", 0.4, -0.1, -0.2, -0.05, 4),
                        ("interq - tis", "final", "thoughts", 0.2, -0.1, -0.2, -0.05, 4)])
    rows = [p.row({"planted_diffs": Table(d, "t")}) for p in preds]
    assert [r and r["verdict"] for r in rows] == ["holds", "not judged (not resolved: the interval spans 0)",
                                                  "fails", None]
    assert rows[0]["measured"] == "interq - tis final +0.050 [+0.010, +0.100], 4 seeds"
    assert all(p.row({}) is None for p in preds)
    # one seed: no interval, so nothing spans 0 (the ablation's rule says "one seed: no interval")
    one = _planted_diffs([("interq - tis", "final", "thoughts", 0.4, 0.0, math.nan, math.nan, 1)])
    verdict = preds[0].row({"planted_diffs": Table(one, "t")})["verdict"]
    assert verdict.startswith("not judged") and "spans 0" not in verdict, verdict
    assert EXPERIMENT.predictions_for(MismatchConfig.two_core()) == ()  # registered with the dual-clip protocol


def test_token_summary_by_hand():
    """Per arm in order of appearance: shares of thoughts, of delta < -1 (strictly) and of calls among those,
    the TIS and InterQ weights there, the share above TIS's cap (delta > ln 2), and mean absolute weights."""
    from creditlab.labs.mismatch.sample import token_summary

    rows = [("b", 0.0, False, 1.0, 1.0, 1.0, 1.5),
            ("a", -2.0, True, 0.2, 0.9, 1.0, 1.0),
            ("a", -0.5, False, 0.6, 1.0, 0.8, 1.0),
            ("b", -1.0, False, 0.4, 1.0, 1.0, 0.5),
            ("a", 1.0, True, 2.0, 1.1, 1.0, 1.0),
            ("a", -1.5, False, 0.3, 0.7, 1.0, 1.0)]
    sample = pd.DataFrame(rows, columns=["arm", "delta", "thought", "w_tis", "w_interq", "w_global", "weight"])
    t = token_summary(sample).set_index("arm")
    assert list(t.index) == ["b", "a"]
    a, b = t.loc["a"], t.loc["b"]
    assert a["tokens"] == 4 and a["thought_share"] == 0.5 and a["delta_below_-1"] == 0.5
    assert a["calls_among_them"] == 0.5  # -2.0 is a thought, -1.5 a call
    assert a["w_tis_there"] == pytest.approx(0.25) and a["w_interq_there"] == pytest.approx(0.8)
    assert a["tis_capped"] == 0.25 and a["mean_abs_w1"] == 0
    assert a["interq_vs_global"] == pytest.approx((0.1 + 0.2 + 0.1 + 0.3) / 4)
    assert a["interq_abs_w1"] == pytest.approx((0.1 + 0.0 + 0.1 + 0.3) / 4)
    assert b["tokens"] == 2 and b["thought_share"] == 0 and b["delta_below_-1"] == 0  # -1.0 is not below -1
    assert np.isnan(b["calls_among_them"]) and np.isnan(b["w_tis_there"]) and np.isnan(b["w_interq_there"])
    assert b["tis_capped"] == 0 and b["mean_abs_w1"] == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------
# the new experiments end to end


def test_the_quick_planted_experiment_runs_through_the_cli(tmp_path, monkeypatch):
    """``creditlab lab mismatch --quick -e planted``: the planted gate, summary, means and differences, and its
    plot (the estimator's and the sample's quick cells run in their own tests, and through run_lab below)."""
    from cli_inproc import run_inproc

    monkeypatch.setenv("CREDITLAB_CACHE", str(tmp_path / "cache"))  # the worlds' bases ship with creditlab
    out = tmp_path / "out"
    r = run_inproc("lab", "mismatch", "--quick", "-e", "planted", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("planted_gate", "planted_summary", "planted_means", "planted_diffs"):
        assert (out / f"{name}.parquet").exists() and (out / f"{name}.md").exists(), name
    assert (out / "mismatch_planted.png").exists()
    gate = pd.read_parquet(out / "planted_gate.parquet")
    assert list(gate["strength"]) == [0.0, 0.4] and list(gate["world"]) == ["thought_free"] * 2
    assert gate["diverged"].iloc[0] == 0 and gate["k3"].iloc[0] < 1e-9  # strength 0 is the unshifted engine
    assert gate["k3"].iloc[1] > 1e-3
    summary = pd.read_parquet(out / "planted_summary.parquet")
    assert list(summary["arm"]) == ["none", "interq"] and summary["final_engine"].notna().all()


def test_the_sample_without_a_dose_is_refused_naming_the_flag(tmp_path, monkeypatch):
    """``-e sample`` alone has no dose to sample: a clear error naming --experiment, exit 2 (a usage error), no
    traceback."""
    from cli_inproc import run_inproc

    monkeypatch.setenv("CREDITLAB_CACHE", str(tmp_path / "cache"))
    r = run_inproc("lab", "mismatch", "--quick", "-e", "sample", "--out", tmp_path / "out")
    assert r.returncode == 2 and "--experiment" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_planted_and_sample_under_the_dual_clip_protocol_at_tiny_size(tmp_path, tiny_base_cache):
    """The dual-clip protocol's experiments at a tiny size through run_lab: the per-token sample's summary (one
    row per trained arm), the planted tables, and the predictions table with (P1)/(P2) not judged on one seed
    and the ablation's (A1) without an interval."""
    cfg = MismatchConfig(base=TINY_BASE, grpo=replace(TINY_GRPO, updates=2, eval_every=1), seeds=1, smooth=1,
                         protocol="dual-clip", arms=("qat", "qat_tis"), experiments=("nvfp4", "planted", "sample"),
                         dose_tasks=8, cache_dir=str(tiny_base_cache), planted_strengths=(0.4,),
                         planted_arms=("none", "tis", "interq"), planted_variants=("thought_free",), planted_seeds=1,
                         planted_updates=2, planted_tasks=8, sample_updates=1)
    res = run_lab(LAB, cfg, tmp_path / "out", progress=False)
    for name in ("planted_gate", "planted_summary", "planted_means", "planted_diffs", "token_summary",
                 "token_sample", "predictions"):
        assert name in res.tables, name
    assert "mismatch_planted.png" in {p.name for p in res.plots}
    ts = res.tables["token_summary"].frame
    assert list(ts["arm"]) == ["qat", "qat_tis"] and (ts["tokens"] > 0).all()
    sample = res.tables["token_sample"].frame
    assert set(sample["update"]) == {0} and set(sample["dose"]) == {"nvfp4"}
    assert (sample.loc[sample["arm"] == "qat", "weight"] == 1).all()
    pred = res.tables["predictions"].frame.set_index("prediction")
    planted = pred[pred["experiment"] == "planted"]
    assert [p.split(" ")[0] for p in planted.index] == ["P1", "P2"]
    assert planted["verdict"].str.startswith("not judged").all()
    (a1,) = [p for p in pred.index if p.startswith("(A1) at nvfp4")]
    assert pred.loc[a1, "verdict"] == "not judged (one seed: no interval)"
