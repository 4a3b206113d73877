"""``creditlab fork score``: batch FORK scoring of a JSONL file."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from creditlab.cli._apps import fork_app
from creditlab.errors import ConfigError

__all__ = ["score"]


def _read_out(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by an interrupted run: that item is simply rescored
    return rows


def _compact(path: Path) -> list[dict]:
    """Keep the last row of each id (a rescored item replaces its earlier error row)."""
    last: dict[str, dict] = {}
    for r in _read_out(path):
        last[str(r.get("id"))] = r
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for r in last.values():
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return list(last.values())


@fork_app.command("score")
def score(
    inp: Path = typer.Option(..., "--in", help="Input JSONL: {id, prompt, response, rubrics: [{criterion, points}]}."),
    out: Path = typer.Option(..., "--out", help="Output JSONL; results are appended as they finish."),
    judge: str = typer.Option("openai", "--judge", help="openai (any OpenAI-compatible endpoint) or offline."),
    base_url: str = typer.Option("http://localhost:8000/v1", "--base-url", help="Endpoint of the openai judge."),
    model: str = typer.Option("judge", "--model", help="Model name for the openai judge."),
    api_key_env: str = typer.Option("OPENAI_API_KEY", "--api-key-env", help="Environment variable with the API key."),
    beta: float = typer.Option(1.0, "--beta", help="F-beta parameter (beta > 1 favours recall)."),
    tau: str = typer.Option("judge", "--tau", help="Necessity threshold: 'judge' or a number > 0."),
    mode: str = typer.Option("fork", "--mode", help="fork, or a baseline: recall, mean, f2."),
    concurrency: int = typer.Option(16, "--concurrency", help="Most judge requests in flight."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds per judge request."),
    max_retries: int = typer.Option(4, "--max-retries", help="Retries of 429/5xx/timeouts per request."),
    cache: Path = typer.Option(None, "--cache", help="sqlite cache of validated judge replies."),
    transport: str = typer.Option("httpx", "--transport",
                                  help="HTTP client: httpx, or asyncio (minimal, cheaper at high request rates)."),
    assume_correct: bool = typer.Option(False, "--assume-correct",
                                        help="Treat every unit as correct (required by the offline judge)."),
) -> None:
    """Score a JSONL file of rubric-graded responses with FORK. Rerunning skips the ids already
    scored and retries the failed ones. Exits 1 when some lines or items failed."""
    from creditlab.judge import EmbeddingJudge, JudgeCache, OpenAIJudge
    from creditlab.rewards import FORKReward, iter_jsonl_items

    console = Console(stderr=True)
    if not inp.exists():
        raise ConfigError("--in", f"no such file: {inp}")
    tau_v: str | float = tau
    if tau != "judge":
        try:
            tau_v = float(tau)
        except ValueError:
            raise ConfigError("--tau", f"must be 'judge' or a number, got {tau!r}") from None
    jcache = JudgeCache(cache) if cache is not None else None
    if judge == "openai":
        j = OpenAIJudge(base_url, model, api_key_env=api_key_env, concurrency=concurrency, timeout=timeout,
                        max_retries=max_retries, cache=jcache, transport=transport)
    elif judge == "offline":
        j = EmbeddingJudge()
    else:
        raise ConfigError("--judge", f"unknown judge {judge!r}; valid: openai, offline")
    reward = FORKReward(j, beta=beta, tau=tau_v, mode=mode, assume_correct=assume_correct)

    done = {str(r["id"]) for r in _read_out(out) if r.get("error") is None}
    items, bad, seen = [], 0, set()
    for _, it in iter_jsonl_items(inp):
        if isinstance(it, Exception):
            bad += 1
            console.print(f"skipped {it}", highlight=False, markup=False)
            continue
        if it.id in seen:
            bad += 1
            console.print(f"skipped {inp.name}: duplicate id {it.id!r}", highlight=False, markup=False)
            continue
        seen.add(it.id)
        if it.id not in done:
            items.append(it)

    async def run_all() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a", encoding="utf-8") as fh, Progress(
            TextColumn("[bold]fork score"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console,
        ) as bar:
            task = bar.add_task("score", total=len(seen), completed=len(seen) - len(items))
            async for res in reward.score_iter(items):
                fh.write(json.dumps(res.to_row(), ensure_ascii=False) + "\n")
                fh.flush()
                bar.advance(task)
        if hasattr(j, "aclose"):
            await j.aclose()

    if items:
        asyncio.run(run_all())
    rows = [r for r in _compact(out) if str(r.get("id")) in seen] if out.exists() else []
    ok = [r for r in rows if r.get("error") is None]
    failed = len(rows) - len(ok)

    def mean(key: str) -> str:
        vals = [float(r[key]) for r in ok if r.get(key) is not None]
        return f"{sum(vals) / len(vals):.3f}" if vals else "-"

    table = Table(title=f"FORK ({mode}, beta={beta:g}, judge={j.name})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in [
        ("items", str(len(seen))), ("scored", str(len(ok))), ("failures", str(failed)), ("bad lines", str(bad)),
        ("mean reward", mean("reward")), ("mean precision P", mean("precision")), ("mean recall Rec", mean("recall")),
        ("mean units", mean("n_units")), ("mean length (words)", mean("length_words")),
        ("judge requests (all runs)", str(sum(int(r.get("requests", 0)) for r in rows))),
        ("assume_correct", str(assume_correct)),
    ]:
        table.add_row(name, value)
    Console().print(table)
    if failed or bad:
        hints = []
        if failed:
            hints.append(f"{failed} item(s) failed: rerun the same command to retry them")
        if bad:
            hints.append(f"{bad} bad line(s) skipped (see the messages above)")
        console.print("; ".join(hints), highlight=False, markup=False)
        raise typer.Exit(1)
