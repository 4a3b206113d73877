"""Experiment budget of the granularity lab: what the process reward leaves to farm (hand-computed on
hand-made episodes), its gate, its settings and cells, its paired-difference table, and the verdicts of
B1-B3 on hand-made tables for every outcome."""

from __future__ import annotations

import math
from dataclasses import replace

import pandas as pd
import pytest
import torch

from creditlab.envs.toolshop import TurnRecord, make_task, run_scripted
from creditlab.errors import ConfigError
from creditlab.lab.experiment import Verdict, predictions_table
from creditlab.lab.protocol import Table
from creditlab.labs.granularity import LAB, GranularityConfig, budget
from creditlab.labs.granularity._common import setting_of
from creditlab.labs.granularity.world import farm_stats, process_scores
from creditlab.train.toolshop_rollout import RolloutBatch

HOLDS, FAILS, NOT_JUDGED = Verdict.HOLDS, Verdict.FAILS, Verdict.NOT_JUDGED


def _batch(task, episodes: list[list[TurnRecord]], truncated: list[bool]) -> RolloutBatch:
    B = len(episodes)
    return RolloutBatch(tokens=torch.zeros(B, 1, dtype=torch.long), policy_mask=torch.zeros(B, 1, dtype=torch.bool),
                        valid_mask=torch.ones(B, 1, dtype=torch.bool), rollout_logprobs=torch.zeros(B, 1),
                        turn_ids=torch.zeros(B, 1, dtype=torch.long), records=episodes,
                        success=torch.tensor([0.0 if t else 1.0 for t in truncated]), progress=torch.zeros(B),
                        truncated=torch.tensor(truncated), n_calls=torch.tensor([len(e) for e in episodes]),
                        tasks=[task] * B, group_ids=torch.zeros(B, dtype=torch.long))


def _episodes():
    """A chain of 3 (two reads, a write); episode 1: the first correct read, a read off the chain that
    returns an unseen value, the same read again, an error, the correct write; episode 2: the first read,
    then stopped with turns left (the token budget)."""
    task = make_task(11, 3)
    _, _, env = run_scripted(task, 0, noise=0.0)
    read, write = env.records[0], env.records[-1]
    assert not read.is_write and write.is_write
    other = dict(read.arguments)
    key = next(iter(other))
    other[key] = 987_654  # an id off the chain
    off = TurnRecord(read.name, other, [123_456_789], False, True)
    err = TurnRecord("<malformed>", {}, [], False, False, "bad")
    return task, [[read, off, off, err, write], [read]]


def test_farm_stats_by_hand():
    task, eps = _episodes()
    b = _batch(task, eps, [False, True])
    # scores: new read 1, off-chain new 1, the same read again 0.25, error 0, write 0; then the first read 1
    assert process_scores(b, 0.25)[0, :5].tolist() == [1.0, 1.0, 0.25, 0.0, 0.0]
    s = farm_stats(b, 0.25)
    mean = (1 + 1 + 0.25 + 0 + 0 + 1) / 6
    assert s["turns"] == 6 and s["rollouts"] == 2
    assert s["mean_turn_score"] == pytest.approx(mean)
    assert s["above_mean_share"] == pytest.approx(3 / 6)
    assert s["off_chain_rate"] == pytest.approx(2 / 6)
    assert s["off_chain_episodes"] == pytest.approx(1 / 2)
    assert s["off_chain_score"] == pytest.approx((1 + 0.25) / 2)
    assert s["off_chain_new_share"] == pytest.approx(1 / 2)
    assert s["truncation"] == 0.5 and s["token_truncation"] == 0.5  # 1 call of C + 2 = 5: turns were left
    assert s["tool_calls"] == 3.0 and s["success"] == 0.5
    # the same stop at an action budget of 1 turn is the action budget's, not the token budget's
    assert farm_stats(b, 0.25, max_turns=1)["token_truncation"] == 0.0


def test_farm_stats_without_off_chain_reads_has_no_score():
    task, eps = _episodes()
    s = farm_stats(_batch(task, [eps[1]], [False]), 0.25)
    assert s["off_chain_rate"] == 0.0 and math.isnan(s["off_chain_score"])


def _farm(score: float | None = 1.0, mean: float = 0.5, episodes: float = 0.2) -> pd.DataFrame:
    return pd.DataFrame([{"gate": "farm", "budget": "long", "off_chain_score": math.nan if score is None else score,
                          "mean_turn_score": mean, "off_chain_episodes": episodes}]).set_index("budget")


def test_the_gate_asks_an_off_chain_read_to_pay_above_the_mean_and_the_base_to_make_one():
    assert budget.gate_passes(_farm()) is True
    assert budget.gate_passes(_farm(score=0.4)) is False
    assert budget.gate_passes(_farm(episodes=0.001)) is False
    assert budget.gate_passes(_farm(score=None)) is False
    assert budget.gate_passes(_farm().rename(index={"long": "c2"})) is None


def test_the_settings_differ_in_the_action_budget_only():
    cfg = GranularityConfig()
    b_long, g_long, t_long = setting_of(cfg, "budget")
    b_c2, g_c2, t_c2 = setting_of(cfg, "budget_c2")
    assert b_long == b_c2 == cfg.budget_base == cfg.multi_base  # one cache entry with experiment multi
    assert g_long.max_turns == cfg.budget_turns == 12 and g_c2.max_turns is None
    assert replace(g_long, max_turns=None) == g_c2
    assert g_long.chain_lengths == (2, 3, 4) and g_long.max_len == 320 and t_long == t_c2 == {"short": (2, 3, 4)}


def test_the_cells_the_gate_first_then_whole_seeds():
    cfg = replace(GranularityConfig(), experiments=("budget",), seeds=2)
    cells = LAB.cells(cfg)
    assert [c.name for c in cells] == ["budget"] + [f"{a}/{b}/seed={s}" for s in range(2) for b, arms in
                                                     budget.BUDGET_ARMS.items() for a in arms]
    assert cfg.bases() == [cfg.base, cfg.budget_base]
    both = replace(cfg, experiments=("multi", "budget"))
    assert both.bases() == [cfg.base, cfg.multi_base]  # the same base policy once


@pytest.mark.parametrize("field,value", [("budget_turns", 6), ("budget_max_len", 400)])
def test_bad_budget_settings_name_their_field(field, value):
    with pytest.raises(ConfigError, match=field):
        replace(GranularityConfig(), **{field: value}).validate()


def test_the_paired_differences_by_hand():
    rows = []
    for s, (g2, f2, gl, fl, dl) in enumerate([((0.8, 0.1), (0.7, 0.2), (0.9, 0.0), (0.6, 0.4), (0.9, 0.1)),
                                              ((0.6, 0.3), (0.6, 0.2), (0.8, 0.1), (0.5, 0.5), (0.7, 0.1))]):
        for b, arm, (succ, trunc) in (("c2", "grpo", g2), ("c2", "prm_fixed", f2), ("long", "grpo", gl),
                                      ("long", "prm_fixed", fl), ("long", "prm_decay", dl)):
            rows.append({"budget": b, "arm": arm, "seed": s, "success": succ, "truncation": trunc,
                         "tool_calls": 4.0 + 10 * trunc})
    d = budget._budget_diffs(pd.DataFrame(rows)).set_index(["diff", "budget"])
    assert d.loc[("prm_fixed - grpo", "long"), "truncation"] == pytest.approx((0.4 + 0.4) / 2)
    assert d.loc[("prm_fixed - grpo", "long"), "tool_calls"] == pytest.approx(4.0)
    assert d.loc[("prm_decay - grpo", "long"), "success"] == pytest.approx((0.0 - 0.1) / 2)
    assert d.loc[("prm_fixed - grpo", "c2"), "success"] == pytest.approx((-0.1 + 0.0) / 2)
    assert d.loc[("grpo: long - C + 2", "both"), "success"] == pytest.approx((0.1 + 0.2) / 2)
    assert d.loc[("prm_fixed: long - C + 2", "both"), "truncation"] == pytest.approx((0.2 + 0.3) / 2)
    assert (d["n"] == 2).all()
    lo, hi = d.loc[("grpo: long - C + 2", "both"), ["success_lo", "success_hi"]]
    assert lo < 0.15 < hi


# ---------------------------------------------------------------------------------------------
# B1-B3 on hand-made tables


def _tabs(trunc=(0.3, 0.1, 0.5), calls=2.0, fixed_level=0.4, decay=(0.0, -0.1, 0.1), grpo=(0.0, -0.1, 0.1)):
    """budget_diffs with fixed - grpo (truncation mean, lo, hi; tool calls), decayed - grpo (truncation) and
    GRPO long - C + 2 (success); budget_means with the fixed arm's truncation at the long budget."""
    def row(diff, b, t=(0, 0, 0), c=0.0, s=(0, 0, 0)):
        return {"diff": diff, "budget": b, "success": s[0], "success_lo": s[1], "success_hi": s[2],
                "truncation": t[0], "truncation_lo": t[1], "truncation_hi": t[2], "tool_calls": c,
                "tool_calls_lo": c - 1, "tool_calls_hi": c + 1, "n": 3}

    diffs = pd.DataFrame([row("prm_fixed - grpo", "long", trunc, calls), row("prm_decay - grpo", "long", decay),
                          row("grpo: long - C + 2", "both", s=grpo)])
    means = pd.DataFrame([{"budget": "long", "arm": "prm_fixed", "truncation": fixed_level, "success": 0.5},
                          {"budget": "long", "arm": "grpo", "truncation": 0.1, "success": 0.8},
                          {"budget": "c2", "arm": "grpo", "truncation": 0.1, "success": 0.8}])
    return {"budget_diffs": Table(diffs, "d"), "budget_means": Table(means, "m")}


def test_b1_the_fixed_weight_farms_to_a_partial_level():
    assert budget.b1_verdict(_tabs()) is HOLDS
    assert budget.b1_verdict(_tabs(trunc=(0.3, -0.1, 0.7))) is NOT_JUDGED  # interval spans 0
    assert budget.b1_verdict(_tabs(trunc=(0.04, 0.01, 0.07))) is FAILS  # no real rise
    assert budget.b1_verdict(_tabs(calls=0.0)) is FAILS
    assert budget.b1_verdict(_tabs(fixed_level=0.95)) is FAILS  # all or nothing
    assert budget.b1_verdict(_tabs(fixed_level=0.05)) is FAILS
    assert budget.b1_verdict({}) is NOT_JUDGED


def test_b2_the_decayed_weight_does_not_farm():
    assert budget.b2_verdict(_tabs()) is HOLDS
    assert budget.b2_verdict(_tabs(decay=(0.2, -0.05, 0.45))) is HOLDS  # a rise within noise
    assert budget.b2_verdict(_tabs(decay=(0.2, 0.05, 0.35))) is FAILS
    assert budget.b2_verdict({}) is NOT_JUDGED


def test_b3_grpo_is_not_hurt_by_the_long_budget():
    assert budget.b3_verdict(_tabs()) is HOLDS
    assert budget.b3_verdict(_tabs(grpo=(-0.04, -0.2, 0.1))) is HOLDS
    assert budget.b3_verdict(_tabs(grpo=(-0.06, -0.2, 0.1))) is FAILS
    assert budget.b3_verdict({}) is NOT_JUDGED


def test_the_predictions_table_writes_the_budget_verdicts():
    p = predictions_table([("budget", p) for p in budget.PREDICTIONS], _tabs(trunc=(0.3, -0.1, 0.7)))
    said = {c.split(":")[0]: v for c, v in zip(p["prediction"], p["verdict"], strict=True)}
    assert said == {"B1": "not judged (not resolved: the interval spans 0)", "B2": "holds", "B3": "holds"}
    assert set(p["experiment"]) == {"budget"}
    assert "fixed-λ truncation 40%" in p["measured"].iloc[0]


def test_a_gate_without_any_off_chain_read_fails_and_still_reads():
    """The store drops a column NaN in every row: a base that made no off-chain read has no off_chain_score."""
    row = {"gate": "farm", "mean_turn_score": 0.5, "above_mean_share": 0.5, "off_chain_rate": 0.0,
           "off_chain_episodes": 0.0, "truncation": 0.1, "token_truncation": 0.0, "tool_calls": 3.0, "success": 0.6}
    gates = pd.DataFrame([{**row, "budget": "c2"}, {**row, "budget": "long"}])
    cfg = GranularityConfig()
    rows = budget.EXPERIMENT.gate_rows(gates, cfg)
    assert [r["passes"] for r in rows] == [None, False] and all(math.isnan(r["measured"]) for r in rows)
    tabs = budget.EXPERIMENT.tables({"gates": gates}, cfg)
    assert "no off-chain read" in budget.EXPERIMENT.interpret(tabs, cfg)["budget_gate"]
