"""The ``warm`` experiment of the granularity lab: a teacher that can read its context. A second base
policy is warm-started on demonstrations a share of which (``warm_base.privileged``) carry a teacher's
privileged hint in exactly the teacher's format; GRPO and both self-distillation teachers train from it.
Its gate: each teacher's preference for good over bad turns beats its placebo's by at least
:data:`TEACHER_GATE` nats. Its predictions: W1, the warm-started teachers pass that gate; W2, advice-OPSD
still collapses below GRPO; W3, ref-OPSD moves the student little while advice-OPSD has the larger KL
and gradient norm, clipped updates and shrinking responses."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import pandas as pd
import torch

from creditlab.errors import ConfigError, InputError
from creditlab.lab.experiment import Prediction, Tables, Verdict, notes
from creditlab.lab.protocol import Table
from creditlab.lab.report import small_run_note
from creditlab.lab.runner import Cell
from creditlab.labs._toolshop import base_knob
from creditlab.labs.granularity._common import (
    GranularityExperiment,
    _curves,
    _diffs,
    _means,
    _opsd,
    _plot_opsd,
    _read_teachers,
    _summary,
    gated_runs,
    setting_of,
)
from creditlab.labs.granularity.config import GranularityConfig
from creditlab.labs.granularity.world import teacher_rows
from creditlab.train.toolshop_base import base_policy

#: The arms of the experiment.
WARM_ARMS = ("grpo", "opsd_ref", "opsd_advice")
#: The gate: a teacher's preference over its placebo's (nats).
TEACHER_GATE = 1.0


@torch.no_grad()
def run_gate_cell(config: dict, gate: str, cache_dir: str) -> list[dict]:
    """The experiment's precondition: the teacher table
    (:func:`~creditlab.labs.granularity.world.teacher_rows`) of the warm-started base policy, before
    any training. ``gate`` (``"warm"``) names the precondition among the lab's gate cells."""
    if gate != "warm":
        raise InputError(f"gate: {gate!r} is not 'warm' (experiment warm's gate cell)")
    cfg = GranularityConfig.from_dict(config)
    base_cfg, _, _ = setting_of(cfg, "warm")
    return [{"gate": "teacher", **r} for r in teacher_rows(cfg, base_policy(base_cfg, cache_dir=cache_dir))]


def _teacher_margins(t: pd.DataFrame) -> dict[str, float]:
    """Per teacher kind: its preference (good - bad turn gap) minus its placebo's, over all types (nats)."""
    d = t[t["type"] == "all"]
    if "preference" not in d:  # every gap undefined (no good or no bad turn tokens): dropped as empty
        d = d.assign(preference=math.nan)
    out = {}
    for k in ("ref", "advice"):
        own = d[(d["teacher"] == k) & ~d["placebo"].astype(bool)]["preference"]
        placebo = d[(d["teacher"] == k) & d["placebo"].astype(bool)]["preference"]
        if len(own) and len(placebo):
            out[k] = float(own.iloc[0] - placebo.iloc[0])
    return out


# --------------------------------------------------------------------------------------------
# the predictions


def _teacher_gates(tabs: Tables, teacher: str = "") -> pd.DataFrame:
    """The teachers' rows of the ``gates`` table (``teacher``: only the rows whose gate starts with it)."""
    gates = tabs["gates"].frame if "gates" in tabs else pd.DataFrame(columns=["gate", "measured", "passes"])
    g = gates[gates["gate"].astype(str).str.contains("teacher")]
    return g[g["gate"].astype(str).str.startswith(teacher)] if teacher else g


def _final(tabs: Tables) -> pd.DataFrame | None:
    """The ``warm_means`` rows over every type, by arm (None: the experiment has no table)."""
    if "warm_means" not in tabs:
        return None
    wm = tabs["warm_means"].frame
    return wm[wm["type"] == "all"].set_index("arm")


def w1_measured(tabs: Tables) -> str | None:
    if "warm_means" not in tabs:
        return None
    return "; ".join(f"{r.gate.split(' teacher')[0]} {r.measured:+.3f}" for r in _teacher_gates(tabs).itertuples())


def w1_verdict(tabs: Tables) -> Verdict:
    """W1 holds when the teachers' gates were measured and every one passes."""
    if "warm_means" not in tabs:
        return Verdict.NOT_JUDGED
    g = _teacher_gates(tabs)
    return Verdict.of(bool(len(g)) and bool(g["passes"].all()))


def _advice_and_grpo(tabs: Tables) -> pd.DataFrame | None:
    wm = _final(tabs)
    return wm if wm is not None and {"grpo", "opsd_advice"} <= set(wm.index) else None


def w2_measured(tabs: Tables) -> str | None:
    wm = _advice_and_grpo(tabs)
    if wm is None:
        return None
    return (f"final success: advice-OPSD {wm.loc['opsd_advice', 'success']:.2f}, GRPO {wm.loc['grpo', 'success']:.2f}"
            + (f", ref-OPSD {wm.loc['opsd_ref', 'success']:.2f}" if "opsd_ref" in wm.index else ""))


def w2_verdict(tabs: Tables) -> Verdict:
    """W2 is judged on the advice teacher's own gate (the reference teacher's is W1's business): not
    judged when it failed; then it fails when advice-OPSD's final success is within 0.02 of GRPO's or
    above, and holds when it is further below."""
    wm = _advice_and_grpo(tabs)
    g = _teacher_gates(tabs, "turn-advice")
    if wm is None or not (len(g) and bool(g["passes"].all())):
        return Verdict.NOT_JUDGED
    return Verdict.of(not (wm.loc["opsd_advice", "success"] >= wm.loc["grpo", "success"] - 0.02))


def _both_teachers(tabs: Tables) -> pd.DataFrame | None:
    """The ``warm_opsd`` table by arm, when it has both OPSD arms (None: nothing to judge)."""
    if "warm_means" not in tabs or "warm_opsd" not in tabs:
        return None
    wo = tabs["warm_opsd"].frame.set_index("arm")
    return wo if {"opsd_ref", "opsd_advice"} <= set(wo.index) else None


def w3_measured(tabs: Tables) -> str | None:
    wo, wm = _both_teachers(tabs), _final(tabs)
    if wo is None or wm is None:
        return None
    r, a = wo.loc["opsd_ref"], wo.loc["opsd_advice"]
    base = wm["gain"] if "gain" in wm else None
    return (f"ref: KL {r.reverse_kl:.3g}, grad {r.grad_norm:.3g}, {r.clipped_updates:.1f} clipped, tokens "
            f"{r.response_tokens_early:.1f} -> {r.response_tokens_late:.1f}"
            + (f", success change {base['opsd_ref']:+.2f}" if base is not None else "")
            + f"; advice: KL {a.reverse_kl:.3g}, grad {a.grad_norm:.3g}, {a.clipped_updates:.1f} clipped, tokens "
            f"{a.response_tokens_early:.1f} -> {a.response_tokens_late:.1f}")


def w3_verdict(tabs: Tables) -> Verdict:
    """W3 holds when advice-OPSD's KL, gradient norm and clipped updates are all above ref-OPSD's, its
    responses shrink, and ref-OPSD's success changes by less than 0.1 (when the change is known); it
    fails when any of these does not hold."""
    wo, wm = _both_teachers(tabs), _final(tabs)
    if wo is None or wm is None:
        return Verdict.NOT_JUDGED
    r, a = wo.loc["opsd_ref"], wo.loc["opsd_advice"]
    base = wm["gain"] if "gain" in wm else None
    return Verdict.of(bool(a.reverse_kl > r.reverse_kl and a.grad_norm > r.grad_norm
                           and a.clipped_updates > r.clipped_updates
                           and a.response_tokens_late < a.response_tokens_early
                           and (base is None or abs(base["opsd_ref"]) < 0.1)))


PREDICTIONS = (
    Prediction("W1: the warm-started teachers beat their placebos by >= 1 nat", measured=w1_measured,
               verdict=w1_verdict,
               stated="W1: warm-started teachers read their hints: each beats its placebo by >= 1 nat (the gate). "
                      "Falsified if either teacher's preference minus its placebo's is below 1 nat."),
    Prediction("W2: advice-OPSD collapses below GRPO (falsified if it matches or beats GRPO with a passing gate)",
               measured=w2_measured, verdict=w2_verdict, note=notes(not_judged="the advice teacher's gate failed"),
               stated="W2: the turn-advice teacher collapses the student: OPSD-advice ends below GRPO. Falsified "
                      "if OPSD-advice's final held-out success matches or beats GRPO's (within 0.02 or above) "
                      "with a passing gate."),
    Prediction("W3: ref-OPSD moves the student little; advice-OPSD has larger KL and gradient norm, clipped updates, "
               "shrinking responses", measured=w3_measured, verdict=w3_verdict,
               note=notes(fails="in part: see measured"),
               stated="W3: the reference-answer teacher moves the student little (final success within 0.1 of the "
                      "base policy's); the advice teacher shows the collapse signature: larger KL and gradient "
                      "norm than the reference teacher, more clipped updates, responses shrinking from the first "
                      "to the last fifth. Falsified if any part fails (reported part by part)."),
)


# --------------------------------------------------------------------------------------------
# the experiment


class Warm(GranularityExperiment):
    """GRPO and both OPSD teachers from the base policy warm-started on the teachers' hints (module docstring)."""

    name = "warm"
    groups = ("gates", "warm")
    fields = ("warm_base",)
    predictions = PREDICTIONS
    gate_reading = ("each teacher's preference for good over bad turns minus its placebo's (another task's hint), "
                    "in nats.")
    gate_knob = f"teacher - placebo preference >= {TEACHER_GATE:g} nat"

    def validate(self, cfg: GranularityConfig) -> None:
        if tuple(cfg.warm_base.chain_lengths) != tuple(cfg.base.chain_lengths):
            raise ConfigError("warm_base.chain_lengths", "must equal base.chain_lengths (the same tasks)")
        if not 0.0 < cfg.warm_base.privileged <= 1.0:
            raise ConfigError("warm_base.privileged", f"must be in (0, 1], got {cfg.warm_base.privileged}")

    def cells(self, cfg: GranularityConfig) -> list[Cell]:
        return gated_runs(cfg, self.name, run_gate_cell, WARM_ARMS)

    def gate_rows(self, gates: pd.DataFrame, cfg: GranularityConfig) -> list[dict]:
        if not gates["gate"].eq("teacher").any():
            return []
        return [{"experiment": "warm", "gate": f"{'reference-answer' if k == 'ref' else 'turn-advice'} "
                                               "teacher: preference - placebo's (nats)",
                 "measured": v, "threshold": f">= {TEACHER_GATE:g}", "passes": v >= TEACHER_GATE,
                 "note": "good-minus-bad-turn log-prob gap of the teacher over the student, minus the same for "
                         "another task's hint"}
                for k, v in _teacher_margins(gates[gates["gate"] == "teacher"]).items()]

    def tables(self, rows: Mapping[str, pd.DataFrame], cfg: GranularityConfig) -> dict[str, Table]:
        tabs: dict[str, Table] = {}
        if "warm" in rows:
            df = rows["warm"]
            summary = _summary(df)
            tabs["warm_means"] = Table(_means(summary), "Experiment warm: held-out results per arm and task type "
                                                        "(warm-started base policy)", ".3g", console=True)
            d = _diffs(summary)
            if len(d):
                tabs["warm_diff"] = Table(d, "Experiment warm: paired differences against GRPO", ".3g")
            tabs["warm_opsd"] = Table(_opsd(df, cfg.grpo.updates), "Experiment warm: KL, gradients, clipping, "
                                      "response length", ".3g")
            tabs["warm_curves"] = Table(_curves(df, ["arm", "seed"]), "Experiment warm: every training update",
                                        ".3g", report=False)
        gates = rows.get("gates")
        if gates is not None and gates["gate"].eq("teacher").any():
            t = gates[gates["gate"] == "teacher"].drop(columns=["gate", "cell_key"], errors="ignore")
            tabs["warm_teachers"] = Table(t.dropna(axis=1, how="all"), "Experiment warm: what the warm-started "
                                          "teachers know (before training)", ".3g")
        return tabs

    def plots(self, tabs: Mapping[str, Table], cfg: GranularityConfig, out: Path) -> list[Path]:
        if "warm_curves" not in tabs:
            return []
        return [_plot_opsd(tabs["warm_curves"].frame, cfg, out, "granularity_warm_opsd.png")]

    def interpret(self, tabs: Mapping[str, Table], cfg: GranularityConfig) -> dict[str, str]:
        few = small_run_note(cfg.seeds)
        text = {}
        if "warm_means" in tabs:
            text["warm_means"] = ("GRPO and both self-distillation arms from the warm-started base policy: final "
                                  "held-out success per type and its change from the base policy." + few)
        if "warm_diff" in tabs:
            text["warm_diff"] = ("Paired differences (arm - GRPO, same seeds, same held-out tasks) from the warm "
                                 "base." + few)
        if "warm_teachers" in tabs:
            text["warm_teachers"] = ("The teacher table (as for the lab's base policy) on the warm-started base "
                                     "policy: a teacher that reads its hint raises the good turns' tokens and lowers "
                                     "the bad ones' more than its placebo does. "
                                     + _read_teachers(tabs["warm_teachers"].frame))
        if "warm_opsd" in tabs:
            text["warm_opsd"] = ("Self-distillation from the warm-started base policy (half of its demonstrations "
                                 "carried a teacher's hint): KL(student || teacher) per token, gradient norm before "
                                 "clipping, updates with a clipped step, policy tokens per episode in the first and "
                                 "last fifth." + few)
        return text

    def describe(self, cfg: GranularityConfig) -> str:
        return (" Experiment warm: GRPO and both OPSD teachers from a base policy warm-started with "
                f"{cfg.warm_base.privileged:.0%} of its demonstrations carrying a teacher's hint.")

    def knob_rows(self, cfg: GranularityConfig) -> list[tuple[str, str, str]]:
        return [("warm-started base (-e warm)", f"{cfg.warm_base.privileged:.0%} of the demonstrations carry a hint "
                 f"(half the reference answer, half turn advice); {base_knob(cfg.warm_base)}",
                 "the product plan's half; the rest of the warm start as the lab's base policy, so the only "
                 "difference is the hints.")]


EXPERIMENT = Warm()
