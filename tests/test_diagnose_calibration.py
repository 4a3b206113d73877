"""``mismatch.prefix_drift``'s thresholds are the measured ones: the committed 2-core run of the mismatch lab
(results/mismatch-2core/run) holds the phase map's calibration table, and the check's constants are its warn
and fail values taken down to two significant digits, as docs/diagnose.md says."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from creditlab.diagnose.calibration import calibration
from creditlab.diagnose.checks import CHECKS, DRIFT_FAIL, DRIFT_WARN

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "results" / "mismatch-2core" / "run"


def _down_to_two_digits(x: float) -> float:
    step = 10 ** (math.floor(math.log10(x)) - 1)
    return math.floor(round(x / step, 9)) * step


def test_two_digits_down():
    assert _down_to_two_digits(2.29) == pytest.approx(2.2)
    assert _down_to_two_digits(8.13) == pytest.approx(8.1)
    assert _down_to_two_digits(13.6) == pytest.approx(13.0)
    assert _down_to_two_digits(0.276) == pytest.approx(0.27)


@pytest.mark.skipif(not (RUN / "prefix_drift_calibration.parquet").exists(), reason="the committed run is absent")
def test_the_prefix_drift_thresholds_are_the_runs_calibration():
    cal = pd.read_parquet(RUN / "prefix_drift_calibration.parquet").set_index("threshold")
    assert set(cal.index) == {"warn", "fail"}, "the run found a crossing: both thresholds are measured"
    assert DRIFT_WARN == pytest.approx(_down_to_two_digits(float(cal.loc["warn", "prefix_rms"])))
    assert DRIFT_FAIL == pytest.approx(_down_to_two_digits(float(cal.loc["fail", "prefix_rms"])))
    doc = (ROOT / "docs" / "diagnose.md").read_text(encoding="utf-8")
    assert "results/mismatch-2core/run/lab.json" in doc
    if calibration() is None:  # the 2-core thresholds are the check's until the transfer run calibrates it
        t = CHECKS["mismatch.prefix_drift"].threshold
        assert (t.warn, t.fail) == (DRIFT_WARN, DRIFT_FAIL)
        assert f">= {DRIFT_WARN:g} / >= {DRIFT_FAIL:g}, and >= 1.5x the first turn's" in doc
