"""TRL's completion logs, read as a dump: ``GRPOTrainer``'s ``log_completions`` parquet files.

With ``GRPOConfig(log_completions=True)`` TRL writes ``output_dir/completions/completions_{step:05d}.parquet``
at every logging step (and logs the same table to wandb / trackio): one row per completion with
``step``, ``prompt``, ``completion``, one column per reward function (named after it; NaN where it
returned None), the columns reward functions added with ``log_extra`` (sorted by name), and
``advantage``, in that order (TRL 1.15-1.16 ``GRPOTrainer.log``). It holds no log-probs, so the mismatch
checks are skipped; the rest is mapped onto the schema:

* ``group``: the prompt (its text, or the conversation as JSON): TRL's GRPO groups are the
  ``num_generations`` completions of one prompt;
* ``reward``: the sum of the reward-function columns with weight 1 each, TRL's default
  ``reward_weights`` (the file does not record them), NaN counted as 0 as TRL's ``nansum`` does; a row
  no function scored is left out. The table does not mark which columns are reward functions: a
  ``log_extra`` column is named freely and may be numeric (a judge's score, a count). They are told
  apart by TRL's layout and the logged advantage (:func:`reward_columns`), or named by the user
  (``creditlab diagnose --reward-column``); ``TrlRows.source`` says which columns were summed and
  which were not;
* ``response``: the completion (a conversation's message contents joined), ``response_length`` its
  length in characters.

TRL's logged tables (wandb's ``*.table.json``) hold the same columns; diagnose points to the parquet
files instead (:func:`not_a_dump`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from creditlab.diagnose.schema import TOKEN_COLUMNS, is_number
from creditlab.errors import ConfigError, InputError

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
    source: str = ""          # which columns the reward is, and how they were told from the others


ADVANTAGE_RTOL = 1e-4
"""A candidate reward reproduces TRL's logged advantage in a group when ``advantage = c (reward - group mean)``
for one ``c >= 0`` to within this share of the group's largest advantage (TRL computes in float32)."""


def _is_numeric(rows: list[dict], c: str) -> bool:
    return any(is_number(r.get(c)) for r in rows) and all(r.get(c) is None or is_number(r.get(c)) for r in rows)


def _matrix(rows: list[dict], names: Sequence[str]) -> np.ndarray:
    return np.asarray([[math.nan if r.get(c) is None else float(r[c]) for c in names] for r in rows],
                      dtype=np.float64).reshape(len(rows), len(names))


def _fits(reward: np.ndarray, advantage: np.ndarray, keys: list[tuple]) -> np.ndarray:
    """(G,) whether ``reward`` (NaN: unscored) reproduces ``advantage`` in each group of rows with one key
    (NaN: a group with fewer than 2 scored rows, or a non-finite advantage, which tells nothing).

    In every way TRL turns the summed reward into the advantage (``scale_rewards`` group, batch or none;
    one reward function under ``normalize_then_sum``), a group's advantages are ``c (R - mean R)`` with
    ``c >= 0``: the group's reward deviations up to one positive scale."""
    codes = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    g = np.asarray([codes[k] for k in keys], dtype=np.int64)
    out = np.full(len(codes), np.nan)
    scored = ~np.isnan(reward)
    for j in range(len(codes)):
        sel = (g == j) & scored
        a = advantage[sel]
        if sel.sum() < 2 or not np.isfinite(a).all():
            continue
        r = reward[sel]
        d = r - r.mean()
        tol = ADVANTAGE_RTOL * max(float(np.abs(a).max()), 1e-6)
        if float(np.abs(d).max()) <= 1e-9 * max(1.0, float(np.abs(r).max())):
            out[j] = float(np.abs(a).max()) <= tol
            continue
        c = float(a @ d / (d @ d))
        out[j] = c >= 0 and float(np.abs(a - c * d).max()) <= tol
    return out


def _declared(spec: Sequence[str], columns: list[str], rows: list[dict], where: Callable[[int, str], str]
              ) -> tuple[list[str], np.ndarray]:
    """The columns (and weights) ``--reward-column NAME[=WEIGHT]`` names."""
    names, weights = [], []
    for item in spec:
        name, eq, w = item.partition("=")
        if name in TRL_KEYS:
            raise ConfigError("--reward-column", f"{item!r}: {name!r} is a column TRL writes itself "
                                                 f"({', '.join(TRL_KEYS)}), not a reward function's")
        if name in names:
            raise ConfigError("--reward-column", f"{item!r}: column {name!r} is named twice; name each reward "
                                                 "function once, with its weight (NAME=WEIGHT)")
        if name not in columns:
            cands = [c for c in columns if c not in TRL_KEYS]
            raise ConfigError("--reward-column", f"{where(0, name)}: no such column in this TRL completions table; "
                                                 f"its columns besides {', '.join(TRL_KEYS)}: {', '.join(cands)}")
        if not _is_numeric(rows, name):
            raise ConfigError("--reward-column", f"{where(0, name)}: not a numeric column, so not a reward")
        try:
            weight = float(w) if eq else 1.0
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight):
            raise ConfigError("--reward-column", f"expected NAME or NAME=WEIGHT with a number, got {item!r}")
        if weight == 0:
            raise ConfigError("--reward-column", f"{item!r}: a weight of 0 counts nothing; leave {name!r} out "
                                                 "(the columns named are the whole reward)")
        names.append(name)
        weights.append(weight)
    return names, np.asarray(weights, dtype=np.float64)


def reward_columns(rows: list[dict], columns: list[str], keys: list[tuple],
                   where: Callable[[int, str], str]) -> tuple[list[str], str]:
    """The reward-function columns of a TRL completions table and a sentence on how they were found.

    TRL writes the reward functions' columns first and the ``log_extra`` columns after them (between
    ``completion`` and ``advantage``), both named freely, and reward columns are always numbers: the
    reward functions are a leading run of the numeric columns. Of those runs, the shortest whose sum
    reproduces the logged advantage in every group that tells (:func:`_fits`) is the reward; a numeric
    column after it is a ``log_extra`` one (or a reward function constant within every group, which no
    advantage can tell apart: the sentence says so). No run reproducing it (non-default
    ``reward_weights``, ``normalize_then_sum`` over several functions) is an error naming
    ``--reward-column``."""
    if "completion" in columns and "advantage" in columns and columns.index("completion") < columns.index("advantage"):
        middle = columns[columns.index("completion") + 1:columns.index("advantage")]
    else:
        middle = [c for c in columns if c not in TRL_KEYS]
    middle = [c for c in middle if c not in TRL_KEYS]
    numeric = [c for c in middle if _is_numeric(rows, c)]
    lead: list[str] = []  # a column no function scored in this table holds only nulls: still a reward column
    for c in middle:
        if not all(r.get(c) is None or is_number(r.get(c)) for r in rows):
            break
        lead.append(c)
    while lead and lead[-1] not in numeric:
        lead.pop()
    if not lead:
        raise InputError(f"{where(0, 'reward')}: a TRL completions table needs a reward-function column (a numeric "
                         f"column after 'completion'), got {', '.join(middle) or 'none'}")

    def others(used: list[str]) -> str:
        rest = [c for c in numeric if c not in used]
        return f"; not counted: {', '.join(rest)} (log_extra columns)" if rest else ""

    per = _matrix(rows, lead)
    adv = _matrix(rows, ["advantage"])[:, 0]
    fits = []
    for j in range(1, len(lead) + 1):
        part = per[:, :j]
        r = np.where(np.isnan(part).all(1), np.nan, np.nansum(part, 1))
        fits.append(_fits(r, adv, keys))
    fits_m = np.asarray(fits)  # (candidates, groups); NaN: the group tells nothing about that candidate
    group_of = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    first_row = {}
    for i, k in enumerate(keys):
        first_row.setdefault(group_of[k], i)

    def contradicted(j: int) -> np.ndarray:
        return np.flatnonzero(fits_m[j] == 0)  # groups whose advantage this candidate does not reproduce

    single = len(lead) == 1 or len([c for c in lead if c in numeric]) == 1 and lead[0] in numeric
    if single:
        bad = contradicted(0)
        if bad.size:  # one function, yet its column does not give the advantage: a negative weight, or not TRL's
            n_told = int((~np.isnan(fits_m[0])).sum())
            raise InputError(
                f"{where(first_row[int(bad[0])], 'advantage')}: the only reward-function column of this TRL "
                f"completions table, {lead[0]}, does not reproduce the logged advantage in {bad.size:,} of the "
                f"{n_told:,} groups that tell (a negative reward_weights?): name the reward function and its "
                "weight with --reward-column NAME=WEIGHT")
        return lead, (f"TRL reward-function column{'s' if len(lead) > 1 else ''} {' + '.join(lead)} (the only "
                      f"numeric column TRL writes before the log_extra ones){others(lead)}")
    told = ~np.isnan(fits_m)
    telling = told.any(0)
    # a candidate is the reward when it reproduces the advantage in every group that tells about it: a group
    # no candidate reproduces is evidence too (weights other than 1), never left out
    ok = [j for j in range(len(lead)) if told[j].any() and bool((fits_m[j][told[j]] == 1).all())]
    if not ok:
        tried = "; ".join(" + ".join(lead[:j + 1]) for j in range(len(lead)))
        none_fit = np.flatnonzero(telling & ~(fits_m == 1).any(0))
        at = first_row[int(none_fit[0])] if none_fit.size else 0
        groups = (f" (in {none_fit.size:,} of {int(telling.sum()):,} groups none does, the first at this row)"
                  if none_fit.size else "")
        raise InputError(
            f"{where(at, 'advantage')}: TRL's completions table does not mark which of its numeric columns are reward "
            f"functions and which log_extra added, and no sum of its leading ones ({tried}) reproduces the logged "
            f"advantage{groups} (non-default reward_weights, or multi_objective_aggregation='normalize_then_sum'?): "
            "name the reward functions with --reward-column NAME[=WEIGHT] (repeatable)")
    telling = (fits_m == 1).any(0)
    j = ok[0] + 1
    while j < len(lead) and lead[j] not in numeric:  # a function that scored nothing in this table
        j += 1
    used = lead[:j]
    n_groups = int(telling.sum())
    untold = [lead[k] for k in range(j, len(lead)) if k in ok]  # adding them changes no group's advantage
    rest = [c for c in numeric if c not in used and c not in untold]
    note = ""
    if untold:
        note = (f"; not counted: {', '.join(untold)}, constant within every group, so the advantage cannot tell a "
                "reward function from a log_extra column there (--reward-column counts it)")
    counted = f"; not counted: {', '.join(rest)} (log_extra columns)" if rest else ""
    return used, (f"TRL reward-function column{'s' if j > 1 else ''} {' + '.join(used)} (weight 1 each, NaN as 0: "
                  f"{'they reproduce' if j > 1 else 'it reproduces'} the logged advantage in {n_groups:,} "
                  f"group{'s' if n_groups > 1 else ''}){counted}{note}")


def from_trl(rows: list[dict], columns: list[str], where: Callable[[int, str], str], *,
             reward_columns_given: Sequence[str] | None = None) -> TrlRows:
    """The rows of one TRL completions table in the schema (see the module docstring); ``where(i, column)``
    names a row and column in error messages; ``reward_columns_given``: the user's ``--reward-column``
    values (``NAME`` or ``NAME=WEIGHT``), which replace the search for the reward-function columns."""
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
    if reward_columns_given:
        names, weights = _declared(reward_columns_given, columns, rows, where)
        ws = [f"{n}" if w == 1 else f"{format(w, 'g')} x {n}" for n, w in zip(names, weights, strict=True)]
        rest = [c for c in columns if c not in TRL_KEYS and c not in names and _is_numeric(rows, c)]
        source = (f"the columns --reward-column names: {' + '.join(ws)} (NaN as 0)"
                  + (f"; not counted: {', '.join(rest)}" if rest else ""))
    else:
        names, source = reward_columns(rows, columns, list(zip(step.tolist(), group, strict=True)), where)
        weights = np.ones(len(names))
    per = _matrix(rows, names)
    scored = ~np.isnan(per).all(1)
    reward = (np.where(np.isnan(per), 0.0, per) * weights).sum(1)
    keep = np.flatnonzero(scored)
    return TrlRows(keep, step[keep], [group[i] for i in keep], reward[keep], [response[i] for i in keep],
                   np.asarray([len(response[i]) for i in keep], dtype=np.float64), source)


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
