"""Speed of ``creditlab diagnose`` on a dump of about 1M tokens (target: under 10 s on 2 cores).

    python benchmarks/bench_diagnose.py            # 2,000 trajectories x 500 tokens, 16 steps
    python benchmarks/bench_diagnose.py --quick    # 10x smaller
    python benchmarks/bench_diagnose.py --smoke    # 48 trajectories x 120 tokens, 2 steps: seconds

The dump is synthetic but has every column: 4 turns of about 100 policy tokens separated by tool
observations, a small engine/learner mismatch, precision, process reward, truncation and 4 tool calls
with dataflow per trajectory. It is written once as parquet (a directory of one part per step, as the
exporters write it) and once as JSONL, and each is diagnosed end to end (read and validate, every
check, report.md, the PNGs and diagnose.json) as ``creditlab diagnose`` does. Prints the wall time of
each phase, the total against the 10 s target (and as a multiple of the time the target allows the
dump's tokens), and the load average (timings on a shared machine are provisional).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from _common import line_buffered
from _common import parser as bench_parser

from creditlab.diagnose import read_dump, run_checks, write_dump
from creditlab.diagnose.report import write_report

TURNS = [
    {"tool": "find_user", "args": {"name": "ann"}, "returned": ["u1"], "is_write": False},
    {"tool": "get_orders", "args": {"user_id": "u1"}, "returned": ["o7"], "is_write": False},
    {"tool": "get_item", "args": {"order_id": "o7"}, "returned": ["i3"], "is_write": False},
    {"tool": "exchange", "args": {"item_id": "i3"}, "returned": ["ok"], "is_write": True},
]


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


def timed(path: Path, out: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    dump = read_dump(path)
    t1 = time.perf_counter()
    results = run_checks(dump)
    t2 = time.perf_counter()
    write_report(dump, results, out)
    t3 = time.perf_counter()
    return {"tokens": dump.n_tokens, "read": t1 - t0, "checks": t2 - t1, "report": t3 - t2, "total": t3 - t0}


def parser() -> argparse.ArgumentParser:
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="10x fewer trajectories")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    if args.quick and args.smoke:
        ap.error("--quick and --smoke are two presets of the sizes: give one")
    line_buffered()
    n_traj, tokens, steps = (48, 120, 2) if args.smoke else (200, 500, 4) if args.quick else (2000, 500, 16)
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
        print(f"dump: {n_traj:,} trajectories x {tokens} tokens = {n_traj * tokens:,} tokens, {steps} steps; "
              f"parquet {sum(p.stat().st_size for p in parquet.iterdir()) / 1e6:.0f} MB, "
              f"JSONL {jsonl.stat().st_size / 1e6:.0f} MB")
        for name, path in (("parquet", parquet), ("jsonl", jsonl)):
            r = timed(path, tmp / f"out-{name}")
            ok = "under" if r["total"] < 10 else "OVER"
            allowed = 10 * r["tokens"] / 1e6  # the target: 1M tokens in 10 s
            print(f"{name:8s} read {r['read']:5.2f} s  checks {r['checks']:5.2f} s  report+plots {r['report']:5.2f} s  "
                  f"total {r['total']:5.2f} s ({r['tokens'] / r['total'] / 1e6:.2f} M tokens/s; {ok} the 10 s target; "
                  f"{r['total'] / allowed:.2f}x the target's time for {r['tokens']:,} tokens)")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
