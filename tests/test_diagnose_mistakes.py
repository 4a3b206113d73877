"""Mistakes in the input of ``creditlab diagnose``, fed through the real CLI (or the API): partial nulls, a
copied log-prob column, values in the wrong scale or unit, repeated files and rows, nested token lists, a
file still being written, an output directory holding an earlier report, and a few messages. Each one is
an error naming the file, row and column (exit 2, no traceback), a warning in the report, or a check that
says how many values it had or why it could not judge: never a silent "ok"."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from creditlab.cli.main import main
from creditlab.diagnose import read_dump, run_checks, write_dump
from creditlab.errors import ConfigError, InputError
from diagnose_synth import CHAIN_TURNS, clean_rows, token_row, trend_rows


def _cli(argv, capsys) -> tuple[int, str]:
    """Exit code and stderr of ``creditlab ARGV`` run in process."""
    with pytest.raises(SystemExit) as ex:
        main([str(a) for a in argv])
    return ex.value.code, capsys.readouterr().err


def _diag(paths, out, capsys, *extra) -> tuple[int, dict | None, str]:
    """Run ``creditlab diagnose`` on ``paths``; return the exit code, diagnose.json (None if absent) and
    stderr."""
    paths = [paths] if isinstance(paths, str | Path) else paths
    code, err = _cli(["diagnose", *paths, "--out", out, "--quiet", *extra], capsys)
    js = Path(out) / "diagnose.json"
    return code, json.loads(js.read_text()) if js.exists() else None, err


def _snapshot(*paths) -> dict[str, bytes]:
    """The bytes of every file under ``paths``."""
    out = {}
    for p in map(Path, paths):
        for f in sorted(p.rglob("*") if p.is_dir() else [p]):
            if f.is_file():
                out[str(f)] = f.read_bytes()
    return out


def _error(paths, tmp_path, capsys, match: str) -> str:
    """Diagnose ``paths`` expecting exit 2 with one line on stderr containing ``match``; the input is
    untouched and no report is written."""
    before = _snapshot(*([paths] if isinstance(paths, str | Path) else paths))
    out = tmp_path / "out-error"
    code, js, err = _diag(paths, out, capsys)
    assert code == 2, err
    assert match in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert js is None and not out.exists()
    assert _snapshot(*([paths] if isinstance(paths, str | Path) else paths)) == before
    return err


def _checks(js: dict) -> dict[str, dict]:
    return {c["id"]: c for c in js["checks"]}


# ------------------------------------------------------------------------------------------------
# 1. nulls in part of the rows or steps
# ------------------------------------------------------------------------------------------------


def _null(rows, column, *, last_quarter=False, every=None):
    """Null ``column`` in the last quarter of steps, or in every ``every``-th row."""
    steps = sorted({r["step"] for r in rows})
    late = set(steps[-max(1, len(steps) // 4):])
    for i, r in enumerate(rows):
        if (last_quarter and r["step"] in late) or (every and i % every == 0):
            r[column] = None
    return rows


def test_precision_missing_late_is_not_read_as_held(tmp_path, capsys):
    rows = _null(trend_rows(length_growth=1.0, precision_drop=0.3), "precision", last_quarter=True)
    code, js, _ = _diag(write_dump(rows, tmp_path / "d.jsonl"), tmp_path / "o", capsys, "--fail-on", "warn")
    r = _checks(js)["reward.length_hacking"]
    assert r["status"] == "warn" and code == 1, r
    assert "precision held" not in r["message"] and "-)" not in r["message"]
    assert ("(precision cannot tell: 0 of the 64 rows of the last quarter of steps have precision, and a trend "
            "needs at least half of them (and 4))") in r["message"]


def test_length_missing_late_is_skipped_not_nan(tmp_path, capsys):
    rows = _null(trend_rows(length_growth=1.0), "response_length", last_quarter=True)
    for r in rows:
        del r["precision"]
    code, js, _ = _diag(write_dump(rows, tmp_path / "d.jsonl"), tmp_path / "o", capsys)
    r = _checks(js)["reward.length_hacking"]
    assert r["status"] == "skipped" and r["value"] is None and "nan" not in r["message"].lower()
    assert r["message"] == ("Too few rows with response_length for a trend: 0 of the 64 rows of the last quarter of "
                            "steps have response_length, and a trend needs at least half of them (and 4).")


def test_process_reward_missing_late_is_skipped_not_constant(tmp_path, capsys):
    rows = _null(trend_rows(process_rise=0.6, reward_rise=0.0), "process_reward", last_quarter=True)
    code, js, _ = _diag(write_dump(rows, tmp_path / "d.jsonl"), tmp_path / "o", capsys)
    r = _checks(js)["reward.process_hacking"]
    assert r["status"] == "skipped" and "constant" not in r["message"]
    assert r["message"].startswith("Too few rows with process_reward for a trend: 0 of the 64 rows of the last "
                                   "quarter of steps have process_reward")


def test_a_quarter_of_the_rows_null_are_counted_not_hidden(tmp_path, capsys):
    rows = trend_rows(length_growth=1.0, precision_drop=0.3)
    for col in ("response_length", "precision"):
        _null(rows, col, every=4)
    code, js, _ = _diag(write_dump(rows, tmp_path / "d.parquet"), tmp_path / "o", capsys)
    r = _checks(js)["reward.length_hacking"]
    assert r["status"] == "fail" and code == 1
    assert "response_length in 192 of 256 rows" in r["message"] and "precision in 192 of 256 rows" in r["message"]
    rows = _null(trend_rows(process_rise=0.6, reward_rise=0.0), "process_reward", every=4)
    code, js, _ = _diag(write_dump(rows, tmp_path / "p.jsonl"), tmp_path / "o2", capsys)
    r = _checks(js)["reward.process_hacking"]
    assert r["status"] == "warn" and "process_reward in 192 of 256 rows" in r["message"], r


def test_rows_without_token_columns_are_counted(tmp_path, capsys):
    d = tmp_path / "mixed"
    write_dump(clean_rows(steps=4), d)
    write_dump([dict(r, step=r["step"] + 4) for r in clean_rows(seed=1, steps=1, tokens=False)], d)
    code, js, _ = _diag(d, tmp_path / "o", capsys)
    assert "token columns in 128 of 160 rows" in _checks(js)["mismatch.k3"]["message"]


# ------------------------------------------------------------------------------------------------
# 2. rollout_logprobs copied from logprobs
# ------------------------------------------------------------------------------------------------


def _copied(rows):
    rows = copy.deepcopy(rows)
    for r in rows:
        r["rollout_logprobs"] = list(r["logprobs"])
    return rows


def test_bit_identical_logprob_columns_are_a_finding_not_a_pass(tmp_path, capsys):
    code, js, _ = _diag(write_dump(_copied(clean_rows()), tmp_path / "d.jsonl"), tmp_path / "o", capsys,
                        "--fail-on", "warn")
    res = _checks(js)
    k3 = res["mismatch.k3"]
    assert k3["status"] == "warn" and k3["value"] is None and code == 1
    assert k3["message"].startswith("rollout_logprobs equal logprobs on every policy token: the dump holds one "
                                    "log-prob computation twice (a copied column, or a trainer that overwrote one")
    for cid in ("mismatch.prefix_drift", "mismatch.one_sided", "mismatch.sequence_ratio_length"):
        assert res[cid]["status"] == "skipped" and "rollout_logprobs equal logprobs" in res[cid]["message"], cid
    assert res["mismatch.placeholder_logprobs"]["status"] == "ok"  # NaN and zero-fill are still looked for


def test_one_copied_file_among_others_is_left_out_and_named(tmp_path):
    d = tmp_path / "dir"
    write_dump(clean_rows(steps=4), d)
    write_dump(_copied([dict(r, step=r["step"] + 4) for r in clean_rows(seed=1, steps=4)]), d)
    k3 = run_checks(read_dump(d), only="mismatch.k3")[0]
    alone = run_checks(read_dump(d / "part-00000.parquet"), only="mismatch.k3")[0]
    assert k3.status == "warn" and k3.value == pytest.approx(alone.value, rel=1e-12)
    assert "part-00001.parquet, whose rollout_logprobs equal logprobs, left out" in k3.message
    assert k3.details["copied_files"] == [str(d / "part-00001.parquet")]


# ------------------------------------------------------------------------------------------------
# 3. scales and units
# ------------------------------------------------------------------------------------------------


def test_probabilities_or_positive_numbers_in_a_logprob_column_are_errors(tmp_path, capsys):
    rows = clean_rows(steps=2)
    probs = copy.deepcopy(rows)
    for r in probs:
        r["logprobs"] = [math.exp(v) for v in r["logprobs"]]
    err = _error(write_dump(probs, tmp_path / "probs.jsonl"), tmp_path, capsys,
                 "probs.jsonl: line 1: column 'logprobs': element 6 is")
    assert "looks like probabilities (every policy value in [0, 1]): write their log" in " ".join(err.split())
    pos = copy.deepcopy(rows)
    pos[3]["rollout_logprobs"][7] = 2.5
    err = _error(write_dump(pos, tmp_path / "pos.parquet"), tmp_path, capsys,
                 "pos.parquet: row 4: column 'rollout_logprobs': element 7 is 2.5 on a policy token, above 0.0001")
    assert "log-probs are <= 0" in err
    ok = copy.deepcopy(rows)
    ok[3]["rollout_logprobs"][0] = 2.5  # a prompt token (policy_mask false): never read
    ok[3]["logprobs"][8] = 5e-5  # float rounding of log_softmax: within the tolerance
    code, js, _ = _diag(write_dump(ok, tmp_path / "ok.jsonl"), tmp_path / "o3", capsys)
    assert code in (0, 1) and js is not None


def test_process_scores_and_shares_outside_their_range_are_errors(tmp_path, capsys):
    rows = clean_rows(steps=2, tokens=False)
    for r in rows:
        r["turns"] = [dict(t, process_score=0.5) for t in CHAIN_TURNS]
    rows[2]["turns"][1]["process_score"] = 7.0  # a 0-10 judge score
    _error(write_dump(rows, tmp_path / "ps.jsonl"), tmp_path, capsys,
           "ps.jsonl: line 3: column 'turns': turn 1: 'process_score' is 7.0, outside [-1, 1]")
    rows = clean_rows(steps=2, tokens=False)
    for r in rows:
        r["precision"] *= 100
    err = _error(write_dump(rows, tmp_path / "pct.jsonl"), tmp_path, capsys, "pct.jsonl: line 1: column 'precision'")
    assert "is outside [0, 1]: precision is a share (a percentage? divide by 100)" in " ".join(err.split())
    signed = clean_rows(steps=2, tokens=False)
    for r in signed:
        r["turns"] = [dict(t, process_score=-0.5) for t in CHAIN_TURNS]
    assert _diag(write_dump(signed, tmp_path / "signed.jsonl"), tmp_path / "o2", capsys)[0] in (0, 1)


def test_verl_column_names_in_a_creditlab_dump_name_the_rename(tmp_path, capsys):
    rows = [{"step": r["step"], "uid": r["group"], "reward": r["reward"], "old_log_probs": r["logprobs"],
             "rollout_log_probs": r["rollout_logprobs"], "response_mask": r["policy_mask"]}
            for r in clean_rows(steps=1)]
    p = tmp_path / "verl_names.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = _error(p, tmp_path, capsys, "verl_names.jsonl: columns 'old_log_probs', 'rollout_log_probs', "
                                      "'response_mask', 'uid' are verl's names")
    assert ("rename 'old_log_probs' to 'logprobs', 'rollout_log_probs' to 'rollout_logprobs', 'response_mask' to "
            "'policy_mask', 'uid' to 'group'") in err


def _verl_dir_file(path: Path, step: int, n: int = 16) -> None:
    """A verl ``rollout_data_dir`` file: lengths are characters."""
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"input": f"question {i // 4}", "output": "word " * (10 + i), "score": float(i % 2),
                                 "step": step}) + "\n")


def test_lengths_in_characters_and_tokens_in_one_input_are_named(tmp_path, capsys):
    d = tmp_path / "mixed"
    d.mkdir()
    for s in range(4):
        _verl_dir_file(d / f"{s}.jsonl", s)
    write_dump([dict(r, step=r["step"] + 4) for r in clean_rows(steps=4, tokens=False)], d / "tokens.parquet")
    before = _snapshot(d)
    code, js, err = _diag(d, tmp_path / "o", capsys, "--fail-on", "warn")
    assert code == 1 and _snapshot(d) == before
    (w,) = js["warnings"]
    assert w.startswith("response_length is in characters in 4 files (0.jsonl, 1.jsonl, 2.jsonl and 1 more) and in "
                        "tokens in 1 (tokens.parquet): lengths in two units cannot be averaged")
    assert f"warning: {w}" in " ".join(err.split())
    assert _checks(js)["reward.length_hacking"]["status"] == "skipped"
    assert "Input warnings (1):" in (tmp_path / "o" / "report.md").read_text()
    # a creditlab file whose response_length is the text's characters, beside one in tokens
    rows = clean_rows(steps=2, tokens=False)
    for r in rows:
        r["response"] = "x" * int(r["response_length"] * 4)
        r["response_length"] = len(r["response"])
    chars = write_dump(rows, tmp_path / "chars.jsonl")
    toks = write_dump([dict(r, step=r["step"] + 2) for r in clean_rows(steps=2, tokens=False)], tmp_path / "t.jsonl")
    dump = read_dump([chars, toks])
    assert dump.length_units == ["characters", "tokens"] and len(dump.warnings) == 1


def test_the_same_file_twice_is_an_error(tmp_path, capsys):
    p = write_dump(clean_rows(steps=1), tmp_path / "d" / "a.jsonl")
    _error([p, p], tmp_path, capsys, "a.jsonl: given twice: its rows would count twice")
    _error([tmp_path / "d", p], tmp_path, capsys, f"a.jsonl: given twice (as '{tmp_path / 'd'}' and '{p}')")
    write_dump(clean_rows(steps=1), tmp_path / "d" / "a.parquet")  # the same rows in another format
    _error(tmp_path / "d", tmp_path, capsys, f"{tmp_path / 'd' / 'a.parquet'} holds the same rows as "
                                             f"{tmp_path / 'd' / 'a.jsonl'} (every row, step for step: the same dump "
                                             "twice, e.g. in two formats or a copied file): pass one of them")


def test_a_step_written_twice_is_left_out_with_a_warning(tmp_path, capsys):
    p = tmp_path / "d.jsonl"
    write_dump(clean_rows(steps=2), p)
    write_dump([r for r in clean_rows(steps=2) if r["step"] == 1], p, append=True)  # a resumed trainer
    write_dump([dict(r, step=2) for r in clean_rows(seed=5, steps=1)], p, append=True)
    code, js, err = _diag(p, tmp_path / "o", capsys)
    assert js["input"]["trajectories"] == 96
    (w,) = js["warnings"]
    assert w.startswith(f"32 rows repeat identical rows of the same step written before and were left out (first: "
                        f"{p}: line 65 repeats {p}: line 33)")
    # identical rollouts within one write of a step are kept: a group's answers can be the same
    same = clean_rows(steps=1, tokens=False)
    for r in same:
        r["response_length"], r["reward"] = 10.0, 1.0
    d = read_dump(write_dump(same, tmp_path / "same.jsonl"))
    assert len(d) == 32 and d.warnings == []


# ------------------------------------------------------------------------------------------------
# 4. nested token lists, a file still being written
# ------------------------------------------------------------------------------------------------


def test_per_turn_nested_lists_in_token_columns_are_errors(tmp_path, capsys):
    rows = clean_rows(steps=1)
    nested = copy.deepcopy(rows)
    for r in nested:  # one list per turn: ragged
        r["logprobs"] = [r["logprobs"][:6], r["logprobs"][6:]]
        r["rollout_logprobs"] = [r["rollout_logprobs"][:6], r["rollout_logprobs"][6:]]
        r["policy_mask"] = [r["policy_mask"][:6], r["policy_mask"][6:]]
        del r["turn_ids"]
    _error(write_dump(nested, tmp_path / "nested.jsonl"), tmp_path, capsys,
           "nested.jsonl: line 1: column 'logprobs': element 0 is a list, not one value: a token column is a flat "
           "list with one value per token (not one list per turn)")
    even = copy.deepcopy(rows)  # equal-length turns: numpy would make a 2-D array of them
    for r in even:
        r["policy_mask"] = [[m] for m in r["policy_mask"]]
    p = tmp_path / "even.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in even))
    _error(p, tmp_path, capsys, "even.jsonl: line 1: column 'policy_mask': element 0 is a list")
    t = pa.table({"step": [0, 0], "group": [0, 0], "reward": [1.0, 0.0],
                  "logprobs": [[[-1.0], [-2.0]], [[-1.0]]], "rollout_logprobs": [[[-1.0], [-2.0]], [[-1.0]]],
                  "policy_mask": [[True, True], [True]]})
    pq.write_table(t, tmp_path / "nested.parquet")
    # one case through a real subprocess: exit 2 and one line, no traceback
    before = _snapshot(tmp_path / "nested.parquet")
    proc = subprocess.run([sys.executable, "-m", "creditlab.cli.main", "diagnose", str(tmp_path / "nested.parquet"),
                           "--out", str(tmp_path / "sub"), "--quiet"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "nested.parquet: row 1: column 'logprobs': element 0 is a list" in " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr and not (tmp_path / "sub").exists()
    assert _snapshot(tmp_path / "nested.parquet") == before


def test_a_torn_last_line_of_the_newest_file_is_skipped_with_a_warning(tmp_path, capsys):
    d = tmp_path / "run"
    old = write_dump(clean_rows(steps=2, tokens=False), d / "1.jsonl")
    new = write_dump([dict(r, step=r["step"] + 2) for r in clean_rows(seed=1, steps=2, tokens=False)], d / "2.jsonl")
    with new.open("a") as fh:
        fh.write('{"step": 3, "group": "prompt-0", "rew')  # the job is writing this line
    os.utime(old, ns=(1_000_000_000, 1_000_000_000))
    code, js, err = _diag(d, tmp_path / "o", capsys)
    assert code == 0 and js["input"]["trajectories"] == 128
    assert _diag(d, tmp_path / "strict", capsys, "--fail-on", "warn")[0] == 1  # an input warning counts there
    (w,) = js["warnings"]
    assert w == (f"{new}: line 65 is incomplete (no end of line, not valid JSON) and was skipped: the newest file of "
                 "the input, probably still being written.")
    assert w in (tmp_path / "o" / "report.md").read_text()
    # the same torn line in the older file is a row its writer left unfinished: skipped, saying so
    os.utime(new, ns=(500_000_000, 500_000_000))
    code, js, _ = _diag(d, tmp_path / "o2", capsys)
    assert code == 0 and js["input"]["trajectories"] == 128
    assert js["warnings"] == [f"{new}: line 65, the last, is a row cut off by its writer (an unfinished JSON object: "
                              "a writer that stopped mid-row, e.g. crashed) and was skipped. To silence this, delete "
                              "that line."]
    # a line that is not JSON and not an unfinished row is an error, wherever it is
    os.utime(new, ns=(2_000_000_000, 2_000_000_000))
    text = new.read_text()
    new.write_text(text[:text.rindex("\n") + 1] + '{"step": 3,, "group": "prompt-0"}\n')
    _error(d, tmp_path, capsys, "2.jsonl: line 65: not valid JSON (Expecting property name enclosed in double "
                                "quotes at column 12): each line must be one JSON object (one trajectory); fix or "
                                "remove that line")


# ------------------------------------------------------------------------------------------------
# 5. an output directory that holds an earlier report
# ------------------------------------------------------------------------------------------------


def test_an_error_does_not_leave_an_earlier_report_claiming_success(tmp_path, capsys):
    good = write_dump(clean_rows(), tmp_path / "good.jsonl")
    out = tmp_path / "o"
    assert _diag(good, out, capsys)[0] == 0
    before = _snapshot(out)
    assert json.loads(before[str(out / "diagnose.json")])["exit_code"] == 0 and str(out / "k3_over_steps.png") in before
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"step": 0, "group": 0, "reward": "x"}) + "\n")
    code, js, err = _diag(bad, out, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    line = " ".join(err.split())
    assert "bad.jsonl: line 1: column 'reward': expected a finite number" in line
    assert f"({out} held the report of an earlier run (exit code 0, on good.jsonl): its diagnose.json and report.md " \
           "now record this error)" in line
    assert js["exit_code"] == 2 and js["checks"] == [] and "column 'reward'" in js["error"]
    assert "Error (exit code 2)" in (out / "report.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["diagnose.json", "report.md"]  # the stale plots are gone
    # an invalid option fails the same way
    assert _diag(good, out, capsys)[0] == 0
    code, js, err = _diag(good, out, capsys, "--fail-on", "never")
    assert code == 2 and js["exit_code"] == 2 and "--fail-on: must be fail or warn" in js["error"]
    # and through the API
    assert _diag(good, out, capsys)[0] == 0
    from creditlab.diagnose.report import diagnose
    with pytest.raises(InputError, match="now record this error"):
        diagnose([bad], out)
    assert json.loads((out / "diagnose.json").read_text())["exit_code"] == 2


def test_replacing_an_earlier_report_says_so_in_one_line(tmp_path, capsys):
    clean = write_dump(clean_rows(), tmp_path / "clean.jsonl")
    out = tmp_path / "o"
    code, js, err = _diag(clean, out, capsys)
    assert code == 0 and "note:" not in err
    rows = clean_rows()
    for r in rows:
        r["reward"] = 1.0
    code, js, err = _diag(write_dump(rows, tmp_path / "other.jsonl"), out, capsys)
    assert code == 1 and js["input"]["files"] == [str(tmp_path / "other.jsonl")]
    notes = [ln for ln in err.splitlines() if ln.startswith("note:")]
    assert notes == [f"note: {out} held the report of an earlier run (exit code 0, on clean.jsonl); this run's "
                     "report replaced it."]


# ------------------------------------------------------------------------------------------------
# 6. run_checks(only=...)  7. messages on small or shrinking mismatch
# ------------------------------------------------------------------------------------------------


def test_run_checks_only_takes_one_id_or_a_list_and_names_every_unknown_one(tmp_path):
    dump = read_dump(write_dump(clean_rows(steps=1), tmp_path / "d.jsonl"))
    assert [r.id for r in run_checks(dump, only="mismatch.k3")] == ["mismatch.k3"]
    with pytest.raises(ConfigError, match=r"--check: unknown checks 'nope', 'mismatch'; valid: mismatch.k3"):
        run_checks(dump, only=["nope", "mismatch.k3", "mismatch"])
    with pytest.raises(ConfigError, match="--check: expected a check id or a list of them, got 3"):
        run_checks(dump, only=3)


def _rows_with_delta(deltas_by_row, step=0):
    rows = []
    for i, d in enumerate(deltas_by_row):
        lp = np.full(len(d), -1.0)
        rows.append({"step": step, "group": i // 4, "reward": float(i % 2), "logprobs": lp.tolist(),
                     "rollout_logprobs": (lp - np.asarray(d)).tolist(), "policy_mask": [True] * len(d)})
    return rows


def test_one_sided_on_too_few_tokens_says_so(tmp_path, capsys):
    rng = np.random.default_rng(0)
    rows = _rows_with_delta([0.01 * rng.choice([-1, 1], 19) for _ in range(5)])  # 95 measurable tokens
    code, js, _ = _diag(write_dump(rows, tmp_path / "small.jsonl"), tmp_path / "o", capsys)
    r = _checks(js)["mismatch.one_sided"]
    assert r["status"] == "skipped" and "No measurable mismatch" not in r["message"]
    assert r["message"] == ("Too few measurable tokens to tell a side: |delta| > 1e-05 on 95 of 95 policy tokens "
                            "(95 < 100).")
    rows = _rows_with_delta([np.zeros(40) for _ in range(5)])  # no token differs beyond 1e-5 (but not copied)
    for r in rows:
        r["rollout_logprobs"] = [v + 1e-7 for v in r["rollout_logprobs"]]
    code, js, _ = _diag(write_dump(rows, tmp_path / "zero.jsonl"), tmp_path / "o2", capsys)
    r = _checks(js)["mismatch.one_sided"]
    assert r["status"] == "ok" and r["message"].startswith("No measurable mismatch: |delta| <= 1e-05 on 200 of 200")
    # (the identical rows of a group, here 0 and 2, 1 and 3, are kept: a group's rollouts can be the same)


def test_prefix_drift_that_shrinks_says_shrinks(tmp_path, capsys):
    turn0 = [0.01] * 30
    turn1 = [-0.03] * 10 + [0.0] * 20
    rows = _rows_with_delta([turn0 + turn1 for _ in range(8)])
    for r in rows:
        r["turn_ids"] = [0] * 30 + [1] * 30
    code, js, _ = _diag(write_dump(rows, tmp_path / "shrink.jsonl"), tmp_path / "o", capsys)
    r = _checks(js)["mismatch.prefix_drift"]
    assert r["status"] == "info" and code == 0
    assert r["message"].startswith("The RMS prefix log ratio shrinks from 0.178 at turn 0 to 0.092 nats at turn 1")
    assert "grows" not in r["message"]


def _long_rows(turns: int = 30, late_from: int = 16, late_bias: float = 0.05) -> list[dict]:
    """Trajectories of ``turns`` turns of 24 policy tokens with a small mismatch, and a bias from turn
    ``late_from`` on that makes the prefix log ratio grow after it."""
    rng = np.random.default_rng(4)
    rows = []
    for i in range(32):
        row = token_row(rng, [24] * turns, noise=0.02)
        late = np.asarray(row["policy_mask"]) & (np.asarray(row["turn_ids"]) >= late_from)
        row["rollout_logprobs"] = (np.asarray(row["rollout_logprobs"]) - late_bias * late).tolist()
        rows.append({"step": i % 8, "group": i // 4, "reward": float(i % 2), **row})
    return rows


def test_prefix_drift_reads_every_turn_whatever_max_turns_draws(tmp_path, capsys):
    """A 30-turn dump whose drift grows after turn 16: the value is read at its last turn (29) with the
    default --max-turns 16 as with --max-turns 32; --max-turns only limits the plot, and the report says
    which turns it leaves out."""
    dump = write_dump(_long_rows(), tmp_path / "long.jsonl")
    got = {}
    for m in (16, 32):
        code, js, err = _diag(dump, tmp_path / f"o{m}", capsys, "--check", "mismatch.prefix_drift", "--max-turns", m)
        got[m] = (code, _checks(js)["mismatch.prefix_drift"])
        assert (tmp_path / f"o{m}" / "prefix_by_turn.png").exists()
    (c16, r16), (c32, r32) = got[16], got[32]
    assert c16 == c32 == 0 and r16["status"] == r32["status"] == "info"
    # the late bias of 0.05 nats on 24 tokens a turn, summed over turns 16-28 and half of turn 29: about 16.2
    assert r16["value"] == r32["value"] == pytest.approx(16.2, rel=0.05)
    assert r16["details"]["turn_last"] == r32["details"]["turn_last"] == 29
    assert r16["details"]["turns"] == 30 and r16["details"]["turns_not_drawn"] == 14
    assert ("The plot draws turns 0-15 (--max-turns 16); the 14 later turns with 20+ tokens (turns 16-29) are "
            "left out of it, not of the value. No calibrated verdict:") in r16["message"]
    assert r32["details"]["turns_not_drawn"] == 0 and "--max-turns" not in r32["message"]
    report = (tmp_path / "o16" / "report.md").read_text()
    assert "the 14 later turns with 20+ tokens (turns 16-29) are left out of it" in report
    # sparse turn ids far apart are read too, without a table as long as the largest id
    rows = _long_rows(turns=3, late_from=1, late_bias=0.3)
    for r in rows:
        r["turn_ids"] = [{0: 0, 1: 40, 2: 10**9}.get(t, -1) for t in r["turn_ids"]]
    code, js, _ = _diag(write_dump(rows, tmp_path / "sparse.jsonl"), tmp_path / "os", capsys,
                        "--check", "mismatch.prefix_drift")
    r = _checks(js)["mismatch.prefix_drift"]
    assert r["details"]["turn_last"] == 10**9 and "(turns 40 and 1000000000) are left out of it" in r["message"]


def test_a_new_file_holding_only_a_torn_line_is_skipped(tmp_path, capsys):
    d = tmp_path / "run"
    old = write_dump(clean_rows(steps=1, tokens=False), d / "1.jsonl")
    os.utime(old, ns=(1_000_000_000, 1_000_000_000))
    (d / "2.jsonl").write_text('{"step": 1, "gro')
    code, js, _ = _diag(d, tmp_path / "o", capsys)
    assert js["input"]["files"] == [str(old)] and js["input"]["trajectories"] == 32
    assert js["warnings"] == [f"{d / '2.jsonl'}: line 1 is incomplete (no end of line, not valid JSON) and was "
                              "skipped: the newest file of the input, probably still being written."]
