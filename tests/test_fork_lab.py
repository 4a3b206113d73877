"""Bag-of-units world (exact verdicts) and the fork lab (deterministic, resumable, writes its outputs)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from creditlab.envs.bagofunits import BagOfUnits, Prompts
from creditlab.errors import ConfigError
from creditlab.lab.protocol import run_lab
from creditlab.labs.fork import LAB, ForkLabConfig, oracle_thresholds, run_fork_cell


def _prompts():
    # One prompt, three facts (slot 3 absent): known, known, a 0-confidence guess.
    return Prompts(fact_mask=torch.tensor([[True, True, True, False]]),
                   points=torch.tensor([[2.0, 1.0, 1.0, 0.0]]),
                   confidence=torch.tensor([[1.0, 1.0, 0.0, 0.0]]))


def test_world_steps_and_exact_verdicts():
    env = BagOfUnits(f_min=1, f_max=4, max_units=6)
    p = _prompts()
    resp = env.reset(p)
    gen = torch.Generator().manual_seed(0)
    # fact 0, fact 0 again (paraphrase), fact 2 (a wrong guess), filler, fact 1, stop.
    for t, a in enumerate([0, 0, 2, env.FILLER, 1, env.STOP]):
        env.step(p, resp, t, torch.tensor([a]), gen)
    assert resp.unit_mask[0].tolist() == [True] * 5 + [False]
    assert resp.correct[0, :5].tolist() == [True, True, False, True, True]
    assert bool(resp.done[0]) and resp.counts[0].tolist() == [2.0, 1.0, 1.0, 0.0]
    match, cov = env.verdicts(p, resp)
    assert cov[0].tolist() == [True, True, False, False]
    assert match[0, 0, :5].tolist() == [True, True, False, False, False]
    parts = env.anatomy(p, resp)
    assert {k: float(v[0]) for k, v in parts.items()} == {"length": 5.0, "necessary": 2.0, "redundant": 1.0,
                                                          "wrong": 1.0, "filler": 1.0, "sweep": 0.0}
    # Recall (2 + 1) / 4; with tau 0.75 only the unit on fact 1 is necessary: P = 1/5.
    s = env.score(p, resp, "fork", tau=0.75)
    assert s.recall.item() == pytest.approx(0.75) and s.precision.item() == pytest.approx(0.2)
    assert env.score(p, resp, "recall").reward.item() == pytest.approx(0.75)
    # Steps after stop change nothing.
    env.step(p, resp, 5, torch.tensor([0]), gen)
    assert resp.unit_mask[0].sum() == 5


def test_prompts_are_ragged_and_bounded():
    env = BagOfUnits(f_min=2, f_max=5, known_prob=0.3)
    p = env.sample_prompts(500, torch.Generator().manual_seed(1))
    n = p.fact_mask.sum(1)
    assert int(n.min()) == 2 and int(n.max()) == 5
    assert bool((p.points[~p.fact_mask] == 0).all()) and bool((p.confidence <= 1).all())
    assert 0.2 < float((p.confidence[p.fact_mask] == 1).float().mean()) < 0.4


def test_oracle_orders_the_rewards():
    # What each reward asks for, without learning noise: recall states everything, FORK is pickier
    # than recall-only and less picky than the arithmetic mean.
    t = oracle_thresholds(ForkLabConfig(arms=("recall", "mean", "fork")), n_prompts=1024).set_index("arm")
    assert t.loc["recall", "best theta"] == 0.0
    assert t.loc["recall", "best theta"] < t.loc["fork", "best theta"] < t.loc["mean", "best theta"]
    assert t.loc["mean", "recall"] < t.loc["fork", "recall"] < t.loc["recall", "recall"]
    assert t.loc["recall", "precision"] < t.loc["fork", "precision"] < t.loc["mean", "precision"]


def test_lab_is_deterministic_resumable_and_writes_outputs(tmp_path):
    cfg = ForkLabConfig(arms=("recall", "mean", "fork"), seeds=2, updates=6, prompts_per_update=4, group_size=4,
                        eval_every=3, eval_prompts=16, max_units=8, experiments=("train", "oracle"))
    a = run_lab(LAB, cfg, tmp_path / "a", progress=False).tables
    for name in ("fork_curves.parquet", "fork_final.md", "fork_paired.md", "fork_oracle.md", "fork_curves.png",
                 "fork_anatomy.png", "report.md"):
        assert (tmp_path / "a" / name).exists(), name
    curves = a["fork_curves"].frame
    assert set(curves["arm"]) == {"recall", "mean", "fork"} and sorted(set(curves["update"])) == [0, 3, 6]
    # Same seed, same initial policy and evaluation batch in every arm.
    first = curves[curves["update"] == 0].groupby("seed")["length"].nunique()
    assert (first == 1).all()
    # Deterministic: the same cell computed again gives the same rows.
    again = pd.DataFrame(run_fork_cell("fork", 1, cfg.identity()))
    stored = curves[(curves["arm"] == "fork") & (curves["seed"] == 1)].reset_index(drop=True)
    pd.testing.assert_frame_equal(stored[again.columns], again, check_dtype=False)
    # Resume: a cell file removed is recomputed, the others are read back; same numbers.
    cells = sorted((tmp_path / "a" / "store" / "cells").glob("*.parquet"))
    mtimes = {c: c.stat().st_mtime_ns for c in cells}
    cells[0].unlink()
    c = run_lab(LAB, cfg, tmp_path / "a", progress=False)
    assert c.computed == 1
    pd.testing.assert_frame_equal(curves, c.tables["fork_curves"].frame)
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items() if p != cells[0])


def test_config_errors():
    with pytest.raises(ConfigError, match="arms"):
        ForkLabConfig(arms=("recall", "precision")).validate()
    with pytest.raises(ConfigError, match="group_size"):
        ForkLabConfig(group_size=1).validate()
    with pytest.raises(ConfigError, match="f_min"):
        ForkLabConfig(f_min=4, f_max=3).validate()


def test_strict_judge_matches_only_the_first_statement():
    p = _prompts()
    for lenient, want in ((True, [True, True, False]), (False, [True, False, False])):
        env = BagOfUnits(f_min=1, f_max=4, max_units=4, lenient=lenient)
        resp = env.reset(p)
        gen = torch.Generator().manual_seed(0)
        for t, a in enumerate([0, 0, env.FILLER]):  # fact 0 (known: always right) twice, then filler
            env.step(p, resp, t, torch.tensor([a]), gen)
        match, coverage = env.verdicts(p, resp)
        assert match[0, 0, :3].tolist() == want and bool(coverage[0, 0])
        assert env.anatomy(p, resp)["redundant"].item() == 1.0  # the truth does not depend on the judge


def test_reward_arms_and_f_beta_names():
    from creditlab.train.bagofunits import reward_of

    assert reward_of("fork", 1.0) == ("fork", 1.0) and reward_of("f1.5", 1.0) == ("fork", 1.5)
    assert reward_of("recall", 2.0) == ("recall", 1.0)
    with pytest.raises(ConfigError, match="f<beta>"):
        reward_of("precision", 1.0)


def test_map_and_deletion_experiments(tmp_path):
    cfg = ForkLabConfig(arms=("recall", "fork"), seeds=2, updates=4, prompts_per_update=4, group_size=4, eval_every=2,
                        eval_prompts=16, max_units=8, experiments=("map", "deletion"), map_known=(0.5, 1.0),
                        map_arms=("recall", "fork"), map_seeds=1, map_updates=3)
    res = run_lab(LAB, cfg, tmp_path, progress=False)
    m = res.tables["fork_map"].frame
    assert len(m) == 2 * 2 * 2 and set(m["arm"]) == {"recall", "fork"}
    rec = m[m["arm"] == "recall"]
    assert (rec["length_ratio"] == 1.0).all() and (rec["rel_recall"] == 0.0).all()
    d = res.tables["fork_deletion"].frame.set_index("predictor")["mean"]
    assert d["truth"] >= d["direct guess"] - 1e-9  # the truth deletes every unnecessary unit first
    curve = res.tables["fork_deletion_curve"].frame
    assert curve.groupby("predictor")["recall"].apply(lambda r: r.is_monotonic_decreasing).all()
    for png in ("fork_map.png", "fork_deletion.png"):
        assert (tmp_path / png).stat().st_size > 5000
