"""The mismatch lab's regime: thought tokens in the toolshop world, the gate's metrics, the predictions.

Thought tokens are reward-neutral (the environment drops them), appended after the vocabulary (no id
moves) and off by default (the cache keys of existing base policies stay); the gate's metrics match a
slow per-trajectory loop on random ragged batches and a hand-computed case; the predictions table
reads hand-made tables the way docs/mismatch.md states the predictions (each rule: holds, fails, not judged).
"""

import math
import random

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from creditlab.envs.toolshop import (
    N_THOUGHTS,
    THOUGHT0,
    THOUGHT_TOKENS,
    TOK,
    VOCAB,
    VOCAB_WITH_THOUGHTS,
    ToolshopEnv,
    decode,
    encode,
    is_thought,
    make_task,
    run_scripted,
    thought_mask,
    vocab_size,
)
from creditlab.errors import ConfigError
from creditlab.labs.mismatch import (
    ENTROPY_BINS,
    MismatchConfig,
    fp32_band,
    gate_metrics,
    gate_table,
    verdict_less_stable,
    verdict_rolls_back,
    verdict_stays,
)
from creditlab.train.toolshop_base import BaseConfig


def test_thought_tokens_are_appended_and_move_no_id():
    assert VOCAB_WITH_THOUGHTS[:len(VOCAB)] == VOCAB and THOUGHT0 == len(VOCAB)
    assert all(TOK[t] == i for i, t in enumerate(VOCAB))
    assert [TOK[t] for t in THOUGHT_TOKENS] == list(range(THOUGHT0, THOUGHT0 + N_THOUGHTS))
    assert vocab_size(0) == len(VOCAB) and vocab_size(8) == len(VOCAB) + N_THOUGHTS
    assert decode(encode(["think3", "get_order", "12"])) == ["think3", "get_order", "12"]
    assert is_thought(THOUGHT0) and not is_thought(THOUGHT0 - 1) and not is_thought(THOUGHT0 + N_THOUGHTS)
    ids = torch.arange(THOUGHT0 + N_THOUGHTS + 3)
    assert thought_mask(ids).tolist() == [is_thought(int(i)) for i in ids]
    assert thought_mask(ids.numpy()).tolist() == thought_mask(ids).tolist()


def test_default_cache_keys_are_those_of_the_configs_without_thoughts():
    # the keys existing caches hold (recorded before thoughts were added): a thoughtless config keeps its file
    assert BaseConfig().key() == "b33704abf4222439"
    assert BaseConfig(chain_lengths=(5, 6, 7, 8)).key() == "9b99370fa2e5e7b8"
    assert BaseConfig(thoughts=4).key() != BaseConfig().key()
    assert BaseConfig(thoughts=4).model_config().vocab_size == len(VOCAB) + N_THOUGHTS


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), C=st.integers(2, 8), m=st.integers(1, 12), noise=st.sampled_from([0.0, 0.3]))
def test_thoughts_are_reward_neutral_and_leave_the_demonstrator_s_choices(seed, C, m, noise):
    """The same episode with and without thoughts: the same tool calls, records and verdict; the
    thoughts stripped, the same tokens."""
    task = make_task(seed, C)
    ids0, mask0, env0 = run_scripted(task, seed, noise=noise)
    ids, mask, env = run_scripted(task, seed, noise=noise, thoughts=m)
    assert env.result() == env0.result()
    assert [(r.name, r.arguments, r.returned, r.ok) for r in env.records] == \
        [(r.name, r.arguments, r.returned, r.ok) for r in env0.records]
    keep = [i for i, t in enumerate(ids) if not is_thought(t)]
    assert [ids[i] for i in keep] == ids0 and [mask[i] for i in keep] == mask0
    n_thoughts = sum(is_thought(t) for t in ids)
    assert n_thoughts == m * len(env.records) and all(mask[i] for i, t in enumerate(ids) if is_thought(t))


def test_thoughts_anywhere_in_an_action_change_nothing():
    task = make_task(3, 4)
    plain = ToolshopEnv(task)
    plain.reset()
    a = encode(["get_order", str(task.order), "EOA"])
    want = plain.step(a)
    env = ToolshopEnv(task)
    env.reset()
    got = env.step([THOUGHT0 + 1, a[0], THOUGHT0, a[1], THOUGHT0 + 5, a[2]])
    assert got.observation == want.observation and got.record.returned == want.record.returned
    with pytest.raises(ConfigError, match="thoughts"):
        run_scripted(task, 0, thoughts=-1)


def _gate_loop(old, rollout, pm, turn, tokens, ent):
    """Slow reference of gate_metrics: one trajectory and one token at a time."""
    B, L = pm.shape
    drifts, n_pol, n_th = [], [], []
    k3_bins = {i: [] for i in range(len(ENTROPY_BINS) - 1)}
    k3_th, k3_act, ent_th = [], [], []
    for b in range(B):
        pol = [t for t in range(L) if pm[b, t]]
        n_pol.append(len(pol))
        n_th.append(sum(1 for t in pol if is_thought(int(tokens[b, t]))))
        if pol:
            last = max(int(turn[b, t]) for t in pol)
            drifts.append(sum(float(old[b, t]) - float(rollout[b, t]) for t in pol if turn[b, t] < last))
        for t in pol:
            d = float(old[b, t]) - float(rollout[b, t])
            k3 = math.exp(d) - 1 - d
            h = float(ent[b, t])
            for i in range(len(ENTROPY_BINS) - 1):
                if ENTROPY_BINS[i] <= h < ENTROPY_BINS[i + 1]:
                    k3_bins[i].append(k3)
            if is_thought(int(tokens[b, t])):
                k3_th.append(k3)
                ent_th.append(h)
            else:
                k3_act.append(k3)
    mean = lambda v: float(np.mean(v)) if v else math.nan  # noqa: E731
    return {"policy_tokens": mean(n_pol), "thought_tokens": mean(n_th), "drift_last": mean(drifts),
            "bins": [mean(k3_bins[i]) for i in k3_bins], "k3_thought": mean(k3_th), "k3_action": mean(k3_act),
            "thought_entropy": mean(ent_th)}


@pytest.mark.parametrize("seed", range(6))
def test_gate_metrics_equal_the_loop_on_ragged_batches(seed):
    g = torch.Generator().manual_seed(seed)
    B, L = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(4, 30, (1,), generator=g))
    pm = torch.rand(B, L, generator=g) < 0.6
    pm[0] = False if seed % 3 == 0 else pm[0]  # a row without policy tokens
    turn = torch.sort(torch.randint(0, 5, (B, L), generator=g), dim=1).values
    tokens = torch.randint(0, THOUGHT0 + N_THOUGHTS, (B, L), generator=g)
    old = -torch.rand(B, L, generator=g) * 3
    rollout = old + torch.randn(B, L, generator=g) * 0.3
    ent = torch.rand(B, L, generator=g) * 2.5
    got = gate_metrics(old, rollout, pm, turn, tokens, ent)
    want = _gate_loop(old, rollout, pm, turn, tokens, ent)
    for k in ("policy_tokens", "thought_tokens", "drift_last", "k3_thought", "k3_action", "thought_entropy"):
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9, nan_ok=True), k
    names = [c for c in got if c.startswith("k3_H")]
    assert len(names) == len(ENTROPY_BINS) - 1
    for name, w in zip(names, want["bins"], strict=True):
        assert got[name] == pytest.approx(w, rel=1e-6, abs=1e-9, nan_ok=True), name
    shares = sum(got[n.replace("k3_", "share_")] for n in names)
    assert shares == pytest.approx(1.0 if pm.any() else 0.0)


def test_gate_metrics_by_hand():
    # one trajectory, turns 0, 0, 1, 1 on policy tokens; deltas -0.1, -0.2, -0.3, 0.4: the drift entering
    # turn 1 is -0.3; the first token is a thought
    old = torch.tensor([[0.0, -0.1, -0.2, -0.3, 0.4]])
    rollout = torch.zeros(1, 5)
    pm = torch.tensor([[False, True, True, True, True]])
    turn = torch.tensor([[-1, 0, 0, 1, 1]])
    tokens = torch.tensor([[1, THOUGHT0, 5, 6, 7]])
    ent = torch.tensor([[0.0, 2.0, 0.01, 0.5, 0.5]])
    m = gate_metrics(old, rollout, pm, turn, tokens, ent)
    k3 = lambda d: math.exp(d) - 1 - d  # noqa: E731
    assert m["drift_last"] == pytest.approx(-0.3)
    assert m["policy_tokens"] == 4 and m["thought_tokens"] == 1
    assert m["k3_thought"] == pytest.approx(k3(-0.1)) and m["thought_entropy"] == pytest.approx(2.0)
    assert m["k3_H<0.05"] == pytest.approx(k3(-0.2)) and m["share_H<0.05"] == 0.25
    assert m["k3_H0.3-1"] == pytest.approx((k3(-0.3) + k3(0.4)) / 2) and math.isnan(m["k3_H0.05-0.3"])


def test_gate_table_passes_a_dose_by_qat_s_drift():
    rows = []
    for engine, dq in (("fp8", -0.2), ("nvfp4", -0.7)):
        for learner, drift in (("fp32", -3.0), ("QAT", dq)):
            rows.append({"engine": engine, "learner": learner, "k3": 0.01, "drift_last": drift, "policy_tokens": 200.0,
                         "thought_tokens": 150.0, "k3_thought": 0.02, "k3_action": 0.001, "thought_entropy": 2.5,
                         "k3_H>1": 0.02})
    g = gate_table(pd.DataFrame(rows)).set_index("engine")
    assert g.loc["fp8", "gate"] == "fail" and g.loc["nvfp4", "gate"] == "pass"
    assert g.loc["nvfp4", "drift_naive"] == -3.0 and g.loc["nvfp4", "k3_H>1 (QAT)"] == 0.02


def _summary(arm, rollbacks, finals=None, growth=1.5, dose="nvfp4", best_update=250.0):
    finals = finals or [0.8] * len(rollbacks)
    return [{"arm": arm, "dose": dose, "seed": s, "rollback": r, "final": f, "k3_growth": growth,
             "best_update": best_update} for s, (r, f) in enumerate(zip(rollbacks, finals, strict=True))]


UPDATES = 400
FP32 = _summary("fp32", [0.0, 0.02, 0.035, 0.01, 0.0], dose="fp32")  # its own band: 0.035


def _judged(rows, diffs, dose="nvfp4", updates=UPDATES, protocol="paper", curves=None, smooth=1):
    """The comparison's predictions of ``protocol`` judged on hand-made tables: arm -> its row of the
    predictions table (the lab's one table: experiment, prediction, measured, verdict)."""
    from dataclasses import replace

    from creditlab.lab.experiment import predictions_table
    from creditlab.lab.protocol import Table
    from creditlab.labs.mismatch.comparison import JUDGED, predictions

    base = MismatchConfig()
    cfg = replace(base, experiments=(dose,), protocol=protocol, smooth=smooth,
                  grpo=replace(base.grpo, updates=updates))
    tabs = {"summary": Table(pd.DataFrame(rows), "s"), "diff_vs_fp32": Table(diffs, "d")}
    if curves is not None:
        tabs["curves"] = Table(curves, "c")
    preds = predictions(cfg)
    table = predictions_table([("comparison", p) for p in preds], tabs)
    arm_of = {p.claim: arm for p, (_, arm) in zip(preds, [j for _ in range(len(preds) // len(JUDGED))
                                                         for j in JUDGED], strict=True)}
    return table.assign(arm=table["prediction"].map(arm_of)).set_index("arm")


def test_predictions_are_read_as_the_docs_state_them():
    rows = (FP32
            + _summary("qat", [0.05, 0.04, 0.06, 0.0, 0.01])                   # (a) 3 of 5 beyond 0.035: holds
            + _summary("qat_tis", [0.05, 0.0, 0.0, 0.0, 0.04])               # (c) 2 of 5: fails
            + _summary("qat_mis", [0.05, 0.04, 0.06, 0.1, 0.01], growth=0.9)  # (c) 4 of 5 but K3 falls: fails
            + _summary("qat_interq", [0.0, 0.01, 0.02, 0.05, 0.0])           # (b) 4 of 5 <= 0.03
            + _summary("qat_prefix", [0.03, 0.02, 0.03, 0.0, 0.01])          # (d) larger in 3 of 5: holds
            + _summary("qat_global", [0.0, 0.0, 0.0, 0.0, 0.0], finals=[0.8, 0.81, 0.79, 0.8, 0.8]))
    diffs = pd.DataFrame([{"diff": "qat_interq - fp32", "dose": "nvfp4", "final": 0.0, "final_lo": -0.04,
                           "final_hi": 0.03}])
    p = _judged(rows, diffs)
    assert list(p.index) == ["qat", "qat_interq", "qat_tis", "qat_mis", "qat_prefix", "qat_global"]  # (a)-(d)
    assert set(p["experiment"]) == {"comparison"}
    assert p.loc["qat", "verdict"] == "holds" and p.loc["qat", "prediction"].startswith("(a) at nvfp4: QAT")
    assert p.loc["qat", "measured"] == ("rollback > 0.035 (the fp32 band) with the best window ending after update "
                                        "200 in 3/5 seeds; K3 late/early 1.50")
    assert p.loc["qat_tis", "verdict"] == p.loc["qat_mis", "verdict"] == "fails"
    assert p.loc["qat_interq", "verdict"] == "holds" and p.loc["qat_interq", "prediction"].startswith("(b)")
    assert p.loc["qat_interq", "measured"] == "rollback <= 0.03 in 4/5 seeds; final - fp32 in [-0.040, 0.030]"
    assert p.loc["qat_prefix", "verdict"] == "holds" and p.loc["qat_global", "verdict"] == "fails"
    wide = diffs.assign(final_lo=-0.06)  # the interval leaves [-0.05, 0.05]: (b) fails
    assert _judged(rows, wide).loc["qat_interq", "verdict"] == "fails"
    assert _judged(rows, diffs.iloc[:0]).loc["qat_interq", "verdict"] == "not judged"  # no paired difference
    assert _judged(rows, diffs, dose="fp8").empty  # another dose than the rows': nothing measured, no row
    only_qat = _judged(FP32 + _summary("qat", [0.05, 0.04, 0.06, 0.0, 0.01]), diffs.iloc[:0])
    assert list(only_qat.index) == ["qat"]  # an arm that did not run is left out


def test_the_rules_of_b_and_d_on_hand_made_tables():
    inter = pd.DataFrame(_summary("qat_interq", [0.0, 0.01, 0.02, 0.05, 0.0])).set_index("seed")
    diff = pd.DataFrame([{"final_lo": -0.04, "final_hi": 0.03}])
    assert verdict_stays(inter, diff, 0.03, 4) == "holds"
    assert verdict_stays(inter, diff, 0.015, 4) == "fails"  # 3 of 5 within a tighter limit
    assert verdict_stays(inter, diff.assign(final_hi=0.06), 0.03, 4) == "fails"  # final not within 0.05 of fp32
    assert verdict_stays(inter, diff.iloc[:0], 0.03, 4) == "not judged"  # no paired difference with fp32
    assert verdict_stays(inter, diff, math.nan, 4) == "not judged"  # no fp32 band to count within
    # one seed has no interval: the second part cannot be told (it used to read NaN as "fails")
    no_interval = diff.assign(final_lo=math.nan, final_hi=math.nan)
    assert verdict_stays(inter.iloc[:1], no_interval, 0.03, 1) == "not judged"
    assert verdict_stays(inter.iloc[3:4], no_interval, 0.03, 1) == "fails"  # it rolled back (0.05): fails anyway
    prefix = pd.DataFrame(_summary("qat_prefix", [0.03, 0.02, 0.03, 0.0, 0.01])).set_index("seed")
    assert verdict_less_stable(prefix, inter, 3) == "holds"  # a larger rollback in 3 of 5 seeds
    steady = pd.DataFrame(_summary("qat_global", [0.0] * 5, finals=[0.8, 0.81, 0.79, 0.8, 0.8])).set_index("seed")
    assert verdict_less_stable(steady, inter, 3) == "fails"
    spread = steady.assign(final=[0.5, 0.9, 0.6, 0.95, 0.7])  # sd >= 2x InterQ's (0): holds on the second part
    assert verdict_less_stable(spread, inter.assign(final=[0.8, 0.82, 0.79, 0.81, 0.8]), 3) == "holds"
    assert verdict_less_stable(prefix, inter.iloc[:0], 3) == "not judged"  # no common seed


def test_a_rollback_counts_for_prediction_a_only_beyond_the_fp32_band_and_late():
    qat = pd.DataFrame(_summary("qat", [0.05, 0.04, 0.06, 0.0, 0.01]))
    assert verdict_rolls_back(qat, 0.03, UPDATES, 3) == "holds"
    assert verdict_rolls_back(qat, 0.045, UPDATES, 3) == "fails"  # within a wider fp32 band: 2 of 5
    early = pd.DataFrame(_summary("qat", [0.05, 0.04, 0.06, 0.0, 0.01], best_update=150.0))
    assert verdict_rolls_back(early, 0.03, UPDATES, 3) == "fails"  # the peak came early: not a late rollback
    assert verdict_rolls_back(qat, None, UPDATES, 3) == "not judged"  # no fp32 arm: no band
    assert fp32_band(pd.DataFrame(FP32)) == 0.035 and fp32_band(pd.DataFrame(FP32).assign(rollback=0.0)) == 0.03
    assert fp32_band(qat) is None


def test_the_lab_default_is_the_thought_regime():
    c = MismatchConfig()
    c.validate()
    assert c.base.thoughts > 0 and c.grpo.max_action_len >= c.base.thoughts + 6 and c.grpo.updates == 400
    assert c.seeds >= 5 and c.grpo.max_len <= c.base.max_len
    with pytest.raises(ConfigError, match="max_action_len"):
        from dataclasses import replace

        replace(c, grpo=replace(c.grpo, max_action_len=c.base.thoughts)).validate()
    # demonstrations of the default hold 150-400 policy tokens when they succeed
    tokens = []
    for s in range(40):
        task = make_task(10_000_000 + s, random.Random(s).choice(c.base.chain_lengths))
        ids, mask, env = run_scripted(task, s, noise=0.0, thoughts=c.base.thoughts)
        assert env.result()[0]
        tokens.append(sum(mask))
    assert 150 <= np.median(tokens) <= 400


def test_imitation_loss_averages_thoughts_and_calls_separately():
    from creditlab.train.toolshop_base import _imitation_loss

    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[True, True, True, False]])
    targets = torch.tensor([[THOUGHT0, THOUGHT0 + 3, 7, THOUGHT0]])
    assert float(_imitation_loss(loss, mask, targets, 0)) == pytest.approx(2.0)  # the plain mean, as before
    assert float(_imitation_loss(loss, mask, targets, 2)) == pytest.approx(1.5 + 3.0)  # thoughts 1, 2; call 3
    no_call = torch.tensor([[True, True, False, False]])
    assert float(_imitation_loss(loss, no_call, targets, 2)) == pytest.approx(1.5)


def _no_time(rows):
    return [[{k: v for k, v in r.items() if not k.startswith("time/")} for r in model] for model in rows]


def test_an_interrupted_stacked_run_resumes_from_its_checkpoint_to_the_same_rows(tmp_path, one_thread):
    from dataclasses import replace

    from creditlab.models.tiny_lm import StackedTinyLM
    from creditlab.train.toolshop_base import base_policy
    from creditlab.train.toolshop_grpo import GRPOConfig, train_grpo_stacked

    base = base_policy(BaseConfig(n_demos=32, steps=10, batch_size=8, d_model=32, n_layer=1, max_len=64,
                                  chain_lengths=(2,)), cache_dir=None)
    g = GRPOConfig(updates=4, tasks_per_update=2, group_size=2, chain_lengths=(2,), max_len=48, eval_every=2,
                   eval_tasks=4)
    configs = [replace(g, rollout_precision="nvfp4", learner_precision="nvfp4", correction="interq"),
               replace(g, rollout_precision="nvfp4", correction="none", seed=1)]
    want = train_grpo_stacked(StackedTinyLM([base] * 2), configs)
    ck = tmp_path / "ck.pt"

    def stop(k, rows):
        if k == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_grpo_stacked(StackedTinyLM([base] * 2), configs, checkpoint=ck, checkpoint_every=2, on_update=stop)
    assert ck.exists()
    seen = []
    got = train_grpo_stacked(StackedTinyLM([base] * 2), configs, checkpoint=ck, checkpoint_every=2,
                             on_update=lambda k, rows: seen.append(k))
    assert seen == [2, 3]  # it continued from update 2
    for g_rows, w_rows in zip(_no_time(got), _no_time(want), strict=True):  # bit for bit (NaN where NaN)
        pd.testing.assert_frame_equal(pd.DataFrame(g_rows), pd.DataFrame(w_rows), check_exact=True)
    with pytest.raises(ConfigError, match="checkpoint"):
        train_grpo_stacked(StackedTinyLM([base] * 2), [replace(c, lr=1e-3) for c in configs], checkpoint=ck,
                           checkpoint_every=2)


def test_the_docs_knobs_table_is_the_labs_own():
    """docs/mismatch.md's knobs table states the lab's default world as the code's knobs table does."""
    from pathlib import Path

    from creditlab.labs.mismatch import _knob_rows

    doc = (Path(__file__).resolve().parents[1] / "docs" / "mismatch.md").read_text()
    section = doc[doc.index("## Knobs chosen, and why"):doc.index("## Run it")]
    rows = [[c.strip() for c in line.strip("|").split(" | ")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| knob")]
    assert [(r[0], r[1], r[3]) for r in rows] == [(k, v, w) for k, v, w in _knob_rows(MismatchConfig())]


# ------------------------------------------------------------------------------------------------
# the 2-core registration


def _fp32_curves(points):
    """fp32 eval rows: ``points`` = {update: [success per seed]}."""
    return pd.DataFrame([{"arm": "fp32", "seed": s, "update": float(u), "eval/success": v}
                         for u, vals in points.items() for s, v in enumerate(vals)])


def test_fp32_saturation_by_hand():
    from creditlab.labs.mismatch import fp32_saturation

    # mean curve 0.4, 0.6, 0.8, 0.9, 0.9, 0.9 at updates 0-50; windows of 3 end at 20..50 with means
    # 0.6, 0.767, 0.867, 0.9; best 0.9, gain 0.5: 90% is 0.85 -> first reached by the window ending at 40
    c = _fp32_curves({0: [0.4, 0.4], 10: [0.5, 0.7], 20: [0.8, 0.8], 30: [0.9, 0.9], 40: [0.9, 0.9],
                      50: [0.9, 0.9]})
    assert fp32_saturation(c, 3) == 40.0
    assert fp32_saturation(c, 1) == 30.0  # 0.9 >= 0.85 first at update 30
    assert fp32_saturation(_fp32_curves({0: [0.5], 10: [0.4], 20: [0.5]}), 1) is None  # never rises
    assert fp32_saturation(pd.DataFrame(columns=["update", "eval/success"]), 3) is None


def _saturating_at(update, updates=100, seeds=2):
    """``curves`` rows of the fp32 arm whose held-out success jumps from 0 to 1 at ``update`` (None: never
    rises), every 10 updates."""
    return pd.DataFrame([{"arm": "fp32", "dose": "fp32", "seed": s, "update": float(u),
                          "success": 1.0 if update is not None and u >= update else 0.0}
                         for s in range(seeds) for u in range(0, updates + 1, 10)])


def test_the_two_core_registration_reads_late_from_fp32_saturation_and_b_from_the_band():
    rows = (FP32  # band 0.035
            + _summary("qat", [0.05, 0.04, 0.06, 0.0, 0.01], best_update=60.0)
            + _summary("qat_interq", [0.0, 0.034, 0.035, 0.05, 0.0]))  # 4 of 5 within the band (0.035)
    diffs = pd.DataFrame([{"diff": "qat_interq - fp32", "dose": "mxfp4", "final": 0.0, "final_lo": -0.04,
                           "final_hi": 0.03}])
    df = [{**r, "dose": "mxfp4" if r["dose"] == "nvfp4" else r["dose"]} for r in rows]

    def judged(curves, protocol="two-core"):
        return _judged(df, diffs, dose="mxfp4", updates=100, protocol=protocol, curves=curves)

    p = judged(_saturating_at(50))
    assert p.loc["qat", "verdict"] == "holds" and "at or after update 50 (fp32 saturates)" in p.loc["qat", "measured"]
    assert p.loc["qat_interq", "verdict"] == "holds" and "rollback <= 0.035" in p.loc["qat_interq", "measured"]
    # the best window before saturation: not late
    assert judged(_saturating_at(70)).loc["qat", "verdict"] == "fails"
    # the fp32 arm never saturated: (a) not judged
    assert judged(_saturating_at(None)).loc["qat", "verdict"] == "not judged"
    assert judged(None).loc["qat", "verdict"] == "not judged"  # no curves at all
    # under the paper registration (b) counts rollbacks <= 0.03: 3 of 5, fails
    assert judged(_saturating_at(50), protocol="paper").loc["qat_interq", "verdict"] == "fails"


def test_the_two_core_protocol_config_and_its_cells():
    from creditlab.labs.mismatch import LAB

    c = MismatchConfig.two_core()
    c.validate()
    assert c.protocol == "two-core" and c.base.thoughts == 40 and c.grpo.max_action_len == 48
    assert c.grpo.max_len <= c.base.max_len and c.grpo.updates == 100 and c.seeds == 5
    cells = LAB.cells(c)
    train = [x for x in cells if x.group == "train"]
    by_dose = {}
    for x in train:
        by_dose.setdefault(x.kwargs["dose"], []).append(x)
    assert [x.kwargs["seeds"] for x in by_dose["fp32"]] == [[0, 1, 2, 3, 4]]
    assert len(by_dose["mxfp4"]) == 5 and by_dose["mxfp4"][0].kwargs["arms"] == [
        "naive", "qat", "qat_tis", "qat_interq", "qat_prefix", "qat_global"]
    for d in ("fp8", "int8", "nvfp4"):
        assert [x.kwargs["seeds"] for x in by_dose[d]] == [[0], [1]]
        assert by_dose[d][0].kwargs["arms"] == ["naive", "qat"]
    assert list(LAB.predictions(c)) == ["mismatch-two-core"]
    with pytest.raises(ConfigError, match="map_arms"):
        from dataclasses import replace

        replace(c, map_arms=("fp32",)).validate()
    with pytest.raises(ConfigError, match="--protocol"):
        replace(c, protocol="laptop").validate()


@pytest.mark.parametrize("seed", range(4))
def test_the_gate_records_diagnoses_prefix_drift_statistic_by_turn(seed):
    """gate_metrics' per-turn RMS of the prefix log ratio, read at the last turn with enough tokens, is
    what creditlab diagnose's mismatch.prefix_drift check gives on the same batch."""
    from creditlab.core.diagnostics import batch_check_values
    from creditlab.diagnose.checks import CHECK_PARAMS
    from creditlab.labs.mismatch import diagnose_drift

    g = torch.Generator().manual_seed(seed)
    B, turns, run = 12, 4, 9
    L = 2 + turns * (run + 3)
    pm = torch.zeros(B, L, dtype=torch.bool)
    turn = torch.full((B, L), -1)
    for b in range(B):
        n_turns = int(torch.randint(2, turns + 1, (1,), generator=g))
        for k in range(n_turns):  # each turn a run of policy tokens, then 3 observation tokens
            start = 2 + k * (run + 3)
            length = int(torch.randint(3, run + 1, (1,), generator=g))
            pm[b, start:start + length] = True
            turn[b, start:start + length] = k
    rollout = -1.0 - torch.rand(B, L, generator=g, dtype=torch.float64) * 2  # no impossible (positive) log-prob
    old = rollout + 0.05 * torch.randn(B, L, generator=g, dtype=torch.float64)
    m = gate_metrics(old, rollout, pm, turn, torch.ones(B, L, dtype=torch.long), None)
    want = float(batch_check_values(old, rollout, pm, CHECK_PARAMS)["mismatch/prefix_drift"])
    assert diagnose_drift(pd.Series(m)) == pytest.approx(want, rel=1e-9)


def _pm(points):
    """phase-map rows: (arm, dose, prefix_rms, beyond_fp32_band, seeds)."""
    return pd.DataFrame([{"arm": a, "dose": d, "drift": x / 3, "prefix_rms": x, "rollback": 0.05 * b,
                          "beyond_fp32_band": b, "seeds": n} for a, d, x, b, n in points])


def test_prefix_drift_calibration_by_the_registered_rule():
    from creditlab.labs.mismatch import prefix_drift_calibration

    m = _pm([("qat", "int8", 0.3, 0, 2), ("naive", "int8", 0.2, 0, 2), ("qat", "fp8", 1.1, 0, 2),
             ("naive", "fp8", 2.2, 1, 2), ("qat", "mxfp4", 2.3, 3, 5), ("naive", "mxfp4", 13.6, 5, 5),
             ("qat_interq", "mxfp4", 2.0, 5, 5)])  # InterQ is not an uncorrected learner: left out
    c = prefix_drift_calibration(m).set_index("threshold")
    assert list(c.index) == ["warn", "fail"]
    assert c.loc["fail", "prefix_rms"] == 2.2 and c.loc["fail", "point"] == "naive at fp8"  # 1 of 2: half
    assert c.loc["warn", "prefix_rms"] == 1.1 and c.loc["warn", "point"] == "QAT at fp8"
    safe = prefix_drift_calibration(_pm([("qat", "int8", 0.3, 0, 2), ("naive", "fp8", 2.2, 0, 2)]))
    assert list(safe["threshold"]) == ["largest safe"] and safe["prefix_rms"].iloc[0] == 2.2
    first = prefix_drift_calibration(_pm([("qat", "int8", 0.3, 2, 2), ("naive", "fp8", 2.2, 2, 2)]))
    assert list(first["threshold"]) == ["fail"] and first["prefix_rms"].iloc[0] == 0.3  # nothing safe below
    assert prefix_drift_calibration(pd.DataFrame()).empty


def test_only_the_registered_run_calibrates_and_a_subset_is_named():
    """`-e mxfp4` on the committed 2-core run used to rewrite its calibration's fail threshold from 8.13 to 13.6
    (three doses left out) without a word; a --quick run printed a calibration too."""
    from dataclasses import replace

    from creditlab.labs.mismatch import calibration_scope

    reg = MismatchConfig.two_core()
    assert calibration_scope(reg) == ""
    # where it lives and which order -e lists the doses in change no number
    assert calibration_scope(replace(reg, cache_dir="results/mismatch-2core", dump_dir="DUMPS",
                                     experiments=("nvfp4", "int8", "fp8", "mxfp4"))) == ""
    assert calibration_scope(replace(reg, experiments=("mxfp4",))) == (
        "it selects dose(s) mxfp4 of the registered mxfp4, fp8, int8, nvfp4 (-e), leaving out fp8, int8, nvfp4")
    dumped = calibration_scope(replace(reg, seeds=1, experiments=("mxfp4",)))  # the committed dumped/ run
    assert "leaving out fp8, int8, nvfp4" in dumped and "seeds 1 (registered: 5)" in dumped
    assert "grpo.updates 50 (registered: 100)" in calibration_scope(replace(reg, grpo=replace(reg.grpo, updates=50)))
    assert "smooth 1 (registered: 3)" in calibration_scope(replace(reg, smooth=1))
    assert calibration_scope(MismatchConfig.quick()) == (
        "this run is of the paper protocol, whose registration has no calibration rule (and it is shortened: "
        "--quick or --updates)")
    assert calibration_scope(MismatchConfig()).startswith("this run is of the paper protocol")
