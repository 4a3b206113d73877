"""Run a diagnosis end to end and write ``report.md``, the PNGs and ``diagnose.json``.

Exit codes (what ``creditlab diagnose`` returns): 0 when no check fails, 1 when one fails (or
warns, or the input has a warning, with ``fail_on="warn"``); unreadable input raises
:class:`creditlab.errors.InputError`, which the CLI turns into exit code 2.

The output directory is one run's: a run into a directory that holds an earlier report replaces it
and says so (:attr:`Diagnosis.replaced`); a run that ends in an error there rewrites the earlier
``diagnose.json`` and ``report.md`` with the error and removes its plots, so no stale report claims
a verdict on input that could not be read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from creditlab.diagnose.checks import CheckResult, format_value, run_checks
from creditlab.diagnose.plots import PLOTS, plot_result
from creditlab.diagnose.readers import Dump, read_dump
from creditlab.diagnose.trainer_metrics import trainer_metrics
from creditlab.errors import ConfigError, CreditlabError, InputError

__all__ = ["Diagnosis", "diagnose", "exit_code", "record_error", "write_report"]

FAIL_ON = ("fail", "warn")
SCHEMA_VERSION = 1


@dataclass
class Diagnosis:
    """The outcome of :func:`diagnose`."""

    results: list[CheckResult]
    summary: dict[str, Any]
    exit_code: int
    files: list[Path]
    warnings: list[str] = field(default_factory=list)  # about the input (also in the report)
    replaced: str | None = None  # one line when the output directory held an earlier report
    trainer_metrics: dict[str, Any] | None = None  # the trainers' own mismatch metrics (diagnose.json)

    def result(self, check_id: str) -> CheckResult:
        return next(r for r in self.results if r.id == check_id)


def exit_code(results: Sequence[CheckResult], fail_on: str = "fail", warnings: Sequence[str] = ()) -> int:
    """1 when a check failed (or warned, or the input has ``warnings``, with ``fail_on="warn"``), else 0."""
    if fail_on not in FAIL_ON:
        raise ConfigError("--fail-on", f"must be one of {', '.join(FAIL_ON)}, got {fail_on!r}")
    bad = {"fail"} if fail_on == "fail" else {"fail", "warn"}
    return int(any(r.status in bad for r in results) or (fail_on == "warn" and bool(warnings)))


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
                 fail_on: str = "fail", trainer: dict[str, Any] | None = None) -> list[Path]:
    """Write the PNGs, ``report.md`` and ``diagnose.json`` of ``results`` into ``out``; return the files.
    ``trainer``: the dump's :func:`~creditlab.diagnose.trainer_metrics.trainer_metrics` (computed when None)."""
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
    code = exit_code(results, fail_on, dump.warnings)
    counts = {s: sum(r.status == s for r in results) for s in ("fail", "warn", "ok", "skipped")}

    lines = ["# creditlab diagnose", ""]
    src = ", ".join(f"`{f}`" for f in summary["files"][:5]) + (
        f" and {len(summary['files']) - 5} more" if len(summary["files"]) > 5 else "")
    lines += [f"Input: {src} ({', '.join(summary['formats'])}): {summary['trajectories']:,} trajectories, "
              f"{summary['steps']:,} steps ({summary['step_range'][0]}-{summary['step_range'][1]}), "
              f"{summary['groups']:,} groups, {summary['tokens']:,} tokens ({summary['policy_tokens']:,} policy).",
              ""]
    if dump.warnings:
        lines += [f"Input warnings ({len(dump.warnings)}):", ""] + [f"* {w}" for w in dump.warnings] + [""]
    lines += [f"Verdict: {counts['fail']} fail, {counts['warn']} warn, {counts['ok']} ok, {counts['skipped']} skipped "
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
               "input": summary, "warnings": list(dump.warnings), "checks": [r.to_json() for r in results],
               "trainer_metrics": trainer if trainer is not None else trainer_metrics(dump)}
    js.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    files.append(js)
    return files


def _earlier_report(out: Path) -> str | None:
    """What ``out`` holds of an earlier run ("the report of an earlier run (exit code 1, on a.jsonl)"), or
    None when it holds no report."""
    js, md = out / "diagnose.json", out / "report.md"
    if not (js.is_file() or md.is_file()):
        return None
    try:
        old = json.loads(js.read_text(encoding="utf-8"))
        files = old.get("input", {}).get("files") or old.get("input", {}).get("paths") or []
        what = [f"exit code {old['exit_code']}"] if "exit_code" in old else []
        if files:
            what.append("on " + ", ".join(Path(f).name for f in files[:2]) + (" ..." if len(files) > 2 else ""))
        return "the report of an earlier run" + (f" ({', '.join(what)})" if what else "")
    except (OSError, ValueError, AttributeError, TypeError):
        return "an earlier report"


def record_error(out: str | os.PathLike, err: CreditlabError, paths: Sequence[str | os.PathLike] = (), *,
                 fail_on: str = "fail") -> CreditlabError:
    """After ``err`` ended a run into ``out``: when ``out`` holds an earlier report, rewrite its
    ``diagnose.json`` and ``report.md`` with the error (exit code 2) and remove its plots, and return the
    error with a note saying so; else return ``err`` unchanged (nothing is written)."""
    out = Path(out)
    earlier = _earlier_report(out) if out.is_dir() else None
    if earlier is None:
        return err
    msg = str(err)
    try:
        payload = {"version": SCHEMA_VERSION, "exit_code": 2, "fail_on": fail_on, "error": msg,
                   "counts": {s: 0 for s in ("fail", "warn", "ok", "skipped")},
                   "input": {"paths": [str(p) for p in paths]}, "warnings": [], "checks": []}
        (out / "diagnose.json").write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        (out / "report.md").write_text(f"# creditlab diagnose\n\nError (exit code 2): {msg}\n\nNo check ran.\n",
                                       encoding="utf-8")
        for name, _ in PLOTS.values():
            (out / name).unlink(missing_ok=True)
    except OSError as os_err:
        note = f" ({out} holds {earlier}, which could not be replaced: {os_err.strerror or os_err})"
    else:
        note = f" ({out} held {earlier}: its diagnose.json and report.md now record this error)"
    if isinstance(err, ConfigError):
        new: CreditlabError = ConfigError(err.parameter, msg[len(err.parameter) + 2:] + note)
    elif type(err) in (InputError, CreditlabError):
        new = type(err)(msg + note)
    else:
        return err
    return new


def diagnose(paths: str | os.PathLike | Sequence[str | os.PathLike], out: str | os.PathLike, *,
             fail_on: str = "fail", only: str | Sequence[str] | None = None, max_turns: int = 16,
             progress: Callable[[str, int, int], None] | None = None) -> Diagnosis:
    """Read the dumps at ``paths``, run the checks, write the report into ``out``.

    ``progress(what, done, total)`` is called as files are read and checks finish. An error (bad input,
    an unknown check) raises; when ``out`` held an earlier report, that report is first rewritten with
    the error (:func:`record_error`). A report that replaces an earlier one says so in
    :attr:`Diagnosis.replaced`.
    """
    plist = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    try:
        exit_code([], fail_on)  # validate before reading
        dump = read_dump(plist, progress=progress)
        results = run_checks(dump, only=only, max_turns=max_turns, progress=progress)
    except CreditlabError as err:
        raise record_error(out, err, plist, fail_on=fail_on if fail_on in FAIL_ON else "fail") from None
    outp = Path(out)
    earlier = _earlier_report(outp) if outp.is_dir() else None
    trainer = trainer_metrics(dump)
    files = write_report(dump, results, out, fail_on=fail_on, trainer=trainer)
    replaced = f"{outp} held {earlier}; this run's report replaced it." if earlier else None
    return Diagnosis(results, summarize(dump), exit_code(results, fail_on, dump.warnings), files,
                     list(dump.warnings), replaced, trainer)
