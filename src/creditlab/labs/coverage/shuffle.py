"""The ``shuffle`` experiment of the coverage lab.

``per_turn`` (credit where the verifier saw progress) vs ``shuffled`` (the same weights on
random steps) vs ``uniform``, at a dense and at a sparse verifier.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from creditlab.lab.experiment import Experiment
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table
from creditlab.lab.report import small_run_note, summarize
from creditlab.lab.runner import Cell
from creditlab.labs.coverage._common import (
    COLORS,
    UNIT,
    _cells_of,
    check_chains,
    check_densities,
    read_diffs,
    runs_of,
    runs_table,
    score_diffs,
)
from creditlab.train.chain import ModelSpec

if TYPE_CHECKING:
    from creditlab.labs.coverage import CoverageConfig

#: The arms of the shuffled control.
ARMS = ("uniform", "per_turn", "shuffled")


def plot_shuffle(df: pd.DataFrame, out: Path) -> Path:
    s = summarize(df, ["C", "vd", "arm"], "final_score", UNIT)
    confs = s[["C", "vd"]].drop_duplicates().sort_values(["C", "vd"], ascending=[True, False]).values.tolist()
    fig, ax = new_figure(figsize=(8, 4.2))
    w = 0.26
    for i, arm in enumerate(ARMS):
        ys, lo, hi = [], [], []
        for C, vd in confs:
            r = s[(s["C"] == C) & (s["vd"] == vd) & (s["arm"] == arm)].iloc[0]
            ys.append(r["mean"])
            lo.append(r["mean"] - r["lo"])
            hi.append(r["hi"] - r["mean"])
        ax.bar(np.arange(len(confs)) + (i - 1) * w, ys, w, yerr=[lo, hi], color=COLORS[arm], label=arm, capsize=3)
    ax.set_xticks(range(len(confs)), [f"C={int(C)}, V_d={vd:g}" for C, vd in confs])
    ax.set(ylabel="final score", ylim=(0, 1.05), title="shuffled control: same concentration, no aim")
    ax.legend(fontsize=8)
    return save(fig, out / "shuffle.png")


class Shuffle(Experiment):
    """The shuffled control: per_turn vs the same weights on random steps vs uniform."""

    name = "shuffle"
    fields = ("shuffle_Cs", "shuffle_vds")

    def validate(self, cfg: CoverageConfig) -> None:
        check_chains(cfg.shuffle_Cs, cfg.train.T)
        check_densities(cfg.shuffle_vds)

    def cells(self, cfg: CoverageConfig) -> list[Cell]:
        S = range(cfg.seeds)
        return _cells_of("shuffle", {
            f"C={C}/vd={vd}": [ModelSpec(seed=s, C=C, arm=a, vd=vd) for a in ARMS for s in S]
            for C in cfg.shuffle_Cs for vd in cfg.shuffle_vds}, cfg.train)

    def tables(self, rows: dict[str, pd.DataFrame], cfg: CoverageConfig) -> dict[str, Table]:
        df, tabs = runs_table(self.name, rows[self.name])
        tabs["shuffle"] = Table(summarize(df, ["C", "vd", "arm"], "final_score", UNIT),
                                "Shuffled control: uniform, per_turn, shuffled")
        pairs = [("per_turn", "shuffled"), ("per_turn", "uniform"), ("shuffled", "uniform")]
        tabs["shuffle_diff"] = Table(score_diffs(df, pairs, ["C", "vd"]), "Shuffled control: paired differences",
                                     console=True)
        return tabs

    def plots(self, tabs, cfg: CoverageConfig, out: Path) -> list[Path]:
        return [plot_shuffle(runs_of(tabs, self.name), out)]

    def interpret(self, tabs, cfg: CoverageConfig) -> dict[str, str]:
        reading = (
            "per_turn puts the credit on the steps where the verifier saw progress (among the exposed causal steps); "
            "shuffled permutes the same weights to random steps of the rollout (same concentration, no aim). If "
            "targeting helped because it aims well, per_turn would beat shuffled." + small_run_note(cfg.seeds))
        return {"shuffle": reading, "shuffle_diff": read_diffs(tabs["shuffle_diff"].frame, ["C", "vd"])}


EXPERIMENT = Shuffle()
