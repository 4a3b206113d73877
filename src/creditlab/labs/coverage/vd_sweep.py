"""The ``vd_sweep`` experiment of the coverage lab.

Verifier density V_d at C = ``vd_C``: ``uniform`` vs ``targeted`` (an independent local signal
on the exposed causal steps only), under independent and prefix exposure. Expected: uniform flat,
targeted rising with V_d and passing uniform only at high density.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from creditlab.core.diagnostics import expected_open_fraction
from creditlab.lab.experiment import Experiment
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table
from creditlab.lab.report import read_diff, small_run_note, summarize
from creditlab.lab.runner import Cell
from creditlab.labs.coverage._common import (
    COLORS,
    UNIT,
    _band,
    _cells_of,
    check_chains,
    check_densities,
    runs_of,
    runs_table,
    score_diffs,
)
from creditlab.train.chain import ModelSpec

if TYPE_CHECKING:
    from creditlab.labs.coverage import CoverageConfig

#: The arms of the V_d sweep: uniform credit, and credit targeted at the exposed causal steps.
ARMS = ("uniform", "targeted")
#: Which causal steps the verifier sees: each with probability V_d, or the first round(V_d x C).
EXPOSURES = ("independent", "prefix")


def plot_vd_sweep(df: pd.DataFrame, cfg, out: Path) -> Path:
    C = cfg.vd_C
    fig, axes = new_figure(1, 2, figsize=(11, 4.2), sharey=True)
    grid = np.linspace(0, 1, 101)
    for ax, ex in zip(axes, EXPOSURES, strict=True):
        sub = df[df["exposure"] == ex]
        if sub.empty:
            continue
        s = summarize(sub, ["vd", "arm"], "final_score", UNIT)
        for arm in ARMS:
            _band(ax, s[s["arm"] == arm], "vd", arm)
        analytic = expected_open_fraction(grid, C).numpy() if ex == "independent" else np.round(grid * C) / C
        ax.plot(grid, analytic, "--", color=COLORS["targeted"], alpha=0.7,
                label="analytic open fraction" + (" (geometric series)" if ex == "independent" else ""))
        ax.set(xlabel="verifier density V_d", title=f"{ex} exposure, C={C}", ylim=(0, 1.05))
        ax.legend(loc="upper left", fontsize=8)
    axes[0].set_ylabel("final score")
    return save(fig, out / "vd_sweep.png")


class VdSweep(Experiment):
    """Verifier density V_d: uniform vs targeted credit, under independent and prefix exposure."""

    name = "vd_sweep"
    fields = ("vd_C", "vds")

    def validate(self, cfg: CoverageConfig) -> None:
        check_chains((cfg.vd_C,), cfg.train.T)
        check_densities(cfg.vds)

    def cells(self, cfg: CoverageConfig) -> list[Cell]:
        S = range(cfg.seeds)
        return _cells_of("vd_sweep", {
            f"{ex}/vd={vd}": [ModelSpec(seed=s, C=cfg.vd_C, arm=a, vd=vd, exposure=ex) for a in ARMS for s in S]
            for ex in EXPOSURES for vd in cfg.vds}, cfg.train)

    def tables(self, rows: dict[str, pd.DataFrame], cfg: CoverageConfig) -> dict[str, Table]:
        df, tabs = runs_table(self.name, rows[self.name])
        s = summarize(df, ["exposure", "vd", "arm"], "final_score", UNIT)
        s["open_fraction"] = [float(expected_open_fraction(v, cfg.vd_C)) if e == "independent" else
                              round(v * cfg.vd_C) / cfg.vd_C
                              for e, v in zip(s["exposure"], s["vd"], strict=True)]
        tabs["vd_sweep"] = Table(s, f"Verifier-density sweep (C={cfg.vd_C}): uniform vs targeted")
        tabs["vd_sweep_diff"] = Table(score_diffs(df, [("targeted", "uniform")], ["exposure", "vd"]),
                                      "V_d sweep: paired difference targeted - uniform", console=True)
        return tabs

    def plots(self, tabs, cfg: CoverageConfig, out: Path) -> list[Path]:
        return [plot_vd_sweep(runs_of(tabs, self.name), cfg, out)]

    def interpret(self, tabs, cfg: CoverageConfig) -> dict[str, str]:
        reading = (
            "Final score against the verifier density V_d (share of causal steps whose local correctness the "
            "verifier sees): targeted credit goes only to those steps, uniform ignores the verifier. "
            "open_fraction is the analytic share of the chain that targeted credit can open (geometric "
            "series for independent exposure, the exposed prefix for prefix exposure). Expected: uniform "
            "flat, targeted rising with V_d and passing uniform only at high density." + small_run_note(cfg.seeds))
        return {"vd_sweep": reading,
                "vd_sweep_diff": read_diff(tabs["vd_sweep_diff"].frame, ["exposure", "vd"], "targeted - uniform")}


EXPERIMENT = VdSweep()
