"""Write ``src/creditlab/diagnose/calibration.json`` from the mismatch lab's committed transfer run.

    python scripts/diagnose_calibration.py            write it, and the units table docs/diagnose.md shows
    python scripts/diagnose_calibration.py --check    exit 1 when a committed file differs from the run's tables
    --run DIR                                         another run directory (default results/mismatch-transfer/run)

It reads the run's tables as the lab wrote them: ``predictions`` (T1's verdict), ``transfer_units`` (the picked
unit and its pooled worst-stable / best-rolling-back values), ``transfer_gate`` (the domain: the range of policy
tokens per trajectory and of turns over every measured point, and ``seq_ratio``), ``transfer_map`` (the points)
and ``lab.json`` (the manifest). The thresholds are the rule's (docs/diagnose.md, "The transfer experiment"):
``mismatch.prefix_drift`` in the picked unit, warn beyond the worst stable value and fail at or beyond the best
rolling-back one, both exactly as measured; ``mismatch.sequence_ratio_length`` by the same rule on its own gate
value when the picked unit is ``total``, with no calibrated verdict otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "results" / "mismatch-transfer" / "run"
OUT = ROOT / "src" / "creditlab" / "diagnose" / "calibration.json"
UNIT_COLUMNS = ("total", "per_token", "ess")
#: The run's ``transfer_units`` table with plain column names (``stable_worst[pooled]`` -> ``stable_worst_pooled``),
#: beside the run: docs/diagnose.md's generated block reads it.
UNITS_TABLE = "units.parquet"


def units_table(run: Path) -> pd.DataFrame:
    units = pd.read_parquet(run / "transfer_units.parquet")
    return units.rename(columns=lambda c: c.replace("[", "_").replace("]", ""))


def _float(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _same_rule(points: pd.DataFrame, col: str, direction: str) -> tuple[float, float] | None:
    """(worst stable, best rolling back) of ``col`` pooled over the worlds, when one threshold separates them."""
    st = points[points["class"] == "stable"][col].dropna()
    rb = points[points["class"] == "rolls back"][col].dropna()
    if st.empty or rb.empty:
        return None
    above = direction == "above"
    worst, best = (st.max(), rb.min()) if above else (st.min(), rb.max())
    return (float(worst), float(best)) if (worst < best if above else worst > best) else None


def build(run: Path) -> dict:
    lab = json.loads((run / "lab.json").read_text())
    pred = pd.read_parquet(run / "predictions.parquet")
    t1 = pred[pred["prediction"].str.startswith("T1")]
    if t1.empty:
        raise SystemExit(f"{run}: no T1 row in predictions.parquet (not a transfer run?)")
    verdict = str(t1["verdict"].iloc[0]).split(" (")[0]
    units = pd.read_parquet(run / "transfer_units.parquet")
    gate = pd.read_parquet(run / "transfer_gate.parquet")
    tmap = pd.read_parquet(run / "transfer_map.parquet")
    picked = units[units["picked"]]
    unit = str(picked["unit"].iloc[0]) if len(picked) else None
    thresholds: dict[str, dict | None] = {"mismatch.prefix_drift": None, "mismatch.sequence_ratio_length": None}
    if unit is not None:
        r = picked.iloc[0]
        direction = "above" if r["direction"] == "higher is worse" else "below"
        thresholds["mismatch.prefix_drift"] = {"unit": unit, "warn": float(r["stable_worst[pooled]"]),
                                               "fail": float(r["rolls_best[pooled]"]), "direction": direction}
        if unit == "total":
            pts = tmap.merge(gate[["world", "arm", "dose", "seq_ratio"]], on=["world", "arm", "dose"], how="left")
            sep = _same_rule(pts, "seq_ratio", "above")
            if sep is not None:
                thresholds["mismatch.sequence_ratio_length"] = {"unit": "seq_ratio", "warn": sep[0], "fail": sep[1],
                                                                "direction": "above"}
    bracketed = bool(units["bracketed"].all())
    why = "" if unit is not None else (
        "in the transfer run no unit separated the points that rolled back from those that did not in both worlds"
        if bracketed else
        "in the transfer run a world did not bracket the onset of rollback (it lacks a point that rolled back or "
        "one that did not), so no threshold could be measured in a unit that carries over")
    rec = lab.get("predictions", {})
    lab_file = run / "lab.json"
    manifest = {"file": str(lab_file.relative_to(ROOT)) if run.is_relative_to(ROOT) else str(lab_file),
                "commit": (rec.get("source") or {}).get("commit"), "recorded": rec.get("recorded_at"),
                "predictions_sha256": rec.get("sha256")}
    points = []
    for _, p in tmap.iterrows():
        g = gate[(gate["world"] == p["world"]) & (gate["arm"] == p["arm"]) & (gate["dose"] == p["dose"])]
        points.append({"world": p["world"], "arm": p["arm"], "dose": p["dose"],
                       **{c: _float(p[c]) for c in UNIT_COLUMNS},
                       "seq_ratio": _float(g["seq_ratio"].iloc[0]) if len(g) else None,
                       "rollback": _float(p["rollback"]), "rollback_lo": _float(p["rollback_lo"]),
                       "rollback_hi": _float(p["rollback_hi"]), "rolled_back": int(p["rolled_back"]),
                       "seeds": int(p["seeds"]), "class": p["class"]})
    return {"written_by": "scripts/diagnose_calibration.py", "run": str(run.relative_to(ROOT))
            if run.is_relative_to(ROOT) else str(run), "manifest": manifest, "verdict": verdict, "unit": unit,
            "why": why, "thresholds": thresholds,
            "worlds": sorted(set(gate["world"]), key=list(gate["world"]).index),
            "policy_tokens": [float(gate["policy_tokens"].min()), float(gate["policy_tokens"].max())],
            "turns": [float(gate["turns"].min()), float(gate["turns"].max())], "points": points}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=RUN)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    run = args.run.resolve()
    text = json.dumps(build(run), indent=2) + "\n"
    units, units_path = units_table(run), run.parent / UNITS_TABLE
    if args.check:
        stale = [str(p) for p, same in (
            (args.out, args.out.is_file() and args.out.read_text() == text),
            (units_path, units_path.is_file() and units.equals(pd.read_parquet(units_path))))
            if not same]
        for p in stale:
            print(f"{p}: stale; rerun python scripts/diagnose_calibration.py")
        return 1 if stale else 0
    args.out.write_text(text)
    units.to_parquet(units_path, index=False)
    print(f"wrote {args.out} and {units_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
