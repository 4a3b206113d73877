"""What the dual clip changed between the mismatch lab's 2-core run and its dual-clip run, from their committed tables.

    python scripts/dual_clip_effect.py [--results DIR]    print both tables
    python scripts/dual_clip_effect.py --write             and write them to results/mismatch-dualclip/dual_clip_effect/
    python scripts/dual_clip_effect.py --check             exit 1 when the written tables differ from the runs'

The two runs share the world, the base policy, the budget, the tasks and the seeds (0-4 in both); the 2-core run
trained without the dual clip and scored held-out success on the fp32 engine, the dual-clip run trains with
``clip_ratio_c = 3`` and scores each arm's own engine, with the fp32 engine's score beside it (``final_fp32``). This
prints, for the arms both ran at MXFP4:

* the largest pre-clip gradient norm of any update and the share of updates above 2 (``curves``);
* the paired difference, seed for seed, of final held-out success on the fp32 engine: dual-clip run minus 2-core
  run (``summary``: ``final_fp32`` against ``final``), with its 95% interval.

A comparison across two registrations, not a prediction of either: what it shows is descriptive.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from creditlab.lab.report import paired_diff, to_markdown  # noqa: E402

ARMS = ("qat", "qat_tis", "qat_interq")
RUNS = {"2-core (no dual clip)": "mismatch-2core/run", "dual-clip": "mismatch-dualclip/run"}


def grad_norms(results: Path) -> pd.DataFrame:
    rows = []
    for name, run in RUNS.items():
        c = pd.read_parquet(results / run / "curves.parquet")
        c = c[(c["dose"] == "mxfp4") & c["arm"].isin(ARMS)].dropna(subset=["grad_norm"])
        for arm, g in c.groupby("arm", sort=False):
            rows.append({"run": name, "arm": arm, "updates": len(g), "seeds": g["seed"].nunique(),
                         "grad_norm_max": g["grad_norm"].max(), "share_above_2": (g["grad_norm"] > 2).mean()})
    out = pd.DataFrame(rows)
    order = {a: i for i, a in enumerate(ARMS)}
    out = out.sort_values(["arm", "run"], key=lambda c: c.map(order) if c.name == "arm" else c)
    return out.reset_index(drop=True)


def final_fp32(results: Path) -> pd.DataFrame:
    two = pd.read_parquet(results / RUNS["2-core (no dual clip)"] / "summary.parquet")
    dual = pd.read_parquet(results / RUNS["dual-clip"] / "summary.parquet")
    two = two[(two["dose"] == "mxfp4") & two["arm"].isin(ARMS)][["arm", "seed", "final"]].assign(run="no")
    dual = dual[dual["arm"].isin(ARMS)][["arm", "seed", "final_fp32"]].rename(columns={"final_fp32": "final"})
    dual = dual.assign(run="dual")
    both = pd.concat([two, dual], ignore_index=True)
    seeds = set(two["seed"]) & set(dual["seed"])
    both = both[both["seed"].isin(seeds)]
    out = []
    for arm in ARMS:
        sub = both[both["arm"] == arm]
        d = paired_diff(sub, "dual", "no", ["arm"], "final", arm_col="run", bounds=(-1.0, 1.0))
        out.append(d.assign(arm=arm))
    return pd.concat(out, ignore_index=True)[["arm", "mean", "lo", "hi", "n"]]


#: Where --write puts the tables (docs/mismatch.md's generated blocks read them), under --results.
OUT = "mismatch-dualclip/dual_clip_effect"


def tables(results: Path) -> dict[str, pd.DataFrame]:
    return {"grad_norms": grad_norms(results), "final_fp32": final_fp32(results)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    ap.add_argument("--write", action="store_true", help=f"write the tables to <results>/{OUT}/")
    ap.add_argument("--check", action="store_true", help=f"exit 1 when <results>/{OUT}/ differs from the runs")
    args = ap.parse_args(argv)
    tabs = tables(args.results)
    out = args.results / OUT
    if args.check:
        stale = [name for name, df in tabs.items() if not (out / f"{name}.parquet").is_file()
                 or not df.equals(pd.read_parquet(out / f"{name}.parquet"))]
        for name in stale:
            print(f"{out / name}.parquet: stale; rerun python scripts/dual_clip_effect.py --write")
        return 1 if stale else 0
    print("Pre-clip gradient norm per update, MXFP4:\n")
    print(to_markdown(tabs["grad_norms"], ".3g"))
    print("\nFinal held-out success on the fp32 engine, dual-clip run minus 2-core run, same seeds:\n")
    print(to_markdown(tabs["final_fp32"], "+.3f"))
    if args.write:
        out.mkdir(parents=True, exist_ok=True)
        for name, df in tabs.items():
            df.to_parquet(out / f"{name}.parquet", index=False)
        print(f"\nwrote {out}/grad_norms.parquet, final_fp32.parquet")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
