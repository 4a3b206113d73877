"""A lab run records its predictions when it starts (their text, its sha256, the git commit of the lab's
source), before any cell runs; a resume keeps that record; the report cites it and says so when the
predictions were edited after the run started; and every built-in lab states the predictions of its docs
page word for word (what is hashed is what the docs say)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import types
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import pandas as pd
import pytest

from creditlab.errors import CreditlabError
from creditlab.lab.experiment import Experiment, ExperimentLab
from creditlab.lab.protocol import LabConfig, Table, check_count, lab_predictions, run_lab, source_commit
from creditlab.lab.runner import Cell
from creditlab.labs import get_lab, register_lab, unregister_lab

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
HAS_GIT = shutil.which("git") is not None


# --------------------------------------------------------------------------------------------
# a tiny lab of two experiments, one of which states predictions


@dataclass(frozen=True)
class TwoConfig(LabConfig):
    EXPERIMENTS: ClassVar[tuple[str, ...]] = ("flip", "quiet")
    SELECTION: ClassVar[tuple[str, ...]] = ("experiments", "out")
    seeds: int = 2
    experiments: tuple[str, ...] = ("flip", "quiet")
    out: str = ""
    """Where the run writes (its cells read the manifest there)."""

    def validate(self) -> None:
        check_count(self.seeds, "--seeds")


def flip_cell(seed: int, out: str) -> list[dict]:
    """A cell that reports what the manifest held when it ran (``out`` is context, not part of its key)."""
    manifest = Path(out) / "lab.json"
    seen = json.loads(manifest.read_text()).get("predictions", {}).get("sha256", "") if manifest.exists() else ""
    return [{"seed": seed, "heads": float(seed % 2), "seen": seen}]


class _Part(Experiment):
    def cells(self, cfg):
        return [Cell(self.name, f"seed={s}", flip_cell, {"seed": s}, context={"out": cfg.out})
                for s in range(cfg.seeds)]

    def tables(self, rows, cfg):
        return {self.name: Table(rows[self.name][["seed", "heads"]], f"{self.name} heads")}

    def interpret(self, tabs, cfg):
        return {self.name: "Heads per seed."}


class Flip(_Part):
    name = "flip"
    stated: tuple[str, ...] = ("1. **Heads at odd seeds**: every odd seed shows heads. Falsified if one does not.",)

    def predictions_text(self, cfg):
        return self.stated


class Quiet(_Part):
    name = "quiet"


FLIP, QUIET = Flip(), Quiet()


class TwoLab(ExperimentLab):
    name = "two"
    summary = "Two experiments, one with predictions."
    config_type = TwoConfig
    experiments = (FLIP, QUIET)

    def describe(self, cfg):
        return "A test lab."


LAB = TwoLab()


def _run(out: Path, cfg: TwoConfig | None = None, **kw):
    return run_lab(LAB, replace(cfg or TwoConfig(), out=str(out)), out, progress=False, **kw)


def _manifest(out: Path) -> dict:
    return json.loads((out / "lab.json").read_text())


def _sha(value) -> str:
    return hashlib.sha256(json.dumps(value, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------------------
# the record


def test_a_run_records_its_predictions_before_any_cell_runs(tmp_path):
    out = tmp_path / "run"
    _run(out)
    m = _manifest(out)
    pred = m["predictions"]
    assert pred["sections"] == {"flip": {"texts": list(Flip.stated), "sha256": _sha(list(Flip.stated))}}
    assert pred["sha256"] == _sha({"flip": list(Flip.stated)})  # the hash of the text, computed here again
    assert m["started_at"] == pred["recorded_at"] <= m["finished_at"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", m["started_at"])
    assert pred["stored_cells"] == 0 and "predictions_edited" not in m
    # every cell saw the record in lab.json when it ran
    rows = pd.concat(pd.read_parquet(p) for p in (out / "store" / "cells").glob("*.parquet"))
    assert len(rows) == 4 and set(rows["seen"]) == {pred["sha256"]}
    # not part of the identity: a run with the record resumes as before
    assert "predictions" not in m["identity"] and "started_at" not in m["identity"]
    src = pred["source"]
    assert src["module"] == __name__
    report = (out / "report.md").read_text()
    assert (f"recorded the text of its predictions (flip: 1) in `lab.json` (`predictions`) when this run started, "
            f"at {pred['recorded_at']}, before any of its cells ran: sha256 `{pred['sha256'][:12]}`") in report
    if src["commit"]:
        assert re.fullmatch(r"[0-9a-f]{40}", src["commit"]) and f"git commit `{src['commit'][:12]}`" in report
    else:
        assert src["why"] and f"no git commit recorded: {src['why']}" in report
    assert "The text has not been edited since." in report


def test_a_resume_keeps_the_first_start_and_says_when_the_predictions_were_edited(tmp_path, monkeypatch):
    out = tmp_path / "run"
    _run(out)
    first = _manifest(out)
    monkeypatch.setattr(FLIP, "stated", ("1. **Heads at even seeds**, edited after the start.",))
    said = []
    assert _run(out, status=said.append).computed == 0
    m = _manifest(out)
    assert m["predictions"] == first["predictions"] and m["started_at"] == first["started_at"]
    assert m["predictions_edited"]["sections"] == ["flip"]
    assert m["predictions_edited"]["sha256"] == _sha({"flip": list(FLIP.stated)}) != first["predictions"]["sha256"]
    assert any("two lab: the predictions of flip were edited after this run started" in s for s in said)
    report = (out / "report.md").read_text()
    assert "**The predictions were edited after this run started**: the text of flip differs" in report
    assert f"sha256 `{first['predictions']['sha256'][:12]}`" in report
    # the verdicts are the rules in the lab's code, not the text: the report used to say they judged the edited one
    said = " ".join(report.split())
    assert "judge the current text" not in said
    assert ("The verdicts below do not read either text: they come from the lab's rules, fixed functions of the "
            "tables registered in its code (") in said
    assert "the edit changes no verdict, and the edited text is not what is judged" in said
    src = first["predictions"]["source"]
    if src["commit"]:
        assert f"as registered at the recorded commit `{src['commit'][:12]}`" in said
    monkeypatch.undo()  # the text as recorded again: nothing to say
    _run(out)
    assert "predictions_edited" not in _manifest(out)
    assert "The text has not been edited since." in (out / "report.md").read_text()


def test_the_record_covers_every_experiment_and_the_report_cites_the_selected_ones(tmp_path):
    out = tmp_path / "run"
    _run(out, TwoConfig(experiments=("quiet",)))
    first = _manifest(out)
    assert list(first["predictions"]["sections"]) == ["flip"]  # fixed at the first start, selected or not
    assert "Predictions, recorded" not in (out / "report.md").read_text()
    assert _run(out).computed == 2  # flip's cells, later; its predictions were recorded before them
    m = _manifest(out)
    assert m["predictions"] == first["predictions"] and m["started_at"] == first["started_at"]
    assert "(flip: 1)" in (out / "report.md").read_text()


def test_a_run_begun_before_the_record_says_the_record_shows_nothing(tmp_path):
    out = tmp_path / "run"
    _run(out)
    m = _manifest(out)
    for key in ("predictions", "started_at", "finished_at"):
        m.pop(key)
    (out / "lab.json").write_text(json.dumps(m))  # a manifest written before runs recorded their start
    assert _run(out).computed == 0
    m = _manifest(out)
    assert m["started_at"] is None and m["predictions"]["stored_cells"] == 4
    assert ("on a resume: 4 cell(s) of this run were stored by then (it began before creditlab recorded a run's "
            "predictions), so this record does not show that the predictions came before them") in (
        out / "report.md").read_text()


def test_fresh_starts_a_new_record(tmp_path, monkeypatch):
    out = tmp_path / "run"
    _run(out)
    monkeypatch.setattr(FLIP, "stated", ("1. Another text.",))
    _run(out, fresh=True)
    m = _manifest(out)
    assert m["predictions"]["sections"]["flip"]["texts"] == ["1. Another text."] and "predictions_edited" not in m


def test_a_lab_without_predictions_records_none_and_bad_ones_are_refused(tmp_path, monkeypatch):
    toolshop = get_lab("toolshop")
    assert lab_predictions(toolshop, toolshop.config_type()) == {}
    monkeypatch.setattr(FLIP, "stated", "one string, not a tuple of texts")
    with pytest.raises(CreditlabError, match="lab 'two': the predictions of 'flip' must be a sequence"):
        _run(tmp_path / "run")


def test_the_guides_coin_lab_records_its_prediction(tmp_path):
    """The lab of docs/contributing.md states a prediction; its module (run from the docs) has no file."""
    block = re.findall(r"```python\n(.*?)```", (DOCS / "contributing.md").read_text(), flags=re.S)[0]
    module = types.ModuleType("creditlab_guide_coin_predictions")
    sys.modules[module.__name__] = module
    try:
        exec(compile(block, "contributing.md", "exec"), module.__dict__)
        lab = register_lab(module.LAB)
        run_lab(lab, lab.config_type.quick(), tmp_path, progress=False)
        pred = _manifest(tmp_path)["predictions"]
        assert list(pred["sections"]) == ["coin"] and pred["source"]["commit"] is None
        assert pred["source"]["why"] == "the lab's module has no source file"
        assert f"sha256 `{pred['sha256'][:12]}`" in (tmp_path / "report.md").read_text()
    finally:
        if "LAB" in module.__dict__:
            unregister_lab("coin")
        sys.modules.pop(module.__name__, None)


# --------------------------------------------------------------------------------------------
# the commit


def _git(cwd: Path, *args: str) -> str:
    who = ["-c", "user.name=t", "-c", "user.email=t@example.org", "-c", "commit.gpgsign=false"]
    return subprocess.run(["git", *who, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(not HAS_GIT, reason="needs git")
def test_source_commit_names_the_commit_and_a_dirty_tree(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    mod = repo / "pkg" / "mod.py"
    mod.write_text("X = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "pkg/mod.py")
    _git(repo, "commit", "-q", "-m", "one")
    head = _git(repo, "rev-parse", "HEAD")
    rec = source_commit(mod, repo / "pkg")
    assert rec["commit"] == head and rec["dirty"] is False and rec["changed"] == [] and rec["why"] is None
    assert rec["commit_time"].startswith(_git(repo, "show", "-s", "--format=%cI", "HEAD")[:10])
    mod.write_text("X = 2\n")
    (repo / "pkg" / "new.py").write_text("")
    rec = source_commit(mod, repo / "pkg")
    assert rec["commit"] == head and rec["dirty"] is True and rec["changed"] == ["pkg/mod.py", "pkg/new.py"]
    rec = source_commit(repo / "pkg" / "new.py")  # a file git does not track: an installed copy, not the commit
    assert rec["commit"] is None and "not tracked" in rec["why"]


def test_source_commit_says_why_there_is_none(tmp_path, monkeypatch):
    loose = tmp_path / "site-packages" / "mod.py"
    loose.parent.mkdir()
    loose.write_text("")
    assert source_commit(None)["why"] == "the lab's module has no source file"
    if HAS_GIT:
        monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no checkout above tmp_path counts
        rec = source_commit(loose)
        assert rec["commit"] is None and rec["why"] == "the lab's source is not in a git checkout (an installed copy)"
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    rec = source_commit(loose)
    assert rec["commit"] is None and rec["why"] == "git is not installed"


# --------------------------------------------------------------------------------------------
# the built-in labs state what their docs pages state


def _section(page: str, heading: str, after: str | None = None) -> list[str]:
    """The lines under ``heading`` (the first after the line ``after``) up to the next heading of its level."""
    lines = (DOCS / page).read_text().splitlines()
    start = lines.index(after) if after else 0
    i = lines.index(heading, start)
    level = len(heading) - len(heading.lstrip("#"))
    body = []
    for line in lines[i + 1:]:
        m = re.match(r"(#+) ", line)
        if m and len(m.group(1)) <= level:
            break
        body.append(line)
    return body


def _items(lines: list[str], numbered: bool) -> list[str]:
    """The list items of ``lines``, continuation lines joined, whitespace collapsed (a numbered item keeps its
    number, a bullet loses its ``* ``)."""
    start = re.compile(r"\d+\. " if numbered else r"\* ")
    items, cur = [], None
    for line in lines:
        if start.match(line):
            if cur is not None:
                items.append(cur)
            cur = line if numbered else line[2:]
        elif cur is not None and line.startswith(" ") and line.strip():
            cur += " " + line.strip()
        elif cur is not None:
            items.append(cur)
            cur = None
    if cur is not None:
        items.append(cur)
    return [" ".join(i.split()) for i in items]


def _paragraphs(lines: list[str]) -> list[str]:
    text = "\n".join(lines)
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def _table_rows(lines: list[str]) -> list[str]:
    """``| M1 | prediction | rule |`` rows as ``M1: prediction. Falsified if rule.``"""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.startswith("| ")]
    return [f"{r[0]}: {r[1]}. Falsified if {r[2]}." for r in rows if r[0] and not set(r[0]) <= set("-")]


def _docs_coverage():
    return _items(_section("coverage-report.md", "### Predictions (written before the full run)",
                           after="## Capability points: one update at 25% and 70% chain completion"), numbered=True)


def _docs_fork():
    return _items(_section("fork.md", "### Predictions (written before the full run)"), numbered=True)


def _docs_granularity():
    return _table_rows(_section("granularity.md", "### Predictions (written before the full run)"))


def _docs_mismatch():
    lines = _section("mismatch.md", "## Predictions (fixed before the full run)")
    scope = [p for p in _paragraphs(lines) if p.startswith("At the dose that passes the gate")]
    return scope + _items(lines, numbered=False)


def _docs_mismatch_two_core():
    lines = _section("mismatch.md", "### Predictions (registered before the 2-core run)")
    scope = [p for p in _paragraphs(lines) if p.startswith("On the 2-core protocol")]
    return scope + _items(lines, numbered=False)


def _docs_mismatch_dual_clip():
    """In the lab's order: the experiments' own predictions (estimator E1, planted P1-P2), then the
    comparison's scope and (A1)-(A4)."""
    lines = _section("mismatch.md", "### Predictions (registered before the dual-clip run)")
    scope = [p for p in _paragraphs(lines) if p.startswith("On the dual-clip protocol")]
    items = _items(lines, numbered=False)
    own = [i for i in items if not i.startswith("**(A")]
    return own + scope + [i for i in items if i.startswith("**(A")]


def _docs_mismatch_transfer():
    return _items(_section("diagnose.md", "#### Predictions (registered before the transfer run)"), numbered=False)


DOCS_PREDICTIONS = {"coverage": _docs_coverage, "fork": _docs_fork, "granularity": _docs_granularity,
                    "mismatch": _docs_mismatch, "mismatch/two-core": _docs_mismatch_two_core,
                    "mismatch/dual-clip": _docs_mismatch_dual_clip, "mismatch/transfer": _docs_mismatch_transfer}


@pytest.mark.parametrize("name", sorted(DOCS_PREDICTIONS))
def test_each_lab_states_its_docs_predictions_word_for_word(name):
    """What a run hashes is the lab's text; its docs page must state the same predictions, no more, no fewer
    (compared after collapsing whitespace; markdown kept). ``lab/protocol``: a registered protocol's."""
    lab_name, _, protocol = name.partition("/")
    lab = get_lab(lab_name)
    cfg = getattr(lab.config_type, lab.config_type.PROTOCOLS[protocol])() if protocol else lab.config_type()
    stated = [t for texts in lab.predictions(cfg).values() for t in texts]
    docs = DOCS_PREDICTIONS[name]()
    assert docs, f"no predictions found on the docs page of the {name} lab"
    for i, (code, page) in enumerate(zip(stated, docs, strict=False)):
        assert " ".join(code.split()) == page, f"{name} lab, prediction {i + 1}: the package and the docs differ"
    assert len(stated) == len(docs), f"{name} lab: {len(stated)} predictions in the package, {len(docs)} in the docs"


def test_the_builtin_labs_sections_are_their_experiments():
    cov, fork, gran, mm = (get_lab(n) for n in ("coverage", "fork", "granularity", "mismatch"))
    assert list(cov.predictions(cov.config_type())) == ["capability"]
    assert list(fork.predictions(fork.config_type())) == ["noise", "winrate", "pitfalls"]
    assert list(gran.predictions(gran.config_type())) == ["multi", "repeat", "warm", "budget"]
    assert list(mm.predictions(mm.config_type())) == ["mismatch"]  # the lab's, whichever doses run
    # a selection does not change what is recorded
    cfg = cov.config_type()
    assert cov.predictions(replace(cfg, experiments=("c_sweep",))) == cov.predictions(cfg)
