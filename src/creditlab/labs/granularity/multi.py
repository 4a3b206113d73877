"""The ``multi`` experiment of the granularity lab: mixed, graded tasks. GRPO and the fixed- and decayed-weight
PRM train on a mix of short (3/7), long (2/7) and multi-exchange (2/7) tasks (3-4 independent short exchanges in one
prompt, graded outcome: the share solved, budget 2 (C + 2)) from a three-type base policy with a longer
context. Its gate: the multi type's base mixing score is at least :data:`MIXING_GATE`. Its predictions
M1-M3: the multi type mixes good and bad turns most, GRPO gains least there, and the decayed PRM gains
over GRPO there."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from creditlab.errors import ConfigError, InputError
from creditlab.lab.experiment import Prediction, Tables, Verdict, notes
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table
from creditlab.lab.report import ci_columns, paired_diff, small_run_note
from creditlab.lab.runner import Cell
from creditlab.labs._toolshop import base_knob
from creditlab.labs.granularity._common import (
    DIFF,
    EVAL_METRICS,
    GranularityExperiment,
    _curves,
    _means,
    _summary,
    gated_runs,
    setting_of,
)
from creditlab.labs.granularity.config import MULTI_CHAIN_LENGTHS, MULTI_TYPES, GranularityConfig
from creditlab.labs.granularity.world import evaluate_types
from creditlab.train.toolshop_base import base_policy

#: The arms of the experiment.
MULTI_ARMS = ("grpo", "prm_fixed", "prm_decay")
#: The gate: the multi type's base mixing score.
MIXING_GATE = 0.6


@torch.no_grad()
def run_gate_cell(config: dict, gate: str, cache_dir: str) -> list[dict]:
    """The experiment's precondition, on the three-type base policy before any training: the held-out
    mixing score, good-turn share, success and truncation per task type (short, long, multi).
    ``gate`` (``"multi"``) names the precondition among the lab's gate cells."""
    if gate != "multi":
        raise InputError(f"gate: {gate!r} is not 'multi' (experiment multi's gate cell)")
    cfg = GranularityConfig.from_dict(config)
    base_cfg, g, types = setting_of(cfg, "multi")
    model = base_policy(base_cfg, cache_dir=cache_dir)
    ev = evaluate_types(model, cfg, types, g)
    return [{"gate": "mixing", "type": t, **{m: ev.get(f"eval/{m}" if t == "all" else f"eval/{t}/{m}", math.nan)
                                             for m in EVAL_METRICS}} for t in ("all", *types)]


# --------------------------------------------------------------------------------------------
# the predictions


def _mixing(tabs: Tables) -> pd.DataFrame | None:
    """The ``multi_mixing`` table by type, when it has the multi type (None: nothing to judge)."""
    if "multi_mixing" not in tabs:
        return None
    mm = tabs["multi_mixing"].frame.set_index("type")
    return mm if "multi" in mm.index else None


def m1_measured(tabs: Tables) -> str | None:
    mm = _mixing(tabs)
    return None if mm is None else "; ".join(f"{t} {m:.2f}" for t, m in mm["base mixing"].items())


def m1_verdict(tabs: Tables) -> Verdict:
    """M1 holds when the multi type's base mixing is at least the gate and above every other type's."""
    mm = _mixing(tabs)
    if mm is None:
        return Verdict.NOT_JUDGED
    mix = mm["base mixing"]
    if "multi" not in mix or pd.isna(mix["multi"]):
        return Verdict.NOT_JUDGED  # the multi type's base mixing was not measured
    return Verdict.of(bool(mix["multi"] >= MIXING_GATE) and bool(mix["multi"] > mix.drop("multi").max()))


def m2_measured(tabs: Tables) -> str | None:
    mm = _mixing(tabs)
    if mm is None:
        return None
    gain = mm["grpo gain / headroom"]
    return "; ".join(f"{t} {mm.loc[t, 'grpo gain']:+.2f} ({gain[t]:.2f} of headroom)" for t in mm.index)


def m2_verdict(tabs: Tables) -> Verdict:
    """M2 holds when GRPO's gain over its headroom is smallest on the type of the highest base mixing."""
    mm = _mixing(tabs)
    if mm is None or mm["grpo gain / headroom"].isna().all() or mm["base mixing"].isna().all():
        return Verdict.NOT_JUDGED  # nothing measured to compare (pandas' idxmin of all-NA raises)
    return Verdict.of(bool(mm["grpo gain / headroom"].idxmin() == mm["base mixing"].idxmax()))


def _decay_gains(tabs: Tables) -> pd.DataFrame | None:
    """The ``multi_mixing`` table by type, when it has the decayed PRM's paired gain over GRPO."""
    mm = _mixing(tabs)
    return mm if mm is not None and "prm_decay - grpo" in mm else None


def m3_measured(tabs: Tables) -> str | None:
    mm = _decay_gains(tabs)
    if mm is None:
        return None
    return "; ".join(f"{t} {mm.loc[t, 'prm_decay - grpo']:+.3f} [{mm.loc[t, 'prm_decay - grpo lo']:+.3f}, "
                     f"{mm.loc[t, 'prm_decay - grpo hi']:+.3f}]" for t in mm.index)


def m3_verdict(tabs: Tables) -> Verdict:
    """M3 holds when the 95% interval of the decayed PRM's gain over GRPO on the most mixed type is above 0,
    fails when it is at or below 0 or its mean is, and is not judged (not resolved) when the interval spans 0."""
    mm = _decay_gains(tabs)
    if mm is None or mm["base mixing"].isna().all():
        return Verdict.NOT_JUDGED
    d = mm.loc[mm["base mixing"].idxmax()]
    if d["prm_decay - grpo lo"] > 0:
        return Verdict.HOLDS
    if d["prm_decay - grpo hi"] <= 0 or d["prm_decay - grpo"] <= 0:
        return Verdict.FAILS
    return Verdict.NOT_JUDGED


PREDICTIONS = (
    Prediction("M1: the multi type's base mixing score is >= 0.6, above short and long", measured=m1_measured,
               verdict=m1_verdict,
               stated="M1: the multi type mixes good and bad turns more than the short and long types; its base "
                      "mixing score is >= 0.6 (the gate). Falsified if the multi type's base mixing is below 0.6, "
                      "or not above both other types'."),
    Prediction("M2: GRPO's gain (over its headroom) is smallest on the most mixed type", measured=m2_measured,
               verdict=m2_verdict,
               stated="M2: mixing predicts where GRPO is weak: GRPO's gain, as a share of the headroom (1 - base "
                      "success), is smallest on the most mixed type. Falsified if another type has a smaller "
                      "headroom-normalised GRPO gain."),
    Prediction("M3: the decayed PRM gains over GRPO on the most mixed type (interval above 0)", measured=m3_measured,
               verdict=m3_verdict, note=notes(not_judged="not resolved: the interval spans 0"),
               stated="M3: the decayed PRM gains over GRPO on the most mixed type (paired, same seeds). Falsified "
                      "if its mean paired gain over GRPO on that type is <= 0 (an interval spanning 0 with a "
                      "positive mean is reported as not resolved)."),
)


# --------------------------------------------------------------------------------------------
# the experiment


class Multi(GranularityExperiment):
    """Mixed, graded tasks: GRPO and both PRM weights on short, long and multi-exchange tasks (module docstring)."""

    name = "multi"
    groups = ("gates", "multi")
    fields = ("multi_base", "multi_max_len")
    predictions = PREDICTIONS
    gate_reading = f"the held-out turn mixing score per type (the gate is the multi type's, >= {MIXING_GATE:g})."
    gate_knob = f"multi base mixing >= {MIXING_GATE:g}"

    def validate(self, cfg: GranularityConfig) -> None:
        if tuple(cfg.multi_base.chain_lengths) != MULTI_CHAIN_LENGTHS:
            raise ConfigError("multi_base.chain_lengths", f"must be {MULTI_CHAIN_LENGTHS} (the three-type mix)")
        if cfg.multi_max_len > cfg.multi_base.max_len:
            raise ConfigError("multi_max_len", f"{cfg.multi_max_len} exceeds the model's {cfg.multi_base.max_len}")

    def cells(self, cfg: GranularityConfig) -> list[Cell]:
        return gated_runs(cfg, self.name, run_gate_cell, MULTI_ARMS)

    def gate_rows(self, gates: pd.DataFrame, cfg: GranularityConfig) -> list[dict]:
        rows = []
        if gates["gate"].eq("mixing").any():
            mix = gates[gates["gate"] == "mixing"].set_index("type")
            for t in MULTI_TYPES:
                if t in mix.index:
                    v = float(mix.loc[t, "mixing"])
                    rows.append({"experiment": "multi", "gate": f"base mixing score, {t}", "measured": v,
                                 "threshold": f">= {MIXING_GATE:g}" if t == "multi" else "(reported)",
                                 "passes": (v >= MIXING_GATE) if t == "multi" else None,
                                 "note": f"good turns {mix.loc[t, 'good_share']:.0%}, success "
                                         f"{mix.loc[t, 'success']:.2f}, truncation {mix.loc[t, 'truncation']:.0%}, "
                                         f"{mix.loc[t, 'tool_calls']:.1f} calls"})
        return rows

    def tables(self, rows: Mapping[str, pd.DataFrame], cfg: GranularityConfig) -> dict[str, Table]:
        if "multi" not in rows:
            return {}
        df = rows["multi"]
        summary = _summary(df, MULTI_TYPES)
        return {
            "multi_means": Table(_means(summary), "Experiment multi: held-out results per arm and task type "
                                                  "(three-type base policy; means over seeds, 95% intervals)", ".3g"),
            "multi_mixing": Table(_multi_mixing(summary, rows.get("gates")), "Experiment multi: each type's base "
                                  "mixing score against GRPO's gain and each PRM arm's gain over GRPO", ".3g",
                                  console=True),
            "multi_curves": Table(_curves(df, ["arm", "seed"]), "Experiment multi: every training update", ".3g",
                                  report=False)}

    def plots(self, tabs: Mapping[str, Table], cfg: GranularityConfig, out: Path) -> list[Path]:
        return [_plot_multi(tabs["multi_mixing"].frame, out)] if "multi_mixing" in tabs else []

    def interpret(self, tabs: Mapping[str, Table], cfg: GranularityConfig) -> dict[str, str]:
        few = small_run_note(cfg.seeds)
        text = {}
        if "multi_mixing" in tabs:
            text["multi_mixing"] = ("Per task type: the three-type base policy's mixing score (gate table), its "
                                    "success, GRPO's final success and gain (95% interval over seeds), the gain as a "
                                    "share of the headroom 1 - base success, each PRM arm's paired gain over "
                                    "GRPO. The multi type's success is the share of its sub-tasks solved." + few)
        if "multi_means" in tabs:
            text["multi_means"] = ("GRPO and the fixed- and decayed-weight PRM trained on the three-type mix from "
                                   "the three-type base policy: final held-out success per type (the multi type's is "
                                   "the share of sub-tasks solved), its gain over the base policy, truncation and "
                                   "tool calls." + few)
        return text

    def describe(self, cfg: GranularityConfig) -> str:
        return (" Experiment multi: GRPO and the fixed- and decayed-weight PRM on a mix of short, long and "
                "multi-exchange tasks (3-4 independent exchanges in one prompt, graded outcome: the share solved, "
                "budget 2 (C + 2)) from a base policy with a 320-token context.")

    def knob_rows(self, cfg: GranularityConfig) -> list[tuple[str, str, str]]:
        return [
            ("multi-exchange arms", ", ".join(MULTI_ARMS), "GRPO, and the process reward at both weights: the "
             "fixed weight is the one a long, graded task gives room to farm."),
            ("multi-exchange type (-e multi)", f"3-4 exchanges of C = {', '.join(map(str, (2, 3, 4)))} per episode, "
             f"budget 2 (C + 2), graded outcome; mix short 3/7, long 2/7, multi 2/7; {cfg.multi_max_len} tokens",
             "the paper's weak case: a long task with a graded, additive outcome over many turns, where a "
             "successful episode can hold as many bad turns as good ones. Sub-tasks are the short type's chains "
             "(existing tokens)."),
            ("three-type base policy", base_knob(cfg.multi_base) + f", context {cfg.multi_base.max_len}",
             "fewer steps and smaller batches than the lab's base policy: its sequences are about twice as long, "
             "and a full build took over an hour on the shared 2-core machine; not tuned on any result."),
        ]


EXPERIMENT = Multi()


# --------------------------------------------------------------------------------------------
# tables and plot


def _multi_mixing(summary: pd.DataFrame, gates: pd.DataFrame | None) -> pd.DataFrame:
    rows = []
    for t in MULTI_TYPES:
        s = summary[summary["type"] == t]
        if s.empty:
            continue
        g = s[s["arm"] == "grpo"]
        row = {"type": t, "base mixing": math.nan}
        if gates is not None and gates["gate"].eq("mixing").any():
            mix = gates[(gates["gate"] == "mixing") & (gates["type"] == t)]
            row["base mixing"] = float(mix["mixing"].iloc[0]) if len(mix) else math.nan
        row["base success"] = float(s["base_success"].mean())
        for arm in MULTI_ARMS:
            a = s[s["arm"] == arm]
            row[f"{arm} success"] = float(a["success"].mean()) if len(a) else math.nan
        row.update({f"grpo gain{k}": v for k, v in ci_of(g["gain"]).items()})
        row["grpo gain / headroom"] = row["grpo gain"] / max(1.0 - row["base success"], 1e-9)
        for arm in MULTI_ARMS[1:]:
            if {"grpo", arm} <= set(s["arm"]):
                d = paired_diff(summary, arm, "grpo", ["type"], "success", bounds=DIFF)
                d = d[d["type"] == t].iloc[0]
                row.update({f"{arm} - grpo": d["mean"], f"{arm} - grpo lo": d["lo"], f"{arm} - grpo hi": d["hi"],
                            "pairs": int(d["n"])})
        for arm in MULTI_ARMS:
            a = s[s["arm"] == arm]
            row[f"{arm} truncation"] = float(a["truncation"].mean()) if len(a) else math.nan
        row["grpo final mixing"] = float(g["mixing"].mean()) if len(g) else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def ci_of(x: pd.Series) -> dict[str, float]:
    """Mean and 95% interval of ``x`` as ``{"": mean, " lo": lo, " hi": hi}`` (the lab's intervals)."""
    c = ci_columns(x, "v", DIFF)
    return {"": c["v"], " lo": c["v_lo"], " hi": c["v_hi"]}


def _plot_multi(mm: pd.DataFrame, out: Path) -> Path:
    fig, axes = new_figure(1, 2, figsize=(11, 3.8))
    x = np.arange(len(mm))
    axes[0].bar(x, mm["base mixing"], color="tab:gray")
    axes[0].axhline(MIXING_GATE, color="tab:red", ls="--", lw=0.8)
    axes[0].set_xticks(x, mm["type"])
    axes[0].set_ylim(0, 1)
    axes[0].set_title("base policy: turn mixing score (gate 0.6 on multi)")
    w = 0.27
    err = np.vstack([(mm["grpo gain"] - mm["grpo gain lo"]).clip(lower=0),
                     (mm["grpo gain hi"] - mm["grpo gain"]).clip(lower=0)])
    axes[1].bar(x - w, mm["grpo gain"], w, yerr=err, color="black", capsize=2, label="GRPO gain over the base")
    for off, arm, color, label in ((0.0, "prm_fixed", "tab:red", "PRM fixed λ - GRPO (paired)"),
                                   (w, "prm_decay", "tab:green", "PRM decayed λ - GRPO (paired)")):
        c = f"{arm} - grpo"
        if c in mm:
            err = np.vstack([(mm[c] - mm[f"{c} lo"]).clip(lower=0), (mm[f"{c} hi"] - mm[c]).clip(lower=0)])
            axes[1].bar(x + off, mm[c], w, yerr=err, color=color, capsize=2, label=label)
    axes[1].axhline(0, color="gray", lw=0.8)
    axes[1].set_xticks(x, [f"{t}\n(mixing {m:.2f})" for t, m in zip(mm["type"], mm["base mixing"], strict=True)])
    axes[1].set_title("final held-out success: gains (95% interval over seeds)")
    axes[1].legend(fontsize=8)
    return save(fig, out / "granularity_multi.png")
