"""docs/mismatch.md's comparison of the 2-core and the dual-clip runs reads tables that
``scripts/dual_clip_effect.py --write`` made from the two committed runs: they are what the script makes now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_comparison_is_what_the_runs_give():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "dual_clip_effect.py"), "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
