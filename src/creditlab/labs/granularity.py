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
from creditlab.envs.toolshop import Task, TurnRecord, make_task
from creditlab.errors import ConfigError, InputError
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import LabConfig, Table, check_count
from creditlab.lab.report import group_means, knobs_table, paired_diff, read_diff, small_run_note, sort_in_order
from creditlab.lab.runner import Cell
from creditlab.labs._toolshop import BasePolicyConfig, BasePolicyLab, base_knob, fresh_dump, optim_knob, seeds_knob
from creditlab.rewards.process import evidence_scores
from creditlab.train.common import generator
from creditlab.train.opsd import aligned_logits, call_key, correct_calls, teacher_logits, train_opsd
from creditlab.train.toolshop_base import BaseConfig, base_policy
from creditlab.train.toolshop_grpo import GRPOConfig, make_prm_advantage, train_grpo
from creditlab.train.toolshop_rollout import (
    EVAL_SEED_OFFSET,
    RolloutBatch,
    rollout,
)

__all__ = [
    "ARMS",
    "LAB",
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


@dataclass(frozen=True)
class GranularityConfig(BasePolicyConfig, LabConfig):
    """Configuration of the granularity lab."""

    OPTIONS: ClassVar[dict[str, str]] = {"updates": "grpo.updates"}
    EXPERIMENTS: ClassVar[tuple[str, ...]] = tuple(ARMS)
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
    """Arms to run (grpo, prm_fixed, prm_decay, opsd_ref, opsd_advice)."""
    cache_dir: str | None = None
    """Where the base policy is cached (None: the user cache directory); never changes a number."""
    dump_dir: str | None = None
    """Write every training update's rollouts in the ``creditlab diagnose`` schema here (one JSONL
    file per arm and seed, for the cells this run computes); never changes a number."""

    @classmethod
    def quick(cls) -> GranularityConfig:
        return cls(grpo=GRPOConfig(updates=6, tasks_per_update=4, group_size=4, chain_lengths=TASK_CHAIN_LENGTHS,
                                   eval_every=3),
                   seeds=2, eval_per_type=16)

    def validate(self) -> None:
        check_count(self.seeds, "--seeds")
        if not self.experiments or any(e not in ARMS for e in self.experiments):
            raise ConfigError("--experiment", f"got {list(self.experiments)}; valid: {', '.join(ARMS)}")
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
    correct = {k for k, _ in correct_calls(task.seed, task.chain_length)}
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
    types = np.array([type_of(t.chain_length) for t in batch.tasks])
    n_calls = batch.n_calls.float()
    mean_proc = torch.stack([proc[b, :max(int(n_calls[b]), 1)].mean() for b in range(len(batch))])
    good = [judge_turns(t, r) for t, r in zip(batch.tasks, batch.records, strict=True)]
    n_pos = torch.tensor([sum(g) for g in good], dtype=torch.float64)
    n_neg = torch.tensor([len(g) - sum(g) for g in good], dtype=torch.float64)
    mix, inc = mixing_score(n_pos, n_neg)
    for name, sel in (("all", np.ones(len(batch), bool)), *((t, types == t) for t in TASK_TYPES)):
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


def eval_tasks(cfg: GranularityConfig) -> list[Task]:
    """The fixed held-out tasks: ``eval_per_type`` of each type, chain lengths cycling in the type."""
    tasks = []
    for j, lengths in enumerate(TASK_TYPES.values()):
        base = EVAL_SEED_OFFSET + 1_000_000 * j
        tasks += [make_task(base + i, lengths[i % len(lengths)]) for i in range(cfg.eval_per_type)]
    return tasks


@torch.no_grad()
def evaluate_types(model, cfg: GranularityConfig) -> dict[str, float]:
    """Held-out statistics per task type (fp32 engine, sampled at the training temperature, fixed uniforms)."""
    g = cfg.grpo
    batch = rollout(model, eval_tasks(cfg), precision="fp32", max_len=g.max_len, max_turns=g.max_turns,
                    max_action_len=g.max_action_len, temperature=g.temperature,
                    generator=generator("granularity/eval"))
    return {f"eval/{k}": v for k, v in batch_stats(batch, cfg.repeat).items()}


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
    g = cfg.grpo
    model = base_policy(cfg.base, cache_dir=cache_dir)
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
    types = [type_of(t.chain_length) for t in batch.tasks]
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



def run_arm(config: dict, arm: str, seed: int, cache_dir: str, dump_dir: str | None = None) -> list[dict]:
    """One training run (a cell): ``arm`` from the cached base policy with ``seed``. Rows: one per
    update (training statistics of that update's rollouts, ``kind = "train"``) and one per
    evaluation point (held-out statistics per task type, ``kind = "eval"``)."""
    import copy

    cfg = GranularityConfig.from_dict(config)
    model = base_policy(cfg.base, cache_dir=cache_dir)
    g = replace(cfg.grpo, seed=seed, eval_every=0)
    kind, what = ARMS[arm]
    extra: dict[int, dict[str, float]] = {}
    path = None
    if dump_dir:
        path = fresh_dump(dump_dir, f"granularity-{arm}-seed={seed}.jsonl")
    evals: list[dict] = []
    scored: dict = {}  # the last batch on_rollouts scored, and its process scores

    def on_rollouts(k, batch, rewards, old):
        if k % cfg.grpo.eval_every == 0:
            evals.append({"kind": "eval", "update": float(k), **evaluate_types(model, cfg)})
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
    evals.append({"kind": "eval", "update": float(g.updates), **evaluate_types(model, cfg)})
    keep = ("update", "grad_norm", "grad/clipped", "loss/", "opsd/", "episode/policy_tokens", "time/update_s",
            "adv/abs_mean")
    out = []
    for r in rows:
        k = int(r["update"])
        out.append({"kind": "train", **{n: v for n, v in r.items() if n.startswith(keep)}, **extra[k]})
    return [{"arm": arm, "seed": seed, **r} for r in out + evals]


# --------------------------------------------------------------------------------------------
# tables


def _ordered(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Sorted by ``by``, arms in the order of :data:`ARMS`, task types in that of :data:`TASK_TYPES`."""
    return sort_in_order(df, by, {"arm": ARMS, "type": TASK_TYPES})


EVAL_METRICS = ("success", "truncation", "tool_calls", "turns_success", "mixing", "good_share", "process",
                "response_tokens")


def _summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per arm, seed and task type: the final held-out statistics, and the base policy's."""
    ev = df[df["kind"] == "eval"]
    rows = []
    for (arm, seed), g in ev.groupby(["arm", "seed"], sort=False):
        last = g[g["update"] == g["update"].max()].iloc[0]
        first = g[g["update"] == g["update"].min()].iloc[0]
        for t in ("all", *TASK_TYPES):
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


class GranularityLab(BasePolicyLab):
    """Outcome GRPO vs process reward (fixed / decayed weight) vs self-distillation (module docstring)."""

    name = "granularity"
    summary = "Outcome GRPO vs PRM mixing (fixed / decayed λ) vs OPSD on short and long toolshop tasks."
    help = ("Credit granularity on the toolshop agent: outcome GRPO, GRPO + an evidence process reward with a fixed "
            "or decayed weight, on-policy self-distillation from a reference-answer or a turn-advice teacher (-e "
            "selects arms), on short (C = 2-4) and long (C = 7-8) tasks. The base policy is trained on first use (a "
            "few minutes on 2 cores) and cached; set CREDITLAB_CACHE to choose where. Use --workers 2 on two cores.")
    config_type = GranularityConfig
    threads = 1  # one intra-op thread, as each process worker gets (see the mismatch lab)

    def describe(self, cfg: GranularityConfig) -> str:
        g = cfg.grpo
        U = g.updates
        return (
            "The tiny toolshop agent trained from one supervised base policy on a mix of task types: "
            + "; ".join(f"{t} (chains of {', '.join(map(str, c))} tool calls)" for t, c in TASK_TYPES.items())
            + f". Arms: {', '.join(LABELS[a] for a in cfg.experiments)}. {U} updates of {g.tasks_per_update} tasks x "
            f"{g.group_size} rollouts, {g.minibatches} AdamW steps per update (lr {g.lr:g}, grad clip "
            f"{g.grad_clip:g}), "
            f"{cfg.seeds} paired seed(s). Process reward: evidence scores (1 for a read that returned something new, "
            f"{cfg.repeat:g} for a read that returned nothing new, 0 for errors and writes), mixed per turn with "
            f"weight {cfg.lam:g} (fixed) or {cfg.lam:g} decayed cubically to 0 between updates "
            f"{cfg.decay_start * U:g} and {cfg.decay_end * U:g}. OPSD: generalised JSD (beta {cfg.beta:g}) to a frozen "
            "copy of the base policy that sees the final write's action in its instruction (ref-answer) or the next "
            "correct action before each of the student's actions (turn-advice). Held-out: "
            f"{cfg.eval_per_type} fixed tasks per type every {g.eval_every} updates, fp32, sampled at temperature "
            f"{g.temperature:g} with the same uniforms for every arm.")

    def cells(self, cfg: GranularityConfig) -> list[Cell]:
        ident, ctx = cfg.identity(), cfg.context(dump=True)
        cells = [Cell("train", f"{arm}/seed={s}", run_arm, {"config": ident, "arm": arm, "seed": s}, ctx)
                 for arm in cfg.experiments for s in range(cfg.seeds)]
        if any(ARMS[a][0] == "opsd" for a in cfg.experiments):
            cells.append(Cell("teachers", "base", run_teacher_cell, {"config": ident}, cfg.context()))
        return cells

    def tables(self, rows: dict[str, pd.DataFrame], cfg: GranularityConfig) -> dict[str, Table]:
        df = rows["train"]
        df = df[df["arm"].isin(cfg.experiments)]
        U = cfg.grpo.updates
        summary = _summary(df)
        tabs = {"knobs": Table(_knobs(cfg), "Knobs chosen for this lab, and why"),
                "means": Table(_means(summary), "Held-out results per arm and task type (means over seeds, 95% "
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

    def plots(self, tabs: dict[str, Table], cfg: GranularityConfig, out: Path) -> list[Path]:
        curves = tabs["curves"].frame
        made = [_plot_hacking(curves, cfg, out), _plot_behaviour(curves, cfg, out),
                _plot_final(tabs["means"].frame, out)]
        if "opsd" in tabs:
            made.append(_plot_opsd(curves, cfg, out))
        return made

    def interpret(self, tabs: dict[str, Table], cfg: GranularityConfig) -> dict[str, str]:
        few = small_run_note(cfg.seeds)
        text = {"knobs": "Every setting of this run that a person chose, with the reason; none was tuned to make an "
                         "arm win or lose. Settings not listed are the defaults of GRPOConfig and BaseConfig."}
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


LAB = GranularityLab()

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
         "the issue's hackable proxy: it pays for evidence, and a repeated read still pays a little."),
        ("process weight", f"fixed {cfg.lam:g}; decayed {cfg.lam:g} -> 0 over updates {cfg.decay_start * U:g}-"
                           f"{cfg.decay_end * U:g} (power {cfg.decay_power:g})",
         "the paper's values (0.5, cubic decay between 20 and 30 of 50), as fractions of the run."),
        ("OPSD", f"beta {cfg.beta:g} (generalised JSD), teacher = frozen base policy",
         "the core default beta; the teacher is the initial policy, as the issue asks; no outcome reward."),
        ("held-out evaluation", f"{cfg.eval_per_type} tasks per type every {g.eval_every} updates, sampled",
         "the same tasks and sampling uniforms for every arm, seed and evaluation point."),
        seeds_knob(cfg.seeds),
    ]


# --------------------------------------------------------------------------------------------
# creditlab diagnose on the dumps


def _diagnose_table(cfg: GranularityConfig) -> pd.DataFrame | None:
    if not cfg.dump_dir:
        return None
    from creditlab.diagnose.checks import run_checks
    from creditlab.diagnose.readers import read_dump

    rows = []
    for arm in cfg.experiments:
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


def _plot_opsd(curves: pd.DataFrame, cfg: GranularityConfig, out: Path) -> Path:
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
    return save(fig, out / "granularity_opsd.png")
