"""The toolshop lab: outcome GRPO of a tiny transformer agent from its supervised base policy.

Reads top to bottom:

1. build (or load from the cache) the base policy: supervised warm start on noisy scripted
   demonstrations (:func:`creditlab.train.toolshop_base.base_policy`);
2. measure the execution mismatch of the base policy: K3 between each rollout engine (fp32, bf16,
   FP8 W8A8-KV8, INT8 W8A8) and the learner (fp32, or quantization-aware with the engine's rules);
3. train with multi-turn outcome GRPO, one cell per seed, persisted as it finishes (resumable);
4. write tables (parquet + markdown) and plots of success and K3 over updates.

The base policy is built once in the driver (:meth:`ToolshopLab.prepare`, with a progress bar) and
every cell loads it from the cache directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import pandas as pd
import torch

from creditlab.core.correction import CORRECTIONS, get_correction
from creditlab.errors import ConfigError
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import LabConfig, LabOption, Table, check_count
from creditlab.lab.report import ci_columns, small_run_note
from creditlab.lab.runner import Cell
from creditlab.labs._toolshop import BasePolicyConfig, BasePolicyLab, base_note, fresh_dump
from creditlab.train.toolshop_base import BaseConfig, base_policy
from creditlab.train.toolshop_grpo import GRPOConfig, train_grpo
from creditlab.train.toolshop_rollout import EVAL_SEED_OFFSET, evaluate, make_tasks, rollout, sequence_logprobs

__all__ = ["LAB", "MISMATCH_PAIRS", "QUICK_BASE", "ToolshopLab", "ToolshopLabConfig", "measure_mismatch",
           "run_base_cell", "run_mismatch_cell", "run_seed"]

#: (engine precision, learner precision) pairs of the mismatch table; equal names = QAT learner.
MISMATCH_PAIRS = (("fp32", "fp32"), ("bf16", "fp32"), ("fp8", "fp32"), ("fp8", "fp8"),
                  ("int8", "fp32"), ("int8", "int8"))
EXPERIMENTS = ("mismatch", "grpo")
#: K3 below this is float noise of identical fp32 arithmetic (no mismatch to plot).
K3_NOISE = 1e-12
#: The base policy of ``--quick``: 700 steps of 32 demonstrations at lr 1e-2 instead of 1000 of 128
#: at 3e-3 (6x fewer demonstrations seen, about 7x less time), with held-out success close to the
#: full base policy's (docs/toolshop.md).
QUICK_BASE = BaseConfig(steps=700, batch_size=32, lr=1e-2)


@dataclass(frozen=True)
class ToolshopLabConfig(BasePolicyConfig, LabConfig):
    """Configuration of the toolshop lab."""

    OPTIONS: ClassVar[dict[str, str]] = {
        "updates": "grpo.updates", "rollout_precision": "grpo.rollout_precision",
        "learner_precision": "grpo.learner_precision", "correction": "grpo.correction"}
    EXPERIMENTS: ClassVar[tuple[str, ...]] = EXPERIMENTS
    SELECTION: ClassVar[tuple[str, ...]] = ("experiments", "cache_dir", "dump_dir")

    base: BaseConfig = field(default_factory=BaseConfig)
    """Supervised warm start of the base policy (cached)."""
    grpo: GRPOConfig = field(default_factory=lambda: GRPOConfig(updates=100, eval_every=10))
    """Outcome GRPO from the base policy."""
    seeds: int = 2
    """Training seeds 0..seeds-1 (task stream and sampling); the base policy is shared."""
    mismatch_tasks: int = 256
    """Trajectories of the base policy used for the mismatch table."""
    experiments: tuple[str, ...] = EXPERIMENTS
    """``mismatch`` (engine/learner mismatch of the base policy) and ``grpo`` (outcome GRPO)."""
    cache_dir: str | None = None
    """Where the base policy is cached (None: the user cache directory); never changes a number."""
    dump_dir: str | None = None
    """Write every training update's rollouts in the ``creditlab diagnose`` schema here (one JSONL
    file per seed, for the cells this run computes); never changes a number."""

    @classmethod
    def quick(cls) -> ToolshopLabConfig:
        """12 updates from the quick base policy (:data:`QUICK_BASE`, built in under a minute)."""
        return cls(base=QUICK_BASE,
                   grpo=GRPOConfig(updates=12, tasks_per_update=16, group_size=8, eval_every=4, eval_tasks=128),
                   seeds=1, mismatch_tasks=64)

    def validate(self) -> None:
        check_count(self.seeds, "--seeds")
        if self.mismatch_tasks < 1:
            raise ConfigError("mismatch_tasks", f"must be >= 1, got {self.mismatch_tasks}")
        if self.grpo.max_len > self.base.max_len:
            raise ConfigError("grpo.max_len", f"{self.grpo.max_len} exceeds the model's {self.base.max_len}")
        if tuple(self.grpo.chain_lengths) != tuple(self.base.chain_lengths):
            raise ConfigError("grpo.chain_lengths", "must equal base.chain_lengths (the base policy's tasks)")
        get_correction(self.grpo.correction)  # an unknown arm raises naming the field (--correction)
        if not self.experiments or any(e not in EXPERIMENTS for e in self.experiments):
            raise ConfigError("--experiment", f"got {list(self.experiments)}; valid: {', '.join(EXPERIMENTS)}")


@torch.no_grad()
def measure_mismatch(model, n_tasks: int, chain_lengths, *, seed: int = 0, max_len: int = 160,
                     pairs=MISMATCH_PAIRS) -> pd.DataFrame:
    """K3 (and mean |delta|) between rollout engine and learner on the model's own trajectories."""
    from creditlab.core.correction import mismatch_metrics

    rows = []
    tasks = make_tasks(range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + n_tasks), chain_lengths)
    for engine, learner in pairs:
        batch = rollout(model, tasks, precision=engine, max_len=max_len,
                        generator=torch.Generator().manual_seed(seed))
        old = sequence_logprobs(model, batch.tokens, learner)
        m = mismatch_metrics(old, batch.rollout_logprobs, batch.policy_mask, batch.valid_mask)
        rows.append({"engine": engine, "learner": learner + (" (QAT)" if learner == engine != "fp32" else ""),
                     "k3": m["mismatch/k3"], "mean_abs_delta": m["mismatch/mean_abs_delta"],
                     "seq_k3": m["mismatch/seq_k3"], "success": float(batch.success.mean())})
    return pd.DataFrame(rows)


def _base(config: dict, cache_dir: str) -> tuple[ToolshopLabConfig, torch.nn.Module]:
    cfg = ToolshopLabConfig.from_dict(config)
    return cfg, base_policy(cfg.base, cache_dir=cache_dir)


def run_base_cell(config: dict, cache_dir: str) -> list[dict]:
    """Held-out success of the base policy (one row)."""
    cfg, model = _base(config, cache_dir)
    g = cfg.grpo
    res = evaluate(model, range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + g.eval_tasks), g.chain_lengths,
                   precision=g.rollout_precision, seed=1, max_len=g.max_len, max_turns=g.max_turns,
                   max_action_len=g.max_action_len)
    return [{f"eval/{k}": v for k, v in res.items()}]


def run_mismatch_cell(config: dict, cache_dir: str) -> list[dict]:
    """The mismatch table of the base policy (one row per engine/learner pair)."""
    cfg, model = _base(config, cache_dir)
    return measure_mismatch(model, cfg.mismatch_tasks, cfg.grpo.chain_lengths, max_len=cfg.grpo.max_len
                            ).to_dict("records")


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


class ToolshopLab(BasePolicyLab):
    """Outcome GRPO of the tiny tool-use agent from its supervised base policy (module docstring)."""

    name = "toolshop"
    summary = "Multi-turn outcome GRPO of a tiny transformer tool agent; engine/learner mismatch table."
    help = ("Multi-turn outcome GRPO on toolshop: success and K3(engine||learner) over updates, plus the execution-"
            "mismatch table of the base policy. The base policy is trained on first use (1.5-4 minutes on 2 cores; "
            "an interrupted build resumes) and cached; set CREDITLAB_CACHE to choose where.")
    quick_help = ("Reduced run: 12 updates x 16 tasks x 8, one seed, from a quick base policy (700 steps of 32): "
                  "about 30 s on 2 cores from an empty cache (the base policy is built first), 10 s once it is "
                  "cached (load average 2-3).")
    config_type = ToolshopLabConfig
    options = (
        LabOption("rollout_precision", "Rollout engine: fp32, bf16, fp8 (W8A8-KV8), int8 (W8A8), nvfp4, mxfp4.",
                  metavar="PRECISION"),
        LabOption("learner_precision", "Learner: fp32, or the engine's precision for a QAT learner.",
                  metavar="PRECISION"),
        LabOption("correction", f"Per-token correction weights: {', '.join(CORRECTIONS)}.", metavar="ARM"),
    )

    def describe(self, cfg: ToolshopLabConfig) -> str:
        g = cfg.grpo
        return (f"A tiny causal transformer agent (base policy: supervised warm start on {cfg.base.n_demos} noisy "
                f"scripted demonstrations, chains of length {list(cfg.base.chain_lengths)}) trained with multi-turn "
                f"outcome GRPO: rollout engine {g.rollout_precision}, learner {g.learner_precision}, correction "
                f"{g.correction}, {g.tasks_per_update} tasks x {g.group_size} rollouts per update, {g.updates} "
                f"updates, {cfg.seeds} seed(s). Held-out success is measured on {g.eval_tasks} fixed evaluation "
                "tasks with sampled actions.")

    def cells(self, cfg: ToolshopLabConfig) -> list[Cell]:
        ident, ctx = cfg.identity(), cfg.context()
        cells = [Cell("base", "base", run_base_cell, {"config": ident}, ctx)]
        if "mismatch" in cfg.experiments:
            cells.append(Cell("mismatch", "mismatch", run_mismatch_cell, {"config": ident}, ctx))
        if "grpo" in cfg.experiments:
            cells += [Cell("grpo", f"seed={s}", run_seed, {"config": ident, "seed": s}, cfg.context(dump=True))
                      for s in range(cfg.seeds)]
        return cells

    def tables(self, rows: dict[str, pd.DataFrame], cfg: ToolshopLabConfig) -> dict[str, Table]:
        tabs: dict[str, Table] = {}
        g = cfg.grpo
        if "mismatch" in rows:
            tabs["mismatch"] = Table(rows["mismatch"], "Execution mismatch of the base policy", ".3g", console=True)
        if "grpo" in rows:
            df = rows["grpo"].sort_values(["seed", "update"]).reset_index(drop=True)
            tabs["updates"] = Table(df, "Every update of every seed", ".3g", report=False)
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
            tabs["summary"] = Table(summary, "Summary (mean and 95% interval over seeds)", ".3g", console=True)
        return tabs

    def plots(self, tabs: dict[str, Table], cfg: ToolshopLabConfig, out: Path) -> list[Path]:
        if "updates" not in tabs:
            return []
        base = float(tabs["summary"].frame["mean"].iloc[0])
        g = cfg.grpo
        return [_plot(tabs["updates"].frame, out, base, f"{g.rollout_precision} engine, {g.learner_precision} learner")]

    def interpret(self, tabs: dict[str, Table], cfg: ToolshopLabConfig) -> dict[str, str]:
        text: dict[str, str] = {}
        note = base_note({"base policy": cfg.base}, {"base policy": ToolshopLabConfig().base},
                         "it solves about as many held-out tasks as the lab's (docs/toolshop.md), but every number "
                         "here is that policy's and its training's, not the full run's.")
        one = small_run_note(cfg.seeds) + note
        if "mismatch" in tabs:
            m = tabs["mismatch"].frame
            naive = m[~m["learner"].str.contains("QAT") & (m["engine"] != "fp32")]
            qat = m[m["learner"].str.contains("QAT")]
            text["mismatch"] = (
                f"K3(engine || learner) per policy token on {cfg.mismatch_tasks} trajectories of the base policy, "
                "for each rollout engine against an fp32 learner and against a quantization-aware (QAT) learner "
                "that runs the engine's rounding. "
                + ("; ".join(f"{r.engine}: {r.k3:.3g}" for r in naive.itertuples()) + " with an fp32 learner; "
                   if len(naive) else "")
                + ("; ".join(f"{r.engine}: {r.k3:.3g}" for r in qat.itertuples()) + " with a QAT learner. "
                   if len(qat) else "")
                + "fp32 against fp32 is zero up to float noise (the same arithmetic)." + note)
        if "summary" in tabs:
            s = tabs["summary"].frame.set_index("what")["mean"]
            text["summary"] = (
                f"Held-out success goes from {s['base policy, held-out success']:.3g} (base policy) to "
                f"{s['held-out success after training']:.3g} after {cfg.grpo.updates} updates; truncation rate "
                f"{s['held-out truncation rate after training']:.3g}, tool calls per episode "
                f"{s['held-out tool calls after training']:.3g}." + one)
        return text


LAB = ToolshopLab()


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
