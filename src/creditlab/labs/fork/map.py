"""The ``map`` experiment of the fork lab: where FORK keeps recall and where it trades recall for
precision, over the share of facts the policy knows and the judge's leniency on paraphrases."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd

from creditlab.errors import ConfigError
from creditlab.lab.experiment import Experiment
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table
from creditlab.lab.report import small_run_note
from creditlab.lab.runner import Cell
from creditlab.labs.fork.config import ForkLabConfig
from creditlab.train.bagofunits import (
    train_bag,
)
from creditlab.train.common import single_thread


def run_map_cell(arm: str, seed: int, known: float, lenient: bool, config: dict) -> list[dict]:
    """One ``map`` run: GRPO under ``arm`` with the share ``known`` of known facts and the judge's
    leniency; rows of the initial and the final policy."""
    base = ForkLabConfig.from_dict(config)
    cfg = replace(base, known_prob=known, lenient=lenient, updates=base.map_updates, eval_every=base.map_updates)
    with single_thread():
        rows = train_bag(arm, seed, cfg)
    return [{**r, "known": known, "lenient": lenient} for r in rows]


def map_table(final: pd.DataFrame, cfg: ForkLabConfig) -> pd.DataFrame:
    """Per (known, lenient, arm): means over seeds and the comparison with the recall-only arm."""
    cols = ["length", "recall", "precision", "redundant", "wrong", "filler"]
    m = final.groupby(["known", "lenient", "arm"])[cols].mean().reset_index()
    m["n"] = final.groupby(["known", "lenient", "arm"]).size().values
    ref = m[m["arm"] == "recall"].set_index(["known", "lenient"])
    out = []
    for _, r in m.iterrows():
        base = ref.loc[(r["known"], r["lenient"])]
        extra = base["length"] - r["length"]
        row = {**r.to_dict(), "length_ratio": base["length"] / r["length"] if r["length"] > 0 else float("nan"),
               "rel_recall": (r["recall"] - base["recall"]) / base["recall"] if base["recall"] > 0 else float("nan")}
        row["extra_redundant"] = (base["redundant"] - r["redundant"]) / extra if extra > 0.05 else float("nan")
        row["extra_wrong"] = (base["wrong"] - r["wrong"]) / extra if extra > 0.05 else float("nan")
        out.append(row)
    order = {a: i for i, a in enumerate(cfg.map_arms)}
    df = pd.DataFrame(out)
    return df.sort_values(["lenient", "known", "arm"], key=lambda c: c.map(order) if c.name == "arm" else c,
                          ascending=[False, True, True]).reset_index(drop=True)


def _plot_map(m: pd.DataFrame, out: Path) -> Path:
    colors = {"recall": "tab:red", "mean": "tab:blue", "fork": "tab:green", "f2": "tab:purple"}
    leniencies = sorted(m["lenient"].unique(), reverse=True)
    fig, axes = new_figure(2, len(leniencies), figsize=(5.5 * len(leniencies), 7), squeeze=False)
    for j, lenient in enumerate(leniencies):
        sub = m[(m["lenient"] == lenient) & (m["arm"] != "recall")]
        for arm, g in sub.groupby("arm", sort=False):
            g = g.sort_values("known")
            c = colors.get(arm, "tab:olive")
            axes[0][j].plot(g["known"], 100 * g["rel_recall"], "o-", color=c, label=arm)
            axes[1][j].plot(g["known"], g["length_ratio"], "o-", color=c, label=arm)
        judge = "lenient judge (paraphrases match)" if lenient else "strict judge (first statement only)"
        axes[0][j].axhline(0, color="grey", lw=1)
        axes[0][j].set(title=judge, xlabel="share of facts known", ylabel="recall change vs recall-only (%)")
        axes[1][j].axhline(1, color="grey", lw=1)
        axes[1][j].set(xlabel="share of facts known", ylabel="length ratio recall-only / arm")
        axes[0][j].legend(fontsize=8)
    return save(fig, out / "fork_map.png")


class Map(Experiment):
    """Where FORK keeps recall and where it trades it: known share x judge leniency."""

    name = "map"
    fields = ("map_known", "map_lenient", "map_arms", "map_seeds", "map_updates")

    def validate(self, cfg: ForkLabConfig) -> None:
        if self.name in cfg.experiments:
            if "recall" not in cfg.map_arms:
                raise ConfigError("map_arms", "the map compares every arm with 'recall': include it")
            for k in cfg.map_known:
                if not 0.0 <= k <= 1.0:
                    raise ConfigError("map_known", f"shares must be in [0, 1], got {k}")
            if cfg.map_seeds < 1 or cfg.map_updates < 1:
                raise ConfigError("map_seeds", "map_seeds and map_updates must be >= 1")

    def cells(self, cfg: ForkLabConfig) -> list[Cell]:
        ident = cfg.identity()
        return [Cell("map", f"known={k}/lenient={len_}/arm={arm}/seed={seed}", run_map_cell,
                     {"arm": arm, "seed": seed, "known": k, "lenient": len_, "config": ident})
                for k in cfg.map_known for len_ in cfg.map_lenient for arm in cfg.map_arms
                for seed in range(cfg.map_seeds)]

    def tables(self, rows: dict[str, pd.DataFrame], cfg: ForkLabConfig) -> dict[str, Table]:
        df = rows["map"]
        return {"fork_map_runs": Table(df, "map: every run (initial and final policy)", report=False),
                "fork_map": Table(map_table(df[df["update"] == cfg.map_updates], cfg),
                                  "Where FORK keeps recall and where it trades it (final policies, means over "
                                  "seeds)", console=True)}

    def plots(self, tabs, cfg: ForkLabConfig, out: Path) -> list[Path]:
        return [_plot_map(tabs["fork_map"].frame, out)]

    def interpret(self, tabs, cfg: ForkLabConfig) -> dict[str, str]:
        m = tabs["fork_map"].frame
        parts = []
        for lenient in cfg.map_lenient:
            g = m[(m["lenient"] == lenient) & (m["arm"] == "fork")].sort_values("known")
            parts.append(f"{'lenient' if lenient else 'strict'} judge, fork: relative recall change "
                         + ", ".join(f"{r:+.0%} at {k:g}" for k, r in zip(g["known"], g["rel_recall"], strict=True))
                         + "; length ratio " + ", ".join(f"{x:.1f}x" for x in g["length_ratio"]))
        return {"fork_map": (
            f"Each cell trains every arm from the same initial policies ({cfg.map_seeds} paired seeds, "
            f"{cfg.map_updates} updates) with a share `known` of the facts known for sure (the rest are guesses "
            "with confidence U(0.05, 0.95)) and a lenient or strict judge (a strict judge matches only the first "
            "statement of a fact to its rubric). length_ratio = recall-only length / arm length; rel_recall = "
            "(arm recall - recall-only recall) / recall-only recall; extra_redundant / extra_wrong: the share "
            "of recall-only's extra units (over the arm) that are restatements / wrong guesses. "
            + "; ".join(parts) + "." + small_run_note(cfg.map_seeds))}


EXPERIMENT = Map()
