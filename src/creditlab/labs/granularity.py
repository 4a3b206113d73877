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

Turn judge (:func:`judge_turns`, for the mixing score): a turn is *good* when it is a call of the
task's correct episode (the noiseless scripted agent's calls: same tool and same arguments) made
for the first time in the episode, *bad* otherwise (an error, a wrong entity, a repeat, a wrong
write). The mixing score of a rollout is ``2 min(good, bad) / (good + bad)``
(:func:`creditlab.core.diagnostics.mixing_score`).

Cells: one per (arm, seed); a cell's rows depend only on its arguments, and every finished cell is
stored at once (resumable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import pandas as pd
import torch

from creditlab.core.diagnostics import mixing_score
from creditlab.envs.toolshop import MULTI_EXCHANGE, MultiTask, Task, TurnRecord, make_multi_task, make_task
from creditlab.errors import ConfigError, InputError
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import LabConfig, LabOption, Table, check_count
from creditlab.lab.report import group_means, knobs_table, paired_diff, read_diff, small_run_note, sort_in_order
from creditlab.lab.runner import Cell
from creditlab.labs._toolshop import (
    BasePolicyConfig,
    BasePolicyLab,
    base_knob,
    base_note,
    fresh_dump,
    optim_knob,
    seeds_knob,
)
from creditlab.rewards.process import evidence_scores
from creditlab.train.common import generator
from creditlab.train.opsd import aligned_logits, call_key, episode_calls, teacher_logits, train_opsd
from creditlab.train.toolshop_base import BaseConfig, base_policy
from creditlab.train.toolshop_grpo import GRPOConfig, make_prm_advantage, train_grpo
from creditlab.train.toolshop_rollout import (
    EVAL_SEED_OFFSET,
    RolloutBatch,
    make_tasks,
    rollout,
)

__all__ = [
    "ARMS",
    "LAB",
    "QUICK_BASE",
    "QUICK_MULTI_BASE",
    "QUICK_WARM_BASE",
    "TASK_TYPES",
    "GranularityConfig",
    "GranularityLab",
    "judge_turns",
    "process_scores",
]

#: Task types: name -> chain lengths (a task of the type draws one, cycling over the list).
TASK_TYPES: dict[str, tuple[int, ...]] = {"short": (2, 3, 4), "long": (7, 8)}
#: Every chain length of the task types (the base policy's and training's chain lengths).
TASK_CHAIN_LENGTHS = (2, 3, 4, 7, 8)
#: The multi-exchange type (experiment ``multi``): 3-4 independent short exchanges per episode, graded
#: outcome (share solved), budget 2 (C + 2) (:class:`creditlab.envs.toolshop.MultiTask`).
MULTI_TYPES: dict[str, tuple[int, ...]] = {**TASK_TYPES, "multi": (MULTI_EXCHANGE,)}
#: The task mix of experiment ``multi``: short 3/7, long 2/7, multi 2/7 of the tasks.
MULTI_CHAIN_LENGTHS = (*TASK_CHAIN_LENGTHS, MULTI_EXCHANGE, MULTI_EXCHANGE)
#: Experiments beyond the arms (selected with -e): the multi-exchange type, the repeat sweep, the
#: self-distillation teachers warm-started on their hints.
NEW_EXPERIMENTS = ("multi", "repeat", "warm")
#: The base policies of ``--quick``, built on first use in about a minute together: the lab's in 700
#: steps of 32 demonstrations at lr 1e-2 (the full one: 1000 of 128 at 3e-3); the three-type one in
#: 200 steps of 32 from it (full: 400 of 64); the warm-started one in 300 steps of 32 at lr 1e-2 from
#: it too (full: 1000 of 128 from scratch). What they can and cannot show: docs/granularity.md.
QUICK_BASE = BaseConfig(chain_lengths=TASK_CHAIN_LENGTHS, steps=700, batch_size=32, lr=1e-2)
QUICK_MULTI_BASE = BaseConfig(chain_lengths=MULTI_CHAIN_LENGTHS, max_len=320, steps=200, batch_size=32, lr=1e-3,
                              init=QUICK_BASE.key())
QUICK_WARM_BASE = BaseConfig(chain_lengths=TASK_CHAIN_LENGTHS, privileged=0.5, steps=300, batch_size=32, lr=1e-2,
                             init=QUICK_BASE.key())
#: Arms of each new experiment.
MULTI_ARMS, SWEEP_ARMS = ("grpo", "prm_decay"), ("prm_fixed", "prm_decay")
WARM_ARMS = ("grpo", "opsd_ref", "opsd_advice")
#: The gates: the multi type's base mixing, the teachers' preference over their placebos (nats).
MIXING_GATE, TEACHER_GATE = 0.6, 1.0
#: Arm -> (kind, what); kinds: grpo (outcome), prm (mixed process reward), opsd (self-distillation).
ARMS: dict[str, tuple[str, str]] = {
    "grpo": ("grpo", "outcome"),
    "prm_fixed": ("prm", "fixed"),
    "prm_decay": ("prm", "decay"),
    "opsd_ref": ("opsd", "ref"),
    "opsd_advice": ("opsd", "advice"),
}
LABELS = {"grpo": "GRPO", "prm_fixed": "PRM fixed λ", "prm_decay": "PRM decayed λ", "opsd_ref": "OPSD ref-answer",
          "opsd_advice": "OPSD turn-advice"}
UNIT, DIFF = (0.0, 1.0), (-1.0, 1.0)


def type_of(chain_length: int) -> str:
    """The task type of a chain length (see :data:`TASK_TYPES`)."""
    for name, lengths in TASK_TYPES.items():
        if int(chain_length) in lengths:
            return name
    raise InputError(f"chain_length: {chain_length} is in no task type ({TASK_TYPES})")


def type_of_task(task: Task | MultiTask) -> str:
    """The task type of a task: ``multi`` for a multi-exchange task, else that of its chain length."""
    return "multi" if isinstance(task, MultiTask) else type_of(task.chain_length)


def parse_repeats(text: str) -> tuple[float, ...]:
    """The ``--repeats`` values: comma-separated numbers in [0, 1], e.g. ``0.25,0.5,0.75,1``."""
    try:
        vals = tuple(float(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise ConfigError("repeats", f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not 0.0 <= v <= 1.0 for v in vals) or len(set(vals)) != len(vals):
        raise ConfigError("repeats", f"expected distinct numbers in [0, 1], got {text!r}")
    return vals


@dataclass(frozen=True)
class GranularityConfig(BasePolicyConfig, LabConfig):
    """Configuration of the granularity lab."""

    OPTIONS: ClassVar[dict[str, str]] = {"updates": "grpo.updates"}
    EXPERIMENTS: ClassVar[tuple[str, ...]] = (*ARMS, *NEW_EXPERIMENTS)
    SELECTION: ClassVar[tuple[str, ...]] = ("experiments", "cache_dir", "dump_dir")

    base: BaseConfig = field(default_factory=lambda: BaseConfig(chain_lengths=TASK_CHAIN_LENGTHS))
    """Supervised warm start of the shared base policy (cached), on every chain length of the mix."""
    grpo: GRPOConfig = field(default_factory=lambda: GRPOConfig(
        updates=50, tasks_per_update=16, group_size=8, chain_lengths=TASK_CHAIN_LENGTHS, eval_every=10))
    """Training shared by every arm (outcome GRPO's settings; OPSD uses its lr, minibatches, grad clip)."""
    seeds: int = 3
    """Paired seeds per arm (task stream, sampling, minibatch order)."""
    lam: float = 0.5
    """Weight of the process advantage (fixed arm; start of the decayed arm)."""
    decay_start: float = 0.4
    """Decayed arm: the weight starts to fall at this fraction of the updates (20 of 50)."""
    decay_end: float = 0.6
    """Decayed arm: the weight reaches 0 at this fraction of the updates (30 of 50)."""
    decay_power: float = 3.0
    """Decayed arm: the power of the decay (cubic)."""
    repeat: float = 0.25
    """Process score of a read that returned nothing new."""
    beta: float = 0.5
    """OPSD: generalised JSD interpolation (0 forward KL(teacher||student), 1 reverse KL)."""
    eval_per_type: int = 128
    """Held-out tasks per task type at each evaluation (fixed, the same for every arm and seed)."""
    experiments: tuple[str, ...] = tuple(ARMS)
    """Arms to run (grpo, prm_fixed, prm_decay, opsd_ref, opsd_advice) and experiments: ``multi``
    (GRPO and the decayed PRM on short, long and multi-exchange tasks), ``repeat`` (fixed and
    decayed PRM at each ``repeats`` value, judged by ``creditlab diagnose``), ``warm`` (GRPO and both
    OPSD teachers from the base policy warm-started on the teachers' hints)."""
    multi_base: BaseConfig = field(default_factory=lambda: BaseConfig(
        chain_lengths=MULTI_CHAIN_LENGTHS, max_len=320, steps=400, batch_size=64, lr=1e-3,
        init=BaseConfig(chain_lengths=TASK_CHAIN_LENGTHS).key()))
    """Experiment multi: the base policy of the three-type mix (a longer context: 320 tokens), started
    from the lab's base policy and trained 400 steps of 64 demonstrations at lr 1e-3, for time: its
    sequences are twice as long, and a fresh build of that size did not learn the tasks."""
    multi_max_len: int = 320
    """Experiment multi: token budget of a trajectory (the multi-exchange budget is 16-36 turns)."""
    warm_base: BaseConfig = field(default_factory=lambda: BaseConfig(chain_lengths=TASK_CHAIN_LENGTHS,
                                                                     privileged=0.5))
    """Experiment warm: the base policy with half of its demonstrations carrying a teacher's hint."""
    repeats: str = "0.25,0.5,0.75,1.0"
    """Experiment repeat: the values of ``repeat`` swept (comma-separated, CLI --repeats)."""
    cache_dir: str | None = None
    """Where the base policy is cached (None: the user cache directory); never changes a number."""
    dump_dir: str | None = None
    """Write every training update's rollouts in the ``creditlab diagnose`` schema here (one JSONL
    file per arm and seed, for the cells this run computes); never changes a number."""

    @classmethod
    def quick(cls) -> GranularityConfig:
        """Every arm and experiment for 6 updates of 4 tasks x 4, one seed, from the quick base
        policies (:data:`QUICK_BASE`, :data:`QUICK_MULTI_BASE`, :data:`QUICK_WARM_BASE`)."""
        return cls(base=QUICK_BASE, multi_base=QUICK_MULTI_BASE, warm_base=QUICK_WARM_BASE,
                   grpo=GRPOConfig(updates=6, tasks_per_update=4, group_size=4, chain_lengths=TASK_CHAIN_LENGTHS,
                                   eval_every=3),
                   seeds=1, eval_per_type=16, experiments=(*ARMS, *NEW_EXPERIMENTS))

    def arms(self) -> tuple[str, ...]:
        """The arms selected (the experiments that are arms)."""
        return tuple(e for e in self.experiments if e in ARMS)

    def multi_grpo(self) -> GRPOConfig:
        """Experiment multi's training: the lab's, on the three-type mix with the longer budget."""
        return replace(self.grpo, chain_lengths=tuple(self.multi_base.chain_lengths), max_len=self.multi_max_len)

    def bases(self) -> list[BaseConfig]:
        """The base policies the selected experiments need (each its own cache entry)."""
        out = [self.base] if self.arms() or "repeat" in self.experiments else []
        for exp, b in (("multi", self.multi_base), ("warm", self.warm_base)):
            if exp in self.experiments:
                if b.init == self.base.key() and self.base not in out:
                    out.append(self.base)  # it starts from the lab's base policy (the quick ones do)
                out.append(b)
        return out

    def validate(self) -> None:
        check_count(self.seeds, "--seeds")
        if not self.experiments or any(e not in self.EXPERIMENTS for e in self.experiments):
            raise ConfigError("--experiment", f"got {list(self.experiments)}; valid: {', '.join(self.EXPERIMENTS)}")
        parse_repeats(self.repeats)
        if tuple(self.multi_base.chain_lengths) != MULTI_CHAIN_LENGTHS:
            raise ConfigError("multi_base.chain_lengths", f"must be {MULTI_CHAIN_LENGTHS} (the three-type mix)")
        if self.multi_max_len > self.multi_base.max_len:
            raise ConfigError("multi_max_len", f"{self.multi_max_len} exceeds the model's {self.multi_base.max_len}")
        if tuple(self.warm_base.chain_lengths) != tuple(self.base.chain_lengths):
            raise ConfigError("warm_base.chain_lengths", "must equal base.chain_lengths (the same tasks)")
        if not 0.0 < self.warm_base.privileged <= 1.0:
            raise ConfigError("warm_base.privileged", f"must be in (0, 1], got {self.warm_base.privileged}")
        g = self.grpo
        if g.eval_every < 1:
            raise ConfigError("grpo.eval_every", "the lab scores held-out success over training: must be >= 1")
        if g.max_len > self.base.max_len:
            raise ConfigError("grpo.max_len", f"{g.max_len} exceeds the model's {self.base.max_len}")
        if tuple(g.chain_lengths) != tuple(self.base.chain_lengths):
            raise ConfigError("grpo.chain_lengths", "must equal base.chain_lengths (the base policy's tasks)")
        if not set(g.chain_lengths) <= {c for cs in TASK_TYPES.values() for c in cs}:
            raise ConfigError("grpo.chain_lengths", f"every chain length must belong to a task type {TASK_TYPES}")
        if g.advantage != "grpo" or g.correction != "none" or g.rollout_precision != "fp32":
            raise ConfigError("grpo", "the granularity lab trains fp32 outcome GRPO without a correction")
        if not 0 < self.decay_start <= self.decay_end <= 1:
            raise ConfigError("decay_start", "needs 0 < decay_start <= decay_end <= 1")
        if not 0.0 <= self.beta <= 1.0:
            raise ConfigError("beta", f"must be in [0, 1], got {self.beta}")
        if not 0.0 <= self.repeat <= 1.0:
            raise ConfigError("repeat", f"must be in [0, 1], got {self.repeat}")
        if self.lam < 0:
            raise ConfigError("lam", f"must be >= 0, got {self.lam}")
        if self.eval_per_type < 1:
            raise ConfigError("eval_per_type", f"must be >= 1, got {self.eval_per_type}")

    def schedule(self, arm: str):
        """The process weight of a PRM arm as a function of the update index."""
        from creditlab.core.schedules import constant, decay

        if arm == "prm_fixed":
            return constant(self.lam)
        U = self.grpo.updates
        return decay(self.lam, start=self.decay_start * U, end=self.decay_end * U, power=self.decay_power)


# --------------------------------------------------------------------------------------------
# the world: process scores, the turn judge, privileged contexts


def process_scores(batch: RolloutBatch, repeat: float = 0.25) -> torch.Tensor:
    """``(B, T)`` evidence scores of every turn of ``batch`` (0 on turns not taken)."""
    T = max(batch.n_turns_max, 1)
    out = torch.zeros(len(batch), T)
    for b, (task, recs) in enumerate(zip(batch.tasks, batch.records, strict=True)):
        s = evidence_scores(recs, task.given, repeat=repeat)
        out[b, :len(s)] = torch.tensor(s)
    return out


def judge_turns(task: Task, records: list[TurnRecord]) -> list[bool]:
    """Good (True) / bad (False) for each turn: a correct call made for the first time (module doc)."""
    correct = {k for k, _ in episode_calls(task)}
    done: set = set()
    out = []
    for rec in records:
        k = call_key(rec)
        good = k is not None and k in correct and k not in done
        if good:
            done.add(k)
        out.append(good)
    return out


# --------------------------------------------------------------------------------------------
# per-batch statistics shared by every arm


def batch_stats(batch: RolloutBatch, repeat: float, proc: torch.Tensor | None = None) -> dict[str, float]:
    """Outcome, process reward, truncation, tool calls and mixing of one batch, overall and per type
    (``proc``: the batch's :func:`process_scores`, when the caller has them already)."""
    proc = process_scores(batch, repeat) if proc is None else proc
    row: dict[str, float] = {}
    types = np.array([type_of_task(t) for t in batch.tasks])
    n_calls = batch.n_calls.float()
    mean_proc = torch.stack([proc[b, :max(int(n_calls[b]), 1)].mean() for b in range(len(batch))])
    good = [judge_turns(t, r) for t, r in zip(batch.tasks, batch.records, strict=True)]
    n_pos = torch.tensor([sum(g) for g in good], dtype=torch.float64)
    n_neg = torch.tensor([len(g) - sum(g) for g in good], dtype=torch.float64)
    mix, inc = mixing_score(n_pos, n_neg)
    for name, sel in (("all", np.ones(len(batch), bool)), *((t, types == t) for t in MULTI_TYPES)):
        idx = torch.as_tensor(sel)
        if not bool(idx.any()):
            continue
        pre = "" if name == "all" else f"{name}/"
        ok = batch.success[idx]
        calls = n_calls[idx]
        row[f"{pre}success"] = float(ok.mean())
        row[f"{pre}process"] = float(mean_proc[idx].mean())
        row[f"{pre}truncation"] = float(batch.truncated[idx].float().mean())
        row[f"{pre}tool_calls"] = float(calls.mean())
        row[f"{pre}turns_success"] = float(calls[ok > 0].mean()) if bool((ok > 0).any()) else math.nan
        row[f"{pre}response_tokens"] = float(batch.policy_mask[idx].sum(1).float().mean())
        m = idx & inc
        row[f"{pre}mixing"] = float(mix[m].mean()) if bool(m.any()) else math.nan
        row[f"{pre}good_share"] = float(n_pos[idx].sum() / max(float((n_pos + n_neg)[idx].sum()), 1.0))
    return row


def eval_tasks(cfg: GranularityConfig, types: dict[str, tuple[int, ...]] = TASK_TYPES) -> list[Task]:
    """The fixed held-out tasks: ``eval_per_type`` of each type, chain lengths cycling in the type
    (the seeds of a type do not depend on which other types are evaluated)."""
    tasks = []
    for name, lengths in types.items():
        base = EVAL_SEED_OFFSET + 1_000_000 * list(MULTI_TYPES).index(name)
        tasks += [make_multi_task(base + i) if lengths[i % len(lengths)] == MULTI_EXCHANGE
                  else make_task(base + i, lengths[i % len(lengths)]) for i in range(cfg.eval_per_type)]
    return tasks


@torch.no_grad()
def evaluate_types(model, cfg: GranularityConfig, types: dict[str, tuple[int, ...]] = TASK_TYPES,
                   g: GRPOConfig | None = None, repeat: float | None = None) -> dict[str, float]:
    """Held-out statistics per task type (fp32 engine, sampled at the training temperature, fixed uniforms)."""
    g = cfg.grpo if g is None else g
    batch = rollout(model, eval_tasks(cfg, types), precision="fp32", max_len=g.max_len, max_turns=g.max_turns,
                    max_action_len=g.max_action_len, temperature=g.temperature,
                    generator=generator("granularity/eval"))
    return {f"eval/{k}": v for k, v in batch_stats(batch, cfg.repeat if repeat is None else repeat).items()}


# --------------------------------------------------------------------------------------------
# cells


@torch.no_grad()
def run_teacher_cell(config: dict, cache_dir: str) -> list[dict]:
    """How much each privileged teacher knows, before any training: on the base policy's own
    held-out trajectories, the teacher-student KL per policy token and the teacher-minus-student
    log-prob of the tokens of good and of bad turns (:func:`judge_turns`), for each teacher and for
    its placebo (the same format holding another task's privileged tokens). A teacher that reads
    its privileged tokens raises good turns and lowers bad ones more than its placebo does."""
    cfg = GranularityConfig.from_dict(config)
    return teacher_rows(cfg, base_policy(cfg.base, cache_dir=cache_dir))


@torch.no_grad()
def teacher_rows(cfg: GranularityConfig, model) -> list[dict]:
    """The rows of :func:`run_teacher_cell` for the base policy ``model``."""
    g = cfg.grpo
    tasks = eval_tasks(cfg)
    batch = rollout(model, tasks, precision="fp32", max_len=g.max_len, max_turns=g.max_turns,
                    max_action_len=g.max_action_len, generator=generator("granularity/teacher"))
    pm = batch.policy_mask
    ls = torch.log_softmax(aligned_logits(model(batch.tokens).float()), -1)
    good_turn = torch.zeros_like(pm)
    for b, (task, recs) in enumerate(zip(batch.tasks, batch.records, strict=True)):
        for t, ok in enumerate(judge_turns(task, recs)):
            if ok:
                good_turn[b] |= batch.turn_ids[b] == t
    donors = tasks[1:] + tasks[:1]
    types = [type_of_task(t) for t in batch.tasks]
    rows = []
    for kind in ("ref", "advice"):
        for placebo in (False, True):
            lt = torch.log_softmax(teacher_logits(model, batch, kind, donors=donors if placebo else None), -1)
            rev = (ls.exp() * (ls - lt)).sum(-1)
            gap = (lt - ls).gather(-1, batch.tokens[..., None]).squeeze(-1)  # teacher - student, sampled token
            for name in ("all", *TASK_TYPES):
                sel = pm & (torch.tensor([name in ("all", ty) for ty in types])[:, None])
                good, bad = sel & good_turn, sel & ~good_turn
                rows.append({"teacher": kind, "placebo": placebo, "type": name,
                             "reverse_kl": float(rev[sel].mean()),
                             "gap_good": float(gap[good].mean()) if bool(good.any()) else math.nan,
                             "gap_bad": float(gap[bad].mean()) if bool(bad.any()) else math.nan,
                             "tokens": int(sel.sum())})
    for r in rows:
        r["preference"] = r["gap_good"] - r["gap_bad"]
    return rows



#: Where a cell's base policy, training and held-out task types come from: ``default`` (the lab's
#: arms), ``multi``, ``warm`` and ``sweep`` (the repeat sweep, on the lab's base policy).
SETTINGS = ("default", "multi", "warm", "sweep")


def setting_of(cfg: GranularityConfig, setting: str) -> tuple[BaseConfig, GRPOConfig, dict[str, tuple[int, ...]]]:
    """The base policy config, training config and held-out task types of ``setting``."""
    if setting == "multi":
        return cfg.multi_base, cfg.multi_grpo(), MULTI_TYPES
    if setting == "warm":
        return cfg.warm_base, cfg.grpo, TASK_TYPES
    if setting in ("default", "sweep"):
        return cfg.base, cfg.grpo, TASK_TYPES
    raise InputError(f"setting: {setting!r} is not one of {SETTINGS}")


def dump_name(arm: str, seed: int, setting: str = "default", repeat: float | None = None) -> str:
    """The dump file of one training run."""
    if setting == "default":
        return f"granularity-{arm}-seed={seed}.jsonl"
    tag = f"-repeat={repeat:g}" if setting == "sweep" else ""
    return f"granularity-{setting}-{arm}{tag}-seed={seed}.jsonl"


def run_arm(config: dict, arm: str, seed: int, cache_dir: str, dump_dir: str | None = None,
            setting: str = "default", repeat: float | None = None) -> list[dict]:
    """One training run (a cell): ``arm`` from the cached base policy of ``setting``
    (:func:`setting_of`) with ``seed``, the process reward scoring a repeated read ``repeat``
    (default: the config's). Rows: one per update (training statistics of that update's rollouts,
    ``kind = "train"``) and one per evaluation point (held-out statistics per task type,
    ``kind = "eval"``); a ``sweep`` run also gets the verdict of ``creditlab diagnose``'s
    ``reward.process_hacking`` check on its own dump (``kind = "verdict"``; the dump goes to
    ``dump_dir``, or to a temporary file)."""
    import copy
    import tempfile

    cfg = GranularityConfig.from_dict(config)
    if repeat is not None:
        cfg = replace(cfg, repeat=float(repeat))
    base_cfg, grpo, types = setting_of(cfg, setting)
    model = base_policy(base_cfg, cache_dir=cache_dir)
    g = replace(grpo, seed=seed, eval_every=0)
    kind, what = ARMS[arm]
    extra: dict[int, dict[str, float]] = {}
    tmp = tempfile.TemporaryDirectory() if setting == "sweep" and not dump_dir else None
    where = tmp.name if tmp is not None else dump_dir
    path = fresh_dump(where, dump_name(arm, seed, setting, cfg.repeat)) if where else None
    evals: list[dict] = []
    scored: dict = {}  # the last batch on_rollouts scored, and its process scores

    def on_rollouts(k, batch, rewards, old):
        if k % cfg.grpo.eval_every == 0:
            evals.append({"kind": "eval", "update": float(k), **evaluate_types(model, cfg, types, grpo)})
        proc = process_scores(batch, cfg.repeat)
        scored.update(batch=batch, proc=proc)
        extra[k] = batch_stats(batch, cfg.repeat, proc)
        if kind == "prm":
            extra[k]["lam"] = float(cfg.schedule(arm)(k))
        if path is not None:
            from creditlab.train.toolshop_dump import dump_rollouts

            dump_rollouts(batch, rewards, k, path, logprobs=old, process_scores=proc)

    if kind == "opsd":
        teacher = copy.deepcopy(model)
        rows = train_opsd(model, teacher, g, what, beta=cfg.beta, on_rollouts=on_rollouts)
    else:
        def scores(b: RolloutBatch) -> torch.Tensor:  # this update's, scored once in on_rollouts
            return scored["proc"] if scored.get("batch") is b else process_scores(b, cfg.repeat)

        adv = (make_prm_advantage(scores, cfg.schedule(arm))
               if kind == "prm" else None)
        rows = train_grpo(model, g, advantage=adv, on_rollouts=on_rollouts)
    evals.append({"kind": "eval", "update": float(g.updates), **evaluate_types(model, cfg, types, grpo)})
    keep = ("update", "grad_norm", "grad/clipped", "loss/", "opsd/", "episode/policy_tokens", "time/update_s",
            "adv/abs_mean")
    out = []
    for r in rows:
        k = int(r["update"])
        out.append({"kind": "train", **{n: v for n, v in r.items() if n.startswith(keep)}, **extra[k]})
    if setting == "sweep":
        out.append({"kind": "verdict", **_hacking_verdict(path)})
    if tmp is not None:
        tmp.cleanup()
    tag = {"repeat": cfg.repeat} if setting == "sweep" else {}
    return [{"arm": arm, "seed": seed, **tag, **r} for r in out + evals]


def _hacking_verdict(path: Path) -> dict:
    """The ``reward.process_hacking`` check of ``creditlab diagnose`` on one dump."""
    from creditlab.diagnose.checks import run_checks
    from creditlab.diagnose.readers import read_dump

    (r,) = run_checks(read_dump([path]), only=("reward.process_hacking",))
    return {"status": r.status, "value": math.nan if r.value is None else float(r.value), "message": r.message}


#: Held-out seeds of the mean-turn-score gate (the training mix, disjoint from the evaluation's).
GATE_SEED_OFFSET = EVAL_SEED_OFFSET + 3_000_000


@torch.no_grad()
def run_gate_cell(config: dict, gate: str, cache_dir: str) -> list[dict]:
    """The preconditions of one new experiment, on its base policy before any training:

    * ``multi``: the held-out mixing score, good-turn share, success and truncation per task type
      (short, long, multi) of the three-type base policy;
    * ``repeat``: the mean turn score of the lab's base policy (the mean process score over every
      turn of its rollouts on the training mix) at each swept ``repeat``, the threshold the
      repeat sweep's prediction is stated against;
    * ``warm``: the teacher table (:func:`teacher_rows`) of the warm-started base policy."""
    cfg = GranularityConfig.from_dict(config)
    base_cfg, g, types = setting_of(cfg, {"repeat": "sweep"}.get(gate, gate))
    model = base_policy(base_cfg, cache_dir=cache_dir)
    if gate == "warm":
        return [{"gate": "teacher", **r} for r in teacher_rows(cfg, model)]
    if gate == "multi":
        ev = evaluate_types(model, cfg, types, g)
        return [{"gate": "mixing", "type": t, **{m: ev.get(f"eval/{m}" if t == "all" else f"eval/{t}/{m}", math.nan)
                                                 for m in EVAL_METRICS}} for t in ("all", *types)]
    if gate != "repeat":
        raise InputError(f"gate: {gate!r} is not one of multi, repeat, warm")
    tasks = make_tasks(range(GATE_SEED_OFFSET, GATE_SEED_OFFSET + 4 * cfg.eval_per_type), g.chain_lengths)
    batch = rollout(model, tasks, precision="fp32", max_len=g.max_len, max_turns=g.max_turns,
                    max_action_len=g.max_action_len, temperature=g.temperature,
                    generator=generator("granularity/teacher"))  # the precondition cells' stream
    taken = torch.arange(max(batch.n_turns_max, 1))[None, :] < batch.n_calls[:, None]
    rows = []
    for r in parse_repeats(cfg.repeats):
        proc = process_scores(batch, r)[taken]
        rows.append({"gate": "turn_score", "repeat": r, "mean_turn_score": float(proc.mean()),
                     "share_new_reads": float((proc == 1.0).double().mean()) if r < 1 else math.nan,
                     "share_repeats": float((proc == r).double().mean()) if 0 < r < 1 else math.nan,
                     "turns": int(taken.sum()), "rollouts": len(batch)})
    return rows


# --------------------------------------------------------------------------------------------
# tables


def _ordered(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Sorted by ``by``, arms in the order of :data:`ARMS`, task types in that of :data:`TASK_TYPES`."""
    return sort_in_order(df, by, {"arm": ARMS, "type": ("all", *MULTI_TYPES)})


EVAL_METRICS = ("success", "truncation", "tool_calls", "turns_success", "mixing", "good_share", "process",
                "response_tokens")


def _summary(df: pd.DataFrame, types: dict[str, tuple[int, ...]] = TASK_TYPES) -> pd.DataFrame:
    """One row per arm, seed and task type: the final held-out statistics, and the base policy's."""
    ev = df[df["kind"] == "eval"]
    rows = []
    for (arm, seed), g in ev.groupby(["arm", "seed"], sort=False):
        last = g[g["update"] == g["update"].max()].iloc[0]
        first = g[g["update"] == g["update"].min()].iloc[0]
        for t in ("all", *types):
            pre = "eval/" if t == "all" else f"eval/{t}/"
            row = {"arm": arm, "seed": int(seed), "type": t}
            row.update({m: last.get(pre + m, math.nan) for m in EVAL_METRICS})
            row["base_success"] = first.get(pre + "success", math.nan)
            row["gain"] = row["success"] - row["base_success"]
            rows.append(row)
    return _ordered(pd.DataFrame(rows), ["arm", "seed", "type"])


def _means(summary: pd.DataFrame) -> pd.DataFrame:
    means = group_means(summary, ["arm", "type"], [("success", UNIT), ("gain", DIFF), ("truncation", UNIT)],
                        ("tool_calls", "turns_success", "mixing"))
    return _ordered(means, ["arm", "type"])


def _diffs(summary: pd.DataFrame) -> pd.DataFrame:
    if "grpo" not in set(summary["arm"]):
        return pd.DataFrame()
    out = []
    for a in [a for a in ARMS if a != "grpo" and a in set(summary["arm"])]:
        merged = None
        for m in ("success", "truncation"):
            d = paired_diff(summary, a, "grpo", ["type"], m, bounds=DIFF).rename(
                columns={"mean": m, "lo": f"{m}_lo", "hi": f"{m}_hi"})
            merged = d if merged is None else merged.merge(d.drop(columns=["n"]), on=["diff", "type"])
        out.append(merged)
    res = pd.concat(out, ignore_index=True)
    return _ordered(res[["diff", "type", "success", "success_lo", "success_hi", "truncation", "truncation_lo",
                         "truncation_hi", "n"]], ["diff", "type"])


def _phases(df: pd.DataFrame, U: int) -> pd.DataFrame:
    """Training statistics per arm in the first and last fifth of the updates (means over seeds)."""
    tr = df[df["kind"] == "train"]
    rows = []
    cols = ["success", "process", "truncation", "tool_calls", "response_tokens", "grad_norm"]
    for arm, g in tr.groupby("arm", sort=False):
        early, late = g[g["update"] < U / 5], g[g["update"] >= U - U / 5]
        row = {"arm": arm}
        for c in cols:
            if c in g.columns:
                row[f"{c}_early"] = float(early[c].mean())
                row[f"{c}_late"] = float(late[c].mean())
        rows.append(row)
    return _ordered(pd.DataFrame(rows), ["arm"])


def _opsd(df: pd.DataFrame, U: int) -> pd.DataFrame:
    tr = df[(df["kind"] == "train") & df["arm"].isin(["opsd_ref", "opsd_advice", "grpo"])]
    rows = []
    for arm, g in tr.groupby("arm", sort=False):
        per_seed = g.groupby("seed")
        row = {"arm": arm, "updates": U}
        for c, name in (("opsd/reverse_kl", "reverse_kl"), ("opsd/forward_kl", "forward_kl"),
                        ("grad_norm", "grad_norm"), ("opsd/kl_top_share", "kl_top5_share"),
                        ("opsd/kl_top_token_share", "kl_top5_token_share")):
            row[name] = float(g[c].mean()) if c in g.columns and g[c].notna().any() else math.nan
        if "grad/clipped" in g.columns and g["grad/clipped"].notna().any():
            row["clipped_updates"] = float(per_seed["grad/clipped"].apply(lambda v: float((v > 0).sum())).mean())
        else:
            row["clipped_updates"] = math.nan
        first = g[g["update"] < U / 5]["response_tokens"].mean()
        last = g[g["update"] >= U - U / 5]["response_tokens"].mean()
        row.update({"response_tokens_early": first, "response_tokens_late": last})
        rows.append(row)
    return _ordered(pd.DataFrame(rows), ["arm"])


def _arm_tables(rows: dict[str, pd.DataFrame], cfg: GranularityConfig) -> dict[str, Table]:
    """The tables of the lab's arms (experiment selection: the arms)."""
    df = rows["train"]
    df = df[df["arm"].isin(cfg.experiments)]
    U = cfg.grpo.updates
    summary = _summary(df)
    tabs = {"means": Table(_means(summary), "Held-out results per arm and task type (means over seeds, 95% "
                                            "intervals)", ".3g", console=True),
            "summary": Table(summary, "Held-out results per arm, seed and task type (final evaluation)", ".3g")}
    d = _diffs(summary)
    if len(d):
        tabs["diff_vs_grpo"] = Table(d, "Paired differences against GRPO (same seeds, same held-out tasks)", ".3g")
    tabs["phases"] = Table(_phases(df, U), "Training rollouts: first and last fifth of the updates", ".3g")
    if df["arm"].isin(["opsd_ref", "opsd_advice"]).any():
        tabs["opsd"] = Table(_opsd(df, U), "Self-distillation: KL, gradients, clipping, KL concentration", ".3g")
    if "teachers" in rows:
        tabs["teachers"] = Table(rows["teachers"].drop(columns=["cell_key"], errors="ignore"),
                                 "What the privileged teachers know (base policy, before training)", ".3g")
    tabs["mixing"] = Table(_mixing_table(df), "Turn mixing score by task type (held-out rollouts)", ".3g")
    diag = _diagnose_table(cfg)
    if diag is not None:
        tabs["diagnose"] = Table(diag, "creditlab diagnose on each run's training rollouts")
    cols = ["arm", "seed", "update"] + [c for c in CURVE_COLUMNS if c in df.columns]
    curves = df[df["kind"] == "train"][cols].sort_values(["arm", "seed", "update"]).reset_index(drop=True)
    tabs["curves"] = Table(curves, "Every training update of every run", ".3g", report=False)
    ev_cols = ["arm", "seed", "update"] + [c for c in df.columns if c.startswith("eval/")]
    tabs["eval_curves"] = Table(df[df["kind"] == "eval"][ev_cols].sort_values(["arm", "seed", "update"])
                                .reset_index(drop=True), "Every held-out evaluation", ".3g", report=False)
    return tabs


class _ArmReadings:
    """The readings of the arms' tables (a mixin of :class:`GranularityLab`)."""

    def _interpret_arms(self, tabs: dict[str, Table], cfg: GranularityConfig) -> dict[str, str]:
        few = small_run_note(cfg.seeds)
        text: dict[str, str] = {}
        m = tabs["means"].frame
        text["means"] = _read_means(m) + few
        text["summary"] = ("One row per run and task type at the final evaluation: success, truncation (share of "
                           "episodes that ended by the action budget without a write), tool calls per episode, "
                           "turns_success (mean turns of the successful episodes), mixing (turn mixing score), "
                           "good_share (share of good turns), process (mean evidence score per turn), "
                           "response_tokens (policy tokens per episode); base_success is the same run's evaluation "
                           "at update 0 (the base policy) and gain = success - base_success." + few)
        if "diff_vs_grpo" in tabs:
            d = tabs["diff_vs_grpo"].frame
            parts = []
            for metric in ("success", "truncation"):
                sub = d.rename(columns={metric: "mean", f"{metric}_lo": "lo", f"{metric}_hi": "hi"})
                for what, g in sub.groupby("diff", sort=False):
                    parts.append(f"[{metric}] " + read_diff(g[["type", "mean", "lo", "hi", "n"]], ["type"], what))
            text["diff_vs_grpo"] = ("Paired differences (arm - GRPO, same seeds, same held-out tasks) of final "
                                    "success and truncation by task type. " + " ".join(parts))
        text["phases"] = _read_phases(tabs["phases"].frame)
        if "opsd" in tabs:
            text["opsd"] = _read_opsd(tabs["opsd"].frame)
        text["mixing"] = _read_mixing(tabs["mixing"].frame)
        if "teachers" in tabs:
            text["teachers"] = _read_teachers(tabs["teachers"].frame)
        if "diagnose" in tabs:
            text["diagnose"] = _read_diagnose(tabs["diagnose"].frame)
        return text


class GranularityLab(_ArmReadings, BasePolicyLab):
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
    threads = 1  # one intra-op thread, as each process worker gets (see the mismatch lab)
    options = (LabOption("repeats", "Experiment repeat: the scores of a repeated read to sweep, comma-separated "
                                    "numbers in [0, 1] (default 0.25,0.5,0.75,1.0).", metavar="LIST"),)

    def describe(self, cfg: GranularityConfig) -> str:
        g = cfg.grpo
        U = g.updates
        return (
            "The tiny toolshop agent trained from one supervised base policy on a mix of task types: "
            + "; ".join(f"{t} (chains of {', '.join(map(str, c))} tool calls)" for t, c in TASK_TYPES.items())
            + f". Arms: {', '.join(LABELS[a] for a in cfg.arms()) or 'none'}; experiments: "
            f"{', '.join(e for e in NEW_EXPERIMENTS if e in cfg.experiments) or 'none'}. {U} updates of "
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
            + (" Experiment multi: GRPO and the decayed PRM on a mix of short, long and multi-exchange tasks (3-4 "
               "independent exchanges in one prompt, graded outcome: the share solved, budget 2 (C + 2)) from a base "
               "policy with a 320-token context." if "multi" in cfg.experiments else "")
            + (f" Experiment repeat: fixed and decayed PRM at repeat = {cfg.repeats}, each run judged by creditlab "
               "diagnose's reward.process_hacking check on its own dump." if "repeat" in cfg.experiments else "")
            + (" Experiment warm: GRPO and both OPSD teachers from a base policy warm-started with "
               f"{cfg.warm_base.privileged:.0%} of its demonstrations carrying a teacher's hint."
               if "warm" in cfg.experiments else ""))

    def cells(self, cfg: GranularityConfig) -> list[Cell]:
        ident, ctx = cfg.identity(), cfg.context(dump=True)
        new = [e for e in NEW_EXPERIMENTS if e in cfg.experiments]
        # a new experiment's cell computes one seed (and one repeat): the count of seeds and the list of
        # repeats change none of its rows, so they stay out of its key (a run with more seeds reuses it)
        own = {k: v for k, v in ident.items() if k not in ("seeds", "repeats")}

        def sweep_ctx(arm: str, r: float) -> dict:
            # at the lab's own repeat, a swept arm is the arm's training run, dumped by its train cell: no copy
            return cfg.context() if arm in cfg.arms() and r == cfg.repeat else ctx
        # the gates first: each new experiment's preconditions, measured before its arms train
        cells = [Cell("gates", g, run_gate_cell, {"config": ident, "gate": g}, cfg.context()) for g in new]
        cells += [Cell("train", f"{arm}/seed={s}", run_arm, {"config": ident, "arm": arm, "seed": s}, ctx)
                  for arm in cfg.arms() for s in range(cfg.seeds)]
        if any(ARMS[a][0] == "opsd" for a in cfg.arms()):
            cells.append(Cell("teachers", "base", run_teacher_cell, {"config": ident}, cfg.context()))
        for s in range(cfg.seeds):  # seed by seed: an interrupted run holds whole seeds
            cells += [Cell("multi", f"{arm}/seed={s}", run_arm, {"config": own, "arm": arm, "seed": s,
                                                                  "setting": "multi"}, ctx)
                      for arm in MULTI_ARMS if "multi" in new]
            cells += [Cell("sweep", f"{arm}/repeat={r:g}/seed={s}", run_arm,
                           {"config": own, "arm": arm, "seed": s, "setting": "sweep", "repeat": r}, sweep_ctx(arm, r))
                      for r in (parse_repeats(cfg.repeats) if "repeat" in new else ()) for arm in SWEEP_ARMS]
            cells += [Cell("warm", f"{arm}/seed={s}", run_arm, {"config": own, "arm": arm, "seed": s,
                                                                 "setting": "warm"}, ctx)
                      for arm in WARM_ARMS if "warm" in new]
        return cells

    def prepare(self, cfg: GranularityConfig, progress: bool = True) -> None:
        """Build the base policies the selected experiments need, once, in the driver (cached)."""
        from creditlab.train.toolshop_base import prepare_base_policy

        labels = {id(cfg.base): "granularity base policy", id(cfg.multi_base): "granularity three-type base policy",
                  id(cfg.warm_base): "granularity warm-started teacher base policy"}
        for b in cfg.bases():
            prepare_base_policy(b, cfg.cache(), labels[id(b)], progress)

    def tables(self, rows: dict[str, pd.DataFrame], cfg: GranularityConfig) -> dict[str, Table]:
        tabs = {"knobs": Table(_knobs(cfg), "Knobs chosen for this lab, and why")}
        if "gates" in rows:
            tabs["gates"] = Table(_gates_table(rows["gates"], cfg), "Gates: each new experiment's preconditions, "
                                  "measured on its base policy before training", ".3g", console=True)
        if cfg.arms() and "train" in rows:
            tabs.update(_arm_tables(rows, cfg))
        tabs.update(_new_tables(rows, cfg))
        return tabs

    def plots(self, tabs: dict[str, Table], cfg: GranularityConfig, out: Path) -> list[Path]:
        made = []
        if "curves" in tabs:
            curves = tabs["curves"].frame
            made += [_plot_hacking(curves, cfg, out), _plot_behaviour(curves, cfg, out),
                     _plot_final(tabs["means"].frame, out)]
            if "opsd" in tabs:
                made.append(_plot_opsd(curves, cfg, out))
        if "multi_mixing" in tabs:
            made.append(_plot_multi(tabs["multi_mixing"].frame, out))
        if "sweep" in tabs:
            made.append(_plot_sweep(tabs["sweep"].frame, out))
        if "warm_curves" in tabs:
            made.append(_plot_opsd(tabs["warm_curves"].frame, cfg, out, "granularity_warm_opsd.png"))
        return made

    def interpret(self, tabs: dict[str, Table], cfg: GranularityConfig) -> dict[str, str]:
        note = _quick_note(cfg)
        text = {"knobs": "Every setting of this run that a person chose, with the reason; none was tuned to make an "
                         "arm win or lose. Settings not listed are the defaults of GRPOConfig and BaseConfig." + note}
        if "means" in tabs:
            text.update(self._interpret_arms(tabs, cfg))
        text.update(_interpret_new(tabs, cfg))
        if "gates" in text:
            text["gates"] += note
        return text


LAB = GranularityLab()


def _quick_note(cfg: GranularityConfig) -> str:
    """What a run on base policies other than the lab's (a --quick run) can and cannot show."""
    lab = GranularityConfig()
    names = {"base": "base policy", "multi_base": "three-type base policy", "warm_base": "warm-started base policy"}
    used = {names[n]: getattr(cfg, n) for n in names if any(getattr(cfg, n) == b for b in cfg.bases())}
    return base_note(used, {names[n]: getattr(lab, n) for n in names},
                     "the gates are measured on these policies and say what they do, not what the full run's base "
                     "policies do (the quick three-type base solves few long and multi-exchange tasks); a quick run "
                     "shows every experiment's tables end to end and tests no prediction.")


CURVE_COLUMNS = ("success", "process", "truncation", "tool_calls", "response_tokens", "lam", "grad_norm",
                 "grad/clipped", "opsd/reverse_kl", "opsd/forward_kl", "opsd/kl_top_share",
                 "opsd/kl_top_token_share", "loss/opsd", "short/success", "long/success", "short/truncation",
                 "long/truncation", "short/mixing", "long/mixing")


def _mixing_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per task type: the base policy's held-out mixing score and good-turn share (update 0), and each
    arm's at the end with its success gain."""
    ev = df[df["kind"] == "eval"]
    rows = []
    for t in TASK_TYPES:
        pre = f"eval/{t}/"
        base = ev[ev["update"] == ev["update"].min()]
        row = {"type": t, "chain lengths": ", ".join(map(str, TASK_TYPES[t])),
               "base mixing": float(base[pre + "mixing"].mean()),
               "base good share": float(base[pre + "good_share"].mean()),
               "base success": float(base[pre + "success"].mean())}
        last = ev[ev["update"] == ev["update"].max()]
        for arm, g in last.groupby("arm", sort=False):
            row[f"{arm} mixing"] = float(g[pre + "mixing"].mean())
            row[f"{arm} gain"] = float(g[pre + "success"].mean()) - float(
                base[base["arm"] == arm][pre + "success"].mean())
        rows.append(row)
    return pd.DataFrame(rows)


def _knobs(cfg: GranularityConfig) -> pd.DataFrame:
    """Each knob with its value in this run, the lab's default, and why the default is what it is."""
    return knobs_table(_knob_rows(cfg), _knob_rows(GranularityConfig()))


def _knob_rows(cfg: GranularityConfig) -> list[tuple[str, str, str]]:
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
        ("multi-exchange type (-e multi)", f"3-4 exchanges of C = {', '.join(map(str, (2, 3, 4)))} per episode, budget "
         f"2 (C + 2), graded outcome; mix short 3/7, long 2/7, multi 2/7; {cfg.multi_max_len} tokens",
         "the paper's weak case: a long task with a graded, additive outcome over many turns, where a successful "
         "episode can hold as many bad turns as good ones. Sub-tasks are the short type's chains (existing tokens)."),
        ("three-type base policy", base_knob(cfg.multi_base) + f", context {cfg.multi_base.max_len}",
         "fewer steps and smaller batches than the lab's base policy: its sequences are about twice as long, and a "
         "full build took over an hour on the shared 2-core machine; not tuned on any result."),
        ("repeat sweep (-e repeat)", cfg.repeats, "the product plan's four values, from the lab's default (0.25) to a "
         "repeated read paying as much as a new one (1.0); fixed and decayed λ at each."),
        ("warm-started base (-e warm)", f"{cfg.warm_base.privileged:.0%} of the demonstrations carry a hint (half "
         f"the reference answer, half turn advice); {base_knob(cfg.warm_base)}",
         "the product plan's half; the rest of the warm start as the lab's base policy, so the only difference is "
         "the hints."),
        ("gates", f"multi base mixing >= {MIXING_GATE:g}; teacher - placebo preference >= {TEACHER_GATE:g} nat",
         "the product plan's thresholds, measured before the arms train."),
    ]


# --------------------------------------------------------------------------------------------
# creditlab diagnose on the dumps


def _diagnose_table(cfg: GranularityConfig) -> pd.DataFrame | None:
    if not cfg.dump_dir or not cfg.arms():
        return None
    from creditlab.diagnose.checks import run_checks
    from creditlab.diagnose.readers import read_dump

    rows = []
    for arm in cfg.arms():
        for seed in range(cfg.seeds):
            path = Path(cfg.dump_dir) / f"granularity-{arm}-seed={seed}.jsonl"
            if not path.exists():
                rows.append({"arm": arm, "seed": seed, "check": "(all)", "status": "skipped", "value": math.nan,
                             "message": f"no dump at {path}: this run did not compute that cell (a stored cell was "
                                        "reused); rerun with --fresh to dump it"})
                continue
            for r in run_checks(read_dump([path]), only=DIAGNOSE_CHECKS):
                rows.append({"arm": arm, "seed": seed, "check": r.id, "status": r.status,
                             "value": math.nan if r.value is None else float(r.value), "message": r.message})
    return pd.DataFrame(rows)


DIAGNOSE_CHECKS = ("reward.process_hacking", "credit.mixing")


def _read_diagnose(d: pd.DataFrame) -> str:
    hack = d[d["check"] == "reward.process_hacking"]
    parts = [f"{LABELS.get(a, a)}: " + ", ".join(f"seed {int(r.seed)} {r.status}" for r in g.itertuples())
             for a, g in hack.groupby("arm", sort=False)]
    return ("`creditlab diagnose` run on each training run's rollouts (written with --dump); its process-hacking and "
            "mixing checks (the dumps hold no execution mismatch: every arm samples and learns in fp32). "
            "reward.process_hacking: " + "; ".join(parts) + ". The dumps' process_reward is each trajectory's mean "
            "evidence score; OPSD arms are dumped with the same scorer although they do not train on it. "
            "credit.mixing judges a turn good when its process score is above 0.5, not by the lab's turn judge.")


# --------------------------------------------------------------------------------------------
# readings


def _read_means(m: pd.DataFrame) -> str:
    parts = []
    for t in ("short", "long"):
        g = m[m["type"] == t].set_index("arm")
        if g.empty:
            continue
        parts.append(f"{t}: " + ", ".join(f"{LABELS[a]} {r.success:.2f} (truncation {r.truncation:.0%}, "
                                          f"{r.tool_calls:.1f} calls)" for a, r in g.iterrows()))
    return "Final held-out success by task type (95% intervals in the table). " + "; ".join(parts) + "."


def _read_phases(p: pd.DataFrame) -> str:
    parts = []
    for _, r in p.iterrows():
        parts.append(f"{LABELS[r['arm']]}: success {r['success_early']:.2f} -> {r['success_late']:.2f}, process "
                     f"{r['process_early']:.2f} -> {r['process_late']:.2f}, truncation {r['truncation_early']:.0%} -> "
                     f"{r['truncation_late']:.0%}, tool calls {r['tool_calls_early']:.1f} -> "
                     f"{r['tool_calls_late']:.1f}")
    return ("On the training rollouts, first fifth of the updates -> last fifth (means over seeds). A process reward "
            "that rises while the outcome falls, with truncation and tool calls climbing, is the signature of "
            "a hacked process reward. " + "; ".join(parts) + ".")


def _read_opsd(o: pd.DataFrame) -> str:
    o = o.set_index("arm")
    parts = []
    for a in ("opsd_ref", "opsd_advice"):
        if a in o.index:
            r = o.loc[a]
            parts.append(f"{LABELS[a]}: reverse KL {r.reverse_kl:.3g} per token, grad norm {r.grad_norm:.3g}, "
                         f"{r.clipped_updates:.1f} of {int(r.updates)} updates clipped, response tokens "
                         f"{r.response_tokens_early:.1f} -> {r.response_tokens_late:.1f}, top 5% of turns carry "
                         f"{r.kl_top5_share:.0%} of the KL in {r.kl_top5_token_share:.0%} of the tokens")
    ratio = ""
    if {"opsd_ref", "opsd_advice"} <= set(o.index) and o.loc["opsd_ref", "reverse_kl"] > 0:
        kl = o.loc["opsd_advice", "reverse_kl"] / o.loc["opsd_ref", "reverse_kl"]
        ratio = f" The advice teacher's KL is {kl:.1f}x the reference teacher's"
        if "grpo" in o.index and o.loc["grpo", "grad_norm"] > 0:
            gn = o.loc["opsd_advice", "grad_norm"] / o.loc["grpo", "grad_norm"]
            ratio += f", its gradient norm {gn:.1f}x GRPO's."
        else:
            ratio += "."
    return ("Self-distillation, means over updates and seeds (clipped: updates with at least one optimizer step "
            "whose gradient norm exceeded the clip, mean over seeds). " + "; ".join(parts) + "." + ratio)


def _read_teachers(t: pd.DataFrame) -> str:
    d = t[t["type"] == "all"].set_index(["teacher", "placebo"])
    parts = []
    for kind, label in (("ref", "reference-answer"), ("advice", "turn-advice")):
        if (kind, False) in d.index:
            r, p = d.loc[(kind, False)], d.loc[(kind, True)]
            v = {n: float(r.get(n, math.nan)) for n in ("gap_good", "gap_bad", "preference")}
            parts.append(f"{label}: KL {r['reverse_kl']:.3g} per token (placebo {p['reverse_kl']:.3g}), teacher - "
                         f"student log-prob on good-turn tokens {v['gap_good']:+.3g} and bad-turn tokens "
                         f"{v['gap_bad']:+.3g}, preference {v['preference']:+.3g} (placebo "
                         f"{float(p.get('preference', math.nan)):+.3g})")
    return ("Before any training, on the base policy's own held-out rollouts: KL(student || teacher) per policy "
            "token, and the teacher-minus-student log-prob of the sampled tokens of good and of bad turns; "
            "preference = good - bad. The placebo puts another task's privileged tokens in the same place: a "
            "teacher whose preference is no larger than its placebo's is not using what it was told, and its "
            "KL is only the disturbance of an unfamiliar context. " + "; ".join(parts) + ".")


def _read_mixing(m: pd.DataFrame) -> str:
    parts = [f"{r['type']} (C = {r['chain lengths']}): base mixing {r['base mixing']:.2f}, good turns "
             f"{r['base good share']:.0%}" + (f", GRPO gain {r['grpo gain']:+.2f}" if "grpo gain" in r else "")
             for _, r in m.iterrows()]
    return ("Rule: a turn is good when it is a call of the task's correct episode (same tool, same arguments) made "
            "for the first time in the episode, bad otherwise; mixing = 2 min(good, bad) / (good + bad) per "
            "held-out rollout, averaged. " + "; ".join(parts) + ".")


# --------------------------------------------------------------------------------------------
# plots

COLORS = {"grpo": "black", "prm_fixed": "tab:red", "prm_decay": "tab:green", "opsd_ref": "tab:blue",
          "opsd_advice": "tab:purple"}


def _line(ax, g: pd.DataFrame, col: str, color: str, label: str, style: str = "-") -> None:
    s = g.dropna(subset=[col]).groupby("update")[col]
    x = s.mean().index.to_numpy()
    ax.plot(x, s.mean().to_numpy(), style, color=color, label=label, lw=1.4)
    if s.size().min() > 1:
        ax.fill_between(x, s.min().to_numpy(), s.max().to_numpy(), color=color, alpha=0.1)


def _plot_hacking(curves: pd.DataFrame, cfg: GranularityConfig, out: Path) -> Path:
    arms = [a for a in ("grpo", "prm_fixed", "prm_decay") if a in set(curves["arm"])] or list(dict.fromkeys(
        curves["arm"]))
    fig, axes = new_figure(1, len(arms), figsize=(4.6 * len(arms), 3.8), squeeze=False, sharey=True)
    for ax, arm in zip(axes[0], arms, strict=True):
        g = curves[curves["arm"] == arm]
        _line(ax, g, "success", "black", "outcome (success)")
        _line(ax, g, "process", "tab:orange", "process (evidence / turn)")
        if "lam" in g.columns and g["lam"].notna().any():
            _line(ax, g, "lam", "tab:gray", "λ", ":")
        ax.set_title(f"{LABELS[arm]}: training rollouts")
        ax.set_xlabel("update")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8, loc="lower left")
    axes[0][0].set_ylabel("mean over seeds (band: min-max)")
    return save(fig, out / "granularity_rewards.png")


def _plot_behaviour(curves: pd.DataFrame, cfg: GranularityConfig, out: Path) -> Path:
    fig, axes = new_figure(1, 3, figsize=(14, 3.8))
    for arm in [a for a in ARMS if a in set(curves["arm"])]:
        g = curves[curves["arm"] == arm]
        for ax, col in zip(axes, ("truncation", "tool_calls", "response_tokens"), strict=True):
            _line(ax, g, col, COLORS[arm], LABELS[arm])
    for ax, title in zip(axes, ("truncation rate", "tool calls per episode", "policy tokens per episode"),
                         strict=True):
        ax.set_title(f"training rollouts: {title}")
        ax.set_xlabel("update")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=8, loc="center right")
    return save(fig, out / "granularity_behaviour.png")


def _plot_final(means: pd.DataFrame, out: Path) -> Path:
    types = [t for t in TASK_TYPES if t in set(means["type"])]
    arms = [a for a in ARMS if a in set(means["arm"])]
    fig, axes = new_figure(1, 2, figsize=(11, 3.8))
    x = np.arange(len(types))
    w = 0.8 / max(len(arms), 1)
    for i, arm in enumerate(arms):
        g = means[means["arm"] == arm].set_index("type").reindex(types)
        xs = x - 0.4 + w * (i + 0.5)
        for ax, m in ((axes[0], "success"), (axes[1], "truncation")):
            err = np.vstack([(g[m] - g[f"{m}_lo"]).fillna(0).clip(lower=0),
                             (g[f"{m}_hi"] - g[m]).fillna(0).clip(lower=0)])
            ax.bar(xs, g[m], w, yerr=err, color=COLORS[arm], label=LABELS[arm], capsize=2)
    for ax, title in ((axes[0], "final held-out success"), (axes[1], "final held-out truncation")):
        ax.set_xticks(x, types)
        ax.set_ylim(0, 1)
        ax.set_title(f"{title} (mean, 95% interval over seeds)")
    axes[0].legend(fontsize=8)
    return save(fig, out / "granularity_final.png")


def _plot_opsd(curves: pd.DataFrame, cfg: GranularityConfig, out: Path, name: str = "granularity_opsd.png") -> Path:
    fig, axes = new_figure(1, 3, figsize=(14, 3.8))
    for arm in [a for a in ("grpo", "opsd_ref", "opsd_advice") if a in set(curves["arm"])]:
        g = curves[curves["arm"] == arm]
        if arm != "grpo":
            _line(axes[0], g, "opsd/reverse_kl", COLORS[arm], LABELS[arm])
        _line(axes[1], g, "grad_norm", COLORS[arm], LABELS[arm])
        _line(axes[2], g, "response_tokens", COLORS[arm], LABELS[arm])
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[1].axhline(cfg.grpo.grad_clip, color="gray", lw=0.8, ls="--")
    for ax, title in zip(axes, ("KL(student || teacher) per token", "gradient norm (before clipping)",
                                "policy tokens per episode"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("update")
        ax.legend(fontsize=8)
    return save(fig, out / name)


# --------------------------------------------------------------------------------------------
# the new experiments: gates, the multi-exchange type, the repeat sweep, the warm-started teachers


def _teacher_margins(t: pd.DataFrame) -> dict[str, float]:
    """Per teacher kind: its preference (good - bad turn gap) minus its placebo's, over all types (nats)."""
    d = t[t["type"] == "all"]
    if "preference" not in d:  # every gap undefined (no good or no bad turn tokens): dropped as empty
        d = d.assign(preference=math.nan)
    out = {}
    for k in ("ref", "advice"):
        own = d[(d["teacher"] == k) & ~d["placebo"].astype(bool)]["preference"]
        placebo = d[(d["teacher"] == k) & d["placebo"].astype(bool)]["preference"]
        if len(own) and len(placebo):
            out[k] = float(own.iloc[0] - placebo.iloc[0])
    return out


def _turn_scores(gates: pd.DataFrame | None) -> dict[float, float]:
    """repeat -> the base policy's mean turn score at that repeat (the gate rows)."""
    if gates is None or "gate" not in gates or not gates["gate"].eq("turn_score").any():
        return {}
    g = gates[gates["gate"] == "turn_score"]
    return {float(r): float(m) for r, m in zip(g["repeat"], g["mean_turn_score"], strict=True)}


def _gates_table(gates: pd.DataFrame, cfg: GranularityConfig) -> pd.DataFrame:
    rows = []
    if gates["gate"].eq("mixing").any():
        mix = gates[gates["gate"] == "mixing"].set_index("type")
        for t in MULTI_TYPES:
            if t in mix.index:
                v = float(mix.loc[t, "mixing"])
                rows.append({"experiment": "multi", "gate": f"base mixing score, {t}", "measured": v,
                             "threshold": f">= {MIXING_GATE:g}" if t == "multi" else "(reported)",
                             "passes": (v >= MIXING_GATE) if t == "multi" else None,
                             "note": f"good turns {mix.loc[t, 'good_share']:.0%}, success {mix.loc[t, 'success']:.2f}, "
                                     f"truncation {mix.loc[t, 'truncation']:.0%}, "
                                     f"{mix.loc[t, 'tool_calls']:.1f} calls"})
    for r, m in _turn_scores(gates).items():
        rows.append({"experiment": "repeat", "gate": f"mean turn score of the base policy, repeat {r:g}",
                     "measured": m, "threshold": "(the prediction's threshold)", "passes": None,
                     "note": f"predicted: fixed-λ PRM {'hacked' if r > m else 'not hacked'} (repeat {r:g} "
                             f"{'>' if r > m else '<='} {m:.3f})"})
    if gates["gate"].eq("teacher").any():
        t = gates[gates["gate"] == "teacher"]
        for k, v in _teacher_margins(t).items():
            rows.append({"experiment": "warm", "gate": f"{'reference-answer' if k == 'ref' else 'turn-advice'} "
                                                       "teacher: preference - placebo's (nats)",
                         "measured": v, "threshold": f">= {TEACHER_GATE:g}", "passes": v >= TEACHER_GATE,
                         "note": "good-minus-bad-turn log-prob gap of the teacher over the student, minus the same "
                                 "for another task's hint"})
    return pd.DataFrame(rows, columns=["experiment", "gate", "measured", "threshold", "passes", "note"])


def _curves(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    tr = df[df["kind"] == "train"]
    cols = by + ["update"] + [c for c in (*CURVE_COLUMNS, "multi/success", "multi/truncation", "multi/mixing")
                              if c in tr.columns]
    return tr[cols].sort_values(by + ["update"]).reset_index(drop=True)


def _new_tables(rows: dict[str, pd.DataFrame], cfg: GranularityConfig) -> dict[str, Table]:
    tabs: dict[str, Table] = {}
    gates = rows.get("gates")
    U = cfg.grpo.updates
    if "multi" in rows and "multi" in cfg.experiments:
        df = rows["multi"]
        summary = _summary(df, MULTI_TYPES)
        tabs["multi_means"] = Table(_means(summary), "Experiment multi: held-out results per arm and task type "
                                                     "(three-type base policy; means over seeds, 95% intervals)", ".3g")
        tabs["multi_mixing"] = Table(_multi_mixing(summary, gates), "Experiment multi: each type's base mixing "
                                     "score against GRPO's gain and the decayed PRM's gain over GRPO", ".3g",
                                     console=True)
        tabs["multi_curves"] = Table(_curves(df, ["arm", "seed"]), "Experiment multi: every training update", ".3g",
                                     report=False)
    if "sweep" in rows and "repeat" in cfg.experiments:
        df = rows["sweep"]
        df = df[df["repeat"].isin(parse_repeats(cfg.repeats))]
        tabs["sweep"] = Table(_sweep_table(df, _turn_scores(gates), U), "Experiment repeat: process-reward hacking "
                              "by the score of a repeated read (verdict of creditlab diagnose on each run's dump)",
                              ".3g", console=True)
        v = df[df["kind"] == "verdict"][["arm", "repeat", "seed", "status", "value", "message"]]
        tabs["sweep_runs"] = Table(_ordered(v, ["arm", "repeat", "seed"]), "Experiment repeat: the "
                                   "reward.process_hacking verdict of every run", ".3g")
        tabs["sweep_curves"] = Table(_curves(df, ["arm", "repeat", "seed"]), "Experiment repeat: every training "
                                     "update", ".3g", report=False)
    if "warm" in rows and "warm" in cfg.experiments:
        df = rows["warm"]
        summary = _summary(df)
        tabs["warm_means"] = Table(_means(summary), "Experiment warm: held-out results per arm and task type "
                                                    "(warm-started base policy)", ".3g", console=True)
        d = _diffs(summary)
        if len(d):
            tabs["warm_diff"] = Table(d, "Experiment warm: paired differences against GRPO", ".3g")
        tabs["warm_opsd"] = Table(_opsd(df, U), "Experiment warm: KL, gradients, clipping, response length", ".3g")
        tabs["warm_curves"] = Table(_curves(df, ["arm", "seed"]), "Experiment warm: every training update", ".3g",
                                    report=False)
    if gates is not None and gates["gate"].eq("teacher").any() and "warm" in cfg.experiments:
        t = gates[gates["gate"] == "teacher"].drop(columns=["gate", "cell_key"], errors="ignore")
        tabs["warm_teachers"] = Table(t.dropna(axis=1, how="all"), "Experiment warm: what the warm-started "
                                      "teachers know (before training)", ".3g")
    pred = _predictions(tabs, cfg, _gates_table(gates, cfg) if gates is not None else None)
    if len(pred):
        tabs["predictions"] = Table(pred, "The predictions written before the run, against this run", ".3g",
                                    console=True)
    return tabs


def _multi_mixing(summary: pd.DataFrame, gates: pd.DataFrame | None) -> pd.DataFrame:
    rows = []
    for t in MULTI_TYPES:
        s = summary[summary["type"] == t]
        if s.empty:
            continue
        g = s[s["arm"] == "grpo"]
        row = {"type": t, "base mixing": math.nan}
        if gates is not None and gates["gate"].eq("mixing").any():
            mix = gates[(gates["gate"] == "mixing") & (gates["type"] == t)]
            row["base mixing"] = float(mix["mixing"].iloc[0]) if len(mix) else math.nan
        row["base success"] = float(s["base_success"].mean())
        for arm in MULTI_ARMS:
            a = s[s["arm"] == arm]
            row[f"{arm} success"] = float(a["success"].mean()) if len(a) else math.nan
        row.update({f"grpo gain{k}": v for k, v in ci_of(g["gain"]).items()})
        row["grpo gain / headroom"] = row["grpo gain"] / max(1.0 - row["base success"], 1e-9)
        if {"grpo", "prm_decay"} <= set(s["arm"]):
            d = paired_diff(summary, "prm_decay", "grpo", ["type"], "success", bounds=DIFF)
            d = d[d["type"] == t].iloc[0]
            row.update({"prm_decay - grpo": d["mean"], "prm_decay - grpo lo": d["lo"],
                        "prm_decay - grpo hi": d["hi"], "pairs": int(d["n"])})
        row["grpo final mixing"] = float(g["mixing"].mean()) if len(g) else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def ci_of(x: pd.Series) -> dict[str, float]:
    """Mean and 95% interval of ``x`` as ``{"": mean, " lo": lo, " hi": hi}`` (the lab's intervals)."""
    from creditlab.lab.report import ci_columns

    c = ci_columns(x, "v", DIFF)
    return {"": c["v"], " lo": c["v_lo"], " hi": c["v_hi"]}


def _sweep_table(df: pd.DataFrame, turn_scores: dict[float, float], U: int) -> pd.DataFrame:
    rows = []
    tr, ev, v = df[df["kind"] == "train"], df[df["kind"] == "eval"], df[df["kind"] == "verdict"]
    for (arm, r), g in v.groupby(["arm", "repeat"], sort=False):
        t = tr[(tr["arm"] == arm) & (tr["repeat"] == r)]
        e = ev[(ev["arm"] == arm) & (ev["repeat"] == r)]
        last = e[e["update"] == e["update"].max()]
        early, late = t[t["update"] < U / 5], t[t["update"] >= U - U / 5]
        m = turn_scores.get(float(r), math.nan)
        rows.append({"arm": arm, "repeat": float(r), "mean turn score": m,
                     "predicted hacked": (bool(r > m) if arm == "prm_fixed" else False) if not math.isnan(m) else None,
                     "hacked runs": int((g["status"] == "fail").sum()), "runs": len(g),
                     "warned runs": int((g["status"] == "warn").sum()),
                     "final success": float(last["eval/success"].mean()),
                     "process early": float(early["process"].mean()), "process late": float(late["process"].mean()),
                     "truncation early": float(early["truncation"].mean()),
                     "truncation late": float(late["truncation"].mean()),
                     "tool calls late": float(late["tool_calls"].mean())})
    return _ordered(pd.DataFrame(rows), ["arm", "repeat"])


def _predictions(tabs: dict[str, Table], cfg: GranularityConfig, gates: pd.DataFrame | None) -> pd.DataFrame:
    """Each prediction of the docs page (written before the run) with what this run measured and
    the verdict its falsification rule gives."""
    rows = []
    gates = pd.DataFrame(columns=["gate", "measured", "passes"]) if gates is None else gates
    mm = tabs["multi_mixing"].frame.set_index("type") if "multi_mixing" in tabs else None
    if mm is not None and "multi" in mm.index:
        mix = mm["base mixing"]
        ok = bool(mix["multi"] >= MIXING_GATE)
        rows.append({"prediction": "M1: the multi type's base mixing score is >= 0.6, above short and long",
                     "measured": "; ".join(f"{t} {mix[t]:.2f}" for t in mix.index),
                     "verdict": "holds" if ok and mix["multi"] > mix.drop("multi").max() else "falsified"})
        gain = mm["grpo gain / headroom"]
        top = mix.idxmax()
        rows.append({"prediction": "M2: GRPO's gain (over its headroom) is smallest on the most mixed type",
                     "measured": "; ".join(f"{t} {mm.loc[t, 'grpo gain']:+.2f} ({gain[t]:.2f} of headroom)"
                                           for t in mm.index),
                     "verdict": "holds" if gain.idxmin() == top else "falsified"})
        if "prm_decay - grpo" in mm:
            d = mm.loc[top]
            rows.append({"prediction": "M3: the decayed PRM gains over GRPO on the most mixed type (interval above 0)",
                         "measured": "; ".join(f"{t} {mm.loc[t, 'prm_decay - grpo']:+.3f} "
                                               f"[{mm.loc[t, 'prm_decay - grpo lo']:+.3f}, "
                                               f"{mm.loc[t, 'prm_decay - grpo hi']:+.3f}]" for t in mm.index),
                         "verdict": "holds" if d["prm_decay - grpo lo"] > 0 else (
                             "falsified" if d["prm_decay - grpo hi"] <= 0 or d["prm_decay - grpo"] <= 0
                             else "not resolved (interval spans 0)")})
    if "sweep" in tabs:
        sw = tabs["sweep"].frame
        fx = sw[sw["arm"] == "prm_fixed"]
        if len(fx) and fx["mean turn score"].notna().all():
            hacked = fx[fx["hacked runs"] > 0]
            early = hacked[hacked["repeat"] <= hacked["mean turn score"] - 0.25]
            above = fx[fx["repeat"] > fx["mean turn score"]]
            false = len(early) > 0 or (len(above) > 0 and not (above["hacked runs"] > 0).any())
            rows.append({"prediction": "R1: fixed-λ PRM is hacked exactly when repeat > the base policy's mean turn "
                                       "score",
                         "measured": "; ".join(f"repeat {r['repeat']:g}: {r['hacked runs']}/{r['runs']} hacked "
                                               "(turn score "
                                               f"{r['mean turn score']:.3f})" for _, r in fx.iterrows()),
                         "verdict": "falsified" if false else (
                             "holds" if (hacked["repeat"] > hacked["mean turn score"]).all()
                             and len(above) and (above["hacked runs"] > 0).all() else
                             "holds by the falsification rule (not at every value above)")
                         if len(above) or len(early) else "untestable (no repeat above the mean turn score)"})
        dc = sw[sw["arm"] == "prm_decay"]
        if len(dc):
            rows.append({"prediction": "R2: the decayed λ prevents hacking at every repeat",
                         "measured": "; ".join(f"repeat {r['repeat']:g}: {r['hacked runs']}/{r['runs']} hacked"
                                               for _, r in dc.iterrows()),
                         "verdict": "holds" if (dc["hacked runs"] == 0).all() else "falsified"})
    if "warm_means" in tabs:
        g = gates[gates["gate"].astype(str).str.contains("teacher")]
        gate_ok = bool(len(g)) and bool(g["passes"].all())
        rows.append({"prediction": "W1: the warm-started teachers beat their placebos by >= 1 nat",
                     "measured": "; ".join(f"{r.gate.split(' teacher')[0]} {r.measured:+.3f}" for r in g.itertuples()),
                     "verdict": "holds" if gate_ok else "falsified"})
        wm = tabs["warm_means"].frame
        wm = wm[wm["type"] == "all"].set_index("arm")
        wo = tabs["warm_opsd"].frame.set_index("arm")
        # W2 is about the advice teacher: its own gate decides whether W2 is judged (the reference
        # teacher's gate is W1's business, not W2's)
        ga = g[g["gate"].astype(str).str.startswith("turn-advice")]
        advice_ok = bool(len(ga)) and bool(ga["passes"].all())
        if {"grpo", "opsd_advice"} <= set(wm.index):
            adv, grpo = wm.loc["opsd_advice", "success"], wm.loc["grpo", "success"]
            rows.append({"prediction": "W2: advice-OPSD collapses below GRPO (falsified if it matches or beats GRPO "
                                       "with a passing gate)",
                         "measured": f"final success: advice-OPSD {adv:.2f}, GRPO {grpo:.2f}"
                                     + (f", ref-OPSD {wm.loc['opsd_ref', 'success']:.2f}" if "opsd_ref" in wm.index
                                        else ""),
                         "verdict": ("not judged (the advice teacher's gate failed)" if not advice_ok else
                                     "falsified" if adv >= grpo - 0.02 else "holds")})
        if {"opsd_ref", "opsd_advice"} <= set(wo.index):
            r, a = wo.loc["opsd_ref"], wo.loc["opsd_advice"]
            base = wm["gain"] if "gain" in wm else None
            rows.append({"prediction": "W3: ref-OPSD moves the student little; advice-OPSD has larger KL and gradient "
                                       "norm, clipped updates, shrinking responses",
                         "measured": f"ref: KL {r.reverse_kl:.3g}, grad {r.grad_norm:.3g}, {r.clipped_updates:.1f} "
                                     f"clipped, tokens {r.response_tokens_early:.1f} -> {r.response_tokens_late:.1f}"
                                     + (f", success change {base['opsd_ref']:+.2f}" if base is not None else "")
                                     + f"; advice: KL {a.reverse_kl:.3g}, grad {a.grad_norm:.3g}, "
                                     f"{a.clipped_updates:.1f} clipped, tokens {a.response_tokens_early:.1f} -> "
                                     f"{a.response_tokens_late:.1f}",
                         "verdict": "holds" if (a.reverse_kl > r.reverse_kl and a.grad_norm > r.grad_norm
                                                and a.clipped_updates > r.clipped_updates
                                                and a.response_tokens_late < a.response_tokens_early
                                                and (base is None or abs(base["opsd_ref"]) < 0.1))
                         else "falsified (in part: see measured)"})
    return pd.DataFrame(rows, columns=["prediction", "measured", "verdict"])


def _interpret_new(tabs: dict[str, Table], cfg: GranularityConfig) -> dict[str, str]:
    few = small_run_note(cfg.seeds)
    text: dict[str, str] = {}
    if "gates" in tabs:
        text["gates"] = ("Measured on each experiment's base policy before any arm trains. multi: the held-out turn "
                         "mixing score per type (the gate is the multi type's, >= 0.6). repeat: the mean process score "
                         "over every turn of the lab's base policy's rollouts on the training mix, at each swept "
                         "repeat value; the process advantage is normalised over the group's turns, so a repeated read "
                         "scoring above this mean is paid and one below it punished. warm: each teacher's preference "
                         "for good over bad turns minus its placebo's (another task's hint), in nats.")
    if "multi_mixing" in tabs:
        text["multi_mixing"] = ("Per task type: the three-type base policy's mixing score (gate table), its success, "
                                "GRPO's final success and gain (95% interval over seeds), the gain as a share of the "
                                "headroom 1 - base success, and the decayed PRM's paired gain over GRPO. The multi "
                                "type's success is the share of its sub-tasks solved." + few)
    if "sweep" in tabs:
        text["sweep"] = ("A run is hacked when creditlab diagnose's reward.process_hacking check fails on its own "
                         "dump (process reward up, outcome down, tool calls or truncation up). predicted hacked: "
                         "fixed λ and repeat above the base policy's mean turn score at that repeat." + few)
    if "multi_means" in tabs:
        text["multi_means"] = ("GRPO and the decayed PRM trained on the three-type mix from the three-type base "
                               "policy: "
                               "final held-out success per type (the multi type's is the share of sub-tasks solved), "
                               "its gain over the base policy, truncation and tool calls." + few)
    if "sweep_runs" in tabs:
        v = tabs["sweep_runs"].frame
        text["sweep_runs"] = ("Every run of the sweep with creditlab diagnose's verdict and message: "
                              + "; ".join(f"{LABELS[a]} repeat {r:g}: " + ", ".join(g["status"])
                                          for (a, r), g in v.groupby(["arm", "repeat"], sort=False)) + ".")
    if "warm_means" in tabs:
        text["warm_means"] = ("GRPO and both self-distillation arms from the warm-started base policy: final held-out "
                              "success per type and its change from the base policy." + few)
    if "warm_diff" in tabs:
        text["warm_diff"] = "Paired differences (arm - GRPO, same seeds, same held-out tasks) from the warm base." + few
    if "warm_teachers" in tabs:
        text["warm_teachers"] = ("The teacher table (as for the lab's base policy) on the warm-started base policy: a "
                                 "teacher that reads its hint raises the good turns' tokens and lowers the bad ones' "
                                 "more than its placebo does. " + _read_teachers(tabs["warm_teachers"].frame))
    if "warm_opsd" in tabs:
        text["warm_opsd"] = ("Self-distillation from the warm-started base policy (half of its demonstrations carried "
                             "a teacher's hint): KL(student || teacher) per token, gradient norm before clipping, "
                             "updates with a clipped step, policy tokens per episode in the first and last fifth."
                             + few)
    if "predictions" in tabs:
        text["predictions"] = ("Each prediction as written on the docs page before the full run, and the verdict of "
                               "its falsification rule on this run. A quick run is too small for these verdicts to "
                               "mean anything." if cfg.grpo.updates < 20 else
                               "Each prediction as written on the docs page before the full run, and the verdict of "
                               "its falsification rule on this run.")
    return text


def _plot_multi(mm: pd.DataFrame, out: Path) -> Path:
    fig, axes = new_figure(1, 2, figsize=(11, 3.8))
    x = np.arange(len(mm))
    axes[0].bar(x, mm["base mixing"], color="tab:gray")
    axes[0].axhline(MIXING_GATE, color="tab:red", ls="--", lw=0.8)
    axes[0].set_xticks(x, mm["type"])
    axes[0].set_ylim(0, 1)
    axes[0].set_title("base policy: turn mixing score (gate 0.6 on multi)")
    w = 0.38
    err = np.vstack([(mm["grpo gain"] - mm["grpo gain lo"]).clip(lower=0),
                     (mm["grpo gain hi"] - mm["grpo gain"]).clip(lower=0)])
    axes[1].bar(x - w / 2, mm["grpo gain"], w, yerr=err, color="black", capsize=2, label="GRPO gain over the base")
    if "prm_decay - grpo" in mm:
        err = np.vstack([(mm["prm_decay - grpo"] - mm["prm_decay - grpo lo"]).clip(lower=0),
                         (mm["prm_decay - grpo hi"] - mm["prm_decay - grpo"]).clip(lower=0)])
        axes[1].bar(x + w / 2, mm["prm_decay - grpo"], w, yerr=err, color="tab:green", capsize=2,
                    label="PRM decayed λ - GRPO (paired)")
    axes[1].axhline(0, color="gray", lw=0.8)
    axes[1].set_xticks(x, [f"{t}\n(mixing {m:.2f})" for t, m in zip(mm["type"], mm["base mixing"], strict=True)])
    axes[1].set_title("final held-out success: gains (95% interval over seeds)")
    axes[1].legend(fontsize=8)
    return save(fig, out / "granularity_multi.png")


def _plot_sweep(sw: pd.DataFrame, out: Path) -> Path:
    fig, axes = new_figure(1, 2, figsize=(11, 3.8))
    fx = sw[sw["arm"] == "prm_fixed"]
    src = fx if len(fx) else sw
    axes[0].plot(src["repeat"], src["mean turn score"], "o-", color="tab:orange", label="mean turn score of the base")
    axes[0].plot([0, 1], [0, 1], ":", color="gray", label="y = repeat (predicted hacked right of the crossing)")
    axes[0].set_xlabel("score of a repeated read (repeat)")
    axes[0].set_title("the prediction's threshold")
    axes[0].set_xlim(0, 1.05)
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(fontsize=8)
    for arm in SWEEP_ARMS:
        g = sw[sw["arm"] == arm]
        if g.empty:
            continue
        axes[1].plot(g["repeat"], g["hacked runs"] / g["runs"], "o-", color=COLORS[arm], label=f"{LABELS[arm]}: "
                     "share of runs hacked")
        axes[1].plot(g["repeat"], g["final success"], "s--", color=COLORS[arm], label=f"{LABELS[arm]}: final success")
    axes[1].set_xlabel("score of a repeated read (repeat)")
    axes[1].set_ylim(-0.05, 1.05)
    axes[1].set_title("reward.process_hacking verdicts and held-out success")
    axes[1].legend(fontsize=7)
    return save(fig, out / "granularity_sweep.png")
