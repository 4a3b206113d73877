"""The runs committed under results/ keep their cell keys, so re-rendering them reads their stored cells
instead of recomputing (hours of training) or refusing the ``--out``.

A cell's key digests its kwargs, which carry the config's identity (``LabConfig.to_dict``). A field added to
a config after a run was stored (``GRPOConfig.clip_ratio_c``, ``GRPOConfig.plant``, ``MismatchConfig.eval_on``)
declares the value that run had (``field(metadata={"absent": value})``): at that value it is left out of the
dict, so the keys do not move. Every cell the committed config makes today must be in the run's store.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from creditlab.lab.store import ResultStore

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _store(run: Path) -> ResultStore:
    """The run's store, read only (``ResultStore`` creates a missing directory: refuse one first)."""
    cells = run / "store" / "cells"
    if not cells.is_dir():
        pytest.skip(f"{cells} is not in this checkout")
    return ResultStore(run / "store")


def _missing(lab, cfg, store: ResultStore) -> list[str]:
    return [c.key for c in lab.cells(cfg) if c.key not in store]


def test_the_two_core_mismatch_run_keeps_every_cell_key():
    """results/mismatch-2core/run was stored before the dual clip and the engine-scored evaluation:
    ``MismatchConfig.two_core()`` (clip_ratio_c None, eval_on fp32) makes exactly its cells, and its identity
    is the one its lab.json recorded (so run_lab accepts the --out)."""
    from creditlab.labs.mismatch import LAB, MismatchConfig

    run = RESULTS / "mismatch-2core" / "run"
    store = _store(run)
    cfg = MismatchConfig.two_core()
    cfg.validate()
    assert cfg.grpo.clip_ratio_c is None and cfg.grpo.plant == 0.0 and cfg.eval_on == "fp32"
    cells = LAB.cells(cfg)
    assert len(cells) == 13  # the dose cell, fp32, 2 seeds at each map dose, 5 seeds at mxfp4
    assert _missing(LAB, cfg, store) == []
    assert {c.key for c in cells} == store.done()
    assert cfg.identity() == json.loads((run / "lab.json").read_text())["identity"]
    # the added fields at the stored run's values are left out of the dict, and read back from their absence
    d = cfg.to_dict()
    assert "eval_on" not in d and {"clip_ratio_c", "plant"}.isdisjoint(d["grpo"])
    assert MismatchConfig.from_dict(d) == cfg


def test_the_granularity_budget_run_keeps_every_cell_key():
    """results/granularity-budget/run100-8seeds: the config its lab.json recorded, read back today, makes
    exactly the 41 cells of its store."""
    from creditlab.labs.granularity import LAB, GranularityConfig

    run = RESULTS / "granularity-budget" / "run100-8seeds"
    store = _store(run)
    manifest = json.loads((run / "lab.json").read_text())
    cfg = GranularityConfig.from_dict(manifest["config"])
    cfg.validate()
    assert cfg.grpo.clip_ratio_c is None and cfg.grpo.plant == 0.0  # absent from the stored config: as then
    cells = LAB.cells(cfg)
    assert len(cells) == 41
    assert _missing(LAB, cfg, store) == []
    assert {c.key for c in cells} == store.done()
    assert cfg.identity() == manifest["identity"]


def test_the_key_check_fails_when_the_protocol_moves():
    """The check above can fail: the same configs with the dual clip on (as the field's default is) or with
    held-out success scored on the engine make keys neither store holds."""
    from creditlab.labs.granularity import LAB as GRANULARITY
    from creditlab.labs.granularity import GranularityConfig
    from creditlab.labs.mismatch import LAB, MismatchConfig

    cfg = MismatchConfig.two_core()
    store = _store(RESULTS / "mismatch-2core" / "run")
    clipped = replace(cfg, grpo=replace(cfg.grpo, clip_ratio_c=3.0))
    assert "clip_ratio_c" in clipped.to_dict()["grpo"]
    assert len(_missing(LAB, clipped, store)) == len(LAB.cells(clipped))
    on_engine = replace(cfg, eval_on="engine")
    assert on_engine.to_dict()["eval_on"] == "engine"
    assert len(_missing(LAB, on_engine, store)) == len(LAB.cells(on_engine))

    run = RESULTS / "granularity-budget" / "run100-8seeds"
    g = GranularityConfig.from_dict(json.loads((run / "lab.json").read_text())["config"])
    planted = replace(g, grpo=replace(g.grpo, plant=0.1))
    assert len(_missing(GRANULARITY, planted, _store(run))) == len(GRANULARITY.cells(planted))
