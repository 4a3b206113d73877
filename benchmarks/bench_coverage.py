"""Speed of the coverage lab's C sweep: batched tensor program vs a per-seed loop.

Prints, measured in one run:
  * wall time of the full C sweep (8 C values x 2 arms x 16 seeds x 400 updates) as one batched
    program, and through the sweep runner (one cell per C value, process pool);
  * the speed-up of the batched trainer over the straightforward per-seed loop implementation
    (tests/reference/ref_chain.py: torch.nn + autograd + torch.optim.Adam, one model at a time)
    on the same reduced configuration, and the loop's extrapolated time for the full sweep.

Usage: python benchmarks/bench_coverage.py [--workers 2] [--reduced-updates 10]
Targets (DESIGN / issue): full sweep <= 5 s on 2 cores; >= 10x faster than the loop.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from creditlab.lab.runner import run_cells  # noqa: E402
from creditlab.lab.store import ResultStore  # noqa: E402
from creditlab.labs.coverage import LAB, CoverageConfig  # noqa: E402
from creditlab.train.chain import ChainTrainConfig, ModelSpec, train_chain  # noqa: E402
from reference.ref_chain import train_loop  # noqa: E402

CS = (1, 2, 3, 4, 6, 8, 10, 12)


def specs(Cs, seeds) -> list[ModelSpec]:
    return [ModelSpec(seed=s, C=C, arm=a, k=3) for C in Cs for a in ("uniform", "concentrated") for s in range(seeds)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reduced-updates", type=int, default=10)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")

    cfg = ChainTrainConfig()
    full = specs(CS, 16)
    train_chain(full[:4], ChainTrainConfig(updates=2))  # warm-up
    t0 = time.perf_counter()
    out = train_chain(full, cfg)
    t_full = time.perf_counter() - t0
    print(f"full C sweep, one batched program: {len(full)} models x {cfg.updates} updates: {t_full:.2f} s")

    cov = CoverageConfig(experiments=("c_sweep",))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run_cells(LAB.cells(cov), ResultStore(tmp), workers=args.workers, progress=False)
        t_runner = time.perf_counter() - t0
    print(f"full C sweep through the runner ({len(CS)} cells, {args.workers} worker processes, "
          f"including process start-up): {t_runner:.2f} s")

    red_cfg = ChainTrainConfig(updates=args.reduced_updates)
    reduced = specs((3, 8), 2)
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
    print(f"loop extrapolated to the full sweep: {loop_full:.0f} s -> full batched sweep is "
          f"{loop_full / t_full:.0f}x faster")
    print(f"sanity: mean final score uniform {out['final_score'][0::2].mean():.3f}")
    ok = t_full <= 5.0 and loop_full / t_full >= 10
    print(f"targets (full sweep <= 5 s, >= 10x vs loop): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
