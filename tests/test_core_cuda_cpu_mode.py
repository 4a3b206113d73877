"""The CUDA suite (tests/test_core_cuda.py) in CPU mode, under the plain test command.

Without a GPU every test of that module is skipped, so nothing would notice when its data or its calls
stop fitting the functions they check. This runs it in a subprocess with ``CREDITLAB_TEST_DEVICE=cpu``
(every call and every comparison, CPU against CPU) and requires that all of it passed and nothing was
skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_cuda_suite_passes_in_cpu_mode(tmp_path):
    report = tmp_path / "cuda_cpu.xml"
    env = {**os.environ, "CREDITLAB_TEST_DEVICE": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/test_core_cuda.py", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={report}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["failures"] == 0 and counts["errors"] == 0, (counts, tail)
    skipped = [c.get("name") for c in suite.iter("testcase") if c.find("skipped") is not None]
    assert counts["skipped"] == 0, f"skipped in CPU mode: {skipped}"
    assert counts["tests"] >= 90, (counts, tail)  # the whole module ran, not a stray subset
