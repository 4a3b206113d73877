"""The fork lab's prediction verdicts (creditlab.labs.fork.verdicts) on hand-made tables: each rule
gives holds, fails and not judged where it should, the experiments' predictions make the lab's
``fork_predictions`` table, and docs/fork.md's verdicts are what the rules give on the page's own tables."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest

from creditlab.lab.experiment import PREDICTION_COLUMNS, Verdict, predictions_table
from creditlab.lab.protocol import Table
from creditlab.labs.fork import LAB
from creditlab.labs.fork import verdicts as v

H, F, N = Verdict.HOLDS, Verdict.FAILS, Verdict.NOT_JUDGED
NAN = math.nan


def paired(rows):
    """rows: (other, target_r, metric, mean, lo, hi)."""
    return pd.DataFrame([{"diff": f"fork - {o}", "target_r": t, "flip": 0.0, "metric": m, "mean": mu, "lo": lo,
                          "hi": hi, "n": 4} for o, t, m, mu, lo, hi in rows])


def both(other, intervals, targets=(1.0, 0.714)):
    return [(other, t, m, (lo + hi) / 2, lo, hi) for t in targets for m in ("f1", "win_rate") for lo, hi in
            [intervals.get((t, m), intervals.get("all"))]]


@pytest.mark.parametrize(("intervals", "targets", "expected"), [
    ({"all": (0.1, 0.3)}, (1.0, 0.714, 0.55), H),
    ({"all": (0.1, 0.3), (0.714, "win_rate"): (-0.01, 0.2)}, (1.0, 0.714), F),   # contains 0 at r 0.714
    ({"all": (0.1, 0.3), (0.55, "f1"): (-0.3, -0.1)}, (1.0, 0.714, 0.55), F),     # below 0 at another r
    ({"all": (0.1, 0.3)}, (1.0, 0.85), N),                                       # r 0.714 not run
    ({"all": (NAN, NAN)}, (1.0, 0.714), N),                                      # one seed: no interval
])
def test_prediction_1_lead_over_recall(intervals, targets, expected):
    assert v.verdict_lead_over_recall(paired(both("recall", intervals, targets))) is expected


def test_prediction_1_without_a_recall_arm_is_not_judged():
    assert v.verdict_lead_over_recall(paired(both("mean", {"all": (0.1, 0.3)}))) is N
    assert v.verdict_lead_over_recall(pd.DataFrame()) is N


@pytest.mark.parametrize(("intervals", "expected"), [
    ({"all": (-0.01, 0.02)}, H),
    ({"all": (-0.01, 0.02), (0.714, "f1"): (0.007, 0.03)}, F),    # FORK ahead: still not "within noise"
    ({"all": (-0.01, 0.02), (1.0, "win_rate"): (-0.05, -0.01)}, F),
    ({"all": (NAN, NAN)}, N),
])
def test_prediction_2_mean_within_noise(intervals, expected):
    assert v.verdict_mean_within_noise(paired(both("mean", intervals))) is expected


def noise(exact, noisy, target=0.714):
    return pd.DataFrame([{"target_r": 1.0, "flip": 0.0, "arm": "fork", "f1": exact},
                         {"target_r": target, "flip": 0.11, "arm": "fork", "f1": noisy},
                         {"target_r": 1.0, "flip": 0.0, "arm": "recall", "f1": 0.1}])


@pytest.mark.parametrize(("table", "expected"), [
    (noise(0.766, 0.758), H), (noise(0.766, 0.72), H), (noise(0.766, 0.70), F), (noise(0.766, 0.80), H),
    (noise(0.766, 0.70, target=0.85), N), (pd.DataFrame(), N)])
def test_prediction_3_noise_cost(table, expected):
    assert v.verdict_noise_cost(table) is expected


def winrate(fork, recall, mean, lo, hi):
    w = pd.DataFrame({"arm": ["initial policy", "recall", "fork"], "win_rate": [0.5, recall, fork]})
    d = pd.DataFrame([{"diff": "fork - recall", "metric": "win_rate", "mean": mean, "lo": lo, "hi": hi, "n": 4}])
    return w, d


@pytest.mark.parametrize(("args", "expected"), [
    ((0.861, 0.442, 0.418, 0.367, 0.469), H),
    ((0.861, 0.442, 0.418, -0.01, 0.8), F),     # interval contains 0
    ((0.70, 0.442, 0.258, 0.2, 0.3), F),        # FORK below 0.75
    ((0.861, 0.70, 0.161, 0.1, 0.2), F),        # recall-only above 0.65
    ((0.80, 0.65, 0.149, 0.1, 0.2), F),         # lead below +0.15
    ((0.861, 0.442, 0.418, NAN, NAN), N),
])
def test_prediction_4_win_rate(args, expected):
    assert v.verdict_win_rate(*winrate(*args)) is expected


def test_prediction_4_without_a_recall_arm_is_not_judged():
    w, d = winrate(0.861, 0.442, 0.418, 0.3, 0.5)
    assert v.verdict_win_rate(w[w["arm"] != "recall"], d) is N


def pitfalls(fork, recall):
    """fork / recall: {points: (lo, hi)}."""
    rows = []
    for arm, spans in (("fork", fork), ("recall", recall)):
        for p, (lo, hi) in spans.items():
            rows.append({"pitfall_points": p, "arm": arm, "absence_change": (lo + hi) / 2, "absence_change_lo": lo,
                         "absence_change_hi": hi})
    return pd.DataFrame(rows)


UP, DOWN, SPAN, NONE = (0.07, 0.2), (-0.9, -0.7), (-0.1, 0.1), (NAN, NAN)


@pytest.mark.parametrize(("fork", "expected"), [
    ({0: UP, 1: UP}, H), ({0: UP, 1: DOWN}, F), ({0: UP, 1: SPAN}, N), ({0: NONE, 1: UP}, N)])
def test_prediction_5_fork_part(fork, expected):
    assert v.verdict_pitfalls_fork(pitfalls(fork, {0: DOWN})) is expected


@pytest.mark.parametrize(("recall", "expected"), [
    ({0: DOWN, 1: UP}, H),
    ({0: UP, 1: UP}, F),        # the plan's recall-only prediction falsified where the rubric is left out
    ({0: DOWN, 1: DOWN}, F),    # lowers it even where the rubric is in the reward
    ({0: DOWN, 1: SPAN}, N), ({0: NONE, 1: UP}, N)])
def test_prediction_5_split_by_setting(recall, expected):
    assert v.verdict_pitfalls_split(pitfalls({0: UP, 1: UP}, recall)) is expected


def _judged(tabs) -> pd.DataFrame:
    """The lab's predictions table on ``tabs``: every experiment's predictions, in the order of its table."""
    return predictions_table([(e.name, p) for e in LAB.experiments for p in e.predictions], tabs)


def _label(prediction: str) -> str:
    return prediction.split(":")[0]


def test_the_predictions_table_has_a_row_per_prediction_whose_experiment_ran():
    w, d = winrate(0.861, 0.442, 0.418, 0.367, 0.469)
    t = _judged({"fork_winrate": Table(w, ""), "fork_winrate_paired": Table(d, "")})
    assert list(t.columns) == list(PREDICTION_COLUMNS) and LAB.predictions_name == "fork_predictions"
    assert list(t["experiment"]) == ["winrate"] and list(t["verdict"]) == ["holds"]
    assert t["prediction"].iloc[0].startswith("4: win rate: FORK >= 0.75")
    assert "fork - recall +0.418 [+0.367, +0.469]" in t["measured"].iloc[0]
    assert _judged({}).empty
    pit = _judged({"fork_pitfalls": Table(pitfalls({0: UP, 1: UP}, {0: DOWN, 1: UP}), "")})
    assert [_label(p) for p in pit["prediction"]] == ["5 (FORK)", "5 (split)"] and set(pit["verdict"]) == {"holds"}


@pytest.mark.parametrize(("judge", "tables", "expected"), [
    (v.judge_lead_over_recall, {"fork_noise_paired": paired(both("recall", {"all": (0.1, 0.3)}))}, H),
    (v.judge_lead_over_recall, {"fork_noise_paired": paired(both("recall", {"all": (-0.3, -0.1)}))}, F),
    (v.judge_lead_over_recall, {}, N),
    (v.judge_mean_within_noise, {"fork_noise_paired": paired(both("mean", {"all": (-0.01, 0.02)}))}, H),
    (v.judge_mean_within_noise, {"fork_noise_paired": paired(both("mean", {"all": (0.01, 0.02)}))}, F),
    (v.judge_mean_within_noise, {}, N),
    (v.judge_noise_cost, {"fork_noise": noise(0.766, 0.758)}, H),
    (v.judge_noise_cost, {"fork_noise": noise(0.766, 0.70)}, F),
    (v.judge_noise_cost, {}, N),
    (v.judge_pitfalls_fork, {"fork_pitfalls": pitfalls({0: UP}, {0: DOWN})}, H),
    (v.judge_pitfalls_fork, {"fork_pitfalls": pitfalls({0: DOWN}, {0: DOWN})}, F),
    (v.judge_pitfalls_split, {"fork_pitfalls": pitfalls({0: UP}, {0: UP})}, F),
    (v.judge_pitfalls_split, {}, N),
])
def test_each_prediction_is_judged_on_the_runs_tables(judge, tables, expected):
    assert judge({k: Table(f, k) for k, f in tables.items()}) is expected


def test_the_win_rate_prediction_is_judged_on_the_runs_tables():
    w, d = winrate(0.861, 0.442, 0.418, 0.367, 0.469)
    assert v.judge_win_rate({"fork_winrate": Table(w, ""), "fork_winrate_paired": Table(d, "")}) is H
    w, d = winrate(0.70, 0.442, 0.258, 0.2, 0.3)
    assert v.judge_win_rate({"fork_winrate": Table(w, ""), "fork_winrate_paired": Table(d, "")}) is F
    assert v.judge_win_rate({"fork_winrate": Table(w, "")}) is N


# ------------------------------------------------------------------------------------------------
# docs/fork.md: the verdicts it states are the rules' verdicts on its tables

DOC = Path(__file__).resolve().parents[1] / "docs" / "fork.md"


def _page_tables() -> list[pd.DataFrame]:
    blocks, cur = [], []
    for line in [*DOC.read_text(encoding="utf-8").splitlines(), ""]:
        if line.startswith("|"):
            cur.append(line)
        elif cur:
            blocks.append(cur)
            cur = []
    frames = []
    for b in blocks:
        head = [c.strip() for c in b[0].strip().strip("|").split("|")]
        rows = [[c.strip() for c in r.strip().strip("|").split("|")] for r in b[2:]]
        df = pd.DataFrame(rows, columns=head)
        for c in df:
            num = pd.to_numeric(df[c], errors="coerce")
            if num.notna().all():
                df[c] = num
        frames.append(df)
    return frames


def _last(frames, head):
    found = [f for f in frames if list(f.columns[:len(head)]) == head]
    assert found, f"docs/fork.md has no table starting with {head}"
    return found[-1]


def test_docs_fork_predictions_table_is_what_the_rules_give_on_the_pages_tables():
    frames = _page_tables()
    tabs = {"fork_noise_paired": _last(frames, ["diff", "target_r", "flip", "metric"]),
            "fork_noise": _last(frames, ["target_r", "flip", "arm", "f1"]),
            "fork_winrate": _last(frames, ["arm", "win_rate"]),
            "fork_winrate_paired": _last(frames, ["diff", "metric", "mean"]),
            "fork_pitfalls": _last(frames, ["pitfall_points", "arm", "absence"])}
    computed = _judged({k: Table(f, "") for k, f in tabs.items()})
    shown = _last(frames, list(PREDICTION_COLUMNS))
    assert list(shown["experiment"]) == list(computed["experiment"])
    assert list(shown["prediction"].astype(str)) == list(computed["prediction"])
    assert list(shown["verdict"]) == list(computed["verdict"])
    assert list(shown["measured"]) == list(computed["measured"])
    # the prose list under the table says the same
    text = DOC.read_text(encoding="utf-8")
    for label, verdict in zip(computed["prediction"].map(_label), computed["verdict"], strict=True):
        assert re.search(rf"\| {re.escape(label)}: [^\n]*\| {verdict} \|", text), (label, verdict)
