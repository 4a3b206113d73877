"""The mismatch lab's gate: the base policy measured at every engine dose before any arm trains (the
``dose`` cells of :func:`~creditlab.labs.mismatch.cells.run_dose_cell`), the ``gate`` table made of it,
and their readings. The lab shows both; the comparison across doses reads the gate for its phase map."""

from __future__ import annotations

import math

import pandas as pd

from creditlab.labs.mismatch.config import DOSES, GATE_DRIFT, MismatchConfig

__all__ = ["diagnose_drift", "gate_table", "read_dose", "read_gate"]


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


def read_gate(g: pd.DataFrame) -> str:
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


def read_dose(d: pd.DataFrame, cfg: MismatchConfig) -> str:
    k3 = d.set_index(["engine", "learner"])["k3"]
    parts = [f"{e}: {k3[(e, 'fp32')]:.2g} naive, {k3[(e, 'QAT')]:.2g} QAT ({1 - k3[(e, 'QAT')] / k3[(e, 'fp32')]:.0%} "
             "removed)" for e in DOSES if (e, "QAT") in k3.index]
    return ("K3(engine || learner) per policy token and the prefix log ratio at the first and last turn, measured "
            f"on the base policy's own trajectories ({cfg.dose_tasks} held-out tasks) before any training, for every "
            "engine against an fp32 learner and a quantization-aware one; engine_success is the base policy's success "
            "when that engine runs it. " + "; ".join(parts) + ".")
