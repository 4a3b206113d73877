"""What the fork lab's experiments share: metrics, interval ranges, per-arm rows and paired differences
against FORK, colours and bars."""

from __future__ import annotations

import math

import pandas as pd

from creditlab.lab.report import ci_columns, paired_diff

METRICS = ("length", "recall", "precision", "f1", "necessary", "redundant", "wrong", "filler")


UNIT_METRICS = ("recall", "precision", "f1")  # in [0, 1]: their intervals are clipped to it


#: Range of the metrics the tables give intervals for (an interval is clipped to it).
BOUNDS = {"f1": (0.0, 1.0), "win_rate": (0.0, 1.0), "absence": (0.0, 1.0), "absence_change": (-1.0, 1.0)}


def _ci(values, name: str) -> dict[str, float]:
    return ci_columns(values, name, BOUNDS.get(name))


def _paired(final: pd.DataFrame, arms: tuple[str, ...], metrics: tuple[str, ...], by: list[str]) -> pd.DataFrame:
    """FORK minus every other arm, paired by seed, per group of ``by``, for each metric."""
    out = []
    for other in arms:
        if other == "fork":
            continue
        for m in metrics:
            d = paired_diff(final, "fork", other, by, m)
            d.insert(len(by) + 1, "metric", m)
            out.append(d)
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame()


def _arm_rows(final: pd.DataFrame, start: pd.DataFrame, arms: tuple[str, ...], cis: tuple[str, ...],
              means: tuple[str, ...]) -> pd.DataFrame:
    """One row per arm (means with 95% intervals over seeds for ``cis``, plain means for ``means``),
    after the initial policy's row (the same policy and evaluation samples in every arm at update 0)."""
    first = start[start["arm"] == arms[0]]
    rows = [{"arm": "initial policy", **{k: v for c in cis for k, v in _ci(first[c], c).items()},
             **{c: float(first[c].mean()) for c in means}, "n": len(first)}]
    for arm in arms:
        g = final[final["arm"] == arm]
        rows.append({"arm": arm, **{k: v for c in cis for k, v in _ci(g[c], c).items()},
                     **{c: float(g[c].mean()) for c in means}, "n": len(g)})
    return pd.DataFrame(rows)


_COLORS = {"recall": "tab:red", "mean": "tab:blue", "fork": "tab:green", "f2": "tab:purple"}


def _bars(ax, t: pd.DataFrame, m: str, title: str) -> None:
    arms = list(t["arm"])
    mean = t[m].to_numpy(float)
    lo, hi = t[f"{m}_lo"].to_numpy(float), t[f"{m}_hi"].to_numpy(float)
    err = [[0 if math.isnan(x) else v - x for v, x in zip(mean, lo, strict=True)],
           [0 if math.isnan(x) else x - v for v, x in zip(mean, hi, strict=True)]]
    ax.bar(arms, mean, yerr=err, capsize=4, color=[_COLORS.get(a, "tab:gray") for a in arms])
    ax.set(title=title)
    ax.tick_params(axis="x", labelsize=8)
