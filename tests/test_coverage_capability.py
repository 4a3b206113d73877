"""The capability points of the coverage lab, and the reward-to-go identity behind "reward-to-go =
full coverage".

* reward-to-go over a terminal-only reward is uniform credit, exactly (random shapes, ragged masks
  with gaps and empty rows, junk at masked steps, a hypothesis property), and the chain trainer's
  ``reward_to_go`` arm is fed the visible progress instead, a different input;
* ``exact_completion`` against hand-computed numbers and a loop;
* ``pretrain_to_completion`` against plain ``train_chain`` runs (the snapshot is the first update
  that crosses the target) and ``single_update_from`` against ``single_update``;
* the gate and equivalence tables against hand-computed frames, and the experiment end to end.
"""

import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from creditlab.core import credit as cr
from creditlab.core.advantages import grpo_advantages
from creditlab.envs.chain import chain_outcome, exact_completion, make_tasks, observe
from creditlab.errors import ConfigError
from creditlab.lab.protocol import run_lab
from creditlab.labs.coverage import LAB, CoverageConfig, capability_gate, capability_test
from creditlab.train.chain import (
    ChainTrainConfig,
    ModelSpec,
    _exposed_steps,
    chain_step_batch,
    pretrain_to_completion,
    single_update,
    single_update_from,
    train_chain,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------------
# reward-to-go over a terminal-only reward is uniform credit


def _terminal_batch(B, T, seed, dtype, p=0.6, junk=float("nan")):
    """Ragged mask (gaps, an empty row, a full row), outcome R_i on each row's last real step, 0 on
    its other real steps, ``junk`` on masked steps; random group labels (not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < p
    mask[0] = False
    if B > 1:
        mask[1] = True
    R = torch.rand(B, generator=g, dtype=torch.float64).to(dtype)
    idx = torch.arange(T).expand(B, T)
    last = torch.where(mask, idx, torch.full_like(idx, -1)).max(-1).values  # -1: no real step
    r = torch.zeros(B, T, dtype=dtype)
    has = last >= 0
    r[has, last[has]] = R[has]
    R = torch.where(has, R, torch.zeros_like(R))  # a row with no real step has no outcome: return 0
    r = torch.where(mask, r, torch.full_like(r, junk))
    gid = torch.randint(0, max(1, B // 2), (B,), generator=g) * 7 + 3
    return r, R, mask, gid


def _check_identity(r, R, mask, gid):
    A = grpo_advantages(R, gid)
    # the unnormalised reward-to-go is the GRPO broadcast, bit for bit
    assert torch.equal(cr.reward_to_go(r, gid, mask), cr.uniform(A, mask, conserve=False))
    # at equal budget it is conserved uniform credit, up to the rounding of sum_t |a| over T_i steps
    got, want = cr.reward_to_go(r, gid, mask, conserve=True), cr.uniform(A, mask, conserve=True)
    eps = torch.finfo(r.dtype).eps
    torch.testing.assert_close(got, want, rtol=(mask.shape[1] + 4) * eps, atol=0.0)
    # the registered geometry reads the same step rewards from a StepBatch
    batch = cr.StepBatch(mask, gid, advantages=A, step_scores=r)
    torch.testing.assert_close(cr.get_geometry("reward_to_go")(batch), want, rtol=(mask.shape[1] + 4) * eps, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(5))
def test_reward_to_go_over_a_terminal_reward_is_uniform(seed, dtype):
    B, T = 3 + 2 * seed, 2 + seed
    _check_identity(*_terminal_batch(B, T, seed, dtype))
    _check_identity(*_terminal_batch(B, T, seed, dtype, junk=123.0))  # masked junk never counts


def test_reward_to_go_golden_terminal_and_not():
    # two rollouts of one group, three steps, the second with a masked middle step
    mask = torch.tensor([[True, True, True], [True, False, True]])
    gid = torch.tensor([0, 0])
    terminal = torch.tensor([[0.0, 0.0, 1.0], [0.0, 9.0, 0.0]], dtype=torch.float64)
    # R = (1, 0) (the 9 is masked): mean 0.5, unbiased std sqrt(0.5) -> A = +-0.5 / (sqrt(0.5) + 1e-6)
    # on every real step
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    want = torch.tensor([[s, s, s], [-s, 0.0, -s]], dtype=torch.float64)
    torch.testing.assert_close(cr.reward_to_go(terminal, gid, mask), want)
    # progress credited where it happened (not terminal): the return shrinks along the row
    early = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    a = cr.reward_to_go(early, gid, mask)
    sd = math.sqrt(0.5) + 1e-6
    torch.testing.assert_close(a, torch.tensor([[0.5 / sd, -0.5 / sd, -0.5 / sd], [-0.5 / sd, 0.0, -0.5 / sd]],
                                               dtype=torch.float64))


@given(st.integers(1, 7), st.integers(1, 9), st.floats(0.1, 1.0), st.integers(0, 10_000))
def test_reward_to_go_terminal_identity_property(B, T, p, seed):
    _check_identity(*_terminal_batch(B, T, seed, torch.float64, p=p))


def test_the_chain_arm_is_fed_the_visible_progress_not_the_terminal_reward():
    T, K, G = 8, 2, 64
    spec = ModelSpec(seed=0, C=3, arm="reward_to_go", exposure="final")
    tasks = make_tasks(T, K, [3], [0])
    g = torch.Generator().manual_seed(1)
    actions = torch.randint(K, (1, G, T), generator=g)
    actions[0, :8] = tasks.correct  # some rollouts complete the chain
    reward, step_correct, progress = chain_outcome(tasks, actions)
    exposed = _exposed_steps(tasks, [spec])
    A = grpo_advantages(reward.reshape(-1), torch.zeros(G, dtype=torch.long))
    zeros = torch.zeros(1, G, T)
    batch, params = chain_step_batch("reward_to_go", torch.tensor([0]), G, A, reward=reward, progress=progress,
                                     step_correct=step_correct, exposed=exposed, first_k=exposed,
                                     k_col=torch.zeros(1, 1, 1, dtype=torch.long), shuffle_keys=zeros, step_keys=zeros)
    # at the final-write verifier the visible return is 1[chain complete], not the prefix reward
    assert torch.equal(batch.step_scores.sum(-1), (reward.reshape(-1) >= 1).float())
    assert not torch.equal(batch.step_scores.sum(-1), reward.reshape(-1))
    arm = cr.get_geometry("reward_to_go")(batch, **params)
    uni = cr.uniform(A, batch.step_mask)
    assert (arm - uni).abs().max() > 0.1  # the arm of the tables is not uniform credit
    # fed the terminal reward instead, the same geometry is uniform credit
    terminal = torch.zeros(G, T)
    terminal[:, -1] = reward.reshape(-1)
    rtg = cr.get_geometry("reward_to_go")(batch._replace(step_scores=terminal))
    torch.testing.assert_close(rtg, uni, rtol=(T + 4) * torch.finfo(torch.float32).eps, atol=0.0)


# --------------------------------------------------------------------------------------------
# exact completion, pre-training to a capability point, the update from given bases


def test_exact_completion_golden_and_padding():
    tasks = make_tasks(6, 2, [3, 1], [0, 0])
    p = torch.tensor([[0.9, 0.5, 0.8], [0.7, float("nan"), float("nan")]])
    torch.testing.assert_close(exact_completion(tasks, p), torch.tensor([0.36, 0.7]))


def _loop_completion(policy_row, tasks, m, T):
    """Reference: the product over causal steps of the probability of the correct action."""
    W1, b1, W2, b2 = (policy_row[k][m] for k in ("W1", "b1", "W2", "b2"))
    out = 1.0
    for j in range(int(tasks.C[m])):
        t = int(tasks.causal_pos[m, j])
        x = observe(T, torch.tensor(t))
        probs = torch.softmax(torch.tanh(x @ W1 + b1) @ W2 + b2, -1)
        out *= float(probs[int(tasks.correct[m, t])])
    return out


def test_pretraining_snapshots_the_first_update_that_crosses_the_target():
    cfg = ChainTrainConfig(T=6, K=3, hidden=8, group=4, lr=0.03)
    seeds, C, targets = [0, 1, 2], 3, (0.2, 0.6)
    pre = pretrain_to_completion(seeds, C, cfg, targets=targets, max_updates=400)
    assert pre["reached"].all()
    tasks = make_tasks(cfg.T, cfg.K, [C] * 3, seeds)
    for i, target in enumerate(targets):
        snap = pre["policies"][i].params()
        for m, sd in enumerate(seeds):
            u = int(pre["updates"][i, m])
            comp = _loop_completion(snap, tasks, m, cfg.T)
            assert comp == pytest.approx(float(pre["completion"][i, m]), rel=1e-5)
            assert comp >= target
            # the same run, stopped at u updates by plain train_chain: the same policy
            alone = train_chain([ModelSpec(seed=sd, C=C, arm="uniform")], replace(cfg, updates=u, eval_points=1))
            p = alone["policy"].params()
            for k in snap:
                torch.testing.assert_close(snap[k][m], p[k][0], rtol=1e-5, atol=1e-6)
            if u > 1:  # one update earlier it had not crossed yet
                before = train_chain([ModelSpec(seed=sd, C=C, arm="uniform")],
                                     replace(cfg, updates=u - 1, eval_points=1))["policy"].params()
                prev = _loop_completion({k: v for k, v in before.items()}, make_tasks(cfg.T, cfg.K, [C], [sd]), 0,
                                        cfg.T)
                assert prev < target
    assert (pre["updates"][1] >= pre["updates"][0]).all()  # 60% is reached no earlier than 20%


def test_a_target_not_reached_keeps_the_final_policy_and_is_marked():
    cfg = ChainTrainConfig(T=6, K=3, hidden=8, group=4)
    pre = pretrain_to_completion([0, 1], 4, cfg, targets=(1.0,), max_updates=2)
    assert not pre["reached"].any() and (pre["updates"] == -1).all()
    final = train_chain([ModelSpec(seed=s, C=4, arm="uniform") for s in (0, 1)], replace(cfg, updates=2))["policy"]
    for k, v in final.params().items():
        assert torch.equal(pre["policies"][0].params()[k], v)
    with pytest.raises(ConfigError, match="targets"):
        pretrain_to_completion([0], 4, cfg, targets=(0.0,), max_updates=2)
    with pytest.raises(ConfigError, match="max_updates"):
        pretrain_to_completion([0], 4, cfg, targets=(0.5,), max_updates=0)


def test_update_from_given_bases_is_single_update():
    cfg = ChainTrainConfig(T=6, K=3, hidden=8, group=4)
    specs = [ModelSpec(seed=s, C=C, arm=a, exposure="final") for C in (3, 4) for a in ("uniform", "per_turn", "binary")
             for s in range(3)]
    ref = single_update(specs, cfg, base_updates=6, step=2.0, clip=0.05, rollouts=16)
    keys = sorted({(s.seed, s.C) for s in specs})
    base = train_chain([ModelSpec(seed=sd, C=C, arm="uniform") for sd, C in keys],
                       replace(cfg, updates=6, eval_points=1))["policy"]
    got = single_update_from(base, keys, specs, cfg, step=2.0, clip=0.05, rollouts=16)
    for k in ("before", "after", "grad_norm", "binding"):
        assert torch.equal(got[k], ref[k]), k
    assert ((got["completion_after"] - got["completion_before"]).abs() > 0).any()
    with pytest.raises(ConfigError, match="base_keys"):
        single_update_from(base, keys[:-1], specs, cfg, step=2.0, clip=0.05)


# --------------------------------------------------------------------------------------------
# the gate and the equivalence test, by hand


def test_gate_table_golden():
    cfg = CoverageConfig(capability_gate_reached=0.75, capability_gate_overshoot=0.05)
    rows = [{"row": "gate", "C": 6, "target": 0.25, "seed": s, "reached": r, "completion": c, "score": 0.5,
             "pretrain_updates": u} for s, (r, c, u) in enumerate([(True, 0.26, 100), (True, 0.28, 140),
                                                                   (True, 0.27, 120), (False, 0.1, -1)])]
    rows += [{"row": "gate", "C": 6, "target": 0.7, "seed": s, "reached": True, "completion": 0.8, "score": 0.9,
              "pretrain_updates": 200} for s in range(4)]
    g = capability_gate(pd.DataFrame(rows), cfg)
    a = g[g["target"] == 0.25].iloc[0]
    assert a["reached"] == 3 and a["seeds"] == 4 and a["achieved"] == pytest.approx(0.27)
    assert (a["achieved_min"], a["achieved_max"], a["updates_mean"], a["updates_min"], a["updates_max"]) == (
        pytest.approx(0.26), pytest.approx(0.28), pytest.approx(120.0), 100, 140)
    assert a["gate"] == "pass"  # 3 of 4 >= 75%, overshoot 0.02 <= 0.05
    assert g[g["target"] == 0.7].iloc[0]["gate"] == "fail"  # overshoot 0.10 > 0.05
    assert capability_gate(pd.DataFrame(rows), replace(cfg, capability_gate_reached=0.9)).iloc[0]["gate"] == "fail"


def _arms(C, target, per_arm):
    return [{"C": C, "target": target, "seed": s, "arm": a, "improvement": v, "completion": target + 0.01}
            for a, vals in per_arm.items() for s, v in enumerate(vals)]


def test_equivalence_test_golden():
    cfg = CoverageConfig(capability_margin=0.25)
    base = np.array([0.010, 0.020, 0.030])
    # per_turn - shuffled = (1, 2, 3) x 1e-3: mean 2e-3, sd 1e-3, t(2) = 4.3027 -> half width 2.4842e-3
    # uniform - binary = 0.04 -> band +-0.01: the interval [-0.484e-3, 4.484e-3] lies inside
    # per_turn - uniform = -(4, 5, 6) x 1e-3: interval below 0
    a = _arms(6, 0.7, {"per_turn": base, "shuffled": base - [0.001, 0.002, 0.003],
                       "uniform": base + [0.004, 0.005, 0.006], "binary": base + [0.004, 0.005, 0.006] - 0.04})
    # at 25%: band from uniform - binary = 0.004 -> +-0.001, the same per_turn - shuffled: not inside;
    # per_turn - uniform = (-1, 0, +1) x 1e-3: contains 0
    a += _arms(6, 0.25, {"per_turn": base, "shuffled": base - [0.001, 0.002, 0.003],
                         "uniform": base + [0.001, 0.0, -0.001], "binary": base + [0.001, 0.0, -0.001] - 0.004})
    t = capability_test(pd.DataFrame(a), cfg).set_index("target")
    half = 4.302652729911275 * 1e-3 / math.sqrt(3)
    hi70 = t.loc[0.7]
    assert hi70["per_turn-shuffled"] == pytest.approx(0.002)
    assert (hi70["lo"], hi70["hi"]) == (pytest.approx(0.002 - half, rel=1e-6), pytest.approx(0.002 + half, rel=1e-6))
    assert hi70["uniform-binary"] == pytest.approx(0.04) and hi70["band"] == pytest.approx(0.01)
    assert hi70["equivalent"] and hi70["null"] and hi70["per_turn<uniform"] and hi70["holds"]
    lo25 = t.loc[0.25]
    assert lo25["band"] == pytest.approx(0.001) and not lo25["equivalent"]
    assert lo25["null"] and not lo25["per_turn<uniform"] and lo25["holds"]  # the prediction at 25% is the null
    # uniform no better than binary: an empty band, so the equivalence fails by definition
    flat = _arms(8, 0.7, {"per_turn": base, "shuffled": base, "uniform": base + 0.001, "binary": base + 0.002})
    r = capability_test(pd.DataFrame(flat), cfg).iloc[0]
    assert r["band"] < 0 and not r["equivalent"] and not r["holds"]


# --------------------------------------------------------------------------------------------
# the experiment end to end


TINY = CoverageConfig(train=ChainTrainConfig(T=6, K=3, hidden=8, group=4, updates=8, eval_points=2), seeds=2,
                      Cs=(1, 4), vd_C=4, shuffle_Cs=(4,), dose_C=2, dose_ks=(1, 6), experiments=("capability",),
                      capability_Cs=(3, 4), capability_seeds=5, capability_targets=(0.3, 0.6), capability_lr=0.03,
                      capability_max_updates=300, single_rollouts=8)


def test_capability_experiment_writes_gate_arms_test_and_plot(tmp_path):
    res = run_lab(LAB, TINY, tmp_path, progress=False)
    gate = res.tables["capability_gate"].frame
    assert len(gate) == 4 and set(gate["C"]) == {3, 4} and set(gate["target"]) == {0.3, 0.6}
    assert (gate["achieved"] >= gate["target"]).all()
    runs = pd.read_parquet(tmp_path / "capability_runs.parquet")
    g, a = runs[runs["row"] == "gate"], runs[runs["row"] == "arm"]
    assert len(g) == 2 * 2 * 5
    assert len(a) == 6 * int(g["reached"].sum())
    # every arm of a seed and point starts from the same base
    assert (a.groupby(["C", "target", "seed"])["before"].nunique() == 1).all()
    test = res.tables["capability_test"].frame
    assert len(test) == 4 and {"per_turn-shuffled", "band", "equivalent", "per_turn<uniform"} <= set(test.columns)
    assert (tmp_path / "capability.png").stat().st_size > 5000
    report = (tmp_path / "report.md").read_text()
    assert report.index("Capability points: gate") < report.index("Capability points: held-out improvement")
    assert "Equivalence test fixed in advance" in report


def test_a_point_no_seed_reaches_still_reports_its_gate(tmp_path):
    cfg = replace(TINY, capability_Cs=(4,), capability_targets=(0.99,), capability_max_updates=1)
    res = run_lab(LAB, cfg, tmp_path, progress=False)
    gate = res.tables["capability_gate"].frame.iloc[0]
    assert gate["reached"] == 0 and gate["gate"] == "fail"
    assert "capability_test" not in res.tables
    assert "not tested" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("field, value", [("capability_targets", (0.0,)), ("capability_targets", (0.5, 0.5)),
                                          ("capability_seeds", 1), ("capability_lr", 0.0),
                                          ("capability_margin", 0.0), ("capability_Cs", (13,))])
def test_bad_capability_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        replace(CoverageConfig(), **{field: value}).validate()


def test_other_experiments_do_not_see_the_new_one():
    # the new experiment adds cells; the cells (hence the stored numbers) of the others are unchanged
    old = replace(CoverageConfig.quick(), experiments=("single_update",))
    new = replace(CoverageConfig.quick(), experiments=("single_update", "capability"))
    keys_old = {c.key for c in LAB.cells(old)}
    keys_new = {c.key for c in LAB.cells(new)}
    assert keys_old < keys_new and {k.split("/")[0] for k in keys_new - keys_old} == {"capability"}


def _test_rows(*rows):
    """Rows of ``capability_test``: (C, target, lo, hi, pu_hi, band) each (the columns the verdicts read)."""
    return pd.DataFrame([{"C": C, "target": t, "lo": lo, "hi": hi, "pu_hi": pu_hi, "band": band,
                          "per_turn-shuffled": (lo + hi) / 2, "per_turn-uniform": pu_hi - 0.001, "pu_lo": pu_hi - 0.002}
                         for C, t, lo, hi, pu_hi, band in rows])


def test_each_capability_verdict_holds_fails_or_is_not_judged():
    from creditlab.labs.coverage.capability import capability_verdict, verdict_below, verdict_equivalent, verdict_null

    nan = float("nan")

    def one(lo, hi, pu_hi=0.5, band=0.02, target=0.25):
        return _test_rows((6, target, lo, hi, pu_hi, band))

    assert verdict_null(one(-0.01, 0.02)) == "holds" and verdict_null(one(0.001, 0.02)) == "fails"
    assert verdict_null(one(nan, nan)) == "not judged"  # one seed: no interval (it read as 'does not hold')
    assert verdict_null(_test_rows()) == "not judged"  # no point
    assert verdict_below(one(0, 0, pu_hi=-0.001)) == "holds" and verdict_below(one(0, 0, pu_hi=0.0)) == "fails"
    assert verdict_below(one(0, 0, pu_hi=nan)) == "not judged"
    assert verdict_equivalent(one(-0.01, 0.01)) == "holds" and verdict_equivalent(one(-0.03, 0.01)) == "fails"
    assert verdict_equivalent(one(-0.01, 0.01, band=-0.02)) == "fails"  # an empty band: uniform <= binary
    assert verdict_equivalent(one(-0.01, 0.01, band=nan)) == "not judged"
    # at every C: fails where one C fails, holds where every C holds
    both = _test_rows((6, 0.25, -0.01, 0.02, 0.5, 0.02), (8, 0.25, 0.001, 0.02, 0.5, 0.02))
    assert verdict_null(both) == "fails" and verdict_null(both.iloc[:1]) == "holds"
    assert verdict_null(_test_rows((6, 0.25, -0.01, 0.02, 0.5, 0.02), (8, 0.25, nan, nan, 0.5, 0.02))) == "not judged"
    # 25%: prediction 1; 70%: predictions 2 and 3 together; any other target predicts nothing
    assert capability_verdict(one(-0.01, 0.02, 0.5, 0.02)) == "holds"
    assert capability_verdict(one(-0.01, 0.01, -0.001, 0.02, 0.70)) == "holds"
    assert capability_verdict(one(-0.01, 0.01, 0.001, 0.02, 0.70)) == "fails"  # per_turn not below uniform
    assert capability_verdict(one(-0.03, 0.01, nan, 0.02, 0.70)) == "fails"  # outside the band decides it
    assert capability_verdict(one(-0.01, 0.01, nan, 0.02, 0.70)) == "not judged"
    assert capability_verdict(one(-0.01, 0.01, -0.001, 0.02, 0.5)) == "not judged"


def test_the_capability_predictions_are_judged_at_the_points_that_pass_their_gate():
    from creditlab.lab.experiment import predictions_table
    from creditlab.lab.protocol import Table
    from creditlab.labs.coverage.capability import CAPABILITY_STATED, EXPERIMENT

    test = _test_rows((6, 0.25, -0.01, 0.02, 0.5, 0.02), (8, 0.25, -0.02, 0.01, 0.5, 0.02),
                      (6, 0.70, -0.01, 0.01, -0.001, 0.02), (8, 0.70, -0.03, 0.01, -0.002, 0.02))

    def judged(failed=()):
        gate = pd.DataFrame([{"C": C, "target": t, "gate": "fail" if (C, t) in failed else "pass"}
                             for C in (6, 8) for t in (0.25, 0.70)])
        tabs = {"capability_test": Table(test, "t"), "capability_gate": Table(gate, "g")}
        return predictions_table([("capability", p) for p in EXPERIMENT.predictions], tabs)

    t = judged()
    assert list(t["prediction"].str.split(":").str[0]) == ["1", "2", "3"]
    assert list(t["verdict"]) == ["holds", "holds", "fails"]  # 3: C=8's interval reaches past the band
    assert t["measured"].iloc[0] == "C=6: +0.0050 [-0.0100, +0.0200]; C=8: -0.0050 [-0.0200, +0.0100]"
    assert t["measured"].iloc[2].endswith("C=8: -0.0100 [-0.0300, +0.0100], band +/-0.02")
    gated = judged(failed={(8, 0.25)})  # a point that fails its gate is not counted as tested
    assert gated["verdict"].iloc[0] == "not judged" and "C=8: -0.0050 [-0.0200, +0.0100] (gate failed" in gated[
        "measured"].iloc[0]
    assert judged(failed={(8, 0.70)})["verdict"].iloc[2] == "not judged"  # held at C=6, C=8 not tested
    assert judged(failed={(6, 0.70)})["verdict"].iloc[2] == "fails"  # C=8 passes its gate and fails it there
    assert predictions_table([("capability", p) for p in EXPERIMENT.predictions], {}).empty  # did not run
    assert EXPERIMENT.predictions_text(CoverageConfig()) == CAPABILITY_STATED
