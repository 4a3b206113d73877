"""``creditlab lab toolshop``: outcome GRPO of the tiny tool-use agent from its base policy."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from creditlab.cli._apps import lab_app


@lab_app.command("toolshop")
def toolshop(
    quick: bool = typer.Option(False, "--quick", help="Few updates, small batches, one seed."),
    out: Path = typer.Option(Path("runs/toolshop"), "--out", help="Output directory (store, tables, plots)."),
    updates: int = typer.Option(None, "--updates", help="Policy updates per seed (default 100; quick 12)."),
    seeds: int = typer.Option(None, "--seeds", help="Number of training seeds (default 2; quick 1)."),
    rollout_precision: str = typer.Option("fp32", "--rollout-precision",
                                          help="Rollout engine: fp32, bf16, fp8 (W8A8-KV8), int8 (W8A8)."),
    learner_precision: str = typer.Option("fp32", "--learner-precision",
                                          help="Learner: fp32, or the engine's precision for a QAT learner."),
    correction: str = typer.Option("none", "--correction",
                                   help="Per-token weights: none, tis, mis, seq_is, geo, prefix, global,"
                                        " interq."),
    workers: int = typer.Option(1, "--workers", help="Worker processes (one cell per seed)."),
) -> None:
    """Multi-turn outcome GRPO on toolshop: success and K3(engine||learner) over updates, plus the
    execution-mismatch table of the base policy. The base policy is trained on first use (about two
    minutes on 2 cores) and cached; set CREDITLAB_CACHE to choose where."""
    import time
    from dataclasses import replace

    from creditlab.lab.report import to_markdown
    from creditlab.lab.toolshop import ToolshopLabConfig, run_toolshop
    from creditlab.lab.toolshop_grpo import make_weights

    cfg = ToolshopLabConfig.quick() if quick else ToolshopLabConfig()
    make_weights(correction)  # validates the arm name
    grpo = replace(cfg.grpo, rollout_precision=rollout_precision, learner_precision=learner_precision,
                   correction=correction, **({"updates": updates} if updates is not None else {}))
    cfg = replace(cfg, grpo=grpo)
    if seeds is not None:
        cfg = replace(cfg, seeds=tuple(range(seeds)))
    cfg.validate()
    console = Console()
    t0 = time.perf_counter()
    res = run_toolshop(cfg, out, workers=workers)
    console.print(to_markdown(res["summary"], ".3g"), markup=False, highlight=False)
    console.print(to_markdown(res["mismatch"], ".3g"), markup=False, highlight=False)
    console.print(f"wrote {out}/report.md, tables and plots in {time.perf_counter() - t0:.1f} s")
