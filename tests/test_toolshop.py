"""toolshop world: deterministic generation, verifier on hand-built episodes, robustness, chain length,
the tool table."""

import hashlib
import random
from collections import Counter
from dataclasses import fields

import pytest
from hypothesis import given
from hypothesis import strategies as st

from creditlab.core.diagnostics import chain_length
from creditlab.envs.toolshop import (
    EOA,
    READ_TOOLS,
    TOK,
    TOOL_TABLE,
    TOOLS,
    VOCAB,
    WRITE_TOOLS,
    ScriptedAgent,
    Task,
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


# ----------------------------------------------------------------------------------------------
# The tool table
# ----------------------------------------------------------------------------------------------


def test_tool_table_is_the_one_definition_of_the_tools():
    assert TOOLS == tuple(TOOL_TABLE) == ("get_case", "get_ticket", "find_user", "get_user", "get_order",
                                          "get_item", "get_product", "exchange")
    assert READ_TOOLS == TOOLS[:-1] and WRITE_TOOLS == ("exchange",)
    assert VOCAB[9:17] == TOOLS and len(VOCAB) == 178  # token ids unchanged
    task_fields = {f.name for f in fields(Task)}
    for name, tool in TOOL_TABLE.items():
        assert tool.name == name and tool.arity == len(tool.arg_kinds) >= 1
        assert set(tool.arg_kinds) <= {"id", "name"}
        if tool.guard is not None:
            assert tool.guard in task_fields and 0 <= tool.guard_pos <= tool.arity
        assert tool.listed_by is None or tool.listed_by in task_fields
    # the chain's dataflow: what a read returns is an argument of the next tool, and the attribute a
    # listing read selects by is the next tool's guard
    for a, b in zip(TOOLS, TOOLS[1:], strict=False):
        ta, tb = TOOL_TABLE[a], TOOL_TABLE[b]
        assert ta.returns in tb.arg_names, a
        if ta.listed_by is not None:
            assert tb.guard == ta.listed_by, a


# (action, observation, error, arguments) on make_task(0, 8), each in a fresh episode; recorded from
# the world before its tools were a table.
_TOOL_CASES = [
    ("get_case 35", "OBS 118 EOO", "", {"case": 35}),
    ("get_case 36", "OBS ERR EOO", "case 36 not found", {"case": 36}),
    ("get_ticket 118", "OBS fay EOO", "", {"ticket": 118}),
    ("get_ticket 35", "OBS ERR EOO", "ticket 35 not found", {"ticket": 35}),
    ("find_user fay", "OBS 88 EOO", "", {"name": "fay"}),
    ("find_user ann", "OBS ERR EOO", "name ann not found", {"name": "ann"}),
    ("find_user 88", "OBS ERR EOO", "argument '88' is not a name", {}),
    ("get_user 88", "OBS delivered 19 pending 8 EOO", "", {"user": 88}),
    ("get_user 8", "OBS ERR EOO", "user 8 not found", {"user": 8}),
    ("get_order 8", "OBS desk 0 bag 82 mug 56 EOO", "", {"order": 8}),
    ("get_order pending 8", "OBS desk 0 bag 82 mug 56 EOO", "", {"order": 8, "status": "pending"}),
    ("get_order delivered 8", "OBS ERR EOO", "order 8 is not delivered", {"order": 8, "status": "delivered"}),
    ("get_order 8 9", "OBS ERR EOO", "get_order takes 1 argument(s), got 2", {}),
    ("get_order 88", "OBS ERR EOO", "order 88 not found", {"order": 88}),
    ("get_item 82", "OBS 119 EOO", "", {"item": 82}),
    ("get_item bag 82", "OBS 119 EOO", "", {"item": 82, "category": "bag"}),
    ("get_item mug 82", "OBS ERR EOO", "item 82 is not a mug", {"item": 82, "category": "mug"}),
    ("get_item bag", "OBS ERR EOO", "argument 'bag' is not an id", {}),
    ("get_product 119", "OBS black 11 red 1 EOO", "", {"product": 119}),
    ("get_product 82", "OBS ERR EOO", "product 82 not found", {"product": 82}),
    ("exchange 8 82 11", "OBS OK EOO", "", {"order": 8, "item": 82, "variant": 11}),
    ("exchange 8 82 black 11", "OBS OK EOO", "", {"order": 8, "item": 82, "variant": 11, "color": "black"}),
    ("exchange 8 82 red 11", "OBS ERR EOO", "variant 11 is not red",
     {"order": 8, "item": 82, "variant": 11, "color": "red"}),
    ("exchange 8 0 11", "OBS ERR EOO", "variant 11 is not a variant of item 0's product",
     {"order": 8, "item": 0, "variant": 11}),
    ("exchange 19 82 11", "OBS ERR EOO", "item 82 is not in order 19", {"order": 19, "item": 82, "variant": 11}),
    ("exchange 8 82 1 11", "OBS ERR EOO", "exchange takes 3 argument(s), got 4", {}),
    ("exchange 8 fay 11", "OBS ERR EOO", "argument 'fay' is not an id", {}),
    ("get_case", "OBS ERR EOO", "get_case takes 1 argument(s), got 0", {}),
    ("EOO", "OBS ERR EOO", "action does not start with a tool name", {}),
    ("", "OBS ERR EOO", "action does not start with a tool name", {}),
    ("TASK 35", "OBS ERR EOO", "action does not start with a tool name", {}),
]


@pytest.mark.parametrize(("action", "observation", "error", "arguments"), _TOOL_CASES)
def test_each_tool_behaves_as_recorded(action, observation, error, arguments):
    t = make_task(0, 8)
    env = ToolshopEnv(t)
    r = env.step(encode([*action.split(), "EOA"]))
    rec = r.record
    assert " ".join(decode(r.observation)) == observation
    assert (rec.error, rec.arguments, rec.ok) == (error, arguments, not error)
    tool = TOOL_TABLE.get(action.split()[0]) if action else None
    assert rec.name == (tool.name if tool else "<malformed>")
    assert rec.is_write == (rec.ok and tool.is_write) and r.done == rec.is_write
    assert verify(env.store, t)[0] == (rec.is_write and rec.arguments["variant"] == t.variant)
    if not rec.is_write:
        assert env.store == t.store  # reads and failures change nothing


# run_scripted on 40 seeds x C = 2..8: successes per C, calls and successful calls per tool, and a
# hash of every token, mask and turn record; recorded from the world before its tools were a table.
_SCRIPTED = {
    0.0: ({2: 40, 3: 40, 4: 40, 5: 40, 6: 40, 7: 40, 8: 40},
          {"exchange": 280, "find_user": 120, "get_case": 40, "get_item": 240, "get_order": 200,
           "get_product": 280, "get_ticket": 80, "get_user": 160},
          {"exchange": 280, "find_user": 120, "get_case": 40, "get_item": 240, "get_order": 200,
           "get_product": 280, "get_ticket": 80, "get_user": 160},
          "9e789c2dc6cbdc2f"),
    0.3: ({2: 30, 3: 32, 4: 19, 5: 8, 6: 15, 7: 10, 8: 7},
          {"<malformed>": 24, "exchange": 298, "find_user": 123, "get_case": 56, "get_item": 244,
           "get_order": 207, "get_product": 283, "get_ticket": 80, "get_user": 171},
          {"<malformed>": 0, "exchange": 275, "find_user": 120, "get_case": 40, "get_item": 240,
           "get_order": 200, "get_product": 279, "get_ticket": 80, "get_user": 160},
          "100b86a2c9bde751"),
}


@pytest.mark.parametrize("noise", sorted(_SCRIPTED))
def test_scripted_episodes_reach_every_tool_as_recorded(noise):
    h = hashlib.sha256()
    succ, calls, ok = Counter(), Counter(), Counter()
    for C in range(2, 9):
        for s in range(40):
            ids, mask, env = run_scripted(make_task(s, C), seed=s, noise=noise)
            succ[C] += env.result()[0]
            h.update(repr((ids, mask)).encode())
            for r in env.records:
                calls[r.name] += 1
                ok[r.name] += r.ok
                h.update(repr((r.name, r.arguments, r.returned, r.is_write, r.ok, r.error, r.action,
                               r.observation)).encode())
    want_succ, want_calls, want_ok, want_hash = _SCRIPTED[noise]
    assert (dict(succ), dict(calls), dict(ok)) == (want_succ, want_calls, want_ok)
    assert set(TOOLS) <= {n for n, k in ok.items() if k}  # every tool of the table is reached and works
    assert h.hexdigest()[:16] == want_hash
