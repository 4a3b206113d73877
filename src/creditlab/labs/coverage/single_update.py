"""The ``single_update`` experiment of the coverage lab.

The one-update protocol: many paired seeds, one update per arm from shared rollouts of a partly
trained base policy (same advantages, same binding grad-norm clip), and the exact held-out improvement
per arm (binary, uniform, per_turn, shuffled, discretized, reward_to_go). Its rollouts, clip and step
are the capability experiment's too.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from creditlab.errors import ConfigError
from creditlab.lab.experiment import Experiment
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table
from creditlab.lab.report import summarize
from creditlab.lab.runner import Cell
from creditlab.labs.coverage._common import (
    COLORS,
    DIFF,
    SINGLE_ARMS,
    _paired_improvements,
    check_in_episode,
    read_diffs,
    runs_table,
)
from creditlab.train.chain import ChainTrainConfig, ModelSpec, single_update

if TYPE_CHECKING:
    from creditlab.labs.coverage import CoverageConfig


def run_single_cell(exposure: str, C: int, seeds: int, train: dict, base_updates: int, step: float, clip: float,
                    rollouts: int) -> list[dict]:
    """The single-update experiment at one (exposure, C): every arm of :data:`SINGLE_ARMS` for each seed."""
    cfg = ChainTrainConfig(**train)
    specs = [ModelSpec(seed=s, C=C, arm=a, vd=1.0, exposure=exposure) for a in SINGLE_ARMS for s in range(seeds)]
    out = single_update(specs, cfg, base_updates=base_updates, step=step, clip=clip, rollouts=rollouts)
    vd = 1.0 / C if exposure == "final" else 1.0
    return [{"experiment": "single_update", **spec.row(), "vd": vd, "before": float(out["before"][m]),
             "after": float(out["after"][m]), "improvement": float(out["after"][m] - out["before"][m]),
             "grad_norm": float(out["grad_norm"][m]), "binding": bool(out["binding"][m])}
            for m, spec in enumerate(specs)]


def _live(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of the seeds where some arm has a gradient (a deterministic base policy moves no arm)."""
    alive = df.groupby(["exposure", "C", "seed"])["grad_norm"].transform("max") > 0
    return df[alive]


def single_update_table(df: pd.DataFrame) -> pd.DataFrame:
    live = _live(df)
    s = summarize(live, ["exposure", "C", "arm"], "improvement", DIFF)
    extra = live.groupby(["exposure", "C", "arm"]).agg(
        positive=("improvement", lambda v: int((v > 0).sum())), zero_grad=("grad_norm", lambda v: int((v == 0).sum())),
        binding=("binding", "mean")).reset_index()
    s = s.merge(extra, on=["exposure", "C", "arm"])
    uni = s[s["arm"] == "uniform"].set_index(["exposure", "C"])["mean"]
    s["gain_share"] = [m / uni.loc[(e, C)] if uni.loc[(e, C)] != 0 else np.nan
                       for e, C, m in zip(s["exposure"], s["C"], s["mean"], strict=True)]
    # the paper's definition: the share of the dense reward's gain over binary, (arm - binary) / (uniform - binary)
    binary = s[s["arm"] == "binary"].set_index(["exposure", "C"])["mean"]
    s["share_over_binary"] = [(m - binary.loc[(e, C)]) / (uni.loc[(e, C)] - binary.loc[(e, C)])
                              if (e, C) in binary.index and uni.loc[(e, C)] != binary.loc[(e, C)] else np.nan
                              for e, C, m in zip(s["exposure"], s["C"], s["mean"], strict=True)]
    dead = df.groupby(["exposure", "C"])["seed"].nunique() - live.groupby(["exposure", "C"])["seed"].nunique()
    s["seeds_left_out"] = [int(dead.loc[(e, C)]) for e, C in zip(s["exposure"], s["C"], strict=True)]
    s.insert(2, "V_d", [1.0 / C if e == "final" else 1.0 for e, C in zip(s["exposure"], s["C"], strict=True)])
    return s


def single_update_diffs(df: pd.DataFrame) -> pd.DataFrame:
    """Paired differences of the improvement between arms (same seed = same base policy and rollouts),
    with the number of seeds where the first arm improved more."""
    live = _live(df)
    pairs = [("per_turn", "shuffled"), ("per_turn", "uniform"), ("shuffled", "uniform"), ("discretized", "uniform"),
             ("binary", "uniform"), ("reward_to_go", "uniform")]
    return _paired_improvements(live, pairs, ["exposure", "C"])


def plot_single_update(s: pd.DataFrame, out: Path) -> Path:
    settings = s[["exposure", "C"]].drop_duplicates().values.tolist()
    fig, axes = new_figure(1, len(settings), figsize=(4.2 * len(settings), 4.0), sharey=True, squeeze=False)
    for ax, (ex, C) in zip(axes[0], settings, strict=True):
        g = s[(s["exposure"] == ex) & (s["C"] == C)].set_index("arm").reindex(list(SINGLE_ARMS))
        x = np.arange(len(g))
        ax.bar(x, g["mean"], yerr=[g["mean"] - g["lo"], g["hi"] - g["mean"]], capsize=3,
               color=[COLORS.get(a, "tab:gray") for a in g.index])
        ax.set_xticks(x, list(g.index), rotation=35, ha="right", fontsize=8)
        vd = 1.0 / C if ex == "final" else 1.0
        ax.set_title(f"{'final write only' if ex == 'final' else 'every causal step'} (C={C}, V_d={vd:.2f})",
                     fontsize=9)
        ax.axhline(0, color="grey", lw=1)
    axes[0][0].set_ylabel("held-out improvement of one update")
    return save(fig, out / "single_update.png")


class SingleUpdate(Experiment):
    """The one-update protocol: one update per arm from shared rollouts of a partly trained base."""

    name = "single_update"
    fields = ("single_seeds", "single_settings", "single_base_updates", "single_rollouts", "single_clip", "single_step")

    def validate(self, cfg: CoverageConfig) -> None:
        if self.name in cfg.experiments:
            check_in_episode([c for _, c in cfg.single_settings], cfg.train.T)
        for ex, _ in cfg.single_settings:
            if ex not in ("independent", "prefix", "final"):
                raise ConfigError("single_settings", f"unknown exposure {ex!r}")
        if cfg.single_seeds < 2 or cfg.single_rollouts < 2:
            raise ConfigError("single_seeds", f"needs single_seeds >= 2 and single_rollouts >= 2, got "
                                              f"{cfg.single_seeds}, {cfg.single_rollouts}")

    def cells(self, cfg: CoverageConfig) -> list[Cell]:
        return [Cell("single_update", f"{ex}/C={C}", run_single_cell,
                     {"exposure": ex, "C": C, "seeds": cfg.single_seeds, "train": asdict(cfg.train),
                      "base_updates": cfg.single_base_updates, "step": cfg.single_step, "clip": cfg.single_clip,
                      "rollouts": cfg.single_rollouts})
                for ex, C in cfg.single_settings]

    def tables(self, rows: dict[str, pd.DataFrame], cfg: CoverageConfig) -> dict[str, Table]:
        df, tabs = runs_table(self.name, rows[self.name])
        tabs["single_update"] = Table(single_update_table(df), "Single update from shared rollouts: held-out "
                                                               "improvement per arm")
        tabs["single_update_diff"] = Table(single_update_diffs(df), "Single update: paired differences",
                                           console=True)
        return tabs

    def plots(self, tabs, cfg: CoverageConfig, out: Path) -> list[Path]:
        return [plot_single_update(tabs["single_update"].frame, out)]

    def interpret(self, tabs, cfg: CoverageConfig) -> dict[str, str]:
        reading = (
            f"One update per arm from the same base policy ({cfg.single_base_updates} uniform-credit updates), "
            f"the same {cfg.single_rollouts} rollouts and advantages, a grad-norm clip of {cfg.single_clip} "
            f"(the share of updates where it binds is in the table) and one SGD step of {cfg.single_step}; the "
            "improvement is the exact expected reward after minus before, so no evaluation batch adds noise. "
            "Seeds whose base policy is already deterministic (every arm's gradient zero) are left out and "
            "counted. A binary reward has no gradient when no rollout completes the chain (zero_grad). "
            "gain_share is the arm's mean improvement over uniform's (the dense reward's); share_over_binary is "
            "the paper's measure of a coarser reward, the share of the dense reward's gain over binary that the arm "
            "keeps: (arm - binary) / (uniform - binary).")
        return {"single_update": reading,
                "single_update_diff": read_diffs(tabs["single_update_diff"].frame, ["exposure", "C"])}


EXPERIMENT = SingleUpdate()
