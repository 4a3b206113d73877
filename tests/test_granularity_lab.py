"""The granularity lab: its process scorer, turn judge, privileged teachers, OPSD trainer, and the lab."""

import json
from dataclasses import replace

import pandas as pd
import pytest
import torch

from creditlab.envs.toolshop import TOK, ToolshopEnv, TurnRecord, encode, make_task, run_scripted
from creditlab.errors import ConfigError
from creditlab.lab.protocol import run_lab
from creditlab.labs.granularity import (
    ARMS,
    LAB,
    TASK_TYPES,
    GranularityConfig,
    batch_stats,
    judge_turns,
    process_scores,
)
from creditlab.rewards.process import evidence_scores
from creditlab.train.opsd import correct_actions, teacher_contexts, teacher_logits, train_opsd
from creditlab.train.toolshop_base import BaseConfig
from creditlab.train.toolshop_grpo import GRPOConfig
from creditlab.train.toolshop_rollout import make_tasks, rollout

CHAINS = (2, 3, 4, 7, 8)
TINY_BASE = BaseConfig(n_demos=64, steps=30, batch_size=16, d_model=32, n_layer=1, max_len=192, chain_lengths=CHAINS)
TINY_GRPO = GRPOConfig(updates=3, tasks_per_update=2, group_size=2, chain_lengths=CHAINS, eval_every=2)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def batch(tiny_base):
    tasks = [t for t in make_tasks(range(40, 46), CHAINS) for _ in range(2)]
    return rollout(tiny_base, tasks, max_len=160, generator=torch.Generator().manual_seed(0),
                   group_ids=[j // 2 for j in range(len(tasks))])


def _missing_id(task):
    st = task.store
    return next(i for i in range(128) if all(i not in t for t in (st.orders, st.items, st.variants, st.users)))


def _episode(task, actions):
    env = ToolshopEnv(task)
    for a in actions:
        env.step(encode(a.split()))
    return env.records


# ---------------------------------------------------------------------------------------------
# the process scorer and the turn judge


def test_evidence_scores_on_a_correct_episode_and_a_padded_one():
    task = make_task(3, 4)
    _, _, env = run_scripted(task, 0, noise=0.0)
    assert evidence_scores(env.records, task.given) == [1.0, 1.0, 1.0, 0.0]  # three new reads, then the write
    read = f"get_order {task.order}"
    gone = _missing_id(task)
    recs = _episode(task, [read, read, f"get_order {gone}", f"exchange {gone} {gone} {gone}"])
    # a new read, the same read again (nothing new), an error, a failed write
    assert evidence_scores(recs, task.given, repeat=0.25) == [1.0, 0.25, 0.0, 0.0]
    assert evidence_scores(recs, task.given, repeat=0.0)[1] == 0.0
    with pytest.raises(ConfigError, match="repeat"):
        evidence_scores(recs, repeat=2.0)


def test_evidence_scores_of_dump_turns_match_records():
    task = make_task(5, 3)
    _, _, env = run_scripted(task, 1, noise=0.5)
    as_dicts = [{"returned": r.returned, "is_write": r.is_write, "ok": r.ok} for r in env.records]
    assert evidence_scores(as_dicts, task.given) == evidence_scores(env.records, task.given)


def test_judge_turns_golden():
    task = make_task(3, 4)
    _, _, env = run_scripted(task, 0, noise=0.0)
    assert judge_turns(task, env.records) == [True] * 4
    read = f"get_order {task.order}"
    recs = _episode(task, [read, read, f"get_order {_missing_id(task)}"])
    assert judge_turns(task, recs) == [True, False, False]  # a repeat and an error are bad
    # the correct actions are the scripted agent's, the last one the write
    acts = correct_actions(task)
    assert len(acts) == 4 and acts[-1][0] == TOK["exchange"]


def test_judge_and_scores_on_a_malformed_turn():
    task = make_task(3, 2)
    recs = [TurnRecord("<malformed>", {}, [], False, False, "bad")]
    assert judge_turns(task, recs) == [False]
    assert evidence_scores(recs) == [0.0]


def test_batch_stats_per_type_and_mixing(batch):
    row = batch_stats(batch, 0.25)
    types = {("short" if t.chain_length <= 4 else "long") for t in batch.tasks}
    for t in types:
        assert 0 <= row[f"{t}/success"] <= 1 and 0 <= row[f"{t}/mixing"] <= 1
    assert row["success"] == pytest.approx(float(batch.success.mean()))
    assert row["tool_calls"] == pytest.approx(float(batch.n_calls.float().mean()))
    ps = process_scores(batch, 0.25)
    assert ps.shape == (len(batch), batch.n_turns_max)
    for b in range(len(batch)):  # off the turns taken the score is 0
        assert bool((ps[b, int(batch.n_calls[b]):] == 0).all())


# ---------------------------------------------------------------------------------------------
# privileged teachers


@pytest.mark.parametrize("kind", ["ref", "advice"])
def test_teacher_contexts_hold_the_student_tokens_after_the_privileged_ones(batch, kind):
    seqs, where = teacher_contexts(batch, kind)
    assert len(seqs) == len(where)
    n_turns = 0
    for seq, (b, first, shift) in zip(seqs, where, strict=True):
        student = batch.tokens[b].tolist()
        tail = seq[first + shift:]
        assert tail == student[first:first + len(tail)]
        assert seq[:first] == student[:first]
        inserted = seq[first:first + shift]
        task = batch.tasks[b]
        if kind == "ref":
            assert inserted == [*correct_actions(task)[-1], TOK["EOA"]]
            assert len(tail) == int(batch.valid_mask[b].sum()) - first
        else:
            assert inserted[0] == inserted[-1] == TOK["SEP"] and tuple(inserted[1:-1]) in correct_actions(task)
            assert bool(batch.policy_mask[b, first:first + len(tail)].all())  # exactly one action
            n_turns += 1
    if kind == "advice":
        assert n_turns == int(batch.n_calls.sum())


@pytest.mark.parametrize("kind", ["ref", "advice"])
def test_placebo_contexts_hold_another_task_s_tokens_in_the_same_place(batch, kind):
    donors = batch.tasks[2:] + batch.tasks[:2]  # groups of 2: a different task for every trajectory
    own, where = teacher_contexts(batch, kind)
    other, where_p = teacher_contexts(batch, kind, donors)
    assert [w[:2] for w in where] == [w[:2] for w in where_p]
    for (b, first, shift), seq in zip(where_p, other, strict=True):
        inserted = seq[first:first + shift]
        if kind == "ref":
            assert inserted == [*correct_actions(donors[b])[-1], TOK["EOA"]]
        else:
            assert tuple(inserted[1:-1]) in correct_actions(donors[b])
    assert own != other


@pytest.mark.parametrize("kind", ["ref", "advice"])
def test_teacher_logits_equal_one_sequence_at_a_time(tiny_base, batch, kind):
    got = teacher_logits(tiny_base, batch, kind, chunk=5)
    seqs, where = teacher_contexts(batch, kind)
    want = torch.zeros_like(got)
    with torch.no_grad():
        for seq, (b, first, shift) in zip(seqs, where, strict=True):
            logits = tiny_base(torch.tensor([seq]))[0]
            for p in range(max(first, 1), len(seq) - shift):
                want[b, p] = logits[p + shift - 1]
    pm = batch.policy_mask
    assert torch.allclose(got[pm], want[pm], atol=1e-5)


def test_opsd_with_a_teacher_that_sees_nothing_more_is_at_kl_zero(tiny_base):
    """If the privileged tokens are dropped the teacher is the student: KL 0 and no gradient."""
    import creditlab.train.opsd as gran

    cfg = replace(TINY_GRPO, updates=1)
    original = gran.teacher_contexts

    def no_privilege(batch, kind, donors=None):
        seqs, where = original(batch, kind, donors)
        return ([s[:first] + s[first + shift:] for s, (_, first, shift) in zip(seqs, where, strict=True)],
                [(b, first, 0) for b, first, _ in where])

    gran.teacher_contexts = no_privilege
    try:
        rows = train_opsd(_copy(tiny_base), _copy(tiny_base), cfg, "ref")
    finally:
        gran.teacher_contexts = original
    assert rows[0]["opsd/reverse_kl"] == pytest.approx(0.0, abs=1e-6)
    assert rows[0]["loss/opsd"] == pytest.approx(0.0, abs=1e-6)


def _copy(m):
    import copy

    return copy.deepcopy(m)


def test_train_opsd_rows(tiny_base):
    model, teacher = _copy(tiny_base), _copy(tiny_base)
    rows = train_opsd(model, teacher, TINY_GRPO, "advice")
    assert [r["update"] for r in rows] == [0.0, 1.0, 2.0]
    for r in rows:
        assert r["opsd/reverse_kl"] >= 0 and r["opsd/forward_kl"] >= 0
        assert 0 <= r["grad/clipped"] <= TINY_GRPO.minibatches
        assert 0 < r["opsd/kl_top_share"] <= 1 and 0 < r["opsd/kl_top_token_share"] <= 1
    # the teacher is frozen, the student moved
    assert all(torch.equal(a, b) for a, b in zip(teacher.parameters(), tiny_base.parameters(), strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), tiny_base.parameters(), strict=True))


# ---------------------------------------------------------------------------------------------
# configuration


def test_schedule_is_scaled_to_the_run():
    cfg = GranularityConfig()
    assert cfg.grpo.updates == 50
    lam = cfg.schedule("prm_decay")
    assert lam(19) == 0.5 and lam(20) == 0.5 and lam(30) == 0.0
    assert lam(25) == pytest.approx(0.5 * 0.5 ** 3)
    short = replace(cfg, grpo=replace(cfg.grpo, updates=10)).schedule("prm_decay")
    assert short(4) == 0.5 and short(6) == 0.0
    assert cfg.schedule("prm_fixed")(49) == 0.5


@pytest.mark.parametrize("change, flag", [({"seeds": 0}, "--seeds"), ({"experiments": ("nope",)}, "--experiment"),
                                          ({"beta": 2.0}, "beta"), ({"repeat": -1.0}, "repeat")])
def test_validation_names_the_flag(change, flag):
    with pytest.raises(ConfigError, match=flag):
        replace(GranularityConfig.quick(), **change).validate()


def test_task_types_cover_the_mix():
    assert sorted(c for cs in TASK_TYPES.values() for c in cs) == list(CHAINS)
    assert set(ARMS) == {"grpo", "prm_fixed", "prm_decay", "opsd_ref", "opsd_advice"}


# ---------------------------------------------------------------------------------------------
# the lab on the protocol


def test_lab_runs_writes_every_table_and_plot_and_resumes(tmp_path, tiny_base_cache):
    cfg = GranularityConfig(base=TINY_BASE, grpo=TINY_GRPO, seeds=2, eval_per_type=4, cache_dir=str(tiny_base_cache),
                            dump_dir=str(tmp_path / "dump"))
    out = tmp_path / "run"
    run_lab(LAB, cfg, out, progress=False)
    for name in ("knobs", "means", "summary", "diff_vs_grpo", "phases", "opsd", "teachers", "mixing", "diagnose",
                 "curves", "eval_curves"):
        assert (out / f"{name}.parquet").exists() and (out / f"{name}.md").exists(), name
    for png in ("granularity_rewards", "granularity_behaviour", "granularity_final", "granularity_opsd"):
        assert (out / f"{png}.png").stat().st_size > 0
    means = pd.read_parquet(out / "means.parquet")
    assert set(means["arm"]) == set(ARMS) and set(means["type"]) == {"all", "short", "long"}
    assert means["n"].eq(2).all()
    curves = pd.read_parquet(out / "curves.parquet")
    assert len(curves) == len(ARMS) * 2 * TINY_GRPO.updates
    lam = curves[curves["arm"] == "prm_fixed"]["lam"]
    assert lam.eq(0.5).all()
    diag = pd.read_parquet(out / "diagnose.parquet")
    assert set(diag["arm"]) == set(ARMS) and set(diag["seed"]) == {0, 1}
    assert {"reward.process_hacking", "credit.mixing"} <= set(diag["check"])
    dumps = sorted(p.name for p in (tmp_path / "dump").iterdir())
    assert len(dumps) == len(ARMS) * 2
    row = json.loads((tmp_path / "dump" / "granularity-prm_fixed-seed=0.jsonl").read_text().splitlines()[0])
    assert row["process_reward"] is not None and row["turns"][0]["process_score"] is not None
    teachers = pd.read_parquet(out / "teachers.parquet")
    assert set(zip(teachers["teacher"], teachers["placebo"], strict=True)) == {
        ("ref", False), ("ref", True), ("advice", False), ("advice", True)}
    assert (teachers["reverse_kl"] >= 0).all()
    report = (out / "report.md").read_text()
    assert "granularity_rewards.png" in report and "Rule: a turn is good" in report
    # a rerun reuses every cell: the same rows
    before = pd.read_parquet(out / "summary.parquet")
    run_lab(LAB, cfg, out, progress=False)
    pd.testing.assert_frame_equal(before, pd.read_parquet(out / "summary.parquet"))
    # a re-render that has not got the dumps (none computed again, no --dump) keeps the diagnose table as it was
    diag_bytes = (out / "diagnose.parquet").read_bytes()
    run_lab(LAB, replace(cfg, dump_dir=None), out, progress=False)
    assert (out / "diagnose.parquet").read_bytes() == diag_bytes
    assert "Carried over unchanged from an earlier render" in (out / "report.md").read_text()
    assert "diagnose" in json.loads((out / "lab.json").read_text())["carried"]


def test_cells_are_deterministic_and_paired(tiny_base_cache):
    from creditlab.labs.granularity import run_arm

    cfg = GranularityConfig(base=TINY_BASE, grpo=replace(TINY_GRPO, updates=1), seeds=1, eval_per_type=2,
                            cache_dir=str(tiny_base_cache))
    a = run_arm(cfg.identity(), "grpo", 0, str(tiny_base_cache))
    b = run_arm(cfg.identity(), "grpo", 0, str(tiny_base_cache))
    c = run_arm(cfg.identity(), "prm_fixed", 0, str(tiny_base_cache))
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    assert strip(a) == strip(b)
    # the first update's rollouts come from the same base policy, tasks and seed in every arm
    first = lambda rows: next(r for r in rows if r["kind"] == "train" and r["update"] == 0)  # noqa: E731
    assert first(a)["success"] == first(c)["success"] and first(a)["tool_calls"] == first(c)["tool_calls"]


def test_prepare_base_policy_builds_once(tmp_path):
    from creditlab.train.toolshop_base import prepare_base_policy

    cfg = BaseConfig(n_demos=16, steps=3, batch_size=8, d_model=16, n_layer=1, max_len=96, chain_lengths=(2,))
    prepare_base_policy(cfg, tmp_path, "test base", progress=False)
    (path,) = tmp_path.iterdir()
    assert path.name == f"toolshop-base-{cfg.key()}.safetensors"
    stamp = path.stat().st_mtime_ns
    prepare_base_policy(cfg, tmp_path, "test base", progress=False)  # cached: not trained again
    assert path.stat().st_mtime_ns == stamp
