"""Labs built from experiments (creditlab.lab.experiment): each experiment owns its config fields,
makes cells of its own group only, and the lab runs just the experiments a config selects."""

from __future__ import annotations

import dataclasses

import pytest

from creditlab.errors import CreditlabError
from creditlab.lab.experiment import Experiment, ExperimentLab
from creditlab.lab.runner import Cell
from creditlab.labs.coverage import EXPERIMENTS, LAB, SHARED_FIELDS, CoverageConfig
from creditlab.labs.fork import LAB as FORK
from creditlab.labs.fork import SHARED_FIELDS as FORK_SHARED
from creditlab.labs.fork import ForkLabConfig
from creditlab.labs.granularity import LAB as GRANULARITY
from creditlab.labs.granularity import SHARED_FIELDS as GRANULARITY_SHARED
from creditlab.labs.granularity import GranularityConfig
from creditlab.labs.mismatch import LAB as MISMATCH
from creditlab.labs.mismatch import SHARED_FIELDS as MISMATCH_SHARED
from creditlab.labs.mismatch import MismatchConfig
from creditlab.labs.toolshop import LAB as TOOLSHOP
from creditlab.labs.toolshop import SHARED_FIELDS as TOOLSHOP_SHARED
from creditlab.labs.toolshop import ToolshopLabConfig

LABS = [(LAB, CoverageConfig, SHARED_FIELDS), (FORK, ForkLabConfig, FORK_SHARED),
        (TOOLSHOP, ToolshopLabConfig, TOOLSHOP_SHARED), (GRANULARITY, GranularityConfig, GRANULARITY_SHARED),
        (MISMATCH, MismatchConfig, MISMATCH_SHARED)]


@pytest.mark.parametrize(("lab", "config_type", "shared"), LABS, ids=lambda v: getattr(v, "name", ""))
def test_every_config_field_belongs_to_one_experiment_or_is_shared(lab, config_type, shared):
    owners: dict[str, list[str]] = {}
    for e in lab.experiments:
        for f in e.fields:
            owners.setdefault(f, []).append(e.name)
    fields = {f.name for f in dataclasses.fields(config_type)}
    assert not {f: o for f, o in owners.items() if len(o) > 1}, "a field owned twice"
    assert set(owners) <= fields, f"experiments own fields the config lacks: {set(owners) - fields}"
    assert not set(owners) & set(shared)
    assert fields == set(owners) | set(shared), f"fields owned by nobody: {fields - set(owners) - set(shared)}"


@pytest.mark.parametrize(("lab", "config_type", "shared"), LABS, ids=lambda v: getattr(v, "name", ""))
def test_experiments_make_cells_of_their_own_group_and_only_selected_ones_run(lab, config_type, shared):
    quick = config_type.quick()
    names = [e.name for e in lab.experiments]
    assert len(set(names)) == len(names) and tuple(names) == config_type.EXPERIMENTS
    for e in lab.experiments:
        cells = e.cells(quick)
        assert cells and {c.group for c in cells} <= set(e.cell_groups()), e.name
    two = dataclasses.replace(quick, experiments=(names[-1], names[0]))
    assert [e.name for e in lab.selected(two)] == [names[0], names[-1]]  # table order, not selection order
    first, last = lab.experiments[0], lab.experiments[-1]
    # the selected experiments' cells, each once (an experiment's groups need not hold its name: the
    # granularity arms' runs are all of group "train")
    assert {c.key for c in lab.cells(two)} == {c.key for e in (first, last) for c in e.cells(two)}
    assert len(lab.cells(two)) == len({c.key for c in lab.cells(two)})


def test_an_experiment_making_another_groups_cells_is_refused():
    class Stray(Experiment):
        name = "stray"

        def cells(self, config):
            return [Cell("other", "x", print, {})]

    class OneLab(ExperimentLab):
        experiments = (Stray(),)

    with pytest.raises(CreditlabError, match=r"experiment 'stray' made cells of group\(s\) \['other'\], not among"):
        OneLab().cells(dataclasses.replace(CoverageConfig.quick(), experiments=("stray",)))


def test_coverage_experiments_are_the_table():
    assert EXPERIMENTS == ("c_sweep", "vd_sweep", "shuffle", "dose", "real_agent", "crossing", "single_update",
                           "capability")


def test_a_cell_two_experiments_share_runs_once():
    class Half(Experiment):
        groups = ("shared",)

        def cells(self, config):
            return [Cell("shared", "common", print, {"x": 1}), Cell("shared", self.name, print, {"x": self.name})]

    class A(Half):
        name = "a"

    class B(Half):
        name = "b"

    class TwoLab(ExperimentLab):
        experiments = (A(), B())

    cells = TwoLab().cells(dataclasses.replace(CoverageConfig.quick(), experiments=("a", "b")))
    assert [c.name for c in cells] == ["common", "a", "b"]


def test_a_verdict_is_holds_fails_or_not_judged():
    from creditlab.lab.experiment import Verdict

    assert [Verdict.of(v).value for v in (True, False, None)] == ["holds", "fails", "not judged"]
    assert Verdict.of(True) == "holds"  # a str: it goes into a table as its value
