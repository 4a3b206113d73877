"""On-policy self-distillation (OPSD) on toolshop: a frozen teacher with privileged context.

The teacher is a frozen copy of a policy that sees what the student does not: the reference answer
(``kind="ref"``: the final correct write's action tokens in the instruction) or per-turn advice
(``kind="advice"``: the next correct action before each of the student's actions).
:func:`teacher_contexts` builds the teacher's sequences around the student's own tokens,
:func:`teacher_logits` scores them, and :func:`train_opsd` trains the student on its own rollouts
with the token-level generalised JSD of :func:`creditlab.core.losses.opsd_loss` (no outcome reward).
The correct episode of a task (:func:`correct_calls`, :func:`correct_actions`; :func:`episode_calls`
for any task, multi-exchange ones included) is the noiseless scripted agent's.

A teacher can use its privileged tokens only if its policy has seen them: :func:`privileged_demo`
gives the supervised warm start (``BaseConfig.privileged``) demonstrations that carry them, in
exactly the teacher's formats, with the demonstrator following the hint.
"""

from __future__ import annotations

import functools
import math
import random
import time
from typing import NamedTuple

import numpy as np
import torch

from creditlab.core.diagnostics import concentration
from creditlab.envs.toolshop import PAD, TOK, TOOL_TABLE, MultiTask, Task, TurnRecord, make_task, run_scripted
from creditlab.errors import ConfigError, InputError
from creditlab.train.common import adamw, generator
from creditlab.train.toolshop_grpo import GRPOConfig, task_seeds
from creditlab.train.toolshop_rollout import RolloutBatch, make_tasks, rollout

__all__ = ["aligned_logits", "call_key", "correct_actions", "correct_calls", "episode_calls", "privileged_demo",
           "teacher_contexts", "teacher_logits", "train_opsd"]


def call_key(rec: TurnRecord) -> tuple | None:
    """``(tool, arguments)`` of a successful call, the identity of a call across episodes; None for errors."""
    tool = TOOL_TABLE.get(rec.name)
    if tool is None or not rec.ok:
        return None
    return (rec.name, tuple(rec.arguments.get(n) for n in tool.arg_names))


@functools.lru_cache(maxsize=4096)
def correct_calls(seed: int, chain_length: int) -> tuple[tuple[tuple, tuple[int, ...]], ...]:
    """The correct episode of a task (the noiseless scripted agent): ``(call_key, action tokens)`` per call."""
    _, _, env = run_scripted(make_task(seed, chain_length), 0, noise=0.0, max_turns=chain_length)
    return tuple((call_key(r), r.action) for r in env.records)


_MULTI_CALLS: dict[tuple, tuple] = {}


def episode_calls(task: Task | MultiTask) -> tuple[tuple[tuple, tuple[int, ...]], ...]:
    """:func:`correct_calls` of any task: for a :class:`~creditlab.envs.toolshop.MultiTask`, the
    correct calls of its sub-tasks in order (the noiseless scripted agent's episode)."""
    if not isinstance(task, MultiTask):
        return correct_calls(task.seed, task.chain_length)
    key = (task.seed, task.instruction)
    if key not in _MULTI_CALLS:
        if len(_MULTI_CALLS) > 4096:
            _MULTI_CALLS.clear()
        _, _, env = run_scripted(task, 0, noise=0.0, max_turns=task.chain_length)
        _MULTI_CALLS[key] = tuple((call_key(r), r.action) for r in env.records)
    return _MULTI_CALLS[key]


def privileged_demo(task: Task, seed: int, noise: float, share: float) -> tuple[list[int], list[bool]]:
    """One warm-start demonstration (token ids, policy mask) of ``task``: with probability ``share``
    (seeded by ``seed``) it carries a teacher's privileged hint in the format of
    :func:`teacher_contexts`, half of those the reference answer, half turn advice; else the noisy
    scripted episode (noise ``noise``) of :func:`~creditlab.envs.toolshop.run_scripted`.

    * reference answer: the noiseless episode, the final write's action (and ``EOA``) inserted
      before the instruction's ``SEP``: with the answer in view, the demonstrator writes it;
    * turn advice: the noisy episode up to a uniformly drawn turn ``t``, then the advice
      ``SEP <next correct action> SEP`` and that action (the demonstrator follows it); the
      demonstration ends there.

    The hint tokens are not policy tokens (no loss on them), as in the teacher's contexts."""
    if not 0.0 <= share <= 1.0:
        raise ConfigError("base.privileged", f"must be in [0, 1], got {share}")
    if isinstance(task, MultiTask):
        raise InputError("privileged_demo: the teachers' hints are defined for single-exchange tasks only")
    rng = random.Random(f"hint-{seed}")
    u = rng.random()
    if u >= share:
        ids, mask, _ = run_scripted(task, seed=seed, noise=noise)
        return ids, mask
    if u < share / 2:  # reference answer
        ids, mask, _ = run_scripted(task, seed=seed, noise=0.0)
        P = len(task.prompt_ids)
        write = [*correct_actions(task)[-1], TOK["EOA"]]
        return ids[:P - 1] + write + ids[P - 1:], mask[:P - 1] + [False] * len(write) + mask[P - 1:]
    ids, mask, env = run_scripted(task, seed=seed, noise=noise)  # turn advice
    starts = [p for p in range(len(mask)) if mask[p] and not mask[p - 1]]  # first token of each action
    t = rng.randrange(len(starts))
    adv = _next_advice(task, env.records)[t]
    s = starts[t]
    act = [*adv[1:-1], TOK["EOA"]]
    return ids[:s] + adv + act, mask[:s] + [False] * len(adv) + [True] * len(act)


def correct_actions(task: Task) -> list[tuple[int, ...]]:
    """The action token ids (without ``EOA``) of the task's correct episode, in order."""
    return [a for _, a in correct_calls(task.seed, task.chain_length)]


def _next_advice(task: Task, records: list[TurnRecord]) -> list[list[int]]:
    """The advice before each turn: the first correct action not yet made by the earlier turns."""
    steps = correct_calls(task.seed, task.chain_length)
    done: set = set()
    out = []
    for rec in records:
        nxt = next((a for k, a in steps if k not in done), steps[-1][1])
        out.append([TOK["SEP"], *nxt, TOK["SEP"]])
        k = call_key(rec)
        if k is not None:
            done.add(k)
    return out


def teacher_contexts(batch: RolloutBatch, kind: str, donors: list[Task] | None = None
                     ) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    """The teacher's privileged sequences for ``batch`` and where the student's tokens sit in them.

    ``kind="ref"``: one sequence per trajectory, the final correct write's action tokens inserted
    into the instruction (before ``SEP``). ``kind="advice"``: one sequence per turn taken: the
    trajectory up to that turn's action, the advice ``SEP <next correct action> SEP``, then the
    action. Returns the sequences and, per sequence, ``(b, first, shift)``: the student's tokens
    from position ``first`` of trajectory ``b`` (to the end of the sequence) sit ``shift``
    positions later in it. ``donors`` (a placebo control): take the privileged tokens of
    ``donors[b]`` instead of trajectory ``b``'s own task (same format, someone else's answer).
    """
    seqs: list[list[int]] = []
    where: list[tuple[int, int, int]] = []
    for b, (task, recs) in enumerate(zip(batch.tasks, batch.records, strict=True)):
        n = int(batch.valid_mask[b].sum())
        toks = batch.tokens[b, :n].tolist()
        P = len(task.prompt_ids)
        info = donors[b] if donors is not None else task
        if kind == "ref":
            write = [*correct_actions(info)[-1], TOK["EOA"]]
            seqs.append(toks[:P - 1] + write + toks[P - 1:])
            where.append((b, P - 1, len(write)))
        elif kind == "advice":
            tid = batch.turn_ids[b, :n]
            pm = batch.policy_mask[b, :n]
            for t, adv in enumerate(_next_advice(info, recs)):
                pos = (pm & (tid == t)).nonzero().flatten()
                if not len(pos):
                    continue
                s, e = int(pos[0]), int(pos[-1])
                seqs.append(toks[:s] + adv + toks[s:e + 1])
                where.append((b, s, len(adv)))
        else:
            raise ConfigError("teacher", f"unknown teacher {kind!r}; valid: ref, advice")
    return seqs, where


@torch.no_grad()
def teacher_logits(teacher, batch: RolloutBatch, kind: str, chunk: int = 256, donors: list[Task] | None = None
                   ) -> torch.Tensor:
    """``(B, L, V)`` next-token logits of the privileged teacher for every position of ``batch``:
    entry ``[b, p]`` is the teacher's distribution of token ``p`` (0 where the teacher does not
    see the student's token, e.g. the prompt)."""
    seqs, where = teacher_contexts(batch, kind, donors)
    B, L = batch.tokens.shape
    V = teacher.cfg.vocab_size
    out = torch.zeros(B, L, V)
    for i in range(0, len(seqs), chunk):
        part = seqs[i:i + chunk]
        n = max(len(s) for s in part)
        if n > teacher.cfg.max_len:
            raise InputError(f"teacher context of {n} tokens exceeds the model's max_len {teacher.cfg.max_len}")
        x = torch.full((len(part), n), PAD, dtype=torch.long)
        for j, s in enumerate(part):
            x[j, :len(s)] = torch.tensor(s)
        logits = teacher(x).float()
        for j, (b, first, shift) in enumerate(where[i:i + chunk]):
            last = len(part[j]) - shift  # student positions first .. last-1
            if kind == "advice":
                out[b, first:last] = logits[j, first + shift - 1:last + shift - 1]
            else:
                out[b, max(first, 1):last] = logits[j, max(first, 1) + shift - 1:last + shift - 1]
    return out


def aligned_logits(logits: torch.Tensor) -> torch.Tensor:
    """Model logits ``(B, L, V)`` (position p predicts p+1) to prediction-of-position form."""
    return torch.cat([torch.zeros_like(logits[:, :1]), logits[:, :-1]], dim=1)



def train_opsd(model, teacher, cfg: GRPOConfig, kind: str, *, beta: float = 0.5,
               on_rollouts=None, top_frac: float = 0.05) -> list[dict[str, float]]:
    """Train ``model`` in place by on-policy self-distillation from ``teacher`` (frozen) with the
    ``kind`` of privileged context (:func:`teacher_contexts`); one metrics row per update.

    Each update samples the same tasks as :func:`~creditlab.train.toolshop_grpo.train_grpo` with
    the same seed (``task_seeds``), scores every policy token of the student's own trajectories
    by the teacher, and takes ``cfg.minibatches`` AdamW steps on
    :func:`creditlab.core.losses.opsd_loss` (no outcome reward). Row keys: ``update``,
    ``opsd/forward_kl`` and ``opsd/reverse_kl`` (per policy token, before the update),
    ``opsd/kl_top_share`` (share of the batch's teacher-student KL carried by the top ``top_frac``
    of turns) and ``opsd/kl_top_token_share`` (share of the policy tokens those turns hold),
    ``grad_norm`` (mean before clipping), ``grad/clipped`` (optimizer steps whose norm was clipped),
    ``loss/opsd``, ``episode/policy_tokens``, ``time/update_s``.
    """
    for p in teacher.parameters():
        p.requires_grad_(False)
    teacher.eval()
    gen = generator("grpo/sampling", cfg.seed)
    opt = adamw(model.parameters(), cfg.lr)
    G = cfg.group_size
    rows = []
    for k in range(cfg.updates):
        t0 = time.perf_counter()
        # --- rollouts (the student's own, fp32)
        model.eval()
        tasks = [t for t in make_tasks(task_seeds(cfg, k), cfg.chain_lengths) for _ in range(G)]
        batch = rollout(model, tasks, precision="fp32", max_len=cfg.max_len, max_turns=cfg.max_turns,
                        max_action_len=cfg.max_action_len, temperature=cfg.temperature, generator=gen,
                        group_ids=[j // G for j in range(len(tasks))])
        pm = batch.policy_mask
        # --- scores: the teacher's and the student's distributions at every position
        with torch.no_grad():
            t_logits = teacher_logits(teacher, batch, kind) / cfg.temperature
            s_logits = aligned_logits(model(batch.tokens).float()) / cfg.temperature
            if on_rollouts is not None:
                lp = torch.log_softmax(s_logits, -1).gather(-1, batch.tokens[..., None]).squeeze(-1)
                on_rollouts(k, batch, batch.success.float(), torch.where(pm, lp, torch.zeros_like(lp)))
            row = {"update": float(k), **_kl_metrics(batch, s_logits, t_logits, top_frac)}
        # --- minibatch steps (no advantages, no weights: the loss is the distillation itself)
        steps = _opsd_steps(model, opt, cfg, batch, t_logits, beta, gen)
        # --- metrics
        row.update({"loss/opsd": float(np.mean(steps.losses)), "grad_norm": float(np.mean(steps.grad_norms)),
                    "grad/clipped": float(steps.clipped), "episode/policy_tokens": float(pm.sum()) / len(batch),
                    "time/update_s": time.perf_counter() - t0})
        rows.append(row)
    return rows


def _kl_metrics(batch: RolloutBatch, s_logits: torch.Tensor, t_logits: torch.Tensor, top_frac: float
                ) -> dict[str, float]:
    """``opsd/*`` of one batch before the update: the KLs per policy token and how concentrated the
    reverse KL is on the top ``top_frac`` of the turns taken."""
    pm = batch.policy_mask
    ls, lt = torch.log_softmax(s_logits, -1), torch.log_softmax(t_logits, -1)
    rev = (ls.exp() * (ls - lt)).sum(-1)  # KL(student || teacher) per position
    fwd = (lt.exp() * (lt - ls)).sum(-1)
    n_pol = max(int(pm.sum()), 1)
    row = {"opsd/reverse_kl": float(rev[pm].sum()) / n_pol, "opsd/forward_kl": float(fwd[pm].sum()) / n_pol}
    # the KL of each turn taken, and the policy tokens it holds
    T = max(batch.n_turns_max, 1)
    tid = batch.turn_ids.clamp(min=0)
    on = pm & (batch.turn_ids >= 0)
    per_turn = torch.zeros(len(batch), T, dtype=torch.float64).scatter_add_(
        1, tid, torch.where(on, rev, torch.zeros_like(rev)).double().clamp(min=0))
    toks = torch.zeros(len(batch), T, dtype=torch.float64).scatter_add_(1, tid, on.double())
    taken = toks > 0
    share, _ = concentration(per_turn[taken], top_frac)
    n_top = max(1, math.ceil(top_frac * int(taken.sum())))
    top = per_turn[taken].argsort(descending=True)[:n_top]
    row["opsd/kl_top_share"] = share
    row["opsd/kl_top_token_share"] = float(toks[taken][top].sum() / toks[taken].sum())
    return row


class _OPSDSteps(NamedTuple):
    """What the minibatch steps of one OPSD update report (one value per optimizer step)."""

    losses: list[float]
    grad_norms: list[float]
    clipped: int
    """Steps whose gradient norm was clipped."""


def _opsd_steps(model, opt: torch.optim.Optimizer, cfg: GRPOConfig, batch: RolloutBatch, t_logits: torch.Tensor,
                beta: float, gen: torch.Generator) -> _OPSDSteps:
    """``minibatches`` clipped AdamW steps on :func:`creditlab.core.losses.opsd_loss`."""
    from creditlab.core.losses import opsd_loss

    pm = batch.policy_mask
    model.train()
    norms, clipped, losses = [], 0, []
    for chunk in torch.randperm(len(batch), generator=gen).chunk(cfg.minibatches):
        s = aligned_logits(model(batch.tokens[chunk]).float()) / cfg.temperature
        loss, _ = opsd_loss(s, t_logits[chunk], pm[chunk], beta, agg=cfg.agg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        norms.append(gn)
        clipped += int(gn > cfg.grad_clip)
        losses.append(float(loss.detach()))
        opt.step()
    model.eval()
    return _OPSDSteps(losses, norms, clipped)
