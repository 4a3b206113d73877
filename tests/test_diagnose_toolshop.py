"""creditlab diagnose on dumps written by the toolshop agent with real quantized rollouts: an fp32 engine with
an fp32 learner passes the mismatch checks, an FP8 engine with an fp32 learner shows the prefix drift; the
credit checks read the agent's real tool calls; the CLI end to end on those dumps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from creditlab.cli.main import main
from creditlab.core.diagnostics import chain_length
from creditlab.diagnose import read_dump, run_checks, write_dump
from creditlab.train.toolshop_base import BaseConfig, train_base
from creditlab.train.toolshop_dump import dump_rollouts, rollout_rows
from creditlab.train.toolshop_rollout import make_tasks, rollout, sequence_logprobs, successful_read_scores

# a small base policy that succeeds about 40% of the time on chains of 2-3 calls (about 10 s on 2 cores)
BASE = BaseConfig(chain_lengths=(2, 3), n_demos=512, steps=300, batch_size=32, d_model=48, n_layer=1, max_len=96,
                  lr=1e-2)
MISMATCH = ("mismatch.k3", "mismatch.prefix_drift", "mismatch.one_sided", "mismatch.placeholder_logprobs",
            "mismatch.sequence_ratio_length")


@pytest.fixture(scope="module")
def model():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield train_base(BASE)
    finally:
        torch.set_num_threads(n)


def _batches(model, engine, steps=4, tasks=32, group=4):
    """Rollouts of ``steps`` updates (the same policy: a diagnosis of the engine, not of learning)."""
    out = []
    for s in range(steps):
        b = rollout(model, make_tasks(range(s * tasks, (s + 1) * tasks), BASE.chain_lengths), precision=engine,
                    max_len=96, generator=torch.Generator().manual_seed(s),
                    group_ids=[i // group for i in range(tasks)])
        out.append((s, b, sequence_logprobs(model, b.tokens)))
    return out


@pytest.fixture(scope="module")
def dumps(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("toolshop")
    paths = {}
    for engine in ("fp32", "fp8"):
        path = root / f"{engine}.jsonl"
        for s, b, old in _batches(model, engine):
            dump_rollouts(b, b.success, s, path, logprobs=old)  # appended step by step, as a trainer would
        paths[engine] = path
    return paths


def _results(path):
    return {r.id: r for r in run_checks(read_dump(path))}


def test_fp32_engine_and_learner_pass_every_mismatch_check(dumps):
    res = _results(dumps["fp32"])
    for cid in MISMATCH:  # the two checks the transfer run left without a calibrated verdict report their value
        want = "info" if cid in ("mismatch.prefix_drift", "mismatch.sequence_ratio_length") else "ok"
        assert res[cid].status == want, (cid, res[cid].message)
    assert res["mismatch.k3"].value < 1e-10 and res["mismatch.prefix_drift"].value < 1e-4
    assert "flat" in res["mismatch.prefix_drift"].message


def test_fp8_engine_with_an_fp32_learner_shows_prefix_drift(dumps):
    """The check sees the history ratio compound while the current one stays small, and reports it (status
    info: the transfer run gave it no calibrated verdict), over a thousand times the fp32 engine's."""
    res = _results(dumps["fp8"])
    drift = res["mismatch.prefix_drift"]
    assert drift.status == "info" and drift.value > 1e3 * _results(dumps["fp32"])["mismatch.prefix_drift"].value
    assert 0.05 < drift.value < 2, drift.message
    assert "grows from" in drift.message
    assert drift.details["prefix_rms_last"] > 3 * drift.details["prefix_rms_first"]
    assert drift.details["turn_last"] >= 3
    assert res["mismatch.k3"].value > 1e-4  # a real, small per-token mismatch
    assert res["mismatch.one_sided"].status == "ok"  # quantization noise is two-sided
    assert res["mismatch.placeholder_logprobs"].status == "ok"


def test_observation_tokens_leaked_into_the_policy_mask_are_flagged(dumps):
    rows = [json.loads(line) for line in dumps["fp32"].read_text().splitlines()]
    for r in rows:  # every token of a turn (action and its observation) marked as the policy's
        r["policy_mask"] = [m or t >= 0 for m, t in zip(r["policy_mask"], r["turn_ids"], strict=True)]
    res = {r.id: r for r in run_checks(read_dump(write_dump(rows, dumps["fp32"].parent / "leak.jsonl")))}
    ph = res["mismatch.placeholder_logprobs"]
    assert ph.status == "fail" and ph.details["repeated_runs"] > 0
    assert res["mismatch.k3"].status == "ok"  # the leaked tokens are reported once, not as a precision mismatch


def test_credit_checks_read_the_agents_tool_calls(model, tmp_path):
    batches = _batches(model, "fp32", steps=2)
    rows, want_C = [], []
    for s, b, old in batches:
        rows += rollout_rows(b, b.success, s, logprobs=old)
        for task, recs in zip(b.tasks, b.records, strict=True):
            c = chain_length(recs, " ".join(task.instruction))
            if c:
                want_C.append(c)
    res = {r.id: r for r in run_checks(read_dump(write_dump(rows, tmp_path / "c.jsonl")))}
    cov = res["credit.coverage"]
    assert cov.details["C_mean"] == pytest.approx(np.mean(want_C))
    # a state-diff verifier sees the write only: V_d = 1/C, the toolshop world's ceiling
    assert cov.status == "warn" and cov.value < 0.6 and cov.details["k_counts"].startswith("the writes")
    assert res["credit.mixing"].status == "skipped"
    # with the (hackable) evidence score on every turn the mixing score is measured
    s, b, old = batches[0]
    scored = rollout_rows(b, b.success, s, logprobs=old, process_scores=successful_read_scores(b))
    assert all(r["process_reward"] is not None for r in scored if r["turns"])
    res = {r.id: r for r in run_checks(read_dump(write_dump(scored, tmp_path / "s.jsonl")))}
    assert res["credit.mixing"].status in ("ok", "warn") and 0 <= res["credit.mixing"].value <= 1


def test_cli_on_a_real_fp8_dump(dumps, tmp_path, capsys):
    out = tmp_path / "diag"
    with pytest.raises(SystemExit) as ex:
        main(["diagnose", str(dumps["fp8"]), "--out", str(out), "--quiet"])
    js = json.loads((out / "diagnose.json").read_text())
    statuses = {c["id"]: c["status"] for c in js["checks"]}
    assert ex.value.code == (1 if "fail" in statuses.values() else 0) == js["exit_code"]
    assert {"id", "status", "value", "threshold", "message", "fix"} <= set(js["checks"][0])
    assert js["input"]["trajectories"] == 128 and js["input"]["steps"] == 4
    report = (out / "report.md").read_text()
    table = report.index("| check | status |")
    assert table < report.index("## mismatch.k3")  # the verdict table comes first
    for png in ("k3_over_steps.png", "prefix_by_turn.png", "length_reward_over_steps.png",
                "weight_by_length_quartile.png"):
        assert (out / png).stat().st_size > 10_000 and f"]({png})" in report
    with pytest.raises(SystemExit) as ex:
        main(["diagnose", str(dumps["fp8"]), "--out", str(out), "--quiet", "--fail-on", "warn"])
    assert ex.value.code == 1  # a check warns (the verifier's coverage, V_d = 1 / C here)
    with pytest.raises(SystemExit) as ex:
        main(["diagnose", str(dumps["fp32"]), "--out", str(tmp_path / "ok"), "--check", "mismatch.k3",
              "--check", "mismatch.prefix_drift"])
    assert ex.value.code == 0
    shown = capsys.readouterr()
    assert "mismatch.k3" in shown.out and "reward.length_hacking" not in shown.out  # the table on stdout
    assert "report:" in shown.err and "Traceback" not in shown.err
