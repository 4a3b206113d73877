"""The granularity lab: when does credit finer than the outcome help, and when does it hurt?

Reads top to bottom:

1. the world: toolshop tasks of two horizons trained together and reported apart: ``short``
   chains (C = 2, 3, 4 tool calls) and ``long`` chains (C = 7, 8: a case or ticket id to resolve
   through seven reads before the write, up to C + 2 turns), each task drawing one chain length
   (:data:`TASK_TYPES`);
2. one supervised base policy for every arm (:func:`creditlab.train.toolshop_base.base_policy` on
   those chain lengths);
3. the process reward: :func:`creditlab.rewards.process.evidence_scores`, a separate scorer that
   sees only the turns (1 for a read that returned something new, ``repeat`` for a read that
   returned nothing new, 0 for errors and writes): useful early, hackable late;
4. the arms, trained from the base policy on the same tasks and seeds for the same number of updates
   (:data:`ARMS`): outcome GRPO; GRPO + the process reward mixed per turn with a fixed weight
   (``prm_fixed``, lambda = 0.5) or a decayed one (``prm_decay``: 0.5, cubic decay to 0 between
   40% and 60% of the run, the schedule of 20 -> 30 of 50 updates scaled to the run length;
   :func:`creditlab.core.advantages.prm_mixed_advantages`, :func:`creditlab.core.schedules.decay`);
   on-policy self-distillation from a frozen copy of the base policy that sees privileged tokens
   (:func:`creditlab.train.opsd.train_opsd`, :func:`creditlab.core.losses.opsd_loss`): the reference answer
   (``opsd_ref``: the final write's action in its instruction) or per-turn advice (``opsd_advice``:
   the next correct action before each of the student's actions);
5. tables: per arm and task type, held-out success with 95% intervals, truncation, tool calls,
   interaction turns and the turn mixing score; curves of outcome and process reward, truncation,
   tool calls and response length over updates; for OPSD, teacher-student KL, gradient norm, clip
   count and the concentration of the KL over turns; and, with ``--dump``, what
   ``creditlab diagnose`` says about each arm's rollouts.

Each arm is an experiment (``-e grpo``...; :mod:`~creditlab.labs.granularity.arms`), and so is each
experiment in the paper's regime, each with a gate measured on its base policy before any arm trains
and predictions written before the run: ``multi`` (mixed, graded tasks), ``repeat`` (when a process
reward is gamed), ``warm`` (teachers warm-started on their hints). Each is a module of this package and
a line of :data:`EXPERIMENT_TABLE`; the lab holds what they share: the config
(:mod:`~creditlab.labs.granularity.config`), the world (:mod:`~creditlab.labs.granularity.world`: the
process scores, the turn judge, the held-out tasks), the training run of a cell, and the tables made
of every experiment's part: the knobs and the gates; the predictions table is every lab's (each
prediction's verdict is a pure function of the run's tables, :class:`~creditlab.lab.experiment.Prediction`).

Cells: one per (arm, seed), per gate, and per (arm, seed) of each regime experiment (and repeat value);
a cell's rows depend only on its arguments, and every finished cell is stored at once (resumable).
"""

from __future__ import annotations

import pandas as pd

from creditlab.lab.experiment import ExperimentLab
from creditlab.lab.protocol import LabOption, Table
from creditlab.lab.report import knobs_table
from creditlab.lab.runner import Cell
from creditlab.labs._toolshop import BasePolicyLab, base_knob, base_note, optim_knob, seeds_knob
from creditlab.labs.granularity import arms, budget, multi, repeat, warm
from creditlab.labs.granularity._common import LABELS, GranularityExperiment, dump_name, run_arm
from creditlab.labs.granularity.config import (
    ARMS,
    COMPUTE_CODE,
    EXPERIMENTS,
    MULTI_CHAIN_LENGTHS,
    MULTI_TYPES,
    QUICK_BASE,
    QUICK_MULTI_BASE,
    QUICK_WARM_BASE,
    REGIME_EXPERIMENTS,
    TASK_CHAIN_LENGTHS,
    TASK_TYPES,
    GranularityConfig,
    parse_repeats,
)
from creditlab.labs.granularity.world import (
    batch_stats,
    eval_tasks,
    evaluate_types,
    judge_turns,
    process_scores,
    teacher_rows,
    type_of,
    type_of_task,
)

__all__ = [
    "ARMS",
    "EXPERIMENTS",
    "EXPERIMENT_TABLE",
    "LAB",
    "MULTI_CHAIN_LENGTHS",
    "MULTI_TYPES",
    "QUICK_BASE",
    "QUICK_MULTI_BASE",
    "QUICK_WARM_BASE",
    "REGIME_EXPERIMENTS",
    "SHARED_FIELDS",
    "TASK_CHAIN_LENGTHS",
    "TASK_TYPES",
    "GranularityConfig",
    "GranularityLab",
    "batch_stats",
    "dump_name",
    "eval_tasks",
    "evaluate_types",
    "judge_turns",
    "parse_repeats",
    "process_scores",
    "run_arm",
    "teacher_rows",
    "type_of",
    "type_of_task",
]

#: The lab's experiments, in report order (``-e`` selects among them; adding one is one line here).
EXPERIMENT_TABLE: tuple[GranularityExperiment, ...] = (*arms.EXPERIMENTS, multi.EXPERIMENT, repeat.EXPERIMENT,
                                                       warm.EXPERIMENT, budget.EXPERIMENT)
#: Config fields every experiment shares (the others each belong to one experiment's ``fields``).
SHARED_FIELDS = ("base", "grpo", "seeds", "lam", "decay_start", "decay_end", "decay_power", "repeat", "beta",
                 "eval_per_type", "experiments", "cache_dir", "dump_dir")


def _run_order(cell: Cell) -> tuple[int, int]:
    """The gates first (each experiment's preconditions, measured before any arm trains), then the arms'
    runs, the teachers' table, and the regime experiments' runs seed by seed (an interrupted run holds
    whole seeds)."""
    phase = {"gates": 0, "train": 1, "teachers": 2}.get(cell.group, 3)
    return phase, int(cell.kwargs["seed"]) if phase == 3 else 0


class GranularityLab(ExperimentLab, BasePolicyLab):
    """Outcome GRPO vs process reward (fixed / decayed weight) vs self-distillation (module docstring)."""

    name = "granularity"
    summary = "Outcome GRPO vs PRM mixing (fixed / decayed λ) vs OPSD on short and long toolshop tasks."
    help = ("Credit granularity on the toolshop agent: outcome GRPO, GRPO + an evidence process reward with a fixed "
            "or decayed weight, on-policy self-distillation from a reference-answer or a turn-advice teacher (-e "
            "selects arms), on short (C = 2-4) and long (C = 7-8) tasks. The base policies are trained on first use "
            "(about 12 minutes for the three of a full run on 2 cores; an interrupted build resumes) and cached; set "
            "CREDITLAB_CACHE to choose where. Use --workers 2 on two cores.")
    quick_help = ("Reduced run: the gates, every arm and a small version of every experiment for 6 updates, one "
                  "seed, from three quick base policies: about 110 s on 2 cores from an empty cache (the base "
                  "policies are built first, about 75 s), 35 s once they are cached (load average 2).")
    config_type = GranularityConfig
    compute_code = COMPUTE_CODE
    experiments = EXPERIMENT_TABLE
    threads = 1  # one intra-op thread, as each process worker gets (see the mismatch lab)
    options = (LabOption("repeats", "Experiment repeat: the scores of a repeated read to sweep, comma-separated "
                                    "numbers in [0, 1] (default 0.25,0.5,0.75,1.0).", metavar="LIST"),)

    def describe(self, cfg: GranularityConfig) -> str:
        g = cfg.grpo
        U = g.updates
        regime = [e for e in self.selected(cfg) if e.name in REGIME_EXPERIMENTS]
        return (
            "The tiny toolshop agent trained from one supervised base policy on a mix of task types: "
            + "; ".join(f"{t} (chains of {', '.join(map(str, c))} tool calls)" for t, c in TASK_TYPES.items())
            + f". Arms: {', '.join(LABELS[a] for a in cfg.arms()) or 'none'}; experiments: "
            f"{', '.join(e.name for e in regime) or 'none'}. {U} updates of "
            f"{g.tasks_per_update} tasks x "
            f"{g.group_size} rollouts, {g.minibatches} AdamW steps per update (lr {g.lr:g}, grad clip "
            f"{g.grad_clip:g}), "
            f"{cfg.seeds} paired seed(s). Process reward: evidence scores (1 for a read that returned something new, "
            f"{cfg.repeat:g} for a read that returned nothing new, 0 for errors and writes), mixed per turn with "
            f"weight {cfg.lam:g} (fixed) or {cfg.lam:g} decayed cubically to 0 between updates "
            f"{cfg.decay_start * U:g} and {cfg.decay_end * U:g}. OPSD: generalised JSD (beta {cfg.beta:g}) to a frozen "
            "copy of the base policy that sees the final write's action in its instruction (ref-answer) or the next "
            "correct action before each of the student's actions (turn-advice). Held-out: "
            f"{cfg.eval_per_type} fixed tasks per type every {g.eval_every} updates, fp32, sampled at temperature "
            f"{g.temperature:g} with the same uniforms for every arm."
            + "".join(e.describe(cfg) for e in regime))

    def cells(self, cfg: GranularityConfig) -> list[Cell]:
        """The selected experiments' cells (a cell two of them make once), in the order of :func:`_run_order`."""
        return sorted(super().cells(cfg), key=_run_order)

    def prepare(self, cfg: GranularityConfig, progress: bool = True) -> None:
        """Build the base policies the selected experiments need, once, in the driver (cached)."""
        from creditlab.train.toolshop_base import prepare_base_policy

        labels = {id(cfg.base): "granularity base policy", id(cfg.multi_base): "granularity three-type base policy",
                  id(cfg.warm_base): "granularity warm-started teacher base policy",
                  id(cfg.budget_base): "granularity budget base policy"}
        for b in cfg.bases():
            prepare_base_policy(b, cfg.cache(), labels[id(b)], progress)

    def lab_tables(self, rows: dict[str, pd.DataFrame], cfg: GranularityConfig) -> dict[str, Table]:
        """The knobs and the gates, before every selected experiment's tables (the predictions read the gates)."""
        tabs = {"knobs": Table(knobs_table(self._knob_rows(cfg), self._knob_rows(GranularityConfig())),
                               "Knobs chosen for this lab, and why")}
        if "gates" in rows:
            gates = [r for e in self.selected(cfg) for r in e.gate_rows(rows["gates"], cfg)]
            tabs["gates"] = Table(pd.DataFrame(gates, columns=["experiment", "gate", "measured", "threshold", "passes",
                                                               "note"]),
                                  "Gates: each new experiment's preconditions, measured on its base policy before "
                                  "training", ".3g", console=True)
        return tabs

    def interpret(self, tabs: dict[str, Table], cfg: GranularityConfig) -> dict[str, str]:
        note = _quick_note(cfg)
        text = {"knobs": "Every setting of this run that a person chose, with the reason; none was tuned to make an "
                         "arm win or lose. Settings not listed are the defaults of GRPOConfig and BaseConfig." + note}
        text.update(super().interpret(tabs, cfg))
        if "gates" in tabs:
            text["gates"] = ("Measured on each experiment's base policy before any arm trains. "
                             + " ".join(f"{e.name}: {e.gate_reading}" for e in self.experiments if e.gate_reading)
                             + note)
        if self.predictions_name in tabs and cfg.grpo.updates < 20:
            text[self.predictions_name] += " A quick run is too small for these verdicts to mean anything."
        return text

    def _knob_rows(self, cfg: GranularityConfig) -> list[tuple[str, str, str]]:
        """Each knob with its value in ``cfg`` and why: the shared ones, each experiment's, the gates."""
        g, U = cfg.grpo, cfg.grpo.updates
        return [
            ("task types", "; ".join(f"{t}: C = {', '.join(map(str, c))}" for t, c in TASK_TYPES.items()),
             "short chains as in the toolshop lab; the long type needs 7-8 tool calls (up to 10 turns), where the base "
             "policy's rollouts mix good and bad turns. Each task draws one of the five chain lengths (short 60%, "
             "long 40%)."),
            ("base policy", base_knob(cfg.base),
             "the toolshop defaults, on the lab's chain lengths; one base policy for every arm and seed."),
            ("updates", str(U), "the paper's 50, so its decay schedule (20 -> 30 of 50) applies unscaled."),
            ("rollouts per update", f"{g.tasks_per_update} tasks x {g.group_size}",
             "half the toolshop lab's 256, for time (the cost of a run is linear in rollouts)."),
            ("optimisation", optim_knob(g), "GRPOConfig defaults for every arm, OPSD included; not tuned."),
            ("process reward", f"new read 1, repeated read {cfg.repeat:g}, errors and writes 0",
             "the lab's hackable proxy: it pays for evidence, and a repeated read still pays a little."),
            ("process weight", f"fixed {cfg.lam:g}; decayed {cfg.lam:g} -> 0 over updates {cfg.decay_start * U:g}-"
                               f"{cfg.decay_end * U:g} (power {cfg.decay_power:g})",
             "the paper's values (0.5, cubic decay between 20 and 30 of 50), as fractions of the run."),
            ("OPSD", f"beta {cfg.beta:g} (generalised JSD), teacher = frozen base policy",
             "the core default beta; the teacher is the initial policy; no outcome reward."),
            ("held-out evaluation", f"{cfg.eval_per_type} tasks per type every {g.eval_every} updates, sampled",
             "the same tasks and sampling uniforms for every arm, seed and evaluation point."),
            seeds_knob(cfg.seeds),
            *(row for e in self.experiments for row in e.knob_rows(cfg)),
            ("gates", "; ".join(e.gate_knob for e in self.experiments if e.gate_knob),
             "the product plan's thresholds, measured before the arms train."),
        ]


LAB = GranularityLab()


def _quick_note(cfg: GranularityConfig) -> str:
    """What a run on base policies other than the lab's (a --quick run) can and cannot show."""
    lab = GranularityConfig()
    names = {"base": "base policy", "multi_base": "three-type base policy", "warm_base": "warm-started base policy",
             "budget_base": "budget base policy"}
    used = {names[n]: getattr(cfg, n) for n in names if any(getattr(cfg, n) == b for b in cfg.bases())}
    return base_note(used, {names[n]: getattr(lab, n) for n in names},
                     "the gates are measured on these policies and say what they do, not what the full run's base "
                     "policies do (the quick three-type base solves few long and multi-exchange tasks); a quick run "
                     "shows every experiment's tables end to end and tests no prediction.")
