"""The ``pitfalls`` experiment of the fork lab: a world with a tempting pitfall (a sweeping claim
buys recall for sure, is incorrect and violates an absence rubric): absence-rubric satisfaction before
and after training."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pandas as pd

from creditlab.errors import ConfigError
from creditlab.lab.experiment import Experiment, Prediction
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table, check_count
from creditlab.lab.report import read_diff, small_run_note
from creditlab.lab.runner import Cell
from creditlab.labs.fork import verdicts
from creditlab.labs.fork._common import _arm_rows, _bars, _paired
from creditlab.labs.fork.config import ForkLabConfig
from creditlab.train.bagofunits import (
    reward_of,
    train_bag,
)
from creditlab.train.common import single_thread


def run_pitfall_cell(arm: str, seed: int, points: float, config: dict) -> list[dict]:
    """One ``pitfalls`` run: GRPO under ``arm`` in the world with pitfalls, the absence rubric worth
    ``points`` in the reward's rubric (judge noise as ``judge_flip``); extended evaluation of the
    initial policy and every quarter of training."""
    base = ForkLabConfig.from_dict(config)
    cfg = replace(base, pitfalls=True, pitfall_points=points, updates=base.pitfall_updates,
                  eval_every=max(1, base.pitfall_updates // 4))
    with single_thread():
        return [{**r, "pitfall_points": points} for r in train_bag(arm, seed, cfg, extended=True)]


def _pitfall_tables(df: pd.DataFrame, cfg: ForkLabConfig) -> dict[str, Table]:
    key = ["pitfall_points", "arm", "seed"]
    fin, start = df[df["update"] == cfg.pitfall_updates], df[df["update"] == 0]
    gain = fin.set_index(key)["absence"] - start.set_index(key)["absence"]
    fin = fin.merge(gain.rename("absence_change").reset_index(), on=key)
    parts, paired = [], []
    for w in cfg.pitfall_weights:
        f, s0 = fin[fin["pitfall_points"] == w], start[start["pitfall_points"] == w].assign(absence_change=0.0)
        t = _arm_rows(f, s0, cfg.pitfall_arms, ("absence", "absence_change", "win_rate"),
                      ("sweep", "quality", "recall", "precision", "length"))
        parts.append(t.assign(pitfall_points=w)[["pitfall_points", *t.columns]])
        if "fork" in cfg.pitfall_arms and len(cfg.pitfall_arms) > 1:
            paired.append(_paired(f, cfg.pitfall_arms, ("absence", "win_rate"), ["pitfall_points"]))
    tabs = {"fork_pitfalls": Table(pd.concat(parts, ignore_index=True), "Absence rubric (no sweeping claims): "
                                   "satisfaction before and after training", console=True),
            "fork_pitfalls_curves": Table(df.sort_values(key + ["update"]).reset_index(drop=True),
                                          "pitfalls: every evaluation point", report=False)}
    if paired:
        tabs["fork_pitfalls_paired"] = Table(pd.concat(paired, ignore_index=True),
                                             "Pitfalls: FORK minus the other arms (paired seeds)")
    return tabs


def _plot_pitfalls(t: pd.DataFrame, out: Path) -> Path:
    weights = list(dict.fromkeys(t["pitfall_points"]))
    fig, axes = new_figure(len(weights), 2, figsize=(11, 3.6 * len(weights)), squeeze=False)
    for i, w in enumerate(weights):
        g = t[t["pitfall_points"] == w]
        _bars(axes[i][0], g, "absence", f"absence-rubric satisfaction (absence rubric: {w:g} points in the reward)")
        axes[i][0].set(ylim=(0, 1.05), ylabel="share of responses")
        _bars(axes[i][1], g, "win_rate", f"win rate against the initial policy ({w:g} points)")
        axes[i][1].axhline(0.5, color="grey", lw=1, ls=":")
        axes[i][1].set(ylim=(0, 1), ylabel="win rate")
    return save(fig, out / "fork_pitfalls.png")


#: The predictions of this experiment as written before its full run (docs/fork.md, "Predictions (written
#: before the full run)"), word for word: what a run records at its start.
PITFALLS_STATED = (
    "5. **Pitfalls**, the plan's prediction: FORK raises absence-rubric satisfaction, recall-only lowers "
    "it. What I expect from the quick run is a split by setting. With the absence rubric **left out of "
    "the reward** (0 points), recall-only lowers satisfaction (towards 0: sweeps are free recall) and "
    "FORK raises it (towards 1: a sweep is an incorrect unit, which precision charges): the plan's "
    "prediction holds. With it **in the reward at 1 point**, every arm, recall-only included, raises it "
    "to about 1: recall-only can hedge with repeated guesses for free, so a sweep gains it less recall "
    "than the pitfall costs; the recall-only half of the plan's prediction fails there. *Falsified* (the "
    "part about FORK) if FORK's satisfaction change has an interval below 0 in either setting; the "
    "recall-only part is falsified in a setting where recall-only's change has an interval above 0.",
)
#: Prediction 5, judged in two parts on ``fork_pitfalls`` (the rules: :mod:`creditlab.labs.fork.verdicts`).
PITFALLS_PREDICTIONS = (
    Prediction("5 (FORK): FORK raises absence satisfaction in every setting", PITFALLS_STATED[0],
               measured=verdicts.measured_pitfalls("fork"), verdict=verdicts.judge_pitfalls_fork),
    Prediction("5 (split): recall-only lowers it at 0 points, raises it where the rubric is in the reward",
               PITFALLS_STATED[0], measured=verdicts.measured_pitfalls("recall"),
               verdict=verdicts.judge_pitfalls_split),
)


class Pitfalls(Experiment):
    """Absence-rubric satisfaction before and after training, in a world with pitfalls."""

    name = "pitfalls"
    fields = ("pitfall_arms", "pitfall_weights", "pitfall_seeds", "pitfall_updates")
    predictions = PITFALLS_PREDICTIONS

    def validate(self, cfg: ForkLabConfig) -> None:
        for name in ("pitfall_seeds", "pitfall_updates"):
            check_count(getattr(cfg, name), name)
        for a in cfg.pitfall_arms:
            reward_of(a, cfg.beta)
        if self.name in cfg.experiments and not cfg.pitfall_arms:
            raise ConfigError("pitfall_arms", "needs at least one arm")
        if not cfg.pitfall_weights or any(not (math.isfinite(w) and w >= 0) for w in cfg.pitfall_weights):
            raise ConfigError("pitfall_weights", f"points finite and >= 0; got {list(cfg.pitfall_weights)}")

    def cells(self, cfg: ForkLabConfig) -> list[Cell]:
        ident = cfg.identity()
        return [Cell("pitfalls", f"points={w:g}/arm={arm}/seed={seed}", run_pitfall_cell,
                     {"arm": arm, "seed": seed, "points": float(w), "config": ident})
                for w in cfg.pitfall_weights for seed in range(cfg.pitfall_seeds) for arm in cfg.pitfall_arms]

    def tables(self, rows: dict[str, pd.DataFrame], cfg: ForkLabConfig) -> dict[str, Table]:
        return _pitfall_tables(rows["pitfalls"], cfg)

    def plots(self, tabs, cfg: ForkLabConfig, out: Path) -> list[Path]:
        return [_plot_pitfalls(tabs["fork_pitfalls"].frame, out)]

    def interpret(self, tabs, cfg: ForkLabConfig) -> dict[str, str]:
        t = tabs["fork_pitfalls"].frame
        parts = [f"absence rubric worth {w:g} points in the reward: " + ", ".join(
            f"{r['arm']} {r['absence']:.3f} ({r['absence_change']:+.3f}, {r['sweep']:.2f} sweeps/response)"
            for _, r in g.iterrows()) for w, g in t.groupby("pitfall_points", sort=False)]
        text = {"fork_pitfalls": (
            "World with pitfalls: a sweep on fact f ('it is A, B or C') always matches rubric f, is incorrect and "
            "violates the prompt's absence rubric (0 points: the absence rubric is left out of the reward's rubric, "
            "only the evaluation knows it). absence = share of responses satisfying it (change from the initial "
            "policy, paired by seed). " + "; ".join(parts)
            + ". Prediction 5 (its text is in lab.json): FORK raises absence satisfaction in both settings; "
            "recall-only lowers it where the absence rubric is left out of the reward (0 points) and, like every "
            "arm, raises it where the rubric is in the reward."
            + small_run_note(cfg.pitfall_seeds))}
        if "fork_pitfalls_paired" in tabs:
            text["fork_pitfalls_paired"] = read_diff(tabs["fork_pitfalls_paired"].frame, ["pitfall_points", "metric"],
                                                     "fork - other")
        return text


EXPERIMENT = Pitfalls()
