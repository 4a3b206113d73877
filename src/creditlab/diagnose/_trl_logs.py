"""TRL's completion logs, read as a dump: ``GRPOTrainer``'s ``log_completions`` parquet files.

With ``GRPOConfig(log_completions=True)`` TRL writes ``output_dir/completions/completions_{step:05d}.parquet``
at every logging step (and logs the same table to wandb / trackio): one row per completion with
``step``, ``prompt``, ``completion``, one column per reward function (named after it; NaN where it
returned None), the columns reward functions added with ``log_extra``, and ``advantage``. It holds
no log-probs, so the mismatch checks are skipped; the rest is mapped onto the schema:

* ``group``: the prompt (its text, or the conversation as JSON): TRL's GRPO groups are the
  ``num_generations`` completions of one prompt;
* ``reward``: the sum of the reward-function columns (the numeric columns other than ``step`` and
  ``advantage``) with weight 1 each, TRL's default ``reward_weights`` (the file does not record them),
  NaN counted as 0 as TRL's ``nansum`` does; a row no function scored is left out;
* ``response``: the completion (a conversation's message contents joined), ``response_length`` its
  length in characters.

TRL's logged tables (wandb's ``*.table.json``) hold the same columns; diagnose points to the parquet
files instead (:func:`not_a_dump`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from creditlab.diagnose.schema import TOKEN_COLUMNS, is_number
from creditlab.errors import InputError

FORMAT_TRL = "TRL log_completions"
TRL_KEYS = ("step", "prompt", "completion", "advantage")
"""The columns TRL's completions table always has."""
NO_LOGPROBS = ("TRL's completion logs (log_completions) hold no log-probs: dump the rollouts with "
               "creditlab.integrations.trl.CreditlabGRPOTrainer(dump=...)")


def is_trl(names: set[str]) -> bool:
    return set(TRL_KEYS) <= names and "group" not in names and not (set(TOKEN_COLUMNS) & names)


def _text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, list | tuple) and all(isinstance(m, dict) for m in v):  # a conversation
        parts = []
        for m in v:
            c = m.get("content")
            if isinstance(c, list):  # typed content blocks
                c = " ".join(str(b.get("text", "")) for b in c if isinstance(b, dict))
            parts.append("" if c is None else str(c))
        return "\n".join(parts)
    return None


@dataclass
class TrlRows:
    """What a TRL completions table gives the schema: the rows kept (indices of the table's rows) and
    their columns."""

    rows: np.ndarray          # (n,) indices of the rows kept (a row no reward function scored is left out)
    step: np.ndarray          # (n,) int64
    group: list[str]          # the prompt of each row
    reward: np.ndarray        # (n,) float64
    response: list[str]       # the completion text
    length: np.ndarray        # (n,) float64, characters of the completion


def from_trl(rows: list[dict], columns: list[str], where: Callable[[int, str], str]) -> TrlRows:
    """The rows of one TRL completions table in the schema (see the module docstring); ``where(i, column)``
    names a row and column in error messages."""
    rewards = [c for c in columns if c not in TRL_KEYS
               and any(is_number(r.get(c)) for r in rows)
               and all(r.get(c) is None or is_number(r.get(c)) for r in rows)]
    if not rewards:
        raise InputError(f"{where(0, 'reward')}: a TRL completions table needs a reward-function column (a numeric "
                         f"column besides {', '.join(TRL_KEYS)})")
    per = np.asarray([[math.nan if r.get(c) is None else float(r[c]) for c in rewards] for r in rows],
                     dtype=np.float64)
    scored = ~np.isnan(per).all(1)
    reward = np.where(np.isnan(per), 0.0, per).sum(1)
    step = np.empty(len(rows), dtype=np.int64)
    group, response = [], []
    for i, r in enumerate(rows):
        s = r.get("step")
        if not is_number(s) or not math.isfinite(float(s)) or float(s) != int(s):
            raise InputError(f"{where(i, 'step')}: expected an integer, got {'nothing' if s is None else repr(s)}")
        step[i] = int(s)
        p, c = r.get("prompt"), _text(r.get("completion"))
        if c is None:
            raise InputError(f"{where(i, 'completion')}: expected the completion text or messages, got "
                             f"{type(r.get('completion')).__name__}")
        if not isinstance(p, str):
            if _text(p) is None:
                raise InputError(f"{where(i, 'prompt')}: expected the prompt text or messages, got {type(p).__name__}")
            p = json.dumps(p, sort_keys=True, default=str)
        group.append(p)
        response.append(c)
    keep = np.flatnonzero(scored)
    return TrlRows(keep, step[keep], [group[i] for i in keep], reward[keep], [response[i] for i in keep],
                   np.asarray([len(response[i]) for i in keep], dtype=np.float64))


def not_a_dump(path: Path) -> str | None:
    """The one-line explanation for a file or directory of TRL's logged tables, or None."""
    tables = [path] if path.name.endswith(".table.json") else \
        sorted(path.glob("*.table.json")) if path.is_dir() else []
    if not tables:
        return None
    what = "is TRL's logged completions table" if path.is_file() else "holds TRL's logged completions tables"
    return (f"{path}: {what} ({tables[0].name}: wandb's copy of log_completions); diagnose reads TRL's own "
            "files of the same rows, output_dir/completions/*.parquet, for the reward and group checks; neither "
            "holds log-probs: for the mismatch checks dump the rollouts with CreditlabGRPOTrainer(dump=...)")
