"""The ``budget`` experiment of the granularity lab: room to farm the process reward. At the lab's action
budget (C + 2) a policy has at most two turns to spend beyond the chain, so a process reward that pays
for new evidence leaves it nothing to farm. Here the short type (C = 2-4) trains at a long action
budget (``budget_turns``, 12 turns: 3 C at C = 4) beside the short one (C + 2), both in a 320-token
context from a base policy whose positions reach it (by default experiment multi's three-type base
policy), with the default process scorer. Arms: GRPO, the fixed- and the decayed-weight PRM at the long
budget; GRPO and the fixed-weight PRM at C + 2.

Measured first (its gate cell), on the base policy at both budgets: the mean turn score, the share of
turns above it, the *off-chain reads* (successful reads of calls off the task's chain: they return
unseen values and score 1) and truncation. The gate: an off-chain read scores above the mean turn
score, and the base makes one in at least :data:`OFF_CHAIN_GATE` of its episodes. Its predictions: B1,
the fixed weight raises tool calls and truncation over GRPO at the long budget, to a partial level; B2,
the decayed weight does not; B3, GRPO is not hurt by the long budget."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import pandas as pd
import torch

from creditlab.errors import ConfigError, InputError
from creditlab.lab.experiment import Prediction, Tables, Verdict, notes
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table
from creditlab.lab.report import group_means, paired_diff, small_run_note
from creditlab.lab.runner import Cell
from creditlab.labs._toolshop import base_knob
from creditlab.labs.granularity._common import (
    COLORS,
    DIFF,
    LABELS,
    UNIT,
    GranularityExperiment,
    _curves,
    _line,
    _ordered,
    _summary,
    run_arm,
    run_config,
    setting_of,
)
from creditlab.labs.granularity.config import GranularityConfig
from creditlab.labs.granularity.world import GATE_SEED_OFFSET, farm_stats
from creditlab.train.common import generator
from creditlab.train.toolshop_base import base_policy
from creditlab.train.toolshop_rollout import make_tasks, rollout

#: The two action budgets: name -> the setting of :func:`~creditlab.labs.granularity._common.setting_of`.
BUDGETS = {"c2": "budget_c2", "long": "budget"}
#: The arms at each budget.
BUDGET_ARMS = {"c2": ("grpo", "prm_fixed"), "long": ("grpo", "prm_fixed", "prm_decay")}
#: The gate: the share of the base policy's episodes at the long budget with an off-chain read.
OFF_CHAIN_GATE = 0.01
#: B1's partial level: the fixed weight's mean held-out truncation at the long budget lies in this range.
PARTIAL = (0.1, 0.8)
#: B1 and B2: a paired rise in truncation smaller than this is no rise.
TRUNCATION_RISE = 0.05
#: B3: a paired drop in GRPO's success larger than this is a hurt.
SUCCESS_DROP = 0.05


def budget_label(budget: str, cfg: GranularityConfig | None = None) -> str:
    """How a budget is written in the tables: ``C + 2`` or ``12 turns``."""
    if budget == "c2":
        return "C + 2"
    return f"{(cfg or GranularityConfig()).budget_turns} turns"


@torch.no_grad()
def run_gate_cell(config: dict, gate: str, cache_dir: str) -> list[dict]:
    """The experiment's precondition, on its base policy before any training, at each budget: what the
    process reward leaves to farm (:func:`~creditlab.labs.granularity.world.farm_stats`) on
    ``4 * eval_per_type`` short tasks of the gates' held-out stream. ``gate`` (``"budget"``) names the
    precondition among the lab's gate cells."""
    if gate != "budget":
        raise InputError(f"gate: {gate!r} is not 'budget' (experiment budget's gate cell)")
    cfg = GranularityConfig.from_dict(config)
    rows = []
    for budget, setting in BUDGETS.items():
        base_cfg, g, _ = setting_of(cfg, setting)
        model = base_policy(base_cfg, cache_dir=cache_dir)
        tasks = make_tasks(range(GATE_SEED_OFFSET, GATE_SEED_OFFSET + 4 * cfg.eval_per_type), g.chain_lengths)
        batch = rollout(model, tasks, precision="fp32", max_len=g.max_len, max_turns=g.max_turns,
                        max_action_len=g.max_action_len, temperature=g.temperature,
                        generator=generator("granularity/teacher"))  # the precondition cells' stream
        rows.append({"gate": "farm", "budget": budget, **farm_stats(batch, cfg.repeat, g.max_turns)})
    return rows


def run_budget_arm(config: dict, arm: str, seed: int, budget: str, cache_dir: str,
                   dump_dir: str | None = None) -> list[dict]:
    """One training run of the experiment (a cell): :func:`~creditlab.labs.granularity._common.run_arm`
    in the setting of ``budget`` (:data:`BUDGETS`), its rows tagged with the budget."""
    if budget not in BUDGETS:
        raise InputError(f"budget: {budget!r} is not one of {', '.join(BUDGETS)}")
    rows = run_arm(config, arm, seed, cache_dir, dump_dir, setting=BUDGETS[budget])
    return [{**r, "budget": budget} for r in rows]


FARM_COLUMNS = ("rollouts", "turns", "mean_turn_score", "above_mean_share", "off_chain_rate", "off_chain_episodes",
                "off_chain_score", "off_chain_new_share", "truncation", "token_truncation", "tool_calls", "success",
                "response_tokens")


def _farm(gates: pd.DataFrame | None) -> pd.DataFrame | None:
    """The gate rows by budget, every column of :func:`farm_stats` present (the store drops a column that
    is NaN in every row, e.g. the off-chain score of a base that made no off-chain read; None: not measured)."""
    if gates is None or "gate" not in gates or not gates["gate"].eq("farm").any():
        return None
    farm = gates[gates["gate"] == "farm"].set_index("budget")
    return farm.reindex(columns=[c for c in farm.columns if c not in FARM_COLUMNS] + list(FARM_COLUMNS))


def gate_passes(farm: pd.DataFrame) -> bool | None:
    """Whether the gate passes at the long budget: an off-chain read scores above the mean turn score and
    the base makes one in at least :data:`OFF_CHAIN_GATE` of its episodes (None: not measured)."""
    if "long" not in farm.index:
        return None
    r = farm.loc["long"]
    score = r["off_chain_score"]
    return bool(not pd.isna(score) and score > r["mean_turn_score"] and r["off_chain_episodes"] >= OFF_CHAIN_GATE)


# --------------------------------------------------------------------------------------------
# the predictions


def _diff(tabs: Tables, diff: str, budget: str) -> pd.DataFrame | None:
    """The row of ``budget_diffs`` for ``diff`` at ``budget`` (None: not in this run)."""
    if "budget_diffs" not in tabs:
        return None
    d = tabs["budget_diffs"].frame
    d = d[(d["diff"] == diff) & (d["budget"] == budget)]
    return d.iloc[0] if len(d) else None


def _mean_of(tabs: Tables, arm: str, budget: str, col: str) -> float:
    if "budget_means" not in tabs:
        return math.nan
    m = tabs["budget_means"].frame
    m = m[(m["arm"] == arm) & (m["budget"] == budget)]
    return float(m[col].iloc[0]) if len(m) else math.nan


def _fmt(d: pd.Series, m: str, pct: bool = False) -> str:
    if pct:
        return f"{d[m]:+.0%} [{d[m + '_lo']:+.0%}, {d[m + '_hi']:+.0%}]"
    return f"{d[m]:+.2f} [{d[m + '_lo']:+.2f}, {d[m + '_hi']:+.2f}]"


def _vs_grpo(tabs: Tables, arm: str, label: str) -> str | None:
    """``arm`` - GRPO at the long budget in truncation and tool calls, as the predictions table writes it."""
    d = _diff(tabs, f"{arm} - grpo", "long")
    if d is None:
        return None
    return (f"{label} - GRPO at the long budget: truncation {_fmt(d, 'truncation', True)}, tool calls "
            f"{_fmt(d, 'tool_calls')}")


def b1_measured(tabs: Tables) -> str | None:
    said = _vs_grpo(tabs, "prm_fixed", "fixed")
    return None if said is None else \
        f"{said}; fixed-λ truncation {_mean_of(tabs, 'prm_fixed', 'long', 'truncation'):.0%}"


def b1_verdict(tabs: Tables) -> Verdict:
    """B1 fails when, at the long budget, the fixed weight's paired rise over GRPO in truncation is at most
    :data:`TRUNCATION_RISE` or in tool calls at most 0, or its truncation is outside :data:`PARTIAL`; it
    holds when, besides, the truncation rise's 95% interval is above 0; else it is not resolved."""
    d = _diff(tabs, "prm_fixed - grpo", "long")
    if d is None:
        return Verdict.NOT_JUDGED
    level = _mean_of(tabs, "prm_fixed", "long", "truncation")
    if d["truncation"] <= TRUNCATION_RISE or d["tool_calls"] <= 0 or not PARTIAL[0] <= level <= PARTIAL[1]:
        return Verdict.FAILS
    return Verdict.HOLDS if d["truncation_lo"] > 0 else Verdict.NOT_JUDGED


def b2_measured(tabs: Tables) -> str | None:
    return _vs_grpo(tabs, "prm_decay", "decayed")


def b2_verdict(tabs: Tables) -> Verdict:
    """B2 fails when, at the long budget, the decayed weight's paired rise over GRPO in truncation exceeds
    :data:`TRUNCATION_RISE` with its 95% interval above 0; it holds otherwise."""
    d = _diff(tabs, "prm_decay - grpo", "long")
    if d is None:
        return Verdict.NOT_JUDGED
    return Verdict.of(not (d["truncation"] > TRUNCATION_RISE and d["truncation_lo"] > 0))


def b3_measured(tabs: Tables) -> str | None:
    d = _diff(tabs, "grpo: long - C + 2", "both")
    if d is None:
        return None
    return (f"GRPO's success at the long budget - at C + 2: {_fmt(d, 'success')} (GRPO "
            f"{_mean_of(tabs, 'grpo', 'long', 'success'):.2f} vs {_mean_of(tabs, 'grpo', 'c2', 'success'):.2f})")


def b3_verdict(tabs: Tables) -> Verdict:
    """B3 fails when GRPO's paired success at the long budget is more than :data:`SUCCESS_DROP` below its
    success at C + 2; it holds otherwise."""
    d = _diff(tabs, "grpo: long - C + 2", "both")
    return Verdict.NOT_JUDGED if d is None else Verdict.of(bool(d["success"] >= -SUCCESS_DROP))


PREDICTIONS = (
    Prediction("B1: at the long budget the fixed-λ PRM raises tool calls and truncation over GRPO, to a partial "
               "level", measured=b1_measured, verdict=b1_verdict,
               note=notes(not_judged="not resolved: the interval spans 0"),
               stated="B1: at the long budget (12 turns), the fixed-λ PRM farms the process reward: its held-out "
                      "truncation and tool calls rise over GRPO's (paired, same seeds), to a partial level (mean "
                      "truncation between 10% and 80%). Falsified if the paired rise in truncation is <= 5 points "
                      "or in tool calls <= 0, or if the fixed arm's truncation is below 10% or above 80% "
                      "(reported as not resolved when the rise's 95% interval spans 0)."),
    Prediction("B2: the decayed-λ PRM does not", measured=b2_measured, verdict=b2_verdict,
               stated="B2: at the long budget the decayed-λ PRM does not farm: its held-out truncation does not "
                      "rise over GRPO's. Falsified if the paired rise in truncation is > 5 points with its 95% "
                      "interval above 0."),
    Prediction("B3: GRPO is not hurt by the long budget", measured=b3_measured, verdict=b3_verdict,
               stated="B3: GRPO is not hurt by the long budget: its held-out success on the short type at 12 "
                      "turns is not below its success at C + 2 (paired, same seeds, each evaluated at its own "
                      "budget). Falsified if the paired difference is below -0.05."),
)


# --------------------------------------------------------------------------------------------
# the experiment


class Budget(GranularityExperiment):
    """Room to farm: GRPO and both PRM weights on the short type at a long action budget (module docstring)."""

    name = "budget"
    groups = ("gates", "budget")
    fields = ("budget_base", "budget_turns", "budget_max_len")
    predictions = PREDICTIONS
    gate_reading = ("on its base policy at each action budget: the mean turn score, the share of turns above it, "
                    "the off-chain reads (successful reads off the task's chain) with their rate and mean score, "
                    f"and truncation; the gate: an off-chain read scores above the mean turn score and at least "
                    f"{OFF_CHAIN_GATE:.0%} of the episodes at the long budget make one.")
    gate_knob = f"budget: off-chain read score > mean turn score, in >= {OFF_CHAIN_GATE:.0%} of episodes"

    def validate(self, cfg: GranularityConfig) -> None:
        short = (2, 3, 4)
        if not set(short) <= set(cfg.budget_base.chain_lengths):
            raise ConfigError("budget_base.chain_lengths", f"must hold the short type's chain lengths {short}")
        if cfg.budget_max_len > cfg.budget_base.max_len:
            raise ConfigError("budget_max_len", f"{cfg.budget_max_len} exceeds the model's {cfg.budget_base.max_len}")
        if cfg.budget_turns <= max(short) + 2:
            raise ConfigError("budget_turns", f"must exceed the short type's C + 2 ({max(short) + 2}), got "
                                              f"{cfg.budget_turns}")

    def cells(self, cfg: GranularityConfig) -> list[Cell]:
        own, ctx = run_config(cfg), cfg.context(dump=True)
        return [Cell("gates", "budget", run_gate_cell, {"config": cfg.identity(), "gate": "budget"}, cfg.context()),
                *(Cell("budget", f"{arm}/{b}/seed={s}", run_budget_arm,
                       {"config": own, "arm": arm, "seed": s, "budget": b}, ctx)
                  for s in range(cfg.seeds) for b, arms in BUDGET_ARMS.items() for arm in arms)]

    def gate_rows(self, gates: pd.DataFrame, cfg: GranularityConfig) -> list[dict]:
        farm = _farm(gates)
        if farm is None:
            return []
        rows = []
        for b in BUDGETS:
            if b not in farm.index:
                continue
            r = farm.loc[b]
            note = (f"mean turn score {r['mean_turn_score']:.2f}, {r['above_mean_share']:.0%} of turns above it; "
                    f"off-chain reads {r['off_chain_rate']:.1%} of turns, in {r['off_chain_episodes']:.0%} of "
                    f"episodes; truncation {r['truncation']:.0%} ({r['token_truncation']:.0%} by the token budget), "
                    f"{r['tool_calls']:.1f} calls, success {r['success']:.2f}")
            gate = f"off-chain read score - mean turn score, {budget_label(b, cfg)}"
            rows.append({"experiment": "budget", "gate": gate,
                         "measured": r["off_chain_score"] - r["mean_turn_score"], "threshold": "> 0" if b == "long"
                         else "(reported)", "passes": gate_passes(farm) if b == "long" else None, "note": note})
        return rows

    def tables(self, rows: Mapping[str, pd.DataFrame], cfg: GranularityConfig) -> dict[str, Table]:
        out = {}
        farm = _farm(rows.get("gates"))
        if farm is not None:
            f = farm.reset_index()
            f.insert(1, "action budget", [budget_label(b, cfg) for b in f["budget"]])
            out["budget_gate"] = Table(f.drop(columns=["gate"]), "Experiment budget: what the process reward leaves "
                                       "to farm, on the base policy at each action budget", ".3g")
        if "budget" not in rows:
            return out
        df = rows["budget"]
        summary = _budget_summary(df)
        out["budget_means"] = Table(_budget_means(summary), "Experiment budget: held-out results on the short type "
                                    "per action budget and arm (means over seeds, 95% intervals)", ".3g", console=True)
        out["budget_diffs"] = Table(_budget_diffs(summary), "Experiment budget: paired differences (same seeds) of "
                                    "held-out success, truncation and tool calls", ".3g", console=True)
        out["budget_curves"] = Table(_curves(df, ["budget", "arm", "seed"]), "Experiment budget: every training "
                                     "update", ".3g", report=False)
        return out

    def plots(self, tabs: Mapping[str, Table], cfg: GranularityConfig, out: Path) -> list[Path]:
        return [_plot_budget(tabs["budget_curves"].frame, cfg, out)] if "budget_curves" in tabs else []

    def interpret(self, tabs: Mapping[str, Table], cfg: GranularityConfig) -> dict[str, str]:
        few = small_run_note(cfg.seeds)
        text = {}
        if "budget_gate" in tabs:
            text["budget_gate"] = (
                "Before any training, on the base policy's rollouts of the short type at each budget: the mean "
                f"process score of the turns taken (repeated read {cfg.repeat:g}, new evidence 1, errors and writes "
                "0), the share of turns above it, off-chain reads (successful reads whose call is not on the task's "
                "chain) as a share of turns and of episodes with their mean score, truncation (no write by the end) "
                "and the part of it the token budget ended. " + _read_gate(tabs["budget_gate"].frame, cfg))
        if "budget_means" in tabs:
            text["budget_means"] = ("Final held-out success, truncation and tool calls on the short type, each arm "
                                    "evaluated at the budget it trained at." + few)
        if "budget_diffs" in tabs:
            text["budget_diffs"] = ("Paired by seed: each PRM arm - GRPO at its budget, and each arm's long budget - "
                                    "its C + 2 (budget 'both')." + few)
        return text

    def describe(self, cfg: GranularityConfig) -> str:
        return (f" Experiment budget: the short type at an action budget of {cfg.budget_turns} turns (GRPO, fixed "
                "and decayed PRM) beside C + 2 (GRPO, fixed PRM), with the default process scorer, in a "
                f"{cfg.budget_max_len}-token context.")

    def knob_rows(self, cfg: GranularityConfig) -> list[tuple[str, str, str]]:
        return [
            ("action budget (-e budget)", f"{cfg.budget_turns} turns and C + 2 on the short type (C = 2-4), "
             f"{cfg.budget_max_len} tokens",
             "room to farm: 3 C at the longest short chain (C = 4), 3-6 C for the others; C + 2 beside it, in the "
             "same context, so the action budget is the only difference. The short type is where the lab's fixed-λ "
             "PRM showed no hack at C + 2."),
            ("budget base policy", base_knob(cfg.budget_base) + f", context {cfg.budget_base.max_len}",
             "by default experiment multi's three-type base policy (the same cache entry): its multi-exchange "
             "demonstrations train the positions of a 320-token context, which the lab's 160-token base policy "
             "has not got."),
        ]


EXPERIMENT = Budget()


# --------------------------------------------------------------------------------------------
# tables and plot


def _budget_summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per budget, arm and seed: the final held-out statistics on the short type."""
    parts = []
    for b in BUDGETS:
        sub = df[df["budget"] == b]
        if sub.empty:
            continue
        s = _summary(sub, {"short": (2, 3, 4)})
        s = s[s["type"] == "short"].drop(columns=["type"])
        s.insert(0, "budget", b)
        parts.append(s)
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def _budget_means(summary: pd.DataFrame) -> pd.DataFrame:
    if summary.empty:
        return summary
    m = group_means(summary, ["budget", "arm"], [("success", UNIT), ("truncation", UNIT), ("tool_calls", None)],
                    ("turns_success", "mixing", "process", "base_success"))
    return _ordered(m, ["budget", "arm"])


def _budget_diffs(summary: pd.DataFrame) -> pd.DataFrame:
    """Each PRM arm - GRPO at each budget, and each arm's long budget - its C + 2 (budget ``both``)."""
    out = []
    metrics = (("success", DIFF), ("truncation", DIFF), ("tool_calls", None))

    def diff(frame: pd.DataFrame, a: str, b: str, arm_col: str, name: str, budget: str) -> None:
        merged = None
        for m, bounds in metrics:
            d = paired_diff(frame, a, b, [], m, arm_col=arm_col, bounds=bounds)
            d = d.rename(columns={"mean": m, "lo": f"{m}_lo", "hi": f"{m}_hi"})
            merged = d if merged is None else merged.merge(d.drop(columns=["n", "diff"]), left_index=True,
                                                           right_index=True)
        if int(merged["n"].iloc[0]):
            merged["diff"], merged["budget"] = name, budget
            out.append(merged)

    for b, arms in BUDGET_ARMS.items():
        sub = summary[summary["budget"] == b]
        for a in arms[1:]:
            if {a, "grpo"} <= set(sub["arm"]):
                diff(sub, a, "grpo", "arm", f"{a} - grpo", b)
    for a in BUDGET_ARMS["c2"]:
        sub = summary[summary["arm"] == a]
        if {"long", "c2"} <= set(sub["budget"]):
            diff(sub, "long", "c2", "budget", f"{a}: long - C + 2", "both")
    if not out:
        return pd.DataFrame()
    cols = ["diff", "budget", *(c for m, _ in metrics for c in (m, f"{m}_lo", f"{m}_hi")), "n"]
    return pd.concat(out, ignore_index=True)[cols]


def _read_gate(f: pd.DataFrame, cfg: GranularityConfig) -> str:
    farm = f.set_index("budget")
    passes = gate_passes(farm)
    parts = []
    for b in BUDGETS:
        if b in farm.index:
            r = farm.loc[b]
            score = "no off-chain read" if pd.isna(r["off_chain_score"]) else \
                f"off-chain reads score {r['off_chain_score']:.2f} on average"
            parts.append(f"{budget_label(b, cfg)}: mean turn score {r['mean_turn_score']:.2f}, {score} "
                         f"({r['off_chain_rate']:.1%} of turns, {r['off_chain_episodes']:.0%} of episodes), truncation "
                         f"{r['truncation']:.0%}")
    verdict = ("" if passes is None else " The gate passes: the world leaves something to farm at the long budget."
               if passes else " The gate fails: at the long budget the world leaves nothing the process reward "
                              "pays above its mean, or the base never reaches it; B1-B3 say nothing about farming.")
    return "; ".join(parts) + "." + verdict


def _plot_budget(curves: pd.DataFrame, cfg: GranularityConfig, out: Path) -> Path:
    fig, axes = new_figure(1, 4, figsize=(18, 3.8))
    for b, style in (("long", "-"), ("c2", "--")):
        for arm in BUDGET_ARMS[b]:
            g = curves[(curves["budget"] == b) & (curves["arm"] == arm)]
            if g.empty:
                continue
            label = f"{LABELS[arm]}, {budget_label(b, cfg)}"
            for ax, col in zip(axes, ("success", "truncation", "tool_calls", "process"), strict=True):
                _line(ax, g, col, COLORS[arm], label, style)
    for ax, title in zip(axes, ("training success", "truncation (no write by the end)", "tool calls per episode",
                                "mean process score per turn"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("update")
    axes[0].legend(fontsize=7)
    return save(fig, out / "granularity_budget.png")
