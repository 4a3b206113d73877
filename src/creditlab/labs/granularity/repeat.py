"""The ``repeat`` experiment of the granularity lab: when is a process reward gamed? The fixed and the
decayed PRM arms at each ``--repeats`` value (the process score of a read that returns nothing new); a run
is hacked when ``creditlab diagnose``'s ``reward.process_hacking`` check fails on that run's own dump.
Measured first (its gate cell): the lab's base policy's mean turn score at each repeat value, the
threshold its predictions are stated against: R1, the fixed weight is hacked exactly when the repeat
is above that score; R2, the decayed weight is hacked at no repeat."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import pandas as pd
import torch

from creditlab.errors import InputError
from creditlab.lab.experiment import Prediction, Tables, Verdict
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table
from creditlab.lab.report import small_run_note
from creditlab.lab.runner import Cell
from creditlab.labs.granularity._common import (
    COLORS,
    LABELS,
    GranularityExperiment,
    _curves,
    _ordered,
    run_arm,
    run_config,
    setting_of,
)
from creditlab.labs.granularity.config import GranularityConfig, parse_repeats
from creditlab.labs.granularity.world import GATE_SEED_OFFSET, process_scores
from creditlab.train.common import generator
from creditlab.train.toolshop_base import base_policy
from creditlab.train.toolshop_rollout import make_tasks, rollout

#: The arms of the sweep.
SWEEP_ARMS = ("prm_fixed", "prm_decay")


@torch.no_grad()
def run_gate_cell(config: dict, gate: str, cache_dir: str) -> list[dict]:
    """The experiment's precondition: the mean turn score of the lab's base policy (the mean process
    score over every turn of its rollouts on the training mix) at each swept ``repeat``, the threshold
    the sweep's prediction is stated against. ``gate`` (``"repeat"``) names the precondition among the
    lab's gate cells."""
    if gate != "repeat":
        raise InputError(f"gate: {gate!r} is not 'repeat' (experiment repeat's gate cell)")
    cfg = GranularityConfig.from_dict(config)
    base_cfg, g, _ = setting_of(cfg, "sweep")
    model = base_policy(base_cfg, cache_dir=cache_dir)
    tasks = make_tasks(range(GATE_SEED_OFFSET, GATE_SEED_OFFSET + 4 * cfg.eval_per_type), g.chain_lengths)
    batch = rollout(model, tasks, precision="fp32", max_len=g.max_len, max_turns=g.max_turns,
                    max_action_len=g.max_action_len, temperature=g.temperature,
                    generator=generator("granularity/teacher"))  # the precondition cells' stream
    taken = torch.arange(max(batch.n_turns_max, 1))[None, :] < batch.n_calls[:, None]
    rows = []
    for r in parse_repeats(cfg.repeats):
        proc = process_scores(batch, r)[taken]
        rows.append({"gate": "turn_score", "repeat": r, "mean_turn_score": float(proc.mean()),
                     "share_new_reads": float((proc == 1.0).double().mean()) if r < 1 else math.nan,
                     "share_repeats": float((proc == r).double().mean()) if 0 < r < 1 else math.nan,
                     "turns": int(taken.sum()), "rollouts": len(batch)})
    return rows


def _turn_scores(gates: pd.DataFrame | None) -> dict[float, float]:
    """repeat -> the base policy's mean turn score at that repeat (the gate rows)."""
    if gates is None or "gate" not in gates or not gates["gate"].eq("turn_score").any():
        return {}
    g = gates[gates["gate"] == "turn_score"]
    return {float(r): float(m) for r, m in zip(g["repeat"], g["mean_turn_score"], strict=True)}


# --------------------------------------------------------------------------------------------
# the predictions


def _fixed(tabs: Tables) -> pd.DataFrame | None:
    """The fixed-weight rows of the ``sweep`` table, when each has its mean turn score (None: nothing to judge)."""
    if "sweep" not in tabs:
        return None
    sw = tabs["sweep"].frame
    fx = sw[sw["arm"] == "prm_fixed"]
    return fx if len(fx) and fx["mean turn score"].notna().all() else None


def r1_measured(tabs: Tables) -> str | None:
    fx = _fixed(tabs)
    if fx is None:
        return None
    return "; ".join(f"repeat {r['repeat']:g}: {r['hacked runs']}/{r['runs']} hacked (turn score "
                     f"{r['mean turn score']:.3f})" for _, r in fx.iterrows())


def r1_verdict(tabs: Tables) -> Verdict:
    """R1 fails when a run is hacked at a repeat at least 0.25 below the mean turn score, or no run is
    hacked at any repeat above it; it holds otherwise, and is not judged when no repeat is above the
    mean turn score and no run is hacked that far below it."""
    fx = _fixed(tabs)
    if fx is None:
        return Verdict.NOT_JUDGED
    hacked = fx[fx["hacked runs"] > 0]
    early = hacked[hacked["repeat"] <= hacked["mean turn score"] - 0.25]
    above = fx[fx["repeat"] > fx["mean turn score"]]
    if not len(above) and not len(early):
        return Verdict.NOT_JUDGED
    return Verdict.of(not (len(early) > 0 or (len(above) > 0 and not (above["hacked runs"] > 0).any())))


def r1_exactly(tabs: Tables) -> bool:
    """Whether R1 holds exactly: every hacked run's repeat is above the mean turn score and a run is
    hacked at every repeat above it (R1 can hold by its falsification rule without that)."""
    fx = _fixed(tabs)
    if fx is None:
        return False
    hacked = fx[fx["hacked runs"] > 0]
    above = fx[fx["repeat"] > fx["mean turn score"]]
    return bool((hacked["repeat"] > hacked["mean turn score"]).all() and len(above)
                and (above["hacked runs"] > 0).all())


def _r1_note(verdict: Verdict, tabs: Tables) -> str:
    """R1's verdict qualified: held by its falsification rule but not exactly, or untestable."""
    if verdict is Verdict.HOLDS:
        return "" if r1_exactly(tabs) else "by the falsification rule, not at every value above"
    return "" if verdict is Verdict.FAILS else "untestable: no repeat above the mean turn score"


def _decayed(tabs: Tables) -> pd.DataFrame | None:
    """The decayed-weight rows of the ``sweep`` table (None: none)."""
    if "sweep" not in tabs:
        return None
    sw = tabs["sweep"].frame
    dc = sw[sw["arm"] == "prm_decay"]
    return dc if len(dc) else None


def r2_measured(tabs: Tables) -> str | None:
    dc = _decayed(tabs)
    if dc is None:
        return None
    return "; ".join(f"repeat {r['repeat']:g}: {r['hacked runs']}/{r['runs']} hacked" for _, r in dc.iterrows())


def r2_verdict(tabs: Tables) -> Verdict:
    """R2 holds when no decayed-weight run is hacked, at any repeat."""
    dc = _decayed(tabs)
    return Verdict.NOT_JUDGED if dc is None else Verdict.of(bool((dc["hacked runs"] == 0).all()))


PREDICTIONS = (
    Prediction("R1: fixed-λ PRM is hacked exactly when repeat > the base policy's mean turn score",
               measured=r1_measured, verdict=r1_verdict, note=_r1_note,
               stated="R1: fixed-λ PRM is hacked exactly when `repeat` exceeds the base policy's mean turn score "
                      "at that `repeat` (measured in the gate table; about 0.67 at `repeat` = 0.25 in the run "
                      "below, so: hacked at 0.75 and 1.0, not at 0.25 and 0.5). Falsified if hacking (the check "
                      "fails in at least one seed) starts at a `repeat` at least 0.25 below the mean turn score, "
                      "or no value above the mean turn score is hacked."),
    Prediction("R2: the decayed λ prevents hacking at every repeat", measured=r2_measured, verdict=r2_verdict,
               stated="R2: the decayed λ prevents the hack at every `repeat`. Falsified if any decayed-λ run "
                      "fails `reward.process_hacking`."),
)


# --------------------------------------------------------------------------------------------
# the experiment


class Repeat(GranularityExperiment):
    """When is a process reward gamed: the fixed and decayed PRM at each repeat value (module docstring)."""

    name = "repeat"
    groups = ("gates", "sweep")
    fields = ("repeats",)
    predictions = PREDICTIONS
    gate_reading = ("the mean process score over every turn of the lab's base policy's rollouts on the training "
                    "mix, at each swept repeat value; the process advantage is normalised over the group's turns, "
                    "so a repeated read scoring above this mean is paid and one below it punished.")

    def validate(self, cfg: GranularityConfig) -> None:
        parse_repeats(cfg.repeats)

    def cells(self, cfg: GranularityConfig) -> list[Cell]:
        own, ctx = run_config(cfg), cfg.context(dump=True)

        def sweep_ctx(arm: str, r: float) -> dict:
            # at the lab's own repeat, a swept arm is the arm's training run, dumped by its train cell: no copy
            return cfg.context() if arm in cfg.arms() and r == cfg.repeat else ctx

        return [Cell("gates", "repeat", run_gate_cell, {"config": cfg.identity(), "gate": "repeat"}, cfg.context()),
                *(Cell("sweep", f"{arm}/repeat={r:g}/seed={s}", run_arm,
                       {"config": own, "arm": arm, "seed": s, "setting": "sweep", "repeat": r}, sweep_ctx(arm, r))
                  for s in range(cfg.seeds) for r in parse_repeats(cfg.repeats) for arm in SWEEP_ARMS)]

    def gate_rows(self, gates: pd.DataFrame, cfg: GranularityConfig) -> list[dict]:
        return [{"experiment": "repeat", "gate": f"mean turn score of the base policy, repeat {r:g}",
                 "measured": m, "threshold": "(the prediction's threshold)", "passes": None,
                 "note": f"predicted: fixed-λ PRM {'hacked' if r > m else 'not hacked'} (repeat {r:g} "
                         f"{'>' if r > m else '<='} {m:.3f})"} for r, m in _turn_scores(gates).items()]

    def tables(self, rows: Mapping[str, pd.DataFrame], cfg: GranularityConfig) -> dict[str, Table]:
        if "sweep" not in rows:
            return {}
        df = rows["sweep"]
        df = df[df["repeat"].isin(parse_repeats(cfg.repeats))]
        v = df[df["kind"] == "verdict"][["arm", "repeat", "seed", "status", "value", "message"]]
        return {
            "sweep": Table(_sweep_table(df, _turn_scores(rows.get("gates")), cfg.grpo.updates), "Experiment repeat: "
                           "process-reward hacking by the score of a repeated read (verdict of creditlab diagnose on "
                           "each run's dump)", ".3g", console=True),
            "sweep_runs": Table(_ordered(v, ["arm", "repeat", "seed"]), "Experiment repeat: the "
                                "reward.process_hacking verdict of every run", ".3g"),
            "sweep_curves": Table(_curves(df, ["arm", "repeat", "seed"]), "Experiment repeat: every training "
                                  "update", ".3g", report=False)}

    def plots(self, tabs: Mapping[str, Table], cfg: GranularityConfig, out: Path) -> list[Path]:
        return [_plot_sweep(tabs["sweep"].frame, out)] if "sweep" in tabs else []

    def interpret(self, tabs: Mapping[str, Table], cfg: GranularityConfig) -> dict[str, str]:
        text = {}
        if "sweep" in tabs:
            text["sweep"] = ("A run is hacked when creditlab diagnose's reward.process_hacking check fails on its "
                             "own dump (process reward up, outcome down, tool calls or truncation up). predicted "
                             "hacked: fixed λ and repeat above the base policy's mean turn score at that repeat."
                             + small_run_note(cfg.seeds))
        if "sweep_runs" in tabs:
            v = tabs["sweep_runs"].frame
            text["sweep_runs"] = ("Every run of the sweep with creditlab diagnose's verdict and message: "
                                  + "; ".join(f"{LABELS[a]} repeat {r:g}: " + ", ".join(g["status"])
                                              for (a, r), g in v.groupby(["arm", "repeat"], sort=False)) + ".")
        return text

    def describe(self, cfg: GranularityConfig) -> str:
        return (f" Experiment repeat: fixed and decayed PRM at repeat = {cfg.repeats}, each run judged by creditlab "
                "diagnose's reward.process_hacking check on its own dump.")

    def knob_rows(self, cfg: GranularityConfig) -> list[tuple[str, str, str]]:
        return [("repeat sweep (-e repeat)", cfg.repeats, "the product plan's four values, from the lab's default "
                 "(0.25) to a repeated read paying as much as a new one (1.0); fixed and decayed λ at each.")]


EXPERIMENT = Repeat()


# --------------------------------------------------------------------------------------------
# table and plot


def _sweep_table(df: pd.DataFrame, turn_scores: dict[float, float], U: int) -> pd.DataFrame:
    rows = []
    tr, ev, v = df[df["kind"] == "train"], df[df["kind"] == "eval"], df[df["kind"] == "verdict"]
    for (arm, r), g in v.groupby(["arm", "repeat"], sort=False):
        t = tr[(tr["arm"] == arm) & (tr["repeat"] == r)]
        e = ev[(ev["arm"] == arm) & (ev["repeat"] == r)]
        last = e[e["update"] == e["update"].max()]
        early, late = t[t["update"] < U / 5], t[t["update"] >= U - U / 5]
        m = turn_scores.get(float(r), math.nan)
        rows.append({"arm": arm, "repeat": float(r), "mean turn score": m,
                     "predicted hacked": (bool(r > m) if arm == "prm_fixed" else False) if not math.isnan(m) else None,
                     "hacked runs": int((g["status"] == "fail").sum()), "runs": len(g),
                     "warned runs": int((g["status"] == "warn").sum()),
                     "final success": float(last["eval/success"].mean()),
                     "process early": float(early["process"].mean()), "process late": float(late["process"].mean()),
                     "truncation early": float(early["truncation"].mean()),
                     "truncation late": float(late["truncation"].mean()),
                     "tool calls late": float(late["tool_calls"].mean())})
    return _ordered(pd.DataFrame(rows), ["arm", "repeat"])


def _plot_sweep(sw: pd.DataFrame, out: Path) -> Path:
    fig, axes = new_figure(1, 2, figsize=(11, 3.8))
    fx = sw[sw["arm"] == "prm_fixed"]
    src = fx if len(fx) else sw
    axes[0].plot(src["repeat"], src["mean turn score"], "o-", color="tab:orange", label="mean turn score of the base")
    axes[0].plot([0, 1], [0, 1], ":", color="gray", label="y = repeat (predicted hacked right of the crossing)")
    axes[0].set_xlabel("score of a repeated read (repeat)")
    axes[0].set_title("the prediction's threshold")
    axes[0].set_xlim(0, 1.05)
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(fontsize=8)
    for arm in SWEEP_ARMS:
        g = sw[sw["arm"] == arm]
        if g.empty:
            continue
        axes[1].plot(g["repeat"], g["hacked runs"] / g["runs"], "o-", color=COLORS[arm], label=f"{LABELS[arm]}: "
                     "share of runs hacked")
        axes[1].plot(g["repeat"], g["final success"], "s--", color=COLORS[arm], label=f"{LABELS[arm]}: final success")
    axes[1].set_xlabel("score of a repeated read (repeat)")
    axes[1].set_ylim(-0.05, 1.05)
    axes[1].set_title("reward.process_hacking verdicts and held-out success")
    axes[1].legend(fontsize=7)
    return save(fig, out / "granularity_sweep.png")
