"""The granularity lab in its paper's regime: the multi-exchange task type, the repeat sweep judged by
``creditlab diagnose``, the teachers warm-started on their hints, and the gates measured before training."""

import random
from dataclasses import replace

import pandas as pd
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from creditlab.envs.toolshop import (
    MULTI_EXCHANGE,
    MULTI_SUB_CHAINS,
    MULTI_SUBTASKS,
    TOK,
    MultiTask,
    ToolshopEnv,
    encode,
    make_multi_task,
    make_task,
    run_scripted,
    verify,
)
from creditlab.errors import ConfigError, InputError
from creditlab.lab.protocol import run_lab
from creditlab.lab.store import ResultStore
from creditlab.labs.granularity import (
    LAB,
    MULTI_CHAIN_LENGTHS,
    REGIME_EXPERIMENTS,
    GranularityConfig,
    batch_stats,
    judge_turns,
    parse_repeats,
    process_scores,
    type_of_task,
)
from creditlab.train.opsd import correct_actions, episode_calls, privileged_demo
from creditlab.train.toolshop_base import BaseConfig
from creditlab.train.toolshop_grpo import GRPOConfig
from creditlab.train.toolshop_rollout import make_tasks

pytestmark = pytest.mark.usefixtures("one_thread")

CHAINS = (2, 3, 4, 7, 8)
TINY = dict(n_demos=64, steps=30, batch_size=16, d_model=32, n_layer=1)


# ---------------------------------------------------------------------------------------------
# the multi-exchange world


def test_multi_task_is_several_exchanges_of_distinct_items_on_one_store():
    t = make_multi_task(3)
    assert t == make_multi_task(3)  # deterministic
    assert len(t.subtasks) in MULTI_SUBTASKS and all(s.chain_length in MULTI_SUB_CHAINS for s in t.subtasks)
    assert len({s.item for s in t.subtasks}) == len(t.subtasks)
    assert all(s.store is t.store for s in t.subtasks)
    assert t.chain_length == sum(s.chain_length for s in t.subtasks)
    assert t.turn_budget == 2 * (t.chain_length + 2)
    # one prompt: the sub-tasks' instructions separated by TASK, existing tokens only
    toks = [k for k, v in TOK.items() for i in t.prompt_ids if v == i]
    assert t.prompt_ids == encode(["<bos>", "TASK", *t.instruction, "SEP"])
    assert t.instruction.count("TASK") == len(t.subtasks) - 1 and len(toks) == len(t.prompt_ids)
    assert max(t.prompt_ids) < TOK["think0"]  # no thought token, no new token
    with pytest.raises(ConfigError, match="n_subtasks"):
        make_multi_task(3, n_subtasks=0)


def test_noiseless_agent_solves_every_sub_task_in_c_turns():
    for seed in range(20):
        t = make_multi_task(seed)
        _, _, env = run_scripted(t, 0, noise=0.0)
        assert env.result() == (1.0, 1.0)
        assert len(env.records) == t.chain_length and not env.truncated
        assert env.max_turns == t.turn_budget
        assert sum(r.is_write for r in env.records) == len(t.subtasks)


def test_graded_outcome_hand_computed():
    t = make_multi_task(7, n_subtasks=3, sub_chains=(2,))
    a, b, c = t.subtasks
    env = ToolshopEnv(t)
    # solve the first sub-task only (its write is legal from the instruction's ids), then a wrong write
    env.step(encode(["exchange", a.order, a.item, a.variant]))
    assert not env.done  # one write of three: the episode goes on
    wrong = next(v for v in t.store.products[t.store.items[b.item]["product"]]["variants"]
                 if v != b.variant and v != t.store.items[b.item]["variant"]) if len(
        t.store.products[t.store.items[b.item]["product"]]["variants"]) > 2 else None
    if wrong is not None:
        env.step(encode(["exchange", b.order, b.item, wrong]))  # b's item changed to the wrong variant
        # solved: a (1 of 3); fields: a 2, b status only 1, c 0, others unchanged 1 -> 4 of 7
        assert env.result() == pytest.approx((1 / 3, 4 / 7))
    else:
        assert env.result() == pytest.approx((1 / 3, 3 / 7))  # a's 2 fields and "others unchanged"
    # an exchange of an item no sub-task names breaks "no other item changed"
    env2 = ToolshopEnv(t)
    other = next(i for i in t.store.items if i not in {s.item for s in t.subtasks})
    rec = t.store.items[other]
    v = next(w for w in t.store.products[rec["product"]]["variants"] if w != rec["variant"])
    env2.step(encode(["exchange", rec["order"], other, v]))
    assert env2.result() == (0.0, 0.0)
    # the budget ends an episode that never made all its writes: truncated
    env3 = ToolshopEnv(t, max_turns=2)
    env3.step(encode(["exchange", a.order, a.item, a.variant]))
    env3.step(encode(["get_product", a.item]))
    assert env3.done and env3.truncated and env3.result()[0] == pytest.approx(1 / 3)


def test_single_tasks_keep_their_budget_and_end_on_their_write():
    t = make_task(3, 4)
    env = ToolshopEnv(t)
    assert env.max_turns == t.chain_length + 2
    _, _, env = run_scripted(t, 0)
    assert env.done and not env.truncated and len(env.records) == 4
    assert verify(env.store, t) == (True, 1.0)


def test_make_tasks_code_for_multi_and_unchanged_single_tasks():
    seeds = range(100, 140)
    plain = make_tasks(seeds, CHAINS)
    mixed = make_tasks(seeds, MULTI_CHAIN_LENGTHS)
    assert all(p == make_task(s, p.chain_length) for s, p in zip(seeds, plain, strict=True))
    assert any(isinstance(m, MultiTask) for m in mixed) and any(not isinstance(m, MultiTask) for m in mixed)
    for s, m in zip(seeds, mixed, strict=True):
        if isinstance(m, MultiTask):
            assert m == make_multi_task(s) and type_of_task(m) == "multi"
        else:
            assert type_of_task(m) in ("short", "long")
    assert MULTI_EXCHANGE not in CHAINS


@given(seed=st.integers(0, 10_000), noise=st.floats(0.0, 0.6))
def test_noisy_multi_episodes_respect_budget_and_grading(seed, noise):
    t = make_multi_task(seed)
    ids, mask, env = run_scripted(t, seed, noise=noise)
    K = len(t.subtasks)
    share, progress = env.result()
    assert len(env.records) <= t.turn_budget
    assert share * K == pytest.approx(round(share * K)) and 0 <= progress <= 1
    writes = sum(r.is_write for r in env.records)
    assert (writes == K) == (not env.truncated)
    assert env.truncated == (len(env.records) == t.turn_budget and writes < K)
    assert len(ids) == len(mask)


def test_scripted_agent_moves_on_after_a_failed_exchange():
    # find an episode with a failed real exchange; the next action starts another sub-task
    for seed in range(400):
        t = make_multi_task(seed)
        _, _, env = run_scripted(t, seed, noise=0.5)
        recs = env.records
        for j, r in enumerate(recs[:-1]):
            if r.name == "exchange" and not r.ok and len(r.arguments) >= 3:
                firsts = {("get_order", "get_item", "get_product")[4 - s.chain_length] for s in t.subtasks}
                assert recs[j + 1].name in firsts | {"<malformed>", *("get_order", "get_item", "get_product",
                                                                     "exchange")}
                # it is not the same exchange again, unless the malformed-action noise hit
                if recs[j + 1].name == "exchange" and recs[j + 1].ok is False:
                    continue
                assert recs[j + 1].action != r.action
                return
    pytest.fail("no failed exchange in 400 noisy episodes")


def test_judge_turns_on_a_multi_task():
    t = make_multi_task(11)
    _, _, env = run_scripted(t, 0, noise=0.0)
    assert judge_turns(t, env.records) == [True] * t.chain_length
    assert len(episode_calls(t)) == t.chain_length
    env2 = ToolshopEnv(t)
    first = [k for k, v in TOK.items() if v == env.records[0].action[0]][0]
    act = list(env.records[0].action)
    env2.step(act)
    env2.step(act)  # the same correct read twice: the repeat is bad
    assert judge_turns(t, env2.records) == [True, False] and first in ("get_order", "get_item", "get_product")


# ---------------------------------------------------------------------------------------------
# the warm start of the teachers


def test_privileged_demos_carry_the_teachers_formats():
    kinds = {"plain": 0, "ref": 0, "advice": 0}
    for j in range(200):
        task = make_task(j, (2, 3, 4, 7, 8)[j % 5])
        plain_ids, plain_mask, _ = run_scripted(task, j, noise=0.2)
        ids, mask = privileged_demo(task, j, 0.2, 0.5)
        P = len(task.prompt_ids)
        write = [*correct_actions(task)[-1], TOK["EOA"]]
        assert len(ids) == len(mask)
        if (ids, mask) == (plain_ids, plain_mask):
            kinds["plain"] += 1
        elif ids[P - 1:P - 1 + len(write)] == write and not any(mask[:P - 1 + len(write)]):
            kinds["ref"] += 1  # the answer before SEP, then the noiseless episode writing it
            clean, _, env = run_scripted(task, j, noise=0.0)
            assert ids[:P - 1] + ids[P - 1 + len(write):] == clean and env.result()[0]
        else:
            kinds["advice"] += 1  # the noisy episode up to a turn, SEP <next correct action> SEP, that action
            sep = [p for p, t in enumerate(ids) if t == TOK["SEP"]]
            a, b = sep[-2], sep[-1]
            advised = ids[a + 1:b]
            assert ids[b + 1:] == [*advised, TOK["EOA"]] and all(mask[b + 1:]) and not any(mask[a:b + 1])
            assert tuple(advised) in {tuple(x) for x in correct_actions(task)}
            assert ids[:a] == plain_ids[:a] and mask[:a] == plain_mask[:a]
    assert all(v > 30 for v in kinds.values()), kinds  # about half plain, a quarter of each hint
    with pytest.raises(ConfigError, match="privileged"):
        privileged_demo(make_task(0, 4), 0, 0.2, 1.5)
    with pytest.raises(InputError):
        privileged_demo(make_multi_task(0), 0, 0.2, 0.5)
    assert privileged_demo(make_task(0, 4), 0, 0.2, 0.0) == tuple(run_scripted(make_task(0, 4), 0, 0.2)[:2])


def test_base_cache_keys_of_existing_configs_are_unchanged():
    # the lab's base policy (recorded before the new fields existed) keeps its cache entry's name
    assert BaseConfig(chain_lengths=CHAINS).key() == "6da9324bc2f063e1"
    assert BaseConfig(chain_lengths=CHAINS, privileged=0.5).key() != BaseConfig(chain_lengths=CHAINS).key()
    cfg = GranularityConfig()
    assert len({b.key() for b in (cfg.base, cfg.multi_base, cfg.warm_base)}) == 3


# ---------------------------------------------------------------------------------------------
# options and validation


def test_repeats_option_parsed_and_checked():
    assert parse_repeats("0.25,0.5,0.75,1.0") == (0.25, 0.5, 0.75, 1.0)
    for bad in ("", "x", "0.5,2", "0.5,0.5"):
        with pytest.raises(ConfigError) as err:
            replace(GranularityConfig.quick(), repeats=bad).validate()
        assert err.value.parameter == "repeats"
    assert any(o.name == "repeats" for o in LAB.options)
    with pytest.raises(ConfigError, match="--experiment"):
        replace(GranularityConfig(), experiments=("nope",)).validate()
    with pytest.raises(ConfigError, match="multi_max_len"):
        replace(GranularityConfig(), multi_max_len=1000).validate()
    assert set(REGIME_EXPERIMENTS) <= set(GranularityConfig.quick().experiments)
    assert GranularityConfig().experiments == ("grpo", "prm_fixed", "prm_decay", "opsd_ref", "opsd_advice")


# ---------------------------------------------------------------------------------------------
# the regime experiments on the protocol (tiny models: mechanics, not results)


@pytest.fixture(scope="module")
def tiny_cfg(tmp_path_factory):
    cache = tmp_path_factory.mktemp("regime-cache")
    return GranularityConfig(base=BaseConfig(**TINY, max_len=192, chain_lengths=CHAINS),
                             multi_base=BaseConfig(**TINY, max_len=320, chain_lengths=MULTI_CHAIN_LENGTHS),
                             warm_base=BaseConfig(**TINY, max_len=192, chain_lengths=CHAINS, privileged=0.5),
                             budget_base=BaseConfig(**TINY, max_len=320, chain_lengths=MULTI_CHAIN_LENGTHS),
                             grpo=GRPOConfig(updates=4, tasks_per_update=2, group_size=2, chain_lengths=CHAINS,
                                             eval_every=2),
                             seeds=1, eval_per_type=3, repeats="0.25,1.0", cache_dir=str(cache),
                             experiments=REGIME_EXPERIMENTS)


def test_regime_experiments_write_gates_verdicts_and_predictions(tmp_path, tiny_cfg):
    out = tmp_path / "run"
    run_lab(LAB, tiny_cfg, out, progress=False)
    for name in ("gates", "multi_means", "multi_mixing", "sweep", "sweep_runs", "warm_means", "warm_opsd",
                 "warm_teachers", "budget_gate", "budget_means", "budget_diffs", "predictions"):
        assert (out / f"{name}.parquet").exists(), name
    for png in ("granularity_multi", "granularity_sweep", "granularity_warm_opsd", "granularity_budget"):
        assert (out / f"{png}.png").stat().st_size > 0
    gates = pd.read_parquet(out / "gates.parquet")
    assert set(gates["experiment"]) == {"multi", "repeat", "warm", "budget"}
    runs = pd.read_parquet(out / "sweep_runs.parquet")
    assert len(runs) == 2 * 2 and set(runs["status"]) <= {"ok", "warn", "fail", "skipped"}
    assert set(runs["repeat"]) == {0.25, 1.0}
    mm = pd.read_parquet(out / "multi_mixing.parquet")
    assert list(mm["type"]) == ["short", "long", "multi"]
    pred = pd.read_parquet(out / "predictions.parquet")
    assert {p.split(":")[0] for p in pred["prediction"]} == {"M1", "M2", "M3", "R1", "R2", "W1", "W2", "W3", "B1",
                                                            "B2", "B3"}
    mm_arms = pd.read_parquet(out / "multi_means.parquet")["arm"]
    assert set(mm_arms) == {"grpo", "prm_fixed", "prm_decay"}  # the fixed weight runs in multi
    bm = pd.read_parquet(out / "budget_means.parquet")
    assert set(zip(bm["budget"], bm["arm"], strict=True)) == {("c2", "grpo"), ("c2", "prm_fixed"), ("long", "grpo"),
                                                              ("long", "prm_fixed"), ("long", "prm_decay")}
    bd = pd.read_parquet(out / "budget_diffs.parquet")
    assert set(bd["diff"]) == {"prm_fixed - grpo", "prm_decay - grpo", "grpo: long - C + 2",
                               "prm_fixed: long - C + 2"}
    # the mean turn score is linear in repeat: m(1) - m(0.25) = 0.75 x the share of repeated reads
    store = ResultStore(out / "store").frame()
    ts = store[store["gate"] == "turn_score"].set_index("repeat")
    share = float(ts.loc[0.25, "share_repeats"]) if "share_repeats" in ts else 0.0
    if share == share:  # not NaN
        assert ts.loc[1.0, "mean_turn_score"] - ts.loc[0.25, "mean_turn_score"] == pytest.approx(0.75 * share,
                                                                                                   abs=1e-6)
    # more seeds reuse the first seed's cells: their keys do not hold the count of seeds
    before = set(store["cell_key"])
    more = LAB.cells(replace(tiny_cfg, seeds=2))
    keys = {c.key for c in more if c.group != "gates"}
    assert {k for k in before if not k.startswith("gates")} <= keys


def test_multi_batch_stats_have_the_multi_type(tiny_cfg):
    from creditlab.train.toolshop_base import base_policy
    from creditlab.train.toolshop_rollout import rollout

    model = base_policy(tiny_cfg.multi_base, cache_dir=tiny_cfg.cache_dir)
    tasks = make_tasks(range(60, 75), MULTI_CHAIN_LENGTHS)
    batch = rollout(model, tasks, max_len=320, generator=torch.Generator().manual_seed(0))
    row = batch_stats(batch, 0.25)
    multi = [b for b, t in enumerate(batch.tasks) if isinstance(t, MultiTask)]
    assert multi and row["multi/success"] == pytest.approx(float(batch.success[multi].mean()))
    ps = process_scores(batch, 0.25)
    assert ps.shape == (len(batch), batch.n_turns_max)
    for b in multi:  # the graded outcome: a multiple of 1/K
        K = len(batch.tasks[b].subtasks)
        assert float(batch.success[b]) * K == pytest.approx(round(float(batch.success[b]) * K))
    random.Random(0)


def test_a_base_policy_starts_from_another_with_a_shorter_context(tmp_path):
    from creditlab.train.toolshop_base import base_policy

    small = BaseConfig(**{**TINY, "steps": 3}, max_len=96, chain_lengths=(2,))
    a = base_policy(small, cache_dir=tmp_path)
    # one step at a vanishing learning rate: the weights are the initial ones up to that step
    big = BaseConfig(**{**TINY, "steps": 1}, max_len=128, chain_lengths=(2,), lr=1e-12, init=small.key())
    b = base_policy(big, cache_dir=tmp_path)
    wa, wb = a.state_dict(), b.state_dict()
    for name, w in wa.items():
        got = wb[name][:w.shape[0]] if name == "pos.weight" else wb[name]
        assert torch.allclose(got, w, atol=1e-9), name
    assert wb["pos.weight"].shape[0] == 128
    fresh = base_policy(replace(big, init=""), cache_dir=None)
    assert not torch.allclose(fresh.state_dict()["tok.weight"], wb["tok.weight"])
    with pytest.raises(ConfigError, match="base.init"):
        base_policy(replace(big, init="0" * 16, seed=1), cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="base.init"):  # a longer model's weights do not fit a shorter one
        base_policy(replace(small, init=big.key(), seed=2), cache_dir=tmp_path)
