"""Speed and memory of ``creditlab diagnose``: 1M tokens end to end, a real run's size in bounded memory.

    python benchmarks/bench_diagnose.py            # [1] 1M tokens; [2] a 422 MB JSONL dump; [3] files in parallel
    python benchmarks/bench_diagnose.py --old      # [2] also with the in-memory reader of before, side by side
    python benchmarks/bench_diagnose.py --mb 844   # [2] at another size
    python benchmarks/bench_diagnose.py --quick    # 10x smaller
    python benchmarks/bench_diagnose.py --smoke    # tiny sizes, seconds (the old reader included)

[1] 2,000 trajectories x 500 tokens, 16 steps (target: under 10 s on 2 cores). The dump is synthetic but
has every column: 4 turns of about 100 policy tokens separated by tool observations, a small
engine/learner mismatch, precision, process reward, truncation and 4 tool calls with dataflow per
trajectory. It is written once as parquet (a directory of one part per step, as the exporters write it)
and once as JSONL, and each is diagnosed end to end (read and validate, every check, report.md, the
PNGs and diagnose.json) as ``creditlab diagnose`` does.

[2] The dump of issue 45's measurements: rows of 12 turns x (125 policy + 20 tool) tokens, 16 steps, every
column (12 tool calls per row), as one JSONL file of ``--mb`` MB (422: the run that took 53 s and 3.2 GB
before). Each reader runs in a fresh process on one thread (``OMP_NUM_THREADS=1``): the streaming reader
end to end (``creditlab.diagnose.report.diagnose``: read, checks, trainers' metrics, report, plots), with
orjson parsing the lines when it is installed ("new") and with Python's json module ("new, json"), and,
with ``--old``, the in-memory reader it replaced (tests/reference/diagnose_inmemory: read, checks,
trainers' metrics; no report). Prints the file size, the wall and CPU time, MB/s of each, and the peak
resident memory of the process (and how much of it the imports take), against the targets: <= 1.5 GB,
>= 20 MB/s on one core.

[3] The same rows as one file per step (a verl ``rollout_data_dir``), diagnosed with 1 worker and with
``--workers`` worker processes (the labs' process executor).

Every figure is printed with the load average: timings on a shared machine are provisional.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from _common import integer, line_buffered, load_line
from _common import parser as bench_parser

from creditlab.diagnose import read_dump, run_checks, write_dump
from creditlab.diagnose.report import write_report
from creditlab.lab.runner import make_executor

ROOT = Path(__file__).resolve().parents[1]
TURNS = [
    {"tool": "find_user", "args": {"name": "ann"}, "returned": ["u1"], "is_write": False},
    {"tool": "get_orders", "args": {"user_id": "u1"}, "returned": ["o7"], "is_write": False},
    {"tool": "get_item", "args": {"order_id": "o7"}, "returned": ["i3"], "is_write": False},
    {"tool": "exchange", "args": {"item_id": "i3"}, "returned": ["ok"], "is_write": True},
]
TARGET_GB, TARGET_MBS = 1.5, 20.0


def make_rows(n_traj: int, tokens: int, steps: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    per_step = n_traj // steps
    obs = 8
    turn_len = (tokens - 3 * obs) // 4
    pm = np.zeros(tokens, dtype=bool)
    tid = np.full(tokens, -1, dtype=np.int64)
    k = 0
    for t in range(4):
        pm[k:k + turn_len] = True
        tid[k:k + turn_len + (obs if t < 3 else 0)] = t
        k += turn_len + obs
    pm_list, tid_list = pm.tolist(), tid.tolist()
    rows = []
    for i in range(n_traj):
        lp = -rng.uniform(0.05, 3.0, tokens)
        rollout = np.where(pm, lp - 0.01 * rng.standard_normal(tokens), 0.0)
        rows.append({"step": i // per_step, "group": (i % per_step) // 8, "reward": float(rng.random() < 0.5),
                     "logprobs": lp.tolist(), "rollout_logprobs": rollout.tolist(), "policy_mask": pm_list,
                     "turn_ids": tid_list, "precision": float(rng.uniform(0.6, 0.9)),
                     "process_reward": float(rng.random()), "truncated": bool(rng.random() < 0.1),
                     "instruction": "exchange the item of ann",
                     "turns": [dict(t, process_score=float(rng.random() < 0.7)) for t in TURNS]})
    return rows


def agent_row(rng: np.random.Generator, step: int, group: int, turns: int = 12, policy: int = 125,
              tool: int = 20) -> dict:
    """One row of issue 45's dumps: ``turns`` x (``policy`` policy tokens, then ``tool`` tool tokens), a
    per-token log ratio of about 0.03 (K3 near 5e-4), every trajectory column."""
    L = turns * (policy + tool)
    pm = np.tile(np.r_[np.ones(policy, dtype=bool), np.zeros(tool, dtype=bool)], turns)
    tid = np.repeat(np.arange(turns), policy + tool)
    lp = -rng.uniform(0.05, 3.0, L)
    rollout = np.where(pm, np.minimum(lp - 0.03 * rng.standard_normal(L), -1e-6), 0.0)
    calls = [{"tool": f"tool_{t % 4}", "args": {"id": f"x{t}"}, "returned": [f"x{t + 1}"], "is_write": t == turns - 1,
              "process_score": float(rng.random() < 0.7)} for t in range(turns)]
    return {"step": step, "group": group, "reward": float(rng.random() < 0.5), "logprobs": lp.tolist(),
            "rollout_logprobs": rollout.tolist(), "policy_mask": pm.tolist(), "turn_ids": tid.tolist(),
            "precision": float(rng.uniform(0.6, 0.9)), "process_reward": float(rng.random()),
            "truncated": bool(rng.random() < 0.1), "instruction": "find x0", "turns": calls}


def write_agent_dump(path: Path, mb: float, steps: int = 16, seed: int = 0, per_step_files: Path | None = None) -> int:
    """A JSONL dump of about ``mb`` MB of :func:`agent_row` rows over ``steps`` steps (groups of 8); with
    ``per_step_files``, the same rows also as one ``{step}.jsonl`` per step there. Returns the rows."""
    rng = np.random.default_rng(seed)
    line = json.dumps(agent_row(rng, 0, 0)) + "\n"
    per_step = max(4, int(round(mb * 1e6 / len(line.encode()) / steps)))
    if per_step_files is not None:
        per_step_files.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for s in range(steps):
            lines = [json.dumps(agent_row(rng, s, i // 8)) + "\n" for i in range(per_step)]
            fh.writelines(lines)
            if per_step_files is not None:
                (per_step_files / f"{s}.jsonl").write_text("".join(lines), encoding="utf-8")
    return per_step * steps


def timed(path: Path, out: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    dump = read_dump(path, tokens=False)
    t1 = time.perf_counter()
    results = run_checks(dump)
    t2 = time.perf_counter()
    write_report(dump, results, out)
    t3 = time.perf_counter()
    return {"tokens": dump.n_tokens, "read": t1 - t0, "checks": t2 - t1, "report": t3 - t2, "total": t3 - t0}


# ------------------------------------------------------------------------------------------------
# [2]: one reader in a fresh process


def _rss() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def child(spec: dict) -> dict:
    """Run one reader (``spec["reader"]``: "new" or "old") on ``spec["path"]`` in this process; its times
    and memory."""
    import resource

    if spec["reader"] == "old":
        sys.path.insert(0, str(ROOT / "tests"))
        from reference.diagnose_inmemory import checks as old_checks
        from reference.diagnose_inmemory import readers as old_readers
        from reference.diagnose_inmemory import trainer_metrics as old_metrics
    else:
        from creditlab.diagnose.trainer_metrics import trainer_metrics
    base = _rss()
    t0, c0 = time.perf_counter(), time.process_time()
    if spec["reader"] == "old":
        dump = old_readers.read_dump(spec["path"])
        results = old_checks.run_checks(dump)
        old_metrics.trainer_metrics(dump)
        report = 0.0
    else:  # what creditlab.diagnose.report.diagnose runs, timed in two parts
        if not spec.get("orjson", True):
            import creditlab.diagnose.readers as readers

            readers._orjson = None  # parse with Python's json module
        ex = make_executor(spec["workers"]) if spec.get("workers", 1) > 1 else None
        dump = read_dump(spec["path"], tokens=False, steps=spec.get("steps"), executor=ex)
        results = run_checks(dump)
        trainer = trainer_metrics(dump)
        t1 = time.perf_counter()
        write_report(dump, results, spec["out"], trainer=trainer)
        report = time.perf_counter() - t1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"wall": wall - report, "cpu": cpu, "report": report, "peak": peak, "base": base,
            "statuses": {r.id: r.status for r in results}}


CHILD = ("import json, sys; sys.path.insert(0, {bench!r}); import bench_diagnose as b; "
         "print('RESULT ' + json.dumps(b.child(json.loads(sys.argv[1]))))")


def run_child(spec: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD.format(bench=str(Path(__file__).parent)), json.dumps(spec)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"the {spec['reader']} reader failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def has_orjson() -> bool:
    import creditlab.diagnose.readers as readers

    return readers._orjson is not None


def old_reader_available() -> bool:
    return (ROOT / "tests" / "reference" / "diagnose_inmemory" / "readers.py").is_file()


def big(tmp: Path, mb: float, old: bool, workers: int, smoke: bool) -> None:
    path = tmp / "agent.jsonl"
    per_step = tmp / "per_step"
    t0 = time.perf_counter()
    rows = write_agent_dump(path, mb, per_step_files=per_step)
    size = path.stat().st_size
    print(f"[2] dump: {rows:,} rows x 12 turns x (125 policy + 20 tool) tokens = {rows * 1740:,} tokens, 16 steps: "
          f"JSONL {size / 1e6:.0f} MB (written in {time.perf_counter() - t0:.0f} s)")
    got = {}
    readers = (["new"] if has_orjson() else []) + ["new, json"] + (["old"] if old else [])
    if old and not old_reader_available():
        print("[2] old: the in-memory reader (tests/reference/diagnose_inmemory) is not here: new reader only")
        readers.remove("old")
    for reader in readers:
        r = run_child({"reader": reader.split(",")[0], "path": str(path), "out": str(tmp / "out-new"),
                       "orjson": reader == "new"})
        got[reader] = r
        ok = ("meets" if r["peak"] / 1e9 <= TARGET_GB and size / 1e6 / r["wall"] >= TARGET_MBS else "misses")
        report = f" (then report and plots {r['report']:.1f} s)" if reader != "old" else ""
        print(f"[2] {reader}: {size / 1e6:.0f} MB, read+checks+trainer metrics {r['wall']:.1f} s wall "
              f"({size / 1e6 / r['wall']:.1f} MB/s){report}, {r['cpu']:.1f} s CPU in all, peak RSS "
              f"{r['peak'] / 1e9:.2f} GB ({r['base'] / 1e9:.2f} GB of it imports); {ok} the targets (<= {TARGET_GB} "
              f"GB, >= {TARGET_MBS:.0f} MB/s on one core); {load_line()}")
    if "old" in got:
        a, b = got["old"], got["new, json"]
        same = a["statuses"] == {k: v for k, v in b["statuses"].items() if k in a["statuses"]}
        print(f"[2] old / new (json): peak RSS {a['peak'] / b['peak']:.2f}x, above the imports "
              f"{(a['peak'] - a['base']) / max(b['peak'] - b['base'], 1):.2f}x, wall {a['wall'] / b['wall']:.2f}x; "
              f"same statuses: {same}")
    sel = run_child({"reader": "new", "path": str(path), "out": str(tmp / "out-steps"), "steps": "every:4"})
    full = got[readers[0]]["wall"]
    print(f"[2] --steps every:4 (4 of 16 steps): {sel['wall']:.1f} s wall ({full / sel['wall']:.2f}x faster), peak RSS "
          f"{sel['peak'] / 1e9:.2f} GB")
    serial = run_child({"reader": "new", "path": str(per_step), "out": str(tmp / "out-dir1")})
    par = run_child({"reader": "new", "path": str(per_step), "out": str(tmp / "out-dirN"), "workers": workers})
    print(f"[3] 16 files, one per step: 1 worker {serial['wall']:.1f} s, {workers} worker processes "
          f"{par['wall']:.1f} s (speed-up {serial['wall'] / par['wall']:.2f}x on {os.cpu_count()} cores; same "
          f"statuses: {serial['statuses'] == par['statuses']}); {load_line()}")


def parser() -> argparse.ArgumentParser:
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="10x fewer trajectories, a 10x smaller [2]")
    ap.add_argument("--mb", type=integer(1), default=None, help="size of the JSONL dump of [2], MB (default 422)")
    ap.add_argument("--old", action="store_true",
                    help="[2] also with the in-memory reader of before (tests/reference), side by side")
    ap.add_argument("--workers", type=integer(2), default=2, help="[3] worker processes (default 2)")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    if args.quick and args.smoke:
        ap.error("--quick and --smoke are two presets of the sizes: give one")
    line_buffered()
    n_traj, tokens, steps = (48, 120, 2) if args.smoke else (200, 500, 4) if args.quick else (2000, 500, 16)
    mb = args.mb or (1 if args.smoke else 42 if args.quick else 422)
    if args.smoke:
        print("--smoke: tiny sizes, the figures below say nothing about speed")
    rows = make_rows(n_traj, tokens, steps)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        parquet = tmp / "parquet"
        per_step = n_traj // steps
        for s in range(steps):
            write_dump(rows[s * per_step:(s + 1) * per_step], parquet)
        jsonl = write_dump(rows, tmp / "dump.jsonl")
        del rows
        print(f"[1] dump: {n_traj:,} trajectories x {tokens} tokens = {n_traj * tokens:,} tokens, {steps} steps; "
              f"parquet {sum(p.stat().st_size for p in parquet.iterdir()) / 1e6:.0f} MB, "
              f"JSONL {jsonl.stat().st_size / 1e6:.0f} MB")
        for name, path in (("parquet", parquet), ("jsonl", jsonl)):
            r = timed(path, tmp / f"out-{name}")
            ok = "under" if r["total"] < 10 else "OVER"
            allowed = 10 * r["tokens"] / 1e6  # the target: 1M tokens in 10 s
            print(f"{name:8s} read {r['read']:5.2f} s  checks {r['checks']:5.2f} s  report+plots {r['report']:5.2f} s  "
                  f"total {r['total']:5.2f} s ({r['tokens'] / r['total'] / 1e6:.2f} M tokens/s; {ok} the 10 s target; "
                  f"{r['total'] / allowed:.2f}x the target's time for {r['tokens']:,} tokens)")
        print(f"{load_line()} on {os.cpu_count()} cores")
        big(tmp, mb, args.old or args.smoke, args.workers, args.smoke)


if __name__ == "__main__":
    main()
