"""The mismatch lab's estimator experiment: the batch gradient against a loop reference and the clipped surrogate,
the weightings on an exact batch, the oracle weight, the moments, the cells (engine precisions and planted doses),
the tables and prediction E1."""

import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch

from creditlab.errors import ConfigError
from creditlab.lab.experiment import Verdict
from creditlab.lab.protocol import Table
from creditlab.labs.mismatch import MismatchConfig
from creditlab.labs.mismatch.estimator import (
    EXPERIMENT,
    ORACLE,
    PREDICTIONS,
    WEIGHTINGS,
    Moments,
    estimate,
    estimator_table,
    parse_dose,
    run_estimator_cell,
    sequence_ratio_weights,
    surrogate_gradients,
    token_mean_coefficients,
    weightings_of,
)
from creditlab.models.tiny_lm import StackedTinyLM, TinyLM, TinyLMConfig
from creditlab.train.toolshop_base import BaseConfig
from creditlab.train.toolshop_grpo import GRPOConfig
from creditlab.train.toolshop_rollout import make_tasks, rollout_stacked, sequence_logprobs

TINY_BASE = BaseConfig(n_demos=64, steps=30, batch_size=16, d_model=32, n_layer=1, max_len=96, chain_lengths=(2, 3))
TINY_GRPO = GRPOConfig(updates=2, tasks_per_update=2, group_size=2, chain_lengths=(2, 3), max_len=48, eval_every=1,
                       eval_tasks=4)

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed=0, vocab=40, L=16):
    m = TinyLM(TinyLMConfig(vocab_size=vocab, d_model=32, n_head=4, n_layer=1, max_len=L),
               generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # off the tiny init, so the gradients are not all tiny
        for p in m.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + seed)))
    return m.eval()


def _flat_grad(model, loss):
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return torch.cat([(torch.zeros(p.numel()) if g is None else g.reshape(-1)).double()
                      for p, g in zip(model.parameters(), grads, strict=True)])


def _ragged_batch(seed, B=3, L=10, vocab=40):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, L), generator=g)
    pm = torch.rand(B, L, generator=g) < 0.6
    pm[:, 0] = False  # position 0 has no log-prob
    pm[-1] = False  # a row without policy tokens
    pm[0, 1:] = True  # a row of policy tokens to the end
    return tokens, pm


# ---------------------------------------------------------------------------------------------
# the gradient of one batch


def _loop_gradient(model, tokens, pm, weights, adv, precision="fp32"):
    """The slow reference: every policy token's log-prob from a forward of its own prefix, summed one by one
    with coefficient w A / (policy tokens of the batch), then one backward."""
    n = max(int(pm.sum()), 1)
    total = torch.zeros((), dtype=torch.float64)
    for b in range(tokens.size(0)):
        for t in range(tokens.size(1)):
            if pm[b, t]:
                lp = sequence_logprobs(model, tokens[b:b + 1, :t + 1], precision)[0, t]
                total = total + float(weights[b, t]) * float(adv[b]) / n * lp.double()
    if total.grad_fn is None:
        return torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    return _flat_grad(model, total)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_batch_gradient_equals_a_per_token_loop_on_ragged_masks(seed):
    model = _model(seed)
    tokens, pm = _ragged_batch(seed)
    g = torch.Generator().manual_seed(10 + seed)
    K = 3
    weights = torch.rand(K, *tokens.shape, generator=g, dtype=torch.float64) * 2
    weights[~pm.expand(K, -1, -1)] = float("nan")  # junk off policy tokens changes nothing
    adv = torch.randn(tokens.size(0), generator=g)
    lp = sequence_logprobs(model, tokens, "fp32")
    got = surrogate_gradients(lp, list(model.parameters()), token_mean_coefficients(weights, adv, pm))
    assert got.shape == (K, sum(p.numel() for p in model.parameters()))
    for k in range(K):
        want = _loop_gradient(model, tokens, pm, weights[k], adv)
        assert want.norm() > 1e-3
        assert torch.allclose(got[k], want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    # a batch without policy tokens: zero gradient, not NaN
    lp = sequence_logprobs(model, tokens, "fp32")
    none = surrogate_gradients(lp, list(model.parameters()),
                               token_mean_coefficients(weights, adv, torch.zeros_like(pm)))
    assert torch.equal(none, torch.zeros_like(none))


@pytest.mark.parametrize("precision", ["fp32", "nvfp4"])
def test_the_gradient_is_minus_the_clipped_surrogates_at_the_sampling_checkpoint(precision):
    """At the sampling checkpoint the PPO ratio is 1: the clipped, dual-clipped, weighted token-mean surrogate of
    policy_loss has gradient -g_w."""
    from creditlab.core.losses import policy_loss

    model = _model(3)
    tokens, pm = _ragged_batch(3)
    g = torch.Generator().manual_seed(4)
    w = torch.rand(*tokens.shape, generator=g) * 2
    adv = torch.tensor([1.0, -2.0, 0.5])  # negative advantages: the dual clip's side
    lp = sequence_logprobs(model, tokens, precision)
    loss, _ = policy_loss(lp, lp.detach(), adv, pm, clip_low=0.2, clip_high=0.28, weights=w, agg="token_mean",
                          clip_ratio_c=3.0)
    want = -_flat_grad(model, loss)
    lp = sequence_logprobs(model, tokens, precision)
    got = surrogate_gradients(lp, list(model.parameters()), token_mean_coefficients(w[None].double(), adv, pm))[0]
    assert want.norm() > 1e-3
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7 * float(want.abs().max()))


# ---------------------------------------------------------------------------------------------
# the weightings


def test_the_oracle_is_the_untruncated_sequence_ratio_per_row():
    old = torch.tensor([[-1.0, -2.0, 0.0, -1.0], [-0.5, -0.5, -0.5, -0.5], [-3.0, -3.0, -3.0, -3.0]])
    roll = torch.tensor([[-1.5, -2.0, 7.0, -4.0], [-0.5, -0.7, -0.1, -0.5], [-1.0, -1.0, -1.0, -1.0]])
    pm = torch.tensor([[True, True, False, True], [True, True, True, False], [False, False, False, False]])
    w = sequence_ratio_weights(old, roll, pm)
    assert w.dtype == torch.float64
    # row 0: 0.5 + 0 + 3 = 3.5 (the masked 7.0 does not count); row 1: 0 + 0.2 - 0.4 = -0.2; row 2: no policy token
    want = torch.tensor([[math.exp(3.5)] * 2 + [1.0, math.exp(3.5)], [math.exp(-0.2)] * 3 + [1.0], [1.0] * 4],
                        dtype=torch.float64)
    assert torch.allclose(w, want, rtol=1e-6)
    # not truncated: the registered seq_is caps the same row at 2
    capped = weightings_of(old, roll, pm, torch.ones_like(pm), ("seq_is", ORACLE))
    assert capped[0, 0, 0] == pytest.approx(2.0) and capped[1, 0, 0] == pytest.approx(math.exp(3.5))
    with pytest.raises(ValueError, match="policy_mask"):
        sequence_ratio_weights(old, roll, pm.float())


def test_every_weighting_is_the_unweighted_gradient_on_an_exact_batch(tiny_base):
    """The exact sampler draws from the learner itself (delta ~ 0): every weighting's gradient is g_1. The engine
    of the dose does not (the two sides differ there, so the identity is not 0 = 0)."""
    stack = StackedTinyLM([tiny_base])
    tasks = [t for t in make_tasks(range(4), (2, 3)) for _ in range(2)]
    u = torch.rand(1, 8, 48, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    params = list(tiny_base.parameters())
    for precision, exact, same in (("fp32", True, True), ("nvfp4", False, False)):
        r = rollout_stacked(stack, [tasks], u, precision=precision, max_len=48, exact=exact)
        pm, vm, rlp = r.policy_mask[0], r.valid_mask[0], r.rollout_logprobs[0]
        lp = sequence_logprobs(tiny_base, r.tokens[0], precision)
        adv = torch.tensor([1.0, -1.0] * 4)
        w = weightings_of(lp.detach(), rlp, pm, vm)
        grads = surrogate_gradients(lp, params, token_mean_coefficients(torch.cat([torch.ones_like(w[:1]), w]),
                                                                        adv, pm))
        scale = float(grads[0].norm())
        assert scale > 1e-4
        err = (grads[1:] - grads[0]).norm(dim=1) / scale
        if same:
            assert float((lp.detach() - rlp)[pm].abs().max()) < 1e-4
            assert (err < 1e-5).all(), dict(zip(WEIGHTINGS, err.tolist(), strict=True))
        else:
            assert float(err[list(WEIGHTINGS).index("none")]) < 1e-12
            assert float(err.max()) > 1e-3  # the engine's batch: the weightings move the gradient


def test_the_exact_sampler_at_a_quantized_dose_reports_the_learners_logprobs(tiny_base):
    """Up to rounding flips (a quantized activation on the other side of a boundary moves a few tokens)."""
    stack = StackedTinyLM([tiny_base])
    tasks = make_tasks(range(8), (2, 3))
    u = torch.rand(1, 8, 48, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for exact, small in ((True, True), (False, False)):
        r = rollout_stacked(stack, [tasks], u, precision="nvfp4", max_len=48, exact=exact)
        with torch.no_grad():
            d = (sequence_logprobs(tiny_base, r.tokens[0], "nvfp4") - r.rollout_logprobs[0])[r.policy_mask[0]].double()
        k3 = float((d.exp() - 1 - d).mean())
        assert (k3 < 1e-6) == small and ((d.abs() > 1e-4).double().mean() < 0.05) == small, k3


def test_moments_are_the_mean_and_the_trace_of_the_covariance():
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    m = Moments()
    assert math.isnan(m.trace_var)
    for row in x:
        m.add(row)
    assert torch.allclose(m.mean, x.mean(0))
    assert m.trace_var == pytest.approx(float(np.trace(np.cov(x.numpy().T))), rel=1e-10)


# ---------------------------------------------------------------------------------------------
# the cell and the experiment


def test_the_cell_measures_every_weighting_and_the_experiment_reads_it(tmp_path, tiny_base_cache, capsys):
    """The QAT cell of the lab's quick config (its shipped base policy: the tiny one never succeeds, so its
    advantages and gradients are all 0), and the base cell of the tiny base; then the experiment's tables, plot,
    reading and prediction on their rows."""
    quick = MismatchConfig.quick()
    rows = run_estimator_cell(quick.identity(), "nvfp4", "qat", 2, 1, str(quick.cache()))
    assert "mismatch estimator nvfp4/qat: batch 2/2" in capsys.readouterr().err
    df = pd.DataFrame(rows)
    assert list(df["weighting"]) == list(WEIGHTINGS) and (df["n_true"] == 2).all() and (df["n_engine"] == 2).all()
    assert (df["k3"] > 0).all() and (df["sampler_k3"] < 1e-3 * df["k3"]).all()
    cols = ["bias_se_ratio", "se_paired", "se", "variance", "true_norm", "cosine", "rel_bias"]
    assert np.isfinite(df[cols].to_numpy()).all() and (df[["se_paired", "variance", "true_norm"]] > 0).all().all()
    none = df[df["weighting"] == "none"].iloc[0]
    assert none["mean_abs_w1"] == 0 and math.isnan(none["shift_se_ratio"])
    assert (df[df["weighting"] != "none"]["mean_abs_w1"] > 0).all()
    assert df.set_index("weighting")["shift_cosine_oracle"][ORACLE] == pytest.approx(1.0)

    tiny = MismatchConfig(base=TINY_BASE, grpo=TINY_GRPO, seeds=1, smooth=1, experiments=("nvfp4",),
                          cache_dir=str(tiny_base_cache))
    base = run_estimator_cell(tiny.identity(), "nvfp4", "base", 2, 0, str(tiny_base_cache))
    again = run_estimator_cell(tiny.identity(), "nvfp4", "base", 2, 0, str(tiny_base_cache))
    pd.testing.assert_frame_equal(pd.DataFrame(again), pd.DataFrame(base))  # its arguments fix its rows
    both = pd.concat([df, pd.DataFrame(base)], ignore_index=True)

    tabs = EXPERIMENT.tables({"estimator": both}, quick)
    assert set(tabs) == {"estimator", "estimator_sampler"}
    t, s = tabs["estimator"].frame, tabs["estimator_sampler"].frame
    assert len(t) == 2 * len(WEIGHTINGS) and list(t["checkpoint"].unique()) == ["base", "qat"]
    assert len(s) == 2 and set(s["exact"]) == {"yes"}
    plots = EXPERIMENT.plots(tabs, quick, tmp_path)
    assert [p.name for p in plots] == ["mismatch_estimator.png"] and plots[0].stat().st_size > 10_000
    text = EXPERIMENT.interpret(tabs, quick)
    assert "nvfp4/qat: smallest bias/SE" in text["estimator"] and "interq" in text["estimator"]
    assert "Exact at every point" in text["estimator_sampler"]
    assert PREDICTIONS[0].row(tabs)["measured"].startswith("nvfp4/base: seq ")


def test_estimate_refuses_a_single_batch(tiny_base):
    with pytest.raises(ConfigError, match="estimator_batches"):
        estimate(tiny_base, TINY_GRPO, "nvfp4", 1)


def _with(cfg, **fields):
    out = replace(cfg)
    for name, value in fields.items():
        object.__setattr__(out, name, value)
    return out


def test_cells_one_per_dose_and_checkpoint_and_validation():
    cfg = _with(MismatchConfig.quick(), estimator_doses=("nvfp4", "mxfp4", "planted:0.4"))
    cells = EXPERIMENT.cells(cfg)
    assert [c.name for c in cells] == ["nvfp4/base", "nvfp4/qat", "mxfp4/base", "mxfp4/qat", "planted:0.4/base",
                                       "planted:0.4/trained"]
    assert {c.group for c in cells} == {"estimator"}
    base, qat, trained = cells[0].kwargs, cells[1].kwargs, cells[-1].kwargs
    assert base["qat_updates"] == 0 and qat["qat_updates"] >= 1 and base["config"] == cfg.identity()
    assert trained["qat_updates"] == qat["qat_updates"] and trained["dose"] == "planted:0.4"
    assert cells[0].context == cfg.context()
    EXPERIMENT.validate(cfg)
    for name, bad, flag in (("estimator_doses", ("fp16",), "estimator_doses"), ("estimator_batches", 1,
                                                                                  "estimator_batches"),
                            ("estimator_qat_updates", 0, "estimator_qat_updates")):
        with pytest.raises(ConfigError, match=flag):
            EXPERIMENT.validate(_with(cfg, **{name: bad}))


@pytest.mark.parametrize("bad", [("planted:0",), ("planted:-0.2",), ("planted:nan",), ("planted:inf",),
                                 ("planted:",), ("planted:x",), ("planted0.2",), ("nvfp4", "planted:0.2",
                                                                                   "planted:0.20"), ()])
def test_a_planted_dose_needs_a_finite_strength_above_0_and_errors_name_estimator_doses(bad):
    with pytest.raises(ConfigError, match="estimator_doses"):
        EXPERIMENT.validate(_with(MismatchConfig.quick(), estimator_doses=bad))


def test_parse_dose():
    assert parse_dose("mxfp4") == ("mxfp4", 0.0)
    assert parse_dose("planted:0.2") == ("fp32", 0.2) and parse_dose("planted:1e-3") == ("fp32", 0.001)
    with pytest.raises(ConfigError, match="estimator_doses"):
        parse_dose("fp32")  # not an engine dose: the exact sampler's precision


def test_a_planted_cell_samples_the_planted_engine_against_the_fp32_learner(monkeypatch, tmp_path):
    """The planted dose on a tiny GRPO config (the thought-free world's base ships with the package): the engine is
    the fp32 engine planted with s, the exact sampler and the learner fp32 without a plant; the trained checkpoint
    is uncorrected fp32 GRPO on the planted engine; then the tables and their reading."""
    import creditlab.train.toolshop_grpo as grpo_mod
    import creditlab.train.toolshop_rollout as rollout_mod
    from creditlab.labs.mismatch.planted import PLANTED_WORLDS

    calls = {"rollout": [], "learner": [], "train": []}
    real_rollout, real_lp, real_train = (rollout_mod.rollout_stacked, rollout_mod.sequence_logprobs,
                                         grpo_mod.train_grpo_stacked)

    def rollout(stack, tasks, u, **kw):
        calls["rollout"].append((kw["precision"], kw.get("plant", 0.0), kw.get("exact", False), kw["max_len"],
                                  kw["max_action_len"]))
        return real_rollout(stack, tasks, u, **kw)

    def learner(model, tokens, precision="fp32", temperature=1.0):
        calls["learner"].append(precision)
        return real_lp(model, tokens, precision, temperature)

    def train(stack, configs, **kw):
        calls["train"] += configs
        return real_train(stack, configs, **kw)

    monkeypatch.setattr(rollout_mod, "rollout_stacked", rollout)
    monkeypatch.setattr(rollout_mod, "sequence_logprobs", learner)
    monkeypatch.setattr(grpo_mod, "train_grpo_stacked", train)

    world = PLANTED_WORLDS["thought_free"]
    cfg = _with(MismatchConfig(base=TINY_BASE, grpo=replace(TINY_GRPO, group_size=4), seeds=1, smooth=1,
                               experiments=("nvfp4",), cache_dir=str(tmp_path)), estimator_doses=("planted:0.4",))
    rows = []
    for checkpoint, updates in (("base", 0), ("trained", 1)):
        rows += run_estimator_cell(cfg.identity(), "planted:0.4", checkpoint, 2, updates, str(tmp_path))
    # the engine batches planted, the exact ones not, both fp32 in the world's lengths; the learner fp32
    sampled = {c for c in calls["rollout"] if c[0] == "fp32" and c[3] == world.max_len}
    assert sampled == {("fp32", 0.4, False, world.max_len, world.max_action_len),
                       ("fp32", 0.0, True, world.max_len, world.max_action_len)}
    assert set(calls["learner"]) == {"fp32"}
    (trained,) = calls["train"]
    assert (trained.rollout_precision, trained.learner_precision, trained.plant, trained.correction,
            trained.updates) == ("fp32", "fp32", 0.4, "none", 1)
    assert tuple(trained.chain_lengths) == tuple(world.chain_lengths) and trained.max_len == world.max_len
    with pytest.raises(ConfigError, match="checkpoint"):
        run_estimator_cell(cfg.identity(), "planted:0.4", "qat", 2, 1, str(tmp_path))

    df = pd.DataFrame(rows)
    assert set(df["dose"]) == {"planted:0.4"} and list(df["checkpoint"].unique()) == ["base", "trained"]
    assert (df["k3"] > 1e-2).all() and (df["sampler_k3"] < 1e-9).all()  # a planted mismatch; an exact sampler
    assert np.isfinite(df[["bias_se_ratio", "se_paired", "true_norm"]].to_numpy()).all()
    tabs = EXPERIMENT.tables({"estimator": df}, cfg)
    t, s = tabs["estimator"].frame, tabs["estimator_sampler"].frame
    assert len(t) == 2 * len(WEIGHTINGS) and list(s["checkpoint"]) == ["base", "trained"]
    assert set(s["exact"]) == {"yes"}
    text = EXPERIMENT.interpret(tabs, cfg)
    assert "planted:0.4/trained: smallest bias/SE" in text["estimator"] and "checkpoint trained" in text["estimator"]
    assert PREDICTIONS[0].row(tabs)["measured"].startswith("planted:0.4/base: seq ")


def test_the_tables_order_precisions_then_planted_doses_by_strength():
    rows = pd.DataFrame([{"dose": d, "checkpoint": c, "weighting": w, "bias_se_ratio": 1.0}
                         for d, c in (("planted:0.4", "trained"), ("planted:0.4", "base"), ("mxfp4", "qat"),
                                      ("planted:0.2", "base"), ("nvfp4", "base"), ("mxfp4", "base"))
                         for w in ("seq", "none")])
    t = estimator_table(rows)
    assert list(dict.fromkeys(zip(t["dose"], t["checkpoint"], strict=True))) == [
        ("nvfp4", "base"), ("mxfp4", "base"), ("mxfp4", "qat"), ("planted:0.2", "base"), ("planted:0.4", "base"),
        ("planted:0.4", "trained")]
    assert list(t["weighting"][:2]) == ["none", "seq"]


# ---------------------------------------------------------------------------------------------
# prediction E1 on hand-made tables


def _table(points):
    """``points``: (dose, checkpoint) -> {weighting: bias/SE}."""
    rows = [{"dose": d, "checkpoint": c, "weighting": w, "bias_se_ratio": v}
            for (d, c), ratios in points.items() for w, v in ratios.items()]
    return {"estimator": Table(pd.DataFrame(rows), "")}


def _e1(tables):
    p = PREDICTIONS[0]
    return p.verdict(tables), p.measured(tables), p.note(p.verdict(tables), tables)


def test_e1_holds_where_interq_is_below_none_at_every_eligible_point():
    v, measured, note = _e1(_table({("nvfp4", "base"): {"none": 3.0, "interq": 1.5, ORACLE: 1.1},
                                    ("nvfp4", "qat"): {"none": 1.2, "interq": 4.0, ORACLE: 1.0},  # no bias: skipped
                                    ("mxfp4", "base"): {"none": 5.0, "interq": 6.0, ORACLE: 2.5}}))  # oracle biased
    assert v is Verdict.HOLDS and note == ""
    assert measured.startswith("nvfp4/base: seq 1.10, none 3.00, interq 1.50; nvfp4/qat")


def test_e1_fails_where_interq_is_not_below_none_at_one_eligible_point():
    v, _, _ = _e1(_table({("nvfp4", "base"): {"none": 3.0, "interq": 1.5, ORACLE: 1.1},
                          ("mxfp4", "qat"): {"none": 3.0, "interq": 3.0, ORACLE: 1.9}}))
    assert v is Verdict.FAILS


def test_e1_is_not_judged_without_an_eligible_point_or_without_the_table():
    v, measured, note = _e1(_table({("nvfp4", "base"): {"none": 1.5, "interq": 9.0, ORACLE: 1.0},
                                    ("mxfp4", "base"): {"none": 9.0, "interq": 1.0, ORACLE: 3.0}}))
    assert v is Verdict.NOT_JUDGED and "no dose and checkpoint" in note
    assert measured is not None
    assert _e1({})[:2] == (Verdict.NOT_JUDGED, None)
    assert PREDICTIONS[0].row({}) is None  # left out of the predictions table


def test_e1_says_where_the_exact_sampler_is_not_exact():
    tables = _table({("nvfp4", "base"): {"none": 3.0, "interq": 1.5, ORACLE: 1.1}})
    tables["estimator_sampler"] = Table(pd.DataFrame([{"dose": "nvfp4", "checkpoint": "base", "exact": "no"}]), "")
    v, _, note = _e1(tables)
    assert v is Verdict.HOLDS and note == "the exact sampler is not exact at nvfp4/base"
