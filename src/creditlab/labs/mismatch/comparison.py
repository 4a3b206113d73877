"""The mismatch lab's comparison across doses: an experiment that runs in every selection (``always``), makes
no cells of its own and reads the rows of the doses a run selects (their ``train`` runs and the gate's
``dose`` measurement).

Its tables: ``summary`` (per arm, dose and seed: final and best held-out success, rollback, AULC,
interaction cost, cap exhaustion, K3 early and late), ``means``, the paired differences against QAT and
against fp32, the ``phase_map`` (rollback against the prefix drift entering the last turn) with the
``prefix_drift_calibration`` of ``creditlab diagnose``'s thresholds, the ``diagnose_agreement`` of a run
with ``--dump``, ``by_turn`` and its ``fingerprint``, and every update's ``curves``; its plots; and the
predictions (a)-(d) of the registered protocol (:data:`REGISTRATIONS`), judged per dose and arm by the
rules of :func:`verdict_rolls_back`, :func:`verdict_stays` and :func:`verdict_less_stable`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from creditlab.core.diagnostics import aulc, rollback
from creditlab.lab.experiment import Experiment, Prediction, Tables, Verdict
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table, diff_paths
from creditlab.lab.report import ci_columns, group_means, paired_diff, read_diff, small_run_note, sort_in_order
from creditlab.lab.runner import Cell
from creditlab.labs.mismatch.ablation import DUAL_CLIP_STATED, ablation_predictions
from creditlab.labs.mismatch.config import ARMS, DIFF, DOSES, LABELS, ROLLBACK, UNIT, MismatchConfig
from creditlab.labs.mismatch.gate import gate_table

__all__ = ["EXPERIMENT", "PREDICTIONS_STATED", "REGISTRATIONS", "TWO_CORE_STATED", "Comparison", "Registration",
           "calibration_scope", "diagnose_agreement", "dump_name", "fp32_band", "fp32_saturation", "late_rollbacks",
           "phase_map", "prefix_drift_calibration", "score_curve", "verdict_less_stable", "verdict_rolls_back",
           "verdict_stays"]


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
        beside = {}
        if "eval_fp32/success" in ev.columns and ev["eval_fp32/success"].notna().any():  # scored on the engine
            beside = {"final_fp32": score_curve(ev["update"].to_numpy(), ev["eval_fp32/success"].to_numpy(),
                                                cfg.smooth)["final"]}
        rows.append({"arm": arm, "dose": dose, "seed": int(seed),
                     **score_curve(ev["update"].to_numpy(), ev["eval/success"].to_numpy(), cfg.smooth), **beside,
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
    if "final_fp32" in summary.columns:
        intervals.insert(1, ("final_fp32", UNIT))
    means = group_means(_with_fp32_per_dose(summary, doses), ["dose", "arm"], intervals,
                        ("interaction_cost", "cap_exhaustion"))
    return _ordered(means, ["dose", "arm"])


def _diffs(summary: pd.DataFrame, doses: list[str], ref: str) -> pd.DataFrame:
    df = _with_fp32_per_dose(summary, doses)
    arms = [a for a in ARMS if a != ref and a in set(df["arm"])]
    if ref not in set(df["arm"]):
        return pd.DataFrame()
    metrics = ("final", "rollback", "aulc", *(("final_fp32",) if "final_fp32" in df.columns else ()))
    out = []
    for a in arms:
        merged = None
        for m in metrics:
            d = paired_diff(df, a, ref, ["dose"], m, bounds=DIFF).rename(
                columns={"mean": m, "lo": f"{m}_lo", "hi": f"{m}_hi"})
            merged = d if merged is None else merged.merge(d.drop(columns=["n"]), on=["diff", "dose"])
        out.append(merged)
    res = pd.concat(out, ignore_index=True)
    cols = ["diff", "dose"] + [c for m in metrics for c in (m, f"{m}_lo", f"{m}_hi")] + ["n"]
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


CURVE_COLUMNS = {"eval/success": "success", "reward/success": "train_success", "mismatch/k3": "k3",
                 "mismatch/mean_abs_delta": "mean_abs_delta", "mismatch/seq_k3": "seq_k3",
                 "correction/clip_rate": "clip_rate", "correction/weight_mean": "weight_mean",
                 "correction/weight_min": "weight_min", "correction/weight_max": "weight_max",
                 "loss/clip_frac": "ppo_clip_frac", "grad_norm": "grad_norm", "episode/tool_calls": "tool_calls",
                 "policy/thought_entropy": "thought_entropy", "policy/action_entropy": "action_entropy",
                 "episode/policy_tokens": "policy_tokens"}


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


def verdict_stays(inter: pd.DataFrame, diff: pd.DataFrame, limit: float, seeds_needed: int) -> Verdict:
    """Prediction (b) on QAT+InterQ's runs at a dose (its rows of ``summary``, by seed) and its row of
    ``diff_vs_fp32`` there: it does not roll back (``rollback <= limit``) in ``seeds_needed`` seeds, and the
    95% interval of its final success minus fp32's lies inside [-0.05, +0.05]. Not judged without that paired
    difference, or without a limit (the fp32 band, under a registration that counts within it, and no fp32
    run); with too few seeds for an interval (one), ``fails`` when the rollback part fails, else not judged."""
    if inter.empty or diff.empty or math.isnan(limit):
        return Verdict.NOT_JUDGED
    k = int((inter["rollback"] <= limit).sum())
    lo, hi = float(diff["final_lo"].iloc[0]), float(diff["final_hi"].iloc[0])
    if k < seeds_needed:
        return Verdict.FAILS
    if math.isnan(lo) or math.isnan(hi):
        return Verdict.NOT_JUDGED  # no interval: the second part cannot be told
    return Verdict.of(-0.05 <= lo and hi <= 0.05)


def verdict_less_stable(runs: pd.DataFrame, inter: pd.DataFrame, seeds_needed: int) -> Verdict:
    """Prediction (d) on an arm's runs at a dose and QAT+InterQ's (rows of ``summary``, by seed): a larger
    rollback than InterQ in ``seeds_needed`` of their common seeds, or a seed standard deviation of final
    success at least 2x InterQ's. Not judged without a common seed."""
    common = runs.index.intersection(inter.index)
    if not len(common):
        return Verdict.NOT_JUDGED
    larger = int((runs.loc[common, "rollback"] > inter.loc[common, "rollback"]).sum())
    sd, sd_i = float(runs["final"].std(ddof=1)), float(inter["final"].std(ddof=1))
    return Verdict.of(larger >= seeds_needed or (sd_i > 0 and sd >= 2 * sd_i))


#: The predictions as written before the full run (docs/mismatch.md, "Predictions (fixed before the full
#: run)"): the scope, then (a)-(d), word for word: what a run records at its start. They are about the dose
#: that passes the gate; the comparison's :class:`~creditlab.lab.experiment.Prediction` s judge (a)-(d).
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


@dataclass(frozen=True)
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
                 "two-core": Registration(TWO_CORE_STATED, "fp32_saturation", True),
                 # (A1)-(A4) of labs/mismatch/ablation.py, judged on paired differences, not on (a)-(d)'s rules
                 "dual-clip": Registration(DUAL_CLIP_STATED, "fp32_saturation", True)}


#: The arms each prediction is judged on at each dose, in the predictions table's order.
JUDGED = (("a", "qat"), ("b", "qat_interq"), ("c", "qat_tis"), ("c", "qat_mis"), ("d", "qat_prefix"),
          ("d", "qat_global"))


def _claim(letter: str, arm: str, dose: str) -> str:
    what = {"a": "QAT rolls back late, with K3 late / early > 1",
            "b": "QAT+InterQ does not roll back, and its final success is within 0.05 of fp32's",
            "c": f"{LABELS[arm]} still rolls back as in (a)",
            "d": f"{LABELS[arm]} is less stable than QAT+InterQ"}[letter]
    return f"({letter}) at {dose}: {what}"


def _frame(tabs: Tables, name: str) -> pd.DataFrame | None:
    return tabs[name].frame if name in tabs else None


def _runs(summary: pd.DataFrame, arm: str, dose: str) -> pd.DataFrame:
    return summary[(summary["arm"] == arm) & (summary["dose"] == dose)].set_index("seed")


@dataclass(frozen=True)
class _Rules:
    """How a registration's rules read a run's tables (its ``summary``, ``diff_vs_fp32`` and ``curves``): the
    measured text and the verdict of (a)-(d) at one dose and arm, pure functions of the tables."""

    registration: Registration
    updates: int
    smooth: int

    def late_after(self, tabs: Tables) -> float | None:
        """The update the fp32 arm saturates at (NaN: it never did) when the registration reads "late" from it;
        None when "late" is the second half of the updates."""
        if self.registration.late != "fp32_saturation":
            return None
        curves = _frame(tabs, "curves")
        fp = (curves[curves["arm"] == "fp32"].rename(columns={"success": "eval/success"}) if curves is not None
              else pd.DataFrame())
        late = fp32_saturation(fp, self.smooth)
        return math.nan if late is None else late

    @staticmethod
    def _needed(summary: pd.DataFrame, dose: str, share: float) -> int:
        """The seeds a prediction needs at ``dose``: ``share`` of InterQ's seeds (or QAT's, without InterQ)."""
        return math.ceil(share * (len(_runs(summary, "qat_interq", dose)) or len(_runs(summary, "qat", dose))))

    def prediction(self, letter: str, arm: str, dose: str, selected: bool = True) -> Prediction:
        """``letter``'s prediction at ``dose`` on ``arm``; one of a dose the run does not select is recorded (its
        text) and never judged."""
        stated = self.registration.stated["abcd".index(letter) + 1]
        if not selected:
            return Prediction(_claim(letter, arm, dose), stated, measured=lambda t: None,
                              verdict=lambda t: Verdict.NOT_JUDGED)
        if letter in "ac":
            return Prediction(_claim(letter, arm, dose), stated, measured=lambda t: self._rolls_back(t, arm, dose),
                              verdict=lambda t: self._rolls_back_verdict(t, arm, dose))
        if letter == "b":
            return Prediction(_claim(letter, arm, dose), stated, measured=lambda t: self._stays(t, dose),
                              verdict=lambda t: self._stays_verdict(t, dose))
        return Prediction(_claim(letter, arm, dose), stated, measured=lambda t: self._less_stable(t, arm, dose),
                          verdict=lambda t: self._less_stable_verdict(t, arm, dose))

    # (a) and (c)
    def _rolls_back(self, tabs: Tables, arm: str, dose: str) -> str | None:
        summary = _frame(tabs, "summary")
        r = _runs(summary, arm, dose) if summary is not None else pd.DataFrame()
        if r.empty:
            return None
        band, late_after = fp32_band(summary), self.late_after(tabs)
        growth = float(r["k3_growth"].mean())
        if band is None:
            return f"no fp32 arm: no band to roll back beyond; K3 late/early {growth:.2f}"
        if late_after is not None and math.isnan(late_after):
            return f"the fp32 arm's success never rose: no saturation to be late after; K3 late/early {growth:.2f}"
        k = int(late_rollbacks(r, band, self.updates, late_after).sum())
        when = (f"at or after update {late_after:g} (fp32 saturates)" if late_after is not None else
                f"after update {self.updates / 2:g}")
        return (f"rollback > {band:.3g} (the fp32 band) with the best window ending {when} in {k}/{len(r)} seeds; "
                f"K3 late/early {growth:.2f}")

    def _rolls_back_verdict(self, tabs: Tables, arm: str, dose: str) -> Verdict:
        summary = _frame(tabs, "summary")
        if summary is None:
            return Verdict.NOT_JUDGED
        return verdict_rolls_back(_runs(summary, arm, dose), fp32_band(summary), self.updates,
                                  self._needed(summary, dose, 0.6), self.late_after(tabs))

    # (b)
    def _limit(self, summary: pd.DataFrame) -> float:
        band = fp32_band(summary)
        return (band if band is not None else math.nan) if self.registration.b_band else ROLLBACK

    @staticmethod
    def _diff(tabs: Tables, dose: str) -> pd.DataFrame:
        d = _frame(tabs, "diff_vs_fp32")
        if d is None or not len(d):
            return pd.DataFrame()
        return d[(d["diff"].str.startswith("qat_interq")) & (d["dose"] == dose)]

    def _stays(self, tabs: Tables, dose: str) -> str | None:
        summary = _frame(tabs, "summary")
        inter = _runs(summary, "qat_interq", dose) if summary is not None else pd.DataFrame()
        if inter.empty:
            return None
        limit, d = self._limit(summary), self._diff(tabs, dose)
        k = int((inter["rollback"] <= limit).sum())
        lo, hi = (float(d["final_lo"].iloc[0]), float(d["final_hi"].iloc[0])) if len(d) else (math.nan, math.nan)
        interval = (f"final - fp32 in [{lo:.3f}, {hi:.3f}]" if not (math.isnan(lo) or math.isnan(hi)) else
                    "no interval of final - fp32 (too few seeds)")
        return f"rollback <= {limit:.3g} in {k}/{len(inter)} seeds; {interval}"

    def _stays_verdict(self, tabs: Tables, dose: str) -> Verdict:
        summary = _frame(tabs, "summary")
        if summary is None:
            return Verdict.NOT_JUDGED
        return verdict_stays(_runs(summary, "qat_interq", dose), self._diff(tabs, dose), self._limit(summary),
                             self._needed(summary, dose, 0.8))

    # (d)
    def _less_stable(self, tabs: Tables, arm: str, dose: str) -> str | None:
        summary = _frame(tabs, "summary")
        if summary is None:
            return None
        r, inter = _runs(summary, arm, dose), _runs(summary, "qat_interq", dose)
        common = r.index.intersection(inter.index)
        if inter.empty or not len(common):
            return None
        larger = int((r.loc[common, "rollback"] > inter.loc[common, "rollback"]).sum())
        sd, sd_i = float(r["final"].std(ddof=1)), float(inter["final"].std(ddof=1))
        return f"larger rollback than InterQ in {larger}/{len(common)} seeds; final sd {sd:.3f} vs InterQ {sd_i:.3f}"

    def _less_stable_verdict(self, tabs: Tables, arm: str, dose: str) -> Verdict:
        summary = _frame(tabs, "summary")
        if summary is None:
            return Verdict.NOT_JUDGED
        return verdict_less_stable(_runs(summary, arm, dose), _runs(summary, "qat_interq", dose),
                                   self._needed(summary, dose, 0.6))


def predictions(cfg: MismatchConfig) -> tuple[Prediction, ...]:
    """The predictions (a)-(d) of ``cfg``'s registered protocol, one per dose and arm (:data:`JUDGED`): the
    selected doses first, in the selection's order (the table's rows), then every other dose, never judged
    (listed so that what a run records does not depend on its selection)."""
    doses = [d for d in cfg.experiments if d in DOSES]
    if cfg.protocol not in REGISTRATIONS:  # the transfer protocol: its experiment's own prediction only
        return ()
    if cfg.protocol == "dual-clip":
        return ablation_predictions(doses, DOSES)
    rules = _Rules(REGISTRATIONS[cfg.protocol], cfg.grpo.updates, cfg.smooth)
    return tuple(rules.prediction(letter, arm, dose, dose in doses)
                 for dose in (*doses, *(d for d in DOSES if d not in doses)) for letter, arm in JUDGED)


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
_SEVERITY = {"skipped": 0, "info": 0, "ok": 0, "warn": 1, "fail": 2}


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
        path = Path(dump_dir) / dump_name(r.arm, r.dose, r.seed)
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


def dump_name(arm: str, dose: str, seed: int) -> str:
    """The file a run's ``--dump`` writes (``mismatch-<dose>-<arm>-seed=<seed>.jsonl``; the fp32 arm's dose is
    ``fp32``)."""
    return f"mismatch-{'fp32' if arm == 'fp32' else dose}-{arm}-seed={int(seed)}.jsonl"


AGREEMENT_TITLE = "creditlab diagnose on each run's own dump against its measured rollback"


def _agreement(summary: pd.DataFrame, cfg: MismatchConfig) -> Table:
    """The ``diagnose_agreement`` table: recomputed when every run of the render has its dump in ``--dump``;
    else (dumps are written only when a cell is computed, and are not committed) what the dumps here give,
    marked ``carry`` so that the table of the render that had them is kept as it was."""
    where = Path(cfg.dump_dir) if cfg.dump_dir else None
    have = where is not None and where.is_dir()
    agree = diagnose_agreement(summary, where, fp32_band(summary)) if have else pd.DataFrame()
    lacking = [r for r in summary.itertuples(index=False)
               if not (have and (where / dump_name(r.arm, r.dose, r.seed)).exists())]
    if not lacking:
        return Table(agree, AGREEMENT_TITLE, ".3g", console=True)
    first = dump_name(lacking[0].arm, lacking[0].dose, lacking[0].seed)
    why = ("it runs creditlab diagnose on each run's training dump (--dump), which a cell writes only when it is "
           "computed, and dumps are not kept with a run's store; "
           + ("this render has no --dump" if where is None else
              f"{len(lacking)} of the {len(summary)} runs of this render have no dump in {where} (e.g. {first}): "
              "their cells were read back from the store, not computed again"))
    return Table(agree, AGREEMENT_TITLE, ".3g", console=True, carry=why)


def calibration_scope(cfg: MismatchConfig) -> str:
    """"" when ``cfg`` is the full run the calibration rule of :func:`prefix_drift_calibration` was registered
    on (the 2-core protocol: every registered dose, arm and seed, its updates and windows), else how this run
    differs from it, naming the subset."""
    reg = MismatchConfig.two_core()
    if cfg.protocol != reg.protocol:
        return (f"this run is of the {cfg.protocol} protocol, whose registration has no calibration rule"
                + (" (and it is shortened: --quick or --updates)" if cfg.grpo.updates < reg.grpo.updates else ""))
    parts = []
    left = [d for d in reg.experiments if d not in cfg.experiments]
    if left:
        parts.append(f"it selects dose(s) {', '.join(d for d in cfg.experiments)} of the registered "
                     f"{', '.join(reg.experiments)} (-e), leaving out {', '.join(left)}")
    ignore = {"experiments", "cache_dir", "dump_dir"}
    mine, theirs = cfg.to_dict(), reg.to_dict()
    parts += [f"{k} {_plain(mine, k)} (registered: {_plain(theirs, k)})"
              for k in diff_paths(mine, theirs) if k.split(".")[0] not in ignore]
    return "; ".join(parts)


#: The run :func:`calibration_scope` accepts, for a reader.
REGISTERED_RUN = ("--protocol two-core: MXFP4 with its 7 arms on 5 seeds, fp8, int8 and nvfp4 with naive and QAT on 2, "
                  "100 updates; results/mismatch-2core/run")


def _plain(d: dict, path: str):
    for part in path.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return ", ".join(map(str, d)) if isinstance(d, list) else d


def _noise_floor(summary: pd.DataFrame) -> float:
    fp = summary[summary["arm"] == "fp32"]["rollback"]
    return float(fp.mean()) if len(fp) else math.nan


def _read_phase_map(m: pd.DataFrame) -> str:
    if m.empty:
        return "No phase-map point: the run has no gate measurement for its doses."
    parts = [f"{LABELS[r.arm]} at {r.dose} (drift {r.drift:.2f} nat): rollback {r.rollback:.3f}, "
             f"{r.rolled_back}/{r.seeds} seeds > {ROLLBACK:g}" for r in m.itertuples()]
    return ("One point per arm and dose: x the |drift| entering the last turn that arm's learner had on the base "
            "policy, y its mean rollback (95% interval over seeds); the fp32 arm's rollback is the band of "
            "training without mismatch. " + "; ".join(parts) + ".")


def _read_calibration(c: pd.DataFrame) -> str:
    rule = ("x: the learner's value of diagnose's statistic (RMS prefix log ratio at the last turn with 20+ tokens) on "
            "the base policy; a point rolls back when at least half its seeds roll back beyond the fp32 band. ")
    by = c.set_index("threshold")
    if "largest safe" in by.index:
        r = by.loc["largest safe"]
        return (rule + f"No point rolls back: there is no crossing to calibrate on. Training was safe up to "
                f"{r['prefix_rms']:.3g} ({r['point']}).")
    f = by.loc["fail"]
    text = rule + f"Rollback begins by {f['prefix_rms']:.3g} ({f['point']}, {f['beyond_fp32_band']}/{f['seeds']} seeds)"
    if "warn" in by.index:
        w = by.loc["warn"]
        text += (f"; the largest point below it that does not roll back is at {w['prefix_rms']:.3g} ({w['point']}): "
                 "the crossing lies between the two")
    return text + "."


def _read_agreement(a: pd.DataFrame, band: float | None, summary: pd.DataFrame | None = None) -> str:
    left = _runs_without_rows(summary, a) if summary is not None else []
    subset = (f" This table covers {len(a)} of the {len(a) + len(left)} runs of this render: the runs without a "
              f"dump are left out ({', '.join(left[:6])}{f', +{len(left) - 6} more' if len(left) > 6 else ''})."
              if left else "")
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
               if len(a) else "") + subset)


def _run_name(arm: str, dose: str, seed: int) -> str:
    return f"{LABELS[arm]}{'' if arm == 'fp32' else f' at {dose}'} seed {int(seed)}"


def _runs_without_rows(summary: pd.DataFrame, a: pd.DataFrame) -> list[str]:
    """The runs of ``summary`` that have no row in ``a`` (by arm, dose and seed), named for a reader."""
    have = {(r.arm, r.dose, int(r.seed)) for r in a.itertuples()} if len(a) else set()
    return [_run_name(r.arm, r.dose, r.seed) for r in summary.itertuples() if (r.arm, r.dose, int(r.seed)) not in have]


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
          "qat_prefix": "tab:purple", "qat_global": "tab:olive", "qat_interq": "tab:green", "qat_mis_low": "tab:pink",
          "qat_interq_tis": "tab:cyan"}


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
        scorer = "each arm's own engine" if cfg.eval_on == "engine" else "fp32 engine"
        ax.set_title(f"engine {dose}: held-out success ({scorer}, sampled)", fontsize=10)
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


class Comparison(Experiment):
    """The doses a run selects compared with one another: the summary, means and paired differences, the phase
    map and diagnose's calibration and agreement, the turn fingerprint, the curves, the plots, and the
    predictions (a)-(d) of the registered protocol (module docstring)."""

    name = "comparison"
    always = True
    fields = ("smooth", "protocol", "map_doses", "map_arms", "map_seeds")  # checked by MismatchConfig.validate

    def cells(self, cfg: MismatchConfig) -> list[Cell]:
        return []  # it reads the doses' rows

    def predictions_for(self, cfg: MismatchConfig) -> tuple[Prediction, ...]:
        return predictions(cfg)

    def predictions_text(self, cfg: MismatchConfig) -> tuple[str, ...]:
        """The registration's scope (the paragraph that frames (a)-(d), not judged itself), then (a)-(d)."""
        if cfg.protocol not in REGISTRATIONS:
            return ()
        return (REGISTRATIONS[cfg.protocol].stated[0], *super().predictions_text(cfg))

    def predictions_section(self, cfg: MismatchConfig) -> str:
        """``mismatch`` (the paper-scale registration), ``mismatch-<protocol>`` for another one: about the dose
        that passes the gate, whichever doses a run selects."""
        return "mismatch" if cfg.protocol == "paper" else f"mismatch-{cfg.protocol}"

    def tables(self, rows: dict[str, pd.DataFrame], cfg: MismatchConfig) -> dict[str, Table]:
        if "train" not in rows:
            return {}
        df = rows["train"]
        df = df[df["dose"].isin(["fp32", *cfg.experiments]) & df["arm"].isin((*cfg.arms, *cfg.map_arms))]
        doses = [d for d in cfg.experiments if d in set(df["dose"])]
        summary = _summary(df, cfg)
        scored = ("each arm's own rollout engine; final_fp32: the fp32 engine's" if cfg.eval_on == "engine" else
                  "fp32 engine")
        tabs = {"summary": Table(summary, f"Summary per arm, dose and seed (held-out success: {scored})", ".3g"),
                "means": Table(_means(summary, doses), "Means over seeds with 95% intervals", ".3g", console=True)}
        for ref in ("qat", "fp32", "qat_tis"):
            d = _diffs(summary, doses, ref)
            if len(d):
                tabs[f"diff_vs_{ref}"] = Table(d, f"Paired differences against {LABELS[ref]} (same seeds)", ".3g")
        if "dose" in rows:
            tabs["phase_map"] = Table(phase_map(summary, gate_table(rows["dose"])),
                                      "Phase map: rollback against the prefix drift entering the last turn", ".3g")
            cal = prefix_drift_calibration(tabs["phase_map"].frame)
            if len(cal) and not calibration_scope(cfg):  # only the run the rule was registered on calibrates
                tabs["prefix_drift_calibration"] = Table(
                    cal, "creditlab diagnose's mismatch.prefix_drift thresholds from the phase map", ".3g",
                    console=True)
        tabs["diagnose_agreement"] = _agreement(summary, cfg)
        by_turn = _by_turn(df, cfg)
        tabs["by_turn"] = Table(by_turn, "Prefix and current log ratio by turn", ".3g", report=False)
        tabs["fingerprint"] = Table(_fingerprint(by_turn),
                                    "Fingerprint: mean prefix and current log ratio by turn (all updates)", ".2g")
        cols = ["arm", "dose", "seed", "update"] + [c for c in CURVE_COLUMNS if c in df.columns]
        curves = df[cols].rename(columns=CURVE_COLUMNS).sort_values(["dose", "arm", "seed", "update"])
        tabs["curves"] = Table(curves.reset_index(drop=True), "Every update of every run", ".3g", report=False)
        return tabs

    def plots(self, tabs: Tables, cfg: MismatchConfig, out: Path) -> list[Path]:
        if "curves" not in tabs:
            return []
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

    def interpret(self, tabs: Tables, cfg: MismatchConfig) -> dict[str, str]:
        if "summary" not in tabs:
            return {}
        few = small_run_note(cfg.seeds)
        s, m = tabs["summary"].frame, tabs["means"].frame
        text: dict[str, str] = {}
        if "phase_map" in tabs:
            text["phase_map"] = _read_phase_map(tabs["phase_map"].frame)
            if (scope := calibration_scope(cfg)) and not tabs["phase_map"].frame.empty:
                text["phase_map"] += (
                    " No calibration of creditlab diagnose's mismatch.prefix_drift thresholds is read from this map "
                    "(no prefix_drift_calibration table): the rule reads the full run it was registered on, the "
                    f"2-core protocol's ({REGISTERED_RUN}), and this run is not it: {scope}. A crossing read from a "
                    "part of that run, or from another run, is not the registered calibration.")
        if "prefix_drift_calibration" in tabs:
            text["prefix_drift_calibration"] = _read_calibration(tabs["prefix_drift_calibration"].frame)
        if "diagnose_agreement" in tabs:
            text["diagnose_agreement"] = _read_agreement(tabs["diagnose_agreement"].frame, fp32_band(s), s)
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
        for ref in ("qat", "fp32", "qat_tis"):
            name = f"diff_vs_{ref}"
            if name not in tabs:
                continue
            d = tabs[name].frame
            parts = []
            for metric in ("final", "rollback", *(("final_fp32",) if "final_fp32" in d.columns else ())):
                sub = d.rename(columns={metric: "mean", f"{metric}_lo": "lo", f"{metric}_hi": "hi"})
                for what, g in sub.groupby("diff", sort=False):
                    parts.append(f"[{metric}] " + read_diff(g[["dose", "mean", "lo", "hi", "n"]], ["dose"], what))
            text[name] = (f"Paired differences (arm - {LABELS[ref]}, same seeds, same evaluation) of final held-out "
                          "success, rollback and AULC. " + " ".join(parts))
        text["fingerprint"] = _read_fingerprint(tabs["by_turn"].frame)
        return text


EXPERIMENT = Comparison()
