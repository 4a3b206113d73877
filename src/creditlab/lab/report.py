"""Tables and statistics for lab reports: parquet + markdown, means with 95% intervals, paired
differences between arms (same seeds, same evaluation batch)."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from creditlab.errors import InputError

__all__ = ["ci_columns", "group_means", "knobs_table", "mean_ci", "paired_diff", "sort_in_order", "summarize",
           "to_markdown", "write_table"]


@functools.lru_cache(maxsize=64)
def _t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (scipy: exact, not approximated;
    12.706 at 1, 4.303 at 2, 2.776 at 4)."""
    from scipy.stats import t  # imported on first use: scipy.stats costs a few hundred ms to import

    return float(t.ppf(0.975, df))


def mean_ci(values, bounds: tuple[float, float] | None = None) -> tuple[float, float, float]:
    """Mean and 95% Student-t interval ``(mean, lo, hi)``.

    A single value has no interval (``lo = hi = NaN``; tables print "-" and the written
    interpretation says "one seed: no interval"); an empty input gives NaNs. ``bounds``: the range
    the quantity lives in (e.g. ``(0, 1)`` for a success rate): the interval is clipped to it, so
    a score's interval never reaches past a perfect score.
    """
    v = np.asarray(values, dtype=float)
    v = v[~np.isnan(v)]
    if v.size == 0:
        return (math.nan, math.nan, math.nan)
    m = float(v.mean())
    if v.size == 1:
        return (m, math.nan, math.nan)
    half = _t975(v.size - 1) * float(v.std(ddof=1)) / math.sqrt(v.size)
    lo, hi = m - half, m + half
    if bounds is not None:
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    return (m, lo, hi)


def ci_columns(values, name: str | None = None, bounds: tuple[float, float] | None = None) -> dict[str, float]:
    """:func:`mean_ci` of ``values`` as table columns: ``{name, name_lo, name_hi}``, or
    ``{mean, lo, hi}`` without a ``name``."""
    m, lo, hi = mean_ci(values, bounds)
    if name is None:
        return {"mean": m, "lo": lo, "hi": hi}
    return {name: m, f"{name}_lo": lo, f"{name}_hi": hi}


def summarize(df: pd.DataFrame, by: list[str], value: str, bounds: tuple[float, float] | None = None
              ) -> pd.DataFrame:
    """Mean, 95% interval (clipped to ``bounds``, see :func:`mean_ci`) and count of ``value`` per
    group of ``by``."""
    rows = []
    for key, g in df.groupby(by, sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        rows.append({**dict(zip(by, key, strict=True)), **ci_columns(g[value], bounds=bounds), "n": len(g)})
    return pd.DataFrame(rows)


def group_means(df: pd.DataFrame, by: list[str], intervals: list[tuple[str, tuple[float, float] | None]],
                means: tuple[str, ...] = ()) -> pd.DataFrame:
    """One row per group of ``by`` (in order of appearance), e.g. an arm's seeds: for each
    ``(column, bounds)`` of ``intervals`` its mean and 95% interval (:func:`ci_columns`), then the
    plain mean of each column of ``means``, then the group's size ``n``."""
    rows = []
    for key, g in df.groupby(by, sort=False):
        row: dict = dict(zip(by, key, strict=True))
        for col, bounds in intervals:
            row.update(ci_columns(g[col], col, bounds))
        for col in means:
            row[col] = float(g[col].mean())
        row["n"] = len(g)
        rows.append(row)
    return pd.DataFrame(rows)


def sort_in_order(df: pd.DataFrame, by: list[str], orders: Mapping[str, Sequence],
                  ascending: bool | list[bool] = True) -> pd.DataFrame:
    """``df`` sorted by the columns ``by``, the columns named in ``orders`` in the order listed there
    (e.g. arms in the lab's order; a value not listed sorts last), the others by value; index reset."""
    ranks = {col: {v: i for i, v in enumerate(values)} for col, values in orders.items()}
    return df.sort_values(by, key=lambda c: c.map(ranks[c.name]) if c.name in ranks else c,
                          ascending=ascending).reset_index(drop=True)


def knobs_table(here: list[tuple[str, str, str]], default: list[tuple[str, str, str]]) -> pd.DataFrame:
    """The ``knobs`` table of a lab: each ``(knob, value, why)`` of this run beside the value of the
    same knob in the lab's default configuration (``default``, in the same order)."""
    return pd.DataFrame([(k, v, d, why) for (k, v, why), (_, d, _) in zip(here, default, strict=True)],
                        columns=["knob", "this run", "lab default", "why the default"])


def paired_diff(df: pd.DataFrame, arm_a: str, arm_b: str, by: list[str], value: str,
                arm_col: str = "arm", pair_col: str = "seed", bounds: tuple[float, float] | None = None
                ) -> pd.DataFrame:
    """Paired difference ``arm_a - arm_b`` of ``value`` per group of ``by``, pairing rows on
    ``pair_col`` (same seed = same environment draws and evaluation batch). Returns mean
    difference, 95% interval (clipped to ``bounds``, e.g. ``(-1, 1)`` for a difference of two
    scores in ``[0, 1]``) and the number of pairs."""
    for col in [*by, arm_col, pair_col, value]:
        if col not in df.columns:
            raise InputError(f"paired_diff: column {col!r} not in the table")
    a = df[df[arm_col] == arm_a].set_index([*by, pair_col])[value]
    b = df[df[arm_col] == arm_b].set_index([*by, pair_col])[value]
    d = (a - b).dropna().reset_index()
    out = summarize(d, by, value, bounds) if by else pd.DataFrame([ci_columns(d[value], bounds=bounds) | {"n": len(d)}])
    out.insert(0, "diff", f"{arm_a} - {arm_b}")
    return out


def _cell(text: str) -> str:
    """A markdown table cell: ``|`` escaped, newlines folded."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(df: pd.DataFrame, floatfmt: str = ".3f") -> str:
    """Markdown table without the optional ``tabulate`` dependency.

    Missing values print as ``-`` (e.g. the interval of a single seed), a value that rounds to
    zero prints without a sign (no ``-0.000``), and ``|`` in labels is escaped so the table renders.
    """
    cols = list(df.columns)

    def fmt(x) -> str:
        if isinstance(x, float | np.floating):
            if math.isnan(x):
                return "-"
            text = format(float(x), floatfmt)
            if text.startswith("-") and float(text) == 0.0:
                text = text[1:]
            return text
        if x is None:
            return "-"
        return _cell(x)

    lines = ["| " + " | ".join(_cell(c) for c in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def write_table(df: pd.DataFrame, out_dir: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``out_dir/name.parquet`` and ``out_dir/name.md``; returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pq, md = out / f"{name}.parquet", out / f"{name}.md"
    df.to_parquet(pq, index=False)
    md.write_text(to_markdown(df))
    return pq, md


# --------------------------------------------------------------------------------------------
# written interpretation


def _label(row: pd.Series, by: list[str]) -> str:
    return ", ".join(f"{c}={_fmt_value(row[c])}" for c in by) if by else "overall"


def _fmt_value(v) -> str:
    if isinstance(v, float | np.floating):
        return format(float(v), "g")
    return str(v)


def read_diff(diff: pd.DataFrame, by: list[str], what: str) -> str:
    """One or two sentences reading a :func:`paired_diff` table: where ``what`` (e.g.
    ``"uniform - concentrated"``) is positive or negative with a 95% interval excluding 0, where
    it is within noise, and whether the run has too few pairs to tell."""
    if diff.empty:
        return f"No pairs for {what}."
    n = int(diff["n"].min())
    if n < 2:
        return (f"{what}: one seed, so no interval; this run cannot tell a difference from noise "
                "(use more --seeds).")
    pos = [_label(r, by) for _, r in diff.iterrows() if r["lo"] > 0]
    neg = [_label(r, by) for _, r in diff.iterrows() if r["hi"] < 0]
    flat = [_label(r, by) for _, r in diff.iterrows() if not (r["lo"] > 0 or r["hi"] < 0)]
    parts = []
    if pos:
        parts.append(f"positive (95% interval above 0) at {'; '.join(pos)}")
    if neg:
        parts.append(f"negative (interval below 0) at {'; '.join(neg)}")
    if flat:
        parts.append(f"within noise (interval contains 0) at {'; '.join(flat)}")
    text = f"{what} over {n} paired seeds is " + ", ".join(parts) + "."
    if n < 5:
        text += f" With {n} pairs the intervals are wide: too small to tell small effects apart."
    return text


def small_run_note(seeds: int) -> str:
    """The sentence a report adds when a run has too few seeds to tell (empty from 5 seeds on)."""
    if seeds < 2:
        return " One seed: no interval; this run is too small to tell a difference from noise."
    if seeds < 5:
        return f" With {seeds} seeds the intervals are wide: too small to tell small differences."
    return ""
