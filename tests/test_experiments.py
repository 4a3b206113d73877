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
    choices = [e.name for e in lab.experiments if not e.always]  # -e chooses among them; the others always run
    assert len(set(names)) == len(names) and tuple(choices) == config_type.EXPERIMENTS
    for e in lab.experiments:
        cells = e.cells(quick)
        assert (cells or e.always) and {c.group for c in cells} <= set(e.cell_groups()), e.name
    selectable = [e for e in lab.experiments if not e.always]
    first, last = selectable[0], selectable[-1]
    always = [e.name for e in lab.experiments if e.always]
    two = dataclasses.replace(quick, experiments=(last.name, first.name))
    selected = [e.name for e in lab.selected(two)]
    assert [n for n in selected if n not in always] == [first.name, last.name]  # table order, not selection order
    assert set(always) <= set(selected)
    # the selected experiments' cells, each once (an experiment's groups need not hold its name: the
    # granularity arms' runs are all of group "train")
    assert {c.key for c in lab.cells(two)} == {c.key for e in (first, last) for c in e.cells(two)}
    assert len(lab.cells(two)) == len({c.key for c in lab.cells(two)})


def test_the_mismatch_lab_is_its_doses_its_own_experiments_and_the_comparison_across_them():
    from creditlab.labs.mismatch import EXPERIMENTS
    from creditlab.labs.mismatch.config import DOSES

    own = ("estimator", "planted", "sample", "transfer")
    assert EXPERIMENTS == (*DOSES, *own) == MismatchConfig.EXPERIMENTS
    assert [e.name for e in MISMATCH.experiments] == [*DOSES, *own, "comparison"]
    comparison = MISMATCH.experiments[-1]
    assert comparison.always and not comparison.cells(MismatchConfig.quick())
    assert set(comparison.fields) == {"smooth", "protocol", "map_doses", "map_arms", "map_seeds"}


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


# --------------------------------------------------------------------------------------------
# predictions: one record, one table


def _tabs(**frames):
    from creditlab.lab.protocol import Table

    return {name: Table(frame, name) for name, frame in frames.items()}


def _heads_prediction(note=None):
    from creditlab.lab.experiment import Prediction, Verdict

    def measured(tabs):
        return None if "heads" not in tabs else f"{int(tabs['heads'].frame['heads'].sum())} heads"

    def verdict(tabs):
        if "heads" not in tabs or tabs["heads"].frame.empty:
            return Verdict.NOT_JUDGED
        return Verdict.of(bool((tabs["heads"].frame["heads"] > 0).all()))

    return Prediction("H1: every seed shows heads", "H1. **Every seed shows heads.** Falsified if one does not.",
                      measured, verdict, note)


def test_a_prediction_is_one_row_of_the_one_predictions_table():
    import pandas as pd

    from creditlab.lab.experiment import PREDICTION_COLUMNS, notes, predictions_table

    p = _heads_prediction()
    assert PREDICTION_COLUMNS == ("experiment", "prediction", "measured", "verdict")
    table = predictions_table([("coin", p)], _tabs(heads=pd.DataFrame({"heads": [1, 1]})))
    assert table.to_dict("records") == [{"experiment": "coin", "prediction": "H1: every seed shows heads",
                                         "measured": "2 heads", "verdict": "holds"}]
    assert predictions_table([("coin", p)], _tabs(heads=pd.DataFrame({"heads": [1, 0]})))["verdict"].tolist() == [
        "fails"]
    assert predictions_table([("coin", p)], {}).empty  # nothing measured: left out
    assert list(predictions_table([], {}).columns) == list(PREDICTION_COLUMNS)
    noted = _heads_prediction(notes(not_judged="no seed ran"))
    assert predictions_table([("coin", noted)], _tabs(heads=pd.DataFrame({"heads": []})))["verdict"].tolist() == [
        "not judged (no seed ran)"]


def test_every_verdict_of_several_points():
    from creditlab.lab.experiment import Verdict

    H, F, N = Verdict.HOLDS, Verdict.FAILS, Verdict.NOT_JUDGED
    assert Verdict.every([H, H]) is H and Verdict.every([H, F, N]) is F and Verdict.every([H, N]) is N
    assert Verdict.every([]) is N


def test_an_experiment_lab_judges_its_experiments_predictions_after_every_table():
    import pandas as pd

    from creditlab.lab.experiment import Prediction, Verdict
    from creditlab.lab.protocol import Table

    heads = _heads_prediction()
    gate_read = Prediction("G1: the gate passes", "G1. The gate passes.",
                           lambda t: "gate" if "gate" in t else None,
                           lambda t: Verdict.of(bool(t["gate"].frame["ok"].all())))

    class Coin(Experiment):
        name = "coin"
        predictions = (heads, gate_read)

        def cells(self, config):
            return []

        def tables(self, rows, config):
            return {"heads": Table(pd.DataFrame({"heads": [1, 1]}), "heads")}

    class Quiet(Experiment):
        name = "quiet"

        def cells(self, config):
            return []

    class CoinLab(ExperimentLab):
        name = "coins"
        experiments = (Coin(), Quiet())

        def lab_tables(self, rows, config):  # the lab's own: judged on too
            return {"gate": Table(pd.DataFrame({"ok": [True]}), "gate")}

    lab = CoinLab()
    cfg = dataclasses.replace(CoverageConfig.quick(), experiments=("coin", "quiet"))
    tabs = lab.tables({}, cfg)
    assert list(tabs) == ["gate", "heads", "predictions"]  # the lab's, the experiments', the predictions
    assert tabs["predictions"].frame[["experiment", "verdict"]].values.tolist() == [["coin", "holds"],
                                                                                   ["coin", "holds"]]
    assert "holds, fails, or not judged" in lab.interpret(tabs, cfg)["predictions"]
    assert lab.predictions(cfg) == {"coin": (heads.stated, gate_read.stated)}
    quiet = dataclasses.replace(cfg, experiments=("quiet",))
    assert "predictions" not in lab.tables({}, quiet)  # an experiment not selected is not judged
    assert lab.predictions(quiet) == lab.predictions(cfg)  # and still recorded

    class Clash(Coin):
        def tables(self, rows, config):
            return {"predictions": Table(pd.DataFrame(), "mine")}

    class ClashLab(ExperimentLab):
        name = "clash"
        experiments = (Clash(),)

    with pytest.raises(CreditlabError, match="a table is named 'predictions'"):
        ClashLab().tables({}, cfg)


def test_parts_of_one_stated_prediction_are_recorded_once():
    from creditlab.labs.fork import LAB as fork
    from creditlab.labs.fork.pitfalls import PITFALLS_PREDICTIONS, PITFALLS_STATED

    assert {p.stated for p in PITFALLS_PREDICTIONS} == set(PITFALLS_STATED)  # 5 (FORK) and 5 (split): one text
    assert fork.predictions(ForkLabConfig())["pitfalls"] == PITFALLS_STATED
