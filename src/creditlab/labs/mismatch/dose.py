"""The mismatch lab's experiment: one engine precision (a dose, ``-e fp8`` ...) and the arms at it.

Each dose is an :class:`Experiment` of the same kind: its cells are the gate's measurement of the base
policy (one cell for every dose, shared), the fp32 arm's runs (no engine precision: shared by every dose)
and the quantized arms' runs at the dose, one cell per seed. The tables compare the doses with one
another (the dose-response, the phase map), so they are the comparison's
(:mod:`~creditlab.labs.mismatch.comparison`), not a dose's.
"""

from __future__ import annotations

from creditlab.lab.experiment import Experiment
from creditlab.lab.runner import Cell
from creditlab.labs.mismatch.cells import run_dose_cell, run_stack
from creditlab.labs.mismatch.config import MismatchConfig


class Dose(Experiment):
    """Quantized-rollout GRPO of every arm at one engine precision."""

    groups = ("dose", "train")

    def __init__(self, name: str):
        self.name = name

    def cells(self, cfg: MismatchConfig) -> list[Cell]:
        ident, ctx = cfg.identity(), cfg.context(dump=True)
        arms, n_seeds = cfg.dose_runs(self.name)
        cells = [Cell("dose", "base", run_dose_cell, {"config": ident, "tasks": cfg.dose_tasks}, cfg.context())]
        if "fp32" in cfg.arms:
            cells.append(Cell("train", "fp32", run_stack, {"dose": "fp32", "arms": ["fp32"],
                                                           "seeds": list(range(cfg.seeds)), "config": ident}, ctx))
        quantized = [a for a in arms if a != "fp32"]
        if quantized:
            cells += [Cell("train", f"{self.name}/seed={s}", run_stack,
                           {"dose": self.name, "arms": quantized, "seeds": [s], "config": ident}, ctx)
                      for s in range(n_seeds)]
        return cells
