"""diagnose on runs unlike the lab's: the calibrated checks judge their value in the calibration's unit, say
where the dump lies against the measured domain, never fail on extrapolation alone, say ``info`` where the
transfer run gave no calibrated verdict; the live checks follow; and the acceptance on long agent dumps
(12-24 turns, 300-6,000 policy tokens, K3 per token from 2e-5 to 5e-3, flat or growing) holds with whatever
calibration the package ships."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import creditlab.diagnose.checks as checks_mod
import creditlab.integrations._live as live_mod
from creditlab.diagnose import read_dump, run_checks, write_dump
from creditlab.diagnose.calibration import CALIBRATION_FILE, Calibration, MeasuredThreshold, load_calibration
from creditlab.diagnose.checks import Threshold

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diagnose_synth import agent_process_rows, padded_tensors  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _cal(prefix: MeasuredThreshold | None, seq: MeasuredThreshold | None = None, why: str = "") -> Calibration:
    unit = prefix.unit if prefix is not None else None
    return Calibration(run="results/mismatch-transfer/run", manifest={"file": "lab.json"},
                       verdict="holds" if unit else "not judged", unit=unit,
                       thresholds={"mismatch.prefix_drift": prefix, "mismatch.sequence_ratio_length": seq},
                       worlds=("thoughts40", "thoughts24"), policy_tokens=(190.0, 320.0), turns=(5.0, 9.0),
                       why=why or ("" if unit else "a world did not bracket the onset of rollback"))


@pytest.fixture
def use_cal(monkeypatch):
    def set_(cal: Calibration) -> None:
        monkeypatch.setattr(checks_mod, "calibration", lambda: cal)
        monkeypatch.setattr(live_mod, "calibration", lambda: cal)
    return set_


def _checks(tmp_path: Path, name: str, **kw) -> dict:
    rows = agent_process_rows(**kw)
    return {r.id: r for r in run_checks(read_dump(write_dump(rows, tmp_path / f"{name}.jsonl")))}


SHORT = {"turns": 6, "policy_tokens": 300}
LONG = {"turns": 24, "policy_tokens": 6000, "steps": 4, "rows_per_step": 16}


# --------------------------------------------------------------------------------------------------------------
# the rules, on a calibration made here


def test_measured_thresholds_warn_beyond_the_safe_value_and_fail_at_the_unsafe_one():
    up = Threshold(2.0, 8.0, measured=True)
    assert [up.level(v) for v in (1.0, 2.0, 2.0001, 7.99, 8.0, 9.0)] == ["ok", "ok", "warn", "warn", "fail", "fail"]
    down = Threshold(0.5, 0.2, "below", measured=True)
    assert [down.level(v) for v in (0.9, 0.5, 0.49, 0.2, 0.1)] == ["ok", "ok", "warn", "fail", "fail"]
    assert up.text().startswith("warn > 2, fail >= 8") and down.text().startswith("warn < 0.5, fail <= 0.2")
    legacy = Threshold(2.0, 8.0)  # the reasoned thresholds keep ">=": the value itself warns
    assert [legacy.level(v) for v in (2.0, 8.0)] == ["warn", "fail"]


def test_a_per_token_calibration_gives_one_status_to_one_process_at_any_length(tmp_path, use_cal):
    use_cal(_cal(MeasuredThreshold("per_token", 3e-3, 1e-2, "above")))
    short = _checks(tmp_path, "s", k3=5e-4, **SHORT)["mismatch.prefix_drift"]
    long = _checks(tmp_path, "l", k3=5e-4, **LONG)["mismatch.prefix_drift"]
    assert short.status == long.status == "ok"
    assert short.value == pytest.approx(5e-4, rel=0.1) and long.value == pytest.approx(5e-4, rel=0.1)
    assert short.details["in_domain"] is True and long.details["in_domain"] is False
    assert long.details["domain"]["policy_tokens_per_trajectory"] == [190.0, 320.0]
    assert "outside the calibration's domain" in long.message
    # beyond the fail value, but outside the domain: it warns, and says why
    far = _checks(tmp_path, "f", k3=2e-2, **LONG)["mismatch.prefix_drift"]
    assert far.status == "warn" and "warns at most" in far.message
    near = _checks(tmp_path, "n", k3=2e-2, **SHORT)["mismatch.prefix_drift"]
    assert near.status == "fail" and near.details["in_domain"] is True


def test_a_total_calibration_marks_the_long_dump_out_of_domain(tmp_path, use_cal):
    use_cal(_cal(MeasuredThreshold("total", 2.3, 8.1, "above")))
    short = _checks(tmp_path, "s", k3=5e-4, **SHORT)["mismatch.prefix_drift"]
    long = _checks(tmp_path, "l", k3=5e-4, **LONG)["mismatch.prefix_drift"]
    assert short.status == "ok" and short.details["in_domain"]
    assert long.status == "warn" and not long.details["in_domain"]  # 3.3 nats: the sum over 6,000 tokens
    # the numbers docs/diagnose.md quotes ("What a verdict means for a run unlike the lab's")
    assert short.details["units"]["total"] == pytest.approx(0.5, abs=0.1)
    assert long.details["units"]["total"] == pytest.approx(3.3, abs=0.2)


def test_an_ess_calibration_reads_lower_as_worse(tmp_path, use_cal):
    use_cal(_cal(MeasuredThreshold("ess", 0.5, 0.1, "below")))
    r = _checks(tmp_path, "s", k3=5e-4, **SHORT)["mismatch.prefix_drift"]
    assert r.status == "ok" and 0.5 < r.value <= 1
    r = _checks(tmp_path, "w", k3=5e-3, **SHORT)["mismatch.prefix_drift"]
    assert r.status in ("warn", "fail") and r.value < 0.5


def test_no_calibrated_verdict_is_info_with_the_reason_and_no_live_warning(tmp_path, use_cal, monkeypatch):
    use_cal(_cal(None, why="a world did not bracket the onset of rollback"))
    r = _checks(tmp_path, "s", k3=5e-3, **LONG)["mismatch.prefix_drift"]
    assert r.status == "info" and "No calibrated verdict: a world did not bracket" in r.message
    assert r.value == pytest.approx(r.details["units"]["total"]) and "domain" in r.details
    # an info threshold (no warn, no fail) is never crossed live, whatever the value
    entry = live_mod.CHECKS["mismatch.prefix_drift"]
    info = type(entry)(entry.id, entry.title, entry.needs, Threshold(None, None, note="no calibrated verdict"),
                       entry.fix, entry.fn)
    monkeypatch.setattr(live_mod, "CHECKS", {**{c: live_mod.CHECKS[c] for c in live_mod.LIVE_CHECKS},
                                             "mismatch.prefix_drift": info})
    assert not live_mod._crossed("mismatch.prefix_drift", 1e6)


def test_a_missing_calibration_file_gives_info_and_says_so(tmp_path, use_cal):
    use_cal(None)  # a broken install: the package's calibration.json is gone
    r = _checks(tmp_path, "s", k3=5e-3, **SHORT)["mismatch.prefix_drift"]
    assert r.status == "info" and "calibration.json is missing" in r.message
    assert r.value == pytest.approx(r.details["units"]["total"]) and "domain" not in r.details
    t = checks_mod.measured_threshold("mismatch.sequence_ratio_length")
    assert (t.warn, t.fail) == (None, None) and "calibration.json is missing" in t.note


def test_live_values_follow_the_calibrated_unit(tmp_path, use_cal):
    use_cal(_cal(MeasuredThreshold("per_token", 3e-3, 1e-2, "above")))
    rows = agent_process_rows(k3=1e-3, steps=1, **{k: v for k, v in SHORT.items()})
    res = {r.id: r for r in run_checks(read_dump(write_dump(rows, tmp_path / "one.jsonl")))}
    old, roll, pm = padded_tensors([{k: v for k, v in r.items() if k != "turn_ids"} for r in rows])
    live = live_mod.to_floats(live_mod.batch_values(old, roll, pm))
    assert live["creditlab/mismatch/prefix_drift"] == pytest.approx(res["mismatch.prefix_drift"].value, rel=1e-9)
    assert live["creditlab/mismatch/prefix_drift"] == pytest.approx(live["creditlab/mismatch/k3"], rel=1e-12)


# --------------------------------------------------------------------------------------------------------------
# the acceptance, with the calibration the package ships (or the 2-core thresholds, while it has none)


def test_long_agent_dumps_with_the_shipped_calibration(tmp_path):
    bf16 = _checks(tmp_path, "bf16", k3=2e-5, **LONG)
    assert not [r.id for r in bf16.values() if r.id.startswith("mismatch.") and r.status == "fail"], \
        {r.id: (r.status, r.message) for r in bf16.values() if r.status == "fail"}
    short = _checks(tmp_path, "s", k3=5e-4, **SHORT)["mismatch.prefix_drift"]
    long = _checks(tmp_path, "l", k3=5e-4, **LONG)["mismatch.prefix_drift"]
    if checks_mod.calibration() is not None:  # one process: one status, or the long dump said to be outside
        assert short.status == long.status or long.details.get("in_domain") is False, (short.message, long.message)
    for kw in (SHORT, LONG):  # a per-token K3 that grows 8x over training is flagged, whatever the length
        grow = _checks(tmp_path, f"g{kw['turns']}", k3=2e-4, k3_end=1.6e-3, **kw)
        assert grow["mismatch.k3"].status in ("warn", "fail") and "rising late" in grow["mismatch.k3"].message


# --------------------------------------------------------------------------------------------------------------
# the file itself


def test_the_shipped_calibration_is_the_transfer_runs():
    if not CALIBRATION_FILE.is_file():
        pytest.skip("no calibration.json yet: the transfer run has not finished (results/mismatch-transfer)")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "diagnose_calibration.py"), "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    cal = load_calibration(CALIBRATION_FILE)
    assert cal.verdict in ("holds", "fails", "not judged") and (cal.unit is None) == (cal.verdict != "holds")
    raw = json.loads(CALIBRATION_FILE.read_text())
    assert raw["written_by"] == "scripts/diagnose_calibration.py"
    for cid, t in cal.thresholds.items():
        th = checks_mod.CHECKS[cid].threshold
        if t is None:
            assert th.warn is None and th.fail is None
        else:
            assert (th.warn, th.fail, th.direction, th.measured) == (t.warn, t.fail, t.direction, True)
    assert math.isfinite(cal.policy_tokens[0]) and cal.policy_tokens[0] <= cal.policy_tokens[1]
    assert np.all([p["class"] in ("rolls back", "stable", "mixed") for p in cal.points])
    assert torch is not None


def test_the_report_shows_the_dump_on_the_phase_map(tmp_path, use_cal, monkeypatch):
    import creditlab.diagnose.plots as plots_mod
    from creditlab.diagnose.report import diagnose

    points = tuple({"world": w, "arm": a, "dose": d, "total": t, "per_token": k, "ess": e, "seq_ratio": None,
                    "rollback": rb, "rollback_lo": rb - 0.02, "rollback_hi": rb + 0.02, "rolled_back": n, "seeds": 4,
                    "class": c}
                   for w, a, d, t, k, e, rb, n, c in (
                       ("thoughts40", "qat", "mxfp4", 2.3, 3e-3, 0.6, 0.01, 0, "stable"),
                       ("thoughts40", "naive", "mxfp4", 13.6, 2e-2, 0.05, 0.3, 4, "rolls back"),
                       ("thoughts24", "naive", "nvfp4", 9.0, 1.3e-2, 0.28, 0.12, 3, "rolls back")))
    cal = _cal(MeasuredThreshold("per_token", 3e-3, 1.3e-2, "above"))
    cal = Calibration(**{**cal.__dict__, "points": points})
    use_cal(cal)
    monkeypatch.setattr(plots_mod, "calibration", lambda: cal)
    dump = write_dump(agent_process_rows(k3=5e-4, **SHORT), tmp_path / "d.jsonl")
    out = tmp_path / "report"
    diagnose([dump], out)
    md = (out / "report.md").read_text()
    assert "![mismatch.prefix_drift on the phase map](phase_map_prefix_drift.png)" in md
    assert (out / "phase_map_prefix_drift.png").stat().st_size > 10_000
    js = json.loads((out / "diagnose.json").read_text())
    assert "phase_map_prefix_drift.png" in js["files"] and js["version"] == 2
    entry = next(c for c in js["checks"] if c["id"] == "mismatch.prefix_drift")
    assert entry["details"]["in_domain"] is True
    assert entry["details"]["domain"]["worlds"] == ["thoughts40", "thoughts24"]
    # a second run into the same directory without a calibration removes the stale plot
    monkeypatch.setattr(plots_mod, "calibration", lambda: None)
    diagnose([dump], out)
    assert not (out / "phase_map_prefix_drift.png").exists()


def _run_dir(tmp_path: Path, rollbacks: dict, verdict: str) -> Path:
    """A transfer run's tables as the lab writes them, from hand-made gate values and per-seed rollbacks."""
    import pandas as pd

    from creditlab.labs.mismatch.transfer import transfer_map, unit_calibration

    run = tmp_path / "run"
    run.mkdir(parents=True)
    gate = pd.DataFrame([{"world": w, "arm": a, "dose": d, "policy_tokens": pt, "turns": tu, "total": t,
                          "per_token": k, "ess": e, "seq_ratio": sr}
                         for (w, a, d), (pt, tu, t, k, e, sr) in {
                             ("thoughts40", "qat", "mxfp4"): (310.0, 7.2, 2.0, 2.8e-3, 0.22, 0.8),
                             ("thoughts40", "naive", "mxfp4"): (310.0, 7.2, 21.7, 2.0e-2, 0.2, 7.2),
                             ("thoughts24", "qat", "mxfp4"): (196.0, 6.9, 1.5, 3.1e-3, 0.5, 0.5),
                             ("thoughts24", "naive", "mxfp4"): (196.0, 6.9, 9.0, 1.5e-2, 0.28, 5.0)}.items()])
    summary = pd.DataFrame([{"world": w, "arm": a, "dose": d, "seed": s, "rollback": r, "final": 0.4}
                            for (w, a, d), rb in rollbacks.items() for s, r in enumerate(rb)])
    tmap = transfer_map(summary, gate)
    units = unit_calibration(tmap, ["thoughts40", "thoughts24"])
    gate.to_parquet(run / "transfer_gate.parquet")
    tmap.to_parquet(run / "transfer_map.parquet")
    units.to_parquet(run / "transfer_units.parquet")
    pd.DataFrame([{"experiment": "transfer", "prediction": "T1 a unit transfers", "measured": "-",
                   "verdict": verdict}]).to_parquet(run / "predictions.parquet")
    (run / "lab.json").write_text(json.dumps({"predictions": {"recorded_at": "2026-12-05T05:08:33Z", "sha256": "ab",
                                                              "source": {"commit": "e5cbdb4"}}}))
    return run


def test_the_calibration_script_takes_the_rule_as_registered(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import diagnose_calibration as script

    fp = {(w, "fp32", "fp32"): [0.0, 0.01, 0.0, 0.02] for w in ("thoughts40", "thoughts24")}
    rolls, stable = [0.2, 0.3, 0.25, 0.0], [0.0, 0.0, 0.01, 0.0]
    run = _run_dir(tmp_path, {**fp, ("thoughts40", "qat", "mxfp4"): stable, ("thoughts40", "naive", "mxfp4"): rolls,
                              ("thoughts24", "qat", "mxfp4"): stable, ("thoughts24", "naive", "mxfp4"): rolls}, "holds")
    raw = script.build(run)
    # every unit separates; per_token has the largest margin: log(1.5e-2 / 3.1e-3) > log(9.0 / 2.0) > log(0.5 / 0.28)
    assert raw["unit"] == "per_token" and raw["verdict"] == "holds"
    t = raw["thresholds"]["mismatch.prefix_drift"]
    assert (t["unit"], t["warn"], t["fail"], t["direction"]) == ("per_token", 3.1e-3, 1.5e-2, "above")
    assert raw["thresholds"]["mismatch.sequence_ratio_length"] is None  # calibrated only when total is picked
    assert raw["policy_tokens"] == [196.0, 310.0] and raw["turns"] == [6.9, 7.2]
    assert raw["manifest"]["commit"] == "e5cbdb4" and len(raw["points"]) == 4
    out = tmp_path / "calibration.json"
    assert script.main(["--run", str(run), "--out", str(out)]) == 0
    assert script.main(["--run", str(run), "--out", str(out), "--check"]) == 0
    cal = load_calibration(out)
    assert cal.unit == "per_token" and cal.in_domain(250, 7.0) and not cal.in_domain(6000, 24)
    # the 24-thought world never rolls back: no calibrated verdict, and the reason says which way
    run2 = _run_dir(tmp_path / "b", {**fp, ("thoughts40", "qat", "mxfp4"): stable,
                                     ("thoughts40", "naive", "mxfp4"): rolls, ("thoughts24", "qat", "mxfp4"): stable,
                                     ("thoughts24", "naive", "mxfp4"): stable}, "not judged")
    raw2 = script.build(run2)
    assert raw2["unit"] is None and all(v is None for v in raw2["thresholds"].values())
    assert "did not bracket the onset" in raw2["why"]
