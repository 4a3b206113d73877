"""The ``mismatch`` experiment of the toolshop lab: K3 between each rollout engine (fp32, bf16, FP8
W8A8-KV8, INT8 W8A8) and the learner (fp32, or quantization-aware with the engine's rules) on the base
policy's own trajectories."""

from __future__ import annotations

import pandas as pd
import torch

from creditlab.errors import ConfigError
from creditlab.lab.experiment import Experiment
from creditlab.lab.protocol import Table
from creditlab.lab.runner import Cell
from creditlab.labs.toolshop._common import (
    MISMATCH_PAIRS,
    ToolshopLabConfig,
    _base,
    base_cell,
    quick_base_note,
)
from creditlab.train.toolshop_rollout import EVAL_SEED_OFFSET, make_tasks, rollout, sequence_logprobs


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


def run_mismatch_cell(config: dict, cache_dir: str) -> list[dict]:
    """The mismatch table of the base policy (one row per engine/learner pair)."""
    cfg, model = _base(config, cache_dir)
    return measure_mismatch(model, cfg.mismatch_tasks, cfg.grpo.chain_lengths, max_len=cfg.grpo.max_len
                            ).to_dict("records")


class Mismatch(Experiment):
    """The execution mismatch of the base policy, engine by engine."""

    name = "mismatch"
    groups = ("base", "mismatch")
    fields = ("mismatch_tasks",)

    def validate(self, cfg: ToolshopLabConfig) -> None:
        if cfg.mismatch_tasks < 1:
            raise ConfigError("mismatch_tasks", f"must be >= 1, got {cfg.mismatch_tasks}")

    def cells(self, cfg: ToolshopLabConfig) -> list[Cell]:
        return [base_cell(cfg), Cell("mismatch", "mismatch", run_mismatch_cell, {"config": cfg.identity()},
                                     cfg.context())]

    def tables(self, rows: dict[str, pd.DataFrame], cfg: ToolshopLabConfig) -> dict[str, Table]:
        return {"mismatch": Table(rows["mismatch"], "Execution mismatch of the base policy", ".3g", console=True)}

    def interpret(self, tabs, cfg: ToolshopLabConfig) -> dict[str, str]:
        m = tabs["mismatch"].frame
        naive = m[~m["learner"].str.contains("QAT") & (m["engine"] != "fp32")]
        qat = m[m["learner"].str.contains("QAT")]
        return {"mismatch": (
            f"K3(engine || learner) per policy token on {cfg.mismatch_tasks} trajectories of the base policy, "
            "for each rollout engine against an fp32 learner and against a quantization-aware (QAT) learner "
            "that runs the engine's rounding. "
            + ("; ".join(f"{r.engine}: {r.k3:.3g}" for r in naive.itertuples()) + " with an fp32 learner; "
               if len(naive) else "")
            + ("; ".join(f"{r.engine}: {r.k3:.3g}" for r in qat.itertuples()) + " with a QAT learner. "
               if len(qat) else "")
            + "fp32 against fp32 is zero up to float noise (the same arithmetic)." + quick_base_note(cfg))}


EXPERIMENT = Mismatch()
