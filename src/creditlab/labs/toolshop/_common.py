"""What the toolshop lab's experiments share: the config, the base policy of every cell and its
held-out success (the ``base`` cell both experiments make), and the notes on a quick base policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from creditlab.errors import ConfigError
from creditlab.lab.protocol import LabConfig, check_count
from creditlab.lab.runner import Cell
from creditlab.labs._toolshop import BasePolicyConfig, base_note
from creditlab.train.toolshop_base import BaseConfig, base_policy
from creditlab.train.toolshop_grpo import GRPOConfig
from creditlab.train.toolshop_rollout import EVAL_SEED_OFFSET, evaluate

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
    grpo: GRPOConfig = field(default_factory=lambda: GRPOConfig(updates=100, eval_every=10, clip_ratio_c=None))
    """Outcome GRPO from the base policy (no dual clip: the lab's settings from before ``clip_ratio_c`` existed,
    kept so that its numbers do not move; ``--correction`` arms are the mismatch lab's subject)."""
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
                   grpo=GRPOConfig(updates=12, tasks_per_update=16, group_size=8, eval_every=4, eval_tasks=128,
                                   clip_ratio_c=None),
                   seeds=1, mismatch_tasks=64)

    def validate(self) -> None:
        """The shared fields, then each experiment's own (selected or not), then the selection."""
        from creditlab.labs.toolshop import EXPERIMENT_TABLE

        check_count(self.seeds, "--seeds")
        for e in EXPERIMENT_TABLE:
            e.validate(self)
        if not self.experiments or any(e not in EXPERIMENTS for e in self.experiments):
            raise ConfigError("--experiment", f"got {list(self.experiments)}; valid: {', '.join(EXPERIMENTS)}")


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


def base_cell(cfg: ToolshopLabConfig) -> Cell:
    """The held-out success of the base policy (a cell of group ``base``, shared by the experiments)."""
    return Cell("base", "base", run_base_cell, {"config": cfg.identity()}, cfg.context())


def quick_base_note(cfg: ToolshopLabConfig) -> str:
    """What a report says when its base policy is not the lab's."""
    return base_note({"base policy": cfg.base}, {"base policy": ToolshopLabConfig().base},
                     "it solves about as many held-out tasks as the lab's (docs/toolshop.md), but every number "
                     "here is that policy's and its training's, not the full run's.")
