"""The ``c_sweep`` experiment of the coverage lab.

Chain length C at a fixed credit budget k: ``uniform`` vs ``concentrated`` on the first k
causal steps. Expected: a tie while C <= k, uniform ahead for every C > k.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from creditlab.core.diagnostics import p_cover
from creditlab.errors import ConfigError
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
    runs_of,
    runs_table,
    score_diffs,
)
from creditlab.train.chain import ModelSpec

if TYPE_CHECKING:
    from creditlab.labs.coverage import CoverageConfig

#: The arms of the C sweep: uniform credit, and credit concentrated on the first k causal steps.
ARMS = ("uniform", "concentrated")


def plot_c_sweep(df: pd.DataFrame, cfg, out: Path) -> Path:
    T, K, k = cfg.train.T, cfg.train.K, cfg.k
    s = summarize(df, ["C", "arm"], "final_score", UNIT)
    fig, (a1, a2) = new_figure(1, 2, figsize=(11, 4.2))
    for arm in ARMS:
        _band(a1, s[s["arm"] == arm], "C", arm)
    Cs = np.arange(1, T + 1)
    # concentrated credit can only teach the first k causal steps; the rest stay at chance 1/K
    ceiling = [(min(C, k) + sum(K ** -j for j in range(1, C - min(C, k) + 1))) / C for C in Cs]
    a1.plot(Cs, ceiling, "--", color=COLORS["concentrated"], alpha=0.7, label="analytic: untaught steps at chance 1/K")
    a1.axvline(k, color="grey", ls=":", lw=1)
    a1.text(k + 0.1, 0.05, f"C = k = {k}", color="grey")
    a1.set(xlabel="chain length C", ylabel="final score (expected prefix / C)", ylim=(0, 1.05),
           title=f"C sweep: credit on k={k} causal steps vs uniform")
    a1.legend(loc="lower left", fontsize=8)
    pc = np.array([float(p_cover(T, C, k)) for C in Cs])
    pos = pc > 0
    a2.semilogy(Cs[pos], pc[pos], "s-", color="black", label=f"P_cover(T={T}, C, k={k})")
    a2.plot(Cs[~pos], np.full((~pos).sum(), 1e-4), "kv", mfc="none", label="P_cover = 0 (C > k)")
    a2.set(xlabel="chain length C", ylabel="probability (log)",
           title="analytic: a random k-step update covers the chain")
    a2.set_ylim(5e-5, 2)
    a2.legend(fontsize=8)
    return save(fig, out / "c_sweep.png")


def plot_curves(df: pd.DataFrame, cfg, out: Path) -> Path:
    """Learning curves of the C sweep (mean over seeds)."""
    Cs = sorted(df["C"].unique())
    pick = [C for C in Cs if C in (cfg.k, cfg.k + 1, max(Cs))] or Cs[:3]
    fig, axes = new_figure(1, len(pick), figsize=(4 * len(pick), 3.6), sharey=True, squeeze=False)
    for ax, C in zip(axes[0], pick, strict=True):
        for arm in ARMS:
            sub = df[(df["C"] == C) & (df["arm"] == arm)]
            if sub.empty:
                continue
            curves = np.stack(sub["curve"].map(np.asarray).to_list())
            x = np.asarray(sub["eval_at"].iloc[0])
            ax.plot(x, curves.mean(0), color=COLORS[arm], label=arm)
            ax.fill_between(x, curves.min(0), curves.max(0), color=COLORS[arm], alpha=0.12)
        ax.set(title=f"C={C}", xlabel="update", ylim=(0, 1.05))
    axes[0][0].set_ylabel("score (mean; band = min..max over seeds)")
    axes[0][0].legend(fontsize=8)
    return save(fig, out / "c_sweep_curves.png")


class CSweep(Experiment):
    """Chain length C at a fixed credit budget k: uniform vs concentrated on the first k causal steps."""

    name = "c_sweep"
    fields = ("k", "Cs")

    def validate(self, cfg: CoverageConfig) -> None:
        if cfg.k < 1:
            raise ConfigError("k", f"must be >= 1, got {cfg.k}")
        check_chains(cfg.Cs, cfg.train.T)

    def cells(self, cfg: CoverageConfig) -> list[Cell]:
        S = range(cfg.seeds)
        return _cells_of("c_sweep", {
            f"C={C}": [ModelSpec(seed=s, C=C, arm=a, k=cfg.k) for a in ARMS for s in S]
            for C in cfg.Cs}, cfg.train)

    def tables(self, rows: dict[str, pd.DataFrame], cfg: CoverageConfig) -> dict[str, Table]:
        df, tabs = runs_table(self.name, rows[self.name])
        s = summarize(df, ["C", "arm"], "final_score", UNIT)
        s["P_cover"] = [float(p_cover(cfg.train.T, C, cfg.k)) for C in s["C"]]
        tabs["c_sweep"] = Table(s, f"C sweep (k={cfg.k}): uniform vs concentrated on the first k causal steps")
        tabs["c_sweep_diff"] = Table(score_diffs(df, [("uniform", "concentrated")], ["C"]),
                                     "C sweep: paired difference uniform - concentrated", console=True)
        return tabs

    def plots(self, tabs, cfg: CoverageConfig, out: Path) -> list[Path]:
        runs = runs_of(tabs, self.name)
        return [plot_c_sweep(runs, cfg, out), plot_curves(runs, cfg, out)]

    def interpret(self, tabs, cfg: CoverageConfig) -> dict[str, str]:
        s = tabs["c_sweep"].frame
        conc = s[s["arm"] == "concentrated"].set_index("C")["mean"]
        reading = (
            f"Final score per chain length C for uniform credit and credit concentrated on the first k={cfg.k} "
            f"causal steps; P_cover is the analytic chance that k random steps cover the whole chain. Expected: "
            f"a tie while C <= k, uniform ahead for every C > k. Concentrated scores "
            + ", ".join(f"{v:.2f} at C={c}" for c, v in conc.items()) + "." + small_run_note(cfg.seeds))
        return {"c_sweep": reading,
                "c_sweep_diff": read_diff(tabs["c_sweep_diff"].frame, ["C"], "uniform - concentrated")}


EXPERIMENT = CSweep()
