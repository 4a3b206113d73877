"""The offline judge: rule-based unitization and embedding matching from the packaged MiniLM model."""

from __future__ import annotations

import asyncio

import pytest

from creditlab.errors import ConfigError
from creditlab.judge import EmbeddingJudge, JudgeError, split_units
from creditlab.rewards import ForkItem, FORKReward, Rubric


def test_split_units_drops_boilerplate_and_keeps_wording():
    text = ("Hello!\n# Aspirin\nIn summary, take aspirin with water. It helps with pain.\n"
            "Steps:\n1. Rest for a day.\n- Drink fluids.\nI hope this helps!")
    assert split_units(text) == ["Take aspirin with water.", "It helps with pain.", "Rest for a day.",
                                 "Drink fluids."]
    assert split_units("") == [] and split_units("Sure!") == []


@pytest.fixture(scope="module")
def judge():
    return EmbeddingJudge()


RUBRICS = ("Mentions that aspirin should be taken with water", "Advises seeing a doctor if pain persists",
           "States that a fever above 39 C needs medical attention")
RESPONSE = ("Take aspirin with a full glass of water. Swallow the aspirin tablet with water. "
            "If the pain does not go away, see a doctor. Paris is the capital of France.")


def test_embedding_match_and_coverage(judge):
    units = asyncio.run(judge.unitize("q", RESPONSE))
    assert len(units) == 4
    m = asyncio.run(judge.match("q", list(RUBRICS), units))
    assert m == [[True, True, False, False], [False, False, True, False], [False, False, False, False]]
    assert asyncio.run(judge.coverage("q", RESPONSE, list(RUBRICS))) == [True, True, False]
    with pytest.raises(JudgeError, match="correctness"):
        asyncio.run(judge.correctness("q", units))


def test_fork_with_offline_judge_requires_and_records_assume_correct(judge):
    with pytest.raises(ConfigError, match="assume_correct"):
        FORKReward(judge)
    item = ForkItem("o1", "Aspirin?", RESPONSE, tuple(Rubric(r, 1.0) for r in RUBRICS))
    res = asyncio.run(FORKReward(judge, assume_correct=True).score([item]))[0]
    assert res.error is None and res.assume_correct is True and res.requests == 0
    # Paraphrases share rubric 1 (1/2 each < tau 0.75); only the doctor unit is necessary.
    assert res.credits == [0.5, 0.5, 1.0, 0.0] and res.N == [False, False, True, False]
    assert res.recall == pytest.approx(2 / 3) and res.precision == pytest.approx(0.25)
    assert res.C == [True] * 4


def test_config_errors():
    with pytest.raises(ConfigError, match="match_threshold"):
        EmbeddingJudge(match_threshold=1.5)


def test_cli_offline_scoring_records_assume_correct(judge, tmp_path):
    import json

    from creditlab.cli.main import main

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": "o1", "prompt": "Aspirin?", "response": RESPONSE,
                               "rubrics": [{"criterion": r, "points": 1} for r in RUBRICS]}) + "\n")
    with pytest.raises(SystemExit) as ex:
        main(["fork", "score", "--in", str(inp), "--out", str(out), "--judge", "offline", "--assume-correct"])
    assert ex.value.code == 0
    row = json.loads(out.read_text())
    assert row["assume_correct"] is True and row["judge"].startswith("offline:")
    assert row["recall"] == pytest.approx(2 / 3) and row["precision"] == pytest.approx(0.25)


def test_loading_the_model_leaves_the_environment_alone(monkeypatch):
    import os

    import creditlab.judge.offline as off

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(off, "_MODEL", None)  # force a fresh load
    before = dict(os.environ)
    vec = EmbeddingJudge()._embed(["take aspirin with water"])
    assert vec.shape == (1, 384)
    assert dict(os.environ) == before
