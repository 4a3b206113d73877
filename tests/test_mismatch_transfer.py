"""The mismatch lab's transfer experiment: the trajectory ESS it adds to the checks' shared values, the rule that
picks a unit (hand-made phase maps), its verdict, and its cells end to end at a tiny size."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from creditlab.core.diagnostics import batch_check_values, trajectory_ess
from creditlab.diagnose.checks import CHECK_PARAMS
from creditlab.errors import ConfigError, InputError
from creditlab.lab.experiment import Verdict
from creditlab.labs.mismatch import MismatchConfig
from creditlab.labs.mismatch.transfer import (
    EXPERIMENT,
    UNITS,
    parse_point,
    transfer_gate_cell,
    transfer_map,
    transfer_stack_cell,
    transfer_verdict,
    unit_calibration,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------------------------------
# trajectory ESS


def test_trajectory_ess_golden():
    # w = (1, 3): (1 + 3)^2 / (2 (1 + 9)) = 0.8
    w13 = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)
    assert float(trajectory_ess(w13)) == pytest.approx(0.8, rel=1e-12)
    assert float(trajectory_ess(torch.zeros(7))) == pytest.approx(1.0, rel=1e-12)
    # one weight dominating: 1 / N; log weights of hundreds of nats neither overflow nor underflow
    assert float(trajectory_ess(torch.tensor([800.0, 0.0, 0.0, -900.0]))) == pytest.approx(0.25, rel=1e-12)
    with pytest.raises(InputError, match="log_w"):
        trajectory_ess(torch.zeros(0))
    with pytest.raises(InputError, match="log_w"):
        trajectory_ess(torch.tensor([0.0, math.nan]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-30, 30), min_size=1, max_size=40), st.floats(-50, 50))
def test_trajectory_ess_is_a_share_and_ignores_a_common_factor(lw, shift):
    x = torch.tensor(lw, dtype=torch.float64)
    e = float(trajectory_ess(x))
    assert 1 / len(lw) - 1e-12 <= e <= 1 + 1e-12
    assert float(trajectory_ess(x + shift)) == pytest.approx(e, rel=1e-9, abs=1e-12)


def _ess_loop(old, rollout, pm, seq_min_rows):
    """Slow reference: per row the sum of delta over its policy tokens, then (sum w)^2 / (R sum w^2) in float64."""
    sums = []
    for b in range(pm.shape[0]):
        s, n = 0.0, 0
        for t in range(pm.shape[1]):
            if pm[b, t]:
                s += float(old[b, t]) - float(rollout[b, t])
                n += 1
        if n:
            sums.append(s)
    if len(sums) < seq_min_rows:
        return math.nan
    m = max(sums)
    w = [math.exp(s - m) for s in sums]
    return sum(w) ** 2 / (len(w) * sum(x * x for x in w))


@pytest.mark.parametrize("seed", range(6))
def test_batch_check_values_trajectory_ess_matches_a_loop_on_ragged_masks(seed):
    g = torch.Generator().manual_seed(seed)
    B, L = int(torch.randint(1, 24, (1,), generator=g)), int(torch.randint(2, 50, (1,), generator=g))
    old = -torch.rand(B, L, generator=g, dtype=torch.float64) * 3 - 0.01
    # log-probs stay below 0 (a positive one is a placeholder the checks leave out)
    rollout = (old - torch.randn(B, L, generator=g, dtype=torch.float64) * 0.4).clamp(max=-1e-3)
    pm = torch.rand(B, L, generator=g) < torch.rand(B, 1, generator=g)  # ragged: each row its own density
    got = float(batch_check_values(old, rollout, pm, CHECK_PARAMS)["mismatch/trajectory_ess"])
    want = _ess_loop(old, rollout, pm, CHECK_PARAMS.seq_min_rows)
    if math.isnan(want):
        assert math.isnan(got)
    else:
        assert got == pytest.approx(want, rel=1e-9)


def test_no_mismatch_keeps_every_trajectory():
    old = -torch.rand(12, 30, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    pm = torch.ones(12, 30, dtype=torch.bool)
    assert float(batch_check_values(old, old.clone(), pm, CHECK_PARAMS)["mismatch/trajectory_ess"]) == 1.0


# --------------------------------------------------------------------------------------------------------------
# the rule


def _summary(points: dict[tuple[str, str, str], list[float]], fp32: dict[str, list[float]]) -> pd.DataFrame:
    rows = [{"world": w, "arm": a, "dose": d, "seed": s, "rollback": r, "final": 0.5}
            for (w, a, d), rb in points.items() for s, r in enumerate(rb)]
    rows += [{"world": w, "arm": "fp32", "dose": "fp32", "seed": s, "rollback": r, "final": 0.5}
             for w, rb in fp32.items() for s, r in enumerate(rb)]
    return pd.DataFrame(rows)


def _gate(values: dict[tuple[str, str, str], tuple[float, float, float]]) -> pd.DataFrame:
    return pd.DataFrame([{"world": w, "arm": a, "dose": d, "policy_tokens": 300.0 if w == "thoughts40" else 200.0,
                          "total": t, "per_token": k, "ess": e} for (w, a, d), (t, k, e) in values.items()])


ROLLS, STABLE, MIXED = [0.2, 0.2, 0.2, 0.0], [0.0, 0.0, 0.0, 0.2], [0.2, 0.2, 0.0, 0.0]


def test_the_map_classes_points_by_seeds_beyond_the_worlds_band():
    s = _summary({("thoughts40", "naive", "mxfp4"): ROLLS, ("thoughts40", "qat", "mxfp4"): STABLE,
                  ("thoughts40", "qat", "nvfp4"): MIXED}, {"thoughts40": [0.01, 0.02, 0.0, 0.1]})
    g = _gate({("thoughts40", "naive", "mxfp4"): (13.0, 0.02, 0.01), ("thoughts40", "qat", "mxfp4"): (2.0, 0.003, 0.5),
               ("thoughts40", "qat", "nvfp4"): (1.5, 0.002, 0.6)})
    m = transfer_map(s, g).set_index(["arm", "dose"])
    assert m.loc[("naive", "mxfp4"), "class"] == "rolls back" and m.loc[("naive", "mxfp4"), "rolled_back"] == 3
    assert m.loc[("qat", "mxfp4"), "class"] == "stable"
    assert m.loc[("qat", "nvfp4"), "class"] == "mixed"
    assert m["band"].iloc[0] == pytest.approx(0.1)  # the largest fp32 rollback, above 0.03
    # a 0.1 rollback is not beyond a band of 0.1: the band is exceeded strictly
    s2 = _summary({("thoughts40", "naive", "mxfp4"): [0.1] * 4}, {"thoughts40": [0.1] * 4})
    assert transfer_map(s2, g)["class"].iloc[0] == "stable"


def _cal(values, classes):
    tmap = pd.DataFrame([{"world": w, "arm": "naive", "dose": d, "total": t, "per_token": k, "ess": e, "class": c}
                         for ((w, d), (t, k, e)), c in zip(values.items(), classes, strict=True)])
    return unit_calibration(tmap, ["thoughts40", "thoughts24"]).set_index("unit")


def test_a_unit_separates_when_one_threshold_splits_both_worlds():
    # total: stable 2.0 (40) and 5.0 (24) vs rolling 8.0 (40) and 4.0 (24): 5.0 > 4.0 overlaps
    # per_token: stable 0.003, 0.004 vs rolling 0.01, 0.02: separates, margin log(0.01 / 0.004)
    # ess: stable 0.6, 0.5 vs rolling 0.1, 0.3 (lower is worse): separates, margin log(0.5 / 0.3)
    values = {("thoughts40", "a"): (2.0, 0.003, 0.6), ("thoughts40", "b"): (8.0, 0.01, 0.1),
              ("thoughts24", "a"): (5.0, 0.004, 0.5), ("thoughts24", "b"): (4.0, 0.02, 0.3)}
    cal = _cal(values, ["stable", "rolls back", "stable", "rolls back"])
    assert not cal.loc["total", "separates"] and cal.loc["total", "bracketed"]
    assert cal.loc["per_token", "separates"] and cal.loc["ess", "separates"]
    assert cal.loc["per_token", "margin"] == pytest.approx(math.log(0.01 / 0.004))
    assert cal.loc["ess", "margin"] == pytest.approx(math.log(0.5 / 0.3))
    assert cal.loc["per_token", "picked"] and not cal.loc["ess", "picked"]  # the larger margin
    assert cal.loc["per_token", "stable_worst[pooled]"] == 0.004
    assert cal.loc["per_token", "rolls_best[pooled]"] == 0.01
    assert cal.loc["ess", "stable_worst[pooled]"] == 0.5 and cal.loc["ess", "rolls_best[pooled]"] == 0.3
    assert transfer_verdict(cal.reset_index()) is Verdict.HOLDS


def test_no_unit_separating_fails_and_an_unbracketed_world_is_not_resolved():
    values = {("thoughts40", "a"): (9.0, 0.03, 0.05), ("thoughts40", "b"): (8.0, 0.01, 0.1),
              ("thoughts24", "a"): (5.0, 0.004, 0.5), ("thoughts24", "b"): (6.0, 0.005, 0.4)}
    cal = _cal(values, ["stable", "rolls back", "stable", "rolls back"])
    assert not cal["separates"].any() and not cal["picked"].any()
    assert transfer_verdict(cal.reset_index()) is Verdict.FAILS
    # the 24-thought world never rolls back: its onset is not bracketed, whatever the other world shows
    cal = _cal(values, ["stable", "rolls back", "stable", "stable"])
    assert not cal["bracketed"].any() and not cal["separates"].any()
    assert transfer_verdict(cal.reset_index()) is Verdict.NOT_JUDGED
    # mixed points constrain nothing
    cal = _cal(values, ["mixed", "rolls back", "stable", "mixed"])
    assert not cal["bracketed"].any()
    assert transfer_verdict(None) is Verdict.NOT_JUDGED


def test_every_unit_is_a_value_the_checks_share():
    keys = batch_check_values(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), CHECK_PARAMS)
    assert {k for _, k, _ in UNITS.values()} <= set(keys)


# --------------------------------------------------------------------------------------------------------------
# config and cells


def test_points_and_fields_are_checked_naming_the_field():
    assert parse_point("qat@mxfp4") == ("qat", "mxfp4")
    for bad in ("qat", "fp32@fp8", "naive@fp16"):
        with pytest.raises(ConfigError, match="transfer_points"):
            parse_point(bad)
    cfg = MismatchConfig.transfer()
    cfg.validate()
    assert cfg.grpo.clip_ratio_c == 3.0 and cfg.eval_on == "engine" and cfg.experiments == ("transfer",)
    with pytest.raises(ConfigError, match="transfer_worlds"):
        replace(cfg, transfer_worlds=("thoughts99",)).validate()
    with pytest.raises(ConfigError, match="transfer_points"):
        replace(cfg, transfer_points=("naive@fp8", "naive@fp8")).validate()
    # 2 worlds x (gate + 4 seeds)
    assert len(EXPERIMENT.cells(cfg)) == 10


def test_the_cells_run_end_to_end_on_the_shipped_world(tmp_path):
    cfg = replace(MismatchConfig.quick(), grpo=replace(MismatchConfig.quick().grpo, updates=1, tasks_per_update=2,
                                                       group_size=2, eval_tasks=4, eval_every=1))
    gate = transfer_gate_cell(cfg.identity(), "thoughts24", ["naive@nvfp4", "qat@nvfp4"], 8, str(tmp_path))
    by = {(r["arm"], r["dose"]): r for r in gate}
    assert set(by) == {("fp32", "fp32"), ("naive", "nvfp4"), ("qat", "nvfp4")}
    fp = by[("fp32", "fp32")]
    assert fp["per_token"] < 1e-9 and fp["ess"] == pytest.approx(1.0, abs=1e-6)
    assert by[("naive", "nvfp4")]["per_token"] > by[("qat", "nvfp4")]["per_token"] > 0
    assert all(r["policy_tokens"] > 100 for r in gate)  # 24 thoughts per action
    rows = transfer_stack_cell(cfg.identity(), "thoughts24", ["naive@nvfp4"], 0, str(tmp_path))
    df = pd.DataFrame(rows)
    assert set(zip(df["arm"], df["dose"], strict=True)) == {("fp32", "fp32"), ("naive", "nvfp4")}
    assert {"eval/success", "eval_fp32/success"} <= set(df.columns)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
    tabs = EXPERIMENT.tables({"transfer_gate": pd.DataFrame(gate), "transfer": df}, cfg)
    assert {"transfer_gate", "transfer_summary", "transfer_map", "transfer_units"} <= set(tabs)
    assert np.isfinite(tabs["transfer_map"].frame["total"]).all()
