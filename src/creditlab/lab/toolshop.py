"""The toolshop lab: outcome GRPO of a tiny transformer agent from its supervised base policy.

Reads top to bottom:

1. build (or load from the cache) the base policy: supervised warm start on noisy scripted
   demonstrations (:func:`creditlab.lab.toolshop_base.base_policy`);
2. measure the execution mismatch of the base policy: K3 between each rollout engine (fp32, bf16,
   FP8 W8A8-KV8, INT8 W8A8) and the learner (fp32, or quantization-aware with the engine's rules);
3. train with multi-turn outcome GRPO, one cell per seed, persisted as it finishes (resumable);
4. write tables (parquet + markdown) and plots of success and K3 over updates.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from creditlab.errors import ConfigError
from creditlab.lab.report import mean_ci, to_markdown, write_table
from creditlab.lab.runner import Cell, run_cells
from creditlab.lab.store import ResultStore
from creditlab.lab.toolshop_base import BaseConfig, base_policy, default_cache_dir
from creditlab.lab.toolshop_grpo import GRPOConfig, train_grpo
from creditlab.lab.toolshop_rollout import EVAL_SEED_OFFSET, evaluate, make_tasks, rollout, sequence_logprobs

__all__ = ["MISMATCH_PAIRS", "ToolshopLabConfig", "measure_mismatch", "run_seed", "run_toolshop"]

#: (engine precision, learner precision) pairs of the mismatch table; equal names = QAT learner.
MISMATCH_PAIRS = (("fp32", "fp32"), ("bf16", "fp32"), ("fp8", "fp32"), ("fp8", "fp8"),
                  ("int8", "fp32"), ("int8", "int8"))


@dataclass(frozen=True)
class ToolshopLabConfig:
    """Configuration of the toolshop lab."""

    base: BaseConfig = field(default_factory=BaseConfig)
    """Supervised warm start of the base policy (cached)."""
    grpo: GRPOConfig = field(default_factory=lambda: GRPOConfig(updates=100, eval_every=10))
    """Outcome GRPO from the base policy."""
    seeds: tuple[int, ...] = (0, 1)
    """Training seeds (task stream and sampling); the base policy is shared."""
    mismatch_tasks: int = 256
    """Trajectories of the base policy used for the mismatch table."""

    @staticmethod
    def quick() -> ToolshopLabConfig:
        return ToolshopLabConfig(grpo=GRPOConfig(updates=12, tasks_per_update=16, group_size=8,
                                                 eval_every=4, eval_tasks=128),
                                 seeds=(0,), mismatch_tasks=64)

    def validate(self) -> None:
        if not self.seeds:
            raise ConfigError("seeds", "needs at least one seed")
        if self.mismatch_tasks < 1:
            raise ConfigError("mismatch_tasks", f"must be >= 1, got {self.mismatch_tasks}")
        if self.grpo.max_len > self.base.max_len:
            raise ConfigError("grpo.max_len", f"{self.grpo.max_len} exceeds the model's {self.base.max_len}")
        if tuple(self.grpo.chain_lengths) != tuple(self.base.chain_lengths):
            raise ConfigError("grpo.chain_lengths", "must equal base.chain_lengths (the base policy's tasks)")


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


def run_seed(base: dict, grpo: dict, seed: int) -> list[dict]:
    """One training run (a cell): GRPO from the cached base policy; one row per update."""
    bcfg = BaseConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in base.items()})
    gcfg = GRPOConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in grpo.items()})
    gcfg = replace(gcfg, seed=seed)
    model = base_policy(bcfg, cache_dir=default_cache_dir(os.environ.get("CREDITLAB_CACHE")))
    rows = train_grpo(model, gcfg)
    final = evaluate(model, range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + gcfg.eval_tasks), gcfg.chain_lengths,
                     precision=gcfg.rollout_precision, seed=gcfg.seed + 1, max_len=gcfg.max_len,
                     max_turns=gcfg.max_turns, max_action_len=gcfg.max_action_len)
    rows.append({"update": float(gcfg.updates), **{f"eval/{k}": v for k, v in final.items()}})
    return [{"seed": seed, **{k: v for k, v in r.items() if not k.startswith("mismatch/turn")}} for r in rows]


def _plot(df: pd.DataFrame, out: Path, base_success: float, engines: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
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
    ax.plot(k3.index.values, np.maximum(k3.values, 1e-16), color="tab:purple")
    ax.set_yscale("log")
    ax.set_xlabel("update")
    ax.set_ylabel("K3(engine || learner) per policy token")
    ax.set_title(f"execution mismatch over training\n({engines})")
    fig.tight_layout()
    p = out / "toolshop_success_k3.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def run_toolshop(cfg: ToolshopLabConfig, out: str | Path, *, workers: int = 1,
                 progress: bool = True) -> dict[str, pd.DataFrame]:
    """Run the lab into ``out``: results store, tables, plots and ``report.md``. Resumable."""
    cfg.validate()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    g = cfg.grpo
    # 1. the base policy (trained once, cached) and its held-out success
    model = base_policy(cfg.base, cache_dir=default_cache_dir(os.environ.get("CREDITLAB_CACHE")))
    eval_seeds = range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + g.eval_tasks)
    base_eval = evaluate(model, eval_seeds, g.chain_lengths, precision=g.rollout_precision, seed=1,
                         max_len=g.max_len, max_turns=g.max_turns, max_action_len=g.max_action_len)
    # 2. execution mismatch of the base policy
    mism = measure_mismatch(model, cfg.mismatch_tasks, g.chain_lengths, max_len=g.max_len)
    write_table(mism, out, "mismatch")
    (out / "mismatch.md").write_text(to_markdown(mism, ".3g"))  # K3 spans orders of magnitude
    # 3. GRPO, one resumable cell per seed
    store = ResultStore(out / "store")
    cells = [Cell(key=f"seed={s}|{json.dumps(asdict(g), sort_keys=True)}|{cfg.base.key()}", fn=run_seed,
                  kwargs={"base": asdict(cfg.base), "grpo": asdict(g), "seed": s}) for s in cfg.seeds]
    df = run_cells(cells, store, workers=workers, desc="toolshop GRPO", progress=progress)
    df = df.sort_values(["seed", "update"]).reset_index(drop=True)
    write_table(df, out, "updates")
    # 4. summary and plots
    final = df[df["update"] == g.updates]
    first = df[df["update"] == 0]
    last_k = df[(df["update"] >= g.updates - max(1, g.updates // 10)) & (df["update"] < g.updates)]
    rows = [{"what": "base policy, held-out success", "mean": base_eval["success"], "lo": np.nan,
             "hi": np.nan, "n": 1}]
    for name, vals in (("training-batch success, first update", first["reward/success"]),
                       ("training-batch success, last 10% of updates",
                        last_k.groupby("seed")["reward/success"].mean()),
                       ("held-out success after training", final["eval/success"]),
                       ("held-out truncation rate after training", final["eval/truncated"]),
                       ("held-out tool calls after training", final["eval/n_calls"]),
                       ("K3 engine||learner, mean over updates", df.groupby("seed")["mismatch/k3"].mean())):
        v = vals.dropna().to_numpy(dtype=float)
        m, lo, hi = mean_ci(v) if len(v) > 1 else (float(v.mean()) if len(v) else np.nan, np.nan, np.nan)
        rows.append({"what": name, "mean": m, "lo": lo, "hi": hi, "n": len(v)})
    summary = pd.DataFrame(rows)
    write_table(summary, out, "summary")
    (out / "summary.md").write_text(to_markdown(summary, ".3g"))
    engines = f"{g.rollout_precision} engine, {g.learner_precision} learner"
    plots = _plot(df, out, base_eval["success"], engines)
    (out / "report.md").write_text(
        "# toolshop lab\n\n"
        f"Outcome GRPO (rollout {g.rollout_precision}, learner {g.learner_precision}, "
        f"{g.tasks_per_update} tasks x {g.group_size} rollouts, {g.updates} updates, "
        f"seeds {list(cfg.seeds)}).\n\n"
        "## Summary\n\n" + to_markdown(summary, ".3g")
        + "\n\n## Execution mismatch of the base policy\n\n" + to_markdown(mism, ".3g") + "\n\n"
        + "".join(f"![{p.stem}]({p.name})\n" for p in plots))
    return {"updates": df, "summary": summary, "mismatch": mism}
