"""Write toolshop rollouts as a rollout dump (docs/diagnose.md), for ``creditlab diagnose``.

One row per trajectory of a :class:`~creditlab.train.toolshop_rollout.RolloutBatch`: ``step``,
``group`` (the batch's ``group_ids``), ``reward``, the token columns (padding dropped; ``logprobs``
are the learner's at the sampling checkpoint, what the trainer calls ``old``), ``turn_ids`` (the
batch's: an action and its observation share a turn, -1 on the prompt), ``response_length`` (policy
tokens), ``truncated``, ``instruction``, ``response`` (the tokens after the prompt, decoded) and
``turns`` (tool, arguments, returned values, ``is_write`` and the optional per-turn process score).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from creditlab.diagnose.schema import rows_from_arrays, write_dump
from creditlab.envs.toolshop import decode
from creditlab.errors import InputError
from creditlab.train.toolshop_rollout import RolloutBatch

__all__ = ["dump_rollouts", "rollout_rows"]


def rollout_rows(batch: RolloutBatch, rewards: torch.Tensor, step: int, *, logprobs: torch.Tensor | None = None,
                 process_scores: torch.Tensor | None = None) -> list[dict[str, Any]]:
    """Dump rows of ``batch`` at training step ``step``.

    ``rewards`` ``(B,)``: the outcome reward the advantage used. ``logprobs`` ``(B, L)``: the
    learner's log-probs of ``batch.tokens`` at the sampling checkpoint (without them the dump has no
    token columns and the mismatch checks are skipped). ``process_scores`` ``(B, T)``: per-turn
    process scores (e.g. :func:`~creditlab.train.toolshop_rollout.successful_read_scores`); each turn gets its
    score and the row's ``process_reward`` is their mean over the turns taken.
    """
    B = len(batch)
    rewards = torch.as_tensor(rewards).reshape(-1)
    if rewards.shape[0] != B:
        raise InputError(f"rewards: expected {B} values (one per trajectory), got {rewards.shape[0]}")
    if logprobs is not None and tuple(logprobs.shape) != tuple(batch.tokens.shape):
        raise InputError(f"logprobs: expected shape {tuple(batch.tokens.shape)} (the batch's tokens), got "
                         f"{tuple(logprobs.shape)}")
    if process_scores is not None and (process_scores.dim() != 2 or process_scores.shape[0] != B
                                       or process_scores.shape[1] < batch.n_turns_max):
        raise InputError(f"process_scores: expected (B={B}, T>={batch.n_turns_max}), got "
                         f"{tuple(process_scores.shape)}")
    turns, process_reward, responses = [], [], []
    for b, (task, recs) in enumerate(zip(batch.tasks, batch.records, strict=True)):
        ps = process_scores[b].tolist() if process_scores is not None else None
        turns.append([{"tool": r.name, "args": dict(r.arguments), "returned": list(r.returned), "is_write": r.is_write,
                       "process_score": None if ps is None else float(ps[t])} for t, r in enumerate(recs)])
        process_reward.append(float(sum(ps[:len(recs)]) / len(recs)) if ps is not None and recs else None)
        valid = batch.tokens[b][batch.valid_mask[b]].tolist()
        responses.append(" ".join(decode(valid[len(task.prompt_ids):])))
    token = {}
    if logprobs is not None:
        token = {"logprobs": logprobs, "rollout_logprobs": batch.rollout_logprobs, "policy_mask": batch.policy_mask,
                 "valid_mask": batch.valid_mask, "turn_ids": batch.turn_ids}
    return rows_from_arrays(
        step=int(step), group_ids=batch.group_ids, rewards=rewards, **token,
        response_length=batch.policy_mask.sum(1), truncated=batch.truncated,
        instruction=[" ".join(t.instruction) for t in batch.tasks], response=responses, turns=turns,
        process_reward=process_reward if process_scores is not None else None,
    )


def dump_rollouts(batch: RolloutBatch, rewards: torch.Tensor, step: int,
                  path_or_writer: str | os.PathLike | Callable[[list[dict[str, Any]]], Any], *,
                  logprobs: torch.Tensor | None = None, process_scores: torch.Tensor | None = None,
                  append: bool = True) -> Path | None:
    """Write the rows of :func:`rollout_rows` to a dump.

    ``path_or_writer``: a ``*.jsonl`` or ``*.parquet`` file (appended to; ``append=False`` refuses one that
    already holds rows), a directory (one ``part-NNNNN.parquet`` per call), or a callable that receives
    the rows (:func:`~creditlab.diagnose.schema.write_dump`). Returns the file written (None for a callable).
    """
    rows = rollout_rows(batch, rewards, step, logprobs=logprobs, process_scores=process_scores)
    if callable(path_or_writer):
        path_or_writer(rows)
        return None
    path = Path(path_or_writer)
    return write_dump(rows, path, append=append)
