"""The mismatch lab's cells: the gate's measurement of the base policy at every dose, and the stacked
training runs of the arms."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from creditlab.labs._toolshop import fresh_dump
from creditlab.labs.mismatch.config import ARMS, CHECKPOINT_EVERY, COMPUTE_CODE, DOSES, MismatchConfig, arm_triple
from creditlab.train.toolshop_base import _duration, base_policy
from creditlab.train.toolshop_grpo import train_grpo_stacked


def run_stack(dose: str, arms: list[str], seeds: list[int], config: dict, cache_dir: str,
              dump_dir: str | None = None) -> list[dict]:
    """One cell: the arms x seeds of one engine precision trained as one stacked program from the
    cached base policy. One row per model per update (and the final evaluation row). With
    ``dump_dir``, every update's rollouts of each model go to ``mismatch-<dose>-<arm>-seed=<s>.jsonl``
    there, in the ``creditlab diagnose`` schema (learner and engine log-probs, turns)."""
    from creditlab.models.tiny_lm import StackedTinyLM

    cfg = MismatchConfig.from_dict(config)
    base = base_policy(cfg.base, cache_dir=cache_dir)
    members, configs = stack_members(cfg, dose, arms, seeds)
    stack = StackedTinyLM([base] * len(members))
    on_rollouts = None
    if dump_dir:
        from creditlab.train.toolshop_dump import dump_rollouts

        paths = [fresh_dump(dump_dir, f"mismatch-{dose}-{a}-seed={s}.jsonl") for a, s in members]

        def on_rollouts(k, m, batch, rewards, old):
            dump_rollouts(batch, rewards, k, paths[m], logprobs=old)

    ck = None
    if on_rollouts is None:  # a resumed dump would miss the updates before the checkpoint
        from creditlab.lab.protocol import code_fingerprint
        from creditlab.lab.runner import digest

        # the cell's arguments and the code: a checkpoint of other code is never resumed
        key = digest({"dose": dose, "arms": arms, "seeds": seeds, "config": config,
                      "code": code_fingerprint(COMPUTE_CODE)})
        ck = Path(cache_dir) / "checkpoints" / f"mismatch-{dose}-{key}.pt"
    label = f"mismatch {dose} seed={','.join(map(str, seeds))} ({len(members)} model(s): {', '.join(arms)})"
    # held-out success on each arm's own engine (the quantized endpoint) with the fp32 engine's beside it, or
    # (eval_on="fp32", the 2-core protocol) on the fp32 engine only
    on_engine = cfg.eval_on == "engine"
    rows = train_grpo_stacked(stack, configs, eval_precision=None if on_engine else "fp32",
                              eval_also="fp32" if on_engine else None, on_rollouts=on_rollouts, checkpoint=ck,
                              checkpoint_every=CHECKPOINT_EVERY, on_update=UpdateProgress(label, cfg.grpo.updates))
    if ck is not None:
        ck.unlink(missing_ok=True)
    out = []
    for (a, s), model_rows in zip(members, rows, strict=True):
        out += [{"arm": a, "dose": dose, "seed": s, **r} for r in model_rows]
    return out


def stack_members(cfg: MismatchConfig, dose: str, arms: list[str], seeds: list[int]):
    """The ``(arm, seed)`` models of a stacked cell at ``dose`` in stack order, and each one's GRPOConfig (its
    engine, learner, correction and seed): consecutive models share a learner precision, so the stack makes one
    quantizer call per precision (StackedTinyLM)."""
    members = [(a, s) for a in arms for s in seeds]
    members.sort(key=lambda m: (arm_triple(m[0], dose)[1] == "fp32", list(ARMS).index(m[0]), m[1]))
    configs = []
    for a, s in members:
        engine, learner, corr = arm_triple(a, dose)
        configs.append(replace(cfg.grpo, rollout_precision=engine, learner_precision=learner, correction=corr, seed=s))
    return members, configs


class UpdateProgress:
    """A training cell's progress on stderr: a line after its first update, then at least once every
    ``every_s`` seconds and after its last, with the updates done, the time so far and the time left
    (from the rate of the updates this process ran: a resumed cell counts from its checkpoint)."""

    def __init__(self, label: str, updates: int, every_s: float = 60.0, stream=None, clock=time.monotonic):
        self.label, self.updates, self.every_s, self.clock = label, updates, every_s, clock
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = clock()
        self.first: int | None = None
        self.last_print = -math.inf

    def __call__(self, k: int, rows) -> None:
        now = self.clock()
        if self.first is None:
            self.first = k
        done = k + 1
        if done < self.updates and self.first != k and now - self.last_print < self.every_s:
            return
        self.last_print = now
        rate = (now - self.t0) / (done - self.first)
        left = "" if done >= self.updates else f", about {_duration(rate * (self.updates - done))} left"
        print(f"{self.label}: update {done}/{self.updates}, {_duration(now - self.t0)} so far{left}",
              file=self.stream, flush=True)


def run_dose_cell(config: dict, tasks: int, cache_dir: str) -> list[dict]:
    """The dose before training: K3 between each engine and an fp32 / a QAT learner on the base
    policy's own trajectories (``tasks`` held-out tasks, one rollout each), and the success of the
    base policy executed by that engine."""
    import torch

    from creditlab.core.correction import mismatch_metrics
    from creditlab.train.toolshop_rollout import EVAL_SEED_OFFSET, make_tasks, rollout, sequence_logprobs

    cfg = MismatchConfig.from_dict(config)
    g = cfg.grpo
    model = base_policy(cfg.base, cache_dir=cache_dir)
    ts = make_tasks(range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + tasks), g.chain_lengths)
    rows = []
    with torch.no_grad():
        for engine in ("fp32", *DOSES):
            batch = rollout(model, ts, precision=engine, max_len=g.max_len, max_turns=g.max_turns,
                            max_action_len=g.max_action_len, generator=torch.Generator().manual_seed(0))
            for learner in (("fp32",) if engine == "fp32" else ("fp32", engine)):
                old = sequence_logprobs(model, batch.tokens, learner)
                m = mismatch_metrics(old, batch.rollout_logprobs, batch.policy_mask, batch.valid_mask)
                last = max(k for k in range(8) if f"mismatch/turn{k}/prefix" in m)
                rows.append({"engine": engine, "learner": "QAT" if learner == engine != "fp32" else "fp32",
                             "k3": m["mismatch/k3"], "mean_abs_delta": m["mismatch/mean_abs_delta"],
                             "seq_k3": m["mismatch/seq_k3"], "prefix_turn0": m["mismatch/turn0/prefix"],
                             "prefix_last": m[f"mismatch/turn{last}/prefix"],
                             "current_last": m[f"mismatch/turn{last}/current"], "last_turn": last,
                             "engine_success": float(batch.success.mean()),
                             **gate_metrics(old, batch.rollout_logprobs, batch.policy_mask, batch.turn_ids,
                                            batch.tokens, batch.entropy)})
    return rows


#: Token-entropy bins (nats, of the engine's distribution) of the gate's K3 by entropy.
ENTROPY_BINS = (0.0, 0.05, 0.3, 1.0, math.inf)


def _bin_name(lo: float, hi: float) -> str:
    return f"k3_H<{hi:g}" if lo == 0 else f"k3_H>{lo:g}" if math.isinf(hi) else f"k3_H{lo:g}-{hi:g}"


def gate_metrics(old, rollout_lp, policy_mask, turn_ids, tokens, entropy) -> dict[str, float]:
    """The preconditions of the lab on one batch of trajectories sampled by the engine:

    * ``policy_tokens``: policy tokens per trajectory (mean), ``thought_tokens`` the thoughts among them;
    * ``drift_last``: the prefix log ratio entering each trajectory's last turn, ``sum of
      (learner - engine)`` over the policy tokens of its earlier turns (mean over trajectories; it is
      negative on average, since the engine drew the tokens: its mean is minus the KL of those
      tokens' engine distributions from the learner's);
    * ``prefix_rms_turn{k}`` / ``tokens_turn{k}``: by turn, the RMS of the prefix log ratio ``E_t``
      (``delta`` summed along the row up to ``t``) over the policy tokens of turn ``k``, and their count:
      what ``creditlab diagnose``'s ``mismatch.prefix_drift`` reads at the last turn with enough tokens;
    * ``k3_H...``: K3 per policy token by the engine's entropy at that token (:data:`ENTROPY_BINS`),
      and ``share_H...`` each bin's share of the policy tokens; ``k3_thought`` / ``k3_action``: K3 on
      the thought tokens and on the rest; ``thought_entropy``: the engine's mean entropy on thoughts.
    """
    import torch

    from creditlab.envs.toolshop import thought_mask

    pm = policy_mask.bool()
    delta = (old - rollout_lp).double().masked_fill(~pm, 0.0)
    k3 = (delta.exp() - 1 - delta).masked_fill(~pm, 0.0)
    tid = torch.where(pm, turn_ids, torch.full_like(turn_ids, -1))
    last = tid.max(1, keepdim=True).values
    has = last[:, 0] >= 0
    drift = (delta * (pm & (turn_ids < last))).sum(1)
    thought = pm & thought_mask(tokens)
    out = {"policy_tokens": float(pm.sum(1).double().mean()), "thought_tokens": float(thought.sum(1).double().mean()),
           "drift_last": float(drift[has].mean()) if bool(has.any()) else math.nan}
    n = max(int(pm.sum()), 1)
    ent = entropy.double() if entropy is not None else None
    for lo, hi in zip(ENTROPY_BINS[:-1], ENTROPY_BINS[1:], strict=True):
        name = _bin_name(lo, hi)
        sel = pm & (ent >= lo) & (ent < hi) if ent is not None else None
        cnt = int(sel.sum()) if sel is not None else 0
        out[name] = float(k3[sel].mean()) if cnt else math.nan
        out[name.replace("k3_", "share_")] = cnt / n
    # the statistic of `creditlab diagnose`'s mismatch.prefix_drift check, by turn: RMS over the policy tokens
    # of turn k of the prefix log ratio E_t (delta summed along the row up to and including t), with the
    # tokens it is over; the lab's tables take it at the last turn with enough tokens, as the check does
    E = torch.cumsum(delta, 1)
    for k in range(int(tid.max()) + 1 if bool(pm.any()) else 0):
        sel = pm & (turn_ids == k)
        cnt = int(sel.sum())
        out[f"tokens_turn{k}"] = float(cnt)
        out[f"prefix_rms_turn{k}"] = float(E[sel].square().mean().sqrt()) if cnt else math.nan
    action = pm & ~thought
    out["k3_thought"] = float(k3[thought].mean()) if bool(thought.any()) else math.nan
    out["k3_action"] = float(k3[action].mean()) if bool(action.any()) else math.nan
    out["thought_entropy"] = float(ent[thought].mean()) if ent is not None and bool(thought.any()) else math.nan
    return out
