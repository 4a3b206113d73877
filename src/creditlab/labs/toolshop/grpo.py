"""The ``grpo`` experiment of the toolshop lab: multi-turn outcome GRPO from the cached base policy,
one cell per seed; success and K3 over updates."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from creditlab.core.correction import get_correction
from creditlab.errors import ConfigError
from creditlab.lab.experiment import Experiment
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table
from creditlab.lab.report import ci_columns, small_run_note
from creditlab.lab.runner import Cell
from creditlab.labs._toolshop import fresh_dump
from creditlab.labs.toolshop._common import (
    K3_NOISE,
    ToolshopLabConfig,
    _base,
    base_cell,
    quick_base_note,
)
from creditlab.train.toolshop_grpo import train_grpo
from creditlab.train.toolshop_rollout import EVAL_SEED_OFFSET, evaluate


def run_seed(config: dict, seed: int, cache_dir: str, dump_dir: str | None = None) -> list[dict]:
    """One training run (a cell): GRPO from the cached base policy; one row per update."""
    cfg, model = _base(config, cache_dir)
    gcfg = replace(cfg.grpo, seed=seed)
    on_rollouts = None
    if dump_dir:
        from creditlab.train.toolshop_dump import dump_rollouts

        path = fresh_dump(dump_dir, f"toolshop-seed={seed}.jsonl")

        def on_rollouts(k, batch, rewards, old):
            dump_rollouts(batch, rewards, k, path, logprobs=old)

    rows = train_grpo(model, gcfg, on_rollouts=on_rollouts)
    final = evaluate(model, range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + gcfg.eval_tasks), gcfg.chain_lengths,
                     precision=gcfg.rollout_precision, seed=gcfg.seed + 1, max_len=gcfg.max_len,
                     max_turns=gcfg.max_turns, max_action_len=gcfg.max_action_len)
    rows.append({"update": float(gcfg.updates), **{f"eval/{k}": v for k, v in final.items()}})
    return [{"seed": seed, **{k: v for k, v in r.items() if not k.startswith("mismatch/turn")}} for r in rows]


def _ci_row(what: str, values, bounds: tuple[float, float] | None = (0.0, 1.0)) -> dict:
    v = pd.Series(values, dtype=float).dropna().to_numpy()
    return {"what": what, **ci_columns(v, bounds=bounds), "n": len(v)}


def _plot(df: pd.DataFrame, out: Path, base_success: float, engines: str) -> Path:
    fig, axes = new_figure(1, 2, figsize=(11, 4))
    ax = axes[0]
    tr = df.dropna(subset=["reward/success"]).groupby("update")["reward/success"]
    x = tr.mean().index.values
    ax.plot(x, tr.mean().values, label="training batch (sampled)", color="tab:blue", alpha=0.7)
    ev = df.dropna(subset=["eval/success"]).groupby("update")["eval/success"]
    ax.plot(ev.mean().index.values, ev.mean().values, "o-", label="held-out tasks (sampled)", color="tab:red")
    ax.axhline(base_success, ls="--", color="gray", label=f"base policy ({base_success:.2f})")
    ax.set_xlabel("update")
    ax.set_ylabel("success rate")
    ax.set_ylim(0, 1)
    ax.set_title("toolshop: outcome GRPO from the base policy")
    ax.legend(loc="lower right")
    ax = axes[1]
    k3 = df.dropna(subset=["mismatch/k3"]).groupby("update")["mismatch/k3"].mean()
    if len(k3) and float(np.abs(k3.values).max()) < K3_NOISE:
        ax.plot(k3.index.values, np.zeros(len(k3)), color="tab:purple")
        ax.set_ylim(-1, 1)
        ax.text(0.5, 0.6, f"K3 = 0 up to float noise (|K3| < {K3_NOISE:g}):\nno engine/learner mismatch",
                transform=ax.transAxes, ha="center", color="tab:purple")
    else:
        ax.plot(k3.index.values, np.maximum(k3.values, K3_NOISE), color="tab:purple")
        ax.set_yscale("log")
    ax.set_xlabel("update")
    ax.set_ylabel("K3(engine || learner) per policy token")
    ax.set_title(f"execution mismatch over training\n({engines})")
    return save(fig, out / "toolshop_success_k3.png")


class Grpo(Experiment):
    """Outcome GRPO from the base policy: success and K3(engine || learner) over updates."""

    name = "grpo"
    groups = ("base", "grpo")
    fields = ("grpo",)

    def validate(self, cfg: ToolshopLabConfig) -> None:
        if cfg.grpo.max_len > cfg.base.max_len:
            raise ConfigError("grpo.max_len", f"{cfg.grpo.max_len} exceeds the model's {cfg.base.max_len}")
        if tuple(cfg.grpo.chain_lengths) != tuple(cfg.base.chain_lengths):
            raise ConfigError("grpo.chain_lengths", "must equal base.chain_lengths (the base policy's tasks)")
        get_correction(cfg.grpo.correction)  # an unknown arm raises naming the field (--correction)

    def cells(self, cfg: ToolshopLabConfig) -> list[Cell]:
        ident = cfg.identity()
        return [base_cell(cfg), *(Cell("grpo", f"seed={s}", run_seed, {"config": ident, "seed": s},
                                       cfg.context(dump=True)) for s in range(cfg.seeds))]

    def tables(self, rows: dict[str, pd.DataFrame], cfg: ToolshopLabConfig) -> dict[str, Table]:
        g = cfg.grpo
        df = rows["grpo"].sort_values(["seed", "update"]).reset_index(drop=True)
        final = df[df["update"] == g.updates]
        first = df[df["update"] == 0]
        last_k = df[(df["update"] >= g.updates - max(1, g.updates // 10)) & (df["update"] < g.updates)]
        base = rows["base"]["eval/success"]
        summary = pd.DataFrame([
            _ci_row("base policy, held-out success", base),
            _ci_row("training-batch success, first update", first["reward/success"]),
            _ci_row("training-batch success, last 10% of updates",
                    last_k.groupby("seed")["reward/success"].mean()),
            _ci_row("held-out success after training", final["eval/success"]),
            _ci_row("held-out truncation rate after training", final["eval/truncated"]),
            _ci_row("held-out tool calls after training", final["eval/n_calls"], (0.0, np.inf)),
            _ci_row("K3 engine||learner, mean over updates", df.groupby("seed")["mismatch/k3"].mean(),
                    (0.0, np.inf)),
        ])
        return {"updates": Table(df, "Every update of every seed", ".3g", report=False),
                "summary": Table(summary, "Summary (mean and 95% interval over seeds)", ".3g", console=True)}

    def plots(self, tabs, cfg: ToolshopLabConfig, out: Path) -> list[Path]:
        base = float(tabs["summary"].frame["mean"].iloc[0])
        g = cfg.grpo
        return [_plot(tabs["updates"].frame, out, base, f"{g.rollout_precision} engine, {g.learner_precision} learner")]

    def interpret(self, tabs, cfg: ToolshopLabConfig) -> dict[str, str]:
        s = tabs["summary"].frame.set_index("what")["mean"]
        return {"summary": (
            f"Held-out success goes from {s['base policy, held-out success']:.3g} (base policy) to "
            f"{s['held-out success after training']:.3g} after {cfg.grpo.updates} updates; truncation rate "
            f"{s['held-out truncation rate after training']:.3g}, tool calls per episode "
            f"{s['held-out tool calls after training']:.3g}." + small_run_note(cfg.seeds) + quick_base_note(cfg))}


EXPERIMENT = Grpo()
