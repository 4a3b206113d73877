"""The fork lab in the FORK paper's regime: the noisy judge, true quality and the win rate, pitfalls."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from creditlab.envs.bagofunits import BagOfUnits, Prompts, flip_verdicts
from creditlab.errors import ConfigError
from creditlab.lab.protocol import run_lab
from creditlab.lab.store import ResultStore
from creditlab.labs.fork import LAB, ForkLabConfig, chosen_flips, noise_calibration, run_noise_cell
from creditlab.train.bagofunits import BagTrainConfig, new_policy, pearson, rollout, train_bag, win_rate


def _prompts():
    # One prompt, three facts (slot 3 absent): known (2 points), known (1), a 0-confidence guess (1).
    return Prompts(fact_mask=torch.tensor([[True, True, True, False]]),
                   points=torch.tensor([[2.0, 1.0, 1.0, 0.0]]),
                   confidence=torch.tensor([[1.0, 1.0, 0.0, 0.0]]))


def _respond(env, prompts, actions):
    resp = env.reset(prompts)
    gen = torch.Generator().manual_seed(0)
    for t, a in enumerate(actions):
        env.step(prompts, resp, t, torch.tensor([a]), gen)
    return resp


def _flip_loop(verdicts, mask, uniforms, rate):
    out = verdicts.clone()
    flat_v, flat_m, flat_u, flat_o = verdicts.flatten(), mask.flatten(), uniforms.flatten(), out.view(-1)
    for i in range(flat_v.numel()):
        if bool(flat_m[i]) and float(flat_u[i]) < rate:
            flat_o[i] = not bool(flat_v[i])
    return out


@settings(max_examples=60, deadline=None)
@given(shape=st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(1, 6)), rate=st.floats(0.0, 1.0),
       seed=st.integers(0, 2**31 - 1))
def test_flip_verdicts_matches_the_loop_and_is_an_involution(shape, rate, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.rand(shape, generator=g) < 0.4
    m = torch.rand(shape, generator=g) < 0.7
    u = torch.rand(shape, generator=g)
    got = flip_verdicts(v, m, u, rate)
    assert torch.equal(got, _flip_loop(v, m, u, rate))
    assert torch.equal(got[~m], v[~m])  # padding is never flipped
    assert torch.equal(flip_verdicts(got, m, u, rate), v)  # the same draws flip back
    assert torch.equal(flip_verdicts(v, m, u, 0.0), v)


def test_flip_verdicts_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="shapes differ"):
        flip_verdicts(torch.zeros(2, 3, dtype=torch.bool), torch.ones(2, 3, dtype=torch.bool), torch.rand(3, 2), 0.1)


def test_noisy_judge_flips_every_real_verdict_at_rate_one_and_none_at_zero():
    env = BagOfUnits(f_min=1, f_max=4, max_units=6)
    p = _prompts()
    resp = _respond(env, p, [0, 2, env.FILLER, env.STOP])
    exact = env.rubric(p, resp)
    noisy = env.noisy_rubric(exact, resp.unit_mask, 1.0, torch.Generator().manual_seed(1))
    real_pairs = exact.rubric_mask[:, :, None] & resp.unit_mask[:, None, :]
    assert torch.equal(noisy.match[real_pairs], ~exact.match[real_pairs])
    assert torch.equal(noisy.match[~real_pairs], exact.match[~real_pairs])
    assert torch.equal(noisy.coverage[exact.rubric_mask], ~exact.coverage[exact.rubric_mask])
    assert torch.equal(noisy.correct[resp.unit_mask], ~exact.correct[resp.unit_mask])
    a = env.score(p, resp, "fork", flip=0.0)
    b = env.score(p, resp, "fork")
    assert torch.equal(a.reward, b.reward)
    with pytest.raises(ValueError, match="generator"):
        env.score(p, resp, "fork", flip=0.1)


def test_pitfall_world_sweep_buys_recall_is_incorrect_and_violates_the_absence_rubric():
    env = BagOfUnits(f_min=1, f_max=4, max_units=6, pitfalls=True, pitfall_points=1.0)
    p = _prompts()
    assert env.n_actions == 4 + 2 + 4
    assert env.action_mask(p)[0].tolist() == [True, True, True, False, True, True, True, True, True, False]
    resp = _respond(env, p, [0, env.SWEEP + 2, env.STOP])  # fact 0 (known), sweep on the 0-confidence fact 2
    assert resp.sweep[0, :2].tolist() == [False, True] and resp.correct[0, :2].tolist() == [True, False]
    assert resp.counts[0].tolist() == [1.0, 0.0, 1.0, 0.0]
    r = env.rubric(p, resp)
    assert r.weights[0].tolist() == [2.0, 1.0, 1.0, 0.0, -1.0] and r.rubric_mask[0, 4]
    assert r.coverage[0].tolist() == [True, False, True, False, True]  # the pitfall is present
    # Recall (2 + 1 - 1) / 4; both units have credit 1 (necessary), the sweep is incorrect: P = 1/2.
    s = env.score(p, resp, "fork")
    assert s.recall.item() == pytest.approx(0.5) and s.precision.item() == pytest.approx(0.5)
    assert s.reward.item() == pytest.approx(0.5)
    assert s.metrics["reward/fork/absence_satisfaction"] == 0.0
    # Left out of the reward's rubric (0 points): recall 3/4, the world still knows the pitfall.
    env0 = BagOfUnits(f_min=1, f_max=4, max_units=6, pitfalls=True, pitfall_points=0.0)
    assert env0.score(p, resp, "recall").reward.item() == pytest.approx(0.75)
    assert not bool(env0.absence(resp)[0])
    # True quality: 2 points (fact 0 stated correctly; the sweep does not count) - 1 wrong unit - 2 pitfall.
    assert env.quality(p, resp).item() == pytest.approx(-1.0)
    assert env.quality(p, resp, wrong_cost=0.5, pitfall_cost=0.0).item() == pytest.approx(1.5)
    assert env.anatomy(p, resp)["sweep"].item() == 1.0 and env.anatomy(p, resp)["wrong"].item() == 1.0
    with pytest.raises(ConfigError, match="pitfall_points"):
        BagOfUnits(pitfalls=True, pitfall_points=-1.0)


def test_quality_counts_correct_facts_and_charges_wrong_units_only():
    env = BagOfUnits(f_min=1, f_max=4, max_units=6)
    p = _prompts()
    # fact 0, fact 0 again (redundant), fact 2 (0-confidence: wrong), filler, fact 1: 2 + 1 - 1 wrong.
    resp = _respond(env, p, [0, 0, 2, env.FILLER, 1, env.STOP])
    assert env.quality(p, resp).item() == pytest.approx(2.0)
    assert bool(env.absence(resp)[0])  # no pitfall without the pitfall world
    padded = _respond(env, p, [0, env.FILLER, env.FILLER, env.FILLER, 0, env.STOP])
    assert env.quality(p, padded).item() == pytest.approx(2.0)  # padding earns and costs nothing


def test_win_rate_and_pearson_golden():
    assert win_rate(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([1.0, 1.0, 5.0])).tolist() == [1.0, 0.5, 0.0]
    x, y = torch.tensor([1.0, 2.0, 3.0, 5.0]), torch.tensor([2.0, 1.0, 4.0, 6.0])
    assert pearson(x, y) == pytest.approx(float(np.corrcoef(x.numpy(), y.numpy())[0, 1]), abs=1e-12)
    assert np.isnan(pearson(torch.ones(3), x[:3]))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(-5, 5), st.integers(-5, 5)), min_size=1, max_size=30))
def test_win_rate_is_antisymmetric(pairs):
    a = torch.tensor([float(x) for x, _ in pairs])
    b = torch.tensor([float(y) for _, y in pairs])
    assert torch.equal(win_rate(a, b) + win_rate(b, a), torch.ones(len(pairs)))


def test_sweep_head_leaves_the_other_weights_and_the_plain_world_unchanged():
    plain, with_sweeps = new_policy(16, 3), new_policy(16, 3, sweeps=True)
    for name, w in plain.state_dict().items():
        assert torch.equal(w, with_sweeps.state_dict()[name]), name
    assert with_sweeps.sweep is not None and plain.sweep is None
    env = BagOfUnits(f_min=2, f_max=4, max_units=8, pitfalls=True)
    prompts = env.sample_prompts(256, torch.Generator().manual_seed(0))
    with torch.no_grad():
        resp, _ = rollout(env, with_sweeps, prompts, torch.Generator().manual_seed(1))
    sweeps = float((resp.sweep & resp.unit_mask).float().sum() / resp.unit_mask.sum())
    # The prior of -3 makes sweeps rare but present in the initial policy.
    assert 0.005 < sweeps < 0.2
    assert not bool((resp.sweep & resp.correct).any())


def test_noisy_training_draws_its_noise_from_its_own_stream():
    cfg = BagTrainConfig(updates=4, prompts_per_update=4, group_size=4, eval_every=4, eval_prompts=32, max_units=8)
    exact = pd.DataFrame(train_bag("fork", 0, cfg))
    noisy = pd.DataFrame(train_bag("fork", 0, replace(cfg, judge_flip=0.2)))
    # The same initial policy and evaluation samples; training moved the policy differently.
    pd.testing.assert_series_equal(exact.iloc[0], noisy.iloc[0])
    assert not exact.iloc[-1].equals(noisy.iloc[-1])
    ext = pd.DataFrame(train_bag("fork", 0, replace(cfg, judge_flip=0.2), extended=True))
    for k in ("length", "recall", "precision", "f1"):  # the extended evaluation draws the same samples
        assert ext[k].tolist() == pytest.approx(noisy[k].tolist(), abs=1e-7)
    assert {"quality", "win_rate", "absence", "sweep", "judge_r"} <= set(ext.columns)
    assert 0.0 <= ext["win_rate"].min() and ext["win_rate"].max() <= 1.0 and ext["judge_r"].between(-1, 1).all()


def test_calibration_r_falls_with_the_flip_rate_and_the_gate_names_failures():
    cfg = ForkLabConfig(noise_seeds=2, noise_calib_prompts=512, noise_flips=(0.0, 0.05, 0.1, 0.2, 0.3))
    c = noise_calibration(cfg)
    assert c["r"].iloc[0] == pytest.approx(1.0) and c["responses"].iloc[0] == 1024
    assert c["r"].is_monotonic_decreasing and c["r"].iloc[-1] < 0.6
    g = chosen_flips(c, (1.0, 0.7, 0.01)).set_index("target_r")
    assert g.loc[1.0, "flip"] == 0.0 and g.loc[1.0, "gate"] == "pass"
    assert g.loc[0.7, "gap"] == pytest.approx((c["r"] - 0.7).abs().min())
    assert g.loc[0.01, "flip"] == 0.3 and g.loc[0.01, "gate"] == "FAIL"  # out of the grid's reach


def _tiny(**kw):
    base = dict(arms=("recall", "fork"), seeds=1, updates=3, prompts_per_update=4, group_size=4, eval_every=3,
                eval_prompts=16, max_units=8, noise_targets=(1.0, 0.7), noise_flips=(0.0, 0.05, 0.1, 0.15, 0.2),
                noise_calib_prompts=128, noise_arms=("recall", "fork"), noise_seeds=2, noise_updates=3,
                pitfall_arms=("recall", "fork"), pitfall_seeds=2, pitfall_updates=4)
    return ForkLabConfig(**{**base, **kw})


def test_regime_experiments_write_their_tables_and_plots(tmp_path):
    cfg = _tiny(experiments=("noise", "winrate", "pitfalls"))
    cells = LAB.cells(cfg)
    noise = [c for c in cells if c.group == "noise"]
    assert len(noise) == 2 * 2 * 2 and len({c.key for c in cells}) == len(cells)  # winrate shares the r = 1 cells
    assert all("flip=" in c.key for c in noise)
    res = run_lab(LAB, cfg, tmp_path, progress=False)
    t = res.tables
    for name in ("fork_noise_calibration", "fork_noise_gate", "fork_noise", "fork_noise_paired", "fork_winrate",
                 "fork_winrate_paired", "fork_pitfalls", "fork_pitfalls_paired"):
        assert name in t, name
        assert (tmp_path / f"{name}.md").exists()
    gate = t["fork_noise_gate"].frame
    flips = dict(zip(gate["target_r"], gate["flip"], strict=True))
    assert set(t["fork_noise"].frame["flip"]) == set(flips.values()) and flips[1.0] == 0.0
    w = t["fork_winrate"].frame
    assert list(w["arm"]) == ["initial policy", "recall", "fork"] and w["win_rate"].between(0, 1).all()
    pit = t["fork_pitfalls"].frame
    assert set(pit["pitfall_points"]) == {1.0, 0.0}
    assert (pit[pit["arm"] == "initial policy"]["absence_change"] == 0).all()
    for png in ("fork_noise.png", "fork_winrate.png", "fork_pitfalls.png"):
        assert (tmp_path / png).stat().st_size > 5000
    # Deterministic: a stored noise cell (a noisy judge) computed again gives the same rows.
    c = next(c for c in noise if c.kwargs["flip"] > 0)
    again = pd.DataFrame(run_noise_cell(**c.kwargs))
    stored = ResultStore(tmp_path / "store").frame({c.key}).drop(columns=["cell_key"])
    assert len(again) == 2
    pd.testing.assert_frame_equal(stored[again.columns].reset_index(drop=True), again, check_dtype=False)


def test_winrate_alone_runs_only_the_exact_judge_cells(tmp_path):
    cfg = _tiny(experiments=("winrate",))
    cells = LAB.cells(cfg)
    assert {c.group for c in cells} == {"noise"} and all(c.kwargs["flip"] == 0.0 for c in cells)


def test_regime_config_errors():
    with pytest.raises(ConfigError, match="judge_flip"):
        ForkLabConfig(judge_flip=0.6).validate()
    with pytest.raises(ConfigError, match="noise_flips"):
        ForkLabConfig(noise_flips=(0.1, 0.2)).validate()
    with pytest.raises(ConfigError, match="noise_targets"):
        ForkLabConfig(noise_targets=(1.2,)).validate()
    with pytest.raises(ConfigError, match="noise_arms"):
        ForkLabConfig(noise_arms=("recall", "mean")).validate()
    with pytest.raises(ConfigError, match="pitfall_weights"):
        ForkLabConfig(pitfall_weights=(-1.0,)).validate()
    with pytest.raises(ConfigError, match="quality_wrong"):
        ForkLabConfig(quality_wrong=float("nan")).validate()
    with pytest.raises(ConfigError, match="noise_seeds"):
        ForkLabConfig(noise_seeds=0).validate()
