"""FORK input parsing and the ``creditlab fork score`` command against the loopback server."""

from __future__ import annotations

import json

import pytest

from creditlab.cli.main import main
from creditlab.errors import InputError
from creditlab.judge.testing import ChatServer
from creditlab.rewards import iter_jsonl_items, parse_item


def test_parse_the_three_accepted_shapes():
    plain = parse_item({"id": "a", "prompt": "q", "response": "r",
                        "rubrics": [{"criterion": "c", "points": 2}]})
    assert (plain.id, plain.prompt, plain.response) == ("a", "q", "r")
    assert plain.rubrics[0].points == 2.0
    hub = parse_item({"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q?"}],
                      "response": [{"role": "assistant", "content": "ans"}],
                      "Rubrics": [{"description": "mentions x", "weight": 3}]})
    assert hub.prompt == "system: be brief\n\nuser: q?" and hub.response == "ans"
    assert hub.rubrics[0].criterion == "mentions x" and len(hub.id) == 16
    assert parse_item({"prompt": "q?", "response": "ans", "Rubrics": [{"description": "mentions x",
                                                                      "weight": 3}]}).id != hub.id
    hb = parse_item({"prompt_id": "p1", "prompt": [{"role": "user", "content": "q"}], "completion": "ans",
                     "rubrics": json.dumps([{"criterion": "Recommends X", "points": -5,
                                             "tags": ["axis:accuracy"]}])})
    assert hb.id == "p1" and hb.rubrics[0].points == -5.0 and hb.rubrics[0].tags == ("axis:accuracy",)


@pytest.mark.parametrize("row, field", [
    ({"prompt": "q", "rubrics": []}, "'response'"),
    ({"response": "r", "rubrics": []}, "'prompt'"),
    ({"prompt": "q", "response": "r"}, "'rubrics'"),
    ({"prompt": "q", "response": "r", "rubrics": [{"criterion": "c", "points": "lots"}]}, "rubrics[0].points"),
    ({"prompt": "q", "response": "r", "rubrics": [{"criterion": "c", "points": 1}, {"points": 1}]},
     "rubrics[1].criterion"),
    ({"prompt": [{"role": "user"}], "response": "r", "rubrics": []}, "prompt[0]"),
])
def test_bad_records_name_the_field(row, field):
    with pytest.raises(InputError, match="line 7") as info:
        parse_item(row, "line 7")
    assert field in str(info.value)


def test_jsonl_errors_name_the_line(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text('{"id": 1, "prompt": "q", "response": "r", "rubrics": []}\n\nnot json\n'
                 '{"id": 2, "prompt": "q", "rubrics": []}\n')
    out = list(iter_jsonl_items(p))
    assert [n for n, _ in out] == [1, 3, 4]
    assert "in.jsonl:3: not valid JSON" in str(out[1][1])
    assert "in.jsonl:4" in str(out[2][1]) and "'response'" in str(out[2][1])


ROWS = [
    {"id": "good", "prompt": "Aspirin?", "response": "Take aspirin with water. Get some rest.",
     "rubrics": [{"criterion": "aspirin water", "points": 2}, {"criterion": "rest", "points": 1}]},
    {"id": "padded", "prompt": "Aspirin?", "response": "Take aspirin with water. Aspirin with water helps. "
     "Aspirin WRONG cures cancer. Rest.", "rubrics": [{"criterion": "aspirin water", "points": 2},
                                                       {"criterion": "rest", "points": 1}]},
]


def _write(path, rows, extra=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)


def test_cli_scores_resumes_and_reports_bad_lines(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, ROWS, extra='{"id": "bad", "prompt": "q", "rubrics": []}\n')
    with ChatServer() as srv:
        args = ["fork", "score", "--in", str(inp), "--out", str(out), "--base-url", srv.url,
                "--timeout", "1", "--max-retries", "0", "--cache", str(tmp_path / "cache.sqlite")]
        srv.push_faults(["500"])  # one item fails on the first run
        with pytest.raises(SystemExit) as ex:
            main(args)
        assert ex.value.code == 1
        err = capsys.readouterr().err
        assert "in.jsonl:3" in err and "'response'" in err
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(rows) == 2 and sum(r["error"] is not None for r in rows) == 1
        first_requests = srv.stats["requests"]
        # Rerun: only the failed item is rescored; the file keeps one row per id.
        _write(inp, ROWS)
        with pytest.raises(SystemExit) as ex:
            main(args)
        assert ex.value.code == 0
        rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
        assert set(rows) == {"good", "padded"} and all(r["error"] is None for r in rows.values())
        assert srv.stats["requests"] - first_requests <= 5
    good, padded = rows["good"], rows["padded"]
    assert good["reward"] == 1.0 and good["precision"] == 1.0 and good["recall"] == 1.0
    # padded: two paraphrases (credit 1/2 each, under tau 0.75), one wrong unit, one necessary unit.
    assert padded["recall"] == 1.0 and padded["precision"] == pytest.approx(0.25)
    assert padded["N"] == [False, False, False, True] and padded["C"] == [True, True, False, True]
    assert padded["assume_correct"] is False
    summary = capsys.readouterr().out
    assert "failures" in summary and "0.625" in summary  # mean reward (1 + 0.4) / 2 = 0.7; mean P 0.625


def test_cli_offline_judge_needs_assume_correct(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, ROWS[:1])
    with pytest.raises(SystemExit) as ex:
        main(["fork", "score", "--in", str(inp), "--out", str(out), "--judge", "offline"])
    assert ex.value.code == 2
    assert "assume_correct" in capsys.readouterr().err


def test_cli_unknown_judge_is_a_one_line_error(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    _write(inp, ROWS[:1])
    with pytest.raises(SystemExit) as ex:
        main(["fork", "score", "--in", str(inp), "--out", str(tmp_path / "o.jsonl"), "--judge", "gpt"])
    assert ex.value.code == 2 and "--judge" in capsys.readouterr().err
