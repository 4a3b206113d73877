"""The toolshop lab: outcome GRPO of a tiny transformer agent from its supervised base policy.

Reads top to bottom:

1. build (or load from the cache) the base policy: supervised warm start on noisy scripted
   demonstrations (:func:`creditlab.train.toolshop_base.base_policy`);
2. measure the execution mismatch of the base policy: K3 between each rollout engine (fp32, bf16,
   FP8 W8A8-KV8, INT8 W8A8) and the learner (fp32, or quantization-aware with the engine's rules);
3. train with multi-turn outcome GRPO, one cell per seed, persisted as it finishes (resumable);
4. write tables (parquet + markdown) and plots of success and K3 over updates.

Each experiment (``mismatch``, ``grpo``) is a module of this package and a line of
:data:`EXPERIMENT_TABLE`. The base policy is built once in the driver (:meth:`ToolshopLab.prepare`,
with a progress bar) and every cell loads it from the cache directory.
"""

from __future__ import annotations

from creditlab.core.correction import CORRECTIONS
from creditlab.lab.experiment import ExperimentLab
from creditlab.lab.protocol import LabOption
from creditlab.labs._toolshop import BasePolicyLab
from creditlab.labs.toolshop import grpo, mismatch
from creditlab.labs.toolshop._common import EXPERIMENTS, MISMATCH_PAIRS, QUICK_BASE, ToolshopLabConfig, run_base_cell
from creditlab.labs.toolshop.grpo import run_seed
from creditlab.labs.toolshop.mismatch import measure_mismatch, run_mismatch_cell

__all__ = ["EXPERIMENTS", "EXPERIMENT_TABLE", "LAB", "MISMATCH_PAIRS", "QUICK_BASE", "SHARED_FIELDS", "ToolshopLab",
           "ToolshopLabConfig", "measure_mismatch", "run_base_cell", "run_mismatch_cell", "run_seed"]

#: The lab's experiments, in report order (``-e`` selects among them).
EXPERIMENT_TABLE = (mismatch.EXPERIMENT, grpo.EXPERIMENT)
#: Config fields every experiment shares (the base policy, seeds, selection, where things live).
SHARED_FIELDS = ("base", "seeds", "experiments", "cache_dir", "dump_dir")


class ToolshopLab(ExperimentLab, BasePolicyLab):
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
    experiments = EXPERIMENT_TABLE
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


LAB = ToolshopLab()
