"""toolshop agent: batched multi-turn rollout, cached base policy, multi-turn GRPO trainer."""

from pathlib import Path

import pytest
import torch

from creditlab.core.diagnostics import chain_length
from creditlab.envs.toolshop import VOCAB, ToolshopEnv, encode, make_task
from creditlab.errors import ConfigError
from creditlab.models.tiny_lm import TinyLM, TinyLMConfig
from creditlab.train.toolshop_base import BaseConfig, base_policy, default_cache_dir, train_base
from creditlab.train.toolshop_grpo import GRPOConfig, advantage_names, make_advantage, make_weights, train_grpo
from creditlab.train.toolshop_rollout import (
    RolloutBatch,
    make_tasks,
    rollout,
    sequence_logprobs,
    turn_progress_deltas,
    turns_to_tokens,
)

TINY_BASE = BaseConfig(n_demos=64, steps=30, batch_size=16, d_model=32, n_layer=1, max_len=96)


@pytest.fixture(scope="module")
def model():
    g = torch.Generator().manual_seed(0)
    m = TinyLM(TinyLMConfig(vocab_size=len(VOCAB), d_model=32, n_layer=2, max_len=96), generator=g)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return m.eval()


def _rollout(model, n=12, precision="fp32", seed=0, **kw):
    tasks = make_tasks(range(n), (2, 4))
    gen = torch.Generator().manual_seed(seed)
    return rollout(model, tasks, precision=precision, max_len=96, generator=gen, **kw)


def test_rollout_is_deterministic_and_consistent_with_the_env(model):
    a, b = _rollout(model), _rollout(model)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    B, L = a.tokens.shape
    assert a.policy_mask.shape == a.valid_mask.shape == a.turn_ids.shape == (B, L)
    assert not bool((a.policy_mask & ~a.valid_mask).any())
    assert bool((a.rollout_logprobs[~a.policy_mask] == 0).all())
    assert bool((a.rollout_logprobs[a.policy_mask] <= 0).all())
    for r in range(B):
        # replay the sampled actions through a fresh env: same records, same observations, same tokens
        env = ToolshopEnv(a.tasks[r])
        toks = a.tokens[r][a.valid_mask[r]].tolist()
        pm = a.policy_mask[r][a.valid_mask[r]].tolist()
        prompt = env.reset()
        assert toks[:len(prompt)] == prompt and not any(pm[:len(prompt)])
        i, rebuilt = len(prompt), list(prompt)
        while i < len(toks):
            act = []
            while i < len(toks) and pm[i]:
                act.append(toks[i])
                i += 1
            if not act:
                break
            res = env.step(act)
            rebuilt += act + res.observation
            i += len(res.observation)
        assert rebuilt[:len(toks)] == toks
        assert [x.name for x in env.records] == [x.name for x in a.records[r]]
        assert int(a.n_calls[r]) == len(a.records[r])
        assert float(a.success[r]) == float(env.result()[0]) or len(rebuilt) > len(toks)
        # the turn id of a policy token is the index of its record
        tid = a.turn_ids[r][a.policy_mask[r]]
        assert bool((tid >= 0).all()) and int(tid.max()) == len(a.records[r]) - 1


def test_fp32_rollout_logprobs_equal_the_learner(model):
    batch = _rollout(model)
    lp = sequence_logprobs(model, batch.tokens)
    pm = batch.policy_mask
    assert torch.allclose(lp[pm], batch.rollout_logprobs[pm], atol=1e-4)
    q = _rollout(model, precision="fp8")
    lq_fp32 = sequence_logprobs(model, q.tokens)
    lq_qat = sequence_logprobs(model, q.tokens, "fp8")
    gap_naive = (lq_fp32 - q.rollout_logprobs)[q.policy_mask].abs().mean()
    gap_qat = (lq_qat - q.rollout_logprobs)[q.policy_mask].abs().mean()
    assert gap_qat < gap_naive and gap_naive > 1e-4


def test_records_carry_dataflow_fields(model):
    batch = _rollout(model, n=6)
    for task, recs in zip(batch.tasks, batch.records, strict=True):
        for rec in recs:
            assert isinstance(rec.arguments, dict) and isinstance(rec.returned, list)
        chain_length(recs, task.given)  # never raises on sampled trajectories


def test_base_policy_is_cached_and_deterministic(tmp_path):
    steps = []
    m1 = base_policy(TINY_BASE, cache_dir=tmp_path, progress=lambda k, loss: steps.append(k))
    assert steps == list(range(TINY_BASE.steps))  # trained: one progress call per optimizer step
    files = list(tmp_path.glob("toolshop-base-*.safetensors"))
    assert [f.name for f in files] == [f"toolshop-base-{TINY_BASE.key()}.safetensors"]
    calls = []
    m2 = base_policy(TINY_BASE, cache_dir=tmp_path, progress=lambda k, loss: calls.append(k))  # loaded
    assert calls == []
    for (n, p), (_, q) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert torch.equal(p, q), n
    m3 = base_policy(TINY_BASE, cache_dir=tmp_path / "other")  # retrained from the seed: same weights
    assert all(torch.equal(p, q) for p, q in zip(m1.state_dict().values(), m3.state_dict().values(),
                                                  strict=True))
    m4 = base_policy(TINY_BASE, cache_dir=None)  # no cache: trained, nothing written
    assert all(torch.equal(p, q) for p, q in zip(m1.state_dict().values(), m4.state_dict().values(),
                                                  strict=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([files[0].name, "other"])


def test_base_policy_needs_no_global_seed_and_leaves_it_alone():
    """train_base draws from its own generators: the global RNG neither matters nor moves."""
    cfg = BaseConfig(n_demos=16, steps=3, batch_size=4, d_model=32, n_layer=1, max_len=96)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a = train_base(cfg)
    assert torch.equal(state, torch.random.get_rng_state())
    torch.manual_seed(456)
    b = train_base(cfg)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_default_cache_dir_takes_the_environment_value_as_an_argument(tmp_path):
    import platformdirs

    assert default_cache_dir(str(tmp_path)) == tmp_path
    assert default_cache_dir(None) == default_cache_dir("") == Path(platformdirs.user_cache_dir("creditlab"))


def test_turns_to_tokens_and_builtin_advantages(model):
    batch = _rollout(model, n=8, group_ids=[0, 0, 0, 0, 1, 1, 1, 1])
    T = batch.n_turns_max
    vals = torch.arange(8 * T, dtype=torch.float32).view(8, T)
    tok = turns_to_tokens(vals, batch)
    pm = batch.policy_mask
    for b in range(8):
        for t in range(batch.tokens.size(1)):
            want = float(vals[b, batch.turn_ids[b, t]]) if pm[b, t] else 0.0
            assert float(tok[b, t]) == want
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 1])
    g = make_advantage("grpo")(batch, rewards, 0)
    assert g.shape == (8,)
    u = make_advantage("uniform")(batch, rewards, 0)
    # equal total credit: sum over turns of |credit| = |A_i|
    per_turn_sum = torch.zeros(8)
    for b in range(8):
        for t in range(int(batch.n_calls[b])):
            sel = pm[b] & (batch.turn_ids[b] == t)
            if sel.any():
                per_turn_sum[b] += u[b][sel][0].abs()
    has_all_turns = torch.tensor([len({int(x) for x in batch.turn_ids[b][pm[b]]}) == int(batch.n_calls[b])
                                  for b in range(8)])
    assert torch.allclose(per_turn_sum[has_all_turns], g.abs()[has_all_turns], atol=1e-5)
    with pytest.raises(ConfigError, match="advantage"):
        make_advantage("nope")


def test_correction_arms_resolve_and_unknown_arm_raises():
    old = torch.tensor([[-1.0, -2.0, 0.0]])
    pm = torch.tensor([[True, True, False]])
    for arm in ("none", "tis", "mis", "seq_is", "geo", "prefix", "global", "interq"):
        w, m = make_weights(arm)(old, old, pm, None)
        assert torch.allclose(w, torch.ones_like(w)), arm  # no mismatch -> weights 1
    with pytest.raises(ConfigError, match="correction"):
        make_weights("magic")
    with pytest.raises(ConfigError, match="^rollout_precision: unknown precision 'fp4'"):
        GRPOConfig(rollout_precision="fp4")
    with pytest.raises(ConfigError, match="^learner_precision: "):
        GRPOConfig(learner_precision="fp16")
    with pytest.raises(ConfigError, match="group_size"):
        GRPOConfig(group_size=1)


def test_weights_and_advantages_come_from_the_core_registries(model):
    from creditlab.core.correction import registered_correction, tis_weights
    from creditlab.core.credit import registered_geometry, uniform

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 6, generator=g)
    roll = old + 0.3 * torch.randn(2, 6, generator=g)
    pm = torch.tensor([[False, True, True, True, False, False], [False, True, True, True, True, True]])
    w, m = make_weights("tis", cap=1.1)(old, roll, pm, None)
    want_w, want_m = tis_weights(old, roll, pm, None, cap=1.1)
    assert torch.equal(w, want_w) and m == want_m
    with pytest.raises(ConfigError, match="correction: tis takes cap"):
        make_weights("tis", eps_low=0.1)

    def half(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, scale: float = 0.5):
        return torch.full_like(old_logprobs, scale), {"correction/half": scale}

    with registered_correction("half", half):  # an arm registered in core works in the trainer at once
        w, m = make_weights("half", scale=0.25)(old, roll, pm)
        assert bool((w == 0.25).all()) and m == {"correction/half": 0.25}
    with pytest.raises(ConfigError, match="half"):
        make_weights("half")

    batch = _rollout(model, n=8, group_ids=[0, 0, 0, 0, 1, 1, 1, 1])
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 1])

    def doubled(batch, *, conserve: bool = True):
        return 2 * uniform(batch.advantages, batch.step_mask, conserve=conserve)

    with registered_geometry("doubled", doubled):
        assert "doubled" in advantage_names()
        got = make_advantage("doubled")(batch, rewards, 0)
        assert torch.allclose(got, 2 * make_advantage("uniform")(batch, rewards, 0))
    assert "doubled" not in advantage_names()
    broadcast = make_advantage("uniform", conserve=False)(batch, rewards, 0)  # A_i on every turn's tokens
    want = make_advantage("grpo")(batch, rewards, 0)[:, None].expand_as(broadcast)
    assert torch.allclose(broadcast[batch.policy_mask], want[batch.policy_mask])
    a = make_advantage("shuffled", generator=torch.Generator().manual_seed(1))(batch, rewards, 0)
    b = make_advantage("shuffled", generator=torch.Generator().manual_seed(1))(batch, rewards, 0)
    assert torch.equal(a, b)
    with pytest.raises(ConfigError, match="advantage: uniform takes eps"):
        make_advantage("uniform", lam=0.3)
    with pytest.raises(ConfigError, match="advantage: grpo takes no parameters"):
        make_advantage("grpo", eps=0.1)


def _one_turn_batch(task, actions):
    """A RolloutBatch of one-turn episodes of ``task``, one per action (tokens are placeholders)."""
    envs = []
    for a in actions:
        env = ToolshopEnv(task)
        env.step(encode([*a.split(), "EOA"]))
        envs.append(env)
    B = len(envs)
    return RolloutBatch(
        tokens=torch.zeros(B, 3, dtype=torch.long), policy_mask=torch.tensor([[False, True, True]] * B),
        valid_mask=torch.ones(B, 3, dtype=torch.bool), rollout_logprobs=torch.zeros(B, 3),
        turn_ids=torch.tensor([[-1, 0, 0]] * B), records=[e.records for e in envs],
        success=torch.tensor([float(e.result()[0]) for e in envs]),
        progress=torch.tensor([e.result()[1] for e in envs]), truncated=torch.tensor([not e.wrote for e in envs]),
        n_calls=torch.ones(B, dtype=torch.long), tasks=[task] * B, group_ids=torch.zeros(B, dtype=torch.long))


def test_per_turn_credit_survives_a_write_that_undoes_progress():
    t = make_task(0, 2)
    other = next(i for i in t.store.orders[t.order]["items"] if i != t.item)
    other_variant = next(v for v in t.store.products[t.store.items[other]["product"]]["variants"]
                         if v != t.store.items[other]["variant"])
    batch = _one_turn_batch(t, [f"exchange {t.order} {t.item} {t.variant}",
                                f"exchange {t.order} {other} {other_variant}"])  # progress 1/3 -> 1 and -> 0
    deltas = turn_progress_deltas(batch)
    assert torch.allclose(deltas[:, 0], torch.tensor([2 / 3, -1 / 3]))  # the signed change
    for name in ("per_turn", "shuffled"):  # the geometries get its positive part (a negative one is refused)
        adv = make_advantage(name, generator=torch.Generator().manual_seed(0))(batch, batch.progress, 0)
        grpo = make_advantage("grpo")(batch, batch.progress, 0)
        assert torch.allclose(adv[:, 1:], grpo[:, None].expand(2, 2)), name  # one turn: all of A_i


def test_grpo_trainer_runs_logs_and_uses_pluggable_weights(model):
    m = TinyLM(model.cfg)
    m.load_state_dict(model.state_dict())
    seen = []

    def weights(old, rollout_lp, pm, vm):
        seen.append(pm.shape)
        return make_weights("interq")(old, rollout_lp, pm, vm)

    cfg = GRPOConfig(updates=2, tasks_per_update=3, group_size=2, chain_lengths=(2,), max_len=64,
                     rollout_precision="fp8", learner_precision="fp8", eval_every=2, eval_tasks=4)
    before = [p.clone() for p in m.parameters()]
    adv_calls = []

    def advantage(batch, rewards, update):  # random advantages: the update must move the weights
        adv_calls.append(update)
        return torch.randn(len(batch), generator=torch.Generator().manual_seed(update))

    state = torch.random.get_rng_state()
    rows = train_grpo(m, cfg, weights=weights, advantage=advantage)
    assert torch.equal(state, torch.random.get_rng_state())  # its own generators only
    assert adv_calls == [0, 1]
    assert len(rows) == 2 and len(seen) == 2
    for key in ("reward/success", "mismatch/k3", "loss/policy", "episode/truncation_rate",
                "episode/tool_calls", "grad_norm", "time/update_s", "correction/clip_rate"):
        assert key in rows[0], key
    assert "eval/success" in rows[0] and "eval/success" not in rows[1]
    assert any(not torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
    assert rows[0]["mismatch/k3"] >= 0


def test_prm_advantage_with_a_schedule_matches_core(model):
    """The registered ``prm`` geometry with a Schedule record (the lab's path and the integrations') equals
    core's PRM mixing bit for bit, and the weight it used is what the trainer reports."""
    from creditlab.core.advantages import prm_mixed_advantages
    from creditlab.core.schedules import Schedule
    from creditlab.train.toolshop_rollout import successful_read_scores, turn_mask_of

    batch = _rollout(model, n=8, group_ids=[0, 0, 0, 0, 1, 1, 1, 1])
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 1])
    lam = Schedule("decay", l0=1.0, start=2, end=4)
    fn = make_advantage("prm", conserve=False, step_scores=successful_read_scores, lam=lam)
    scores = successful_read_scores(batch)
    for k in (0, 3, 10):
        want = prm_mixed_advantages(rewards, scores, turn_mask_of(batch), batch.group_ids, lam(k))
        assert torch.equal(fn(batch, rewards, k), turns_to_tokens(want, batch))
    assert [fn.params_at(k) for k in (0, 3, 10)] == [{"lam": 1.0}, {"lam": 0.125}, {"lam": 0.0}]
    assert 0.0 < lam(3) < 1.0  # the weights differ, so the equality above is not 0 == 0 at every update
    # after the decay only the outcome remains: the GRPO advantage on every policy token
    out = fn(batch, rewards, 10)
    grpo = make_advantage("grpo")(batch, rewards, 0)
    pm = batch.policy_mask
    assert torch.allclose(out[pm], grpo[:, None].expand_as(out)[pm], atol=1e-6)


def test_the_trainer_reports_the_prm_weight_it_used(model):
    """``adv/lam`` in each update's row is the schedule's value at that update, read from the advantage the
    trainer called (a lab logs it from there, not from its own recomputation)."""
    from creditlab.core.schedules import Schedule
    from creditlab.train.toolshop_rollout import successful_read_scores

    m = TinyLM(model.cfg)
    m.load_state_dict(model.state_dict())
    cfg = GRPOConfig(updates=3, tasks_per_update=2, group_size=2, chain_lengths=(2,), max_len=64, eval_every=0)
    lam = Schedule("decay", l0=0.8, start=1, end=3, power=1)
    adv = make_advantage("prm", conserve=False, step_scores=successful_read_scores, lam=lam)
    rows = train_grpo(m, cfg, advantage=adv)
    assert [r["adv/lam"] for r in rows] == pytest.approx([0.8, 0.8, 0.4])
    plain = train_grpo(TinyLM(model.cfg), cfg)
    assert "adv/lam" not in plain[0]  # no scheduled parameter, nothing reported
