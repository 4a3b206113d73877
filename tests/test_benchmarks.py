"""Every benchmark's ``--smoke`` runs to the end and prints its ratio lines, under the plain test command.

A benchmark is a script nobody runs until it is needed; these runs keep each one working. Each smoke
runs in a subprocess with its own ``HOME``, ``XDG_CACHE_HOME``, ``CREDITLAB_CACHE`` and ``TMPDIR``, so it
can neither read nor fill the user's base-policy cache, and must leave them empty. The smokes run two at
a time (most of each runs on one core); their figures mean nothing and are not checked, only that every
section ran and printed its ratios.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
NUM = r"\d+(?:\.\d+)?"
BASE_BUILD = [r"base policy: not in the cache yet; building it now .* into (\S+); later runs load it",
              rf"base policy: step {NUM}/{NUM}, loss {NUM}, {NUM} s, ETA {NUM} s"]

#: benchmark -> the lines (regular expressions, each must match a line) its smoke prints: its ratios
RATIOS: dict[str, list[str]] = {
    "bench_correction.py": [rf"^\[1\] .*speed-up\s+{NUM}x", rf"^\[2\] .*ratio\s+{NUM}", rf"^\[3\] .*/ at L=.*: {NUM}",
                            rf"^\[4\] .*= {NUM}x inputs", rf"^\[5\] .*ratio {NUM}",
                            *([rf"^\[6\] verl token TIS .*checks on .*= {NUM}x .*checks off .*= {NUM}x"]
                              if importlib.util.find_spec("verl") else [])],
    "bench_coverage.py": [rf"batched is {NUM}x faster", rf"batched sweep is {NUM}x faster",
                          r"through the runner \(2 cells, 2 worker processes"],
    "bench_diagnose.py": [rf"^parquet .*{NUM}x the target's time", rf"^jsonl .*{NUM}x the target's time",
                          rf"^\[2\] new, json: {NUM} MB, read\+checks\+trainer metrics {NUM} s wall \({NUM} MB/s\).* "
                          rf"peak RSS {NUM} GB", rf"^\[2\] old / new \(json\): peak RSS {NUM}x",
                          rf"^\[2\] --steps every:4 .*\({NUM}x faster\)",
                          rf"^\[3\] 16 files, one per step: .*speed-up {NUM}x"],
    "bench_fork.py": [rf"^\[ratio\] openai-sdk wall / creditlab/asyncio wall: {NUM}",
                      rf"^\[ratio\] openai-sdk wall / creditlab/httpx wall: {NUM}",
                      r"^\[three, one killed halfway\] 8/8 scored",
                      r"^\[cache\] rerun: 0 requests.*identical rewards: True", r"^\[faults\] final: 8/8 scored"],
    "bench_granularity.py": [*BASE_BUILD, *(rf"^   {arm} +{NUM} s  \({NUM}x grpo\)"
                                            for arm in ("grpo", "prm_fixed", "prm_decay", "opsd_ref", "opsd_advice")),
                             rf"full lab .* about {NUM} min with 1 worker"],
    "bench_mismatch.py": [*BASE_BUILD, rf"^1\. one update of 7 arms as one stack: {NUM} s",
                          *(rf"^   {p} +forward .*\( ?{NUM}x fp32.*decode step .*\( ?{NUM}x fp32.*forward \+ backward "
                            rf".*\( ?{NUM}x fp32" for p in ("fp32", "int8", "fp8", "nvfp4", "mxfp4")),
                          rf"stacking is {NUM}x faster", rf"about {NUM} min with 1 worker"],
    "bench_toolshop.py": [*BASE_BUILD, rf"^ratio fp8\+QAT / fp32 seconds per update: {NUM}",
                          rf"^full-length update fp8 engine / fp8 learner: {NUM} s/update"],
}


def test_every_benchmark_has_a_smoke_test_and_says_so():
    assert sorted(p.name for p in BENCH.glob("bench_*.py")) == sorted(RATIOS)
    for name in RATIOS:
        doc = ast.get_docstring(ast.parse((BENCH / name).read_text()))
        assert doc and "--smoke" in doc, f"{name}: its docstring (the usage) does not mention --smoke"


def _run(name: str, root: Path) -> tuple[subprocess.CompletedProcess, float, Path]:
    where = root / name.removesuffix(".py")
    for d in ("home", "xdg", "cache", "tmp"):
        (where / d).mkdir(parents=True)
    env = {**os.environ, "HOME": str(where / "home"), "XDG_CACHE_HOME": str(where / "xdg"),
           "CREDITLAB_CACHE": str(where / "cache"), "TMPDIR": str(where / "tmp")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(BENCH / name), "--smoke"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    return proc, time.perf_counter() - t0, where


@pytest.fixture(scope="module")
def smokes(tmp_path_factory):
    """Every benchmark's ``--smoke``, two at a time: name -> (process, wall seconds, its folders)."""
    root = tmp_path_factory.mktemp("smokes")
    with ThreadPoolExecutor(2) as pool:
        runs = {name: pool.submit(_run, name, root) for name in sorted(RATIOS)}
        return {name: f.result() for name, f in runs.items()}


@pytest.mark.parametrize("name", sorted(RATIOS))
def test_smoke(name, smokes):
    proc, wall, where = smokes[name]
    out = proc.stdout
    tail = f"--- stdout\n{out[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{name} --smoke exited {proc.returncode} after {wall:.1f} s\n{tail}"
    assert "--smoke: tiny sizes" in out or name == "bench_correction.py", tail
    missing = [p for p in RATIOS[name] if not re.search(p, out, re.MULTILINE)]
    assert not missing, f"{name} --smoke did not print lines matching {missing}\n{tail}"
    built = re.search(BASE_BUILD[0], out)
    if built:  # the base policy was built in a temporary folder, said before the build, and removed after
        assert Path(built.group(1)).parent == where / "tmp", built.group(1)
        assert out.index("not in the cache yet") < out.index(" step 1/")
    for d in ("home", "xdg", "cache", "tmp"):  # no cache filled, nothing left behind
        left = [str(p.relative_to(where)) for p in (where / d).rglob("*") if "creditlab" in p.name or
                p.name.startswith(("toolshop-base", "bench_fork"))]
        assert not left, f"{name} --smoke left {left}"


# ------------------------------------------------------------------------------------------------
# options: every one checked, refused in one line


@pytest.fixture
def bench_module(monkeypatch):
    """``bench_module(name)``: a benchmark script imported in this process (its ``parser`` and ``main``)."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", os.environ.get("THP_MEM_ALLOC_ENABLE", "1"))  # bench_mismatch sets it
    before = set(sys.modules)

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"_bench_{name.removesuffix('.py')}", BENCH / name)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    yield load
    for k in set(sys.modules) - before:
        if k == "_common" or k.startswith(("bench_", "_bench_")):
            del sys.modules[k]


def _refused(mod, argv, capsys) -> str:
    """stderr of ``main(argv)``, which must exit 2 with one line and no traceback."""
    with pytest.raises(SystemExit) as ex:
        mod.main(argv)
    err = capsys.readouterr().err
    assert ex.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)
    return err


@pytest.mark.parametrize("name", sorted(RATIOS))
def test_every_option_of_every_benchmark_is_checked_and_refused_in_one_line(name, bench_module, capsys):
    """Each option that takes a value has a checked type (a range) or choices; a value out of them exits 2
    with one line naming the option, before the benchmark runs (``--items 0``, ``--B 0``, ``--dose fp16``,
    ``--workers 0``, and every other)."""
    mod = bench_module(name)
    tried = 0
    for action in mod.parser()._actions:
        if not action.option_strings or action.nargs == 0 or action.dest == "help":
            continue
        flag = max(action.option_strings, key=len)
        bad = list(getattr(action.type, "refuses", ()))
        if action.choices:
            bad.append("not-a-choice")
        assert bad, f"{name} {flag}: no range and no choices: a bad value would reach the benchmark"
        for value in bad:
            err = _refused(mod, [flag, value], capsys)
            assert f"argument {'/'.join(action.option_strings)}:" in err and value in err, (flag, value, err)
            tried += 1
    assert tried or name == "bench_diagnose.py"


def test_presets_do_not_override_sizes_given_as_options(bench_module, capsys):
    """--quick and --smoke fill in only the sizes not given; both at once are refused in one line."""
    corr = bench_module("bench_correction.py")
    ap = corr.parser()
    args = corr.sizes(ap, ap.parse_args(["--smoke", "--B", "2", "--L", "64"]))
    assert (args.B, args.L, args.segments, args.repeat) == (2, 64, corr.SMOKE["segments"], corr.SMOKE["repeat"])
    args = corr.sizes(ap, ap.parse_args(["--quick", "--repeat", "5"]))
    assert (args.B, args.L, args.repeat) == (corr.QUICK["B"], corr.QUICK["L"], 5)
    for name in ("bench_correction.py", "bench_diagnose.py"):
        err = _refused(bench_module(name), ["--smoke", "--quick"], capsys)
        assert "--quick and --smoke are two presets of the sizes: give one" in err
    proc = subprocess.run([sys.executable, str(BENCH / "bench_correction.py"), "--smoke", "--B", "2", "--L", "64"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "batch B=2 L=64:" in proc.stdout, proc.stderr[-2000:]
