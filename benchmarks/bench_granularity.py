"""Where the granularity lab's time goes, and how long its full run takes.

Run (one torch thread, as each lab worker):

    python benchmarks/bench_granularity.py [--updates 3]
    python benchmarks/bench_granularity.py --smoke     # every arm on tiny sizes, seconds

From the lab's cached base policy (built on first use: it says so, then prints the build's steps
with an ETA), side by side in one run:

1. a few updates of each arm with the lab's settings, split into the update itself (rollout,
   log-probs or teacher scores, optimisation) and the held-out evaluation, and each arm's time per
   update against GRPO's;
2. the estimated wall time of the full lab (every arm x seed x update, plus the evaluations) with
   1 and with 2 workers (the cells are independent: two workers halve it on two free cores).

``--smoke``: every arm for 2 updates of 2 tasks x 2 rollouts of at most 64 tokens, 2 held-out tasks
per type, from a tiny base policy built in a temporary cache directory: the code paths, not the speed.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import replace

import numpy as np
import torch
from _common import cache_dir, integer, line_buffered, load_base, smoke_base
from _common import parser as bench_parser

from creditlab.labs.granularity import ARMS, GranularityConfig, evaluate_types, run_arm


def parser() -> argparse.ArgumentParser:
    ap = bench_parser(__doc__)
    ap.add_argument("--updates", type=integer(1), default=None, help="updates per arm (default 3; --smoke: 2)")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    line_buffered()
    with ExitStack() as stack:
        run(args, cache_dir(args.smoke, stack))


def run(args, cache: str) -> None:
    torch.set_num_threads(1)
    updates = args.updates or (2 if args.smoke else 3)
    cfg = GranularityConfig(cache_dir=cache)
    if args.smoke:
        print("--smoke: tiny sizes, the figures below say nothing about speed")
        cfg = replace(cfg, base=smoke_base(cfg.base), eval_per_type=2,
                      grpo=replace(cfg.grpo, tasks_per_update=2, group_size=2, max_len=64, eval_every=1))
    g = cfg.grpo
    model = load_base(cfg.base, cache, "granularity base policy")
    load = os.getloadavg()
    print(f"{g.tasks_per_update} tasks x {g.group_size} rollouts per update, {updates} updates per arm, 1 thread; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    t0 = time.perf_counter()
    evaluate_types(model, cfg)
    t_eval = time.perf_counter() - t0
    print(f"\none held-out evaluation ({2 * cfg.eval_per_type} tasks): {t_eval:.2f} s")
    short = replace(cfg, grpo=replace(g, updates=updates))
    per_update = {}
    print("\nper update (mean of the updates after the first):")
    for arm in ARMS:
        rows = run_arm(short.identity(), arm, 0, cache)
        ts = [r["time/update_s"] for r in rows if r["kind"] == "train"]
        # update 0 carries the evaluation at update 0 (the callback runs inside it): leave it out
        per_update[arm] = float(np.mean(ts[1:])) if len(ts) > 1 else float(ts[0]) - t_eval
        first = next(iter(per_update))
        print(f"   {arm:12s} {per_update[arm]:6.2f} s  ({per_update[arm] / per_update[first]:.2f}x {first})")
    n_eval = g.updates // g.eval_every + 1
    cell = {a: g.updates * per_update[a] + n_eval * t_eval for a in ARMS}
    total = cfg.seeds * sum(cell.values())
    longest = max(cell.values())
    print(f"\nfull lab ({len(ARMS)} arms x {cfg.seeds} seeds x {g.updates} updates, {n_eval} evaluations per run) at "
          f"this speed: about {total / 60:.1f} min with 1 worker, {max(total / 2, longest) / 60:.1f} min with "
          "--workers 2")


if __name__ == "__main__":
    main()
