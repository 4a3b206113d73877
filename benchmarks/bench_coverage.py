"""Speed of the coverage lab's C sweep: batched tensor program vs a per-seed loop.

Prints, measured in one run:
  * wall time of the full C sweep (8 C values x 2 arms x 16 seeds x 400 updates) as one batched
    program, and through the sweep runner (one cell per C value, process pool);
  * the speed-up of the batched trainer over the straightforward per-seed loop implementation
    (tests/reference/ref_chain.py: torch.nn + autograd + torch.optim.Adam, one model at a time)
    on the same reduced configuration, and the loop's extrapolated time for the full sweep.

Usage: python benchmarks/bench_coverage.py [--workers 2] [--reduced-updates 10]
       python benchmarks/bench_coverage.py --smoke    # the same measurements on tiny sizes, seconds
Targets (DESIGN / issue): full sweep <= 5 s on 2 cores; >= 10x faster than the loop.

``--smoke``: a sweep of 2 C values x 2 arms x 2 seeds x 20 updates (and the runner on it, with the
given workers), the loop on 1 model x 3 updates, one torch thread: the code paths, not the speed (the
targets' verdict is then not printed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _common import integer, line_buffered  # noqa: E402
from _common import parser as bench_parser  # noqa: E402

from creditlab.lab.runner import run_cells  # noqa: E402
from creditlab.lab.store import ResultStore  # noqa: E402
from creditlab.labs.coverage import LAB, CoverageConfig  # noqa: E402
from creditlab.train.chain import ChainTrainConfig, ModelSpec, train_chain  # noqa: E402
from reference.ref_chain import train_loop  # noqa: E402

CS = (1, 2, 3, 4, 6, 8, 10, 12)


def specs(Cs, seeds) -> list[ModelSpec]:
    return [ModelSpec(seed=s, C=C, arm=a, k=3) for C in Cs for a in ("uniform", "concentrated") for s in range(seeds)]


def parser() -> argparse.ArgumentParser:
    ap = bench_parser(__doc__)
    ap.add_argument("--workers", type=integer(1), default=2)
    ap.add_argument("--reduced-updates", type=integer(1), default=None,
                    help="updates of the loop comparison (default 10; --smoke: 3)")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    line_buffered()
    smoke = args.smoke
    if smoke:
        torch.set_num_threads(1)  # tiny ops on two busy threads mostly wait
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    if smoke:
        print("--smoke: tiny sizes, the figures below say nothing about speed")

    cfg = ChainTrainConfig(updates=20, eval_points=4) if smoke else ChainTrainConfig()
    Cs, seeds = ((2, 4), 2) if smoke else (CS, 16)
    full = specs(Cs, seeds)
    train_chain(full[:4], ChainTrainConfig(updates=2))  # warm-up
    t0 = time.perf_counter()
    out = train_chain(full, cfg)
    t_full = time.perf_counter() - t0
    print(f"{'smoke' if smoke else 'full'} C sweep, one batched program: {len(full)} models x {cfg.updates} updates: "
          f"{t_full:.2f} s")

    cov = CoverageConfig(experiments=("c_sweep",))
    if smoke:
        cov = replace(cov, Cs=Cs, seeds=seeds, train=cfg)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run_cells(LAB.cells(cov), ResultStore(tmp), workers=args.workers, progress=False)
        t_runner = time.perf_counter() - t0
    print(f"the same C sweep through the runner ({len(Cs)} cells, {args.workers} worker processes, "
          f"including process start-up): {t_runner:.2f} s")

    red_cfg = ChainTrainConfig(updates=args.reduced_updates or (3 if smoke else 10), eval_points=1 if smoke else 20)
    reduced = specs((3,), 1)[:1] if smoke else specs((3, 8), 2)
    t0 = time.perf_counter()
    train_chain(reduced, red_cfg)
    t_b = time.perf_counter() - t0
    t0 = time.perf_counter()
    train_loop(reduced, red_cfg)
    t_l = time.perf_counter() - t0
    per_model_update = t_l / (len(reduced) * red_cfg.updates)
    loop_full = per_model_update * len(full) * cfg.updates
    print(f"reduced config ({len(reduced)} models x {red_cfg.updates} updates): batched {t_b:.3f} s, "
          f"loop {t_l:.2f} s -> batched is {t_l / t_b:.0f}x faster")
    print(f"loop extrapolated to the {'smoke' if smoke else 'full'} sweep: {loop_full:.0f} s -> batched sweep is "
          f"{loop_full / t_full:.0f}x faster")
    print(f"sanity: mean final score uniform {out['final_score'][0::2].mean():.3f}")
    if not smoke:
        ok = t_full <= 5.0 and loop_full / t_full >= 10
        print(f"targets (full sweep <= 5 s, >= 10x vs loop): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
