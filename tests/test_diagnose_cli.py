"""``creditlab diagnose``: exit codes 0 / 1 / 2, one-line errors without a traceback, the shipped example."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from creditlab.cli.main import main
from creditlab.diagnose import write_dump
from diagnose_synth import clean_rows

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "toolshop_fp8.jsonl"


def _code(argv) -> int:
    with pytest.raises(SystemExit) as ex:
        main(argv)
    return ex.value.code


def test_exit_0_on_a_clean_dump_and_1_on_a_failing_one(tmp_path):
    clean = write_dump(clean_rows(), tmp_path / "clean.jsonl")
    # nothing warns, so 0 even with --fail-on warn (hence 0 without it)
    assert _code(["diagnose", str(clean), "--out", str(tmp_path / "a"), "--quiet", "--fail-on", "warn"]) == 0
    bad = clean_rows()
    for r in bad:
        r["reward"] = 1.0  # every group degenerate
    bad_path = write_dump(bad, tmp_path / "bad.parquet")
    assert _code(["diagnose", str(bad_path), "--out", str(tmp_path / "b"), "--quiet",
                  "--check", "baseline.degenerate_groups"]) == 1
    js = json.loads((tmp_path / "b" / "diagnose.json").read_text())
    assert js["exit_code"] == 1 and js["counts"]["fail"] >= 1


@pytest.mark.parametrize("argv, match", [
    (["diagnose", "{tmp}/missing.jsonl", "--out", "{tmp}/o"], "missing.jsonl: no such file or directory"),
    (["diagnose", "{tmp}/bad.jsonl", "--out", "{tmp}/o"], "bad.jsonl: line 2: column 'reward': expected a finite"),
    (["diagnose", "{tmp}/good.jsonl", "--out", "{tmp}/o", "--fail-on", "never"], "--fail-on: must be fail or warn"),
    (["diagnose", "{tmp}/good.jsonl", "--out", "{tmp}/o", "--max-turns", "1"], "--max-turns: must be >= 2"),
    (["diagnose", "{tmp}/good.jsonl", "--out", "{tmp}/o", "--check", "nope"], "--check: unknown check 'nope'"),
    (["diagnose", "{tmp}/good.jsonl", "--out", "{tmp}/good.jsonl/o"], "--out: cannot create the directory"),
])
def test_unreadable_input_exits_2_with_one_line(tmp_path, capsys, argv, match):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"step": 0, "group": 0, "reward": 1}) + "\n"
                                        + json.dumps({"step": 0, "group": 0, "reward": "x"}) + "\n")
    write_dump(clean_rows(steps=1), tmp_path / "good.jsonl")
    assert _code([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o" / "diagnose.json").exists()


def test_the_shipped_example_reads_as_documented(tmp_path):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "diagnose.md").read_text()
    assert "docs/examples/toolshop_fp8.jsonl" in doc
    assert "exits 0 (nothing fails; `--fail-on warn` exits 1)" in doc
    assert _code(["diagnose", str(EXAMPLE), "--out", str(tmp_path / "ex"), "--quiet"]) == 0
    assert _code(["diagnose", str(EXAMPLE), "--out", str(tmp_path / "ex"), "--quiet", "--fail-on", "warn"]) == 1
    js = json.loads((tmp_path / "ex" / "diagnose.json").read_text())
    statuses = {c["id"]: c["status"] for c in js["checks"]}
    # the history ratio grows to 0.62 nats, which the transfer run gave no calibrated verdict on
    assert statuses["mismatch.prefix_drift"] == "info" and statuses["credit.coverage"] == "warn"
    assert statuses["mismatch.sequence_ratio_length"] == "info" and js["counts"]["info"] == 2
    assert statuses["mismatch.k3"] == "warn"
    assert statuses["mismatch.placeholder_logprobs"] == "ok" and statuses["credit.mixing"] == "skipped"
    for c in js["checks"]:  # the documented verdict table of the example is the one it produces
        assert f"| `{c['id']}` | {c['status']} |" in doc, c["id"]


def test_max_turns_changes_no_verdict_of_the_shipped_example(tmp_path):
    """The example's trajectories have 5 turns: below --max-turns or above it, every check gives the
    value and status of the documented table; below, the prefix-drift plot says what it leaves out."""
    from creditlab.diagnose.checks import format_value

    doc = (Path(__file__).resolve().parents[1] / "docs" / "diagnose.md").read_text()
    got = {}
    for m in (2, 16, 64):
        assert _code(["diagnose", str(EXAMPLE), "--out", str(tmp_path / f"m{m}"), "--quiet", "--max-turns",
                      str(m)]) == 0
        js = json.loads((tmp_path / f"m{m}" / "diagnose.json").read_text())
        got[m] = {c["id"]: c for c in js["checks"]}
    for cid, c in got[16].items():
        assert f"| `{cid}` | {c['status']} | {format_value(c['value'])} |" in doc, cid
        for m in (2, 64):
            assert (got[m][cid]["status"], got[m][cid]["value"]) == (c["status"], c["value"]), (cid, m)
    drift = {m: got[m]["mismatch.prefix_drift"] for m in got}
    assert drift[16]["message"] == drift[64]["message"] and drift[16]["details"]["turns_not_drawn"] == 0
    assert drift[2]["details"]["turns_not_drawn"] == 3
    assert ("The plot draws turns 0-1 (--max-turns 2); the 3 later turns with 20+ tokens (turns 2-4) are left out "
            "of it, not of the value. No calibrated verdict: ") in drift[2]["message"]
