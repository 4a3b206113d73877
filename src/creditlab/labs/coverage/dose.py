"""The ``dose`` experiment of the coverage lab.

Credit on k random steps per rollout (fixed total credit), dose k = 1..T.
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
from creditlab.lab.report import small_run_note, summarize
from creditlab.lab.runner import Cell
from creditlab.labs.coverage._common import (
    COLORS,
    UNIT,
    _cells_of,
    check_chains,
    runs_of,
    runs_table,
)
from creditlab.train.chain import ModelSpec

if TYPE_CHECKING:
    from creditlab.labs.coverage import CoverageConfig


def plot_dose(df: pd.DataFrame, cfg, out: Path) -> Path:
    T, C = cfg.train.T, cfg.dose_C
    sub = df[df["arm"] == "random_k"]
    fig, ax = new_figure(figsize=(7, 4.2))
    for value, style in (("final_score", "o-"), ("aulc", "s--")):
        s = summarize(sub, ["k"], value, UNIT).sort_values("k")
        ax.plot(s["k"], s["mean"], style, color="tab:brown", label=f"random k steps: {value}")
        ax.fill_between(s["k"], s["lo"], s["hi"], color="tab:brown", alpha=0.15)
    u = df[df["arm"] == "uniform"]
    if not u.empty:
        ax.axhline(u["final_score"].mean(), color=COLORS["uniform"], ls=":", label="uniform: final_score")
    ks = np.arange(1, T + 1)
    ax2 = ax.twinx()
    ax2.plot(ks, [float(p_cover(T, C, k)) for k in ks], "k-.", alpha=0.6, label="P_cover(T, C, k)")
    ax2.set_ylabel("P_cover (analytic)")
    ax2.set_ylim(0, 1.05)
    ax.set(xlabel="steps receiving credit per rollout (k)", ylabel="score", ylim=(0, 1.05),
           title=f"dose-response of coverage (C={C}, T={T})")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="lower right")
    return save(fig, out / "dose.png")


class Dose(Experiment):
    """Dose-response of coverage: credit on k random steps per rollout."""

    name = "dose"
    fields = ("dose_C", "dose_ks")

    def validate(self, cfg: CoverageConfig) -> None:
        T = cfg.train.T
        check_chains((cfg.dose_C,), T)
        for k in cfg.dose_ks:
            if not 1 <= k <= T:
                raise ConfigError("k", f"dose k must be in [1, T={T}], got {k}")

    def cells(self, cfg: CoverageConfig) -> list[Cell]:
        S = range(cfg.seeds)
        groups = {f"k={k}": [ModelSpec(seed=s, C=cfg.dose_C, arm="random_k", k=k) for s in S]
                  for k in cfg.dose_ks}
        groups["uniform"] = [ModelSpec(seed=s, C=cfg.dose_C, arm="uniform", k=cfg.train.T) for s in S]
        return _cells_of("dose", groups, cfg.train)

    def tables(self, rows: dict[str, pd.DataFrame], cfg: CoverageConfig) -> dict[str, Table]:
        df, tabs = runs_table(self.name, rows[self.name])
        s = summarize(df, ["arm", "k"], "final_score", UNIT)
        s["aulc"] = summarize(df, ["arm", "k"], "aulc")["mean"]
        s["P_cover"] = [float(p_cover(cfg.train.T, cfg.dose_C, k)) for k in s["k"]]
        tabs["dose"] = Table(s, f"Dose-response of coverage (C={cfg.dose_C})")
        return tabs

    def plots(self, tabs, cfg: CoverageConfig, out: Path) -> list[Path]:
        return [plot_dose(runs_of(tabs, self.name), cfg, out)]

    def interpret(self, tabs, cfg: CoverageConfig) -> dict[str, str]:
        s = tabs["dose"].frame
        rk = s[s["arm"] == "random_k"].sort_values("k")
        return {"dose": (
            f"Credit on k steps drawn at random per rollout (same total credit), C={cfg.dose_C}; P_cover is the "
            "analytic chance that one rollout's credit covers the chain. Final score by k: "
            + ", ".join(f"{m:.2f} (k={int(k)})" for k, m in zip(rk["k"], rk["mean"], strict=True))
            + ". Expected: rising with k toward uniform as coverage grows." + small_run_note(cfg.seeds))}


EXPERIMENT = Dose()
