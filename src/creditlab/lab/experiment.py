"""Experiments: the units a lab is built from.

An experiment is one question a lab asks (the coverage lab's C sweep, its shuffled control...): the
cells that answer it, the tables derived from their rows, its plots and the written reading of its
tables. It lives in a module of its own under ``labs/<lab>/`` and is one line in its lab's table of
experiments. :class:`ExperimentLab` gives a lab the four methods of the :class:`~creditlab.lab.protocol.Lab`
protocol by looping over the experiments a run selects (``-e``), in the order of the table, so a
lab's own code is what every experiment shares: its config, its description, its one-off
``prepare``, its own tables (``lab_tables``: its knobs, its gate).

What an experiment provides (subclass :class:`Experiment`; every method but ``cells`` has a default):

* ``name``: the ``-e`` name, and the group of its cells (the key of its rows in ``tables``);
* ``groups``: the cell groups it makes (default: its name); experiments that share work list the
  same group, and a cell two selected experiments both make (the same key) runs once;
* ``always``: True for an experiment that runs in every selection and is not an ``-e`` choice (one that
  compares the selected ones from their rows, making no cells of its own);
* ``fields``: the config fields it owns (a test checks that each field of a lab's config is owned by
  one experiment or is one of the lab's shared fields);
* ``validate(config)``: the checks of its fields (a ``ConfigError`` names the CLI flag or field);
* ``cells(config)``: its cells, all of group ``name``;
* ``tables(rows, config)``: its tables from the rows of its groups (``rows`` maps every group of the run
  to its rows);
* ``plots(tables, config, out)``: its PNG files, from every table made so far;
* ``interpret(tables, config)``: the reading of each of its report tables;
* ``predictions``: its :class:`Prediction` s, each written before a full run (``predictions_for(config)``
  when their text depends on the config, e.g. on a registered protocol). Their texts
  (``predictions_text(config)``, the same texts its docs page states) are what
  :func:`~creditlab.lab.protocol.run_lab` records, with their hash and the source's git commit, in the
  run's manifest at the start of every run; their verdicts make the lab's predictions table.

A prediction written before a run is judged by a small pure function from the run's tables to a
:class:`Verdict` (``holds``, ``fails`` or ``not judged``: the run cannot tell, e.g. its gate failed or
an arm it needs did not run), tested on hand-made tables for each outcome. :class:`ExperimentLab`
builds one predictions table for the whole run (:data:`PREDICTION_COLUMNS`, the same in every lab)
from the selected experiments' predictions, after every other table exists.

Adding an experiment: see ``docs/contributing.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from creditlab.errors import CreditlabError
from creditlab.lab.protocol import Table
from creditlab.lab.runner import Cell

__all__ = ["PREDICTION_COLUMNS", "Experiment", "ExperimentLab", "Prediction", "Tables", "Verdict", "notes",
           "predictions_table"]

#: The tables of a run, by name (what a prediction's verdict is judged on).
Tables = Mapping[str, Table]
#: The columns of a lab's predictions table, the same in every lab: the experiment that states the
#: prediction, its short form (:attr:`Prediction.claim`), what the run measured, and the verdict (a
#: :class:`Verdict`'s value, with the prediction's note in parentheses when it has one).
PREDICTION_COLUMNS = ("experiment", "prediction", "measured", "verdict")


class Verdict(str, Enum):
    """The outcome of a prediction on a run's tables."""

    HOLDS = "holds"
    FAILS = "fails"
    NOT_JUDGED = "not judged"

    @classmethod
    def of(cls, held: bool | None) -> Verdict:
        """``holds`` / ``fails`` from a test's outcome; ``not judged`` when it could not be tested (None)."""
        return cls.NOT_JUDGED if held is None else cls.HOLDS if held else cls.FAILS

    @classmethod
    def every(cls, verdicts: Iterable[Verdict]) -> Verdict:
        """One verdict of a prediction stated at several points (every C, every dose...): ``fails`` when it
        fails at any point, ``holds`` when it holds at every point (at least one), else ``not judged``."""
        seen = list(verdicts)
        if cls.FAILS in seen:
            return cls.FAILS
        return cls.HOLDS if seen and all(v is cls.HOLDS for v in seen) else cls.NOT_JUDGED


def notes(holds: str = "", fails: str = "", not_judged: str = "") -> Callable[[Verdict, Tables], str]:
    """A :attr:`Prediction.note` that depends on the verdict only (e.g. ``notes(not_judged="not resolved:
    the interval spans 0")``)."""
    words = {Verdict.HOLDS: holds, Verdict.FAILS: fails, Verdict.NOT_JUDGED: not_judged}
    return lambda verdict, tables: words[verdict]


@dataclass(frozen=True)
class Prediction:
    """A prediction written before a run, and how a run judges it: one row of the lab's predictions table.

    ``measured`` and ``verdict`` are pure functions of the run's tables (by name): ``measured`` says what
    the run measured, or None when the run has nothing the prediction is about (the experiment or the arm
    it needs did not run: the table leaves it out); ``verdict`` is its falsification rule. ``note``
    (optional) qualifies a verdict in a few words, written after it in parentheses ("" for none): e.g. a
    rule that reports an interval spanning 0 as not resolved."""

    claim: str
    """Its short form in the predictions table, with its id (``"M1: ..."``)."""
    stated: str
    """The prediction word for word as written before the run (as its docs page states it): what a run
    records at its start. Several records may judge parts of one stated text (one per arm, say): the
    text is recorded once."""
    measured: Callable[[Tables], str | None]
    verdict: Callable[[Tables], Verdict]
    note: Callable[[Verdict, Tables], str] | None = None

    def row(self, tables: Tables) -> dict[str, str] | None:
        """Its row of the predictions table, without the experiment (None: left out)."""
        measured = self.measured(tables)
        if measured is None:
            return None
        verdict = self.verdict(tables)
        note = self.note(verdict, tables) if self.note is not None else ""
        return {"prediction": self.claim, "measured": measured,
                "verdict": f"{verdict.value} ({note})" if note else verdict.value}


def predictions_table(predictions: Iterable[tuple[str, Prediction]], tables: Tables) -> pd.DataFrame:
    """The predictions table (:data:`PREDICTION_COLUMNS`) of ``(experiment name, prediction)`` pairs judged on
    ``tables``: one row per prediction the run has something on, in the given order."""
    rows = [{"experiment": name, **r} for name, p in predictions if (r := p.row(tables)) is not None]
    return pd.DataFrame(rows, columns=list(PREDICTION_COLUMNS))


class Experiment:
    """One experiment of a lab (see the module docstring); subclass it and override what it does."""

    name: ClassVar[str] = ""
    fields: ClassVar[tuple[str, ...]] = ()
    groups: ClassVar[tuple[str, ...]] = ()
    """The cell groups it makes; empty: just ``name``."""
    always: ClassVar[bool] = False
    """True: it runs whatever a run selects, and is not a ``-e`` choice (an experiment that compares the
    selected ones: it reads their rows and makes no cells of its own)."""
    predictions: ClassVar[tuple[Prediction, ...]] = ()
    """Its predictions, written before a full run, in the order of the predictions table (override
    :meth:`predictions_for` instead when their text depends on the config)."""

    def cell_groups(self) -> tuple[str, ...]:
        return self.groups or (self.name,)

    def validate(self, config: Any) -> None:
        """Check the fields this experiment owns (the lab validates the shared ones)."""

    def cells(self, config: Any) -> list[Cell]:  # pragma: no cover - every experiment overrides it
        raise NotImplementedError

    def tables(self, rows: Mapping[str, pd.DataFrame], config: Any) -> dict[str, Table]:
        """The tables of this experiment from the rows of its cells (``rows[group]`` for each of its groups)."""
        return {}

    def plots(self, tables: Mapping[str, Table], config: Any, out: Path) -> list[Path]:
        """PNG files written into ``out`` (``tables``: every table of the run)."""
        return []

    def interpret(self, tables: Mapping[str, Table], config: Any) -> dict[str, str]:
        """The reading of each of this experiment's report tables (``tables``: every table of the run)."""
        return {}

    def predictions_for(self, config: Any) -> tuple[Prediction, ...]:
        """Its predictions under ``config`` (default: :attr:`predictions`; the mismatch lab's depend on the
        registered protocol). They must not depend on the selection: a run records them all at its start."""
        return self.predictions

    def predictions_text(self, config: Any) -> tuple[str, ...]:
        """Its predictions as they were written before a full run, word for word as its docs page states
        them: each distinct :attr:`Prediction.stated` once, in order. A run records them at its start,
        before any cell runs (the manifest's ``predictions``), and its report says if they were edited
        after that."""
        return tuple(dict.fromkeys(p.stated for p in self.predictions_for(config)))

    def predictions_section(self, config: Any) -> str:
        """The name its texts are recorded under in the manifest (default: its name)."""
        return self.name


class ExperimentLab:
    """The ``cells`` / ``tables`` / ``plots`` / ``interpret`` of a lab built from :class:`Experiment` s.

    A lab sets ``experiments`` (its table: every experiment, in report order) and keeps
    ``config.experiments`` (the selection) among their names. Each method runs the selected
    experiments in table order; the tables of one experiment are visible to the plots and
    interpretation of every other (they run after all tables exist). ``tables`` begins with the lab's
    own (:meth:`lab_tables`) and ends with the predictions table (:attr:`predictions_name`): every
    prediction of the selected experiments, judged on all the tables before it.
    """

    experiments: ClassVar[Sequence[Experiment]] = ()
    predictions_name: ClassVar[str] = "predictions"
    """The name of the lab's predictions table (``<name>.parquet``, ``<name>.md``)."""

    def selected(self, config: Any) -> list[Experiment]:
        """The experiments ``config.experiments`` selects (and those that always run), in the order of the
        lab's table."""
        chosen = set(config.experiments)
        return [e for e in self.experiments if e.always or e.name in chosen]

    def cells(self, config: Any) -> list[Cell]:
        """The selected experiments' cells in table order; a cell two of them make (same key) once."""
        out: dict[str, Cell] = {}
        for e in self.selected(config):
            cells = e.cells(config)
            wrong = sorted({c.group for c in cells} - set(e.cell_groups()))
            if wrong:
                raise CreditlabError(f"experiment {e.name!r} made cells of group(s) {wrong}, not among its groups "
                                     f"{list(e.cell_groups())}")
            for c in cells:
                out.setdefault(c.key, c)
        return list(out.values())

    def lab_tables(self, rows: dict[str, pd.DataFrame], config: Any) -> dict[str, Table]:
        """The lab's own tables (its knobs, its gate: what every experiment shares), first in the report;
        the predictions are judged on them too. None by default."""
        return {}

    def tables(self, rows: dict[str, pd.DataFrame], config: Any) -> dict[str, Table]:
        """The lab's own tables, the selected experiments' tables, then the predictions table (when the run
        has something on a prediction)."""
        tabs = dict(self.lab_tables(rows, config))
        for e in self.selected(config):
            tabs.update(e.tables(rows, config))
        if self.predictions_name in tabs:
            raise CreditlabError(f"lab {getattr(self, 'name', type(self).__name__)!r}: a table is named "
                                 f"{self.predictions_name!r}, the name of the lab's predictions table")
        judged = predictions_table([(e.name, p) for e in self.selected(config) for p in e.predictions_for(config)],
                                   tabs)
        if len(judged):
            tabs[self.predictions_name] = Table(judged, "The predictions written before the run, judged on this run",
                                                console=True)
        return tabs

    def plots(self, tables: dict[str, Table], config: Any, out: Path) -> list[Path]:
        return [p for e in self.selected(config) for p in e.plots(tables, config, out)]

    def interpret(self, tables: dict[str, Table], config: Any) -> dict[str, str]:
        text: dict[str, str] = {}
        for e in self.selected(config):
            text.update(e.interpret(tables, config))
        if self.predictions_name in tables:
            text[self.predictions_name] = PREDICTIONS_READING
        return text

    def predictions(self, config: Any) -> dict[str, tuple[str, ...]]:
        """The predictions' texts of every experiment that states some (selected or not: a later run into the
        same ``--out`` may select another, and its predictions were fixed at the first start), by section
        (:meth:`Experiment.predictions_section`: the experiment's name), in the order of the lab's table."""
        return {e.predictions_section(config): texts for e in self.experiments
                if (texts := tuple(e.predictions_text(config)))}


#: The reading of every lab's predictions table.
PREDICTIONS_READING = (
    "One row per prediction of the selected experiments that this run has something on: its short form (the text "
    "as written before the run, word for word, is in lab.json, predictions), what this run measured, and the "
    "verdict of its rule, a fixed function of the tables above: holds, fails, or not judged (the run cannot tell: "
    "a gate failed, an arm or point the prediction is about did not run, one seed gives no interval, or the rule "
    "reports an interval spanning 0 as not resolved); words in parentheses after a verdict qualify it.")
