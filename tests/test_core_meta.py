"""Every public ``core`` function on ``meta`` tensors, which have shapes but no values.

A ``meta`` run proves two things at once: the function reads no tensor value on the host (any read
raises on ``meta``), and it creates no tensor on the CPU behind the caller's back (a CPU tensor
mixed with ``meta`` inputs raises a device error). Functions that read values on the host by design
(segment counts from ``nonzero``, group counts from ``unique``, metrics returned as Python floats once
per step) refuse ``meta`` tensors with creditlab's :class:`InputError` naming the function and why
(:data:`NEEDS_VALUES`); their device handling is checked by the CUDA suite (tests/test_core_cuda.py).
A test checks that every public function is in one list.
"""

from __future__ import annotations

import pytest
import torch

from core_listing import public_core_functions
from creditlab.core import advantages, correction, credit, losses, precision
from creditlab.core import diagnostics as diag
from creditlab.core import masks as mk
from creditlab.core.credit import StepBatch

B, L, T, S, V, J, U = 4, 9, 5, 6, 7, 3, 5
META = torch.device("meta")


def f(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device=META)


def b(*shape):
    return f(*shape, dtype=torch.bool)


def i(*shape):
    return f(*shape, dtype=torch.int64)


def _batch(**kw):
    return StepBatch(b(B, T), i(B), **kw)


#: name -> a call on meta inputs that must run to the end and return meta tensors
RUNS = {
    "_checks.check_tensor": lambda: correction.check_tensor("x", f(B, L), finite=True, finite_where=b(B, L)),
    "masks.effective_policy_mask": lambda: mk.effective_policy_mask(b(B, L), b(B, L)),
    "masks.segment_sum": lambda: mk.segment_sum(f(B, L), i(B, L), S),
    "masks.segments_from_bounds": lambda: mk.segments_from_bounds(  # S known: bounds built by hand
        mk.SegmentBounds(b(B, L), b(B, L), i(S), i(S), i(S), i(S), i(B), S)),
    # a trainer's hot path: every built-in arm with its diagnostics, no host read (metrics left unread)
    "correction.correction_weights[sync=False]": lambda: [
        correction.correction_weights(a, f(B, L), f(B, L), b(B, L), b(B, L), check=False, sync=False)[0]
        for a in ("interq", "prefix", "global", "tis", "mis", "seq_is", "geo", "none", "interq_tis")],
    "correction.allocate_budget": lambda: (correction.allocate_budget(f(S), f(S), 0.5),
                                           correction.allocate_budget(f(S), f(S), 0.5, iters=8)),
    "credit.uniform": lambda: (credit.uniform(f(B), b(B, T)), credit.uniform(f(B), b(B, T), conserve=False)),
    "credit.per_turn": lambda: (credit.per_turn(f(B), f(B, T), b(B, T)),
                                credit.per_turn(f(B), f(B, T), b(B, T), conserve=False)),
    "credit.concentrated": lambda: credit.concentrated(f(B), b(B, T), b(B, T)),
    "credit.shuffled": lambda: (credit.shuffled(f(B, T), b(B, T), keys=f(B, T)), credit.shuffled(f(B, T), b(B, T))),
    "credit.random_k_mask": lambda: (credit.random_k_mask(f(B, T), 2, b(B, T)), credit.random_k_mask(f(B, T), i(B),
                                                                                                    b(B, T))),
    "credit.random_k": lambda: credit.random_k(f(B), f(B, T), 2, b(B, T)),
    "credit.conserve_credit": lambda: credit.conserve_credit(f(B, T), f(B), b(B, T)),
    "credit.GEOMETRIES[uniform, per_turn, concentrated, shuffled, random_k]": lambda: [
        credit.get_geometry(g)(_batch(advantages=f(B), step_scores=f(B, T), keys=f(B, T)))
        for g in ("uniform", "per_turn", "concentrated", "shuffled", "random_k")],
    "losses.aggregate": lambda: [losses.aggregate(f(B, L), b(B, L), m) for m in losses.AGG_MODES],
    "losses.policy_loss": lambda: [losses.policy_loss(f(B, L), f(B, L), f(B), b(B, L), weights=f(B, L),
                                                      clip_ratio_c=3.0, agg=m, check_finite=c)
                                   for m in losses.AGG_MODES for c in (True, False)],
    "losses.opsd_loss": lambda: [losses.opsd_loss(f(B, L, V), f(B, L, V), b(B, L), beta, check_finite=False)
                                 for beta in (0.0, 0.3, 1.0)],
    "losses.opsd_sampled_advantages": lambda: losses.opsd_sampled_advantages(f(B, L), f(B, L), b(B, L)),
    "losses.opsd_sampled_loss": lambda: losses.opsd_sampled_loss(f(B, L), f(B, L), b(B, L), check_finite=False),
    "precision.credit_split": lambda: precision.credit_split(b(B, J, U), b(B, J), b(B, U)),
    "precision.unit_credit": lambda: precision.unit_credit(b(B, J, U), b(B, J), b(B, U)),
    "precision.necessity": lambda: (precision.necessity(f(B, U), 0.5, b(B, U)),  # a float tau: built on META
                                    precision.necessity(f(B, U), f(B), b(B, U))),
    "precision.unit_precision": lambda: precision.unit_precision(b(B, U), b(B, U), b(B, U)),
    "precision.signed_recall": lambda: precision.signed_recall(b(B, J), f(B, J), b(B, J)),
    "precision.f_beta": lambda: precision.f_beta(f(B), f(B), 2.0),
    "precision.combine_rewards": lambda: [precision.combine_rewards(f(B), f(B), m) for m in precision.COMBINE_MODES],
    "diagnostics.p_cover": lambda: diag.p_cover(12, f(B), f(B)),  # a Python T goes on the tensors' device
    "diagnostics.expected_open_fraction": lambda: diag.expected_open_fraction(f(B), 4),
    "diagnostics.verifier_density": lambda: diag.verifier_density(f(B), 4),
    "diagnostics.mixing_score": lambda: diag.mixing_score(f(B), f(B)),
    "diagnostics.aulc": lambda: diag.aulc(f(B, T)),
    "diagnostics.rollback": lambda: diag.rollback(f(B, T)),
    "diagnostics.trajectory_ess": lambda: diag.trajectory_ess(f(B, T)),
    "diagnostics.batch_check_values": lambda: diag.batch_check_values(
        f(B, L), f(B, L), b(B, L), diag.CheckParams(1e-4, 4, 0.5, 1e-5, 100, 0.05, 20, 16, 8), group_ids=i(B),
        rewards=f(B)),
}

#: name -> a call on meta inputs to a function that reads values on the host (segment and group counts
#: from ``nonzero``/``unique``, metrics returned as Python floats once per step): it must raise creditlab's
#: InputError naming itself and saying it needs values, not torch's error from deep inside
NEEDS_VALUES = {
    **{f"correction.{n}_weights": (lambda n=n: getattr(correction, f"{n}_weights")(f(B, L), f(B, L), b(B, L)))
       for n in ("tis", "mis", "seq_is", "geo", "none", "interq", "interq_tis")},
    "correction.interq_terms": lambda: correction.interq_terms(f(B, L), f(B, L), b(B, L)),
    "correction.mismatch_metrics": lambda: correction.mismatch_metrics(f(B, L), f(B, L), b(B, L), b(B, L)),
    **{f"correction.correction_weights[{a}]": (lambda a=a: correction.correction_weights(a, f(B, L), f(B, L), b(B, L)))
       for a in ("interq", "tis", "none", "interq_tis")},
    "masks.segment_bounds": lambda: mk.segment_bounds(b(B, L)),
    "masks.segments": lambda: mk.segments(b(B, L), b(B, L)),
    "advantages.group_stats": lambda: advantages.group_stats(f(B), i(B)),
    "advantages.grpo_advantages": lambda: advantages.grpo_advantages(f(B), i(B)),
    "advantages.prm_mixed_advantages": lambda: advantages.prm_mixed_advantages(f(B), f(B, T), b(B, T), i(B), 0.5),
    "advantages.mix_process_advantage": lambda: advantages.mix_process_advantage(f(B), f(B, T), b(B, T), i(B), 0.5),
    "credit.binary": lambda: credit.binary(f(B), i(B), b(B, T)),
    "credit.discretized": lambda: credit.discretized(f(B), i(B), b(B, T)),
    "credit.reward_to_go": lambda: credit.reward_to_go(f(B, T), i(B), b(B, T)),
    "credit.targeted": lambda: credit.targeted(f(B), f(B, T), b(B, T), i(B), b(B, T)),
    "precision.fork_scores": lambda: precision.fork_scores(b(B, J, U), b(B, J), f(B, J), b(B, U), b(B, J), b(B, U),
                                                           0.5),
    "precision.deletion_curve": lambda: precision.deletion_curve(b(B, J, U), f(B, J), b(B, J), b(B, U), f(B, U)),
    "diagnostics.concentration": lambda: diag.concentration(f(B), 0.5),
}

#: public core functions that take no tensors (nothing to run on meta), with what they take
NO_TENSORS = {
    "correction.parse_correction": "an arm as a config string names it",
    "diagnostics.chain_length": "Python call records",
    "precision.unit_credit_one": "plain Python lists (the judge client's path)",
    "precision.fork_scores_one": "plain Python lists and floats (the judge client's path)",
}


def _meta_leaves(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, dict):
        for v in out.values():
            yield from _meta_leaves(v)
    elif isinstance(out, tuple | list):
        for v in out:
            yield from _meta_leaves(v)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_runs_on_meta(name):
    leaves = list(_meta_leaves(RUNS[name]()))
    assert leaves and all(t.device == META for t in leaves), name


@pytest.mark.parametrize("name", sorted(NEEDS_VALUES))
def test_functions_that_read_values_refuse_meta_tensors_by_name(name):
    from creditlab.errors import InputError

    function = name.split(".")[1].split("[")[0]
    with pytest.raises(InputError, match=rf"^{function}: needs tensors with values, got meta tensors"):
        NEEDS_VALUES[name]()


@pytest.mark.parametrize("name", sorted(NO_TENSORS))
def test_functions_without_tensors_take_none(name):
    import inspect

    module, function = name.split(".")
    fn = getattr({"correction": correction, "diagnostics": diag, "precision": precision}[module], function)
    annotations = " ".join(str(p.annotation) for p in inspect.signature(fn).parameters.values())
    assert "Tensor" not in annotations, f"{name} takes tensors: run it in RUNS or NEEDS_VALUES"


def test_every_public_core_function_is_listed():
    listed = " ".join([*RUNS, *NEEDS_VALUES, *NO_TENSORS])
    modules = ("advantages", "correction", "credit", "diagnostics", "losses", "masks", "precision")
    missing = [name for name in public_core_functions(modules) if name not in listed]
    assert not missing, f"add these to RUNS, NEEDS_VALUES or NO_TENSORS: {missing}"


def test_meta_value_checks_are_skipped_but_shape_and_device_checks_are_not():
    from creditlab.errors import InputError

    with pytest.raises(InputError, match=r"old_logprobs: dimension 1 \(L\) is 10"):
        losses.policy_loss(f(B, L), f(B, L + 1), f(B), b(B, L))
    with pytest.raises(InputError, match="old_logprobs: is on device cpu"):
        losses.policy_loss(f(B, L), torch.zeros(B, L), f(B), b(B, L))
