"""The verdicts of the fork lab's predictions (docs/fork.md, "Predictions (written before the full run)").

Each prediction's verdict is a pure function of the run's tables returning
:class:`~creditlab.lab.experiment.Verdict`: ``holds`` when what the prediction states is what the
tables show, ``fails`` when the tables show it is not, ``not judged`` when the run cannot say (the
experiment or the point it is about did not run, one seed gives no interval, or an interval the
prediction needs on one side of 0 spans 0 where the text does not make that a failure). The rules take
the table they read; ``judge_*`` and ``measured_*`` take the run's tables (by name): the
:class:`~creditlab.lab.experiment.Prediction` s of the experiments ``noise`` (1-3), ``winrate`` (4) and
``pitfalls`` (5), which the lab judges in its ``fork_predictions`` table.

The rules, by prediction:

1. FORK - recall-only, in true F1 and in win rate, has its 95% interval above 0 at every target r.
   Holds when every interval is above 0; fails when any is not; not judged without the judge noise
   the paper reports (r = :data:`~creditlab.labs.fork.config.PAPER_R`) or without intervals.
2. FORK - mean, in true F1 and in win rate, is within noise (interval containing 0) at every r.
   Holds when every interval contains 0; fails when any lies off 0 (the table says on which side).
3. FORK's true F1 at r = 0.714 is within 0.05 of its exact-judge F1: fails when it drops by more.
4. FORK's win rate >= 0.75, recall-only's <= 0.65, FORK - recall-only >= +0.15 with its interval above
   0 (exact judge): holds when all four are met, fails when any is not.
5. Pitfalls, two verdicts. *FORK*: its change in absence-rubric satisfaction has an interval above 0
   in every setting (holds), below 0 in some setting (fails), else not judged. *The split by setting*:
   recall-only's change has an interval below 0 where the absence rubric is left out of the reward
   (0 points) and above 0 where it is in the reward; fails where an interval lies on the other side.
"""

from __future__ import annotations

import math

import pandas as pd

from creditlab.lab.experiment import Tables, Verdict
from creditlab.labs.fork.config import PAPER_R

__all__ = ["NOISE_COST", "WIN_FORK", "WIN_LEAD", "WIN_RECALL", "judge_lead_over_recall", "judge_mean_within_noise",
           "judge_noise_cost", "judge_pitfalls_fork", "judge_pitfalls_split", "judge_win_rate", "measured_lead",
           "measured_mean", "measured_noise_cost", "measured_pitfalls", "measured_win_rate",
           "verdict_lead_over_recall", "verdict_mean_within_noise", "verdict_noise_cost", "verdict_pitfalls_fork",
           "verdict_pitfalls_split", "verdict_win_rate"]

#: Prediction 3: the most FORK's true F1 at r = 0.714 may drop below its exact-judge F1.
NOISE_COST = 0.05
#: Prediction 4: FORK's win rate at least, recall-only's at most, FORK - recall-only at least.
WIN_FORK, WIN_RECALL, WIN_LEAD = 0.75, 0.65, 0.15
_METRICS = ("f1", "win_rate")


def _at(target: float, values) -> pd.Series:
    return pd.Series([math.isclose(float(v), target, abs_tol=1e-6) for v in values], index=values.index)


def _diffs(paired: pd.DataFrame, other: str) -> pd.DataFrame:
    """The rows of FORK minus ``other`` in true F1 and win rate (empty when there are none)."""
    if paired is None or paired.empty or "diff" not in paired:
        return pd.DataFrame()
    return paired[(paired["diff"] == f"fork - {other}") & paired["metric"].isin(_METRICS)]


def _has_intervals(d: pd.DataFrame) -> bool:
    return bool(len(d)) and not (d["lo"].isna() | d["hi"].isna()).any()


def verdict_lead_over_recall(paired: pd.DataFrame) -> Verdict:
    """Prediction 1 on ``fork_noise_paired``: FORK - recall-only above 0 at every r (F1 and win rate)."""
    d = _diffs(paired, "recall")
    if not _has_intervals(d) or not _at(PAPER_R, d["target_r"]).any():
        return Verdict.NOT_JUDGED
    return Verdict.of(bool((d["lo"] > 0).all()))


def verdict_mean_within_noise(paired: pd.DataFrame) -> Verdict:
    """Prediction 2 on ``fork_noise_paired``: FORK - mean's interval contains 0 at every r (F1 and win rate)."""
    d = _diffs(paired, "mean")
    if not _has_intervals(d):
        return Verdict.NOT_JUDGED
    return Verdict.of(bool(((d["lo"] <= 0) & (d["hi"] >= 0)).all()))


def verdict_noise_cost(noise: pd.DataFrame) -> Verdict:
    """Prediction 3 on ``fork_noise``: FORK's mean true F1 at r = 0.714 is at most 0.05 below its
    exact-judge (flip 0) F1."""
    if noise is None or noise.empty:
        return Verdict.NOT_JUDGED
    fork = noise[noise["arm"] == "fork"]
    exact, noisy = fork[fork["flip"] == 0.0], fork[_at(PAPER_R, fork["target_r"])]
    if exact.empty or noisy.empty:
        return Verdict.NOT_JUDGED
    return Verdict.of(bool(float(exact["f1"].iloc[0]) - float(noisy["f1"].iloc[0]) <= NOISE_COST))


def verdict_win_rate(winrate: pd.DataFrame, paired: pd.DataFrame) -> Verdict:
    """Prediction 4 on ``fork_winrate`` and ``fork_winrate_paired``: FORK >= 0.75, recall-only <= 0.65,
    FORK - recall-only >= +0.15 with its interval above 0."""
    if winrate is None or winrate.empty or paired is None or paired.empty:
        return Verdict.NOT_JUDGED
    w = winrate.set_index("arm")["win_rate"]
    d = paired[(paired["diff"] == "fork - recall") & (paired["metric"] == "win_rate")]
    if not {"fork", "recall"} <= set(w.index) or not _has_intervals(d):
        return Verdict.NOT_JUDGED
    lead = d.iloc[0]
    return Verdict.of(bool(w["fork"] >= WIN_FORK and w["recall"] <= WIN_RECALL and lead["mean"] >= WIN_LEAD
                           and lead["lo"] > 0))


def _changes(pitfalls: pd.DataFrame, arm: str) -> pd.DataFrame:
    if pitfalls is None or pitfalls.empty:
        return pd.DataFrame()
    g = pitfalls[pitfalls["arm"] == arm]
    return g if len(g) and not (g["absence_change_lo"].isna() | g["absence_change_hi"].isna()).any() else g.iloc[:0]


def verdict_pitfalls_fork(pitfalls: pd.DataFrame) -> Verdict:
    """Prediction 5, FORK's part, on ``fork_pitfalls``: its change in absence satisfaction has an interval
    above 0 in every setting (holds) or below 0 in some setting (fails)."""
    g = _changes(pitfalls, "fork")
    if g.empty:
        return Verdict.NOT_JUDGED
    if (g["absence_change_hi"] < 0).any():
        return Verdict.FAILS
    return Verdict.HOLDS if (g["absence_change_lo"] > 0).all() else Verdict.NOT_JUDGED


def verdict_pitfalls_split(pitfalls: pd.DataFrame) -> Verdict:
    """Prediction 5, the split by setting, on ``fork_pitfalls``: recall-only's change has an interval below
    0 at 0 points (the absence rubric left out of the reward) and above 0 where it is in the reward."""
    g = _changes(pitfalls, "recall")
    if g.empty:
        return Verdict.NOT_JUDGED
    out = g["pitfall_points"] == 0
    expected = (out & (g["absence_change_hi"] < 0)) | (~out & (g["absence_change_lo"] > 0))
    opposite = (out & (g["absence_change_lo"] > 0)) | (~out & (g["absence_change_hi"] < 0))
    if opposite.any():
        return Verdict.FAILS
    return Verdict.HOLDS if expected.all() else Verdict.NOT_JUDGED


def _interval(r) -> str:
    return f"{r['mean']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}]"


def _by_r(d: pd.DataFrame) -> str:
    return "; ".join(f"{m} " + ", ".join(f"r {t:g} {_interval(r)}" for t, r in g.set_index("target_r").iterrows())
                     for m, g in d.groupby("metric", sort=False))


def _frame(tabs: Tables, name: str) -> pd.DataFrame | None:
    return tabs[name].frame if name in tabs else None


# the rules and what the run measured, on the run's tables (the predictions' ``verdict`` and ``measured``)


def judge_lead_over_recall(tabs: Tables) -> Verdict:
    return verdict_lead_over_recall(_frame(tabs, "fork_noise_paired"))


def judge_mean_within_noise(tabs: Tables) -> Verdict:
    return verdict_mean_within_noise(_frame(tabs, "fork_noise_paired"))


def judge_noise_cost(tabs: Tables) -> Verdict:
    return verdict_noise_cost(_frame(tabs, "fork_noise"))


def judge_win_rate(tabs: Tables) -> Verdict:
    return verdict_win_rate(_frame(tabs, "fork_winrate"), _frame(tabs, "fork_winrate_paired"))


def judge_pitfalls_fork(tabs: Tables) -> Verdict:
    return verdict_pitfalls_fork(_frame(tabs, "fork_pitfalls"))


def judge_pitfalls_split(tabs: Tables) -> Verdict:
    return verdict_pitfalls_split(_frame(tabs, "fork_pitfalls"))


def measured_lead(tabs: Tables) -> str | None:
    """Prediction 1: FORK - recall-only at every r (None: the noise experiment did not run)."""
    paired = _frame(tabs, "fork_noise_paired")
    return None if paired is None else _by_r(_diffs(paired, "recall")) or "no recall-only arm"


def measured_mean(tabs: Tables) -> str | None:
    """Prediction 2: FORK - mean at every r, and on which side of 0 it lies where it fails."""
    paired = _frame(tabs, "fork_noise_paired")
    if paired is None:
        return None
    mean, side = _diffs(paired, "mean"), ""
    if verdict_mean_within_noise(paired) is Verdict.FAILS:
        off = mean[(mean["lo"] > 0) | (mean["hi"] < 0)]
        side = (" (off 0 in FORK's favour)" if (off["lo"] > 0).all() else " (off 0 against FORK)"
                if (off["hi"] < 0).all() else " (off 0 on both sides)")
    return (_by_r(mean) or "no mean arm") + side


def measured_noise_cost(tabs: Tables) -> str | None:
    """Prediction 3: FORK's F1 at r 0.714 against its exact-judge F1."""
    noise = _frame(tabs, "fork_noise")
    if noise is None:
        return None
    fork = noise[noise["arm"] == "fork"]
    exact, noisy = fork[fork["flip"] == 0.0], fork[_at(PAPER_R, fork["target_r"])]
    return (f"F1 {float(noisy['f1'].iloc[0]):.3f} at r {PAPER_R:g} against {float(exact['f1'].iloc[0]):.3f} "
            f"exact ({float(noisy['f1'].iloc[0]) - float(exact['f1'].iloc[0]):+.3f})"
            if len(exact) and len(noisy) else f"no exact or r {PAPER_R:g} point")


def measured_win_rate(tabs: Tables) -> str | None:
    """Prediction 4: FORK's and recall-only's win rates, and FORK - recall-only."""
    winrate = _frame(tabs, "fork_winrate")
    if winrate is None:
        return None
    w = winrate.set_index("arm")["win_rate"]
    wp = _frame(tabs, "fork_winrate_paired")
    d = wp[(wp["diff"] == "fork - recall") & (wp["metric"] == "win_rate")] if wp is not None and len(wp) else None
    measured = ", ".join(f"{a} {w[a]:.3f}" for a in ("fork", "recall") if a in w.index)
    if d is not None and len(d):
        measured += f"; fork - recall {_interval(d.iloc[0])}"
    return measured


def measured_pitfalls(arm: str):
    """Prediction 5: ``arm``'s change in absence satisfaction in each setting."""
    def measured(tabs: Tables) -> str | None:
        pit = _frame(tabs, "fork_pitfalls")
        if pit is None:
            return None
        g = pit[pit["arm"] == arm]
        return "; ".join(f"{p:g} points {r['absence_change']:+.3f} [{r['absence_change_lo']:+.3f}, "
                         f"{r['absence_change_hi']:+.3f}]" for p, r in g.set_index("pitfall_points").iterrows()
                         ) or f"no {arm} arm"
    return measured
