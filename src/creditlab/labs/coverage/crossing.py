"""The ``crossing`` experiment of the coverage lab.

Where targeted credit passes uniform, on a finer V_d grid near the crossing (C = ``vd_C``, the
V_d sweep's), for independent-step and state-dependent chains, with a bootstrap interval over seeds.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from creditlab.errors import ConfigError
from creditlab.lab.experiment import Experiment
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table
from creditlab.lab.report import small_run_note
from creditlab.lab.runner import Cell
from creditlab.labs.coverage._common import (
    _cells_of,
    check_densities,
    runs_table,
    score_diffs,
)
from creditlab.train.chain import ModelSpec

if TYPE_CHECKING:
    from creditlab.labs.coverage import CoverageConfig


#: Kinds of chain of the crossing experiment: the policy sees the step index only, or also the
#: correct-prefix length and a broken bit (``ChainTrainConfig.state_dependent``).
CHAIN_KINDS = ("independent_step", "state_dependent")


#: The crossing points the credit-granularity paper reports (targeted passes uniform at this V_d).
PAPER_CROSSING = {"independent_step": 0.95, "state_dependent": 0.81}


def _last_crossing(vds: np.ndarray, D: np.ndarray) -> float:
    """Smallest V_d from which ``D`` stays >= 0 on the grid (linear interpolation into the last
    negative interval); ``vds[0]`` when ``D`` is never negative, NaN when it ends negative."""
    neg = np.nonzero(D < 0)[0]
    if len(neg) == 0:
        return float(vds[0])
    i = int(neg[-1])
    if i == len(vds) - 1:
        return float("nan")
    return float(vds[i] + (0.0 - D[i]) * (vds[i + 1] - vds[i]) / (D[i + 1] - D[i]))


def crossing_table(df: pd.DataFrame, cfg: CoverageConfig) -> pd.DataFrame:
    """Per chain type: the crossing V_d of the mean paired difference targeted - uniform, and its
    bootstrap 95% interval over seeds (percentiles of the resamples that cross)."""
    rng = np.random.default_rng(0)
    out = []
    for chain in CHAIN_KINDS:
        sub = df[df["chain"] == chain]
        if sub.empty:
            continue
        wide = sub.pivot_table(index=["seed", "vd"], columns="arm", values="final_score")
        d = (wide["targeted"] - wide["uniform"]).unstack("vd").sort_index(axis=1)  # (seeds, vds)
        vds, mat = d.columns.to_numpy(dtype=float), d.to_numpy()
        est = _last_crossing(vds, mat.mean(0))
        boots = np.array([_last_crossing(vds, mat[rng.integers(0, len(mat), len(mat))].mean(0))
                          for _ in range(cfg.crossing_bootstrap)]) if len(mat) > 1 else np.array([])
        ok = boots[~np.isnan(boots)]
        lo, hi = (np.percentile(ok, [2.5, 97.5]) if len(ok) else (np.nan, np.nan))
        out.append({"chain": chain, "crossing": est, "lo": float(lo), "hi": float(hi),
                    "no_crossing_share": float(np.isnan(boots).mean()) if len(boots) else np.nan,
                    "paper": PAPER_CROSSING[chain], "seeds": len(mat)})
    return pd.DataFrame(out)


def plot_crossing(curve: pd.DataFrame, cross: pd.DataFrame, out: Path) -> Path:
    fig, ax = new_figure(figsize=(8, 4.4))
    colors = {"independent_step": "tab:blue", "state_dependent": "tab:green"}
    for chain, g in curve.groupby("chain"):
        g = g.sort_values("vd")
        c = colors.get(chain)
        ax.plot(g["vd"], g["mean"], "o-", color=c, label=f"{chain}: targeted - uniform")
        ax.fill_between(g["vd"], g["lo"], g["hi"], color=c, alpha=0.15)
        r = cross[cross["chain"] == chain]
        if len(r) and not np.isnan(r["crossing"].iloc[0]):
            ax.axvline(r["crossing"].iloc[0], color=c, lw=1.5)
            if not np.isnan(r["lo"].iloc[0]):
                ax.axvspan(r["lo"].iloc[0], r["hi"].iloc[0], color=c, alpha=0.08)
        if len(r):
            ax.axvline(r["paper"].iloc[0], color=c, ls="--", lw=1, label=f"{chain}: paper {r['paper'].iloc[0]:.2f}")
    ax.axhline(0, color="grey", lw=1)
    ax.set(xlabel="verifier density V_d", ylabel="final score difference", title="where targeted credit passes "
           "uniform (solid: measured crossing, band: bootstrap 95%)")
    ax.legend(fontsize=7, loc="lower right")
    return save(fig, out / "crossing.png")


class Crossing(Experiment):
    """Where targeted credit passes uniform, for independent-step and state-dependent chains."""

    name = "crossing"
    fields = ("crossing_vds", "crossing_bootstrap")

    def validate(self, cfg: CoverageConfig) -> None:
        check_densities(cfg.crossing_vds)
        if cfg.crossing_bootstrap < 1:
            raise ConfigError("crossing_bootstrap", f"must be >= 1, got {cfg.crossing_bootstrap}")

    def cells(self, cfg: CoverageConfig) -> list[Cell]:
        S = range(cfg.seeds)
        out: list[Cell] = []
        for chain in CHAIN_KINDS:
            train = replace(cfg.train, state_dependent=chain == "state_dependent")
            out += _cells_of("crossing", {
                f"{chain}/vd={vd}": [ModelSpec(seed=s, C=cfg.vd_C, arm=a, vd=vd) for a in ("uniform", "targeted")
                                     for s in S]
                for vd in cfg.crossing_vds}, train)
        return out

    def tables(self, rows: dict[str, pd.DataFrame], cfg: CoverageConfig) -> dict[str, Table]:
        runs, tabs = runs_table(self.name, rows[self.name])
        independent, dependent = CHAIN_KINDS
        df = runs.assign(chain=lambda d: np.where(d["cfg_state_dependent"], dependent, independent))
        tabs["crossing_curve"] = Table(
            score_diffs(df, [("targeted", "uniform")], ["chain", "vd"]),
            f"Crossing (C={cfg.vd_C}, independent exposure): paired difference targeted - uniform by V_d")
        tabs["crossing"] = Table(crossing_table(df, cfg), "Crossing point: the V_d at which targeted credit "
                                                          "passes uniform (bootstrap 95% interval over seeds)",
                                 console=True)
        return tabs

    def plots(self, tabs, cfg: CoverageConfig, out: Path) -> list[Path]:
        return [plot_crossing(tabs["crossing_curve"].frame, tabs["crossing"].frame, out)]

    def interpret(self, tabs, cfg: CoverageConfig) -> dict[str, str]:
        reading = (
            "Paired difference targeted - uniform of the final score on a finer V_d grid, for chains whose "
            "policy sees only the step index (independent-step) and chains whose policy also sees the "
            "correct-prefix length and a broken bit (state-dependent)." + small_run_note(cfg.seeds))
        parts = []
        for _, r in tabs["crossing"].frame.iterrows():
            if np.isnan(r["crossing"]):
                parts.append(f"{r['chain']}: targeted does not pass uniform on the grid (up to V_d = 1)")
            else:
                ci = ("no interval" if np.isnan(r["lo"]) else f"95% interval [{r['lo']:.2f}, {r['hi']:.2f}]")
                parts.append(f"{r['chain']}: crossing at V_d = {r['crossing']:.2f} ({ci}; "
                             f"{r['no_crossing_share']:.0%} of bootstrap resamples never cross) against the "
                             f"paper's {r['paper']:.2f}")
        return {"crossing_curve": reading,
                "crossing": ("The crossing is the smallest V_d from which the mean paired difference stays >= 0 "
                             "on the grid, interpolated linearly; its interval resamples seeds. "
                             + "; ".join(parts) + ".")}


EXPERIMENT = Crossing()
