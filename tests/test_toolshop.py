"""toolshop world: deterministic generation, verifier on hand-built episodes, robustness, chain length."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from creditlab.core.diagnostics import chain_length
from creditlab.envs.toolshop import (
    EOA,
    TOK,
    VOCAB,
    ScriptedAgent,
    ToolshopEnv,
    decode,
    encode,
    make_store,
    make_task,
    run_scripted,
    tool_chain,
    verify,
    world_stats,
)
from creditlab.errors import ConfigError, InputError


def act(env, *toks):
    return env.step(encode([*toks, "EOA"]))


def test_store_and_task_generation_is_deterministic():
    assert make_store(3) == make_store(3)
    assert make_store(3) != make_store(4)
    a, b = make_task(11, 6), make_task(11, 6)
    assert a.instruction == b.instruction and a.store == b.store and (a.order, a.item, a.variant) == (
        b.order, b.item, b.variant)
    ids, mask, _ = run_scripted(a, seed=5, noise=0.3)
    assert (ids, mask) == run_scripted(b, seed=5, noise=0.3)[:2]


def test_ids_are_globally_distinct_and_instruction_hides_the_write_arguments():
    for seed in range(20):
        st_ = make_store(seed)
        all_ids = [*st_.cases, *st_.tickets, *st_.users, *st_.orders, *st_.items, *st_.products,
                   *st_.variants]
        assert len(all_ids) == len(set(all_ids))
        for C in range(2, 9):
            t = make_task(seed, C)
            assert str(t.variant) not in t.instruction
            if C >= 4:
                assert str(t.item) not in t.instruction
            if C >= 5:
                assert str(t.order) not in t.instruction


def test_verifier_on_hand_built_episodes():
    t = make_task(0, 4)
    st_ = t.store
    prod = st_.items[t.item]["product"]
    wrong_variant = st_.items[t.item]["variant"]  # the current one: never the goal
    other_item = next(i for i in st_.orders[t.order]["items"] if i != t.item)
    other_variant = st_.items[other_item]["variant"]

    # the correct episode, typed by hand
    env = ToolshopEnv(t)
    r = act(env, "get_order", t.order)
    obs = decode(r.observation)
    assert obs[0] == "OBS" and obs[obs.index(str(t.item)) - 1] == t.category  # "category item" pairs
    act(env, "get_item", t.item)
    r = act(env, "get_product", prod)
    assert str(t.variant) in decode(r.observation)
    r = act(env, "exchange", t.order, t.item, t.variant)
    assert decode(r.observation) == ["OBS", "OK", "EOO"] and r.done and r.record.is_write
    assert env.result() == (True, 1.0) and not env.truncated

    # right item, wrong variant: status field right, variant wrong, others unchanged -> 2/3
    env = ToolshopEnv(t)
    act(env, "exchange", t.order, t.item, wrong_variant)
    assert env.result() == (False, pytest.approx(2 / 3))

    # wrong item: target untouched (variant, status wrong) and another item changed -> 0
    env = ToolshopEnv(t)
    act(env, "exchange", t.order, other_item, other_variant)
    assert env.result() == (False, 0.0)

    # no write at all: only "others unchanged" holds; the budget truncates the episode
    env = ToolshopEnv(t, max_turns=2)
    act(env, "get_order", t.order)
    r = act(env, "get_order", t.order)
    assert r.done and env.truncated and env.result() == (False, pytest.approx(1 / 3))

    # guards: the attribute the agent expects must match, else an error and nothing changes
    env = ToolshopEnv(t)
    r = act(env, "get_item", t.category, t.item)
    assert r.record.ok and r.record.arguments == {"item": t.item, "category": t.category}
    other_cat = next(c for c in ("shirt", "lamp", "mug", "shoe", "desk", "bag") if c != t.category)
    assert not act(env, "get_item", other_cat, t.item).record.ok
    other_color = next(c for c in ("red", "blue", "green", "black", "white", "gray") if c != t.color)
    r = act(env, "exchange", t.order, t.item, other_color, t.variant)
    assert not r.record.ok and not r.done
    r = act(env, "exchange", t.order, t.item, t.color, t.variant)
    assert r.record.ok and r.done and env.result() == (True, 1.0)
    assert r.record.arguments == {"order": t.order, "item": t.item, "variant": t.variant, "color": t.color}

    # a variant of another product is refused (error, no state change, episode goes on)
    env = ToolshopEnv(t)
    r = act(env, "exchange", t.order, t.item, other_variant)
    if other_variant not in st_.products[prod]["variants"]:
        assert decode(r.observation) == ["OBS", "ERR", "EOO"] and not r.done and not r.record.ok
        assert verify(env.store, t) == (False, pytest.approx(1 / 3))


@given(seed=st.integers(0, 10**6), C=st.integers(2, 8),
       action=st.lists(st.integers(0, len(VOCAB) - 1), max_size=8))
def test_malformed_actions_never_crash(seed, C, action):
    env = ToolshopEnv(make_task(seed, C))
    r = env.step(action)
    toks = decode(r.observation)
    assert toks[0] == "OBS" and toks[-1] == "EOO"
    assert r.record.ok or toks == ["OBS", "ERR", "EOO"]
    assert isinstance(r.record.arguments, dict) and isinstance(r.record.returned, list)


def test_bad_inputs_raise_typed_errors():
    with pytest.raises(ConfigError, match="chain_length"):
        make_task(0, 9)
    with pytest.raises(ConfigError, match="chain_length"):
        tool_chain(1)
    with pytest.raises(InputError, match="vocabulary"):
        encode(["frobnicate"])
    env = ToolshopEnv(make_task(0, 2))
    env.step(encode(["exchange", "1", "2", "3"]))
    env.done = True
    with pytest.raises(InputError, match="episode is over"):
        env.step([EOA])


@pytest.mark.parametrize("C", range(2, 9))
def test_chain_length_by_dataflow_on_scripted_trajectories(C):
    for seed in range(5):
        t = make_task(seed, C)
        ids, mask, env = run_scripted(t, seed=seed)
        assert env.result() == (True, 1.0)
        assert [r.name for r in env.records] == list(tool_chain(C))
        assert chain_length(env.records, t.given) == C
        assert sum(r.is_write for r in env.records) / len(env.records) == pytest.approx(
            world_stats(C)["write_fraction"])
        # policy tokens are exactly the actions
        acts = [tok for tok, m in zip(ids, mask, strict=True) if m]
        assert acts.count(TOK["EOA"]) == C


def test_chain_length_on_hand_built_trajectory_with_a_detour_and_an_error():
    t = make_task(2, 5)
    env = ToolshopEnv(t)
    r_user = act(env, "get_user", t.user).record
    act(env, "get_item", 9999 % 128)           # a detour: unrelated (probably failing) read
    act(env, "get_order", t.order)
    act(env, "get_item", t.item)
    prod = t.store.items[t.item]["product"]
    act(env, "get_product", prod)
    act(env, "exchange", t.order, t.item, t.variant)
    assert r_user.ok and env.result()[0]
    assert chain_length(env.records, t.given) == 5
    # C=3 gives the order and the item: the write only depends on get_item -> get_product
    t3 = make_task(2, 3)
    env = ToolshopEnv(t3)
    act(env, "get_order", t3.order)           # an unnecessary read (its values are given)
    act(env, "get_item", t3.item)
    act(env, "get_product", t3.store.items[t3.item]["product"])
    act(env, "exchange", t3.order, t3.item, t3.variant)
    assert chain_length(env.records, t3.given) == 3


def test_noisy_demonstrator_is_middling_and_exact_without_noise():
    succ = [run_scripted(make_task(s, 4), seed=s, noise=0.2)[2].result()[0] for s in range(300)]
    assert 0.4 < sum(succ) / 300 < 0.85
    agent = ScriptedAgent(make_task(1, 4), random.Random(0), noise=0.0)
    assert agent.act()[0] == "get_order"


def test_world_stats():
    assert world_stats(4) == {"chain_length": 4.0, "write_fraction": 0.25, "verifier_density": 0.25}


def test_trajectory_stats():
    from creditlab.envs.toolshop import trajectory_stats

    t = make_task(4, 4)
    _, _, env = run_scripted(t, seed=0)
    assert trajectory_stats(env.records) == {"tool_calls": 4.0, "write_fraction": 0.25, "error_rate": 0.0}
    assert trajectory_stats([])["write_fraction"] == 0.0
