"""The goldens hold on another CPU: every golden test (a test whose name holds "golden", and the lab
goldens of ``tests/test_lab_golden.py``) runs again in a subprocess under an emulated older CPU.

One machine stands in for others through PyTorch's and its libraries' back-end switches: AVX2 instead
of AVX-512 kernels in ATen (``ATEN_CPU_CAPABILITY``) and oneDNN (``ONEDNN_MAX_CPU_ISA``), MKL's
conditional-numerical-reproducibility mode (``MKL_CBWR=COMPATIBLE``) and its AVX2 code path
(``MKL_ENABLE_INSTRUCTIONS``). Each changes the order of float sums, so each moves values in their last
bits and, on the quantized paths, flips rounding decisions (1 to 3 rows of the mismatch golden each, on
an AVX-512 machine); the goldens' tolerances (``tests/golden_compare.py``) are derived to absorb exactly
that. Run here under the default back-end as well, the README test command covers both.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
EMULATED_CPU = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE",
                "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
_INSIDE = "CREDITLAB_GOLDENS_EMULATED_CPU"

pytestmark = pytest.mark.skipif(os.environ.get(_INSIDE) == "1", reason="already the emulated-CPU run")


def golden_files() -> list[Path]:
    """Test modules that hold a golden test (``def test_...golden...``)."""
    pattern = re.compile(r"^def test_\w*golden", re.M)
    return sorted(p for p in TESTS.rglob("test_*.py") if p.name != Path(__file__).name
                  and pattern.search(p.read_text()))


def test_golden_files_are_found():
    names = {p.name for p in golden_files()}
    assert {"test_lab_golden.py", "test_correction.py", "test_precision.py", "test_quant.py"} <= names, names


def test_goldens_hold_under_an_emulated_older_cpu(tmp_path):
    report = tmp_path / "goldens.xml"
    env = {**os.environ, **EMULATED_CPU, _INSIDE: "1"}
    files = [str(p.relative_to(TESTS.parent)) for p in golden_files()]
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "ignore", "-k", "golden",
                        f"--junitxml={report}", *files], cwd=TESTS.parent, env=env, capture_output=True, text=True,
                       timeout=600)
    assert report.is_file(), (r.stdout + r.stderr)[-4000:]
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    assert r.returncode == 0 and counts["failures"] == counts["errors"] == 0, (r.stdout + r.stderr)[-6000:]
    assert counts["skipped"] == 0, counts
    assert counts["tests"] >= 30, counts  # every golden ran (32 when this was written)
