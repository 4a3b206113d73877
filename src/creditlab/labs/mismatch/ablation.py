"""The predictions of the dual-clip protocol's ablation at MXFP4 (``--protocol dual-clip``; docs/mismatch.md,
"The dual-clip protocol"): what TIS does when the trainer clips like verl, whether masking only the tokens the
engine found far likelier than the learner does the same, and whether InterQ-RL adds anything, alone or
composed with TIS.

Each is judged on a paired difference of final held-out success (the mean of the last evaluation points, scored
on each arm's own rollout engine), same seeds, from the ``diff_vs_qat`` and ``diff_vs_qat_tis`` tables: a pure
function of those tables, with "not resolved" when the rule says the interval cannot tell.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pandas as pd

from creditlab.lab.experiment import Prediction, Tables, Verdict
from creditlab.labs.mismatch.config import LABELS

__all__ = ["DUAL_CLIP_STATED", "ablation_predictions", "verdict_above_zero", "verdict_within"]

#: The predictions registered for the dual-clip protocol, word for word: the scope, then (A1)-(A4).
DUAL_CLIP_STATED = (
    "On the dual-clip protocol (the 2-core protocol's world, base policy and budget, with clip_ratio_c = 3 and "
    "held-out success scored on each arm's own rollout engine; MXFP4; 8 paired seeds), each prediction reads the "
    "paired difference of final held-out success (the mean of the last 3 evaluation points) with its 95% "
    "interval, at the thresholds as written: an interval that spans 0 where the prediction needs it above 0 is "
    "\"not resolved\", whatever its mean.",
    "**(A1)** TIS still helps once the trainer has the dual clip: QAT+TIS - QAT has a 95% interval above 0 "
    "(fails: below 0).",
    "**(A2)** What TIS does here is masking the tokens the engine found far likelier than the learner: QAT+MIS "
    "masking only delta < -1, minus QAT+TIS, has a 95% interval inside [-0.05, +0.05] (fails: an interval that "
    "excludes 0; not resolved otherwise).",
    "**(A3)** InterQ-RL helps: QAT+InterQ - QAT has a 95% interval above 0 (fails: below 0).",
    "**(A4)** InterQ-RL adds to TIS: QAT+InterQxTIS - QAT+TIS has a 95% interval above 0 (fails: below 0).",
)

#: (id, arm, reference, rule) of each prediction; ``rule`` is ``above`` (interval above 0) or ``within``
#: (interval inside [-0.05, +0.05]).
JUDGED = (("A1", "qat_tis", "qat", "above"), ("A2", "qat_mis_low", "qat_tis", "within"),
          ("A3", "qat_interq", "qat", "above"), ("A4", "qat_interq_tis", "qat_tis", "above"))
#: The bound of (A2)'s interval.
WITHIN = 0.05


def verdict_above_zero(lo: float, hi: float) -> Verdict:
    """``holds`` when the interval lies above 0, ``fails`` when below, else ``not judged`` (not resolved, or no
    interval)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return Verdict.NOT_JUDGED
    return Verdict.HOLDS if lo > 0 else Verdict.FAILS if hi < 0 else Verdict.NOT_JUDGED


def verdict_within(lo: float, hi: float, bound: float = WITHIN) -> Verdict:
    """``holds`` when the interval lies inside ``[-bound, +bound]``, ``fails`` when it excludes 0, else ``not
    judged`` (not resolved, or no interval)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return Verdict.NOT_JUDGED
    if -bound <= lo and hi <= bound:
        return Verdict.HOLDS
    return Verdict.FAILS if lo > 0 or hi < 0 else Verdict.NOT_JUDGED


def _row(tabs: Tables, arm: str, ref: str, dose: str) -> pd.Series | None:
    name = f"diff_vs_{ref}"
    if name not in tabs:
        return None
    d = tabs[name].frame
    sel = d[(d["diff"] == f"{arm} - {ref}") & (d["dose"] == dose)] if len(d) else d
    return None if sel.empty else sel.iloc[0]


def _prediction(pid: str, arm: str, ref: str, rule: str, dose: str, stated: str) -> Prediction:
    judge: Callable[[float, float], Verdict] = verdict_above_zero if rule == "above" else verdict_within

    def measured(t: Tables) -> str | None:
        r = _row(t, arm, ref, dose)
        if r is None:
            return None
        return (f"{LABELS[arm]} - {LABELS[ref]} final {r['final']:+.3f} [{r['final_lo']:+.3f}, {r['final_hi']:+.3f}], "
                f"{int(r['n'])} seeds")

    def verdict(t: Tables) -> Verdict:
        r = _row(t, arm, ref, dose)
        return Verdict.NOT_JUDGED if r is None else judge(float(r["final_lo"]), float(r["final_hi"]))

    def note(v: Verdict, t: Tables) -> str:
        r = _row(t, arm, ref, dose)
        if v is not Verdict.NOT_JUDGED or r is None:
            return ""
        if not (math.isfinite(float(r["final_lo"])) and math.isfinite(float(r["final_hi"]))):
            return "one seed: no interval"
        return "not resolved: the interval spans 0" if rule == "above" else \
            f"not resolved: the interval includes 0 and leaves [-{WITHIN:g}, +{WITHIN:g}]"

    what = {"above": "above 0", "within": f"inside [-{WITHIN:g}, +{WITHIN:g}]"}[rule]
    return Prediction(f"({pid}) at {dose}: {LABELS[arm]} - {LABELS[ref]}, final, 95% interval {what}", stated,
                      measured, verdict, note)


def ablation_predictions(doses: list[str], all_doses: tuple[str, ...]) -> tuple[Prediction, ...]:
    """(A1)-(A4) at each selected dose, then at every other dose (recorded, never judged: what a run records
    does not depend on its selection)."""
    out = []
    for dose in (*doses, *(d for d in all_doses if d not in doses)):
        for i, (pid, arm, ref, rule) in enumerate(JUDGED):
            p = _prediction(pid, arm, ref, rule, dose, DUAL_CLIP_STATED[i + 1])
            if dose not in doses:
                p = Prediction(p.claim, p.stated, measured=lambda t: None, verdict=lambda t: Verdict.NOT_JUDGED)
            out.append(p)
    return tuple(out)
