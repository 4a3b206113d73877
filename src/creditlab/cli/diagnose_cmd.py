"""``creditlab diagnose DUMP... --out DIR``: fingerprint the silent failures in a rollout dump."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from creditlab.cli._apps import app

__all__ = ["diagnose"]

_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "info": "cyan", "skipped": "dim"}


@app.command("diagnose")
def diagnose(
    dumps: list[Path] = typer.Argument(..., metavar="DUMP", show_default=False,
                                       help="Dump files (.parquet, .jsonl, .jsonl.gz) or directories of them, "
                                            "e.g. verl's trainer.rollout_data_dir."),
    out: Path = typer.Option(..., "--out", help="Directory for report.md, the PNG plots and diagnose.json. A rerun "
                                                "replaces only the files creditlab diagnose wrote there (another "
                                                "report.md, e.g. a lab's, is refused); locked while the run lasts "
                                                "(<out>.lock)."),
    fail_on: str = typer.Option("fail", "--fail-on", help="Exit 1 on: fail (default), or warn (stricter)."),
    check: list[str] = typer.Option(None, "--check", help="Run only this check (repeatable)."),
    max_turns: int = typer.Option(16, "--max-turns", help="Turns shown by the by-turn mismatch check."),
    reward_column: list[str] = typer.Option(None, "--reward-column", metavar="NAME[=WEIGHT]",
                                            help="A reward-function column of TRL's log_completions tables "
                                                 "(repeatable): the reward is their sum, NaN as 0. Needed when "
                                                 "the table's layout and advantage cannot tell them from "
                                                 "log_extra columns (the error says so)."),
    steps: str = typer.Option(None, "--steps", metavar="SPEC",
                              help="Diagnose only these training steps: N, START:STOP (STOP excluded), "
                                   "START:STOP:STEP (every STEP-th), every:K (the steps divisible by K, as verl's "
                                   "save_freq counts), or several joined by commas, e.g. 10:1000:10,250:260. Other "
                                   "rows are not read (a verl rollout_data_dir file of another step is not opened); "
                                   "the report says which steps were read."),
    workers: int = typer.Option(1, "--workers", help="Read this many dump files at a time, in worker processes "
                                                     "(with --executor ray, the CPUs of a local Ray instance)."),
    executor: str = typer.Option(None, "--executor",
                                 help="Where the files are read: serial, process, ray (default: process when "
                                      '--workers > 1). ray needs pip install "creditlab\\[ray]".'),
    ray_address: str = typer.Option(None, "--ray-address", metavar="ADDR",
                                    help="Ray cluster of --executor ray (auto, HOST:PORT, ray://HOST:PORT); default: "
                                         "a local Ray instance for this run."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress and no table on the terminal (input warnings "
                                                      "and notes still go to stderr)."),
) -> None:
    """Diagnose rollout dumps: execution mismatch, reward hacking, degenerate groups, credit coverage.

    Writes report.md (a verdict table, then one section per check with its plot), PNG plots and diagnose.json.
    Reads dumps of any size in bounded memory, a batch of rows at a time; --steps reads a subset of the steps,
    --workers several files at a time.

    Exit code 0 when no check fails, 1 when one does (or warns, or the input has a warning, with --fail-on warn),
    2 for unreadable input or an --out that holds files creditlab diagnose did not write.
    """
    from rich.markup import escape

    from creditlab.diagnose.checks import format_value
    from creditlab.diagnose.report import diagnose as run
    from creditlab.diagnose.steps import parse_steps
    from creditlab.lab.runner import make_executor

    console = Console(stderr=True)
    selection = parse_steps(steps) if steps is not None else None
    ex = None
    if workers != 1 or executor not in (None, "serial") or ray_address is not None:
        ex = make_executor(workers, executor, ray_address,
                           warn=lambda m: console.print(f"[yellow]warning:[/] {escape(m)}", highlight=False))
    opts = {"fail_on": fail_on, "only": check or None, "max_turns": max_turns, "reward_columns": reward_column or None,
            "steps": selection, "executor": ex}
    if quiet:
        result = run(dumps, out, **opts)
    else:
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                      TimeElapsedColumn(), console=console, transient=True) as bar:
            tasks: dict[str, int] = {}

            def progress(what: str, done: int, total: int) -> None:
                kind = what.split(" ", 1)[0]
                if kind not in tasks:
                    tasks[kind] = bar.add_task("reading" if kind == "read" else "checks", total=total)
                bar.update(tasks[kind], completed=done, total=total, description=what)

            result = run(dumps, out, progress=progress, **opts)
        table = Table(title=f"creditlab diagnose: {result.summary['trajectories']:,} trajectories, "
                            f"{result.summary['tokens']:,} tokens", show_lines=False)
        for col in ("check", "status", "value", "evidence"):
            table.add_column(col, overflow="fold", no_wrap=col in ("check", "status", "value"))
        for r in result.results:
            table.add_row(r.id, f"[{_STYLE[r.status]}]{r.status}[/]", format_value(r.value), r.message)
        Console().print(table)
    for w in result.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False, soft_wrap=True)
    for note in (result.took_over, result.replaced):
        if note:
            console.print(f"note: {escape(note)}", highlight=False, soft_wrap=True)
    if not quiet:
        console.print(f"report: {out / 'report.md'}", highlight=False)
    raise typer.Exit(result.exit_code)
