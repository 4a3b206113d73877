"""A verdict depends on what it should: the set of rows (not their order), the reward (not a column
logged beside it), and log-probs that were measured (not padding or placeholder zeros)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from creditlab.diagnose import CHECKS, read_dump, run_checks, write_dump
from creditlab.diagnose.checks import _quartiles
from diagnose_synth import CHAIN_TURNS, clean_rows


def _run(path, rows, **kw):
    return {r.id: r for r in run_checks(read_dump(write_dump(rows, path)), **kw)}


# ------------------------------------------------------------------------------------------------
# a verdict is a function of the set of rows


def _tie_rows(draw) -> list[dict]:
    """Rows with every column a check reads, drawn from a few values each, so that lengths, rewards,
    deltas and steps tie often (many responses cut at one maximum length). Each row has its own
    ``response``: identical rows of a step in two places of a file read as the step written twice (the
    readers leave the repeat out), which is the file's layout speaking, not the set of rows."""
    n = draw(st.integers(12, 40))
    rows = []
    for i in range(n):
        k = draw(st.sampled_from([3, 6, 6, 6]))  # policy tokens per turn: ties at the quartile boundaries
        turns = draw(st.integers(1, 2))
        delta = draw(st.sampled_from([0.0, 0.01, -0.01, 0.3, -0.2]))
        lp, rlp, pm = [-1.0, -2.0], [0.0, 0.0], [False, False]  # a prompt
        for t in range(turns):
            lp += [-0.5 - 0.1 * j for j in range(k)]
            rlp += [-0.5 - 0.1 * j - delta * (j % 2) for j in range(k)]
            pm += [True] * k
            if t < turns - 1:
                lp += [-3.0] * 2
                rlp += [0.0] * 2
                pm += [False] * 2
        score = draw(st.sampled_from([None, 0.2, 0.9]))
        rows.append({
            "step": draw(st.integers(0, 4)), "group": f"p{draw(st.integers(0, 2))}",
            "reward": draw(st.sampled_from([0.0, 1.0, 1.0])), "logprobs": lp, "rollout_logprobs": rlp,
            "policy_mask": pm, "precision": draw(st.sampled_from([0.5, 0.8])),
            "process_reward": draw(st.sampled_from([0.0, 0.5, 1.0])), "truncated": draw(st.booleans()),
            "turns": [dict(t, process_score=score) for t in CHAIN_TURNS[:draw(st.integers(1, 4))]],
            "instruction": "cancel the order of ann", "response": f"response {i}"})
    return rows


@st.composite
def _rows_and_order(draw):
    rows = _tie_rows(draw)
    return rows, draw(st.permutations(range(len(rows))))


def _same(a, b) -> bool:
    if isinstance(a, float | int) and isinstance(b, float | int):
        return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-9, abs=1e-12)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=40, deadline=None, derandomize=True)
@given(_rows_and_order())
def test_every_verdict_and_value_is_a_function_of_the_set_of_rows(tmp_path_factory, data):
    rows, order = data
    tmp = tmp_path_factory.mktemp("perm")
    a = _run(tmp / "a" / "d.jsonl", rows)
    b = _run(tmp / "b" / "d.jsonl", [rows[i] for i in order])
    assert list(a) == list(b) == list(CHECKS)
    for cid in CHECKS:
        ra, rb = a[cid], b[cid]
        assert ra.status == rb.status, (cid, ra.message, rb.message)
        assert _same(ra.value, rb.value), (cid, ra.value, rb.value)
        for k in ra.details.keys() | rb.details.keys():
            if k != "copied_files":
                assert _same(ra.details.get(k), rb.details.get(k)), (cid, k, ra.details.get(k), rb.details.get(k))


def test_rows_tied_at_the_longest_quartile_are_not_split_by_their_order(tmp_path):
    """16 of 32 responses hit the length limit, half of them with a large sequence log ratio: which 8 of
    them a stable sort put in the longest quarter used to decide the verdict (ok 0.01 or warn 0.6)."""
    def row(n, delta):  # n policy tokens whose log ratios sum to delta
        lp = [-0.7] * n
        return {"logprobs": lp, "rollout_logprobs": [x - delta / n for x in lp], "policy_mask": [True] * n}
    rows = [{"step": 0, "group": i // 4, "reward": float(i % 2), **row(40 + i, 0.01)} for i in range(16)]
    rows += [{"step": 0, "group": 4 + i // 4, "reward": float(i % 2), **row(128, 0.6 if i % 2 else 0.01)}
             for i in range(16)]
    def ratio(r):
        return sum(r["logprobs"]) - sum(r["rollout_logprobs"])
    got = [_run(tmp_path / f"{k}.jsonl", sorted(rows, key=ratio, reverse=k == "desc"))["mismatch.sequence_ratio_length"]
           for k in ("asc", "desc")]
    assert got[0].status == got[1].status and got[0].value == pytest.approx(got[1].value, rel=1e-12)
    assert got[0].details["longest_quartile"] == [128.0, 128.0]
    assert got[0].series["rows"][-1] == 16 and "16 rows" in got[0].message  # every row at the limit


def test_quartiles_without_ties_are_the_sorted_split_and_ties_go_up():
    rng = np.random.default_rng(0)
    for R in (8, 9, 10, 11, 37):
        n = rng.permutation(R).astype(float)
        want = np.empty(R, dtype=np.int64)
        for q, part in enumerate(np.array_split(np.argsort(n), 4)):
            want[part] = q
        assert np.array_equal(_quartiles(n), want)
    n = np.array([1.0, 2, 3, 4, 5, 9, 9, 9])  # the three tied longest rows share the top quartile
    assert _quartiles(n).tolist() == [0, 0, 1, 1, 2, 3, 3, 3]
    assert _quartiles(np.array([1.0] * 6 + [2, 3])).tolist() == [2] * 6 + [3, 3]  # quartiles 0 and 1 empty


# ------------------------------------------------------------------------------------------------
# placeholders and padding are named, and are no precision evidence


def _padded(rows: list[dict], extra: int = 40) -> list[dict]:
    """The rows padded to one length with policy tokens holding 0.0 on both sides (a padded batch written
    without its valid_mask, padding inside the policy mask)."""
    rows = copy.deepcopy(rows)
    L = max(len(r["logprobs"]) for r in rows) + extra
    for r in rows:
        n = L - len(r["logprobs"])
        r["logprobs"] += [0.0] * n
        r["rollout_logprobs"] += [0.0] * n
        r["policy_mask"] += [True] * n
        r["turn_ids"] += [r["turn_ids"][-1]] * n
    return rows


def test_padding_in_the_policy_mask_is_named_and_does_not_dilute_k3(tmp_path):
    rows = clean_rows(noise=0.063, steps=4, groups=4)
    plain = _run(tmp_path / "plain.jsonl", rows)
    padded = _run(tmp_path / "padded.jsonl", _padded(rows))
    assert plain["mismatch.k3"].status == "warn" and plain["mismatch.k3"].value > 1e-3  # the two sides differ
    for cid in ("mismatch.k3", "mismatch.one_sided", "mismatch.prefix_drift", "mismatch.sequence_ratio_length"):
        assert padded[cid].status == plain[cid].status, (cid, padded[cid].message)
        assert padded[cid].value == pytest.approx(plain[cid].value, rel=1e-9), cid
    assert "padding tokens" in padded["mismatch.k3"].message
    ph = padded["mismatch.placeholder_logprobs"]
    assert plain["mismatch.placeholder_logprobs"].status == "ok"
    assert ph.status == "fail" and ph.details["padded_rows"] == len(rows)
    assert ph.details["padding"] == sum(len(r["logprobs"]) for r in _padded(rows)) - sum(
        len(r["logprobs"]) for r in rows)
    assert "padding tokens in the policy mask" in ph.message and "padding marked as policy tokens" in ph.message


def test_a_few_tokens_with_probability_one_on_both_sides_are_not_padding(tmp_path):
    rows = clean_rows(steps=4, groups=4)
    for r in rows[::3]:  # a sampled token the two models both give probability 1 (0.0 in float), mid-row
        i = r["policy_mask"].index(True) + 2
        r["logprobs"][i] = r["rollout_logprobs"][i] = 0.0
    for r in rows[1::3]:  # and three such tokens at the end of a row
        for i in (-1, -2, -3):
            r["logprobs"][i] = r["rollout_logprobs"][i] = 0.0
    res = _run(tmp_path / "sure.jsonl", rows)
    assert res["mismatch.placeholder_logprobs"].status == "ok", res["mismatch.placeholder_logprobs"].message


def test_all_zero_engine_logprobs_are_placeholders_not_a_precision_problem(tmp_path):
    """A confident learner (every token above e^-0.5) and an engine that returned no log-probs (0.0): no
    token is zero-filled by itself, but a column of zeros is not a measurement."""
    rows = clean_rows(steps=4, groups=4)
    for r in rows:
        r["logprobs"] = [0.15 * x for x in r["logprobs"]]
        r["rollout_logprobs"] = [0.0] * len(r["logprobs"])
    assert max(x for r in rows for x, m in zip(r["logprobs"], r["policy_mask"], strict=True) if m) < 0
    res = _run(tmp_path / "zero.jsonl", rows)
    ph = res["mismatch.placeholder_logprobs"]
    assert ph.status == "fail" and ph.value == 1.0 and ph.details["zero_rollout_logprobs_rows"] == len(rows)
    assert "rollout_logprobs exactly 0.0 on every policy token of" in ph.message
    assert "the engine's log-probs are placeholders" in ph.message
    for cid in ("mismatch.k3", "mismatch.one_sided", "mismatch.prefix_drift", "mismatch.sequence_ratio_length"):
        r = res[cid]
        assert r.status == "skipped" and r.value is None, (cid, r.message)
        assert "rollout_logprobs are 0.0 throughout" in r.message and "no precision evidence" in r.message
        assert "top-k" not in r.message
    # half the rows so: those are left out, the other half measured
    rows2 = clean_rows(steps=4, groups=4)
    for r in rows2[::2]:
        r["rollout_logprobs"] = [0.0] * len(r["logprobs"])
    res2 = _run(tmp_path / "half.jsonl", rows2)
    clean = _run(tmp_path / "clean.jsonl", clean_rows(steps=4, groups=4))
    assert res2["mismatch.placeholder_logprobs"].details["zero_rollout_logprobs_rows"] == len(rows2) // 2
    for cid in ("mismatch.k3", "mismatch.one_sided"):
        assert res2[cid].status == clean[cid].status == "ok", (cid, res2[cid].message)
    assert "whose rollout_logprobs are 0.0 throughout (mismatch.placeholder_logprobs) left out" in \
        res2["mismatch.k3"].message


def test_a_turn_the_engine_filled_with_zeros_is_flagged_even_where_each_token_is_close(tmp_path):
    rows = clean_rows(steps=4, groups=4)
    for r in rows[:8]:  # the first turn of 8 rows: engine 0.0, learner a confident -0.1 each
        pm = r["policy_mask"]
        first = [i for i, m in enumerate(pm) if m][:12]
        for i in first:
            r["logprobs"][i], r["rollout_logprobs"][i] = -0.1, 0.0
    res = _run(tmp_path / "turn.jsonl", rows)
    ph = res["mismatch.placeholder_logprobs"]
    assert ph.status == "fail" and ph.details["repeated_runs"] == 8 * 12
    assert res["mismatch.one_sided"].status == "ok"


# ------------------------------------------------------------------------------------------------
# the reward is the reward: TRL's log_completions tables


def _trl_table(path, step: int, funcs: dict[str, list], extra: dict[str, list], *, G: int = 4,
               weights: list[float] | None = None, completions: list[str] | None = None) -> None:
    """A ``completions_{step:05d}.parquet`` as TRL 1.16's ``GRPOTrainer`` writes it (``log`` and
    ``_generate_and_score_completions``, default ``sum_then_normalize`` and ``scale_rewards="group"``):
    the reward functions' columns (None: not scored), then the ``log_extra`` ones sorted by name, then the
    advantage of the weighted ``nansum`` of the functions, in float32."""
    import pandas as pd
    import torch

    n = len(next(iter(funcs.values())))
    per = torch.tensor([[math.nan if v is None else v for v in col] for col in funcs.values()],
                       dtype=torch.float32).T
    w = torch.tensor(weights or [1.0] * len(funcs), dtype=torch.float32)
    unscorable = torch.isnan(per).all(1)
    rewards = (per * w).nansum(1)
    rewards[unscorable] = math.nan
    grouped = rewards.view(-1, G)
    mean = torch.nanmean(grouped, 1, keepdim=True)
    count = (~torch.isnan(grouped)).sum(1, keepdim=True)
    std = torch.sqrt(torch.nanmean((grouped - mean) ** 2, 1, keepdim=True) * count / (count - 1))
    adv = torch.nan_to_num(((grouped - mean) / (std + 1e-4)).view(-1), nan=0.0)
    table = {"step": [step] * n, "prompt": [f"prompt {i // G} of step {step}" for i in range(n)],
             "completion": completions or [f"completion {i}" for i in range(n)],
             **{k: list(v) for k, v in funcs.items()},
             **{k: extra[k] for k in sorted(extra)}, "advantage": adv.tolist()}
    path.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(table).to_parquet(path / f"completions_{step:05d}.parquet")


def test_trl_log_extra_columns_are_not_summed_into_the_reward(tmp_path):
    """A pass/fail reward that ties in 7 of 8 groups, and a judge score and a word count logged with
    log_extra: the groups are degenerate (summing the extras broke every tie: ok 0 instead of fail 0.875)."""
    rng = np.random.default_rng(0)
    logs = tmp_path / "completions"
    for step in range(1, 3):
        ok = [1.0] * 32
        ok[1] = 0.0 if step == 1 else 1.0  # the one group that is not degenerate, at step 1
        if step == 2:
            ok[5] = 0.0
        _trl_table(logs, step, {"pass_reward": ok}, {"judge_score": rng.uniform(0, 1, 32).tolist(),
                                                      "n_words": rng.integers(3, 30, 32).tolist(),
                                                      "note": ["x"] * 32})
    d = read_dump(logs)
    assert np.array_equal(d.reward, np.asarray([1.0] * 64) - np.isin(np.arange(64), [1, 37]))
    r = run_checks(d, only="baseline.degenerate_groups")[0]
    assert r.status == "fail" and r.value == pytest.approx(0.875)
    assert d.reward_sources == ["TRL reward-function column pass_reward (weight 1 each, NaN as 0: it reproduces the "
                                "logged advantage in 8 groups); not counted: judge_score, n_words (log_extra "
                                "columns)"] * 2
    from creditlab.diagnose.report import diagnose

    out = diagnose([logs], tmp_path / "diag")
    js = __import__("json").loads((tmp_path / "diag" / "diagnose.json").read_text())
    assert js["input"]["reward_source"] == out.summary["reward_source"] == d.reward_sources[0]
    assert f"Reward: {d.reward_sources[0]}." in (tmp_path / "diag" / "report.md").read_text()


def test_trl_reward_functions_are_told_from_numeric_log_extra_columns_by_the_advantage(tmp_path):
    rng = np.random.default_rng(1)
    logs = tmp_path / "completions"
    acc = rng.integers(0, 2, 32).astype(float).tolist()
    fmt = [None if i % 5 == 0 else float(x) for i, x in enumerate(rng.uniform(0, 0.5, 32))]  # None: unscored
    _trl_table(logs, 1, {"accuracy": acc, "format_reward": fmt},
               {"correct": acc, "judge_score": rng.uniform(0, 1, 32).tolist()})  # "correct" repeats accuracy
    d = read_dump(logs)
    assert np.allclose(d.reward, np.asarray(acc) + np.asarray([0.0 if v is None else v for v in fmt]), atol=1e-6)
    assert d.reward_sources[0] == ("TRL reward-function columns accuracy + format_reward (weight 1 each, NaN as 0: "
                                   "they reproduce the logged advantage in 8 groups); not counted: correct, "
                                   "judge_score (log_extra columns)")
    # a column constant within every group cannot be told from a reward function: not counted, and said so
    logs2 = tmp_path / "completions2"
    _trl_table(logs2, 1, {"accuracy": acc}, {"difficulty": [float(i // 4) for i in range(32)]})
    src = read_dump(logs2).reward_sources[0]
    assert src.startswith("TRL reward-function column accuracy (weight 1 each") and \
        "not counted: difficulty, constant within every group" in src and "--reward-column" in src


def _weighted_run(logs, steps: int = 8) -> None:
    """TRL tables of a run with ``reward_weights=[1, 3]``: accuracy falls a little while the format reward
    (weight 3) goes from 0 to 1, each constant within most groups, and the completions grow by half."""
    rng = np.random.default_rng(5)
    for step in range(steps):
        acc, fmt = [], []
        for g in range(8):
            acc += rng.permutation([1.0, 0.0, 1.0 if step < steps // 2 else 0.0, 1.0]).tolist()
            if g == 0:  # one group per step where the format reward differs within the group
                fmt += [1.0, 0.0, 0.0, 1.0]
            else:
                fmt += [1.0 if step >= steps // 2 else 0.0] * 4
        n = int(40 * (1 + 0.5 * step / (steps - 1)))
        _trl_table(logs, step, {"accuracy": acc, "format_reward": fmt}, {}, weights=[1.0, 3.0],
                   completions=["x" * (n + i % 3) for i in range(32)])


def test_trl_weighted_rewards_are_refused_not_read_with_weight_1(tmp_path, capsys):
    """Groups whose advantage no weight-1 sum reproduces are evidence of reward_weights, not groups to leave
    out: the table is refused (exit 2) naming --reward-column, and with the weights named the length check
    sees the weighted reward rise with the length (the first column alone falls: "ok")."""
    from creditlab.cli.main import main
    from creditlab.errors import InputError

    logs = tmp_path / "completions"
    _weighted_run(logs)

    def run(*extra):
        with pytest.raises(SystemExit) as ex:
            main(["diagnose", str(logs), "--out", str(tmp_path / "o"), "--quiet", *extra])
        return ex.value.code, " ".join(capsys.readouterr().err.split())

    code, err = run()
    assert code == 2 and err.startswith(f"error: {logs / 'completions_00000.parquet'}: row 1: column 'advantage': "
                                        "TRL's completions table does not mark")
    assert "(in 1 of 8 groups none does, the first at this row)" in err and "--reward-column NAME[=WEIGHT]" in err
    code, err = run("--reward-column", "accuracy", "--reward-column", "format_reward=3", "--check",
                    "reward.length_hacking")
    js = __import__("json").loads((tmp_path / "o" / "diagnose.json").read_text())
    r = js["checks"][0]
    assert code == 0 and r["status"] == "warn", r["message"]
    assert js["input"]["reward_source"].startswith("the columns --reward-column names: accuracy + 3 x format_reward")
    # a single reward function whose column gives the opposite advantage (a negative weight) is refused too
    logs1 = tmp_path / "single"
    _trl_table(logs1, 1, {"penalty": [float(i % 3) for i in range(32)]}, {}, weights=[-1.0])
    with pytest.raises(InputError, match=r"row 1: column 'advantage': the only reward-function column of this TRL "
                                         r"completions table, penalty, does not reproduce the logged advantage in "
                                         r"8 of the 8 groups that tell .* --reward-column NAME=WEIGHT"):
        read_dump(logs1)
    assert np.allclose(read_dump(logs1, reward_columns=["penalty=-1"]).reward, [-float(i % 3) for i in range(32)])


@pytest.mark.parametrize("spec, want", [
    (["step"], "--reward-column: 'step': 'step' is a column TRL writes itself (step, prompt, completion, advantage), "
               "not a reward function's"),
    (["advantage=1"], "--reward-column: 'advantage=1': 'advantage' is a column TRL writes itself"),
    (["a=0", "b"], "--reward-column: 'a=0': a weight of 0 counts nothing; leave 'a' out"),
    (["a", "b", "a=2"], "--reward-column: 'a=2': column 'a' is named twice; name each reward function once"),
])
def test_reward_column_refuses_trls_own_columns_a_zero_weight_and_a_repeated_name(tmp_path, capsys, spec, want):
    from creditlab.cli.main import main

    rng = np.random.default_rng(2)
    logs = tmp_path / "completions"
    _trl_table(logs, 1, {"a": rng.integers(0, 2, 32).astype(float).tolist(), "b": rng.uniform(0, 1, 32).tolist()},
               {})
    with pytest.raises(SystemExit) as ex:
        main(["diagnose", str(logs), "--out", str(tmp_path / "o"), "--quiet",
              *[x for item in spec for x in ("--reward-column", item)]])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and want in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_trl_reward_weights_the_table_cannot_tell_are_named_with_reward_column(tmp_path, capsys):
    from creditlab.cli.main import main
    from creditlab.errors import InputError

    rng = np.random.default_rng(2)
    logs = tmp_path / "completions"
    a, b = rng.integers(0, 2, 32).astype(float).tolist(), rng.uniform(0, 1, 32).tolist()
    _trl_table(logs, 1, {"a": a, "b": b}, {"extra": rng.uniform(0, 1, 32).tolist()}, weights=[2.0, 1.0])
    with pytest.raises(InputError, match=r"completions_00001.parquet: row 1: column 'advantage': TRL's completions "
                                         r"table does not mark .* \(a; a \+ b; a \+ b \+ extra\) reproduces the "
                                         r"logged advantage .* --reward-column NAME\[=WEIGHT\]"):
        read_dump(logs)
    d = read_dump(logs, reward_columns=["a=2", "b"])
    assert np.allclose(d.reward, 2 * np.asarray(a) + np.asarray(b), atol=1e-6)
    assert d.reward_sources[0] == "the columns --reward-column names: 2 x a + b (NaN as 0); not counted: extra"

    def code(argv):
        with pytest.raises(SystemExit) as ex:
            main(argv)
        return ex.value.code

    assert code(["diagnose", str(logs), "--out", str(tmp_path / "o"), "--quiet", "--reward-column", "a=2",
                 "--reward-column", "b"]) == 0
    assert "Reward: the columns --reward-column names: 2 x a + b" in (tmp_path / "o" / "report.md").read_text()
    capsys.readouterr()
    for extra, want in ((["--reward-column", "nope"], "--reward-column: " + str(logs / "completions_00001.parquet")
                         + ": row 1: column 'nope': no such column"),
                        (["--reward-column", "a=x"], "--reward-column: expected NAME or NAME=WEIGHT")):
        assert code(["diagnose", str(logs), "--out", str(tmp_path / "o2"), "--quiet", *extra]) == 2
        err = capsys.readouterr().err
        assert want in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    dump = write_dump(clean_rows(steps=1, tokens=False), tmp_path / "d.jsonl")
    assert code(["diagnose", str(dump), "--out", str(tmp_path / "o3"), "--quiet", "--reward-column", "a"]) == 2
    err = capsys.readouterr().err
    assert "--reward-column: names the reward functions of TRL's log_completions tables; this input has none " \
           "(column reward is the reward)" in err
