"""The chain world and the batched trainer against loop references."""

import pytest
import torch

from creditlab.envs.chain import chain_outcome, exact_score, make_tasks
from creditlab.errors import ConfigError
from creditlab.train.chain import ChainTrainConfig, ModelSpec, train_chain
from reference.ref_chain import train_loop


def test_tasks_depend_only_on_seed_and_C():
    a = make_tasks(12, 4, [3, 5, 3], [0, 0, 1])
    b = make_tasks(12, 4, [3], [0])
    assert torch.equal(a.causal_pos[0, :3], b.causal_pos[0, :3])
    assert torch.equal(a.correct[0], b.correct[0])
    assert a.is_causal.sum(-1).tolist() == [3, 5, 3]
    assert (a.causal_pos[:, :3].diff(dim=-1) > 0).all()  # chain order = time order


@pytest.mark.parametrize("seed", range(4))
def test_outcome_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    T, K = 9, 3
    Cs = [1, 4, 9]
    tasks = make_tasks(T, K, Cs, [seed] * 3)
    actions = torch.randint(K, (3, 7, T), generator=g)
    actions[:, 0] = tasks.correct  # one perfect rollout per task
    reward, step_ok, progress = chain_outcome(tasks, actions)
    for m, C in enumerate(Cs):
        causal = tasks.causal_pos[m, :C].tolist()
        for r in range(7):
            n = 0
            for t in causal:
                if actions[m, r, t] != tasks.correct[m, t]:
                    break
                n += 1
            assert reward[m, r] == pytest.approx(n / C)
            for t in range(T):
                assert bool(step_ok[m, r, t]) == (t in causal and bool(actions[m, r, t] == tasks.correct[m, t]))
                assert float(progress[m, r, t]) == float(t in causal[:n])
    assert (reward[:, 0] == 1).all()


def test_exact_score_matches_monte_carlo():
    tasks = make_tasks(6, 2, [3], [0])
    p = torch.tensor([[0.9, 0.5, 0.8]])
    exact = float(exact_score(tasks, p))
    assert exact == pytest.approx((0.9 + 0.45 + 0.36) / 3)
    g = torch.Generator().manual_seed(0)
    n = 200_000
    ok = torch.rand(n, 3, generator=g) < p
    mc = ok.to(torch.int8).cumprod(-1).sum(-1).double().mean() / 3
    assert float(mc) == pytest.approx(exact, abs=5e-3)


# Adam divides by sqrt(v) + eps: with the default eps=1e-8 a gradient that is 0 in one implementation
# and 4e-9 (float rounding) in the other moves a weight by a quarter of the learning rate, so the two
# implementations are compared with a larger eps (the computation is otherwise the same).
CFG = ChainTrainConfig(T=5, K=3, hidden=8, group=4, updates=8, lr=0.05, eval_points=2, adam_eps=1e-4)


@pytest.mark.parametrize("state_dependent", [False, True])
def test_batched_trainer_matches_per_seed_loop(state_dependent):
    cfg = ChainTrainConfig(**{**CFG.__dict__, "state_dependent": state_dependent})
    specs = [
        ModelSpec(seed=0, C=2, arm="uniform"),
        ModelSpec(seed=1, C=3, arm="concentrated", k=2),
        ModelSpec(seed=0, C=4, arm="targeted", vd=0.6),
        ModelSpec(seed=2, C=3, arm="targeted", vd=0.7, exposure="prefix"),
        ModelSpec(seed=1, C=4, arm="per_turn", vd=0.5),
        ModelSpec(seed=2, C=4, arm="shuffled"),
        ModelSpec(seed=3, C=2, arm="random_k", k=2),
    ]
    batched = train_chain(specs, cfg)["curve"]
    loop = train_loop(specs, cfg)
    torch.testing.assert_close(batched.double(), loop.double(), atol=2e-5, rtol=1e-4)


def test_result_of_a_model_does_not_depend_on_its_batch():
    cfg = ChainTrainConfig(T=6, K=3, hidden=8, group=6, updates=25, eval_points=2)
    alone = train_chain([ModelSpec(seed=5, C=4, arm="per_turn")], cfg)["curve"]
    mixed = train_chain([ModelSpec(seed=1, C=2, arm="uniform"), ModelSpec(seed=5, C=4, arm="per_turn"),
                         ModelSpec(seed=5, C=6, arm="shuffled")], cfg)["curve"]
    torch.testing.assert_close(alone[0], mixed[1], atol=1e-6, rtol=1e-5)
    again = train_chain([ModelSpec(seed=5, C=4, arm="per_turn")], cfg)["curve"]
    assert torch.equal(alone, again)


def test_learning_happens_and_concentrated_stalls_beyond_k():
    cfg = ChainTrainConfig(T=8, K=3, hidden=16, group=8, updates=150, lr=0.05, eval_points=2)
    specs = [ModelSpec(seed=s, C=6, arm=a, k=2) for a in ("uniform", "concentrated") for s in range(3)]
    out = train_chain(specs, cfg)["final_score"].view(2, 3)
    chance = sum(3.0**-j for j in range(1, 7)) / 6
    assert (out[0] > chance + 0.3).all()  # uniform opens most of the chain
    # concentrated teaches only 2 of 6 causal steps (the others move only through the shared output layer)
    assert (out[0] - out[1] > 0.15).all()


@pytest.mark.parametrize(("spec", "param"), [
    (ModelSpec(seed=0, C=7, arm="uniform"), "C"),
    (ModelSpec(seed=0, C=2, arm="concentrated", k=0), "k"),
    (ModelSpec(seed=0, C=2, arm="targeted", vd=1.5), "vd"),
    (ModelSpec(seed=0, C=2, arm="magic"), "arm"),
    (ModelSpec(seed=0, C=2, arm="targeted", exposure="sideways"), "exposure"),
])
def test_impossible_configurations_name_the_parameter(spec, param):
    with pytest.raises(ConfigError) as err:
        train_chain([spec], ChainTrainConfig(T=6, updates=1))
    assert err.value.parameter == param


def test_bad_train_config():
    with pytest.raises(ConfigError, match="K"):
        train_chain([ModelSpec(seed=0, C=2, arm="uniform")], ChainTrainConfig(K=1))


def _first_step(batch, *, conserve: bool = True):
    """All of A_i on each rollout's first step (a geometry registered by this test module)."""
    out = torch.zeros(batch.step_mask.shape, dtype=batch.advantages.dtype)
    out[:, 0] = batch.advantages
    return out


def test_a_geometry_registered_elsewhere_is_an_arm_of_the_chain_trainer():
    from creditlab.core.credit import registered_geometry

    cfg = ChainTrainConfig(T=4, K=3, hidden=8, group=4, updates=20, eval_points=2)
    specs = [ModelSpec(seed=0, C=2, arm="first_step"), ModelSpec(seed=0, C=2, arm="uniform")]
    with registered_geometry("first_step", _first_step):
        out = train_chain(specs, cfg)["final_score"]
    assert torch.isfinite(out).all() and ((out >= 0) & (out <= 1)).all()
    assert out[0] != out[1]  # the arm really was the new geometry, not a fallback to uniform
    with pytest.raises(ConfigError, match="first_step|valid") as err:
        train_chain([ModelSpec(seed=0, C=1, arm="first_step")], cfg)
    assert err.value.parameter == "arm" and "uniform" in str(err.value)
