"""What the coverage lab's experiments share: the training cell of the GRPO experiments, the arms of
the one-update protocol, the runs table, the paired differences and their reading, intervals' ranges
and the plots' colours."""

from __future__ import annotations

from dataclasses import asdict

import pandas as pd

from creditlab.errors import ConfigError
from creditlab.lab.experiment import Tables
from creditlab.lab.protocol import Table
from creditlab.lab.report import paired_diff, read_diff
from creditlab.lab.runner import Cell
from creditlab.train.chain import ChainTrainConfig, ModelSpec, train_chain

SINGLE_ARMS = ("binary", "uniform", "per_turn", "shuffled", "discretized", "reward_to_go")
UNIT, DIFF = (0.0, 1.0), (-1.0, 1.0)  # range of a score and of a difference of two scores (interval clipping)


def run_cell(experiment: str, specs: list[dict], train: dict) -> list[dict]:
    """Train one cell (module-level so a process pool can run it); one row per model."""
    cfg = ChainTrainConfig(**train)
    models = [ModelSpec(**s) for s in specs]
    out = train_chain(models, cfg)
    rows = []
    for m, spec in enumerate(models):
        curve = out["curve"][m]
        rows.append({
            "experiment": experiment, **spec.row(),
            "final_score": float(out["final_score"][m]), "aulc": float(curve.mean()),
            "curve": [float(v) for v in curve], "eval_at": [int(v) for v in out["eval_at"]],
            **{f"cfg_{k}": v for k, v in asdict(cfg).items()},
        })
    return rows


def _cells_of(experiment: str, groups: dict[str, list[ModelSpec]], train: ChainTrainConfig) -> list[Cell]:
    train_d = asdict(train)
    return [Cell(experiment, name, run_cell, {"experiment": experiment, "specs": [asdict(s) for s in specs],
                                              "train": train_d})
            for name, specs in groups.items()]


def check_chains(Cs, T: int) -> None:
    """Chain lengths an experiment trains on: each in [1, T] (the ``C`` in the error is the field's role)."""
    for C in Cs:
        if C < 1:
            raise ConfigError("C", f"must be >= 1, got {C}")
        if C > T:
            raise ConfigError("C", f"the chain (C={C}) cannot be longer than the episode (T={T})")


def check_in_episode(Cs, T: int) -> None:
    """Chain lengths of the real-agent and one-update experiments: each in [1, T]."""
    for C in Cs:
        if not 1 <= C <= T:
            raise ConfigError("C", f"must be in [1, T={T}], got {C}")


def check_densities(vds) -> None:
    """Verifier densities: each in [0, 1]."""
    for vd in vds:
        if not 0.0 <= vd <= 1.0:
            raise ConfigError("vd", f"verifier density must be in [0, 1], got {vd}")


def runs_table(name: str, rows: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, Table]]:
    """An experiment's rows in a fixed order (arm, C, k, vd, exposure, seed) and its ``<name>_runs`` table:
    every run, one row per model with its learning curve (not in the report)."""
    df = rows.sort_values(["arm", "C", "k", "vd", "exposure", "seed"], kind="stable").reset_index(drop=True)
    return df, {f"{name}_runs": Table(df, f"{name}: every run", report=False)}


def runs_of(tabs: Tables, name: str) -> pd.DataFrame:
    """The rows of an experiment's ``<name>_runs`` table (the one :func:`runs_table` makes)."""
    return tabs[f"{name}_runs"].frame


def score_diffs(df: pd.DataFrame, pairs: list[tuple[str, str]], by: list[str]) -> pd.DataFrame:
    """:func:`paired_diff` of the final score for each pair of arms (first - second) within each group
    of ``by`` (rows paired by seed), one table in the order of ``pairs``."""
    return pd.concat([paired_diff(df, a, b, by, "final_score", bounds=DIFF) for a, b in pairs], ignore_index=True)


def read_diffs(diffs: pd.DataFrame, by: list[str]) -> str:
    """The reading of a table of several paired differences: :func:`read_diff` of each, in order."""
    return " ".join(read_diff(g, by, what) for what, g in diffs.groupby("diff", sort=False))


def _paired_improvements(df: pd.DataFrame, pairs: list[tuple[str, str]], by: list[str]) -> pd.DataFrame:
    """:func:`paired_diff` of the improvement for each pair of arms within each group of ``by`` (rows
    paired by seed), with ``pairs_positive``: the seeds where the first arm improved more."""
    wide = df.pivot_table(index=[*by, "seed"], columns="arm", values="improvement")
    rows = []
    for a, b in pairs:
        d = paired_diff(df, a, b, by, "improvement", bounds=(-2.0, 2.0))
        d["pairs_positive"] = [int(((wide[a] - wide[b]).xs(key, level=tuple(by)) > 0).sum())
                               for key in zip(*(d[c] for c in by), strict=True)]
        rows.append(d)
    return pd.concat(rows, ignore_index=True)


COLORS = {"uniform": "tab:blue", "concentrated": "tab:red", "targeted": "tab:green", "per_turn": "tab:orange",
          "shuffled": "tab:purple", "random_k": "tab:brown", "binary": "tab:gray", "discretized": "tab:cyan",
          "reward_to_go": "tab:olive"}


def _band(ax, s: pd.DataFrame, x: str, arm: str, label: str | None = None) -> None:
    s = s.sort_values(x)
    ax.plot(s[x], s["mean"], "o-", color=COLORS.get(arm), label=label or arm, lw=1.8, ms=4)
    ax.fill_between(s[x], s["lo"], s["hi"], color=COLORS.get(arm), alpha=0.2)
