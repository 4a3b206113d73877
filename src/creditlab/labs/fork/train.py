"""The ``train`` experiment of the fork lab: GRPO under every reward arm of ``arms``, evaluated over
training; the final policies' anatomy and FORK's paired differences with the other arms."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from creditlab.lab.experiment import Experiment
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table
from creditlab.lab.report import paired_diff, read_diff, small_run_note, summarize
from creditlab.lab.runner import Cell
from creditlab.labs.fork._common import METRICS, UNIT_METRICS
from creditlab.labs.fork.config import ForkLabConfig
from creditlab.train.bagofunits import (
    train_bag,
)
from creditlab.train.common import single_thread


def run_fork_cell(arm: str, seed: int, config: dict) -> list[dict]:
    """Train one policy under ``arm`` with ``seed``; one row per evaluation point."""
    cfg = ForkLabConfig.from_dict(config)
    with single_thread():  # tiny tensors; the sweep runs one process per core
        return train_bag(arm, seed, cfg)


def summary_tables(df: pd.DataFrame, cfg: ForkLabConfig) -> dict[str, pd.DataFrame]:
    """Final-point means with 95% intervals per arm (``final``), and paired differences FORK - others
    (``paired``)."""
    final = df[df["update"] == cfg.updates]
    start = df[df["update"] == 0]
    rows = []
    for arm in cfg.arms:
        row: dict[str, object] = {"arm": arm}
        for m in METRICS:
            s = summarize(final[final["arm"] == arm], ["arm"], m, (0.0, 1.0) if m in UNIT_METRICS else None).iloc[0]
            row[m] = f"{s['mean']:.3f} [{s['lo']:.3f}, {s['hi']:.3f}]"
        rows.append(row)
    init: dict[str, object] = {"arm": "initial policy"}
    for m in METRICS:
        init[m] = f"{start[m].mean():.3f}"
    tables = {"final": pd.DataFrame([init, *rows])}
    diffs = []
    if "fork" in cfg.arms:
        for other in cfg.arms:
            if other == "fork":
                continue
            for m in ("length", "recall", "precision", "wrong", "redundant"):
                d = paired_diff(final, "fork", other, [], m)
                diffs.append({"diff": f"fork - {other}", "metric": m, "mean": d["mean"].iloc[0],
                              "lo": d["lo"].iloc[0], "hi": d["hi"].iloc[0], "pairs": int(d["n"].iloc[0])})
    tables["paired"] = pd.DataFrame(diffs)
    return tables


def _plot(df: pd.DataFrame, cfg: ForkLabConfig, out: Path) -> list[Path]:
    colors = {"recall": "tab:red", "mean": "tab:blue", "fork": "tab:green", "f2": "tab:purple"}
    panels = [("length", "response length (units)"), ("recall", "recall"), ("precision", "precision"),
              ("wrong", "wrong units per response"), ("redundant", "redundant units per response"),
              ("f1", "F1 of P and Rec")]
    fig, axes = new_figure(2, 3, figsize=(13, 7))
    for ax, (m, title) in zip(axes.flat, panels, strict=True):
        for arm in cfg.arms:
            g = df[df["arm"] == arm].groupby("update")[m]
            mean, sd, n = g.mean(), g.std().fillna(0.0), g.count()
            half = 1.96 * sd / n.clip(lower=1) ** 0.5
            ax.plot(mean.index, mean.values, color=colors[arm], label=arm)
            ax.fill_between(mean.index, (mean - half).values, (mean + half).values, color=colors[arm], alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("GRPO update")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(title="reward")
    fig.suptitle(f"fork lab: GRPO under rewards {', '.join(cfg.arms)} ({cfg.seeds} seeds, mean ± 95% CI)")
    curves = save(fig, out / "fork_curves.png")

    final = df[df["update"] == cfg.updates]
    fig, ax = new_figure(figsize=(7, 4.2))
    parts = ["necessary", "redundant", "wrong", "filler"]
    pcolors = ["tab:green", "tab:orange", "tab:red", "tab:gray"]
    bottom = [0.0] * len(cfg.arms)
    for part, c in zip(parts, pcolors, strict=True):
        vals = [float(final[final["arm"] == a][part].mean()) for a in cfg.arms]
        ax.bar(list(cfg.arms), vals, bottom=bottom, color=c, label=part)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("units per response (final policy)")
    ax.set_title("anatomy of the final responses")
    ax.legend()
    anatomy = save(fig, out / "fork_anatomy.png")
    return [curves, anatomy]


class Train(Experiment):
    """GRPO under every reward arm, paired seeds."""

    name = "train"

    def cells(self, cfg: ForkLabConfig) -> list[Cell]:
        ident = cfg.identity()
        return [Cell("train", f"arm={arm}/seed={seed}", run_fork_cell, {"arm": arm, "seed": seed, "config": ident})
                for seed in range(cfg.seeds) for arm in cfg.arms]

    def tables(self, rows: dict[str, pd.DataFrame], cfg: ForkLabConfig) -> dict[str, Table]:
        tabs: dict[str, Table] = {}
        df = rows["train"].sort_values(["arm", "seed", "update"]).reset_index(drop=True)
        tabs["fork_curves"] = Table(df, "Evaluation over training, every run", report=False)
        summary = summary_tables(df, cfg)
        tabs["fork_final"] = Table(summary["final"], "Final policies (mean [95% CI] over seeds)", console=True)
        if len(summary["paired"]):
            tabs["fork_paired"] = Table(summary["paired"], "Paired differences (same seeds)", console=True)
        return tabs

    def plots(self, tabs, cfg: ForkLabConfig, out: Path) -> list[Path]:
        return _plot(tabs["fork_curves"].frame, cfg, out)

    def interpret(self, tabs, cfg: ForkLabConfig) -> dict[str, str]:
        text = {"fork_final": (
            "Length, recall, precision and the anatomy of the final policies' responses (units that are "
            "necessary, redundant restatements, wrong facts, filler), with the initial policy for reference. "
            "Expected: recall-only grows the response with redundancy and wrong guesses; FORK keeps recall, "
            "raises precision and cuts length; the mean gives up more recall." + small_run_note(cfg.seeds))}
        if "fork_paired" in tabs:
            d = tabs["fork_paired"].frame.rename(columns={"pairs": "n"})
            text["fork_paired"] = " ".join(
                read_diff(g, ["metric"], what) for what, g in d.groupby("diff", sort=False))
        return text


EXPERIMENT = Train()
