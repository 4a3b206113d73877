"""Tables and statistics for lab reports: parquet + markdown, means with 95% intervals, paired
differences between arms (same seeds, same evaluation batch)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pandas as pd

from creditlab.errors import InputError

__all__ = ["mean_ci", "paired_diff", "summarize", "to_markdown", "write_table"]


def _t975(df: int) -> float:
    try:
        from scipy.stats import t

        return float(t.ppf(0.975, df))
    except ImportError:  # scipy is optional at run time; Cornish-Fisher style approximation
        z = 1.959964
        return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci(values) -> tuple[float, float, float]:
    """Mean and 95% Student-t interval ``(mean, lo, hi)``; a single value gives a zero-width
    interval, an empty input gives NaNs."""
    v = np.asarray(values, dtype=float)
    v = v[~np.isnan(v)]
    if v.size == 0:
        return (math.nan, math.nan, math.nan)
    m = float(v.mean())
    if v.size == 1:
        return (m, m, m)
    half = _t975(v.size - 1) * float(v.std(ddof=1)) / math.sqrt(v.size)
    return (m, m - half, m + half)


def summarize(df: pd.DataFrame, by: list[str], value: str) -> pd.DataFrame:
    """Mean, 95% interval and count of ``value`` per group of ``by``."""
    rows = []
    for key, g in df.groupby(by, sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        m, lo, hi = mean_ci(g[value])
        rows.append({**dict(zip(by, key, strict=True)), "mean": m, "lo": lo, "hi": hi, "n": len(g)})
    return pd.DataFrame(rows)


def paired_diff(df: pd.DataFrame, arm_a: str, arm_b: str, by: list[str], value: str,
                arm_col: str = "arm", pair_col: str = "seed") -> pd.DataFrame:
    """Paired difference ``arm_a - arm_b`` of ``value`` per group of ``by``, pairing rows on
    ``pair_col`` (same seed = same environment draws and evaluation batch). Returns mean
    difference, 95% interval and the number of pairs."""
    for col in [*by, arm_col, pair_col, value]:
        if col not in df.columns:
            raise InputError(f"paired_diff: column {col!r} not in the table")
    a = df[df[arm_col] == arm_a].set_index([*by, pair_col])[value]
    b = df[df[arm_col] == arm_b].set_index([*by, pair_col])[value]
    d = (a - b).dropna().reset_index()
    out = summarize(d, by, value) if by else pd.DataFrame([dict(zip(("mean", "lo", "hi"), mean_ci(d[value]),
                                                                      strict=True)) | {"n": len(d)}])
    out.insert(0, "diff", f"{arm_a} - {arm_b}")
    return out


def to_markdown(df: pd.DataFrame, floatfmt: str = ".3f") -> str:
    """Markdown table without the optional ``tabulate`` dependency."""
    cols = list(df.columns)

    def fmt(x) -> str:
        if isinstance(x, float | np.floating):
            return "nan" if math.isnan(x) else format(float(x), floatfmt)
        return str(x)

    lines = ["| " + " | ".join(map(str, cols)) + " |", "|" + "|".join("---" for _ in cols) + "|"]
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
        return (f"{what}: one pair per configuration, so no interval; this run cannot tell a difference "
                "from noise (use more --seeds).")
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
