"""``creditlab fork score``: batch FORK scoring of a JSONL file."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from creditlab._outlock import OutLock
from creditlab.cli._apps import fork_app
from creditlab.cli._results import RowWriter, check_cache, compact, scan_results, set_aside, truncate
from creditlab.errors import ConfigError

__all__ = ["score"]


def _read_out(path: Path) -> list[dict]:
    """The rows of a results file (:func:`creditlab.cli._results.scan_results`: a file that is not one is
    refused; cut-off lines are not rows)."""
    return scan_results(path).rows


def _compact(path: Path) -> list[dict]:
    """Keep the last row of each id (a rescored item replaces its earlier error row)."""
    return compact(path)


def _check_input(inp: Path) -> None:
    """``--in``: an existing, non-empty UTF-8 file (one line naming the path otherwise)."""
    if not inp.exists():
        raise ConfigError("--in", f"no such file: {inp}")
    if inp.is_dir():
        raise ConfigError("--in", f"{inp} is a directory, not a JSONL file")
    try:
        data = inp.read_bytes()
    except OSError as err:
        raise ConfigError("--in", f"cannot read {inp}: {err.strerror}") from None
    for magic, kind in ((b"\x1f\x8b", "gzip-compressed"), (b"PAR1", "a Parquet file"),
                        (b"PK\x03\x04", "a zip archive")):
        if data.startswith(magic):
            raise ConfigError("--in", f"{inp} is {kind}, not JSON Lines text; decompress or convert it to one JSON "
                                      "object per line first")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ConfigError("--in", f"{inp} is not UTF-8 text (invalid byte at offset {err.start}, line {line})"
                          ) from None
    text = text.replace("\ufeff", "")  # a UTF-8 byte order mark is ignored
    if not text.strip():
        raise ConfigError("--in", f"{inp} is empty: no JSON lines to score")
    from creditlab.errors import InputError
    from creditlab.rewards.items import check_jsonl_text

    try:
        check_jsonl_text(text, str(inp))
    except InputError as err:
        raise ConfigError("--in", str(err)) from None


def _read_items(inp: Path, response_field: str | None, console: Console) -> tuple[list, int, dict[str, int]]:
    """The items of ``--in`` (bad lines and duplicate ids are reported, one line each, and skipped):
    ``(items, bad line count, {id: line})``."""
    from creditlab.rewards import iter_jsonl_items

    items, bad, seen = [], 0, {}
    for n, it in iter_jsonl_items(inp, response_field=response_field):
        if isinstance(it, Exception):
            bad += 1
            console.print(f"skipped {it}", highlight=False, markup=False)
            continue
        if it.id in seen:
            bad += 1
            first = seen[it.id]
            if it.id_from == "hash":  # neither row has an id: they hold the same prompt, response and rubrics
                why = (f"the same item as line {first} (the same prompt, response and rubrics; neither row has an "
                       "'id', 'prompt_id' or 'uid', so each is named by a hash of those): remove one, or give each "
                       "its own 'id'")
            elif it.id_from == "id":
                why = (f"duplicate id {it.id!r} (first at line {first}; ids are compared as text, so 1 and \"1\" "
                       "are the same id)")
            else:
                why = (f"duplicate id {it.id!r}, taken from its field {it.id_from.split()[0]!r} as the row has no "
                       f"'id' (first at line {first}): give each row its own 'id'")
            console.print(f"skipped {inp.name}:{n}: {why}", highlight=False, markup=False)
            continue
        seen[it.id] = n
        items.append(it)
    return items, bad, seen


def _changed_inputs(previous: list[dict], items: list) -> list[str]:
    """Ids scored before (a row without error) whose input hash differs from the item's now (a row
    without an ``input_hash`` counts as changed)."""
    last_ok: dict[str, dict] = {}
    for r in previous:
        if r.get("error") is None:
            last_ok[str(r.get("id"))] = r
    return [it.id for it in items if it.id in last_ok and last_ok[it.id].get("input_hash") != it.input_hash]


def _response_summary(items: list) -> str:
    """Which field was scored as the response, and the reference fields the rows also hold (not scored)."""
    from collections import Counter

    fields = Counter(it.response_field for it in items)
    refs = Counter(k for it in items for k in it.references)
    text = ", ".join(f"'{k}'" + (f" ({n} rows)" if len(fields) > 1 else "") for k, n in fields.most_common())
    if refs:
        text += "; also held, not scored (references): " + ", ".join(f"'{k}' ({n} rows)" for k, n in refs.most_common())
    return text or "-"


def _check_output(out: Path, inp: Path) -> None:
    """``--out``: a JSONL file in an existing, writable directory, not the input itself."""
    if out.is_dir():
        raise ConfigError("--out", f"{out} is a directory; --out names the results file (JSONL)")
    if out.exists() and not out.is_file():
        raise ConfigError("--out", f"{out} is not a regular file (a device or a pipe); --out names the results "
                                   "file (JSONL)")
    if out.exists() and inp.exists() and out.resolve() == inp.resolve():
        raise ConfigError("--out", f"{out} is the input file; choose another --out")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError("--out", f"directory {parent} does not exist (create it first)")
    if not os.access(parent, os.W_OK):
        raise ConfigError("--out", f"the directory {parent} is not writable: fork score needs it for the lock file "
                                   f"{OutLock(out).path} (and to rewrite {out.name} in place); make {parent} "
                                   "writable, or choose an --out in a writable directory")
    if out.exists() and not os.access(out, os.W_OK):
        raise ConfigError("--out", f"{out} is not writable (its directory is): make the file writable, or choose "
                                   "another --out")


class _LazyWriter:
    """A :class:`RowWriter` opened at the first row: a run that writes no row (it failed before its first
    item finished) creates no --out, so nothing is left that a later run would take for its results."""

    def __init__(self, path: Path):
        self.path = path
        self._writer: RowWriter | None = None

    @property
    def written(self) -> int:
        return self._writer.written if self._writer is not None else 0

    def write(self, row: dict) -> None:
        if self._writer is None:
            self._writer = RowWriter(self.path)
        self._writer.write(row)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _stop_on_signals(stopped: list) -> None:
    """SIGINT (Ctrl-C) and SIGTERM cancel the running command's main task between two rows (never in the
    middle of writing one); the signal is appended to ``stopped``. Outside the main thread nothing is
    installed."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    def stop(sig: signal.Signals) -> None:
        stopped.append(sig)
        if main is not None:
            main.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop, sig)
        except (NotImplementedError, RuntimeError, ValueError):
            return


def _hold(ctx: typer.Context, lock: OutLock, console: Console) -> None:
    """Take ``--out``'s lock for the rest of the command: released when the command's context closes,
    which it does however the command ends (errors and exits included); names a stale lock taken over."""
    note = lock.acquire()
    ctx.call_on_close(lock.release)
    if note:
        console.print(note, highlight=False, markup=False)


DEFAULT_BASE_URL = "http://localhost:8000/v1"
#: Settings recorded in every row but not compared for equality on resume: where the judge model was
#: served. Two servers may serve different models under one model name (the judge cache keys replies
#: by endpoint for that reason), so a resume compares the endpoints on their own
#: (:func:`_endpoint_mismatch`): the rows' endpoints and this run's must share one, directly or through
#: the runs between (the endpoints of one run serve one model, so one more replica or one fewer resumes);
#: endpoints linked to none of the rows' are another judge.
UNCOMPARED = ("base_url",)


def _settings(**values) -> dict:
    """What produced a row; a resumed run reuses a row only when every compared value matches."""
    from creditlab import __version__

    return {**values, "creditlab_version": __version__}


def _settings_mismatch(rows: list[dict], settings: dict) -> list[str]:
    """Keys in which the rows of an earlier run differ from ``settings`` (empty: every row matches)."""
    diff: set[str] = set()
    for r in rows:
        old = r.get("settings")
        if not isinstance(old, dict):
            return ["settings (rows written without them, by another creditlab version)"]
        diff |= {k for k in set(old) | set(settings) if k not in UNCOMPARED and old.get(k) != settings.get(k)}
    return sorted(diff)


def _endpoint_mismatch(rows: list[dict], urls: list[str]) -> list[str]:
    """The endpoints (:func:`~creditlab.judge.cache.endpoint_id`, as the judge cache keys replies) of earlier
    openai-judge rows that are not the judge of this run's ``urls``, in the order first met; empty when every
    earlier row is.

    The endpoints of one run serve one model, so endpoints given together in a run (this one, or one that
    wrote rows) are one judge, and so are runs that share an endpoint: a chain of runs each adding or
    dropping a replica stays one judge. A row is another judge's when no such chain links it to this run.
    """
    from creditlab.judge.cache import endpoint_id

    parent: dict[str, str] = {}

    def find(e: str) -> str:
        parent.setdefault(e, e)
        while parent[e] != e:
            parent[e] = parent[parent[e]]
            e = parent[e]
        return e

    def join(ids: list[str]) -> None:
        for e in ids[1:]:
            parent[find(e)] = find(ids[0])

    sets: list[list[str]] = []
    for r in rows:
        old = r.get("settings")
        if not isinstance(old, dict) or old.get("judge") != "openai" or not old.get("base_url"):
            continue
        was = old["base_url"] if isinstance(old["base_url"], list) else [old["base_url"]]
        sets.append([endpoint_id(str(u)) for u in was])
        join(sets[-1])
    now = [endpoint_id(u) for u in urls]
    join(now)
    other: list[str] = []
    for ids in sets:
        if find(ids[0]) != find(now[0]):
            other += [e for e in ids if e not in other]
    return other


def _base_urls(flags: list[str] | None, path: Path | None) -> list[str]:
    """The endpoint URLs of ``--base-url`` (repeatable) and ``--base-urls-file`` (one per line, ``#``
    comments), in order; the default endpoint when neither is given."""
    urls: list[tuple[str, str]] = [(u.strip(), f"--base-url {u.strip()}") for u in flags or []]
    if path is not None:
        if not path.is_file():
            raise ConfigError("--base-urls-file", f"no such file: {path}" if not path.exists()
                              else f"{path} is a directory, not a file of URLs")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError("--base-urls-file", f"cannot read {path}: {err}") from None
        found = 0
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if line:
                urls.append((line, f"{path}:{n}"))
                found += 1
        if not found:
            raise ConfigError("--base-urls-file", f"{path} holds no URL (one per line, '#' starts a comment)")
    if not urls:
        return [DEFAULT_BASE_URL]
    seen: dict[str, str] = {}
    for url, where in urls:
        flag = "--base-url" if where.startswith("--") else "--base-urls-file"
        if not url.startswith(("http://", "https://")):
            raise ConfigError(flag, f"{where}: {url!r} must start with http:// or https://")
        from creditlab.judge.openai_compat import base_url_problem

        problem = base_url_problem(url)
        if problem:
            raise ConfigError(flag, f"{where}: {problem}")
        key = url.rstrip("/")
        if key in seen:
            raise ConfigError(flag, f"{where}: {url} is given twice (also {seen[key]})")
        seen[key] = where
    return [u.rstrip("/") for u, _ in urls]


def _transport(choice: str, urls: list[str]) -> str:
    """``--transport``; ``auto`` takes the minimal asyncio client only where it needs nothing it lacks:
    every URL plain http:// and not behind a proxy setting (https and proxies go through httpx)."""
    import urllib.request
    from urllib.parse import urlsplit

    if choice not in ("auto", "httpx", "asyncio"):
        raise ConfigError("--transport", f"unknown {choice!r}; valid: auto, httpx, asyncio")
    if choice != "auto":
        return choice
    proxies = urllib.request.getproxies()  # the environment's http_proxy / all_proxy / no_proxy, as httpx reads it
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme != "http":
            return "httpx"
        if (proxies.get("http") or proxies.get("all")) and not urllib.request.proxy_bypass(parts.hostname or ""):
            return "httpx"
    return "asyncio"


def _endpoint_lines(judge) -> list[str]:
    """Requests, errors and latency per endpoint of this run, one line each."""
    lines = []
    for st in judge.endpoint_stats():
        lat = (f"latency {st['latency_mean_s'] * 1000:.0f} ms mean, {st['latency_p95_s'] * 1000:.0f} ms p95"
               if st["latency_mean_s"] is not None else "no reply")
        why = f" ({st['reason']})" if st["reason"] else ""
        lines.append(f"  {st['base_url']}: {st['state']}, {st['requests']} requests, {st['errors']} errors, "
                     f"{lat}{why}")
    return lines


@fork_app.command("score")
def score(
    ctx: typer.Context,
    inp: Path = typer.Option(..., "--in", help="Input JSONL: {id, prompt, response, rubrics: [{criterion, points}]}."),
    out: Path = typer.Option(..., "--out",
                             help="Output JSONL; each row is written as its item finishes. A run owns it while it "
                                  "runs (<out>.lock): a second run into it is refused."),
    judge: str = typer.Option("openai", "--judge",
                              help="openai (any OpenAI-compatible endpoint) or offline (APPROXIMATE: an embedding "
                                   "model that measures topic, not truth; see docs/fork.md)."),
    base_url: list[str] = typer.Option(None, "--base-url",
                                       help=f"Endpoint of the openai judge (default {DEFAULT_BASE_URL}); repeat it "
                                            "for several endpoints serving the same model. A rerun into the same "
                                            "--out needs one endpoint of the runs that scored its rows."),
    base_urls_file: Path = typer.Option(None, "--base-urls-file",
                                        help="File of endpoint URLs, one per line ('#' comments), added to "
                                             "--base-url."),
    model: str = typer.Option(None, "--model", help="Model name for the openai judge (default 'judge')."),
    api_key_env: str = typer.Option("OPENAI_API_KEY", "--api-key-env", help="Environment variable with the API key."),
    beta: float = typer.Option(None, "--beta",
                               help="F-beta parameter of --mode fork (default 1; beta > 1 favours recall). --mode f2 "
                                    "is F-beta with beta 2, and recall and mean have no beta: --beta with them is "
                                    "refused unless it is what the mode computes (2 for f2)."),
    tau: str = typer.Option("judge", "--tau", help="Necessity threshold: 'judge' or a number > 0."),
    mode: str = typer.Option("fork", "--mode", help="fork, or a baseline: recall, mean, f2."),
    pitfall_only: str = typer.Option("error", "--pitfall-only",
                                     help="Items with only negative (pitfall) rubrics: error (cannot be scored) or "
                                          "absence (reward 1 when no pitfall is violated, else 0)."),
    concurrency: int = typer.Option(16, "--concurrency", help="Most judge requests in flight, per endpoint."),
    timeout: float = typer.Option(30.0, "--timeout", help="Seconds per judge request (see docs/fork.md for the "
                                                          "defaults' reason)."),
    max_retries: int = typer.Option(2, "--max-retries", help="Retries of 429/5xx/timeouts per request."),
    preflight: bool = typer.Option(True, "--preflight/--no-preflight",
                                   help="Check with one cheap request (GET /models, 10 s) that the endpoint answers "
                                        "before scoring."),
    cache: Path = typer.Option(None, "--cache",
                               help="sqlite cache of validated judge replies, each stored with the endpoint that "
                                    "gave it and served only to that endpoint (another server may serve another "
                                    "model under the same name)."),
    cache_any_endpoint: bool = typer.Option(False, "--cache-any-endpoint",
                                            help="Serve --cache replies whichever endpoint gave them (also those "
                                                 "of caches written before creditlab 0.2.0 recorded endpoints): "
                                                 "only for a cache known to come from the same model. Recorded in "
                                                 "every row's settings."),
    transport: str = typer.Option("auto", "--transport",
                                  help="HTTP client: httpx, asyncio (minimal HTTP/1.1, several times cheaper per "
                                       "request), or auto: asyncio when every endpoint is plain http:// and no proxy "
                                       "setting covers it, else httpx."),
    assume_correct: bool = typer.Option(False, "--assume-correct",
                                        help="Treat every unit as correct (required by the offline judge)."),
    force: bool = typer.Option(False, "--force",
                               help="Rescore every item into --out, discarding its rows, even rows made with other "
                                    "settings (judge, model, mode, beta, tau...). It never overrides the lock of a "
                                    "run still writing --out, and never erases a file that is not a fork-score "
                                    "results file. It concerns --out only: --cache still serves the replies this "
                                    "judge's endpoints gave to the same requests (choose another --cache, or none, "
                                    "to ask the judge again)."),
    response_field: str = typer.Option(None, "--response-field",
                                       help="Input field holding the response to score (default: 'response', else "
                                            "'completion'; 'answer', 'output', 'reference'... are read as "
                                            "references and scored only when named here)."),
    rescore_changed: bool = typer.Option(False, "--rescore-changed",
                                         help="Rescore the ids of --out whose prompt, response or rubrics changed "
                                              "since they were scored (without it such a rerun refuses)."),
) -> None:
    """Score a JSONL file of rubric-graded responses with FORK. Several endpoints serving the same model
    (--base-url repeated, or --base-urls-file) share the requests by load; one that keeps failing is
    taken out of rotation while the others go on. Rerunning with the same settings skips the ids
    already scored and retries the failed ones; rerunning with other settings (judge, model, mode,
    beta, tau...) into the same --out refuses unless --force, as does a rerun whose endpoints share
    none with those that scored the rows (one replica more or fewer resumes), and so
    does a rerun whose prompt, response or rubrics changed under ids already scored, unless
    --rescore-changed. Ctrl-C
    keeps every finished row (exit 130): rerun the same command to resume. Exits 1 when some lines or
    items failed, 2 on bad options or files."""
    from creditlab.core.precision import COMBINE_MODES
    from creditlab.judge.prompts import PROMPT_VERSION
    from creditlab.rewards.fork import BETA_MAX, BETA_MIN, MODE_BETA, effective_beta

    console = Console(stderr=True)
    # -- everything that can be checked without a judge, before anything expensive or any write
    _check_input(inp)
    _check_output(out, inp)
    check_cache(cache, inp, out)
    tau_v: str | float = tau
    if tau != "judge":
        try:
            tau_v = float(tau)
        except ValueError:
            raise ConfigError("--tau", f"must be 'judge' or a number, got {tau!r}") from None
        if not 0 < tau_v < float("inf"):
            raise ConfigError("--tau", f"must be a finite number > 0, got {tau_v}")
    if beta is not None and not BETA_MIN <= beta <= BETA_MAX:
        raise ConfigError("--beta", f"must be between {BETA_MIN:g} and {BETA_MAX:g}, got {beta:g} (beyond, F-beta is "
                                    "precision or recall to 6 decimals: use --mode recall for recall alone)")
    if not 1 <= concurrency <= 4096:
        raise ConfigError("--concurrency", f"must be between 1 and 4096, got {concurrency}")
    if not 0 < timeout <= 3600:
        raise ConfigError("--timeout", f"must be a number of seconds > 0 and <= 3600, got {timeout:g}")
    if not 0 <= max_retries <= 100:
        raise ConfigError("--max-retries", f"must be between 0 and 100, got {max_retries}")
    if response_field is not None and not response_field.strip():
        raise ConfigError("--response-field", "must name a field of the input rows")
    if mode not in COMBINE_MODES:
        raise ConfigError("--mode", f"unknown mode {mode!r}; valid: {', '.join(COMBINE_MODES)}")
    if beta is not None and mode in MODE_BETA and beta != MODE_BETA[mode]:  # contradictory flags
        fixed = MODE_BETA[mode]
        raise ConfigError("--beta", f"--beta {beta:g} with --mode {mode}: " + (
            f"--mode {mode} has no beta; drop --beta (or use --mode fork --beta {beta:g})" if fixed is None else
            f"--mode {mode} is F-beta with beta = {fixed:g}; drop --beta, or use --mode fork --beta {beta:g}"))
    beta_v = effective_beta(mode, beta)  # what the rewards are computed with, and what is recorded
    if cache_any_endpoint and cache is None:
        raise ConfigError("--cache-any-endpoint", "it says which cached replies --cache may serve: give --cache too")
    if pitfall_only not in ("error", "absence"):
        raise ConfigError("--pitfall-only", f"unknown {pitfall_only!r}; valid: error, absence")
    offline_judge = None
    if judge == "openai":
        model = "judge" if model is None else model
        urls = _base_urls(base_url, base_urls_file)
        settings = _settings(judge="openai", model=model, base_url=urls[0] if len(urls) == 1 else urls,
                             prompt_version=PROMPT_VERSION,
                             mode=mode, beta=beta_v, tau=tau_v, assume_correct=assume_correct,
                             pitfall_only=pitfall_only, cache_any_endpoint=cache_any_endpoint)
    elif judge == "offline":
        # flags of the openai judge would be silently ignored: refused (every recorded setting is the one used)
        for flag, given in (("--base-url", bool(base_url)), ("--base-urls-file", base_urls_file is not None),
                            ("--model", model is not None), ("--cache", cache is not None),
                            ("--cache-any-endpoint", cache_any_endpoint)):
            if given:
                raise ConfigError(flag, f"{flag} belongs to --judge openai: the offline judge runs here, with its "
                                        "own embedding model, and sends no request; drop it")
        if not assume_correct:
            raise ConfigError("--assume-correct", "the offline judge cannot judge factual correctness; pass "
                                                  "--assume-correct (assume_correct) to score anyway")
        from creditlab.judge import EmbeddingJudge

        try:
            offline_judge = EmbeddingJudge()  # a missing extra is found here, before --out is touched
        except ConfigError as err:
            raise ConfigError("--judge", f"offline: {err.message}; nothing was scored") from None
        settings = _settings(judge="offline", model="all-MiniLM-L6-v2", match_threshold=offline_judge.match_threshold,
                             mode=mode, beta=beta_v, tau=tau_v, assume_correct=assume_correct,
                             pitfall_only=pitfall_only)
    else:
        raise ConfigError("--judge", f"unknown judge {judge!r}; valid: openai, offline")

    # -- the input, read before --out is touched (bad lines and duplicate ids: one line each, skipped)
    items, bad, seen = _read_items(inp, response_field, console)
    response_summary = _response_summary(items)

    # -- this run owns --out from here on (a second writer is refused; the lock goes when the command ends)
    _hold(ctx, OutLock(out, what=f"scoring {inp}", overrides="--force"), console)
    scan = scan_results(out)  # refuses a file that is not a results file, before anything is written
    previous = scan.rows
    differs = _settings_mismatch(previous, settings)
    if differs and not force:
        raise ConfigError("--out", f"{out} holds rows scored with other settings (differs in: {', '.join(differs)}); "
                                   "rerun with the same options, choose another --out, or pass --force to rescore "
                                   "into this file")
    other = [] if force or judge != "openai" else _endpoint_mismatch(previous, urls)
    if other:
        flag = "--base-urls-file" if base_urls_file is not None and not base_url else "--base-url"
        raise ConfigError(flag, f"{out} holds rows scored by the judge at {', '.join(other)}, and this run's "
                                f"endpoints ({', '.join(urls)}) include none of them: another server under the "
                                "same --model name may be another judge, whose rows would be mixed with these; "
                                "give one of the endpoints that scored them (one replica more or fewer resumes), "
                                "choose another --out, or pass --force to rescore into this file")
    changed = [] if force else _changed_inputs(previous, items)
    if changed and not rescore_changed:
        shown = ", ".join(repr(i) for i in changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise ConfigError("--out", f"{out} holds rows for {len(changed)} id(s) whose prompt, response or rubrics "
                                   f"changed since they were scored ({shown}): new responses under the same ids "
                                   "(another checkpoint?) go to another --out; --rescore-changed replaces these rows, "
                                   "--force rescores every item")
    note = set_aside(out, scan)  # a line cut off by a killed run goes to <out>.torn; its item is rescored
    if note:
        console.print(note, highlight=False, markup=False)
    if force and previous:
        truncate(out)
        previous = []
    done = {str(r["id"]) for r in previous if r.get("error") is None} - set(changed)  # changed: --rescore-changed
    items = [it for it in items if it.id not in done]

    from creditlab.judge import JudgeCache, OpenAIJudge
    from creditlab.rewards import FORKReward

    jcache = JudgeCache(cache) if cache is not None else None
    if jcache is not None and not cache_any_endpoint and jcache.legacy_count():
        console.print(f"--cache {cache}: {jcache.legacy_count()} judge replies in it were written before creditlab "
                      "recorded the endpoint that gave each reply; they are not served (--cache-any-endpoint serves "
                      "them, for a cache known to come from this same model)", highlight=False, markup=False)
    if offline_judge is None:
        j = OpenAIJudge(urls, model, api_key=os.environ.get(api_key_env), concurrency=concurrency,
                        timeout=timeout, max_retries=max_retries, cache=jcache, transport=_transport(transport, urls),
                        cache_any_endpoint=cache_any_endpoint)
    else:
        j = offline_judge
    if judge == "openai" and preflight and items:
        from creditlab.judge import JudgeError

        try:
            problems = asyncio.run(j.preflight(timeout=min(10.0, timeout)))
        except JudgeError as err:
            flag = "--model" if err.kind == "unknown_model" else "--base-url"
            raise ConfigError(flag, f"{err} (nothing was scored; --no-preflight skips this check)") from None
        for problem in problems:
            console.print(f"endpoint: {problem}", highlight=False, markup=False)
    reward = FORKReward(j, beta=beta, tau=tau_v, mode=mode, assume_correct=assume_correct, pitfall_only=pitfall_only)

    async def run_all(writer: _LazyWriter) -> None:
        _stop_on_signals(stopped)
        try:
            with Progress(TextColumn("[bold]fork score"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console) as bar:
                task = bar.add_task("score", total=len(seen), completed=len(seen) - len(items))
                # a bounded pipeline: each item runs its stages to the end and its row is written at once
                async for res in reward.score_iter(items):
                    if res.error_kind == "endpoint_down":
                        not_sent.append(res.id)  # never judged: no row, a rerun scores it
                        continue
                    writer.write({**res.to_row(), "settings": settings})
                    bar.advance(task)
        finally:
            if hasattr(j, "aclose"):
                await j.aclose()

    not_sent: list[str] = []
    stopped: list[signal.Signals] = []
    if items:
        writer = _LazyWriter(out)
        try:
            asyncio.run(run_all(writer))
        except (KeyboardInterrupt, asyncio.CancelledError):
            stopped[:] = stopped or [signal.SIGINT]
        finally:
            writer.close()
        if stopped:
            console.print(f"interrupted ({stopped[0].name}): {writer.written} row(s) written to {out} by this run, "
                          f"{len(seen) - len(items) + writer.written} of {len(seen)} items have a row; rerun the same "
                          "command to resume (finished rows are kept, only the rest is scored)",
                          highlight=False, markup=False)
            raise typer.Exit(130 if stopped[0] == signal.SIGINT else 143)
    rows = [r for r in _compact(out) if str(r.get("id")) in seen] if out.exists() else []
    ok = [r for r in rows if r.get("error") is None]
    unscorable = [r for r in rows if r.get("error_kind") == "input"]
    failed = len(rows) - len(ok)

    def mean(key: str) -> str:
        vals = [float(r[key]) for r in ok if r.get(key) is not None]
        return f"{sum(vals) / len(vals):.3f}" if vals else "-"

    quality = str(getattr(j, "quality", "unknown"))
    shown_beta = f", beta={beta_v:g}" if beta_v is not None else ""
    table = Table(title=f"FORK ({mode}{shown_beta}, judge={j.name})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in [
        ("judge quality", quality),
        ("items", str(len(seen))), ("scored", str(len(ok))), ("failures", str(failed)),
        ("cannot be scored (input)", str(len(unscorable))), ("bad lines", str(bad)),
        ("mean reward", mean("reward")), ("mean precision P", mean("precision")), ("mean recall Rec", mean("recall")),
        ("mean units", mean("n_units")), ("mean length (words)", mean("length_words")),
        ("judge requests (all runs)", str(sum(int(r.get("requests", 0)) for r in rows))),
        ("assume_correct", str(assume_correct)),
        ("response field", response_summary),
        *([("judge cache", f"{cache}: " + ("replies of any endpoint (--cache-any-endpoint)" if cache_any_endpoint
                                            else "replies of these endpoints only"))] if cache is not None else []),
    ]:
        table.add_row(name, value)
    Console().print(table)
    if judge == "openai" and items:
        Console(soft_wrap=True).print("\n".join(["judge endpoints (this run):", *_endpoint_lines(j)]),
                                      highlight=False, markup=False)
    if not_sent:
        console.print(f"stopped submitting: {getattr(j, 'down', None)}; {len(ok)} finished row(s) kept in {out}, "
                      f"{len(not_sent)} item(s) not scored: rerun the same command when the endpoint is back",
                      highlight=False, markup=False)
        raise typer.Exit(1)
    if failed or bad:
        hints = []
        if failed - len(unscorable):
            hints.append(f"{failed - len(unscorable)} item(s) failed: rerun the same command to retry them")
        if unscorable:
            hints.append(f"{len(unscorable)} item(s) cannot be scored (see their 'error'): fix them in the input")
        if bad:
            hints.append(f"{bad} bad line(s) skipped (see the messages above)")
        console.print("; ".join(hints), highlight=False, markup=False)
        raise typer.Exit(1)
