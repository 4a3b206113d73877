"""The example lab of docs/contributing.md runs as written, and so does its example experiment, added to
each lab built from experiments (so the guide cannot rot)."""

import dataclasses
import importlib
import json
import re
import sys
import types
from pathlib import Path

import pandas as pd
import pytest

from creditlab.lab.protocol import run_lab
from creditlab.labs import get_lab, register_lab, unregister_lab

DOC = Path(__file__).resolve().parents[1] / "docs" / "contributing.md"


def test_the_coin_lab_of_the_guide_runs_and_resumes(tmp_path):
    block = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[0]
    module = types.ModuleType("creditlab_guide_coin")
    sys.modules[module.__name__] = module  # the cell function must be importable by name (pickling)
    try:
        exec(compile(block, str(DOC), "exec"), module.__dict__)
        lab = register_lab(module.LAB)
        assert get_lab("coin") is lab
        res = run_lab(lab, lab.config_type.quick(), tmp_path, progress=False)
        assert set(res.tables) == {"heads", "heads_diff"}
        report = (tmp_path / "report.md").read_text()
        assert "biased - fair over 3 paired seeds" in report
        assert run_lab(lab, lab.config_type.quick(), tmp_path, progress=False).computed == 0
    finally:
        if "LAB" in module.__dict__:
            unregister_lab("coin")
        sys.modules.pop(module.__name__, None)


# --------------------------------------------------------------------------------------------
# "Adding an experiment": the guide's experiment, wired into each lab as its table says


@pytest.fixture(scope="module")
def guide_experiment():
    """The module of the guide's example experiment (its code block, run as written)."""
    text = DOC.read_text()
    section = text[text.index("## Adding an experiment"):text.index("## Adding a correction arm")]
    block = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    module = types.ModuleType("creditlab_guide_toss")
    sys.modules[module.__name__] = module  # the cell function must be importable by name (pickling)
    exec(compile(block, str(DOC), "exec"), module.__dict__)
    yield module
    sys.modules.pop(module.__name__, None)


def _wire(monkeypatch, lab, experiment) -> None:
    """What the guide's table says to edit, done at runtime (and undone after): the experiment's line in the
    lab's ``EXPERIMENT_TABLE`` and its ``-e`` name in the lists the config checks the selection against."""
    table = (*lab.experiments, experiment)
    names = (*lab.config_type.EXPERIMENTS, experiment.name)
    package = importlib.import_module(f"creditlab.labs.{lab.name}")
    monkeypatch.setattr(lab, "experiments", table)
    monkeypatch.setattr(package, "EXPERIMENT_TABLE", table)
    monkeypatch.setattr(lab.config_type, "EXPERIMENTS", names)
    for module in (package, sys.modules.get(f"creditlab.labs.{lab.name}.config")):
        if module is not None and hasattr(module, "EXPERIMENTS"):
            monkeypatch.setattr(module, "EXPERIMENTS", names)


@pytest.mark.parametrize("name", ["coverage", "fork", "granularity", "mismatch"])
def test_the_guides_experiment_joins_each_lab_with_its_table_plot_and_prediction(name, guide_experiment, tmp_path,
                                                                                 monkeypatch):
    lab = get_lab(name)
    toss = guide_experiment.Toss
    if name == "granularity":  # the guide's table: a granularity experiment subclasses GranularityExperiment
        from creditlab.labs.granularity._common import GranularityExperiment

        toss = type("Toss", (toss, GranularityExperiment), {})
    experiment = toss()
    _wire(monkeypatch, lab, experiment)
    cfg = dataclasses.replace(lab.config_type.quick(), experiments=("toss",))  # the quick config, the toy alone
    if hasattr(cfg, "cache_dir"):
        cfg = dataclasses.replace(cfg, cache_dir=str(tmp_path / "cache"))
    out = tmp_path / "run"
    res = run_lab(lab, cfg, out, progress=False)
    assert res.computed == 2 and {c.group for c in lab.cells(cfg)} == {"toss"}
    # its table and its plot
    assert list(res.tables["toss"].frame["seed"]) == [0, 1] and (out / "toss.parquet").exists()
    assert [p.name for p in res.plots] == ["toss.png"] and (out / "toss.png").stat().st_size > 0
    # its prediction: judged in the lab's predictions table, recorded in lab.json, cited in the report
    judged = res.tables[lab.predictions_name].frame
    assert judged.to_dict("records") == [{
        "experiment": "toss", "prediction": "T1: every seed's share of heads lies in [0.2, 0.8]",
        "measured": ", ".join(f"seed {s}: {h:.2f}" for s, h in zip(res.tables["toss"].frame["seed"],
                                                                   res.tables["toss"].frame["heads"], strict=True)),
        "verdict": "holds"}]
    pd.testing.assert_frame_equal(pd.read_parquet(out / f"{lab.predictions_name}.parquet"), judged)
    manifest = json.loads((out / "lab.json").read_text())
    stated = list(experiment.predictions_text(cfg))
    assert len(stated) == 1 and manifest["predictions"]["sections"]["toss"]["texts"] == stated
    assert {"toss.parquet", "toss.md", "toss.png", f"{lab.predictions_name}.parquet"} <= set(manifest["outputs"])
    report = (out / "report.md").read_text()
    assert "## Toss: share of heads per seed" in report and "![toss](toss.png)" in report
    assert "toss: 1" in report.split("\n## ")[0]  # the record of the predictions, cited at the top
    assert report.index("## Toss: share of heads per seed") < report.index("T1: every seed's share of heads")
