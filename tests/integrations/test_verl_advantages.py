"""creditlab's advantage estimators through verl's real ``compute_advantage`` (verl 0.9.1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from integration_helpers import agent_batch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.utils.skip.skip_manager import SkipManager

import creditlab.integrations.verl as cv
from creditlab.core import credit
from creditlab.core.advantages import grpo_advantages, prm_mixed_advantages
from creditlab.errors import ConfigError, InputError
from creditlab.integrations._common import turn_layout

UIDS = np.array(["p0", "p0", "p0", "p1", "p1", "p1"], dtype=object)
GID = torch.tensor([0, 0, 0, 1, 1, 1])


def _run(estimator, rewards, rm, creditlab=None, uids=UIDS):
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": rm},
                               non_tensors={"uid": uids})
    algo = OmegaConf.create({"adv_estimator": estimator, "norm_adv_by_std_in_grpo": True,
                             **({"creditlab": creditlab} if creditlab is not None else {})})
    out = compute_advantage(data, adv_estimator=estimator, config=algo)
    return out.batch["advantages"], out.batch["returns"]


def _last_token_scores(rm, scores):
    """verl's reward-manager layout: the scalar score on the last valid response token."""
    r = torch.zeros_like(rm)
    last = rm.shape[1] - 1 - torch.argmax(rm.flip(1), dim=1)
    r[torch.arange(rm.shape[0]), last] = scores
    return r


def _turn_scores(lay, seed):
    """Random process scores; 0 for a final turn that is one token long (the layout has no slot for it)."""
    s = torch.rand(lay.step_mask.shape, generator=torch.Generator().manual_seed(seed)) * lay.step_mask
    n = lay.seg.n_segments
    for i in range(s.shape[0]):
        if n[i] > 0 and int(((lay.seg.turn_index[i] == n[i] - 1)).sum()) == 1:
            s[i, n[i] - 1] = 0.0
    return s


def test_uniform_broadcast_equals_verl_grpo():
    _, _, rm = agent_batch(0)
    r = _last_token_scores(rm, torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.9]))
    ours, ret = _run("creditlab_uniform", r, rm, {"conserve": False})
    theirs, _ = _run("grpo", r, rm)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(ret, ours)


def test_prm_with_zero_process_scores_is_grpo_and_with_scores_matches_core():
    _, _, rm = agent_batch(1)
    outcome = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.4])
    lay = turn_layout(rm.bool())
    r = cv.pack_turn_rewards(rm, outcome)
    ours, _ = _run("creditlab_prm", r, rm, {"prm_lambda": 0.7})
    theirs, _ = _run("grpo", r, rm)
    torch.testing.assert_close(ours, theirs)

    turn_scores = _turn_scores(lay, 0)
    r = cv.pack_turn_rewards(rm, outcome, turn_scores)
    SkipManager.set_step(5)
    ours, _ = _run("creditlab_prm", r, rm, {"prm_lambda": 0.7})
    expected = prm_mixed_advantages(outcome, turn_scores, lay.step_mask, GID, 0.7)
    torch.testing.assert_close(ours, lay.to_tokens(expected).float())


def test_prm_decay_follows_verls_global_step():
    _, _, rm = agent_batch(2)
    lay = turn_layout(rm.bool())
    outcome = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.4])
    turn_scores = _turn_scores(lay, 1)
    r = cv.pack_turn_rewards(rm, outcome, turn_scores)
    knobs = {"prm_lambda": 1.0, "prm_schedule": "decay", "prm_start": 20, "prm_end": 30, "prm_power": 3}
    for step, lam in [(3, 1.0), (25, 0.125), (40, 0.0)]:
        SkipManager.set_step(step)  # what verl's trainers do before each step
        ours, _ = _run("creditlab_prm", r, rm, knobs)
        expected = prm_mixed_advantages(outcome, turn_scores, lay.step_mask, GID, lam)
        torch.testing.assert_close(ours, lay.to_tokens(expected).float())
    SkipManager.set_step(-1)
    with pytest.raises(ConfigError, match="global step"):
        _run("creditlab_prm", r, rm, knobs)


def test_per_turn_golden():
    # row 0: two turns (tokens 0-1 and 4), progress 0.2 after turn 0 (on the observation), 0.6 at the end
    rm = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    r = torch.tensor([[0, 0, 0.2, 0, 0.6, 0], [0, 0, 0.0, 0, 0, 0]])
    adv, _ = _run("creditlab_per_turn", r, rm, {"conserve": True}, uids=np.array(["a", "a"], dtype=object))
    A = 0.4 / (0.8 / 2**0.5 + 1e-6)  # GRPO of (0.8, 0): mean 0.4, unbiased std 0.8/sqrt(2)
    # conserve=True: row 0 splits A as 0.2 : 0.6 over its two turns (every token of a turn carries the
    # turn's credit); row 1 has no progress, so its single turn gets all of -A (uniform fallback)
    expected = torch.tensor([[A * 0.25, A * 0.25, 0, 0, A * 0.75, 0], [-A, -A, -A, 0, 0, 0]])
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("geometry", ["uniform", "per_turn", "concentrated", "binary", "discretized",
                                      "reward_to_go"])
def test_estimators_match_core_geometries(geometry):
    _, _, rm = agent_batch(3)
    lay = turn_layout(rm.bool())
    g = torch.Generator().manual_seed(2)
    step_r = torch.rand(6, lay.num_turns, generator=g) * lay.step_mask
    # put each turn's reward on the first observation token after it (or its last token at the end)
    r = torch.zeros_like(rm)
    for i in range(6):
        for t in range(int(lay.seg.n_segments[i])):
            pos = torch.nonzero(lay.seg.turn_index[i] == t).max().item()
            r[i, min(pos + 1, rm.shape[1] - 1) if t + 1 < int(lay.seg.n_segments[i]) else pos] += step_r[i, t]
    R = r.sum(1)
    knobs = {"conserve": True, "threshold": 0.8, "levels": [0.0, 0.5, 1.0]}
    ours, _ = _run(f"creditlab_{geometry}", r, rm, knobs)
    A = grpo_advantages(R, GID)
    core = {
        "uniform": lambda: credit.uniform(A, lay.step_mask),
        "per_turn": lambda: credit.per_turn(A, step_r, lay.step_mask),
        "concentrated": lambda: credit.concentrated(A, step_r > 0, lay.step_mask),
        "binary": lambda: credit.binary(R, GID, lay.step_mask, threshold=0.8),
        "discretized": lambda: credit.discretized(R, GID, lay.step_mask, levels=(0.0, 0.5, 1.0)),
        "reward_to_go": lambda: credit.reward_to_go(step_r, GID, lay.step_mask, conserve=True),
    }[geometry]()
    torch.testing.assert_close(ours, lay.to_tokens(core), rtol=1e-5, atol=1e-6)
    assert bool((ours[rm == 0] == 0).all())


def test_shuffled_keeps_each_rows_credit_multiset_and_is_seeded():
    _, _, rm = agent_batch(4)
    lay = turn_layout(rm.bool())
    step_r = torch.rand(6, lay.num_turns, generator=torch.Generator().manual_seed(3)) * lay.step_mask
    r = torch.zeros_like(rm)
    r[lay.first] = step_r[lay.step_mask]
    SkipManager.set_step(7)
    a1, _ = _run("creditlab_shuffled", r, rm, {"seed": 1})
    a2, _ = _run("creditlab_shuffled", r, rm, {"seed": 1})
    torch.testing.assert_close(a1, a2, rtol=0, atol=0)
    ref, _ = _run("creditlab_per_turn", r, rm)
    steps = lay.first_values(a1.double()), lay.first_values(ref.double())
    for i in range(6):
        n = int(lay.seg.n_segments[i])
        torch.testing.assert_close(steps[0][i, :n].sort().values, steps[1][i, :n].sort().values)


def test_pack_turn_rewards_round_trip_and_collision():
    rm = torch.tensor([[1, 1, 0, 1, 1, 0, 0], [1, 0, 0, 1, 0, 0, 0]], dtype=torch.float32)
    r = cv.pack_turn_rewards(rm, torch.tensor([1.0, 0.0]), torch.tensor([[0.2, 0.5], [0.3, 0.0]]))
    lay = turn_layout(rm.bool())
    torch.testing.assert_close(lay.first_values(r), torch.tensor([[0.2, 0.5], [0.3, 0.0]]))
    torch.testing.assert_close(r.sum(1) - lay.first_values(r).sum(1), torch.tensor([1.0, 0.0]))
    with pytest.raises(InputError, match="row 1: the last turn is one token long"):
        cv.pack_turn_rewards(rm, None, torch.tensor([[0.2, 0.5], [0.3, 0.4]]))


def test_config_errors_name_the_key():
    _, _, rm = agent_batch(5)
    r = _last_token_scores(rm, torch.ones(6))
    with pytest.raises(ConfigError, match=r"algorithm.creditlab: unknown key\(s\) \['lambda'\]"):
        _run("creditlab_prm", r, rm, {"lambda": 0.3})
    with pytest.raises(ConfigError, match="prm_schedule"):
        _run("creditlab_prm", r, rm, {"prm_schedule": "cosine"})
    with pytest.raises(ConfigError, match="uid"):
        data = DataProto.from_dict(tensors={"token_level_rewards": r, "response_mask": rm})
        compute_advantage(data, adv_estimator="creditlab_uniform", config=OmegaConf.create({}))
    with pytest.raises(InputError, match="progress_deltas"):
        _run("creditlab_per_turn", -r, rm)


def test_random_k_targeted_and_a_geometry_registered_later():
    from verl.trainer.ppo import core_algos

    from creditlab.integrations._common import CreditSettings, turn_credit

    _, _, rm = agent_batch(6)
    lay = turn_layout(rm.bool())
    step_r = torch.rand(6, lay.num_turns, generator=torch.Generator().manual_seed(4)) * lay.step_mask
    r = torch.zeros_like(rm)
    r[lay.first] = step_r[lay.step_mask]
    R = r.sum(1)
    A = grpo_advantages(R, GID)
    SkipManager.set_step(3)
    ours, _ = _run("creditlab_random_k", r, rm, {"k": 2, "seed": 5, "conserve": True})
    keys = torch.rand(lay.step_mask.shape, generator=torch.Generator().manual_seed(5 * 1_000_003 + 3),
                      dtype=torch.float64)
    torch.testing.assert_close(ours, lay.to_tokens(credit.random_k(A, keys, 2, lay.step_mask)), rtol=1e-5, atol=1e-6)
    ours, _ = _run("creditlab_targeted", r, rm, {"conserve": True})
    core = credit.targeted(A, step_r, lay.step_mask, GID, lay.step_mask)
    torch.testing.assert_close(ours, lay.to_tokens(core), rtol=1e-5, atol=1e-6)

    def doubled(batch, *, conserve=True, eps=1e-6):
        A = batch.advantages if batch.advantages is not None else grpo_advantages(batch.rewards, batch.group_ids, eps)
        return 2 * credit.uniform(A, batch.step_mask, conserve=conserve)

    name = "creditlab_doubled_test"
    try:
        with credit.registered_geometry("doubled_test", doubled):
            assert name in cv.ESTIMATORS
            cv.install()  # puts the new geometry in verl's registry
            ours, _ = _run(name, r, rm)
            torch.testing.assert_close(ours, 2 * _run("creditlab_uniform", r, rm)[0])
        assert name not in cv.ESTIMATORS
        with pytest.raises(ConfigError, match="geometry: unknown 'doubled_test'"):  # never a KeyError mid-run
            _run(name, r, rm)
        with pytest.raises(ConfigError, match="geometry: unknown 'bogus'; valid: uniform"):
            turn_credit("bogus", lay.step_mask, GID, rewards=R, settings=CreditSettings())
    finally:
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(name, None)
        cv._ESTIMATOR_FNS.pop(name, None)
        SkipManager.set_step(-1)
