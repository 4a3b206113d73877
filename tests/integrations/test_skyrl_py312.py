"""scripts/check_skyrl_py312.sh, the check of what the suite's own environment (Python 3.11, SkyRL
0.3.0) cannot reach: SkyRL 0.4.0 and SkyRL's trainer path (``skyrl.train.trainer``), which need
Python 3.12.

The script builds a Python 3.12 environment with PyPI's torch, a CUDA build: the environment takes
about 6.4 GB of disk and the first run several minutes (docs/integrations.md has the figures), far
past the suite's time budget. So the test of the script itself runs only when asked,
``CREDITLAB_CHECK_SKYRL_PY312=1``, and skips with the reason otherwise, or where there is no Python
3.12 interpreter. Finding the interpreter is checked on every run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_skyrl_py312.sh"
OPT_IN = "CREDITLAB_CHECK_SKYRL_PY312"


def _find_python312() -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--find-python"], capture_output=True, text=True, timeout=60)


def test_the_script_finds_a_python312_or_says_there_is_none():
    found = _find_python312()
    if found.returncode == 2:
        assert "no Python 3.12 interpreter" in found.stderr
        return
    assert found.returncode == 0, found.stderr
    version = subprocess.run([found.stdout.strip(), "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60)
    assert version.stdout.strip() == "(3, 12)"
    nothing = subprocess.run(["bash", str(SCRIPT), "--find-python"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHON312": "/nonexistent/python3.12"})
    assert nothing.returncode == 2 and "no Python 3.12 interpreter" in nothing.stderr


@pytest.mark.slow
def test_skyrl_on_python312():
    found = _find_python312()
    if found.returncode != 0:
        pytest.skip("no Python 3.12 interpreter: SkyRL 0.4.0 and SkyRL's trainer (skyrl.train.trainer) need "
                    "one; scripts/check_skyrl_py312.sh checks them where there is one")
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(f"{OPT_IN}=1 runs scripts/check_skyrl_py312.sh (SkyRL 0.3.0 and 0.4.0 on Python 3.12): it "
                    "builds an environment with PyPI's CUDA torch (about 6.4 GB, minutes)")
    run = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=3600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    for version in ("0.3.0", "0.4.0"):
        assert f"SkyRL {version}: trainer imports ok; creditlab's SkyRL tests: " in run.stdout
