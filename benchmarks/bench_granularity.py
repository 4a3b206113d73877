"""Where the granularity lab's time goes, and how long its full run takes.

Run (one torch thread, as each lab worker):

    python benchmarks/bench_granularity.py [--updates 3]

From the lab's cached base policy (built on first use), side by side in one run:

1. a few updates of each arm with the lab's settings, split into the update itself (rollout,
   log-probs or teacher scores, optimisation) and the held-out evaluation;
2. the estimated wall time of the full lab (every arm x seed x update, plus the evaluations) with
   1 and with 2 workers (the cells are independent: two workers halve it on two free cores).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

import numpy as np
import torch

from creditlab.labs.granularity import ARMS, GranularityConfig, evaluate_types, run_arm
from creditlab.train.toolshop_base import base_policy, default_cache_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cache = str(default_cache_dir(os.environ.get("CREDITLAB_CACHE")))
    cfg = GranularityConfig(cache_dir=cache)
    g = cfg.grpo
    model = base_policy(cfg.base, cache_dir=cache)
    load = os.getloadavg()
    print(f"{g.tasks_per_update} tasks x {g.group_size} rollouts per update, {args.updates} updates per arm, 1 thread; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    t0 = time.perf_counter()
    evaluate_types(model, cfg)
    t_eval = time.perf_counter() - t0
    print(f"\none held-out evaluation ({2 * cfg.eval_per_type} tasks): {t_eval:.2f} s")
    short = replace(cfg, grpo=replace(g, updates=args.updates))
    per_update = {}
    print("\nper update (mean of the updates after the first):")
    for arm in ARMS:
        rows = run_arm(short.identity(), arm, 0, cache)
        ts = [r["time/update_s"] for r in rows if r["kind"] == "train"]
        # update 0 carries the evaluation at update 0 (the callback runs inside it): leave it out
        per_update[arm] = float(np.mean(ts[1:])) if len(ts) > 1 else float(ts[0]) - t_eval
        print(f"   {arm:12s} {per_update[arm]:6.2f} s")
    n_eval = g.updates // g.eval_every + 1
    cell = {a: g.updates * per_update[a] + n_eval * t_eval for a in ARMS}
    total = cfg.seeds * sum(cell.values())
    longest = max(cell.values())
    print(f"\nfull lab ({len(ARMS)} arms x {cfg.seeds} seeds x {g.updates} updates, {n_eval} evaluations per run) at "
          f"this speed: about {total / 60:.1f} min with 1 worker, {max(total / 2, longest) / 60:.1f} min with "
          "--workers 2")


if __name__ == "__main__":
    main()
