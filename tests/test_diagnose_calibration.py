"""The 2-core run's calibration of ``mismatch.prefix_drift`` (results/mismatch-2core/run, table
prefix_drift_calibration) is history: docs/diagnose.md quotes its crossing, and the checks no longer use it
(their thresholds follow the transfer run's calibration, tests/test_diagnose_transfer.py)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from creditlab.diagnose.calibration import calibration
from creditlab.diagnose.checks import CHECKS

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "results" / "mismatch-2core" / "run"


@pytest.mark.skipif(not (RUN / "prefix_drift_calibration.parquet").exists(), reason="the committed run is absent")
def test_the_docs_quote_the_2core_runs_crossing():
    cal = pd.read_parquet(RUN / "prefix_drift_calibration.parquet").set_index("threshold")
    assert set(cal.index) == {"warn", "fail"}, "the run found a crossing: both values are measured"
    doc = (ROOT / "docs" / "diagnose.md").read_text(encoding="utf-8")
    assert "results/mismatch-2core/run/lab.json" in doc
    for level in ("warn", "fail"):
        assert f"| {cal.loc[level, 'prefix_rms']:.3g} |" in doc, level


def test_the_checks_use_no_2core_threshold():
    cal = calibration()
    assert cal is not None, "the package ships calibration.json (scripts/diagnose_calibration.py writes it)"
    for cid in ("mismatch.prefix_drift", "mismatch.sequence_ratio_length"):
        t, m = CHECKS[cid].threshold, cal.thresholds[cid]
        if m is None:  # no calibrated verdict: no threshold at all, and the reason in its note
            assert (t.warn, t.fail, t.measured) == (None, None, False) and cal.why in t.note
        else:
            assert (t.warn, t.fail, t.measured) == (m.warn, m.fail, True)
        assert (t.warn, t.fail) != (2.2, 8.1) and (t.warn, t.fail) != (0.3, 1.0)
