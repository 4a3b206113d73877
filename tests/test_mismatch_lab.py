"""The mismatch lab: the stacked model, rollout and trainer it runs on, and the lab on the protocol."""

from dataclasses import replace

import pytest
import torch

from creditlab.errors import ConfigError
from creditlab.lab.protocol import run_lab
from creditlab.labs.mismatch import ARMS, LAB, MismatchConfig, arm_triple, score_curve
from creditlab.models.quant import PRECISIONS
from creditlab.models.tiny_lm import StackedTinyLM, TinyLM, TinyLMConfig
from creditlab.train.toolshop_base import BaseConfig
from creditlab.train.toolshop_grpo import GRPOConfig, train_grpo_stacked
from creditlab.train.toolshop_rollout import make_tasks, rollout_stacked, stacked_logprobs

TINY_BASE = BaseConfig(n_demos=64, steps=30, batch_size=16, d_model=32, n_layer=1, max_len=96, chain_lengths=(2, 3))
TINY_GRPO = GRPOConfig(updates=2, tasks_per_update=2, group_size=2, chain_lengths=(2, 3), max_len=48, eval_every=1,
                       eval_tasks=4)


pytestmark = pytest.mark.usefixtures("one_thread")


def _models(n=3):
    out = []
    for s in range(n):
        cfg = TinyLMConfig(vocab_size=40, d_model=32, n_head=4, max_len=48)
        m = TinyLM(cfg, generator=torch.Generator().manual_seed(s))
        with torch.no_grad():  # move off the tiny init so quantization matters
            for p in m.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + s)))
        out.append(m.eval())
    return out


# ---------------------------------------------------------------------------------------------
# StackedTinyLM: M models as one program


def assert_equal_up_to_rounding_flips(got: torch.Tensor, want: torch.Tensor, precision: str) -> None:
    """``(..., L, V)`` logits of two computations of one quantized program are equal at float noise,
    except where a value landed on the other side of a rounding boundary of the quantizer.

    Stacked and single-model matmuls sum in other orders, so a pre-quantization activation can differ
    in its last bit; when it sits on a rounding boundary, its quantized value moves by one step, and
    (through the KV cache) so does every later position of that sequence. Allowed: at most a quarter
    of the positions differ beyond float noise (1e-4), and then by less than what one quantization
    step can move a logit (0.25 here). A real change (another model's weights, a wrong cache) moves
    nearly every position by O(1) and fails both."""
    diff = (got - want).abs().amax(-1)  # (..., L) worst logit per position
    if precision in ("fp32", "bf16"):
        assert diff.max() <= 1e-4, float(diff.max())
        return
    flipped = diff > 1e-4
    assert flipped.float().mean() <= 0.25, f"{int(flipped.sum())} of {flipped.numel()} positions differ"
    assert diff.max() <= 0.25, float(diff.max())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_stacked_forward_and_decoding_equal_each_model(precision):
    models = _models()
    stack = StackedTinyLM(models)
    idx = torch.randint(0, 40, (3, 2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = stack(idx, precision)
        cache = stack.init_cache(2, precision)
        inc = torch.stack([stack.step(idx[:, :, t], cache) for t in range(16)], dim=2)
        for i, m in enumerate(models):
            assert_equal_up_to_rounding_flips(full[i], m(idx[i], precision), precision)
            c = m.init_cache(2, precision)
            ref = torch.stack([m.step(idx[i, :, t], c) for t in range(16)], dim=1)
            assert_equal_up_to_rounding_flips(inc[i], ref, precision)
    if precision == "fp32":
        assert torch.allclose(inc, full, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_the_rounding_flip_comparison_fails_on_a_real_change(precision):
    """The tolerant comparison above still tells another model, or a model with slightly other
    weights, from the same one."""
    models = _models()
    stack = StackedTinyLM(models)
    idx = torch.randint(0, 40, (3, 2, 16), generator=torch.Generator().manual_seed(1))
    nudged = _models()[0]
    with torch.no_grad():
        for p in nudged.parameters():
            p.mul_(1.05)
        full = stack(idx, precision)
        with pytest.raises(AssertionError):
            assert_equal_up_to_rounding_flips(full[0], models[1](idx[0], precision), precision)
        with pytest.raises(AssertionError):
            assert_equal_up_to_rounding_flips(full[0], nudged(idx[0], precision), precision)


def test_stacked_mixed_precisions_and_unstack():
    models = _models()
    stack = StackedTinyLM(models)
    idx = torch.randint(0, 40, (3, 2, 12), generator=torch.Generator().manual_seed(2))
    prec = ("fp32", "fp8", "nvfp4")
    with torch.no_grad():
        out = stack(idx, prec)
    for i, (m, p) in enumerate(zip(models, prec, strict=True)):
        assert torch.allclose(out[i], m(idx[i], p), atol=1e-5)
        back = stack.unstack(i)
        assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), m.state_dict().values(), strict=True))
    with pytest.raises(ConfigError, match="precision"):
        stack(idx, ("fp32", "fp8"))


def test_mixed_precision_stack_values_and_gradients_are_each_precision_alone():
    """A stack of mixed precisions runs each run of models through its own quantizer (split, not
    slices) with straight-through gradients: every model's logits and gradients are bit for bit
    those of a stack in its precision alone."""
    models = _models()
    idx = torch.randint(0, 40, (3, 2, 12), generator=torch.Generator().manual_seed(4))
    prec = ("fp8", "nvfp4", "fp32")

    def run(precision):
        stack = StackedTinyLM(models)
        out = stack(idx, precision)
        (out.logsumexp(-1).mean(dim=(1, 2)) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
        return out.detach(), {n: p.grad for n, p in stack.named_parameters()}

    out, grads = run(prec)
    for i, p in enumerate(prec):
        out_p, grads_p = run(p)
        assert torch.equal(out[i], out_p[i])
        assert all(torch.equal(grads[n][i], grads_p[n][i]) for n in grads)


def test_stacked_gradients_are_per_model_and_clipped_per_model():
    models = _models(2)
    stack = StackedTinyLM(models)
    idx = torch.randint(0, 40, (2, 2, 10), generator=torch.Generator().manual_seed(3))
    loss = stack(idx, ("fp32", "nvfp4"))[0].logsumexp(-1).mean()  # model 0's loss only
    loss.backward()
    assert all(bool(p.grad[1].eq(0).all()) for p in stack.parameters() if p.grad is not None)
    ref = models[0]
    ref.zero_grad()
    ref(idx[0]).logsumexp(-1).mean().backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    norms = stack.clip_grad_norm_(0.1)
    assert norms[0] == pytest.approx(float(want), rel=1e-5) and norms[1] == 0
    assert torch.allclose(stack.param("blocks.0.qkv.weight").grad[0], ref.blocks[0].qkv.weight.grad, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# rollout_stacked and train_grpo_stacked


def test_stacked_rollout_logprobs_pairing_and_independence(tiny_base):
    stack = StackedTinyLM([tiny_base, tiny_base])
    tasks = make_tasks(range(6), (2, 3))
    u = torch.rand(1, 6, 48, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    b = rollout_stacked(stack, [tasks, tasks], u.expand(2, -1, -1), precision=("fp32", "fp32"), max_len=48)
    # same policy, same uniforms: the same trajectories (common random numbers)
    assert torch.equal(b.tokens[0], b.tokens[1]) and bool(b.policy_mask.any())
    lp = stacked_logprobs(stack, b.tokens)
    assert torch.allclose(lp[b.policy_mask], b.rollout_logprobs[b.policy_mask], atol=1e-5)
    # one model alone draws what it draws inside the stack
    alone = rollout_stacked(StackedTinyLM([tiny_base]), [tasks], u, max_len=48)
    L = alone.tokens.size(-1)
    assert torch.equal(alone.tokens[0], b.tokens[0, :, :L]) and torch.equal(alone.success[0], b.success[0])
    # the environment saw the sampled tokens: the actions are the policy tokens without their EOA
    from creditlab.envs.toolshop import EOA

    for toks, pm, recs in zip(b.tokens[0], b.policy_mask[0], b.records[0], strict=True):
        sampled = [int(t) for t in toks[pm] if int(t) != EOA]
        acts = [t for r in recs for t in r.action]
        assert acts and sampled[:len(acts)] == acts
    # dropping finished rows from the engine's batch keeps every trajectory
    c = rollout_stacked(stack, [tasks, tasks], u.expand(2, -1, -1), precision=("fp32", "fp32"), max_len=48,
                        compact=0.9)
    assert torch.equal(c.tokens, b.tokens) and torch.allclose(c.rollout_logprobs, b.rollout_logprobs, atol=1e-5)
    assert c.decode_rows < b.decode_rows == 2 * 6 * b.decode_steps
    q = rollout_stacked(stack, [tasks, tasks], u.expand(2, -1, -1), precision="nvfp4", max_len=48)
    d = (stacked_logprobs(stack, q.tokens) - q.rollout_logprobs)[q.policy_mask]
    assert d.abs().mean() > 1e-4  # an fp32 learner does not reproduce the FP4 engine


def test_stacked_trainer_pairs_arms_and_is_independent_of_stack_mates(tiny_base):
    cfgs = [replace(TINY_GRPO, rollout_precision=e, learner_precision=lp, correction=c)
            for e, lp, c in (("fp8", "fp8", "none"), ("fp8", "fp8", "interq"), ("fp8", "fp32", "none"))]
    rows = train_grpo_stacked(StackedTinyLM([tiny_base] * 3), cfgs)
    first = [r[0] for r in rows]
    # update 0: one engine, one base policy, same uniforms: the same rollouts in every arm
    assert first[0]["reward/success"] == first[1]["reward/success"] == first[2]["reward/success"]
    assert first[0]["mismatch/k3"] == pytest.approx(first[1]["mismatch/k3"], rel=1e-6)
    assert first[2]["mismatch/k3"] > first[0]["mismatch/k3"] > 0  # naive fp32 learner vs QAT
    assert first[0]["eval/success"] == first[1]["eval/success"] == first[2]["eval/success"]
    assert {"eval/interaction_cost", "eval/cap_exhaustion", "time/rollout_s"} <= set(rows[0][-1]) | set(rows[0][0])
    alone = train_grpo_stacked(StackedTinyLM([tiny_base]), cfgs[1:2])[0]
    for a, b in zip(alone, rows[1], strict=True):
        for k in ("reward/success", "mismatch/k3", "eval/success", "loss/policy"):
            if k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    with pytest.raises(ConfigError, match="lr"):
        train_grpo_stacked(StackedTinyLM([tiny_base] * 2), [cfgs[0], replace(cfgs[1], lr=1e-3)])


# ---------------------------------------------------------------------------------------------
# the lab


def _tiny(cache, **kw):
    return MismatchConfig(base=TINY_BASE, grpo=replace(TINY_GRPO, updates=4, eval_every=2), seeds=2, smooth=2,
                          experiments=("fp8", "nvfp4"), cache_dir=str(cache), **kw)


def test_lab_writes_every_table_and_plot_and_resumes(tmp_path, tiny_base_cache):
    cfg = _tiny(tiny_base_cache, arms=("fp32", "naive", "qat", "qat_interq"))
    out = tmp_path / "out"
    said = []
    res = run_lab(LAB, cfg, out, progress=False, status=said.append)
    tables = ("knobs", "gate", "dose", "summary", "means", "diff_vs_qat", "diff_vs_fp32", "predictions", "phase_map",
              "by_turn", "fingerprint", "curves")
    for name in tables:
        assert (out / f"{name}.parquet").exists() and (out / f"{name}.md").exists(), name
    assert {p.name for p in res.plots} == {"mismatch_success.png", "mismatch_k3.png", "mismatch_fingerprint.png",
                                           "mismatch_dose.png", "mismatch_phase_map.png"}
    assert said[0].startswith("Gate:") and "drift_qat" in said[0] and len(said) == 2  # the gate, then the summary
    assert set(res.tables["gate"].frame["engine"]) == {"fp8", "int8", "nvfp4", "mxfp4"}
    assert {p.split(":")[0] for p in res.tables["predictions"].frame["prediction"]} == {
        "(a) at fp8", "(b) at fp8", "(a) at nvfp4", "(b) at nvfp4"}
    assert list(res.tables)[-1] == "predictions"  # the lab's one predictions table, judged after every other
    assert set(res.tables["predictions"].frame["experiment"]) == {"comparison"}
    dose = res.tables["dose"].frame
    assert set(dose["engine"]) == {"fp32", "fp8", "int8", "nvfp4", "mxfp4"} and len(dose) == 9
    assert dose.set_index(["engine", "learner"])["k3"][("fp32", "fp32")] < 1e-9
    s = res.tables["summary"].frame
    assert len(s) == 2 + 2 * 3 * 2  # fp32 x seeds + doses x quantized arms x seeds
    assert (s["rollback"] >= 0).all() and (s["rollback"] == s["best"] - s["final"]).all()
    assert (s[s["arm"] == "fp32"]["k3_late"] < 1e-9).all()
    m = res.tables["means"].frame
    assert set(m["dose"]) == {"fp8", "nvfp4"} and (m["arm"] == "fp32").sum() == 2  # fp32 under every dose
    d = res.tables["diff_vs_qat"].frame
    assert set(d["diff"]) == {"fp32 - qat", "naive - qat", "qat_interq - qat"}
    report = (out / "report.md").read_text()
    assert "Paired differences against QAT" in report and "rollback" in report
    # not the run the calibration rule was registered on: no calibration, and the report says why
    assert "prefix_drift_calibration" not in res.tables and not (out / "prefix_drift_calibration.parquet").exists()
    assert ("No calibration of creditlab diagnose's mismatch.prefix_drift thresholds is read from this map (no "
            "prefix_drift_calibration table)") in report and "this run is of the paper protocol" in report
    assert run_lab(LAB, cfg, out, progress=False).computed == 0
    # one dose only: the same run (experiments are a selection), nothing recomputed
    one = run_lab(LAB, replace(cfg, experiments=("fp8",)), out, progress=False)
    assert one.computed == 0 and set(one.tables["means"].frame["dose"]) == {"fp8"}


def test_the_calibration_is_written_only_from_the_run_it_was_registered_on(tmp_path, tiny_base_cache, monkeypatch):
    """A re-render of a part of the registered run (-e) used to rewrite the calibration from that part."""
    registered = replace(_tiny(tiny_base_cache, arms=("fp32", "naive", "qat")), protocol="two-core", seeds=1,
                         smooth=1)
    monkeypatch.setattr(MismatchConfig, "two_core", classmethod(lambda cls: replace(registered, cache_dir=None)))
    out = tmp_path / "out"
    res = run_lab(LAB, registered, out, progress=False)
    assert "prefix_drift_calibration" in res.tables
    calibration = (out / "prefix_drift_calibration.parquet").read_bytes()
    part = run_lab(LAB, replace(registered, experiments=("fp8",)), out, progress=False)
    assert part.computed == 0 and "prefix_drift_calibration" not in part.tables
    assert not (out / "prefix_drift_calibration.parquet").exists()
    report = " ".join((out / "report.md").read_text().split())
    assert ("this run is not it: it selects dose(s) fp8 of the registered fp8, nvfp4 (-e), leaving out nvfp4"
            in report)
    assert "**This render reads a subset of the run**: it selects fp8" in report and "(of nvfp4: -e nvfp4)" in report
    again = run_lab(LAB, registered, out, progress=False)  # the whole run: the same calibration again
    assert again.computed == 0 and (out / "prefix_drift_calibration.parquet").read_bytes() == calibration


def test_score_curve_reads_a_rollback_and_the_arms_are_the_issue_s():
    up = torch.arange(0, 60, 10).numpy()
    s = score_curve(up, [0.2, 0.5, 0.8, 0.8, 0.5, 0.4], smooth=2)
    assert s["best"] == pytest.approx(0.8) and s["final"] == pytest.approx(0.45)
    assert s["rollback"] == pytest.approx(0.35) and s["best_update"] == 30 and s["aulc"] == pytest.approx(3.2 / 6)
    assert arm_triple("naive", "nvfp4") == ("nvfp4", "fp32", "none")
    assert arm_triple("qat_interq", "fp8") == ("fp8", "fp8", "interq")
    assert arm_triple("fp32", "int8") == ("fp32", "fp32", "none")
    assert list(ARMS) == ["fp32", "naive", "qat", "qat_tis", "qat_mis", "qat_prefix", "qat_global", "qat_interq",
                          "qat_mis_low", "qat_interq_tis"]  # the last two: the dual-clip protocol's ablation
    assert arm_triple("qat_mis_low", "mxfp4") == ("mxfp4", "mxfp4", "mis:lo=0.36787944117144233,hi=inf")
    with pytest.raises(ConfigError, match="arms"):
        arm_triple("qat_magic", "fp8")


@pytest.mark.parametrize(("args", "flag"), [
    (["--seeds", "0"], "--seeds"),
    (["-e", "fp16"], "--experiment"),
])
def test_cli_errors_name_the_flag(tmp_path, args, flag, capsys):
    from creditlab.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["lab", "mismatch", "--quick", "--out", str(tmp_path / "x"), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_quick_config_is_valid_and_small():
    q = MismatchConfig.quick()
    q.validate()
    MismatchConfig().validate()
    assert q.grpo.updates * q.grpo.tasks_per_update * q.grpo.group_size < 1000
    # the lab's corrections beside fp32 and QAT (stacked in one cell: little more time)
    assert q.arms == ("fp32", "naive", "qat", "qat_tis", "qat_interq") and q.seeds == 1
    assert [len(c.kwargs["arms"]) for c in LAB.cells(q) if c.group == "train"] == [1, 4]


def test_a_run_that_would_build_its_base_says_so_first(tmp_path, monkeypatch):
    """--protocol two-core from a pip install (no results/ folder, so no cached base) used to start a 50-minute
    build without a word, under a help text saying that no run trains the base."""
    from cli_inproc import run_inproc
    from creditlab.errors import ConfigError
    from creditlab.labs.mismatch import MismatchLab

    def stop(self, cfg, progress=True):
        raise ConfigError("--test", "stopped where the build would start")

    monkeypatch.setattr(MismatchLab, "prepare", stop)
    cache = tmp_path / "cache"
    monkeypatch.setenv("CREDITLAB_CACHE", str(cache))
    r = run_inproc("lab", "mismatch", "--protocol", "two-core", "--out", tmp_path / "out")
    assert r.returncode == 2 and "stopped where the build would start" in r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if "is built first" in ln]  # one line, before the build
    assert line.startswith("mismatch lab: this run's base policy (toolshop-base-f2af6f5721dd887d: 40 thoughts")
    assert f"neither in the cache {cache} nor shipped with creditlab" in line
    assert "3000 optimizer steps, about 51 minutes on 2 cores (3037 s measured)" in line
    assert f"cached in {cache}" in line and "CREDITLAB_CACHE=<checkout>/results/mismatch-2core" in line
    # the default protocol's base ships: nothing is built, and nothing is said
    r = run_inproc("lab", "mismatch", "--out", tmp_path / "out2")
    assert r.returncode == 2 and "built first" not in r.stdout
    h = run_inproc("lab", "mismatch", "--help")
    text = " ".join(h.stdout.split())
    assert "no run trains it" not in text and "builds it first (about 50 minutes on 2 cores)" in text


def test_dump_writes_each_arm_in_the_diagnose_schema_and_diagnose_tells_them_apart(tmp_path, tiny_base_cache):
    """--dump: one file per dose, arm and seed, which diagnose reads: K3 is float noise in the fp32 arm
    and not in the naive arm (an fp32 learner on an FP4 engine); the dump does not change a number."""
    from creditlab.diagnose.checks import run_checks
    from creditlab.diagnose.readers import read_dump

    cfg = replace(_tiny(tiny_base_cache, arms=("fp32", "naive"), dump_dir=str(tmp_path / "dump")),
                  experiments=("nvfp4",), seeds=1, smooth=1)
    res = run_lab(LAB, cfg, tmp_path / "out", progress=False)
    names = sorted(p.name for p in (tmp_path / "dump").iterdir())
    assert names == ["mismatch-fp32-fp32-seed=0.jsonl", "mismatch-nvfp4-naive-seed=0.jsonl"]
    status = {}
    for arm, path in (("fp32", "mismatch-fp32-fp32-seed=0.jsonl"), ("naive", "mismatch-nvfp4-naive-seed=0.jsonl")):
        dump = read_dump([tmp_path / "dump" / path])
        assert len(dump) == cfg.grpo.updates * cfg.grpo.tasks_per_update * cfg.grpo.group_size
        (k3,) = run_checks(dump, only=("mismatch.k3",))
        status[arm] = (k3.status, k3.value)
    # this tiny test model's naive K3 is about 1e-4, under the check's warn line (the lab's model is at 4e-2)
    assert status["fp32"][0] == "ok" and status["fp32"][1] < 1e-9 and status["naive"][1] > 1e-6
    # the agreement table: the same checks on the same dumps, against each run's rollback
    agree = res.tables["diagnose_agreement"].frame.set_index("arm")
    assert list(agree.index) == ["fp32", "naive"]
    assert agree.loc["fp32", "k3"] == status["fp32"][0] and agree.loc["naive", "k3_value"] == status["naive"][1]
    summary = res.tables["summary"].frame.set_index("arm")
    for arm, r in agree.iterrows():
        assert r["rollback"] == summary.loc[arm, "rollback"]
        assert r["agrees"] == ((r["verdict"] == "fail") == r["rolls_back"])
    plain = run_lab(LAB, replace(cfg, dump_dir=None), tmp_path / "plain", progress=False)
    import pandas as pd

    assert "diagnose_agreement" not in plain.tables
    pd.testing.assert_frame_equal(res.tables["summary"].frame, plain.tables["summary"].frame)
    # a re-render reads the cells back, so no dump is written again (the committed dumped run's command, whose
    # dumps were not committed): it used to delete the table and its report section, and exit 0
    out = tmp_path / "out"
    kept = {n: (out / n).read_bytes() for n in ("diagnose_agreement.parquet", "diagnose_agreement.md")}
    for dump in (str(tmp_path / "no-dumps"), None):  # --dump DIR of nothing, and no --dump
        again = run_lab(LAB, replace(cfg, dump_dir=dump), out, progress=False)
        assert again.computed == 0
        assert {n: (out / n).read_bytes() for n in kept} == kept
        pd.testing.assert_frame_equal(again.tables["diagnose_agreement"].frame, res.tables["diagnose_agreement"].frame)
        report = " ".join((out / "report.md").read_text().split())
        assert "## creditlab diagnose on each run's own dump against its measured rollback" in report
        assert "**Carried over unchanged from an earlier render of this run** (finished " in report
        assert ("it runs creditlab diagnose on each run's training dump (--dump), which a cell writes only when it "
                "is computed") in report
        assert ("2 of the 2 runs of this render have no dump in" if dump else "this render has no --dump") in report
