"""The granularity lab's world: the process scorer's scores, the turn judge, per-batch statistics, the
fixed held-out tasks and what the privileged teachers know.

Turn judge (:func:`judge_turns`, for the mixing score): a turn is *good* when it is a call of the
task's correct episode (the noiseless scripted agent's calls: same tool and same arguments) made
for the first time in the episode, *bad* otherwise (an error, a wrong entity, a repeat, a wrong
write). The mixing score of a rollout is ``2 min(good, bad) / (good + bad)``
(:func:`creditlab.core.diagnostics.mixing_score`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from creditlab.core.diagnostics import mixing_score
from creditlab.envs.toolshop import MULTI_EXCHANGE, MultiTask, Task, TurnRecord, make_multi_task, make_task
from creditlab.errors import InputError
from creditlab.labs.granularity.config import MULTI_TYPES, TASK_TYPES, GranularityConfig
from creditlab.rewards.process import evidence_scores
from creditlab.train.common import generator
from creditlab.train.opsd import aligned_logits, call_key, episode_calls, teacher_logits
from creditlab.train.toolshop_grpo import GRPOConfig
from creditlab.train.toolshop_rollout import EVAL_SEED_OFFSET, RolloutBatch, rollout

__all__ = ["GATE_SEED_OFFSET", "batch_stats", "eval_tasks", "evaluate_types", "farm_stats", "judge_turns",
           "process_scores", "teacher_rows", "type_of", "type_of_task"]

#: Held-out seeds of the gates measured on rollouts (disjoint from the training tasks and the evaluation's).
GATE_SEED_OFFSET = EVAL_SEED_OFFSET + 3_000_000


def type_of(chain_length: int) -> str:
    """The task type of a chain length (see :data:`TASK_TYPES`)."""
    for name, lengths in TASK_TYPES.items():
        if int(chain_length) in lengths:
            return name
    raise InputError(f"chain_length: {chain_length} is in no task type ({TASK_TYPES})")


def type_of_task(task: Task | MultiTask) -> str:
    """The task type of a task: ``multi`` for a multi-exchange task, else that of its chain length."""
    return "multi" if isinstance(task, MultiTask) else type_of(task.chain_length)


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


def farm_stats(batch: RolloutBatch, repeat: float, max_turns: int | None = None) -> dict[str, float]:
    """What the process reward leaves a policy to farm, on one batch: the mean process score of every
    turn taken (the mean turn score: the process advantage is normalised over the turns, so a turn
    above it is paid), the share of turns above it, and the *off-chain reads*: successful reads whose
    call is not one of the task's correct calls (:func:`judge_turns`' correct episode). Their rate per
    turn, the share of episodes with one, and their mean score: a read of an entity off the chain
    returns unseen values and scores 1. Then truncation (no write by the end), split into the action
    budget (``max_turns``, default C + 2 per task) and the token budget (the episode stopped with
    turns left), tool calls and success.

    >>> from creditlab.envs.toolshop import make_task, run_scripted
    >>> from creditlab.train.toolshop_rollout import RolloutBatch
    >>> import torch
    >>> task = make_task(3, 2)
    >>> _, _, env = run_scripted(task, 0, noise=0.0)
    >>> b = RolloutBatch(tokens=torch.zeros(1, 1), policy_mask=torch.zeros(1, 1, dtype=torch.bool),
    ...                  valid_mask=torch.ones(1, 1, dtype=torch.bool), rollout_logprobs=torch.zeros(1, 1),
    ...                  turn_ids=torch.zeros(1, 1), records=[env.records], success=torch.ones(1),
    ...                  progress=torch.ones(1), truncated=torch.zeros(1, dtype=torch.bool),
    ...                  n_calls=torch.tensor([len(env.records)]), tasks=[task], group_ids=torch.zeros(1))
    >>> s = farm_stats(b, 0.25)
    >>> s["off_chain_rate"], s["mean_turn_score"], s["truncation"]
    (0.0, 0.5, 0.0)
    """
    proc = process_scores(batch, repeat)
    scores, off = [], []
    token_cap = []
    for b, (task, recs) in enumerate(zip(batch.tasks, batch.records, strict=True)):
        correct = {k for k, _ in episode_calls(task)}
        for t, rec in enumerate(recs):
            scores.append(float(proc[b, t]))
            off.append(bool(rec.ok and not rec.is_write and call_key(rec) not in correct))
        budget = max_turns if max_turns is not None else getattr(task, "turn_budget", task.chain_length + 2)
        token_cap.append(bool(batch.truncated[b]) and len(recs) < budget)
    s, o = np.array(scores, dtype=np.float64), np.array(off, dtype=bool)
    mean = float(s.mean()) if s.size else math.nan
    per_ep = np.add.reduceat(o, np.cumsum([0, *map(len, batch.records)])[:-1]) if s.size else np.zeros(0)
    trunc = batch.truncated.float()
    return {"rollouts": len(batch), "turns": int(s.size), "mean_turn_score": mean,
            "above_mean_share": float((s > mean).mean()) if s.size else math.nan,
            "off_chain_rate": float(o.mean()) if s.size else math.nan,
            "off_chain_episodes": float((per_ep > 0).mean()) if s.size else math.nan,
            "off_chain_score": float(s[o].mean()) if o.any() else math.nan,
            "off_chain_new_share": float((s[o] == 1.0).mean()) if o.any() else math.nan,
            "truncation": float(trunc.mean()), "token_truncation": float(np.mean(token_cap)),
            "tool_calls": float(batch.n_calls.float().mean()), "success": float(batch.success.mean()),
            "response_tokens": float(batch.policy_mask.sum(1).float().mean())}


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


@torch.no_grad()
def teacher_rows(cfg: GranularityConfig, model) -> list[dict]:
    """How much each privileged teacher knows, before any training: on ``model``'s own held-out
    trajectories, the teacher-student KL per policy token and the teacher-minus-student log-prob of
    the tokens of good and of bad turns (:func:`judge_turns`), for each teacher and for its placebo
    (the same format holding another task's privileged tokens). A teacher that reads its privileged
    tokens raises good turns and lowers bad ones more than its placebo does."""
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
