"""The checks of creditlab diagnose: each planted failure is flagged, a clean dump is not; the flat token
quantities agree with core.correction.mismatch_metrics on the same rows padded."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from creditlab.core.correction import mismatch_metrics
from creditlab.diagnose import CHECKS, read_dump, run_checks, write_dump
from creditlab.diagnose._tokens import token_stats
from creditlab.diagnose.checks import Context, turn_profile
from creditlab.diagnose.report import exit_code
from creditlab.errors import ConfigError, InputError
from diagnose_synth import CHAIN_TURNS, clean_rows, padded_tensors, token_row, topk_row


def _run(tmp_path, rows, name="d.jsonl", **kw):
    p = write_dump(rows, tmp_path / name)
    return {r.id: r for r in run_checks(read_dump(p), **kw)}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("clean"), clean_rows())


def test_every_check_passes_on_a_clean_dump(clean):
    assert list(clean) == list(CHECKS)
    for cid in ("mismatch.k3", "mismatch.one_sided", "mismatch.placeholder_logprobs", "reward.length_hacking",
                "reward.process_hacking", "baseline.degenerate_groups"):
        assert clean[cid].status == "ok", (cid, clean[cid].message)
    for cid in ("mismatch.prefix_drift", "mismatch.sequence_ratio_length"):  # measured, with no calibrated verdict
        assert clean[cid].status == "info" and "No calibrated verdict" in clean[cid].message, cid
        assert clean[cid].value is not None and clean[cid].value < 0.05, (cid, clean[cid].value)
    for cid in ("credit.coverage", "credit.mixing"):  # no turns column
        assert clean[cid].status == "skipped" and "turns" in clean[cid].message
    for r in clean.values():
        assert r.message.endswith(".") and r.fix and r.threshold.text()
        assert r.status == "skipped" or r.value is not None


def test_token_quantities_equal_core_mismatch_metrics_on_padded_rows(tmp_path):
    rng = np.random.default_rng(3)
    rows = []
    for i in range(40):  # ragged rows, 1 to 5 turns
        row = token_row(rng, rng.integers(1, 30, rng.integers(1, 6)).tolist(), noise=0.05, bias=0.01)
        row.pop("turn_ids")  # turns = policy runs, as in core
        rows.append({"step": i % 4, "group": i // 4, "reward": float(i % 2), **row})
    dump = read_dump(write_dump(rows, tmp_path / "r.parquet"))
    ctx = Context(dump, max_turns=8)
    ts = token_stats(dump)  # the flat token arrays; the checks read their sums per row (ctx.tokens.rows)
    want = mismatch_metrics(*padded_tensors(rows), max_turns=8)
    k3 = float((np.expm1(ts.delta) - ts.delta).sum() / ts.usable.sum())
    assert k3 == pytest.approx(want["mismatch/k3"], rel=1e-9)
    r = ctx.tokens.rows
    assert float(r.sum_k3.sum() / r.usable.sum()) == pytest.approx(want["mismatch/k3"], rel=1e-9)
    assert np.array_equal(r.usable, ts.row_usable) and np.array_equal(r.sum_delta, ts.row_delta)
    prof = turn_profile(ctx)
    for k in range(8):
        if f"mismatch/turn{k}/tokens" in want:
            assert prof["tokens"][k] == want[f"mismatch/turn{k}/tokens"]
            assert prof["current_mean"][k] == pytest.approx(want[f"mismatch/turn{k}/current"], abs=1e-12)
            assert prof["prefix_mean"][k] == pytest.approx(want[f"mismatch/turn{k}/prefix"], abs=1e-10)
        else:
            assert prof["tokens"][k] == 0
    # sequence log ratio per row
    old, roll, pm = padded_tensors(rows)
    seq = ((old - roll) * pm).sum(1).numpy()
    assert np.allclose(ts.row_delta, seq, atol=1e-12)


def test_token_quantities_ignore_values_at_masked_positions(tmp_path):
    rng = np.random.default_rng(4)
    rows = [{"step": 0, "group": i, "reward": 0.0, **token_row(rng, [10, 12, 9], noise=0.02)} for i in range(6)]
    junk = copy.deepcopy(rows)
    for r in junk:
        r["logprobs"] = [v if m else 5.0 for v, m in zip(r["logprobs"], r["policy_mask"], strict=True)]
        r["rollout_logprobs"] = [v if m else float("nan") for v, m in zip(r["rollout_logprobs"], r["policy_mask"],
                                                                          strict=True)]
    a = token_stats(read_dump(write_dump(rows, tmp_path / "a.jsonl")))
    b = token_stats(read_dump(write_dump(junk, tmp_path / "b.jsonl")))
    for f in ("delta", "prefix", "turn", "usable", "row_delta"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


def test_k3_fails_on_a_large_mismatch_and_warns_when_it_rises_late(tmp_path):
    big = _run(tmp_path, clean_rows(noise=0.2), "big.jsonl")["mismatch.k3"]
    assert big.status == "fail" and big.value == pytest.approx(0.02, rel=0.15)
    rows = []
    for s in range(8):  # per-token noise growing over training: 0.003 early, 0.03 late
        rows += [r for r in clean_rows(seed=s, steps=1, noise=0.003 if s < 4 else 0.03) if not r.update(step=s)]
    late = _run(tmp_path, rows, "late.jsonl")["mismatch.k3"]
    assert late.value < 1e-3 and late.status == "warn" and "rising late" in late.message
    assert late.details["late"] > 2 * late.details["early"]
    assert late.series["k3"].shape == (8,)


def test_prefix_drift_measures_the_prefix_growing_while_the_current_ratio_is_flat(tmp_path):
    # about 84 policy tokens before the last of 4 turns: a per-token noise of 0.4 sums to an RMS near 3.7
    r = _run(tmp_path, clean_rows(noise=0.4, turns=4), "drift.jsonl")["mismatch.prefix_drift"]
    assert 3.0 < r.value < 5.0 and r.value == r.details["prefix_rms_last"] and r.details["current_flat"]
    assert r.status == "info" and "grows from" in r.message and "while the current one stays flat" in r.message
    small = _run(tmp_path, clean_rows(noise=0.02, turns=4), "small.jsonl")["mismatch.prefix_drift"]
    assert small.value == pytest.approx(r.value / 20, rel=0.25) and small.status == "info"  # linear in the noise
    assert r.details["prefix_rms_last"] > 2 * r.details["prefix_rms_first"]
    one_turn = _run(tmp_path, clean_rows(noise=0.02, turns=1), "one.jsonl")["mismatch.prefix_drift"]
    assert one_turn.status == "skipped" and "2 turns" in one_turn.message


def test_one_sided_flags_top_k_truncated_engine_logprobs(tmp_path):
    rng = np.random.default_rng(0)

    def rows(k, noise=0.0):
        return [{"step": i // 8, "group": i // 4, "reward": float(i % 2), **topk_row(rng, 40, k=k, noise=noise)}
                for i in range(32)]

    trunc = _run(tmp_path, rows(5), "topk.jsonl")["mismatch.one_sided"]
    assert trunc.status == "fail" and trunc.value == 1.0 and "top-k/top-p" in trunc.message
    assert trunc.details["bias_per_token"] < -0.01  # the engine is above the learner by log(1 / kept mass)
    full = _run(tmp_path, rows(None, noise=0.02), "full.jsonl")["mismatch.one_sided"]
    assert full.status == "ok" and 0.4 < full.value < 0.6
    # a little noise on top of the truncation does not hide it
    assert _run(tmp_path, rows(20), "top20.jsonl")["mismatch.one_sided"].status in ("warn", "fail")


def test_placeholders_flag_leaked_observation_tokens_and_nans_and_stay_out_of_the_other_checks(tmp_path, clean):
    leak = _run(tmp_path, clean_rows(leak_obs=True), "leak.jsonl")
    r = leak["mismatch.placeholder_logprobs"]
    assert r.status == "fail" and r.details["repeated_runs"] > 0 and "line 1, token" in r.message
    # the leaked tokens are left out of K3: it stays at the clean dump's level
    assert leak["mismatch.k3"].status == "ok" and "left out" in leak["mismatch.k3"].message
    assert leak["mismatch.k3"].value == pytest.approx(clean["mismatch.k3"].value, rel=0.2)
    rows = clean_rows()
    rows[5]["logprobs"][10] = float("nan")  # a NaN is its own finding, not a placeholder
    res = _run(tmp_path, rows, "nan.jsonl")
    assert res["mismatch.placeholder_logprobs"].status == "ok"
    r = res["mismatch.nonfinite_logprobs"]
    assert r.status == "fail" and r.details["nonfinite"] == 1 and r.details["logprobs"] == 1  # the learner's
    assert "line 6, token 10" in r.message
    rows = clean_rows()  # one engine 0.0 where the learner gives the token e^-2: below the fail share
    rows[7]["logprobs"][12], rows[7]["rollout_logprobs"][12] = -2.0, 0.0
    r = _run(tmp_path, rows, "one.jsonl")["mismatch.placeholder_logprobs"]
    assert r.status == "warn" and r.details["zero_fill"] == 1
    rows[7]["rollout_logprobs"][12] = 0.5  # a positive log-prob on a policy token is an input error
    with pytest.raises(InputError, match="pos.jsonl: line 8: column 'rollout_logprobs': element 12 is 0.5 on a "
                                         "policy token"):
        _run(tmp_path, rows, "pos.jsonl")


def test_sequence_ratio_vanishes_with_length(tmp_path):
    rng = np.random.default_rng(1)
    rows = [{"step": i // 16, "group": i // 4, "reward": float(i % 2), **token_row(rng, [int(n)], noise=0.05)}
            for i, n in enumerate(rng.integers(10, 1200, 64))]
    r = _run(tmp_path, rows, "long.jsonl")["mismatch.sequence_ratio_length"]
    assert r.status == "info" and r.value >= 1.0
    assert r.series["prod_abs"][-1] > 3 * r.series["prod_abs"][0]
    assert r.details["median_abs_log_geo_longest"] < 0.01  # the geometric mean does not vanish


def _trend_rows(seed=0, *, length_growth=0.0, precision_drop=0.0, reward_rise=0.3, steps=8):
    rows = clean_rows(seed, steps=steps, tokens=False)
    rng = np.random.default_rng(seed + 1)
    for r in rows:
        f = r["step"] / (steps - 1)
        r["response_length"] *= 1 + length_growth * f
        r["precision"] -= precision_drop * f
        if r["reward"] == 0 and rng.random() < reward_rise * f:
            r["reward"] = 1.0
    return rows


def test_length_hacking(tmp_path):
    r = _run(tmp_path, _trend_rows(length_growth=1.0, precision_drop=0.3), "pad.jsonl")["reward.length_hacking"]
    assert r.status == "fail" and r.value > 0.5 and "precision fell" in r.message
    rows = _trend_rows(length_growth=1.0)
    assert _run(tmp_path, rows, "content.jsonl")["reward.length_hacking"].status == "ok"  # precision held
    for row in rows:
        del row["precision"]
    r = _run(tmp_path, rows, "noprec.jsonl")["reward.length_hacking"]
    assert r.status == "warn" and "no precision column" in r.message
    assert _run(tmp_path, clean_rows(steps=3, tokens=False), "short.jsonl")["reward.length_hacking"].status == \
        "skipped"


def test_process_hacking(tmp_path):
    rows = clean_rows(tokens=False)
    for r in rows:
        f = r["step"] / 7
        r["process_reward"] = 0.3 + 0.6 * f + 0.05 * math.sin(len(str(r)))
        r["turns"] = [dict(CHAIN_TURNS[0]) for _ in range(3 + int(4 * f))]  # tool calls rising
    res = _run(tmp_path, rows, "farm.jsonl")["reward.process_hacking"]
    assert res.status == "fail" and "tool calls" in res.message
    for r in rows:
        del r["turns"]
    assert _run(tmp_path, rows, "noturns.jsonl")["reward.process_hacking"].status == "warn"
    for r in rows:  # the outcome rises with the process reward: no hacking
        r["reward"] = float(r["step"] >= 4)
    assert _run(tmp_path, rows, "honest.jsonl")["reward.process_hacking"].status == "ok"


def test_degenerate_groups_flag_a_reward_variance_collapse(tmp_path):
    rows = clean_rows()
    for r in rows:
        if r["step"] >= 4:
            r["reward"] = 1.0
    res = _run(tmp_path, rows, "collapse.jsonl")["baseline.degenerate_groups"]
    assert res.status == "fail" and res.value == 1.0 and res.details["share_early"] < 0.5
    for i, r in enumerate(rows):
        r["group"] = i
    single = _run(tmp_path, rows, "single.jsonl")["baseline.degenerate_groups"]
    assert single.status == "fail" and "one trajectory" in single.message


def test_credit_coverage_and_mixing(tmp_path):
    rows = clean_rows(tokens=False)
    for r in rows:
        r["turns"] = copy.deepcopy(CHAIN_TURNS)
        r["instruction"] = "cancel the order of ann"
    res = _run(tmp_path, rows, "sparse.jsonl")
    cov = res["credit.coverage"]
    assert cov.status == "warn" and cov.details["C_mean"] == 3 and cov.details["T_mean"] == 4
    assert cov.value == pytest.approx(1 / 3) and cov.details["write_fraction"] == 0.25
    assert cov.details["p_cover"] == 0.0  # k = 1 < C = 3
    assert res["credit.mixing"].status == "skipped"
    for r in rows:  # a process score on every turn, alternating good and bad
        for t, turn in enumerate(r["turns"]):
            turn["process_score"] = float(t % 2)
    res = _run(tmp_path, rows, "dense.jsonl")
    assert res["credit.coverage"].status == "ok" and res["credit.coverage"].value == 1.0
    assert res["credit.mixing"].status == "warn" and res["credit.mixing"].value == 1.0
    for r in rows:
        for turn in r["turns"]:
            turn["process_score"] = 0.9
    assert _run(tmp_path, rows, "agree.jsonl")["credit.mixing"].status == "ok"


def test_run_checks_selection_and_exit_codes(tmp_path, clean):
    dump = read_dump(write_dump(clean_rows(steps=2), tmp_path / "s.jsonl"))
    assert [r.id for r in run_checks(dump, only=["mismatch.k3"])] == ["mismatch.k3"]
    with pytest.raises(ConfigError, match="--check: unknown check 'nope'; valid: mismatch.k3"):
        run_checks(dump, only=["nope"])
    results = list(clean.values())
    warned = [*results[:1], type(results[0])(**{**vars(results[0]), "status": "warn"})]
    assert exit_code(results) == 0 and exit_code(warned) == 0 and exit_code(warned, "warn") == 1
    failed = [type(results[0])(**{**vars(results[0]), "status": "fail"})]
    assert exit_code(failed) == 1
    with pytest.raises(ConfigError, match="--fail-on"):
        exit_code(results, "never")
