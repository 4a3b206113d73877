"""creditlab.core.credit and core.advantages against loop references, goldens and invariants."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from creditlab.core import credit as cr
from creditlab.core.advantages import grpo_advantages, prm_mixed_advantages
from creditlab.core.credit import GEOMETRIES, StepBatch, geometry_needs, geometry_params, get_geometry
from creditlab.errors import ConfigError, InputError
from reference import ref_credit as ref


def ragged(B, T, seed, p=0.7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < p
    mask[0] = False  # a row with no real step
    if B > 1:
        mask[1] = True
    return mask, g


@pytest.mark.parametrize("seed", range(6))
def test_grpo_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 20, (1,), generator=g))
    r = torch.rand(B, generator=g, dtype=torch.float64)
    gid = torch.randint(0, 4, (B,), generator=g) * 7  # non-contiguous labels
    torch.testing.assert_close(grpo_advantages(r, gid), ref.grpo(r, gid))


@pytest.mark.parametrize("seed", range(8))
def test_geometries_match_loop(seed):
    B, T = 5 + seed, 3 + seed % 5
    mask, g = ragged(B, T, seed)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    dS = torch.rand(B, T, generator=g, dtype=torch.float64) * (torch.rand(B, T, generator=g) < 0.5)
    sel = torch.rand(B, T, generator=g) < 0.3
    keys = torch.rand(B, T, generator=g, dtype=torch.float64)
    junk = torch.where(mask, dS, torch.full_like(dS, 1e9))  # junk at masked positions changes nothing
    torch.testing.assert_close(cr.uniform(adv, mask), ref.uniform(adv, mask))
    torch.testing.assert_close(cr.uniform(adv, mask, conserve=False), ref.uniform(adv, mask, conserve=False))
    torch.testing.assert_close(cr.per_turn(adv, junk, mask), ref.per_turn(adv, dS, mask))
    torch.testing.assert_close(cr.concentrated(adv, sel, mask), ref.concentrated(adv, sel, mask))
    c = cr.per_turn(adv, dS, mask)
    torch.testing.assert_close(cr.shuffled(c, mask, keys=keys), ref.shuffled(c, mask, keys))
    gid = torch.arange(B) % 3
    r = torch.rand(B, T, generator=g, dtype=torch.float64)
    torch.testing.assert_close(cr.reward_to_go(r, gid, mask), ref.reward_to_go(r, gid, mask))


def test_golden_geometries():
    adv = torch.tensor([2.0, -3.0])
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    torch.testing.assert_close(cr.uniform(adv, mask), torch.tensor([[0.5, 0.5, 0.5, 0.5], [-1.0, -1.0, -1.0, 0.0]]))
    dS = torch.tensor([[0.0, 1.0, 0.0, 3.0], [0.0, 0.0, 0.0, 5.0]])  # row 2: progress only on a masked step
    torch.testing.assert_close(cr.per_turn(adv, dS, mask),
                               torch.tensor([[0.0, 0.5, 0.0, 1.5], [-1.0, -1.0, -1.0, 0.0]]))
    sel = torch.tensor([[True, False, False, True], [False, True, False, False]])
    torch.testing.assert_close(cr.concentrated(adv, sel, mask),
                               torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, -3.0, 0.0, 0.0]]))
    # reward-to-go by hand: returns R = [1, 3], group mean 2, std sqrt(2)
    r = torch.tensor([[0.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    a = cr.reward_to_go(r, torch.tensor([0, 0]), torch.ones(2, 2, dtype=torch.bool), eps=1e-12)
    s2 = 2**0.5
    torch.testing.assert_close(a, torch.tensor([[-1 / s2, -1 / s2], [1 / s2, 0.0]], dtype=torch.float64))


def test_binary_and_discretized_golden():
    r = torch.tensor([1.0, 0.9, 0.3, 0.7])
    gid = torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 2, dtype=torch.bool)
    b = cr.binary(r, gid, mask, eps=1e-12)  # outcomes 1, 0 | 0, 0
    s = 2**-0.5
    torch.testing.assert_close(b, torch.tensor([[s / 2, s / 2], [-s / 2, -s / 2], [0.0, 0.0], [0.0, 0.0]]))
    d = cr.discretized(r, gid, mask, eps=1e-12)  # levels 1, 1 | 0.5, 0.5 -> all ties -> zero advantages
    torch.testing.assert_close(d, torch.zeros(4, 2))
    d2 = cr.discretized(torch.tensor([0.2, 0.8]), torch.tensor([0, 0]), torch.ones(2, 1, dtype=torch.bool), eps=1e-12)
    torch.testing.assert_close(d2, torch.tensor([[-s], [s]]))


def test_reward_to_go_terminal_only_is_uniform_broadcast():
    g = torch.Generator().manual_seed(0)
    B, T = 8, 5
    R = torch.rand(B, generator=g, dtype=torch.float64)
    r = torch.zeros(B, T, dtype=torch.float64)
    r[:, -1] = R
    gid = torch.arange(B) // 4
    mask = torch.ones(B, T, dtype=torch.bool)
    torch.testing.assert_close(cr.reward_to_go(r, gid, mask), cr.uniform(grpo_advantages(R, gid), mask, conserve=False))


@given(st.integers(1, 6), st.integers(1, 9), st.integers(0, 10_000))
def test_credit_is_conserved(B, T, seed):
    mask, g = ragged(B, T, seed, p=0.6)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    has = mask.any(-1)
    want = torch.where(has, adv.abs(), torch.zeros_like(adv))
    dS = torch.rand(B, T, generator=g, dtype=torch.float64) * (torch.rand(B, T, generator=g) < 0.4)
    sel = torch.rand(B, T, generator=g) < 0.3
    for c in (cr.uniform(adv, mask), cr.per_turn(adv, dS, mask), cr.concentrated(adv, sel, mask),
              cr.shuffled(cr.per_turn(adv, dS, mask), mask, torch.Generator().manual_seed(seed)),
              cr.conserve_credit(torch.randn(B, T, generator=g, dtype=torch.float64), adv, mask)):
        torch.testing.assert_close(c.abs().sum(-1), want)
        assert (c[~mask] == 0).all()
        # the sign of every step's credit is the sign of the trajectory's advantage (geometries
        # reshape credit, they never flip it), except conserve_credit of an arbitrary tensor
    for c in (cr.uniform(adv, mask), cr.per_turn(adv, dS, mask), cr.concentrated(adv, sel, mask)):
        assert (c * adv.unsqueeze(-1) >= 0).all()


@given(st.integers(1, 5), st.integers(1, 8), st.integers(0, 10_000))
def test_shuffle_keeps_the_multiset_of_each_row(B, T, seed):
    mask, g = ragged(B, T, seed)
    c = torch.randn(B, T, generator=g)
    s = cr.shuffled(c, mask, torch.Generator().manual_seed(seed))
    for i in range(B):
        assert sorted(s[i][mask[i]].tolist()) == sorted(c[i][mask[i]].tolist())
        assert (s[i][~mask[i]] == 0).all()


def test_shuffle_is_uniform_over_positions():
    c = torch.tensor([[1.0, 0.0, 0.0, 0.0]]).expand(4000, 4)
    s = cr.shuffled(c, torch.ones(4000, 4, dtype=torch.bool), torch.Generator().manual_seed(0))
    freq = (s == 1).double().mean(0)
    assert torch.allclose(freq, torch.full((4,), 0.25, dtype=torch.float64), atol=0.03)


def test_bad_inputs_name_the_argument():
    adv, mask = torch.zeros(2), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(InputError, match="step_mask"):
        cr.uniform(adv, mask.float())
    with pytest.raises(InputError, match="advantages"):
        cr.uniform(torch.zeros(3), mask)
    with pytest.raises(InputError, match="advantages"):
        cr.uniform(torch.tensor([0.0, float("nan")]), mask)
    with pytest.raises(InputError, match="progress_deltas"):
        cr.per_turn(adv, -torch.ones(2, 3), mask)
    with pytest.raises(InputError, match="selected_mask"):
        cr.concentrated(adv, torch.ones(2, 3), mask)
    with pytest.raises(InputError, match="group_ids"):
        grpo_advantages(torch.zeros(2), torch.zeros(2))


# --------------------------------------------------------------------------------------------
# random_k and targeted (the chain lab's arms)


@given(st.integers(1, 6), st.integers(1, 9), st.integers(0, 4), st.booleans(), st.integers(0, 10_000))
def test_random_k_matches_loop(B, T, k, per_row, seed):
    mask, g = ragged(B, T, seed)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    keys = torch.rand(B, T, generator=g, dtype=torch.float64)
    kk = torch.randint(0, T + 1, (B,), generator=g) if per_row else k
    got = cr.random_k(adv, torch.where(mask, keys, torch.full_like(keys, 1e9)), kk, mask)  # junk where masked
    torch.testing.assert_close(got, ref.random_k(adv, keys, kk, mask))
    torch.testing.assert_close(cr.random_k_mask(keys, kk, mask).sum(-1),
                               torch.minimum(torch.as_tensor(kk), mask.sum(-1)))


def _groups(B, G, seed, contiguous):
    if contiguous:
        return torch.arange(B // G).repeat_interleave(G) * 5 + 2  # contiguous blocks, arbitrary labels
    return torch.randint(0, max(B // G, 1), (B,), generator=torch.Generator().manual_seed(seed))


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 8), st.sampled_from([0.6, 1.0]), st.booleans(),
       st.booleans(), st.integers(0, 10_000))
def test_targeted_matches_loop(M, G, T, p, contiguous, conserve, seed):
    B = M * G
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < p
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    local = (torch.rand(B, T, generator=g) < 0.5).double() + torch.rand(B, T, generator=g, dtype=torch.float64) * 0.1
    exposed = torch.rand(B, T, generator=g) < 0.7
    gid = _groups(B, G, seed, contiguous)
    junk = torch.where(mask, local, torch.full_like(local, 1e6))
    got = cr.targeted(adv, junk, exposed, gid, mask, conserve=conserve)
    want = ref.targeted(adv, local, exposed, gid, mask, conserve=conserve)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    if conserve:
        mass = want.abs().sum(-1)
        torch.testing.assert_close(got.abs().sum(-1), torch.where(mass > 0, adv.abs(), torch.zeros_like(adv)))


def _chain_trainer_targeted(step_correct, exposed, a_r):
    """The lines of creditlab.train.chain._train_chain (targeted arm), copied as they are."""
    T = step_correct.shape[-1]
    loc = step_correct.float()
    mu, sd = loc.mean(1, keepdim=True), loc.std(1, keepdim=True)
    loc = torch.where(exposed.unsqueeze(1), (loc - mu) / (sd + 1e-6), torch.zeros_like(loc))
    loc = loc.reshape(-1, T)
    mass = loc.abs().sum(-1, keepdim=True)
    return torch.where(mass > 0, loc * a_r.abs().unsqueeze(-1) / mass.clamp_min(1e-12), torch.zeros_like(loc))


@pytest.mark.parametrize("M, G, T", [(1, 2, 3), (5, 8, 12), (7, 16, 20), (3, 4, 1)])
def test_targeted_is_the_chain_trainers_float32_arithmetic_bit_for_bit(M, G, T):
    g = torch.Generator().manual_seed(M * 100 + G)
    step_correct = torch.rand(M, G, T, generator=g) < 0.6
    exposed = torch.rand(M, T, generator=g) < 0.5
    reward = torch.rand(M * G, generator=g)
    A = grpo_advantages(reward, torch.arange(M).repeat_interleave(G))  # float32, as in the lab
    rows = torch.arange(M)[torch.rand(M, generator=g) < 0.7]  # the models of one arm
    if rows.numel() == 0:
        rows = torch.tensor([0])
    a_r = A.view(M, G)[rows].reshape(-1)
    want = _chain_trainer_targeted(step_correct[rows], exposed[rows], a_r)
    R = rows.numel()
    got = cr.targeted(a_r, step_correct[rows].float().reshape(R * G, T), exposed[rows].repeat_interleave(G, 0),
                      rows.repeat_interleave(G), torch.ones(R * G, T, dtype=torch.bool))
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    batch = StepBatch(torch.ones(R * G, T, dtype=torch.bool), torch.arange(R).repeat_interleave(G), advantages=a_r,
                      step_scores=step_correct[rows].float().reshape(R * G, T),
                      selected=exposed[rows].repeat_interleave(G, 0))
    assert torch.equal(get_geometry("targeted")(batch), want)


def test_random_k_is_the_chain_trainers_selection_bit_for_bit():
    M, G, T = 6, 8, 10
    g = torch.Generator().manual_seed(0)
    step_keys = torch.rand(M, G, T, generator=g)
    k_col = torch.randint(1, T, (M,), generator=g).view(M, 1, 1)
    A = grpo_advantages(torch.rand(M * G, generator=g), torch.arange(M).repeat_interleave(G))
    mask = torch.ones(M * G, T, dtype=torch.bool)
    rank = step_keys.argsort(-1).argsort(-1)
    want = cr.concentrated(A, (rank < k_col).reshape(-1, T), mask)  # _train_chain's random_k arm
    got = cr.random_k(A, step_keys.reshape(-1, T), k_col.view(M).repeat_interleave(G), mask)
    assert torch.equal(got, want)


def test_targeted_and_random_k_golden():
    # one group of two rollouts, two steps, both real. Step 0 is exposed: local (1, 0) -> mean 0.5,
    # unbiased std sqrt(0.5) -> loc = (+0.7071, -0.7071); step 1 not exposed -> 0. Each row's |A_i|
    # goes to its only non-zero step, with the local sign.
    adv = torch.tensor([2.0, -3.0], dtype=torch.float64)
    local = torch.tensor([[1.0, 5.0], [0.0, 7.0]], dtype=torch.float64)
    exposed = torch.tensor([[True, False], [True, False]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    got = cr.targeted(adv, local, exposed, torch.tensor([4, 4]), mask)
    torch.testing.assert_close(got, torch.tensor([[2.0, 0.0], [-3.0, 0.0]], dtype=torch.float64))
    s = 0.5 / (0.5**0.5 + 1e-6)
    torch.testing.assert_close(cr.targeted(adv, local, exposed, torch.tensor([4, 4]), mask, conserve=False),
                               torch.tensor([[2 * s, 0.0], [-3 * s, 0.0]], dtype=torch.float64))
    # all-equal local signal: nothing to target, no credit (no uniform fallback)
    torch.testing.assert_close(cr.targeted(adv, torch.ones(2, 2, dtype=torch.float64), mask, torch.tensor([0, 0]),
                                           mask), torch.zeros(2, 2, dtype=torch.float64))
    # random_k: keys (0.5, 0.1, 0.3) with k = 2 pick steps 1 and 2: A / 2 each
    keys = torch.tensor([[0.5, 0.1, 0.3]])
    torch.testing.assert_close(cr.random_k(torch.tensor([4.0]), keys, 2, torch.ones(1, 3, dtype=torch.bool)),
                               torch.tensor([[0.0, 2.0, 2.0]]))
    with pytest.raises(ConfigError, match="k: must be a non-negative integer"):
        cr.random_k(torch.tensor([4.0]), keys, 1.5, torch.ones(1, 3, dtype=torch.bool))


# --------------------------------------------------------------------------------------------
# the registry


def test_registry_names_params_and_needs():
    assert list(GEOMETRIES)[:10] == ["uniform", "per_turn", "concentrated", "shuffled", "binary", "discretized",
                                     "reward_to_go", "prm", "random_k", "targeted"]
    assert geometry_params("prm") == ("lam", "eps") and geometry_params("binary") == ("threshold", "eps")
    assert geometry_params("random_k") == ("k", "eps", "generator")
    assert geometry_needs("binary") == {"rewards"} and geometry_needs("uniform") == {"advantages"}
    assert geometry_needs("per_turn") == {"advantages", "step_scores"}
    with pytest.raises(ConfigError, match="geometry: unknown 'bogus'; valid: uniform, per_turn, concentrated"):
        get_geometry("bogus")


def test_registered_geometries_pickle():
    import pickle

    for name, fn in GEOMETRIES.items():
        assert pickle.loads(pickle.dumps(fn)) is fn, name


@pytest.mark.parametrize("conserve", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_registered_geometries_are_the_public_functions(seed, conserve):
    B, T = 9, 5
    mask, g = ragged(B, T, seed)
    gid = torch.arange(B) // 3
    R = torch.rand(B, generator=g, dtype=torch.float64)
    A = grpo_advantages(R, gid)
    scores = torch.rand(B, T, generator=g, dtype=torch.float64) * (torch.rand(B, T, generator=g) < 0.6)
    sel = torch.rand(B, T, generator=g) < 0.4
    keys = torch.rand(B, T, generator=g, dtype=torch.float64)
    full = StepBatch(mask, gid, A, R, scores, None, keys)
    kw = {"conserve": conserve}

    def geo(name, batch=full, **params):
        return get_geometry(name)(batch, **kw, **params)

    torch.testing.assert_close(geo("uniform"), cr.uniform(A, mask, **kw))
    torch.testing.assert_close(geo("uniform", full._replace(advantages=None)), cr.uniform(A, mask, **kw))
    torch.testing.assert_close(geo("per_turn"), cr.per_turn(A, scores, mask, **kw))
    torch.testing.assert_close(geo("concentrated"), cr.concentrated(A, scores > 0, mask, **kw))
    torch.testing.assert_close(geo("concentrated", full._replace(selected=sel)), cr.concentrated(A, sel, mask, **kw))
    torch.testing.assert_close(geo("shuffled"), cr.shuffled(cr.per_turn(A, scores, mask, **kw), mask, keys=keys))
    torch.testing.assert_close(geo("binary", threshold=0.5), cr.binary(R, gid, mask, threshold=0.5, **kw))
    torch.testing.assert_close(geo("discretized", levels=(0.0, 1.0)), cr.discretized(R, gid, mask, levels=(0.0, 1.0),
                                                                                     **kw))
    torch.testing.assert_close(geo("reward_to_go"), cr.reward_to_go(scores, gid, mask, **kw))
    prm = A[:, None] + prm_mixed_advantages(torch.zeros(B, dtype=torch.float64), scores, mask, gid, 0.3)
    prm = torch.where(mask, prm, 0.0)
    torch.testing.assert_close(geo("prm", lam=0.3), cr.conserve_credit(prm, A, mask) if conserve else prm)
    torch.testing.assert_close(geo("random_k", k=2), cr.random_k(A, keys, 2, mask, **kw))
    torch.testing.assert_close(geo("targeted", full._replace(selected=sel)),
                               cr.targeted(A, scores, sel, gid, mask, **kw))
    torch.testing.assert_close(geo("targeted"), cr.targeted(A, scores, mask, gid, mask, **kw))
    # keys drawn from a generator when none are given
    drawn = geo("random_k", full._replace(keys=None), k=2, generator=torch.Generator().manual_seed(1))
    keys1 = torch.rand(B, T, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(drawn, cr.random_k(A, keys1, 2, mask, **kw))


@pytest.mark.parametrize("name, missing, match", [("per_turn", "step_scores", "step_scores: geometry 'per_turn'"),
                                                  ("binary", "rewards", "rewards: geometry 'binary'"),
                                                  ("uniform", "advantages", "advantages: pass the outcome")])
def test_a_missing_input_names_it(name, missing, match):
    mask = torch.ones(2, 3, dtype=torch.bool)
    batch = StepBatch(mask, torch.tensor([0, 0]), torch.tensor([1.0, -1.0]), torch.tensor([1.0, 0.0]),
                      torch.ones(2, 3))
    batch = batch._replace(**{missing: None}, **({"rewards": None} if missing == "advantages" else {}))
    with pytest.raises(InputError, match=match):
        get_geometry(name)(batch)


def _half_uniform(batch, *, conserve=True, scale: float = 0.5):
    return scale * cr.uniform(batch.advantages, batch.step_mask, conserve=conserve)


def test_register_geometry_idempotent_refuses_taken_names_and_bad_signatures():
    with cr.registered_geometry("half_uniform_test", _half_uniform):
        assert cr.register_geometry("half_uniform_test")(_half_uniform) is _half_uniform
        with pytest.raises(ConfigError, match="already registered"):
            cr.register_geometry("uniform")(_half_uniform)
        assert geometry_params("half_uniform_test") == ("scale",)
        assert "half_uniform_test" in str(pytest.raises(ConfigError, get_geometry, "x").value)
    assert "half_uniform_test" not in GEOMETRIES

    def no_conserve(batch, *, scale=1.0):
        return batch.step_mask.double()

    def no_default(batch, *, conserve=True, scale):
        return batch.step_mask.double()

    for fn, match in [(no_conserve, "conserve"), (no_default, "need a default")]:
        with pytest.raises(ConfigError, match=match):
            cr.register_geometry("bad_geometry_test")(fn)
    with pytest.raises(ConfigError, match="needs"):
        cr.register_geometry("bad_geometry_test", needs=("nothing",))
    cr.register_geometry("tmp_test")(_half_uniform)
    assert cr.unregister_geometry("tmp_test") is _half_uniform and "tmp_test" not in GEOMETRIES
    with pytest.raises(ConfigError, match="unknown"):
        cr.unregister_geometry("tmp_test")
