"""Run a diagnosis end to end and write ``report.md``, the PNGs and ``diagnose.json``.

Exit codes (what ``creditlab diagnose`` returns): 0 when no check fails, 1 when one fails (or
warns, with ``fail_on="warn"``); unreadable input raises :class:`creditlab.errors.InputError`,
which the CLI turns into exit code 2.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from creditlab.diagnose.checks import CheckResult, format_value, run_checks
from creditlab.diagnose.plots import PLOTS, plot_result
from creditlab.diagnose.readers import Dump, read_dump
from creditlab.errors import ConfigError

__all__ = ["Diagnosis", "diagnose", "exit_code", "write_report"]

FAIL_ON = ("fail", "warn")
SCHEMA_VERSION = 1


@dataclass
class Diagnosis:
    """The outcome of :func:`diagnose`."""

    results: list[CheckResult]
    summary: dict[str, Any]
    exit_code: int
    files: list[Path]

    def result(self, check_id: str) -> CheckResult:
        return next(r for r in self.results if r.id == check_id)


def exit_code(results: Sequence[CheckResult], fail_on: str = "fail") -> int:
    """1 when a check failed (or warned, with ``fail_on="warn"``), else 0."""
    if fail_on not in FAIL_ON:
        raise ConfigError("--fail-on", f"must be one of {', '.join(FAIL_ON)}, got {fail_on!r}")
    bad = {"fail"} if fail_on == "fail" else {"fail", "warn"}
    return int(any(r.status in bad for r in results))


def summarize(dump: Dump) -> dict[str, Any]:
    """What the dump holds, for the report header and ``diagnose.json``."""
    out: dict[str, Any] = {
        "files": dump.files, "formats": sorted(set(dump.formats)), "trajectories": len(dump),
        "steps": int(np.unique(dump.step).size), "step_range": [int(dump.step.min()), int(dump.step.max())],
        "groups": int(np.unique(np.stack([dump.step, dump.group]), axis=1).shape[1]),
        "tokens": dump.n_tokens,
        "policy_tokens": int(dump.tokens.policy_mask.sum()) if dump.tokens is not None else 0,
        "columns": [c for c in ("logprobs", "rollout_logprobs", "policy_mask", "turn_ids", "response",
                                "response_length", "truncated", "process_reward", "precision", "recall",
                                "instruction", "turns") if dump.has(c)],
    }
    return out


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def write_report(dump: Dump, results: Sequence[CheckResult], out: str | os.PathLike, *,
                 fail_on: str = "fail") -> list[Path]:
    """Write the PNGs, ``report.md`` and ``diagnose.json`` of ``results`` into ``out``; return the files."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError("--out", f"cannot create the directory {out}: {err.strerror or err}") from None
    files: list[Path] = []
    for r in results:
        p = plot_result(r, out)
        r.plot = p.name if p is not None else None
        if p is not None:
            files.append(p)
    for name, _ in PLOTS.values():  # a plot of an earlier run into this directory would now be stale
        if (out / name) not in files and (out / name).exists():
            (out / name).unlink()
    summary = summarize(dump)
    code = exit_code(results, fail_on)
    counts = {s: sum(r.status == s for r in results) for s in ("fail", "warn", "ok", "skipped")}

    lines = ["# creditlab diagnose", ""]
    src = ", ".join(f"`{f}`" for f in summary["files"][:5]) + (
        f" and {len(summary['files']) - 5} more" if len(summary["files"]) > 5 else "")
    lines += [f"Input: {src} ({', '.join(summary['formats'])}): {summary['trajectories']:,} trajectories, "
              f"{summary['steps']:,} steps ({summary['step_range'][0]}-{summary['step_range'][1]}), "
              f"{summary['groups']:,} groups, {summary['tokens']:,} tokens ({summary['policy_tokens']:,} policy).",
              "",
              f"Verdict: {counts['fail']} fail, {counts['warn']} warn, {counts['ok']} ok, {counts['skipped']} skipped "
              f"(exit code {code} with `--fail-on {fail_on}`).", "",
              "| check | status | value | threshold | evidence |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| [{r.id}](#{r.id.replace('.', '')}) | **{r.status}** | {format_value(r.value)} | "
                     f"{_cell(r.threshold.text())} | {_cell(r.message)} |")
    lines.append("")
    for r in results:
        value = f", value {format_value(r.value)} (threshold: {r.threshold.text()})." if r.value is not None else "."
        lines += [f"## {r.id}", "", f"{r.title}. **{r.status}**{value}", "", r.message, ""]
        if r.status in ("warn", "fail"):
            lines += [f"Fix: {r.fix}", ""]
        elif r.status == "ok":
            lines += [f"If it fires: {r.fix}", ""]
        if r.plot:
            lines += [f"![{r.id}]({r.plot})", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    files.append(report)
    js = out / "diagnose.json"
    payload = {"version": SCHEMA_VERSION, "exit_code": code, "fail_on": fail_on, "counts": counts,
               "input": summary, "checks": [r.to_json() for r in results]}
    js.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    files.append(js)
    return files


def diagnose(paths: str | os.PathLike | Sequence[str | os.PathLike], out: str | os.PathLike, *,
             fail_on: str = "fail", only: Sequence[str] | None = None, max_turns: int = 16,
             progress: Callable[[str, int, int], None] | None = None) -> Diagnosis:
    """Read the dumps at ``paths``, run the checks, write the report into ``out``.

    ``progress(what, done, total)`` is called as files are read and checks finish.
    """
    exit_code([], fail_on)  # validate before reading
    dump = read_dump(paths, progress=progress)
    results = run_checks(dump, only=only, max_turns=max_turns, progress=progress)
    files = write_report(dump, results, out, fail_on=fail_on)
    return Diagnosis(results, summarize(dump), exit_code(results, fail_on), files)
