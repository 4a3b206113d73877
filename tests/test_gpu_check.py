"""scripts/gpu_check.py, the check for the first machine with a GPU, kept runnable where there is none.

It cannot run here (no CUDA device): this checks that it compiles, that it refuses to start without CUDA
in one line with a non-zero exit code and writes nothing, and that the calls it times and counts host
syncs of run (on the CPU, at tiny shapes), so the script does not rot before a GPU run."""

from __future__ import annotations

import os
import py_compile
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def test_it_compiles(tmp_path):
    py_compile.compile(str(SCRIPT), cfile=str(tmp_path / "gpu_check.pyc"), doraise=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: run the check itself")
def test_without_cuda_it_refuses_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "gpu-check"
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device"), r.stderr
    assert r.stdout == "" and not out.exists()


def test_the_timed_and_counted_calls_run_on_the_cpu():
    ns = runpy.run_path(str(SCRIPT), run_name="gpu_check")
    assert ns["SHAPES"] == {"B": 64, "L": 8192, "segments": 32}  # bench_correction.py's full run
    bench = (SCRIPT.parents[1] / "benchmarks" / "bench_correction.py").read_text()
    assert 'FULL = {"B": 64, "L": 8192, "segments": 32' in bench
    calls = ns["hot_path_calls"]("cpu", 4, 256, 4)
    assert set(ns["TIMED"]) <= set(calls) and any(k.startswith("verl creditlab_ppo") for k in calls)
    for fn in calls.values():
        fn()
    rows = ns["time_calls"]("cpu", 4, 256, 4, repeat=1)
    assert [r["call"] for r in rows] == list(ns["TIMED"]) and all(r["ms"] > 0 for r in rows)
    assert rows[-1]["x_verl_token_tis"] == pytest.approx(1.0)
