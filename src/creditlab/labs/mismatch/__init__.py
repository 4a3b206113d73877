"""The mismatch lab: does a multi-turn agent trained on quantized rollouts need execution-prefix correction?

Reads top to bottom:

1. build (or load from the cache) one base policy: the toolshop agent's supervised warm start on
   chains of 5 to 8 tool calls (:func:`creditlab.train.toolshop_base.base_policy`);
2. train it with multi-turn outcome GRPO under every arm, a triple (rollout engine, learner,
   correction): ``fp32`` (fp32, fp32, none), ``naive`` (P, fp32, none), ``qat`` (P, P-QAT, none)
   and ``qat_tis``, ``qat_mis``, ``qat_prefix``, ``qat_global``, ``qat_interq`` (P, P-QAT, that
   correction of :data:`creditlab.core.correction.CORRECTIONS`), where the engine precision ``P``
   (fp8, int8, nvfp4, mxfp4) is the dose of residual mismatch;
3. every arm starts from the same base policy and, seed for seed, sees the same tasks, the same
   sampling uniforms and the same minibatch order (common random numbers,
   :func:`creditlab.train.toolshop_grpo.train_grpo_stacked`), and is evaluated on the same held-out
   tasks by the same fp32 engine with the same sampling uniforms;
4. tables: ``summary`` (per arm, dose and seed: final and best held-out success, rollback, AULC,
   interaction cost, cap exhaustion, K3 early and late), ``curves`` (per update), ``by_turn`` (the
   prefix and current log ratio by turn index), paired differences against QAT and against fp32;
   plots: success over updates, K3 over updates, the prefix/current fingerprint, rollback and
   final success against the dose.

Cells: one per (dose, seed) holding the seven quantized arms of that seed as one stacked tensor
program, and one holding the fp32 arm of every seed (it does not depend on the dose). A cell's
rows depend only on its arguments; every finished cell is stored at once (resumable).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pandas as pd

from creditlab.core.diagnostics import aulc, rollback
from creditlab.lab.experiment import ExperimentLab, Verdict
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table
from creditlab.lab.report import (
    ci_columns,
    group_means,
    knobs_table,
    paired_diff,
    read_diff,
    small_run_note,
    sort_in_order,
)
from creditlab.labs._toolshop import BasePolicyLab, base_knob, optim_knob, seeds_knob
from creditlab.labs.mismatch.cells import ENTROPY_BINS, gate_metrics, run_dose_cell, run_stack
from creditlab.labs.mismatch.config import (
    ARMS,
    COMPUTE_CODE,
    DIFF,
    DOSES,
    GATE_DRIFT,
    LABELS,
    ROLLBACK,
    UNIT,
    MismatchConfig,
    arm_triple,
)
from creditlab.labs.mismatch.dose import Dose

__all__ = ["ARMS", "DOSES", "ENTROPY_BINS", "EXPERIMENT_TABLE", "LAB", "MismatchConfig", "MismatchLab",
           "REGISTRATIONS", "Registration", "SHARED_FIELDS", "TWO_CORE_STATED", "arm_triple", "diagnose_drift",
           "fp32_band", "fp32_saturation", "gate_metrics", "gate_table", "late_rollbacks", "phase_map",
           "predictions_table", "prefix_drift_calibration", "run_dose_cell", "run_stack", "score_curve",
           "verdict_rolls_back"]


def score_curve(updates: np.ndarray, success: np.ndarray, smooth: int) -> dict[str, float]:
    """Final, best, rollback and AULC of one held-out learning curve (eval points in update order).

    ``final`` is the mean of the last ``smooth`` evaluation points, ``best`` the largest mean of
    ``smooth`` consecutive points anywhere in the run, ``rollback = best - final``
    (:func:`creditlab.core.diagnostics.rollback` on the smoothed curve); averaging a window keeps
    the maximum of a noisy curve from reading as a rollback. ``aulc`` is the mean over all points
    (:func:`creditlab.core.diagnostics.aulc`).
    """
    import torch

    y = torch.tensor(np.asarray(success, dtype=np.float64))
    w = min(smooth, len(y))
    s = y.unfold(0, w, 1).mean(-1)
    peak = int(torch.argmax(s))
    return {"final": float(s[-1]), "best": float(s.max()), "rollback": float(rollback(s)), "aulc": float(aulc(y)),
            "best_update": float(updates[peak + w - 1])}


def _summary(df: pd.DataFrame, cfg: MismatchConfig) -> pd.DataFrame:
    U = cfg.grpo.updates
    rows = []
    for (arm, dose, seed), g in df.groupby(["arm", "dose", "seed"], sort=False):
        ev = g.dropna(subset=["eval/success"]).sort_values("update")
        tr = g.dropna(subset=["mismatch/k3"]).sort_values("update")
        last = ev[ev["update"] == ev["update"].max()].iloc[0]
        early = tr[tr["update"] < U / 3]["mismatch/k3"].mean()
        late = tr[tr["update"] >= 2 * U / 3]["mismatch/k3"].mean()
        rows.append({"arm": arm, "dose": dose, "seed": int(seed),
                     **score_curve(ev["update"].to_numpy(), ev["eval/success"].to_numpy(), cfg.smooth),
                     "interaction_cost": last.get("eval/interaction_cost", math.nan),
                     "cap_exhaustion": last.get("eval/cap_exhaustion", math.nan),
                     "k3_early": early, "k3_late": late,
                     "k3_growth": late / early if early > 0 else math.nan,
                     "train_success_late": tr[tr["update"] >= 2 * U / 3]["reward/success"].mean(),
                     # how much the arm corrects, and how far the policy moves per update
                     "weight_min": _mean_of(tr, "correction/weight_min"),
                     "weight_max": _mean_of(tr, "correction/weight_max"),
                     "clip_rate": _mean_of(tr, "correction/clip_rate"),
                     "update_kl": _mean_of(tr, "loss/approx_kl"),
                     # the regime: does the policy keep its entropy on thoughts while it trains?
                     "thought_entropy_early": _mean_of(tr[tr["update"] < U / 3], "policy/thought_entropy"),
                     "thought_entropy_late": _mean_of(tr[tr["update"] >= 2 * U / 3], "policy/thought_entropy"),
                     "policy_tokens_late": _mean_of(tr[tr["update"] >= 2 * U / 3], "episode/policy_tokens")})
    return _ordered(pd.DataFrame(rows), ["dose", "arm", "seed"])


def _mean_of(df: pd.DataFrame, col: str) -> float:
    return float(df[col].mean()) if col in df.columns else math.nan


def _ordered(df: pd.DataFrame, by: list[str], ascending: bool | list[bool] = True) -> pd.DataFrame:
    """Sorted by ``by``, arms in the order of :data:`ARMS`."""
    return sort_in_order(df, by, {"arm": ARMS}, ascending)


def _with_fp32_per_dose(summary: pd.DataFrame, doses: list[str]) -> pd.DataFrame:
    """The fp32 arm's rows repeated under every dose, so it pairs with each dose's arms."""
    fp = summary[summary["arm"] == "fp32"]
    rest = summary[summary["arm"] != "fp32"]
    return pd.concat([rest] + [fp.assign(dose=d) for d in doses], ignore_index=True)


def _means(summary: pd.DataFrame, doses: list[str]) -> pd.DataFrame:
    intervals = [("final", UNIT), ("rollback", (0.0, 1.0)), ("aulc", UNIT), ("k3_late", (0.0, math.inf)),
                 ("k3_growth", (0.0, math.inf))]
    means = group_means(_with_fp32_per_dose(summary, doses), ["dose", "arm"], intervals,
                        ("interaction_cost", "cap_exhaustion"))
    return _ordered(means, ["dose", "arm"])


def _diffs(summary: pd.DataFrame, doses: list[str], ref: str) -> pd.DataFrame:
    df = _with_fp32_per_dose(summary, doses)
    arms = [a for a in ARMS if a != ref and a in set(df["arm"])]
    if ref not in set(df["arm"]):
        return pd.DataFrame()
    out = []
    for a in arms:
        merged = None
        for m in ("final", "rollback", "aulc"):
            d = paired_diff(df, a, ref, ["dose"], m, bounds=DIFF).rename(
                columns={"mean": m, "lo": f"{m}_lo", "hi": f"{m}_hi"})
            merged = d if merged is None else merged.merge(d.drop(columns=["n"]), on=["diff", "dose"])
        out.append(merged)
    res = pd.concat(out, ignore_index=True)
    cols = ["diff", "dose"] + [c for m in ("final", "rollback", "aulc") for c in (m, f"{m}_lo", f"{m}_hi")] + ["n"]
    return res[cols]


def _by_turn(df: pd.DataFrame, cfg: MismatchConfig) -> pd.DataFrame:
    U = cfg.grpo.updates
    turns = sorted({int(c.split("/")[1][4:]) for c in df.columns if c.startswith("mismatch/turn") and
                    c.endswith("/prefix")})
    rows = []
    for (arm, dose), g in df.dropna(subset=["mismatch/k3"]).groupby(["arm", "dose"], sort=False):
        for phase, sel in (("all", g), ("early", g[g["update"] < U / 3]), ("late", g[g["update"] >= 2 * U / 3])):
            for k in turns:
                pre, cur, n = (sel.get(f"mismatch/turn{k}/{w}") for w in ("prefix", "current", "tokens"))
                if pre is None or pre.notna().sum() == 0:
                    continue
                per_seed = sel.assign(p=pre, c=cur).groupby("seed")[["p", "c"]].mean()
                rows.append({"arm": arm, "dose": dose, "phase": phase, "turn": k,
                             **ci_columns(per_seed["p"], "prefix"), **ci_columns(per_seed["c"], "current"),
                             "tokens": float(n.mean()) if n is not None else math.nan})
    return pd.DataFrame(rows)


def _fingerprint(by_turn: pd.DataFrame) -> pd.DataFrame:
    """Wide view of ``by_turn`` (phase ``all``): one row per arm, dose and ratio, one column per turn."""
    if by_turn.empty:
        return by_turn
    d = by_turn[by_turn["phase"] == "all"]
    rows = []
    for (dose, arm), g in d.groupby(["dose", "arm"], sort=False):
        for what in ("prefix", "current"):
            rows.append({"dose": dose, "arm": arm, "log ratio": what,
                         **{f"turn {int(t)}": v for t, v in zip(g["turn"], g[what], strict=True)}})
    return _ordered(pd.DataFrame(rows), ["dose", "arm", "log ratio"], ascending=[True, True, False])


def _knobs(cfg: MismatchConfig) -> pd.DataFrame:
    """Each knob with its value in this run, the lab's default, and why the default is what it is."""
    return knobs_table(_knob_rows(cfg), _knob_rows(MismatchConfig()))


def _knob_rows(cfg: MismatchConfig) -> list[tuple[str, str, str]]:
    g, b = cfg.grpo, cfg.base
    return [
        ("chain lengths", ", ".join(map(str, g.chain_lengths)),
         "5 to 8 tool calls (7 turns on average, up to C + 2): a long interaction history for the mismatch to "
         "compound over, and a base policy at about 0.4 held-out success that GRPO does not saturate at once "
         "(at C = 4 outcome GRPO reached 0.96 in 100 updates)."),
        ("thought tokens per action", str(b.thoughts),
         "reward-neutral free tokens before every call, uniformly random in the demonstrations, so the trained "
         "policy keeps entropy where an LLM agent keeps it (its free text) while its tool calls become "
         "deterministic. Per-token K3 is largest at high entropy, and the prefix drift grows with the policy "
         "tokens before the last turn: with 24 thoughts a successful episode of C calls holds about C x 28 "
         "policy tokens (140-225 at C = 5-8, inside the 150-400 of LLM agent turns' regime), against 20-29 "
         "without thoughts. 32 would cost a third more decode steps per update for a few more tokens."),
        ("context", f"model {b.max_len}, trajectory {g.max_len}, action {g.max_action_len} tokens",
         "C + 2 = 10 turns at C = 8 of (thoughts + call + observation) fit; an action holds its thoughts and "
         "the longest call."),
        ("base policy", base_knob(b),
         "the toolshop defaults, with the chain lengths, the thoughts and the context above; demonstrations in "
         "batches of 64 (each holds 7x the tokens of one without thoughts); one base policy shared by every arm "
         "and seed."),
        ("updates", str(g.updates),
         "as in the paper: its QAT run peaks near 300 updates and rolls back between 300 and 400; the time of a "
         "run is linear in updates."),
        ("rollouts per update", f"{g.tasks_per_update} tasks x {g.group_size}",
         "a quarter of the toolshop lab's 256, for time: the cost of a run is linear in rollouts per update."),
        ("optimisation", optim_knob(g), "GRPOConfig defaults, as in the toolshop lab; not tuned."),
        ("held-out evaluation", f"{g.eval_tasks} tasks every {g.eval_every} updates, fp32 engine, sampled",
         "one evaluation for every arm (the fp32 engine measures the learned policy, not its engine); sampled at "
         f"temperature {g.temperature:g} like training, with the same uniforms for every arm and evaluation, so "
         "arms and evaluation points differ only by their policies."),
        ("final / best window", f"{cfg.smooth} evaluation points",
         "a single point has a standard error of about 0.03 at 256 tasks, so best-minus-last of raw points reads "
         "noise as rollback; means of a window (and the fp32 arm as the no-mismatch reference) keep it honest."),
        seeds_knob(cfg.seeds),
        ("correction parameters", "core defaults",
         "TIS cap 2, MIS [0.5, 2], InterQ eps 0.025 / 0.05, alpha_g 0.5 (prefix: alpha 1); not tuned."),
        ("doses", ", ".join(cfg.experiments),
         "engine precisions of current serving stacks: FP8 W8A8-KV8, INT8 W8A8, FP4 W4A4-KV8 (NVFP4: E2M1 in "
         "blocks of 16 with FP8 scales; MXFP4, blocks of 32 with power-of-two scales, is available as -e mxfp4)."),
    ]


CURVE_COLUMNS = {"eval/success": "success", "reward/success": "train_success", "mismatch/k3": "k3",
                 "mismatch/mean_abs_delta": "mean_abs_delta", "mismatch/seq_k3": "seq_k3",
                 "correction/clip_rate": "clip_rate", "correction/weight_mean": "weight_mean",
                 "correction/weight_min": "weight_min", "correction/weight_max": "weight_max",
                 "loss/clip_frac": "ppo_clip_frac", "grad_norm": "grad_norm", "episode/tool_calls": "tool_calls",
                 "policy/thought_entropy": "thought_entropy", "policy/action_entropy": "action_entropy",
                 "episode/policy_tokens": "policy_tokens"}


def gate_table(dose: pd.DataFrame) -> pd.DataFrame:
    """Per engine dose: the base policy's K3 per token, policy tokens per trajectory and prefix drift
    entering the last turn for the naive (fp32 learner) and the QAT learner, K3 by token entropy, and
    whether QAT's drift reaches :data:`GATE_DRIFT` (the precondition of the main run)."""
    rows = []
    for engine in [e for e in DOSES if e in set(dose["engine"])]:
        d = dose[dose["engine"] == engine].set_index("learner")
        if not {"fp32", "QAT"} <= set(d.index) or "drift_last" not in d.columns:
            continue
        nv, q = d.loc["fp32"], d.loc["QAT"]
        row = {"engine": engine, "policy_tokens": q["policy_tokens"], "thought_tokens": q["thought_tokens"],
               "k3_naive": nv["k3"], "k3_qat": q["k3"], "drift_naive": nv["drift_last"], "drift_qat": q["drift_last"]}
        if any(str(c).startswith("tokens_turn") for c in d.columns):  # diagnose's statistic (newer gate cells)
            row["prefix_rms_naive"], row["prefix_rms_qat"] = diagnose_drift(nv.dropna()), diagnose_drift(q.dropna())
        for c in [c for c in d.columns if c.startswith("k3_H")]:
            row[f"{c} (naive)"], row[f"{c} (QAT)"] = nv[c], q[c]
        row["k3_thought (QAT)"], row["k3_action (QAT)"] = q.get("k3_thought", math.nan), q.get("k3_action", math.nan)
        row["thought_entropy"] = q.get("thought_entropy", math.nan)  # absent (all NaN) without thoughts
        row["gate"] = "pass" if -q["drift_last"] >= GATE_DRIFT else "fail"
        rows.append(row)
    return pd.DataFrame(rows)


def diagnose_drift(row: pd.Series) -> float:
    """The value ``creditlab diagnose``'s ``mismatch.prefix_drift`` check gives on the gate's batch: the
    RMS prefix log ratio at the last turn with at least ``turn_min_tokens`` tokens (from the
    ``prefix_rms_turn{k}`` / ``tokens_turn{k}`` of :func:`gate_metrics`); NaN when fewer than 2 turns
    have them, as the check."""
    from creditlab.diagnose.checks import CHECK_PARAMS

    turns = sorted(int(str(c)[len("tokens_turn"):]) for c in row.index if str(c).startswith("tokens_turn"))
    good = [k for k in turns if row[f"tokens_turn{k}"] >= CHECK_PARAMS.turn_min_tokens]
    return float(row[f"prefix_rms_turn{good[-1]}"]) if len(good) >= 2 else math.nan


def fp32_band(summary: pd.DataFrame) -> float | None:
    """The fp32 arm's own band of rollback (no mismatch: the noise of evaluation and of RL itself): the
    largest rollback of an fp32 run, and at least :data:`ROLLBACK`; None without an fp32 run."""
    fp = summary[summary["arm"] == "fp32"]["rollback"]
    return max(ROLLBACK, float(fp.max())) if len(fp) else None


def late_rollbacks(runs: pd.DataFrame, band: float, updates: int, late_after: float | None = None) -> pd.Series:
    """Per seed: does its held-out success roll back as prediction (a) states it, beyond the fp32 arm's
    own band (``rollback > band``) and late in training: its best window ends at or after ``late_after``
    (the 2-core registration: the update at which the fp32 arm's success saturates,
    :func:`fp32_saturation`), or in the second half of the updates when ``late_after`` is None (the
    paper-scale registration)?"""
    late = updates / 2 if late_after is None else late_after
    return (runs["rollback"] > band) & (runs["best_update"] >= late)


def fp32_saturation(curves: pd.DataFrame, smooth: int, share: float = 0.9) -> float | None:
    """The update at which the fp32 arm's held-out success saturates: on its curve averaged over seeds
    (``curves``: the fp32 rows with ``update`` and ``eval/success``), the end of the first window of
    ``smooth`` evaluation points whose mean reaches ``share`` of the way from the first point to the best
    window. None when there is no fp32 curve or it never rises above its first point."""
    ev = curves.dropna(subset=["eval/success"]) if "eval/success" in curves else curves.iloc[:0]
    if ev.empty:
        return None
    y = ev.groupby("update")["eval/success"].mean().sort_index()
    w = min(smooth, len(y))
    s = y.rolling(w).mean().dropna()
    gain = float(s.max()) - float(y.iloc[0])
    if not gain > 0:
        return None
    return float(s.index[int(np.argmax(s.to_numpy() >= float(y.iloc[0]) + share * gain))])


def verdict_rolls_back(runs: pd.DataFrame, band: float | None, updates: int, seeds_needed: int,
                       late_after: float | None = None) -> Verdict:
    """Predictions (a) and (c): late rollbacks (:func:`late_rollbacks`) beyond the fp32 band in
    ``seeds_needed`` seeds, with K3 growing (late / early > 1); not judged without the fp32 arm (no band),
    without runs, or (``late_after`` is NaN) when the fp32 arm never saturated."""
    if band is None or runs.empty or (late_after is not None and math.isnan(late_after)):
        return Verdict.NOT_JUDGED
    return Verdict.of(bool(late_rollbacks(runs, band, updates, late_after).sum() >= seeds_needed
                           and runs["k3_growth"].mean() > 1))


#: The predictions as written before the full run (docs/mismatch.md, "Predictions (fixed before the full
#: run)"): the scope, then (a)-(d), word for word: what a run records at its start. They are about the dose
#: that passes the gate, not one experiment; :func:`predictions_table` judges them.
PREDICTIONS_STATED = (
    "At the dose that passes the gate, on the full run (400 updates, 5 paired seeds; \"rolls back\" means "
    "best-minus-final held-out success > 0.03, the window of 3 evaluation points):",
    "**(a)** QAT rolls back beyond the fp32 arm's own band in at least 3 of 5 seeds, late in training, "
    "with K3 late / early > 1.",
    "**(b)** QAT+InterQ does not roll back (best-minus-final <= 0.03) in at least 4 of 5 seeds, and its "
    "final success paired with fp32 has a 95% interval inside [-0.05, +0.05].",
    "**(c)** QAT+TIS and QAT+MIS still roll back as in (a).",
    "**(d)** QAT+prefix (alpha = 1) and QAT+global are less stable than InterQ: a larger rollback than "
    "InterQ in at least 3 of 5 seeds, or a seed standard deviation of final success at least 2x InterQ's.",
)


#: The predictions registered for the 2-core protocol (:meth:`MismatchConfig.two_core`; docs/mismatch.md,
#: "Predictions (registered before the 2-core run)"), word for word: a new registration, beside the
#: paper-scale one above, which is kept as it was.
TWO_CORE_STATED = (
    "On the 2-core protocol (MXFP4, 100 updates of 8 tasks x 4 rollouts, held-out success on 128 tasks "
    "every 10 updates, 5 paired seeds; \"rolls back\" means best-minus-final held-out success, the window "
    "of 3 evaluation points, above the fp32 band: the largest rollback of an fp32 run, and at least 0.03; "
    "\"late\" means the best window ends at or after the update at which the fp32 arm's success "
    "saturates, the end of the first window whose mean reaches 90% of the way from its first point to "
    "its best window):",
    "**(a)** QAT rolls back late in at least 3 of 5 seeds, with K3 late / early > 1.",
    "**(b)** QAT+InterQ does not roll back in at least 4 of 5 seeds, and its final success paired with "
    "fp32 has a 95% interval inside [-0.05, +0.05].",
    "**(c)** QAT+TIS still rolls back as in (a).",
    "**(d)** QAT+prefix (alpha = 1) and QAT+global are less stable than InterQ: a larger rollback than "
    "InterQ in at least 3 of 5 seeds, or a seed standard deviation of final success at least 2x InterQ's.",
)


@dataclasses.dataclass(frozen=True)
class Registration:
    """A registered protocol's predictions and how its rules read them: ``late`` is ``"half"`` (the best
    window ends in the second half of the updates) or ``"fp32_saturation"`` (at or after the fp32 arm
    saturates); ``b_band``: (b)'s "does not roll back" is within the fp32 band (else within
    :data:`ROLLBACK`)."""

    stated: tuple[str, ...]
    late: str
    b_band: bool


#: ``MismatchConfig.protocol`` -> its registration.
REGISTRATIONS = {"paper": Registration(PREDICTIONS_STATED, "half", False),
                 "two-core": Registration(TWO_CORE_STATED, "fp32_saturation", True)}


def predictions_table(summary: pd.DataFrame, diffs_fp32: pd.DataFrame, doses: list[str], updates: int,
                      registration: Registration = REGISTRATIONS["paper"], late_after: float | None = None
                      ) -> pd.DataFrame:
    """The predictions (fixed before the full run; docs/mismatch.md) tested on this run, per dose:
    (a) QAT rolls back beyond the fp32 arm's own band late in training (:func:`late_rollbacks`) in >= 3/5
    of seeds, with K3 late / early > 1; (b) InterQ does not (rollback <= ROLLBACK in >= 4/5 of seeds) and
    its final success paired with fp32 has a 95% interval inside [-0.05, 0.05]; (c) TIS and MIS on QAT
    roll back as in (a); (d) QAT+prefix and QAT+global are less stable than InterQ: a larger rollback than
    InterQ in >= 3/5 of seeds, or a seed standard deviation of final success >= 2x InterQ's. ``verdict``:
    holds, fails or not judged; ``held`` is ``verdict == holds``.

    Under a ``registration`` whose ``late`` is ``fp32_saturation``, ``late_after`` is the update the fp32
    arm saturates at (:func:`fp32_saturation`; None: it never did, and (a) and (c) are not judged), and
    (b) counts the seeds within the fp32 band when its ``b_band``."""
    rows = []
    band = fp32_band(summary)
    saturation = registration.late == "fp32_saturation"
    if saturation and late_after is None:
        late_after = math.nan
    b_limit = (band if band is not None else math.nan) if registration.b_band else ROLLBACK

    def runs(arm, dose):
        return summary[(summary["arm"] == arm) & (summary["dose"] == dose)].set_index("seed")

    def row(dose, label, arm, measured, verdict: Verdict):
        rows.append({"dose": dose, "prediction": label, "arm": arm, "measured": measured,
                     "held": verdict is Verdict.HOLDS, "verdict": verdict.value})

    for dose in doses:
        inter = runs("qat_interq", dose)
        n = len(inter) or len(runs("qat", dose))
        need_a, need_b = math.ceil(0.6 * n), math.ceil(0.8 * n)
        for label, arm in (("a", "qat"), ("c", "qat_tis"), ("c", "qat_mis")):
            r = runs(arm, dose)
            if r.empty:
                continue
            growth = float(r["k3_growth"].mean())
            if band is None:
                measured = f"no fp32 arm: no band to roll back beyond; K3 late/early {growth:.2f}"
            elif saturation and math.isnan(late_after):
                measured = (f"the fp32 arm's success never rose: no saturation to be late after; K3 late/early "
                            f"{growth:.2f}")
            else:
                k = int(late_rollbacks(r, band, updates, late_after).sum())
                when = (f"at or after update {late_after:g} (fp32 saturates)" if saturation else
                        f"after update {updates / 2:g}")
                measured = (f"rollback > {band:.3g} (the fp32 band) with the best window ending {when} in "
                            f"{k}/{len(r)} seeds; K3 late/early {growth:.2f}")
            row(dose, label, arm, measured, verdict_rolls_back(r, band, updates, need_a, late_after))
        if not inter.empty:
            k = int((inter["rollback"] <= b_limit).sum())
            d = diffs_fp32[(diffs_fp32["diff"].str.startswith("qat_interq")) & (diffs_fp32["dose"] == dose)] \
                if len(diffs_fp32) else pd.DataFrame()
            lo, hi = (float(d["final_lo"].iloc[0]), float(d["final_hi"].iloc[0])) if len(d) else (math.nan, math.nan)
            row(dose, "b", "qat_interq", f"rollback <= {b_limit:.3g} in {k}/{len(inter)} seeds; final - fp32 in "
                                         f"[{lo:.3f}, {hi:.3f}]",
                Verdict.NOT_JUDGED if not len(d) or math.isnan(b_limit) else
                Verdict.of(k >= need_b and -0.05 <= lo and hi <= 0.05))
            for arm in ("qat_prefix", "qat_global"):
                r = runs(arm, dose)
                common = r.index.intersection(inter.index)
                if not len(common):
                    continue
                larger = int((r.loc[common, "rollback"] > inter.loc[common, "rollback"]).sum())
                sd, sd_i = float(r["final"].std(ddof=1)), float(inter["final"].std(ddof=1))
                row(dose, "d", arm, f"larger rollback than InterQ in {larger}/{len(common)} seeds; final sd "
                                    f"{sd:.3f} vs InterQ {sd_i:.3f}",
                    Verdict.of(larger >= need_a or (sd_i > 0 and sd >= 2 * sd_i)))
    return pd.DataFrame(rows)


def phase_map(summary: pd.DataFrame, gate: pd.DataFrame) -> pd.DataFrame:
    """Rollback of the uncorrected arms (naive, QAT) and of InterQ against the prefix drift entering the
    last turn that the arm's learner had on the base policy (|drift| in nats, from the gate), one point
    per arm and dose, with the fp32 arm's rollback (no mismatch) as the noise band. ``prefix_rms``: the
    same learner's value of ``creditlab diagnose``'s ``mismatch.prefix_drift`` statistic on the base
    policy (:func:`diagnose_drift`), the x its thresholds are calibrated on; ``beyond_fp32_band``: seeds
    whose rollback is above the fp32 band (:func:`fp32_band`)."""
    if gate.empty:
        return pd.DataFrame()
    drift = gate.set_index("engine")
    fp = summary[summary["arm"] == "fp32"]["rollback"]
    band = fp32_band(summary)
    rows = []
    for (arm, dose), g in summary[summary["arm"].isin(["naive", "qat", "qat_interq"])].groupby(["arm", "dose"]):
        if dose not in drift.index:
            continue
        learner = "naive" if arm == "naive" else "qat"
        x = -float(drift.loc[dose, f"drift_{learner}"])
        rms = float(drift.loc[dose, f"prefix_rms_{learner}"]) if f"prefix_rms_{learner}" in drift.columns else math.nan
        rows.append({"arm": arm, "dose": dose, "drift": x, "prefix_rms": rms, **ci_columns(g["rollback"], "rollback"),
                     "rolled_back": int((g["rollback"] > ROLLBACK).sum()),
                     "beyond_fp32_band": int((g["rollback"] > band).sum()) if band is not None else math.nan,
                     "seeds": len(g), "fp32_rollback": float(fp.mean()) if len(fp) else math.nan})
    return _ordered(pd.DataFrame(rows), ["drift", "arm"]) if rows else pd.DataFrame()


def prefix_drift_calibration(m: pd.DataFrame) -> pd.DataFrame:
    """``creditlab diagnose``'s ``mismatch.prefix_drift`` thresholds from the phase map (docs/mismatch.md,
    the rule registered with the 2-core protocol): the points of the uncorrected learners (the naive and
    QAT arms), x their ``prefix_rms`` on the base policy. A point *rolls back* when at least half its seeds
    roll back beyond the fp32 band. ``fail`` is the smallest x of a point that rolls back; ``warn`` the
    largest x below it of a point that does not (the crossing lies between the two). With no point that
    rolls back there is no crossing: ``largest safe`` is the largest x measured, and the thresholds stay
    as they were reasoned."""
    cols = ["threshold", "prefix_rms", "point", "rollback", "beyond_fp32_band", "seeds"]
    if m.empty or "prefix_rms" not in m or "beyond_fp32_band" not in m:
        return pd.DataFrame(columns=cols)
    pts = m[m["arm"].isin(["naive", "qat"]) & m["prefix_rms"].notna() & m["beyond_fp32_band"].notna()]
    pts = pts.assign(rolls=pts["beyond_fp32_band"] >= pts["seeds"] / 2).sort_values("prefix_rms")

    def row(name, r):
        return {"threshold": name, "prefix_rms": float(r["prefix_rms"]), "point": f"{LABELS[r['arm']]} at {r['dose']}",
                "rollback": float(r["rollback"]), "beyond_fp32_band": int(r["beyond_fp32_band"]),
                "seeds": int(r["seeds"])}

    rolling = pts[pts["rolls"]]
    if rolling.empty:
        return pd.DataFrame([row("largest safe", pts.iloc[-1])] if len(pts) else [], columns=cols)
    fail = rolling.iloc[0]
    below = pts[(~pts["rolls"]) & (pts["prefix_rms"] < fail["prefix_rms"])]
    rows = ([row("warn", below.iloc[-1])] if len(below) else []) + [row("fail", fail)]
    return pd.DataFrame(rows, columns=cols)


#: The checks of ``creditlab diagnose`` that read the execution mismatch of a dump (the agreement table's).
MISMATCH_CHECKS = ("mismatch.k3", "mismatch.prefix_drift", "mismatch.sequence_ratio_length")
_SEVERITY = {"skipped": 0, "ok": 0, "warn": 1, "fail": 2}


def diagnose_agreement(summary: pd.DataFrame, dump_dir: str | Path, band: float | None) -> pd.DataFrame:
    """``creditlab diagnose`` on each training run's own dump (``--dump``) against that run's measured
    outcome: the status and value of each of :data:`MISMATCH_CHECKS`, the dump's verdict (the worst of
    them: ``fail`` is the CLI's exit code 1), and whether the run rolled back beyond the fp32 band
    (:func:`fp32_band`). ``agrees``: flagged (verdict ``fail``) exactly when the run rolled back. Runs
    without a dump file are left out."""
    from creditlab.diagnose.checks import run_checks
    from creditlab.diagnose.readers import read_dump

    rows = []
    for r in summary.itertuples(index=False):
        path = Path(dump_dir) / f"mismatch-{'fp32' if r.arm == 'fp32' else r.dose}-{r.arm}-seed={r.seed}.jsonl"
        if not path.exists():
            continue
        res = {c.id: c for c in run_checks(read_dump([path]), only=MISMATCH_CHECKS)}
        verdict = max((c.status for c in res.values()), key=_SEVERITY.__getitem__)
        rolls = bool(band is not None and r.rollback > band)
        row = {"arm": r.arm, "dose": r.dose, "seed": int(r.seed), "rollback": float(r.rollback),
               "rolls_back": rolls}
        for cid in MISMATCH_CHECKS:
            short = cid.split(".", 1)[1]
            row[short] = res[cid].status
            row[f"{short}_value"] = math.nan if res[cid].value is None else float(res[cid].value)
        row.update({"verdict": verdict, "agrees": (verdict == "fail") == rolls})
        rows.append(row)
    return pd.DataFrame(rows)


#: The lab's experiments: one per dose, in the order of :data:`DOSES` (``-e`` selects among them).
EXPERIMENT_TABLE = tuple(Dose(d) for d in DOSES)
#: Config fields every dose shares (all of them: a dose has no field of its own).
SHARED_FIELDS = tuple(f.name for f in dataclasses.fields(MismatchConfig))


class MismatchLab(ExperimentLab, BasePolicyLab):
    """Quantized-rollout GRPO of the toolshop agent under each correction arm (module docstring)."""

    name = "mismatch"
    summary = "Quantized rollout engine vs learner in a multi-turn agent: QAT, TIS, MIS, prefix, InterQ-RL."
    help = ("Quantized rollout engine vs learner in the multi-turn toolshop agent: arms fp32, naive, QAT, QAT+TIS, "
            "QAT+MIS, QAT+prefix, QAT+global, QAT+InterQ-RL at each engine precision of the dose (-e fp8 -e int8 "
            "-e nvfp4 -e mxfp4). The base policy ships with creditlab (its build takes 27-49 minutes on 2 cores), so "
            "no run trains it; a build of your own in the cache (CREDITLAB_CACHE) comes first. Use --workers 2 on "
            "two cores.")
    quick_help = ("Reduced run: the full run's gate table (the same shipped base policy on the same 256 tasks) and "
                  "fp32 vs QAT at NVFP4 for 4 updates, one seed: about 60 s on 2 cores, cold or warm (nothing is "
                  "built; load average 2-2.5).")
    config_type = MismatchConfig
    experiments = EXPERIMENT_TABLE
    gate_groups = ("dose",)
    compute_code = COMPUTE_CODE
    # One intra-op thread in the CLI process, as the process executor gives each worker: the lab's
    # tensors are small, and a second thread on busy cores waits more than it works (a GRPO update
    # of the tiny trainer took 7x longer with two threads than with one on a shared 2-core machine).
    threads = 1

    def predictions(self, cfg: MismatchConfig) -> dict[str, tuple[str, ...]]:
        """The lab's predictions as written before the full run (:data:`PREDICTIONS_STATED`), one section:
        they are about the dose that passes the gate, whichever experiments a run selects."""
        if cfg.protocol == "paper":
            return {"mismatch": PREDICTIONS_STATED}
        return {f"mismatch-{cfg.protocol}": REGISTRATIONS[cfg.protocol].stated}

    def describe(self, cfg: MismatchConfig) -> str:
        g = cfg.grpo
        arms = ", ".join(f"{LABELS[a]} ({'/'.join(arm_triple(a, 'P'))})" for a in cfg.arms)
        return (
            f"Multi-turn outcome GRPO of the tiny toolshop agent on chains of {', '.join(map(str, g.chain_lengths))} "
            f"tool calls, from one supervised base policy ({cfg.base.n_demos} noisy demonstrations). Arms "
            f"(rollout engine / learner / correction, P = the engine precision of the dose): {arms}. Doses: "
            f"{', '.join(cfg.experiments)}. {g.updates} updates of {g.tasks_per_update} tasks x {g.group_size} "
            f"rollouts, {g.minibatches} AdamW steps per update (lr {g.lr:g}), {cfg.seeds} paired seed(s): every arm "
            "sees the same tasks, sampling uniforms and minibatch order seed for seed. Held-out success: "
            f"{g.eval_tasks} fixed tasks every {g.eval_every} updates, sampled (temperature {g.temperature:g}) by the "
            "fp32 engine with the same uniforms for every arm and every evaluation. Final success is the mean "
            f"of the last {cfg.smooth} evaluation points, best the largest mean of {cfg.smooth} consecutive points, "
            "rollback = best - final." + self._map_note(cfg))

    @staticmethod
    def _map_note(cfg: MismatchConfig) -> str:
        mapped = [d for d in cfg.experiments if d in cfg.map_doses]
        if not mapped:
            return ""
        return (f" The phase map's doses {', '.join(mapped)} run only {', '.join(LABELS[a] for a in cfg.map_arms)} "
                f"on {cfg.map_seeds} paired seed(s) (seeds 0-{cfg.map_seeds - 1}).")

    def gate(self, rows: dict[str, pd.DataFrame], cfg: MismatchConfig) -> Table | None:
        if "dose" not in rows:
            return None
        return Table(gate_table(rows["dose"]), f"Gate: the base policy before training (QAT's drift entering the "
                                               f"last turn >= {GATE_DRIFT:g} nat)", ".3g", console=True)

    def tables(self, rows: dict[str, pd.DataFrame], cfg: MismatchConfig) -> dict[str, Table]:
        df = rows["train"]
        df = df[df["dose"].isin(["fp32", *cfg.experiments]) & df["arm"].isin((*cfg.arms, *cfg.map_arms))]
        doses = [d for d in cfg.experiments if d in set(df["dose"])]
        summary = _summary(df, cfg)
        tabs = {"knobs": Table(_knobs(cfg), "Knobs chosen for this lab, and why")}
        if "dose" in rows:
            tabs["gate"] = self.gate(rows, cfg)
            tabs["dose"] = Table(rows["dose"], "The dose: engine/learner mismatch of the base policy", ".3g")
        tabs |= {
                "summary": Table(summary, "Summary per arm, dose and seed (held-out success, fp32 engine)", ".3g"),
                "means": Table(_means(summary, doses), "Means over seeds with 95% intervals", ".3g", console=True)}
        for ref in ("qat", "fp32"):
            d = _diffs(summary, doses, ref)
            if len(d):
                tabs[f"diff_vs_{ref}"] = Table(d, f"Paired differences against {LABELS[ref]} (same seeds)", ".3g")
        diffs = tabs["diff_vs_fp32"].frame if "diff_vs_fp32" in tabs else pd.DataFrame()
        reg = REGISTRATIONS[cfg.protocol]
        late_after = fp32_saturation(df[df["arm"] == "fp32"], cfg.smooth) if reg.late == "fp32_saturation" else None
        tabs["predictions"] = Table(predictions_table(summary, diffs, doses, cfg.grpo.updates, reg, late_after),
                                    f"The predictions ({cfg.protocol} registration), tested on this run", console=True)
        if "gate" in tabs:
            tabs["phase_map"] = Table(phase_map(summary, tabs["gate"].frame),
                                      "Phase map: rollback against the prefix drift entering the last turn", ".3g")
            cal = prefix_drift_calibration(tabs["phase_map"].frame)
            if len(cal):
                tabs["prefix_drift_calibration"] = Table(
                    cal, "creditlab diagnose's mismatch.prefix_drift thresholds from the phase map", ".3g",
                    console=True)
        if cfg.dump_dir and Path(cfg.dump_dir).is_dir():
            agree = diagnose_agreement(summary, cfg.dump_dir, fp32_band(summary))
            if len(agree):
                tabs["diagnose_agreement"] = Table(
                    agree, "creditlab diagnose on each run's own dump against its measured rollback", ".3g",
                    console=True)
        by_turn = _by_turn(df, cfg)
        tabs["by_turn"] = Table(by_turn, "Prefix and current log ratio by turn", ".3g", report=False)
        tabs["fingerprint"] = Table(_fingerprint(by_turn),
                                    "Fingerprint: mean prefix and current log ratio by turn (all updates)", ".2g")
        cols = ["arm", "dose", "seed", "update"] + [c for c in CURVE_COLUMNS if c in df.columns]
        curves = df[cols].rename(columns=CURVE_COLUMNS).sort_values(["dose", "arm", "seed", "update"])
        tabs["curves"] = Table(curves.reset_index(drop=True), "Every update of every run", ".3g", report=False)
        return tabs

    def plots(self, tabs: dict[str, Table], cfg: MismatchConfig, out: Path) -> list[Path]:
        curves, means = tabs["curves"].frame, tabs["means"].frame
        doses = [d for d in cfg.experiments if d in set(curves["dose"])]
        made = [_plot_success(curves, doses, cfg, out), _plot_k3(curves, doses, cfg, out)]
        if len(tabs["by_turn"].frame):
            made.append(_plot_fingerprint(tabs["by_turn"].frame, doses, out))
        made.append(_plot_dose(means, doses, out))
        if "thought_entropy" in curves.columns and curves["thought_entropy"].notna().any():
            made.append(_plot_entropy(curves, doses, out))
        if "phase_map" in tabs and len(tabs["phase_map"].frame):
            made.append(_plot_phase_map(tabs["phase_map"].frame, out))
        return made

    def interpret(self, tabs: dict[str, Table], cfg: MismatchConfig) -> dict[str, str]:
        few = small_run_note(cfg.seeds)
        s, m = tabs["summary"].frame, tabs["means"].frame
        text: dict[str, str] = {
            "knobs": "Every setting of this run that a person chose, with the reason; none was tuned to make an arm "
                     "win or lose. Settings not listed are the defaults of GRPOConfig and BaseConfig (the toolshop "
                     "lab's) and of the correction arms in creditlab.core.correction."}
        if "dose" in tabs:
            text["gate"] = _read_gate(tabs["gate"].frame)
            text["dose"] = _read_dose(tabs["dose"].frame, cfg)
        text["predictions"] = _read_predictions(tabs["predictions"].frame, cfg) + few
        if "phase_map" in tabs:
            text["phase_map"] = _read_phase_map(tabs["phase_map"].frame)
        if "prefix_drift_calibration" in tabs:
            text["prefix_drift_calibration"] = _read_calibration(tabs["prefix_drift_calibration"].frame)
        if "diagnose_agreement" in tabs:
            text["diagnose_agreement"] = _read_agreement(tabs["diagnose_agreement"].frame, fp32_band(s))
        noise = _noise_floor(s)
        text["summary"] = (
            "One row per run. final: mean held-out success of the last evaluation points; best: the best such "
            "window anywhere in training; rollback = best - final; AULC: mean held-out success over all evaluation "
            "points; interaction cost: mean turns of the successful held-out episodes; cap exhaustion: share of the "
            "failed held-out episodes that used the whole action budget; K3 early/late: mean K3(engine || learner) "
            "per policy token over the first and last third of the updates, k3_growth = late / early. "
            + (f"Rollback of the fp32 arm, which has no mismatch, is {noise:.3g} on average: rollbacks of that size "
               "are the noise of the evaluation and of RL itself, not a collapse." if not math.isnan(noise) else "")
            + few)
        text["means"] = _read_means(m, cfg) + few
        for ref in ("qat", "fp32"):
            name = f"diff_vs_{ref}"
            if name not in tabs:
                continue
            d = tabs[name].frame
            parts = []
            for metric in ("final", "rollback"):
                sub = d.rename(columns={metric: "mean", f"{metric}_lo": "lo", f"{metric}_hi": "hi"})
                for what, g in sub.groupby("diff", sort=False):
                    parts.append(f"[{metric}] " + read_diff(g[["dose", "mean", "lo", "hi", "n"]], ["dose"], what))
            text[name] = (f"Paired differences (arm - {LABELS[ref]}, same seeds, same evaluation) of final held-out "
                          "success, rollback and AULC. " + " ".join(parts))
        text["fingerprint"] = _read_fingerprint(tabs["by_turn"].frame)
        return text


LAB = MismatchLab()


def _noise_floor(summary: pd.DataFrame) -> float:
    fp = summary[summary["arm"] == "fp32"]["rollback"]
    return float(fp.mean()) if len(fp) else math.nan


def _read_gate(g: pd.DataFrame) -> str:
    if g.empty:
        return "No dose was measured with both an fp32 and a QAT learner."
    parts = [f"{r.engine}: {r.policy_tokens:.0f} policy tokens per trajectory, drift entering the last turn "
             f"{r.drift_naive:.2f} nat naive and {r.drift_qat:.2f} QAT ({r.gate})" for r in g.itertuples()]
    passing = list(g[g["gate"] == "pass"]["engine"])
    return ("Measured on the base policy's own trajectories before any arm trains. The drift is the summed "
            "learner - engine log ratio of the policy tokens before the last turn: negative because the engine "
            "drew those tokens (its mean is minus their KL), and what a prefix correction multiplies the last "
            f"turn's gradient by (as exp). The gate asks |QAT drift| >= {GATE_DRIFT:g} nat. " + "; ".join(parts)
            + ". " + (f"Doses that pass: {', '.join(passing)}." if passing else
                      "No dose passes: in this world QAT's residual mismatch does not reach the regime the "
                      "predictions are about; their outcome below says nothing about it."))


def _read_predictions(p: pd.DataFrame, cfg: MismatchConfig) -> str:
    if p.empty:
        return "The predictions need the QAT, InterQ and fp32 arms; this run has not got them."
    said = {"holds": "held", "fails": "did not hold", "not judged": "not judged"}
    parts = [f"({r.prediction}) {LABELS[r.arm]} at {r.dose}: {r.measured}: {said[r.verdict]}" for r in p.itertuples()]
    short = (f" This run has {cfg.grpo.updates} updates: the predictions are about rollback after hundreds of "
             "updates (QAT peaks near 300 in the paper), so these verdicts test nothing."
             if cfg.grpo.updates < 100 else "")
    return ("Each prediction of docs/mismatch.md (fixed before the full run) against this run's summary table. "
            + "; ".join(parts) + "." + short)


def _read_phase_map(m: pd.DataFrame) -> str:
    if m.empty:
        return "No phase-map point: the run has no gate measurement for its doses."
    parts = [f"{LABELS[r.arm]} at {r.dose} (drift {r.drift:.2f} nat): rollback {r.rollback:.3f}, "
             f"{r.rolled_back}/{r.seeds} seeds > {ROLLBACK:g}" for r in m.itertuples()]
    return ("One point per arm and dose: x the |drift| entering the last turn that arm's learner had on the base "
            "policy, y its mean rollback (95% interval over seeds); the fp32 arm's rollback is the band of "
            "training without mismatch. " + "; ".join(parts) + ".")


def _read_calibration(c: pd.DataFrame) -> str:
    from creditlab.diagnose.checks import DRIFT_FAIL, DRIFT_WARN

    rule = ("x: the learner's value of diagnose's statistic (RMS prefix log ratio at the last turn with 20+ tokens) on "
            "the base policy; a point rolls back when at least half its seeds roll back beyond the fp32 band. ")
    by = c.set_index("threshold")
    if "largest safe" in by.index:
        r = by.loc["largest safe"]
        return (rule + f"No point rolls back: there is no crossing to calibrate on. Training was safe up to "
                f"{r['prefix_rms']:.3g} ({r['point']}); the thresholds ({DRIFT_WARN:g} / {DRIFT_FAIL:g}) stay as "
                "they were reasoned.")
    f = by.loc["fail"]
    text = rule + f"Rollback begins by {f['prefix_rms']:.3g} ({f['point']}, {f['beyond_fp32_band']}/{f['seeds']} seeds)"
    if "warn" in by.index:
        w = by.loc["warn"]
        text += (f"; the largest point below it that does not roll back is at {w['prefix_rms']:.3g} ({w['point']}): "
                 "the crossing lies between the two")
    return text + f". The check's thresholds today: warn {DRIFT_WARN:g}, fail {DRIFT_FAIL:g}."


def _read_agreement(a: pd.DataFrame, band: float | None) -> str:
    parts = [f"{LABELS[r.arm]} at {r.dose} seed {r.seed}: {r.verdict} (k3 {r.k3}, prefix_drift {r.prefix_drift}, "
             f"sequence_ratio_length {r.sequence_ratio_length}), rollback {r.rollback:.3f}"
             f"{' beyond the band' if r.rolls_back else ''}: {'agrees' if r.agrees else 'disagrees'}"
             for r in a.itertuples()]
    wrong = a[~a["agrees"]]
    corrected = wrong[wrong["arm"].isin(["qat_tis", "qat_mis", "qat_interq", "qat_prefix", "qat_global"])]
    band_text = f"{band:.3g}" if band is not None else "not measured (no fp32 run)"
    return ("creditlab diagnose's mismatch checks on each run's own training dump (every update's rollouts), "
            f"against whether that run rolled back beyond the fp32 band ({band_text}, this run's). A dump is "
            "flagged when a check fails (the CLI's exit code 1). " + "; ".join(parts) + ". "
            + (f"{len(a) - len(wrong)} of {len(a)} agree."
               + (f" Of the {len(wrong)} that disagree, {len(corrected)} are correction arms: diagnose reads the "
                  "engine's and the learner's log-probs, which a correction leaves as they are (it reweights the "
                  "loss), so it flags the mismatch a correction is there to handle." if len(corrected) else "")
               if len(a) else ""))


def _read_dose(d: pd.DataFrame, cfg: MismatchConfig) -> str:
    k3 = d.set_index(["engine", "learner"])["k3"]
    parts = [f"{e}: {k3[(e, 'fp32')]:.2g} naive, {k3[(e, 'QAT')]:.2g} QAT ({1 - k3[(e, 'QAT')] / k3[(e, 'fp32')]:.0%} "
             "removed)" for e in DOSES if (e, "QAT") in k3.index]
    return ("K3(engine || learner) per policy token and the prefix log ratio at the first and last turn, measured "
            f"on the base policy's own trajectories ({cfg.dose_tasks} held-out tasks) before any training, for every "
            "engine against an fp32 learner and a quantization-aware one; engine_success is the base policy's success "
            "when that engine runs it. " + "; ".join(parts) + ".")


def _read_means(m: pd.DataFrame, cfg: MismatchConfig) -> str:
    parts = []
    for dose, g in m.groupby("dose", sort=False):
        g = g.set_index("arm")
        items = ", ".join(f"{LABELS[a]} {r.final:.2f}" for a, r in g.iterrows())
        worst = g["rollback"].idxmax()
        k3 = ", ".join(f"{LABELS[a]} {r.k3_late:.2g}" for a, r in g.iterrows() if a != "fp32")
        parts.append(f"{dose}: final success {items}; largest mean rollback {g.loc[worst, 'rollback']:.3f} "
                     f"({LABELS[worst]}); late K3 {k3}.")
    return ("Means over seeds (95% intervals in the table), the fp32 arm repeated under every dose. "
            + " ".join(parts))


def _read_fingerprint(by_turn: pd.DataFrame) -> str:
    if by_turn.empty:
        return "No turn-level mismatch metrics were recorded."
    d = by_turn[by_turn["phase"] == "all"]
    parts = []
    for (dose, arm), g in d.groupby(["dose", "arm"], sort=False):
        if arm not in ("naive", "qat") or len(g) < 2:
            continue
        g = g.sort_values("turn")
        parts.append(f"{LABELS[arm]} at {dose}: prefix {g['prefix'].iloc[0]:.2g} at turn 0 -> "
                     f"{g['prefix'].iloc[-1]:.2g} at turn {int(g['turn'].iloc[-1])}, current "
                     f"{g['current'].iloc[0]:.2g} -> {g['current'].iloc[-1]:.2g}")
    return ("Mean log ratio (learner - engine) of the policy tokens of each turn (current) and of the whole "
            "execution prefix up to them (prefix), over all updates and seeds. A prefix that grows with the turn "
            "while the current ratio stays flat is the compounding the prefix corrections target. "
            + "; ".join(parts) + ".")


COLORS = {"fp32": "black", "naive": "tab:red", "qat": "tab:blue", "qat_tis": "tab:orange", "qat_mis": "tab:brown",
          "qat_prefix": "tab:purple", "qat_global": "tab:olive", "qat_interq": "tab:green"}


def _runs_for(curves: pd.DataFrame, dose: str) -> pd.DataFrame:
    fp = curves[curves["arm"] == "fp32"].assign(dose=dose)
    return pd.concat([fp, curves[(curves["dose"] == dose) & (curves["arm"] != "fp32")]])


def _band(ax, df: pd.DataFrame, value: str, arm: str, log: bool = False) -> None:
    g = df.dropna(subset=[value]).groupby("update")[value]
    x = g.mean().index.to_numpy()
    if log:
        y = g.apply(lambda v: float(np.exp(np.log(np.maximum(v, 1e-12)).mean()))).to_numpy()
    else:
        y = g.mean().to_numpy()
    ax.plot(x, y, color=COLORS[arm], label=LABELS[arm], lw=1.6 if arm in ("fp32", "qat", "qat_interq") else 1.1)
    if g.size().min() > 1:
        ax.fill_between(x, g.min().to_numpy(), g.max().to_numpy(), color=COLORS[arm], alpha=0.08)


def _legend_where_most(axes, loc: str) -> None:
    """One legend, on the panel that shows the most arms (a dose with every arm, not the last panel)."""
    ax = max(axes, key=lambda a: len(a.get_legend_handles_labels()[1]))
    ax.legend(loc=loc, fontsize=8)


def _plot_success(curves: pd.DataFrame, doses: list[str], cfg: MismatchConfig, out: Path) -> Path:
    fig, axes = new_figure(1, len(doses), figsize=(5.2 * len(doses), 4.2), squeeze=False)
    for ax, dose in zip(axes[0], doses, strict=True):
        runs = _runs_for(curves, dose)
        for arm in [a for a in ARMS if a in set(runs["arm"])]:
            _band(ax, runs[runs["arm"] == arm], "success", arm)
        ax.set_title(f"engine {dose}: held-out success (fp32, sampled)")
        ax.set_xlabel("update")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("success (mean over seeds; band: min-max)")
    _legend_where_most(axes[0], loc="lower right")
    return save(fig, out / "mismatch_success.png")


def _plot_k3(curves: pd.DataFrame, doses: list[str], cfg: MismatchConfig, out: Path) -> Path:
    fig, axes = new_figure(1, len(doses), figsize=(5.2 * len(doses), 4.2), squeeze=False, sharey=True)
    for ax, dose in zip(axes[0], doses, strict=True):
        runs = curves[(curves["dose"] == dose) & (curves["arm"] != "fp32")].copy()
        runs["k3"] = runs.groupby(["arm", "seed"])["k3"].transform(lambda v: v.rolling(5, min_periods=1).mean())
        for arm in [a for a in ARMS if a in set(runs["arm"])]:
            _band(ax, runs[runs["arm"] == arm], "k3", arm, log=True)
        ax.set_yscale("log")
        ax.set_title(f"engine {dose}: K3(engine || learner) per policy token")
        ax.set_xlabel("update")
    axes[0][0].set_ylabel("K3 (5-update rolling mean; geometric mean over seeds)")
    _legend_where_most(axes[0], loc="upper right")
    return save(fig, out / "mismatch_k3.png")


def _plot_fingerprint(by_turn: pd.DataFrame, doses: list[str], out: Path) -> Path:
    """Top row: the naive arm (fp32 learner); bottom row: QAT and QAT+InterQ, on their own scale
    (means over seeds; the per-seed spread is in the ``by_turn`` table)."""
    fig, axes = new_figure(2, len(doses), figsize=(5.2 * len(doses), 7.2), squeeze=False)
    d = by_turn[by_turn["phase"] == "all"]
    for col, dose in enumerate(doses):
        for row, arms in enumerate((("naive",), ("qat", "qat_interq"))):
            ax = axes[row][col]
            shown = []
            for arm in arms:
                g = d[(d["dose"] == dose) & (d["arm"] == arm)].sort_values("turn")
                if g.empty:
                    continue
                shown.append(arm)
                ax.plot(g["turn"], g["prefix"], "o-", color=COLORS[arm], label=f"{LABELS[arm]}: prefix")
                ax.plot(g["turn"], g["current"], "s--", color=COLORS[arm], alpha=0.8, label=f"{LABELS[arm]}: current")
            ax.axhline(0, color="gray", lw=0.8)
            ax.set_title(f"engine {dose}: {' and '.join(LABELS[a] for a in shown) or 'no run'}")
            ax.set_xlabel("turn index")
            if shown:
                ax.legend(fontsize=8, loc="lower left")
        axes[0][0].set_ylabel("mean log ratio learner - engine")
        axes[1][0].set_ylabel("mean log ratio learner - engine")
    return save(fig, out / "mismatch_fingerprint.png")


def _plot_entropy(curves: pd.DataFrame, doses: list[str], out: Path) -> Path:
    """The engine's entropy on thought tokens and on tool-call tokens over training, per dose."""
    fig, axes = new_figure(1, len(doses), figsize=(5.2 * len(doses), 4.2), squeeze=False, sharey=True)
    for ax, dose in zip(axes[0], doses, strict=True):
        runs = _runs_for(curves, dose)
        for arm in [a for a in ARMS if a in set(runs["arm"])]:
            _band(ax, runs[runs["arm"] == arm], "thought_entropy", arm)
        for arm in [a for a in ("fp32", "qat") if a in set(runs["arm"])]:
            g = runs[runs["arm"] == arm].groupby("update")["action_entropy"].mean()
            ax.plot(g.index, g.to_numpy(), ":", color=COLORS[arm], label=f"{LABELS[arm]}: tool-call tokens")
        ax.set_title(f"engine {dose}: policy entropy (thoughts solid)")
        ax.set_xlabel("update")
    axes[0][0].set_ylabel("mean entropy of the sampled position (nats)")
    axes[0][-1].legend(loc="center right", fontsize=7)
    return save(fig, out / "mismatch_entropy.png")


def _plot_phase_map(m: pd.DataFrame, out: Path) -> Path:
    fig, axes = new_figure(1, 1, figsize=(6.4, 4.4), squeeze=False)
    ax = axes[0][0]
    for arm, g in m.groupby("arm", sort=False):
        err = np.vstack([(g["rollback"] - g["rollback_lo"]).clip(lower=0),
                         (g["rollback_hi"] - g["rollback"]).clip(lower=0)])
        ax.errorbar(g["drift"], g["rollback"], yerr=err, fmt="o", color=COLORS[arm], label=LABELS[arm], capsize=3)
        for r in g.itertuples():
            ax.annotate(r.dose, (r.drift, r.rollback), textcoords="offset points", xytext=(4, 4), fontsize=7)
    fp = float(m["fp32_rollback"].iloc[0])
    if not math.isnan(fp):
        ax.axhline(fp, color="black", lw=1, ls="--", label="fp32 rollback (no mismatch)")
    ax.axhline(ROLLBACK, color="gray", lw=0.8, ls=":", label=f"rollback threshold {ROLLBACK:g}")
    ax.set_xlim(min(0.0, float(m["drift"].min())), max(1.0, 1.15 * float(m["drift"].max())))
    ax.set_xlabel("|prefix drift| entering the last turn, base policy (nats)")
    ax.set_ylabel("rollback = best - final (mean, 95% interval)")
    ax.legend(fontsize=8)
    return save(fig, out / "mismatch_phase_map.png")


def _plot_dose(means: pd.DataFrame, doses: list[str], out: Path) -> Path:
    """Rollback and final success of each arm against the engine precision, the doses ordered by
    the residual mismatch the QAT arm measured (its late K3)."""
    qat = means[means["arm"] == "qat"].set_index("dose")["k3_late"]
    doses = sorted(doses, key=lambda d: float(qat.get(d, math.nan)) if d in qat.index else math.inf)
    fig, axes = new_figure(1, 2, figsize=(11, 4.2))
    x = np.arange(len(doses))
    arms = [a for a in ARMS if a in set(means["arm"])]
    width = 0.8 / max(len(arms), 1)
    ticks = [f"{d}\n(QAT K3 {qat[d]:.1e})" if d in qat.index else d for d in doses]
    for ax, metric, label in ((axes[0], "rollback", "rollback = best - final"), (axes[1], "final", "final success")):
        for i, arm in enumerate(arms):
            g = means[means["arm"] == arm].set_index("dose").reindex(doses)
            xs = x - 0.4 + width * (i + 0.5)
            err = np.vstack([(g[metric] - g[f"{metric}_lo"]).fillna(0).clip(lower=0),
                             (g[f"{metric}_hi"] - g[metric]).fillna(0).clip(lower=0)])
            ax.bar(xs, g[metric], width, yerr=err, color=COLORS[arm], label=LABELS[arm], capsize=2,
                   error_kw={"elinewidth": 0.8})
        ax.set_xticks(x, ticks)
        ax.set_xlabel("rollout engine precision (dose), by the residual mismatch under QAT")
        ax.set_ylabel(f"{label} (mean, 95% interval over seeds)")
    axes[1].set_ylim(0, 1)
    axes[0].legend(fontsize=8, ncol=2)
    return save(fig, out / "mismatch_dose.png")
