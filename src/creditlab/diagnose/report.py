"""Run a diagnosis end to end and write ``report.md``, the PNGs and ``diagnose.json``.

Exit codes (what ``creditlab diagnose`` returns): 0 when no check fails, 1 when one fails (or
warns, or the input has a warning, with ``fail_on="warn"``); unreadable input raises
:class:`creditlab.errors.InputError`, which the CLI turns into exit code 2.

The output directory is one run's, and creditlab replaces only what it marked as its own: ``report.md``
starts with :data:`REPORT_MARK`, ``diagnose.json`` has ``"written_by": "creditlab diagnose"`` and lists
the plots of its run in ``"files"``. A ``report.md``, ``diagnose.json`` or plot of that name that is not
so marked (a lab's report, a user's notes) is never replaced: the run is refused before it reads its
input (:class:`~creditlab.errors.ConfigError` naming ``--out`` and the file; nothing is written). A run
into a directory that holds an earlier report of its own replaces it and says so
(:attr:`Diagnosis.replaced`); a run that ends in an error there rewrites that ``diagnose.json`` and
``report.md`` with the error and removes its plots, so no stale report claims a verdict on input that
could not be read. A run holds the lock ``<out>.lock`` (:class:`~creditlab._outlock.OutLock`)
from start to end: a second run into the same ``--out`` is refused, naming the first.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from creditlab._outlock import OutLock
from creditlab.diagnose._trl_logs import FORMAT_TRL
from creditlab.diagnose.checks import CheckResult, format_value, run_checks
from creditlab.diagnose.plots import PHASE_PLOTS, PLOTS, plot_phase, plot_result
from creditlab.diagnose.readers import Dump, read_dump
from creditlab.diagnose.steps import StepSelection, describe_steps
from creditlab.diagnose.trainer_metrics import trainer_metrics
from creditlab.errors import ConfigError, CreditlabError, InputError

__all__ = ["REPORT_MARK", "WRITTEN_BY", "Diagnosis", "diagnose", "exit_code", "record_error", "write_report"]

FAIL_ON = ("fail", "warn")
#: The statuses diagnose.json counts, in the report's order (``info``: measured, no calibrated verdict).
COUNTED = ("fail", "warn", "ok", "info", "skipped")
SCHEMA_VERSION = 2  # 2: the status info (counts.info) and threshold.measured
#: Every plot file a run may write into ``--out`` (one per check, and the phase maps of the calibrated checks).
PLOT_FILES = (*(name for name, _ in PLOTS.values()), *PHASE_PLOTS.values())
WRITTEN_BY = "creditlab diagnose"
"""``diagnose.json``'s ``written_by``: the mark of a ``diagnose.json`` (and of the plots it lists) that a rerun
may replace."""
REPORT_MARK = "<!-- written by creditlab diagnose: a rerun into this directory replaces this file -->"
"""The first line of every ``report.md`` creditlab diagnose writes (an HTML comment, invisible when rendered):
the mark of a ``report.md`` that a rerun may replace."""


@dataclass
class Diagnosis:
    """The outcome of :func:`diagnose`."""

    results: list[CheckResult]
    summary: dict[str, Any]
    exit_code: int
    files: list[Path]
    warnings: list[str] = field(default_factory=list)  # about the input (also in the report)
    replaced: str | None = None  # one line when the output directory held an earlier report of its own
    trainer_metrics: dict[str, Any] | None = None  # the trainers' own mismatch metrics (diagnose.json)
    took_over: str | None = None  # one line when the lock left by a killed run into the directory was taken over

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
        "policy_tokens": dump.n_policy_tokens,
        "columns": [c for c in ("logprobs", "rollout_logprobs", "policy_mask", "turn_ids", "response",
                                "response_length", "truncated", "process_reward", "precision", "recall",
                                "instruction", "turns") if dump.has(c)],
        "reward_source": reward_source(dump),
        "steps_read": np.unique(dump.step).tolist(),
        "steps_selection": dump.steps_selection,
        "steps_not_read": list(dump.steps_not_read),
    }
    return out


def steps_line(summary: dict[str, Any]) -> str:
    """The report's sentence on which steps were read."""
    read = summary["steps_read"]
    if summary["steps_selection"] is None:
        return f"Steps read: all {len(read):,} ({describe_steps(read)})."
    left = summary["steps_not_read"]
    out = (f"Steps read: {len(read):,} of {len(read) + len(left):,}, selected by `--steps "
           f"{summary['steps_selection']}`: {describe_steps(read)}")
    return out + (f"; not read: {describe_steps(left)}." if left else ".")


def reward_source(dump: Dump) -> str:
    """Where the reward of the checks comes from, one phrase per distinct source (``file: source`` when the
    files differ)."""
    srcs = dump.reward_sources
    if len(set(srcs)) <= 1:
        return srcs[0] if srcs else ""
    return "; ".join(f"{Path(f).name}: {s}" for f, s in zip(dump.files, srcs, strict=True))


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def write_report(dump: Dump, results: Sequence[CheckResult], out: str | os.PathLike, *,
                 fail_on: str = "fail", trainer: dict[str, Any] | None = None) -> list[Path]:
    """Write the PNGs, ``report.md`` and ``diagnose.json`` of ``results`` into ``out``; return the files.
    ``trainer``: the dump's :func:`~creditlab.diagnose.trainer_metrics.trainer_metrics` (computed when None)."""
    out = Path(out)
    _own_report(out)  # refuses a file of these names that creditlab did not write, before anything is written
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError("--out", f"cannot create the directory {out}: {err.strerror or err}") from None
    files: list[Path] = []
    phase: dict[str, str] = {}
    for r in results:
        p = plot_result(r, out)
        r.plot = p.name if p is not None else None
        if p is not None:
            files.append(p)
        q = plot_phase(r, out)  # where the dump sits on the transfer run's phase map (calibrated checks)
        if q is not None:
            phase[r.id] = q.name
            files.append(q)
    for name in PLOT_FILES:  # a plot of an earlier run into this directory would now be stale
        if (out / name) not in files and (out / name).exists():
            (out / name).unlink()  # _own_report checked that the earlier run wrote it
    summary = summarize(dump)
    code = exit_code(results, fail_on, dump.warnings)
    counts = {s: sum(r.status == s for r in results) for s in COUNTED}

    lines = [REPORT_MARK, "# creditlab diagnose", ""]
    src = ", ".join(f"`{f}`" for f in summary["files"][:5]) + (
        f" and {len(summary['files']) - 5} more" if len(summary["files"]) > 5 else "")
    lines += [f"Input: {src} ({', '.join(summary['formats'])}): {summary['trajectories']:,} trajectories, "
              f"{summary['steps']:,} steps ({summary['step_range'][0]}-{summary['step_range'][1]}), "
              f"{summary['groups']:,} groups, {summary['tokens']:,} tokens ({summary['policy_tokens']:,} policy).",
              "", steps_line(summary), "", f"Reward: {summary['reward_source']}.", ""]
    if dump.warnings:
        lines += [f"Input warnings ({len(dump.warnings)}):", ""] + [f"* {w}" for w in dump.warnings] + [""]
    lines += [f"Verdict: {counts['fail']} fail, {counts['warn']} warn, {counts['ok']} ok, {counts['info']} info "
              f"(measured, no calibrated verdict), {counts['skipped']} skipped "
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
        elif r.status == "info":
            lines += [f"If the value is a concern: {r.fix}", ""]
        if r.plot:
            lines += [f"![{r.id}]({r.plot})", ""]
        if r.id in phase:
            lines += ["Where this dump sits on the phase map of the transfer run that calibrated this check (the "
                      "run's points: the unit at the base policy against the rollback of training):", "",
                      f"![{r.id} on the phase map]({phase[r.id]})", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    files.append(report)
    js = out / "diagnose.json"
    payload = {"version": SCHEMA_VERSION, "written_by": WRITTEN_BY, "files": [f.name for f in files] + [js.name],
               "exit_code": code, "fail_on": fail_on, "counts": counts,
               "input": summary, "warnings": list(dump.warnings), "checks": [r.to_json() for r in results],
               "trainer_metrics": trainer if trainer is not None else trainer_metrics(dump)}
    js.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    files.append(js)
    return files


def _read_own_json(js: Path) -> dict[str, Any] | None:
    """``diagnose.json`` when it is a file creditlab diagnose wrote (marked :data:`WRITTEN_BY`), else None."""
    try:
        old = json.loads(js.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return old if isinstance(old, dict) and old.get("written_by") == WRITTEN_BY else None


def _is_own_report(md: Path) -> bool:
    try:
        with open(md, encoding="utf-8", errors="replace") as fh:
            return fh.readline().rstrip("\r\n") == REPORT_MARK
    except OSError:
        return False


def _own_report(out: Path) -> str | None:
    """What ``out`` holds of an earlier run of creditlab diagnose ("the report of an earlier run (exit code 1,
    on a.jsonl)"), or None when it holds no report. Raises a :class:`ConfigError` naming ``--out`` and the
    file when ``out`` is not a directory or holds a ``report.md``, ``diagnose.json`` or plot of this
    command's names that creditlab did not mark as its own (a run would replace it)."""
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{out} is a file; --out names the directory of report.md, diagnose.json and the "
                                   "plots: choose another --out")
    if not out.is_dir():
        return None
    js, md = out / "diagnose.json", out / "report.md"
    old = _read_own_json(js) if js.is_file() else None
    listed = set(old.get("files") or []) if old is not None else set()
    own = {md: md.is_file() and _is_own_report(md), js: old is not None}
    foreign = [p for p in (md, js) if p.exists() and not own[p]]
    foreign += [out / name for name in PLOT_FILES if (out / name).exists() and name not in listed]
    if foreign:
        first = foreign[0]
        more = f" (and {', '.join(p.name for p in foreign[1:])})" if len(foreign) > 1 else ""
        whose = " (it belongs to the creditlab lab run in that directory)" if (out / "lab.json").is_file() else ""
        raise ConfigError("--out", f"{first}{more} was not written by creditlab diagnose{whose}, and this run would "
                                   f"replace it; nothing was written: choose another --out (e.g. {out / 'diagnose'}), "
                                   f"or move {first.name} out of {out}")
    if not (md.exists() or js.exists()):
        return None
    if old is None:
        return "the report of an earlier run"
    inp = old.get("input") if isinstance(old.get("input"), dict) else {}
    files = inp.get("files") or inp.get("paths") or []
    what = [f"exit code {old['exit_code']}"] if "exit_code" in old else []
    if files:
        what.append("on " + ", ".join(Path(f).name for f in files[:2]) + (" ..." if len(files) > 2 else ""))
    return "the report of an earlier run" + (f" ({', '.join(what)})" if what else "")


def record_error(out: str | os.PathLike, err: CreditlabError, paths: Sequence[str | os.PathLike] = (), *,
                 fail_on: str = "fail") -> CreditlabError:
    """After ``err`` ended a run into ``out``: when ``out`` holds an earlier report of creditlab diagnose (marked
    as its own), rewrite its ``diagnose.json`` and ``report.md`` with the error (exit code 2) and remove its
    plots, and return the error with a note saying so; else return ``err`` unchanged (nothing is written,
    and a file creditlab did not write is never touched)."""
    out = Path(out)
    try:
        earlier = _own_report(out)
    except ConfigError:
        return err
    if earlier is None:
        return err
    msg = str(err)
    try:
        payload = {"version": SCHEMA_VERSION, "written_by": WRITTEN_BY, "files": ["report.md", "diagnose.json"],
                   "exit_code": 2, "fail_on": fail_on, "error": msg,
                   "counts": {s: 0 for s in COUNTED},
                   "input": {"paths": [str(p) for p in paths]}, "warnings": [], "checks": []}
        (out / "diagnose.json").write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        (out / "report.md").write_text(f"{REPORT_MARK}\n# creditlab diagnose\n\nError (exit code 2): {msg}\n\n"
                                       "No check ran.\n", encoding="utf-8")
        for name in PLOT_FILES:
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
             progress: Callable[[str, int, int], None] | None = None,
             reward_columns: Sequence[str] | None = None, steps: str | StepSelection | None = None,
             executor: Any = None) -> Diagnosis:
    """Read the dumps at ``paths``, run the checks, write the report into ``out``.

    The dumps are read in bounded memory (``read_dump(..., tokens=False)``): each file a batch of rows at a
    time, the token columns reduced per row as they are read. ``steps``: diagnose only these steps
    (``--steps``: :mod:`creditlab.diagnose.steps`); the report and ``diagnose.json`` say which were read.
    ``executor``: read the files in parallel on one of the labs' executors
    (``creditlab.lab.runner.make_executor``; ``--workers``, ``--executor``).

    The run holds the lock of ``out`` (``<out>.lock``) from start to end, and first checks that every
    ``report.md``, ``diagnose.json`` and plot it would replace in ``out`` is one creditlab diagnose wrote:
    otherwise it raises a :class:`ConfigError` naming ``--out`` and the file, before reading any input and
    with nothing written. ``progress(what, done, total)`` is called as files are read and checks finish.
    An error (bad input, an unknown check, a bad ``fail_on`` or ``max_turns``) raises; when ``out`` held an
    earlier report of its own, that report is first rewritten with the error (:func:`record_error`). A
    report that replaces an earlier one says so in :attr:`Diagnosis.replaced`. ``reward_columns``: the
    reward-function columns of TRL completion tables (``--reward-column``; an error for other input).
    """
    plist = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    outp = Path(out)
    if outp.exists() and not outp.is_dir():
        _own_report(outp)  # the one-line error of a file given as --out
    names = ", ".join(Path(p).name for p in plist[:2]) + (" ..." if len(plist) > 2 else "")
    lock = OutLock(outp, what=f"creditlab diagnose {names}")
    took_over = lock.acquire()
    try:
        earlier = _own_report(outp)  # under the lock: nothing else writes here until the run ends
        try:
            if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 2:
                raise ConfigError("--max-turns", f"must be >= 2, got {max_turns}")
            if fail_on not in FAIL_ON:
                raise ConfigError("--fail-on", f"must be fail or warn, got {fail_on!r}")
            dump = read_dump(plist, progress=progress, reward_columns=reward_columns, tokens=False, steps=steps,
                             executor=executor)
            if reward_columns and FORMAT_TRL not in dump.formats:
                raise ConfigError("--reward-column", "names the reward functions of TRL's log_completions tables; "
                                                     f"this input has none ({reward_source(dump)} is the reward)")
            results = run_checks(dump, only=only, max_turns=max_turns, progress=progress)
        except CreditlabError as err:
            raise record_error(outp, err, plist, fail_on=fail_on if fail_on in FAIL_ON else "fail") from None
        trainer = trainer_metrics(dump)
        files = write_report(dump, results, outp, fail_on=fail_on, trainer=trainer)
    finally:
        lock.release()
    replaced = f"{outp} held {earlier}; this run's report replaced it." if earlier else None
    return Diagnosis(results, summarize(dump), exit_code(results, fail_on, dump.warnings), files,
                     list(dump.warnings), replaced, trainer, took_over)
