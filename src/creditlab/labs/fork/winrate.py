"""The ``winrate`` experiment of the fork lab: the rubric-free headline metric, the share of prompts
on which an arm's response has a higher true quality than the initial policy's (ties count half),
exact judge. Its cells are the exact-judge cells of ``noise`` (shared when both run)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from creditlab.lab.experiment import Experiment, Prediction
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table
from creditlab.lab.report import read_diff, small_run_note
from creditlab.lab.runner import Cell
from creditlab.labs.fork import verdicts
from creditlab.labs.fork._common import _arm_rows, _bars, _paired
from creditlab.labs.fork.config import ForkLabConfig
from creditlab.labs.fork.noise import noise_cells


def _plot_winrate(t: pd.DataFrame, out: Path) -> Path:
    fig, ax = new_figure(figsize=(6, 4))
    _bars(ax, t, "win_rate", "win rate against the initial policy (true quality; ties half)")
    ax.axhline(0.5, color="grey", lw=1, ls=":")
    ax.set(ylim=(0, 1), ylabel="win rate")
    return save(fig, out / "fork_winrate.png")


#: The predictions of this experiment as written before its full run (docs/fork.md, "Predictions (written
#: before the full run)"), word for word: what a run records at its start.
WINRATE_STATED = (
    "4. **Win rate**: FORK's win rate against the initial policy well above recall-only's: FORK ≥ 0.75, "
    "recall-only ≤ 0.65, FORK − recall-only ≥ +0.15 with its interval above 0 (exact judge). *Falsified* "
    "if the interval of FORK − recall-only contains 0.",
)
#: Prediction 4, judged on the win-rate tables (the rule: :func:`creditlab.labs.fork.verdicts.verdict_win_rate`).
WINRATE_PREDICTIONS = (
    Prediction(f"4: win rate: FORK >= {verdicts.WIN_FORK:g}, recall-only <= {verdicts.WIN_RECALL:g}, FORK - "
               f"recall-only >= +{verdicts.WIN_LEAD:g} (interval above 0)", WINRATE_STATED[0],
               measured=verdicts.measured_win_rate, verdict=verdicts.judge_win_rate),
)


class WinRate(Experiment):
    """Win rate against the initial policy, exact judge (the noise experiment's cells at flip 0)."""

    name = "winrate"
    groups = ("noise",)
    predictions = WINRATE_PREDICTIONS

    def cells(self, cfg: ForkLabConfig) -> list[Cell]:
        return noise_cells(cfg, {1.0: 0.0})

    def tables(self, rows: dict[str, pd.DataFrame], cfg: ForkLabConfig) -> dict[str, Table]:
        df = rows["noise"]
        exact = df[df["flip"] == 0.0]
        if not len(exact):
            return {}
        fin, start = exact[exact["update"] == cfg.noise_updates], exact[exact["update"] == 0]
        return {"fork_winrate": Table(
                    _arm_rows(fin, start, cfg.noise_arms, ("win_rate", "quality"), ("length", "recall", "precision")),
                    "Win rate against the initial policy's responses (true quality, no rubric; exact judge)",
                    console=True),
                "fork_winrate_paired": Table(_paired(fin, cfg.noise_arms, ("win_rate", "quality"), []),
                                             "Win rate: FORK minus the other arms (paired seeds)")}

    def plots(self, tabs, cfg: ForkLabConfig, out: Path) -> list[Path]:
        return [_plot_winrate(tabs["fork_winrate"].frame, out)] if "fork_winrate" in tabs else []

    def interpret(self, tabs, cfg: ForkLabConfig) -> dict[str, str]:
        if "fork_winrate" not in tabs:
            return {}
        w = tabs["fork_winrate"].frame.set_index("arm")
        d = tabs["fork_winrate_paired"].frame
        return {"fork_winrate": (
            "Win rate: the share of evaluation prompts on which the arm's response has a higher true quality than the "
            "initial policy's response to the same prompt (ties count half; true quality = points of the facts stated "
            f"correctly - {cfg.quality_wrong:g} per incorrect unit - {cfg.quality_pitfall:g} for a pitfall; padding "
            "earns nothing). " + "; ".join(f"{a}: {r['win_rate']:.3f}" for a, r in w.iterrows())
            + ". Prediction 4 (its text is in lab.json): FORK's win rate well above recall-only's (FORK - "
            "recall-only >= +0.15, its interval above 0)." + small_run_note(cfg.noise_seeds)),
            "fork_winrate_paired": read_diff(d, ["metric"], "fork - other")}


EXPERIMENT = WinRate()
