"""Live checks: diagnose's batch checks in the trainers' own step metrics, through verl's and TRL's real
metric paths (verl 0.9.1's ``compute_data_metrics`` on a ``DataProto`` that went through verl's rollout
correction and advantage functions, TRL 1.16.0's ``GRPOTrainer.log``), computed on the device without a
host read, with one warning line per crossing; and ``diagnose.json``'s verl metrics against verl's own
functions on the same tensors."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from integration_helpers import agent_batch, assert_engine_differs, make_rollout_func, tiny_model, tiny_tokenizer
from omegaconf import OmegaConf
from trl import GRPOConfig
from verl import DataProto
from verl.trainer.ppo import metric_utils, ray_trainer, rollout_corr_helper

import creditlab.integrations.verl as cv
from creditlab.core.diagnostics import batch_check_values
from creditlab.diagnose import CHECKS, read_dump, run_checks, write_dump
from creditlab.diagnose.checks import CHECK_PARAMS
from creditlab.diagnose.report import diagnose
from creditlab.integrations._live import LIVE_CHECKS, LiveWarnings, batch_values, metric_name
from creditlab.integrations.trl import CreditlabGRPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the synthetic dump builders
from diagnose_synth import clean_rows, padded_tensors, token_row, topk_row  # noqa: E402

V = cv.VERL_PREFIX  # "rollout_corr/creditlab/"


# ------------------------------------------------------------------------------------------------
# the device-side values are the checks' values


def _cases():
    rng = np.random.default_rng(0)
    nan = clean_rows(steps=1)
    nan[5]["rollout_logprobs"][10] = float("nan")
    return {
        "clean": clean_rows(steps=1), "drift": clean_rows(noise=0.4, turns=4, steps=1),  # about 4 nats
        "leak": clean_rows(leak_obs=True, steps=1), "nan": nan,
        "topk": [{"step": 0, "group": i // 4, "reward": float(i % 2), **topk_row(rng, 40, k=5)} for i in range(32)],
        "lengths": [{"step": 0, "group": i // 4, "reward": float(i < 4), **token_row(rng, [int(n)], noise=0.05)}
                    for i, n in enumerate(rng.integers(10, 1200, 64))],
        # many rows at the longest length (cut at the limit), tied across the quartile boundary
        "ties": [{"step": 0, "group": i // 4, "reward": float(i % 3 == 0),
                  **token_row(rng, [int(n)], noise=0.05 if n == 300 else 0.2)}
                 for i, n in enumerate([300] * 13 + list(rng.integers(20, 290, 19)))],
        "padding": _padded(rng), "zero_engine": _zero_engine(rng),
        # more turns than diagnose's --max-turns default draws (16): the value reads the last of them
        "long": [{"step": 0, "group": i // 4, "reward": float(i % 2), **token_row(rng, [20] * 24, noise=0.05)}
                 for i in range(16)],
    }


def _padded(rng):
    """Every row padded to one width with (0.0, 0.0) tokens that the policy mask marks as policy."""
    rows = [{"step": 0, "group": i // 4, "reward": float(i % 2), **token_row(rng, [12, 10], noise=0.05)}
            for i in range(16)]
    width = max(len(r["logprobs"]) for r in rows) + 6
    for r in rows:
        pad = width - len(r["logprobs"])
        r["logprobs"] = list(r["logprobs"]) + [0.0] * pad
        r["rollout_logprobs"] = list(r["rollout_logprobs"]) + [0.0] * pad
        r["policy_mask"] = list(r["policy_mask"]) + [True] * pad
    return rows


def _zero_engine(rng):
    """A quarter of the rows whose engine returned no log-probs (0.0 on every token)."""
    rows = clean_rows(steps=1)
    for r in rows[::4]:
        r["rollout_logprobs"] = [0.0] * len(r["rollout_logprobs"])
    return rows


@pytest.mark.parametrize("case", ["clean", "drift", "leak", "nan", "topk", "lengths", "ties", "padding",
                                  "zero_engine", "long"])
def test_batch_values_are_the_checks_values_on_the_same_batch(tmp_path, case):
    rows = _cases()[case]
    for r in rows:
        r.pop("turn_ids", None)  # turns: the runs of policy tokens, as a trainer's batch has them
    res = {r.id: r for r in run_checks(read_dump(write_dump(rows, tmp_path / "d.jsonl")))}
    old, roll, pm = padded_tensors(rows)
    groups = torch.as_tensor(np.unique([r["group"] for r in rows], return_inverse=True)[1])
    live = batch_values(old, roll, pm, group_ids=groups, rewards=torch.tensor([r["reward"] for r in rows]))
    assert set(live) == {metric_name(c) for c in LIVE_CHECKS} | {metric_name("mismatch.prefix_drift") + "/first_turn",
                                                                 metric_name("mismatch.trajectory_ess")}
    for cid in LIVE_CHECKS:
        v, want = float(live[metric_name(cid)]), res[cid].value
        if want is None:  # the check is skipped: the batch cannot give the value
            assert np.isnan(v), (cid, v)
        else:
            assert v == pytest.approx(want, rel=1e-9, abs=1e-15), (cid, v, want)
    first = float(live[metric_name("mismatch.prefix_drift") + "/first_turn"])
    assert first == pytest.approx(res["mismatch.prefix_drift"].details.get("prefix_rms_first", np.nan), nan_ok=True)
    flagged = {"leak": "mismatch.placeholder_logprobs", "nan": "mismatch.nonfinite_logprobs",
               "topk": "mismatch.one_sided", "padding": "mismatch.placeholder_logprobs",
               "zero_engine": "mismatch.placeholder_logprobs"}
    # planted, and measured by checks that the transfer run left without a calibrated verdict (status info)
    measured = {"lengths": ("mismatch.sequence_ratio_length", 1.0), "drift": ("mismatch.prefix_drift", 3.0)}
    # the transfer experiment's candidate units: the dump check's details, the batch's values
    units, vals = res["mismatch.prefix_drift"].details.get("units"), batch_check_values(old, roll, pm, CHECK_PARAMS)
    if units is not None:
        for unit, key in (("total", "mismatch/prefix_drift"), ("per_token", "mismatch/k3"),
                          ("ess", "mismatch/trajectory_ess")):
            assert units[unit] == pytest.approx(float(vals[key]), rel=1e-9, abs=1e-15, nan_ok=True), (case, unit)
    if case in flagged:  # each planted failure reaches its threshold live too
        assert res[flagged[case]].status in ("warn", "fail")
    if case in measured:
        cid, least = measured[case]
        assert res[cid].status == "info" and res[cid].value >= least, (cid, res[cid].value)
    if case == "long":  # every turn is read, live as in the dump
        assert res["mismatch.prefix_drift"].details["turn_last"] == 23


def test_batch_values_read_nothing_on_the_host_and_run_on_meta(host_reads):
    old, roll, rm = agent_batch(0, B=16, L=40, mismatch=0.1)
    groups, rewards = torch.arange(16) // 4, torch.rand(16, generator=torch.Generator().manual_seed(0))
    with host_reads:
        values = batch_values(old, roll, rm, group_ids=groups, rewards=rewards)
    assert host_reads.calls == [] and len(values) == len(LIVE_CHECKS) + 2  # + first_turn, trajectory_ess
    meta = torch.device("meta")
    out = batch_check_values(old.to(meta), roll.to(meta), rm.bool().to(meta), CHECK_PARAMS,
                             group_ids=groups.to(meta), rewards=rewards.to(meta))
    assert all(v.device == meta and v.shape == () for v in out.values())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")
def test_batch_values_do_not_synchronise_a_cuda_device():
    old, roll, rm = agent_batch(0, B=16, L=40, mismatch=0.1)
    groups, rewards = torch.arange(16) // 4, torch.rand(16, generator=torch.Generator().manual_seed(0))
    want = batch_values(old, roll, rm, group_ids=groups, rewards=rewards)
    dev = [x.cuda() for x in (old, roll, rm, groups, rewards)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host synchronisation raises
    try:
        got = batch_values(*dev[:3], group_ids=dev[3], rewards=dev[4])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for k, v in want.items():
        torch.testing.assert_close(got[k].cpu(), v, equal_nan=True)


def test_warnings_fire_once_per_crossing_with_the_registry_thresholds(caplog):
    k3, drift = metric_name("mismatch.k3"), metric_name("mismatch.prefix_drift")
    warn = CHECKS["mismatch.k3"].threshold.warn
    w = LiveWarnings()
    with caplog.at_level(logging.WARNING, logger="creditlab.integrations"):
        got = [w.observe({k3: v}, step=s) for s, v in enumerate([warn / 2, warn, 3 * warn, float("nan"), warn / 3,
                                                                   2 * warn])]
        # a check without a calibrated verdict (the prefix drift: status info) never warns, whatever its value
        assert CHECKS["mismatch.prefix_drift"].threshold.warn is None
        quiet = [w.observe({drift: v, drift + "/first_turn": 0.0}) for v in (0.1, 10.0, 1e6)]
    assert [len(x) for x in got] == [0, 1, 0, 0, 0, 1]  # crossing, staying (and NaN) quiet, cleared, again
    assert quiet == [[], [], []]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(line.count("\n") == 0 for line in lines)
    assert "mismatch.k3 crossed its warn threshold at step 1" in lines[0] and CHECKS["mismatch.k3"].fix in lines[0]


# ------------------------------------------------------------------------------------------------
# verl


def _verl_step(seed=0, mismatch=0.05, B=8, L=24, rollout_is=None, rollout_rs=None, dump=None):
    """A step's batch through verl's own functions, as ``RayPPOTrainer.fit`` runs them on the driver:
    the rollout correction (``compute_rollout_correction_and_add_to_batch``) and ``compute_advantage``
    (with creditlab's dump hook when ``dump``); returns the batch and verl's rollout-correction metrics."""
    old, rollout, rm = agent_batch(seed, B=B, L=L, mismatch=mismatch)
    old, rollout = old.double(), rollout.double()
    last = L - 1 - torch.argmax(rm.flip(1), dim=1)
    scores = torch.zeros(B, L, dtype=torch.float64)
    outcome = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5])[:B].double()  # the second group: degenerate
    scores[torch.arange(B), last] = outcome
    P = 4
    attn = torch.cat([torch.ones(B, P), (torch.arange(L)[None, :] <= last[:, None]).float()], 1).long()
    data = DataProto.from_dict(
        tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": rm,
                 "token_level_scores": scores, "token_level_rewards": scores, "attention_mask": attn,
                 "prompts": torch.ones(B, P, dtype=torch.long), "responses": torch.ones(B, L, dtype=torch.long)},
        non_tensors={"uid": np.array([f"p{i // 4}" for i in range(B)], dtype=object)}, meta_info={"global_steps": 1})
    cfg = OmegaConf.create({"rollout_is": rollout_is, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
                            "rollout_rs": rollout_rs, "rollout_rs_threshold": 1e9 if rollout_rs else None,
                            "bypass_mode": False})
    data, corr = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(data, cfg)
    algo = {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True}
    if dump is not None:
        algo["creditlab"] = {"dump_dir": str(dump)}
    data = ray_trainer.compute_advantage(data, adv_estimator="grpo", config=OmegaConf.create(algo))
    return data, corr


def test_verl_step_metrics_carry_the_live_checks(tmp_path, host_reads):
    assert ray_trainer.compute_data_metrics is metric_utils.compute_data_metrics  # what fit() calls, wrapped
    data, corr = _verl_step(rollout_is="creditlab_interq", dump=tmp_path / "dump")
    own = metric_utils.compute_data_metrics.__creditlab_original__(batch=data, use_critic=False)
    metrics = {**corr}
    metrics.update(ray_trainer.compute_data_metrics(batch=data, use_critic=False))  # as fit() merges them
    assert {k: metrics[k] for k in own} == own  # verl's own data metrics unchanged
    assert sum(metric_name(c, V) in metrics for c in LIVE_CHECKS) >= 5
    # the same values as the checks of creditlab diagnose on the dump of this very batch
    res = {r.id: r for r in run_checks(read_dump(tmp_path / "dump"))}
    for cid in LIVE_CHECKS:
        key = metric_name(cid, V)
        if res[cid].value is None:
            assert key not in metrics, cid  # NaN: left out
        else:
            assert metrics[key] == pytest.approx(res[cid].value, rel=1e-9, abs=1e-15), cid
    assert metrics[V + "baseline/degenerate_groups"] == 0.5  # group p1 scored 0.5 four times
    # one K3 under one name: the live value replaced the rollout correction's, and it is verl's own k3_kl
    assert metrics[V + "mismatch/k3"] == pytest.approx(corr["rollout_corr/k3_kl"], rel=1e-6)
    # one host read for the whole step's live values
    with host_reads:
        cv.live_metrics(data)
    assert host_reads.calls == ["tolist"]


def test_verl_warns_once_per_run_per_check_and_again_after_it_cleared(caplog, monkeypatch):
    monkeypatch.setattr(cv, "_LIVE_WARNINGS", LiveWarnings(prefix=V))
    steps = [0.3, 0.3, 0.001, 0.3]  # large mismatch, still large, cleared, large again
    with caplog.at_level(logging.WARNING, logger="creditlab.integrations"):
        for s, mismatch in enumerate(steps):
            data, _ = _verl_step(seed=s, mismatch=mismatch)
            metrics = ray_trainer.compute_data_metrics(batch=data, use_critic=False)
            assert (metrics[V + "mismatch/k3"] >= CHECKS["mismatch.k3"].threshold.warn) == (mismatch > 0.01)
    k3 = [r.getMessage() for r in caplog.records if "mismatch.k3 crossed" in r.getMessage()]
    assert len(k3) == 2 and CHECKS["mismatch.k3"].fix in k3[0]
    monkeypatch.setenv(cv.LIVE_ENV, "0")  # switched off: verl's metrics only
    data, _ = _verl_step()
    assert not any(k.startswith(V) for k in ray_trainer.compute_data_metrics(batch=data, use_critic=False))


def test_verl_bypass_mode_checks_only_the_groups():
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

    data, _ = _verl_step()
    policy_loss = OmegaConf.create({"loss_mode": "vanilla"})
    apply_bypass_mode(data, OmegaConf.create({"bypass_mode": True}), policy_loss)  # verl: old := rollout
    metrics = ray_trainer.compute_data_metrics(batch=data, use_critic=False)
    assert [k for k in metrics if k.startswith(V)] == [V + "baseline/degenerate_groups"]


def test_diagnose_json_reports_verls_own_rollout_corr_metrics(tmp_path):
    """``trainer_metrics.verl`` from the dump equals verl's compute_offpolicy_metrics and its seq_sum_k3
    rejection statistic, on the tensors verl had."""
    data, corr = _verl_step(mismatch=0.2, rollout_rs="seq_sum_k3", dump=tmp_path / "dump")
    js = diagnose([tmp_path / "dump"], tmp_path / "diag").trainer_metrics
    b = data.batch
    mask = getattr(data, cv.MASK_BEFORE_REJECTION, None)
    mask = b["response_mask"] if mask is None else mask
    want = {f"rollout_corr/{k}": v for k, v in rollout_corr_helper.compute_offpolicy_metrics(
        b["old_log_probs"], b["rollout_log_probs"], mask).items()}
    assert {k: corr[k] for k in want} == pytest.approx(want, rel=1e-12)  # verl's own path logged these
    want.update({k: corr[k] for k in ("rollout_corr/rollout_rs_seq_sum_k3_mean",
                                      "rollout_corr/rollout_rs_seq_sum_k3_seq_mean",
                                      "rollout_corr/rollout_rs_seq_sum_k3_max")})
    for name, value in want.items():
        if name in js["verl"]:
            # 1e-8: verl's masked_mean adds 1e-8 to the token count, which a float32 mask rounds away
            assert js["verl"][name]["all"] == pytest.approx(value, rel=1e-8, abs=1e-9), name
            assert js["verl"][name]["by_step"] == [js["verl"][name]["all"]]
    assert {"rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_token", "rollout_corr/chi2_seq",
            "rollout_corr/ppl_ratio", "rollout_corr/rollout_rs_seq_sum_k3_seq_mean"} <= set(js["verl"])
    # where the definitions differ, creditlab's are its own: chi2 = E[(r-1)^2], seq K3 on the sequence ratio
    cl = js["creditlab"]
    assert cl["mismatch/k3"]["all"] == pytest.approx(js["verl"]["rollout_corr/k3_kl"]["all"], rel=1e-6)
    assert cl["mismatch/chi2"]["all"] != pytest.approx(js["verl"]["rollout_corr/chi2_token"]["all"], rel=1e-3)
    assert cl["mismatch/seq_k3"]["all"] != pytest.approx(
        js["verl"]["rollout_corr/rollout_rs_seq_sum_k3_seq_mean"]["all"], rel=1e-3)


# ------------------------------------------------------------------------------------------------
# TRL


def constant_reward(completions, **kwargs):  # every group degenerate
    return [1.0] * len(completions)


def _trl(tmp_path, rf, **kw):
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                      max_steps=4, learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no",
                      use_cpu=True, max_completion_length=16, disable_tqdm=True, seed=0)
    return CreditlabGRPOTrainer(model=tiny_model(), reward_funcs=constant_reward,
                                args=args, train_dataset=Dataset.from_dict({"prompt": ["take aspirin", "drink tea"]}),
                                processing_class=tiny_tokenizer(), rollout_func=rf, **kw)


def test_trl_logs_the_live_checks_with_its_metrics_and_warns_once_per_crossing(tmp_path, caplog, host_reads):
    tok = tiny_tokenizer()
    rf = make_rollout_func(tok, precision=lambda step: "fp32" if step == 2 else "fp8")  # the engine fixed at 2
    tr = _trl(tmp_path, rf, correction="interq", dump=tmp_path / "dump.jsonl")
    with caplog.at_level(logging.WARNING, logger="creditlab.integrations"):
        tr.train()
    assert_engine_differs(rf)
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert len(logs) == 4
    for h in logs:
        for cid in ("mismatch.k3", "mismatch.prefix_drift", "mismatch.placeholder_logprobs",
                    "mismatch.nonfinite_logprobs", "baseline.degenerate_groups"):
            assert metric_name(cid) in h, cid
    assert all(h["creditlab/baseline/degenerate_groups"] == 1.0 for h in logs)  # a constant reward
    # the logged K3 of each step is the check's on the dump of that step's batch
    res = run_checks(read_dump(tmp_path / "dump.jsonl"), only="mismatch.k3")[0]
    assert [h["creditlab/mismatch/k3"] for h in logs] == pytest.approx(res.series["k3"].tolist(), rel=1e-9)
    warn = CHECKS["mismatch.k3"].threshold.warn
    assert [h["creditlab/mismatch/k3"] >= warn for h in logs] == [True, True, False, True]
    k3 = [r.getMessage() for r in caplog.records if "mismatch.k3 crossed" in r.getMessage()]
    assert len(k3) == 2 and "at step 1" in k3[0] and "at step 4" in k3[1]  # crossed, cleared at step 3, again
    degenerate = [r for r in caplog.records if "baseline.degenerate_groups crossed" in r.getMessage()]
    assert len(degenerate) == 1
    # the values wait on the device: no host read per batch; one per logging step, for all of them
    tr.state.global_step = 5
    tr.model.train()
    out = tr._generate_and_score_completions([{"prompt": p} for p in ("take aspirin", "drink tea") for _ in range(4)])
    pm = (out["completion_mask"] * out["tool_mask"]).bool()
    with host_reads:
        tr._live_values(out, pm, "train")
    assert host_reads.calls == []
    with host_reads:
        tr.log({})
    assert host_reads.calls.count("tolist") == 1
    assert tr.state.log_history[-1]["creditlab/mismatch/k3"] > 0


def test_trl_live_checks_can_be_switched_off(tmp_path):
    tr = _trl(tmp_path, make_rollout_func(tiny_tokenizer()), correction="interq", live_checks=False)
    tr.args.max_steps = 1
    tr.train()
    h = next(h for h in tr.state.log_history if "loss" in h)
    assert "creditlab/mismatch/k3" in h  # the arm's own K3
    assert not any(k.startswith(("creditlab/mismatch/prefix_drift", "creditlab/baseline")) for k in h)
