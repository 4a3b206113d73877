"""Experiments: the units a lab is built from.

An experiment is one question a lab asks (the coverage lab's C sweep, its shuffled control...): the
cells that answer it, the tables derived from their rows, its plots and the written reading of its
tables. It lives in a module of its own under ``labs/<lab>/`` and is one line in its lab's table of
experiments. :class:`ExperimentLab` gives a lab the four methods of the :class:`~creditlab.lab.protocol.Lab`
protocol by looping over the experiments a run selects (``-e``), in the order of the table, so a
lab's own code is what every experiment shares: its config, its description, its one-off
``prepare``.

What an experiment provides (subclass :class:`Experiment`; every method but ``cells`` has a default):

* ``name``: the ``-e`` name, and the group of its cells (the key of its rows in ``tables``);
* ``groups``: the cell groups it makes (default: its name); experiments that share work list the
  same group, and a cell two selected experiments both make (the same key) runs once;
* ``fields``: the config fields it owns (a test checks that each field of a lab's config is owned by
  one experiment or is one of the lab's shared fields);
* ``validate(config)``: the checks of its fields (a ``ConfigError`` names the CLI flag or field);
* ``cells(config)``: its cells, all of group ``name``;
* ``tables(rows, config)``: its tables from the rows of its groups (``rows`` maps every group of the run
  to its rows);
* ``plots(tables, config, out)``: its PNG files, from every table made so far;
* ``interpret(tables, config)``: the reading of each of its report tables;
* ``predictions_text(config)``: its predictions as written before a full run, one text each (the
  same texts its docs page states): :func:`~creditlab.lab.protocol.run_lab` records them, with their
  hash and the source's git commit, in the run's manifest at the start of every run.

A prediction written before a run is judged by a small pure function from tables to a
:class:`Verdict` (``holds``, ``fails`` or ``not judged``: the run cannot tell, e.g. its gate failed or
an arm it needs did not run), tested on hand-made tables for each outcome.

Adding an experiment: see ``docs/contributing.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from creditlab.errors import CreditlabError
from creditlab.lab.protocol import Table
from creditlab.lab.runner import Cell

__all__ = ["Experiment", "ExperimentLab", "Verdict"]


class Verdict(str, Enum):
    """The outcome of a prediction on a run's tables."""

    HOLDS = "holds"
    FAILS = "fails"
    NOT_JUDGED = "not judged"

    @classmethod
    def of(cls, held: bool | None) -> Verdict:
        """``holds`` / ``fails`` from a test's outcome; ``not judged`` when it could not be tested (None)."""
        return cls.NOT_JUDGED if held is None else cls.HOLDS if held else cls.FAILS


class Experiment:
    """One experiment of a lab (see the module docstring); subclass it and override what it does."""

    name: ClassVar[str] = ""
    fields: ClassVar[tuple[str, ...]] = ()
    groups: ClassVar[tuple[str, ...]] = ()
    """The cell groups it makes; empty: just ``name``."""

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

    def predictions_text(self, config: Any) -> tuple[str, ...]:
        """Its predictions as they were written before a full run, one text each, word for word as its
        docs page states them (none by default). A run records them at its start, before any cell runs
        (the manifest's ``predictions``), and its report says if they were edited after that."""
        return ()


class ExperimentLab:
    """The ``cells`` / ``tables`` / ``plots`` / ``interpret`` of a lab built from :class:`Experiment` s.

    A lab sets ``experiments`` (its table: every experiment, in report order) and keeps
    ``config.experiments`` (the selection) among their names. Each method runs the selected
    experiments in table order; the tables of one experiment are visible to the plots and
    interpretation of every other (they run after all tables exist).
    """

    experiments: ClassVar[Sequence[Experiment]] = ()

    def selected(self, config: Any) -> list[Experiment]:
        """The experiments ``config.experiments`` selects, in the order of the lab's table."""
        chosen = set(config.experiments)
        return [e for e in self.experiments if e.name in chosen]

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

    def tables(self, rows: dict[str, pd.DataFrame], config: Any) -> dict[str, Table]:
        tabs: dict[str, Table] = {}
        for e in self.selected(config):
            tabs.update(e.tables(rows, config))
        return tabs

    def plots(self, tables: dict[str, Table], config: Any, out: Path) -> list[Path]:
        return [p for e in self.selected(config) for p in e.plots(tables, config, out)]

    def interpret(self, tables: dict[str, Table], config: Any) -> dict[str, str]:
        text: dict[str, str] = {}
        for e in self.selected(config):
            text.update(e.interpret(tables, config))
        return text

    def predictions(self, config: Any) -> dict[str, tuple[str, ...]]:
        """The predictions of every experiment that states some (selected or not: a later run into the same
        ``--out`` may select another, and its predictions were fixed at the first start), by experiment
        name, in the order of the lab's table."""
        return {e.name: texts for e in self.experiments if (texts := tuple(e.predictions_text(config)))}
