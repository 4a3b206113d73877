"""The granularity lab's predictions: each verdict is a pure function of the run's tables, judged here on
hand-made tables for every outcome (holds, fails, not judged), and written in the lab's predictions table
(every lab's: experiment, prediction, measured, verdict, a note in parentheses after a verdict)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from creditlab.lab.experiment import PREDICTION_COLUMNS, Verdict, predictions_table
from creditlab.lab.protocol import Table
from creditlab.labs.granularity import LAB, multi, repeat, warm

HOLDS, FAILS, NOT_JUDGED = Verdict.HOLDS, Verdict.FAILS, Verdict.NOT_JUDGED


def _tabs(**frames: pd.DataFrame) -> dict[str, Table]:
    return {name: Table(frame, name) for name, frame in frames.items()}


def _said(tabs: dict[str, Table], predictions) -> dict[str, str]:
    """Prediction id -> the verdict as the predictions table writes it."""
    p = predictions_table([("experiment", p) for p in predictions], tabs)
    return {c.split(":")[0]: v for c, v in zip(p["prediction"], p["verdict"], strict=True)}


def test_the_lab_judges_every_prediction_in_the_order_of_its_experiments():
    ids = [p.claim.split(":")[0] for e in LAB.experiments for p in e.predictions]
    assert ids == ["M1", "M2", "M3", "R1", "R2", "W1", "W2", "W3", "B1", "B2", "B3"]
    assert predictions_table([], {}).columns.tolist() == list(PREDICTION_COLUMNS)
    texts = LAB.predictions(LAB.config_type())
    assert {e.name: tuple(p.stated for p in e.predictions) for e in LAB.experiments if e.predictions} == texts


# ---------------------------------------------------------------------------------------------
# multi: M1-M3 on the multi_mixing table


def _mixing(mixing=(0.3, 0.5, 0.7), share=(0.6, 0.4, 0.2), decay: tuple[float, float, float] | None = None):
    """A multi_mixing table: base mixing and GRPO's gain over its headroom per type (short, long,
    multi); ``decay``: the decayed PRM's gain over GRPO (mean, lo, hi), the same on every type."""
    df = pd.DataFrame({"type": ["short", "long", "multi"], "base mixing": list(mixing),
                       "grpo gain": [0.1, 0.1, 0.1], "grpo gain / headroom": list(share)})
    if decay is not None:
        df["prm_decay - grpo"], df["prm_decay - grpo lo"], df["prm_decay - grpo hi"] = decay
    return _tabs(multi_mixing=df)


def test_m1_the_multi_type_mixes_most_and_passes_the_gate():
    assert multi.m1_verdict(_mixing((0.3, 0.5, 0.7))) is HOLDS
    assert multi.m1_verdict(_mixing((0.3, 0.5, 0.55))) is FAILS  # the most mixed, under the gate
    assert multi.m1_verdict(_mixing((0.3, 0.8, 0.7))) is FAILS  # over the gate, below long
    assert multi.m1_verdict({}) is NOT_JUDGED
    no_multi = _tabs(multi_mixing=_mixing().pop("multi_mixing").frame.iloc[:2])  # the multi type did not run
    assert multi.m1_verdict(no_multi) is NOT_JUDGED and multi.m1_measured(no_multi) is None
    assert multi.m1_measured(_mixing()) == "short 0.30; long 0.50; multi 0.70"


def test_m2_grpo_gains_least_on_the_most_mixed_type():
    assert multi.m2_verdict(_mixing((0.3, 0.5, 0.7), (0.6, 0.4, 0.2))) is HOLDS
    assert multi.m2_verdict(_mixing((0.3, 0.5, 0.7), (0.1, 0.4, 0.2))) is FAILS
    assert multi.m2_verdict(_mixing((0.3, 0.9, 0.7), (0.6, 0.4, 0.2))) is FAILS  # least gain, not most mixed
    assert multi.m2_verdict({}) is NOT_JUDGED
    assert multi.m2_measured(_mixing()).startswith("short +0.10 (0.60 of headroom)")


def test_m3_the_decayed_prm_gains_on_the_most_mixed_type():
    assert multi.m3_verdict(_mixing(decay=(0.1, 0.02, 0.2))) is HOLDS
    assert multi.m3_verdict(_mixing(decay=(-0.1, -0.2, -0.01))) is FAILS  # interval below 0
    assert multi.m3_verdict(_mixing(decay=(-0.01, -0.2, 0.1))) is FAILS  # spans 0 with a mean at or below 0
    assert multi.m3_verdict(_mixing(decay=(0.05, -0.02, 0.1))) is NOT_JUDGED  # spans 0: not resolved
    assert multi.m3_verdict(_mixing(decay=(0.05, math.nan, math.nan))) is NOT_JUDGED  # one seed: no interval
    assert multi.m3_verdict(_mixing()) is NOT_JUDGED and multi.m3_measured(_mixing()) is None  # no decayed arm


def test_the_multi_verdicts_are_not_judged_where_nothing_was_measured():
    nan3 = (math.nan,) * 3
    assert multi.m1_verdict(_mixing((0.3, 0.5, math.nan))) is NOT_JUDGED  # it was a "fails" on a NaN
    assert multi.m2_verdict(_mixing(share=nan3)) is NOT_JUDGED  # pandas' idxmin raised on all-NA
    assert multi.m2_verdict(_mixing(mixing=nan3)) is NOT_JUDGED
    assert multi.m3_verdict(_mixing(mixing=nan3, decay=(0.1, 0.02, 0.2))) is NOT_JUDGED
    said = _said(_mixing(decay=(0.05, -0.02, 0.1)), multi.PREDICTIONS)
    assert said == {"M1": "holds", "M2": "holds", "M3": "not judged (not resolved: the interval spans 0)"}
    assert _said(_mixing(), multi.PREDICTIONS) == {"M1": "holds", "M2": "holds"}  # M3 left out
    assert _said(_mixing(decay=(-0.1, -0.2, -0.01)), multi.PREDICTIONS)["M3"] == "fails"


# ---------------------------------------------------------------------------------------------
# repeat: R1 and R2 on the sweep table


def _sweep(fixed: dict[float, int], decayed: dict[float, int] | None = None, score: float = 0.6):
    """A sweep table: repeat -> hacked runs (of 2) per arm, the base policy's mean turn score ``score``."""
    rows = [{"arm": arm, "repeat": r, "mean turn score": score, "hacked runs": h, "runs": 2}
            for arm, runs in (("prm_fixed", fixed), ("prm_decay", decayed or {})) for r, h in runs.items()]
    return _tabs(sweep=pd.DataFrame(rows))


def test_r1_the_fixed_weight_is_hacked_exactly_above_the_mean_turn_score():
    exactly = _sweep({0.25: 0, 0.5: 0, 0.75: 2, 1.0: 1})
    assert repeat.r1_verdict(exactly) is HOLDS and repeat.r1_exactly(exactly)
    by_rule = _sweep({0.25: 0, 0.5: 1, 0.75: 2, 1.0: 0})  # hacked just below, and not at every value above
    assert repeat.r1_verdict(by_rule) is HOLDS and not repeat.r1_exactly(by_rule)
    assert repeat.r1_verdict(_sweep({0.25: 1, 0.75: 2})) is FAILS  # hacked 0.35 below the threshold
    assert repeat.r1_verdict(_sweep({0.25: 0, 0.75: 0, 1.0: 0})) is FAILS  # never hacked above it
    assert repeat.r1_verdict(_sweep({0.25: 0, 0.5: 0})) is NOT_JUDGED  # no repeat above the threshold
    no_score = _sweep({0.25: 0, 0.75: 2}, score=math.nan)
    assert repeat.r1_verdict(no_score) is NOT_JUDGED and repeat.r1_measured(no_score) is None
    assert repeat.r1_verdict({}) is NOT_JUDGED
    assert _said(exactly, repeat.PREDICTIONS[:1]) == {"R1": "holds"}
    assert _said(by_rule, repeat.PREDICTIONS[:1]) == {
        "R1": "holds (by the falsification rule, not at every value above)"}
    assert _said(_sweep({0.25: 1, 0.75: 2}), repeat.PREDICTIONS[:1]) == {"R1": "fails"}
    assert _said(_sweep({0.25: 0}), repeat.PREDICTIONS[:1]) == {
        "R1": "not judged (untestable: no repeat above the mean turn score)"}
    assert repeat.r1_measured(_sweep({0.25: 0, 1.0: 2})) == (
        "repeat 0.25: 0/2 hacked (turn score 0.600); repeat 1: 2/2 hacked (turn score 0.600)")


def test_r2_the_decayed_weight_is_never_hacked():
    assert repeat.r2_verdict(_sweep({0.25: 0}, {0.25: 0, 1.0: 0})) is HOLDS
    assert repeat.r2_verdict(_sweep({0.25: 0}, {0.25: 0, 1.0: 1})) is FAILS
    only_fixed = _sweep({0.25: 0, 1.0: 2})
    assert repeat.r2_verdict(only_fixed) is NOT_JUDGED and repeat.r2_measured(only_fixed) is None
    assert repeat.r2_verdict({}) is NOT_JUDGED
    assert _said(_sweep({0.75: 2}, {0.25: 0, 1.0: 1}), repeat.PREDICTIONS) == {"R1": "holds", "R2": "fails"}


# ---------------------------------------------------------------------------------------------
# warm: W1-W3 on the gates, warm_means and warm_opsd tables


def _warm(ref_gate: float | None = 1.2, advice_gate: float | None = 1.2, grpo: float = 0.8, advice: float = 0.5,
          opsd: dict[str, list[float]] | None = None, ref_gain: float | None = 0.05) -> dict[str, Table]:
    """The warm experiment's tables: the teachers' gates (None: not measured), final success over every
    type, and the OPSD table (ref, advice) of ``opsd`` (default: W3 holds)."""
    gates = pd.DataFrame([{"experiment": "warm", "gate": f"{name} teacher: preference - placebo's (nats)",
                           "measured": v, "passes": v >= 1.0}
                          for name, v in (("reference-answer", ref_gate), ("turn-advice", advice_gate))
                          if v is not None], columns=["experiment", "gate", "measured", "passes"])
    means = pd.DataFrame({"arm": ["grpo", "opsd_ref", "opsd_advice", "grpo"], "type": ["all", "all", "all", "short"],
                          "success": [grpo, 0.7, advice, 0.9], "gain": [0.1, ref_gain, -0.2, 0.1]})
    if ref_gain is None:
        means = means.drop(columns="gain")
    o = {"reverse_kl": [0.1, 0.3], "grad_norm": [0.2, 0.9], "clipped_updates": [0.0, 3.0],
         "response_tokens_early": [20.0, 20.0], "response_tokens_late": [20.5, 12.0], **(opsd or {})}
    return _tabs(gates=gates, warm_means=means, warm_opsd=pd.DataFrame({"arm": ["opsd_ref", "opsd_advice"], **o}))


def test_w1_the_warm_started_teachers_pass_their_gates():
    assert warm.w1_verdict(_warm(1.2, 1.5)) is HOLDS
    assert warm.w1_verdict(_warm(0.4, 1.5)) is FAILS
    assert warm.w1_verdict(_warm(None, None)) is FAILS  # as the rule has it: no teacher measured is no pass
    assert warm.w1_verdict({}) is NOT_JUDGED and warm.w1_measured({}) is None  # the experiment did not run
    assert warm.w1_measured(_warm(0.404, 1.271)) == "reference-answer +0.404; turn-advice +1.271"


def test_w2_is_judged_on_the_advice_teachers_own_gate():
    assert warm.w2_verdict(_warm(ref_gate=0.2, advice_gate=1.1, grpo=0.89, advice=0.60)) is HOLDS
    assert warm.w2_verdict(_warm(ref_gate=0.2, advice_gate=1.1, grpo=0.89, advice=0.92)) is FAILS  # beats GRPO
    assert warm.w2_verdict(_warm(advice_gate=1.1, grpo=0.89, advice=0.875)) is FAILS  # within 0.02 of GRPO
    assert warm.w2_verdict(_warm(ref_gate=1.5, advice_gate=0.99, advice=0.92)) is NOT_JUDGED  # its gate failed
    assert warm.w2_verdict(_warm(advice_gate=None)) is NOT_JUDGED
    no_grpo = _warm()
    no_grpo["warm_means"] = Table(no_grpo["warm_means"].frame.query("arm != 'grpo'"), "m")
    assert warm.w2_verdict(no_grpo) is NOT_JUDGED and warm.w2_measured(no_grpo) is None
    assert warm.w2_measured(_warm(grpo=0.89, advice=0.6)) == "final success: advice-OPSD 0.60, GRPO 0.89, ref-OPSD 0.70"
    said = _said(_warm(ref_gate=1.5, advice_gate=0.99), warm.PREDICTIONS)
    assert said["W1"] == "fails" and said["W2"] == "not judged (the advice teacher's gate failed)"


@pytest.mark.parametrize("change", [{"reverse_kl": [0.3, 0.3]}, {"grad_norm": [0.9, 0.2]},
                                    {"clipped_updates": [0.0, 0.0]}, {"response_tokens_late": [20.5, 21.0]}])
def test_w3_fails_when_any_of_its_signs_is_missing(change):
    assert warm.w3_verdict(_warm(opsd=change)) is FAILS
    assert _said(_warm(opsd=change), warm.PREDICTIONS)["W3"] == "fails (in part: see measured)"


def test_w3_advice_opsd_moves_the_student_and_ref_opsd_does_not():
    assert warm.w3_verdict(_warm()) is HOLDS
    assert warm.w3_verdict(_warm(ref_gain=0.15)) is FAILS  # ref-OPSD moved the student
    assert warm.w3_verdict(_warm(ref_gain=None)) is HOLDS  # no success change to judge: the rest decides
    one = _warm()
    one["warm_opsd"] = Table(one["warm_opsd"].frame.iloc[:1], "o")  # the advice arm did not run
    assert warm.w3_verdict(one) is NOT_JUDGED and warm.w3_measured(one) is None
    assert warm.w3_verdict({}) is NOT_JUDGED
    assert warm.w3_measured(_warm()) == ("ref: KL 0.1, grad 0.2, 0.0 clipped, tokens 20.0 -> 20.5, success change "
                                         "+0.05; advice: KL 0.3, grad 0.9, 3.0 clipped, tokens 20.0 -> 12.0")
    assert _said(_warm(), warm.PREDICTIONS) == {"W1": "holds", "W2": "holds", "W3": "holds"}
