"""The arms: outcome GRPO, GRPO + the process reward with a fixed or a decayed weight, and on-policy
self-distillation from a reference-answer or a turn-advice teacher, each an experiment of its own
(``-e grpo``, ``-e prm_fixed``...), trained from the lab's base policy on the same tasks and seeds for
the same number of updates: one cell per (arm, seed), and for the OPSD arms one cell of what the
teachers know before training (both make it; it runs once). The arms' tables compare every arm a run
selects: the first of them (in the order of :data:`~creditlab.labs.granularity.config.ARMS`) makes
them, their plots and their readings."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table
from creditlab.lab.report import read_diff, small_run_note
from creditlab.lab.runner import Cell
from creditlab.labs.granularity._common import (
    COLORS,
    CURVE_COLUMNS,
    LABELS,
    GranularityExperiment,
    _diffs,
    _line,
    _means,
    _opsd,
    _ordered,
    _plot_opsd,
    _read_teachers,
    _summary,
    dump_name,
    run_arm,
)
from creditlab.labs.granularity.config import ARMS, TASK_TYPES, GranularityConfig
from creditlab.labs.granularity.world import teacher_rows
from creditlab.train.toolshop_base import base_policy

DIAGNOSE_CHECKS = ("reward.process_hacking", "credit.mixing")
"""The checks of ``creditlab diagnose`` the ``diagnose`` table runs on each arm's dump (with ``--dump``)."""


@torch.no_grad()
def run_teacher_cell(config: dict, cache_dir: str) -> list[dict]:
    """What the privileged teachers know on the lab's base policy, before any training
    (:func:`~creditlab.labs.granularity.world.teacher_rows`)."""
    cfg = GranularityConfig.from_dict(config)
    return teacher_rows(cfg, base_policy(cfg.base, cache_dir=cache_dir))


class Arm(GranularityExperiment):
    """One arm: its training runs, one cell per seed (module docstring). It owns no config field: the
    lab's training, process reward and OPSD settings are every arm's and the regime experiments' too."""

    def __init__(self, arm: str) -> None:
        self.name = arm
        self.groups = ("train", "teachers") if ARMS[arm][0] == "opsd" else ("train",)

    def makes_tables(self, cfg: GranularityConfig) -> bool:
        """Whether this arm makes the arms' tables, plots and readings: it is the first arm ``cfg`` selects."""
        return self.name == next((a for a in ARMS if a in cfg.experiments), None)

    def cells(self, cfg: GranularityConfig) -> list[Cell]:
        ident = cfg.identity()
        cells = [Cell("train", f"{self.name}/seed={s}", run_arm, {"config": ident, "arm": self.name, "seed": s},
                      cfg.context(dump=True)) for s in range(cfg.seeds)]
        if ARMS[self.name][0] == "opsd":
            cells.append(Cell("teachers", "base", run_teacher_cell, {"config": ident}, cfg.context()))
        return cells

    def tables(self, rows: Mapping[str, pd.DataFrame], cfg: GranularityConfig) -> dict[str, Table]:
        if not self.makes_tables(cfg) or "train" not in rows:
            return {}
        return _arm_tables(rows, cfg)

    def plots(self, tabs: Mapping[str, Table], cfg: GranularityConfig, out: Path) -> list[Path]:
        if not self.makes_tables(cfg) or "curves" not in tabs:
            return []
        curves = tabs["curves"].frame
        made = [_plot_hacking(curves, cfg, out), _plot_behaviour(curves, cfg, out),
                _plot_final(tabs["means"].frame, out)]
        if "opsd" in tabs:
            made.append(_plot_opsd(curves, cfg, out))
        return made

    def interpret(self, tabs: Mapping[str, Table], cfg: GranularityConfig) -> dict[str, str]:
        if not self.makes_tables(cfg) or "means" not in tabs:
            return {}
        return _interpret(tabs, cfg)


#: The arms, one experiment each, in the order of :data:`ARMS`.
EXPERIMENTS = tuple(Arm(a) for a in ARMS)


# --------------------------------------------------------------------------------------------
# tables


def _arm_tables(rows: Mapping[str, pd.DataFrame], cfg: GranularityConfig) -> dict[str, Table]:
    """The arms' tables, over every arm ``cfg`` selects."""
    df = rows["train"]
    df = df[df["arm"].isin(cfg.experiments)]
    U = cfg.grpo.updates
    summary = _summary(df)
    tabs = {"means": Table(_means(summary), "Held-out results per arm and task type (means over seeds, 95% "
                                            "intervals)", ".3g", console=True),
            "summary": Table(summary, "Held-out results per arm, seed and task type (final evaluation)", ".3g")}
    d = _diffs(summary)
    if len(d):
        tabs["diff_vs_grpo"] = Table(d, "Paired differences against GRPO (same seeds, same held-out tasks)", ".3g")
    tabs["phases"] = Table(_phases(df, U), "Training rollouts: first and last fifth of the updates", ".3g")
    if df["arm"].isin(["opsd_ref", "opsd_advice"]).any():
        tabs["opsd"] = Table(_opsd(df, U), "Self-distillation: KL, gradients, clipping, KL concentration", ".3g")
    if "teachers" in rows:
        tabs["teachers"] = Table(rows["teachers"].drop(columns=["cell_key"], errors="ignore"),
                                 "What the privileged teachers know (base policy, before training)", ".3g")
    tabs["mixing"] = Table(_mixing_table(df), "Turn mixing score by task type (held-out rollouts)", ".3g")
    if cfg.arms():
        tabs["diagnose"] = _diagnose_table(cfg)
    cols = ["arm", "seed", "update"] + [c for c in CURVE_COLUMNS if c in df.columns]
    curves = df[df["kind"] == "train"][cols].sort_values(["arm", "seed", "update"]).reset_index(drop=True)
    tabs["curves"] = Table(curves, "Every training update of every run", ".3g", report=False)
    ev_cols = ["arm", "seed", "update"] + [c for c in df.columns if c.startswith("eval/")]
    tabs["eval_curves"] = Table(df[df["kind"] == "eval"][ev_cols].sort_values(["arm", "seed", "update"])
                                .reset_index(drop=True), "Every held-out evaluation", ".3g", report=False)
    return tabs


def _phases(df: pd.DataFrame, U: int) -> pd.DataFrame:
    """Training statistics per arm in the first and last fifth of the updates (means over seeds)."""
    tr = df[df["kind"] == "train"]
    rows = []
    cols = ["success", "process", "truncation", "tool_calls", "response_tokens", "grad_norm"]
    for arm, g in tr.groupby("arm", sort=False):
        early, late = g[g["update"] < U / 5], g[g["update"] >= U - U / 5]
        row = {"arm": arm}
        for c in cols:
            if c in g.columns:
                row[f"{c}_early"] = float(early[c].mean())
                row[f"{c}_late"] = float(late[c].mean())
        rows.append(row)
    return _ordered(pd.DataFrame(rows), ["arm"])


def _mixing_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per task type: the base policy's held-out mixing score and good-turn share (update 0), and each
    arm's at the end with its success gain."""
    ev = df[df["kind"] == "eval"]
    rows = []
    for t in TASK_TYPES:
        pre = f"eval/{t}/"
        base = ev[ev["update"] == ev["update"].min()]
        row = {"type": t, "chain lengths": ", ".join(map(str, TASK_TYPES[t])),
               "base mixing": float(base[pre + "mixing"].mean()),
               "base good share": float(base[pre + "good_share"].mean()),
               "base success": float(base[pre + "success"].mean())}
        last = ev[ev["update"] == ev["update"].max()]
        for arm, g in last.groupby("arm", sort=False):
            row[f"{arm} mixing"] = float(g[pre + "mixing"].mean())
            row[f"{arm} gain"] = float(g[pre + "success"].mean()) - float(
                base[base["arm"] == arm][pre + "success"].mean())
        rows.append(row)
    return pd.DataFrame(rows)


def _diagnose_table(cfg: GranularityConfig) -> Table:
    """``creditlab diagnose`` on each arm run's training dump (``--dump``). Dumps are written only when a cell
    is computed and are not kept with the store, so when a run of this render has none the table is marked
    ``carry``: the table of the render that had them is kept as it was (a render never removes or changes a
    result it cannot recompute); with no earlier one, the rows this render can give are written, a missing
    dump as a ``skipped`` row."""
    from creditlab.diagnose.checks import run_checks
    from creditlab.diagnose.readers import read_dump

    rows, lacking = [], []
    where = Path(cfg.dump_dir) if cfg.dump_dir else None
    for arm in cfg.arms():
        for seed in range(cfg.seeds):
            path = where / dump_name(arm, seed) if where is not None else None
            if path is None or not path.exists():
                lacking.append(dump_name(arm, seed))
                if path is not None:
                    rows.append({"arm": arm, "seed": seed, "check": "(all)", "status": "skipped", "value": math.nan,
                                 "message": f"no dump at {path}: this run did not compute that cell (a stored cell "
                                            "was reused); rerun with --fresh to dump it"})
                continue
            for r in run_checks(read_dump([path]), only=DIAGNOSE_CHECKS):
                rows.append({"arm": arm, "seed": seed, "check": r.id, "status": r.status,
                             "value": math.nan if r.value is None else float(r.value), "message": r.message})
    why = "" if not lacking else (
        "it runs creditlab diagnose on each run's training dump (--dump), which a cell writes only when it is "
        "computed, and dumps are not kept with a run's store; "
        + ("this render has no --dump" if where is None else
           f"{len(lacking)} of the {len(cfg.arms()) * cfg.seeds} runs of this render have no dump in {where} "
           f"(e.g. {lacking[0]}): their cells were read back from the store"))
    cols = ["arm", "seed", "check", "status", "value", "message"]
    return Table(pd.DataFrame(rows, columns=cols), "creditlab diagnose on each run's training rollouts", carry=why)


# --------------------------------------------------------------------------------------------
# readings


def _interpret(tabs: Mapping[str, Table], cfg: GranularityConfig) -> dict[str, str]:
    """The readings of the arms' tables."""
    few = small_run_note(cfg.seeds)
    text: dict[str, str] = {}
    m = tabs["means"].frame
    text["means"] = _read_means(m) + few
    text["summary"] = ("One row per run and task type at the final evaluation: success, truncation (share of "
                       "episodes that ended by the action budget without a write), tool calls per episode, "
                       "turns_success (mean turns of the successful episodes), mixing (turn mixing score), "
                       "good_share (share of good turns), process (mean evidence score per turn), "
                       "response_tokens (policy tokens per episode); base_success is the same run's evaluation "
                       "at update 0 (the base policy) and gain = success - base_success." + few)
    if "diff_vs_grpo" in tabs:
        d = tabs["diff_vs_grpo"].frame
        parts = []
        for metric in ("success", "truncation"):
            sub = d.rename(columns={metric: "mean", f"{metric}_lo": "lo", f"{metric}_hi": "hi"})
            for what, g in sub.groupby("diff", sort=False):
                parts.append(f"[{metric}] " + read_diff(g[["type", "mean", "lo", "hi", "n"]], ["type"], what))
        text["diff_vs_grpo"] = ("Paired differences (arm - GRPO, same seeds, same held-out tasks) of final "
                                "success and truncation by task type. " + " ".join(parts))
    text["phases"] = _read_phases(tabs["phases"].frame)
    if "opsd" in tabs:
        text["opsd"] = _read_opsd(tabs["opsd"].frame)
    text["mixing"] = _read_mixing(tabs["mixing"].frame)
    if "teachers" in tabs:
        text["teachers"] = _read_teachers(tabs["teachers"].frame)
    if "diagnose" in tabs:
        text["diagnose"] = _read_diagnose(tabs["diagnose"].frame)
    return text

def _read_diagnose(d: pd.DataFrame) -> str:
    hack = d[d["check"] == "reward.process_hacking"]
    parts = [f"{LABELS.get(a, a)}: " + ", ".join(f"seed {int(r.seed)} {r.status}" for r in g.itertuples())
             for a, g in hack.groupby("arm", sort=False)]
    return ("`creditlab diagnose` run on each training run's rollouts (written with --dump); its process-hacking and "
            "mixing checks (the dumps hold no execution mismatch: every arm samples and learns in fp32). "
            "reward.process_hacking: " + "; ".join(parts) + ". The dumps' process_reward is each trajectory's mean "
            "evidence score; OPSD arms are dumped with the same scorer although they do not train on it. "
            "credit.mixing judges a turn good when its process score is above 0.5, not by the lab's turn judge.")


def _read_means(m: pd.DataFrame) -> str:
    parts = []
    for t in ("short", "long"):
        g = m[m["type"] == t].set_index("arm")
        if g.empty:
            continue
        parts.append(f"{t}: " + ", ".join(f"{LABELS[a]} {r.success:.2f} (truncation {r.truncation:.0%}, "
                                          f"{r.tool_calls:.1f} calls)" for a, r in g.iterrows()))
    return "Final held-out success by task type (95% intervals in the table). " + "; ".join(parts) + "."


def _read_phases(p: pd.DataFrame) -> str:
    parts = []
    for _, r in p.iterrows():
        parts.append(f"{LABELS[r['arm']]}: success {r['success_early']:.2f} -> {r['success_late']:.2f}, process "
                     f"{r['process_early']:.2f} -> {r['process_late']:.2f}, truncation {r['truncation_early']:.0%} -> "
                     f"{r['truncation_late']:.0%}, tool calls {r['tool_calls_early']:.1f} -> "
                     f"{r['tool_calls_late']:.1f}")
    return ("On the training rollouts, first fifth of the updates -> last fifth (means over seeds). A process reward "
            "that rises while the outcome falls, with truncation and tool calls climbing, is the signature of "
            "a hacked process reward. " + "; ".join(parts) + ".")


def _read_opsd(o: pd.DataFrame) -> str:
    o = o.set_index("arm")
    parts = []
    for a in ("opsd_ref", "opsd_advice"):
        if a in o.index:
            r = o.loc[a]
            parts.append(f"{LABELS[a]}: reverse KL {r.reverse_kl:.3g} per token, grad norm {r.grad_norm:.3g}, "
                         f"{r.clipped_updates:.1f} of {int(r.updates)} updates clipped, response tokens "
                         f"{r.response_tokens_early:.1f} -> {r.response_tokens_late:.1f}, top 5% of turns carry "
                         f"{r.kl_top5_share:.0%} of the KL in {r.kl_top5_token_share:.0%} of the tokens")
    ratio = ""
    if {"opsd_ref", "opsd_advice"} <= set(o.index) and o.loc["opsd_ref", "reverse_kl"] > 0:
        kl = o.loc["opsd_advice", "reverse_kl"] / o.loc["opsd_ref", "reverse_kl"]
        ratio = f" The advice teacher's KL is {kl:.1f}x the reference teacher's"
        if "grpo" in o.index and o.loc["grpo", "grad_norm"] > 0:
            gn = o.loc["opsd_advice", "grad_norm"] / o.loc["grpo", "grad_norm"]
            ratio += f", its gradient norm {gn:.1f}x GRPO's."
        else:
            ratio += "."
    return ("Self-distillation, means over updates and seeds (clipped: updates with at least one optimizer step "
            "whose gradient norm exceeded the clip, mean over seeds). " + "; ".join(parts) + "." + ratio)


def _read_mixing(m: pd.DataFrame) -> str:
    parts = [f"{r['type']} (C = {r['chain lengths']}): base mixing {r['base mixing']:.2f}, good turns "
             f"{r['base good share']:.0%}" + (f", GRPO gain {r['grpo gain']:+.2f}" if "grpo gain" in r else "")
             for _, r in m.iterrows()]
    return ("Rule: a turn is good when it is a call of the task's correct episode (same tool, same arguments) made "
            "for the first time in the episode, bad otherwise; mixing = 2 min(good, bad) / (good + bad) per "
            "held-out rollout, averaged. " + "; ".join(parts) + ".")


# --------------------------------------------------------------------------------------------
# plots


def _plot_hacking(curves: pd.DataFrame, cfg: GranularityConfig, out: Path) -> Path:
    arms = [a for a in ("grpo", "prm_fixed", "prm_decay") if a in set(curves["arm"])] or list(dict.fromkeys(
        curves["arm"]))
    fig, axes = new_figure(1, len(arms), figsize=(4.6 * len(arms), 3.8), squeeze=False, sharey=True)
    for ax, arm in zip(axes[0], arms, strict=True):
        g = curves[curves["arm"] == arm]
        _line(ax, g, "success", "black", "outcome (success)")
        _line(ax, g, "process", "tab:orange", "process (evidence / turn)")
        if "lam" in g.columns and g["lam"].notna().any():
            _line(ax, g, "lam", "tab:gray", "λ", ":")
        ax.set_title(f"{LABELS[arm]}: training rollouts")
        ax.set_xlabel("update")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8, loc="lower left")
    axes[0][0].set_ylabel("mean over seeds (band: min-max)")
    return save(fig, out / "granularity_rewards.png")


def _plot_behaviour(curves: pd.DataFrame, cfg: GranularityConfig, out: Path) -> Path:
    fig, axes = new_figure(1, 3, figsize=(14, 3.8))
    for arm in [a for a in ARMS if a in set(curves["arm"])]:
        g = curves[curves["arm"] == arm]
        for ax, col in zip(axes, ("truncation", "tool_calls", "response_tokens"), strict=True):
            _line(ax, g, col, COLORS[arm], LABELS[arm])
    for ax, title in zip(axes, ("truncation rate", "tool calls per episode", "policy tokens per episode"),
                         strict=True):
        ax.set_title(f"training rollouts: {title}")
        ax.set_xlabel("update")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=8, loc="center right")
    return save(fig, out / "granularity_behaviour.png")


def _plot_final(means: pd.DataFrame, out: Path) -> Path:
    types = [t for t in TASK_TYPES if t in set(means["type"])]
    arms = [a for a in ARMS if a in set(means["arm"])]
    fig, axes = new_figure(1, 2, figsize=(11, 3.8))
    x = np.arange(len(types))
    w = 0.8 / max(len(arms), 1)
    for i, arm in enumerate(arms):
        g = means[means["arm"] == arm].set_index("type").reindex(types)
        xs = x - 0.4 + w * (i + 0.5)
        for ax, m in ((axes[0], "success"), (axes[1], "truncation")):
            err = np.vstack([(g[m] - g[f"{m}_lo"]).fillna(0).clip(lower=0),
                             (g[f"{m}_hi"] - g[m]).fillna(0).clip(lower=0)])
            ax.bar(xs, g[m], w, yerr=err, color=COLORS[arm], label=LABELS[arm], capsize=2)
    for ax, title in ((axes[0], "final held-out success"), (axes[1], "final held-out truncation")):
        ax.set_xticks(x, types)
        ax.set_ylim(0, 1)
        ax.set_title(f"{title} (mean, 95% interval over seeds)")
    axes[0].legend(fontsize=8)
    return save(fig, out / "granularity_final.png")
