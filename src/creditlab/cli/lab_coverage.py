"""``creditlab lab coverage``: the coverage lab from the command line."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from creditlab.cli._apps import lab_app


@lab_app.command("coverage")
def coverage(
    quick: bool = typer.Option(False, "--quick", help="Reduced sweep (under a minute on 2 cores)."),
    out: Path = typer.Option(Path("runs/coverage"), "--out", help="Output directory (results store, tables, plots)."),
    seeds: int = typer.Option(None, "--seeds", help="Seeds per arm and configuration (default 16; quick 6)."),
    updates: int = typer.Option(None, "--updates", help="Policy updates per run (default 400; quick 150)."),
    workers: int = typer.Option(2, "--workers", help="Worker processes for the sweep cells."),
    state_dependent: bool = typer.Option(False, "--state-dependent",
                                         help="Policy also observes the correct-prefix length and a broken bit."),
    experiment: list[str] = typer.Option(None, "--experiment", "-e",
                                         help="Run only these experiments (c_sweep, vd_sweep, shuffle, dose)."),
) -> None:
    """Credit geometries on a hard-prerequisite chain: C sweep, verifier-density sweep, shuffled
    control, dose-response. Resumes an interrupted run in the same --out directory."""
    import time
    from dataclasses import replace

    from creditlab.lab.coverage import CoverageConfig, config_with, run_coverage, summary_tables
    from creditlab.lab.report import to_markdown

    cfg = CoverageConfig.quick() if quick else CoverageConfig()
    cfg = config_with(cfg, seeds=seeds, updates=updates)
    if experiment:
        cfg = replace(cfg, experiments=tuple(experiment))
    if state_dependent:
        cfg = replace(cfg, train=replace(cfg.train, state_dependent=True))
    cfg.validate()
    console = Console()
    t0 = time.perf_counter()
    frames = run_coverage(cfg, out, workers=workers)
    tabs = summary_tables(frames, cfg)
    for key in ("c_sweep_diff", "vd_sweep_diff", "shuffle_diff"):
        if key in tabs:
            console.print(f"[bold]{key}[/]")
            console.print(to_markdown(tabs[key]), markup=False, highlight=False)
    console.print(f"wrote {out}/report.md, parquet/markdown tables and PNG plots in {time.perf_counter() - t0:.1f} s")
