"""The dump schema: writers and readers round-trip in every format, and a malformed row is an error naming
the file, the row and the column."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from creditlab.diagnose import COLUMNS, read_dump, rows_from_arrays, write_dump
from creditlab.diagnose.readers import dump_files
from creditlab.errors import ConfigError, InputError
from diagnose_synth import CHAIN_TURNS, clean_rows


def _rows(n_steps=2):
    rows = clean_rows(steps=n_steps, groups=2)
    for i, r in enumerate(rows):
        r["turns"] = [dict(t, process_score=float(i % 2)) for t in CHAIN_TURNS]
        r["instruction"] = "cancel the order of ann"
        r["truncated"] = bool(i % 3 == 0)
    return rows


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz", "d.parquet", "dir"])
def test_every_format_reads_back_the_same_dump(tmp_path, name):
    rows = _rows()
    ref = read_dump(write_dump(rows, tmp_path / "ref.jsonl"))
    p = write_dump(rows, tmp_path / name)
    d = read_dump(tmp_path / name if name == "dir" else p)
    assert len(d) == len(rows) and d.n_tokens == sum(len(r["logprobs"]) for r in rows)
    for f in ("step", "group", "reward"):
        assert np.array_equal(getattr(d, f), getattr(ref, f)), f
    for f in ("offsets", "logprobs", "rollout_logprobs", "policy_mask", "turn_ids"):
        assert np.array_equal(getattr(d.tokens, f), getattr(ref.tokens, f)), f
    for k in ("precision", "process_reward", "truncated"):
        assert np.array_equal(d.scalars[k], ref.scalars[k]), k
    assert d.turns == ref.turns and d.texts["instruction"] == ref.texts["instruction"]
    assert d.group_labels == ["prompt-0", "prompt-1"]


def _as_arrays(rows):
    """The rows with torch tensors and numpy values where a trainer has them."""
    out = []
    for r in rows:
        r = dict(r)
        r["step"] = torch.tensor(r["step"])
        r["reward"] = np.float32(r["reward"])
        r["logprobs"] = torch.tensor(r["logprobs"], dtype=torch.float64)
        r["rollout_logprobs"] = np.asarray(r["rollout_logprobs"])
        r["policy_mask"] = torch.tensor(r["policy_mask"])
        r["turn_ids"] = np.asarray(r["turn_ids"], dtype=np.int64)
        r["precision"] = torch.tensor(r["precision"], dtype=torch.float64)
        out.append(r)
    return out


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz", "d.parquet", "dir"])
def test_tensors_and_numpy_values_are_written_in_every_format(tmp_path, name):
    rows = _rows()
    ref = read_dump(write_dump(rows, tmp_path / "ref.jsonl"))
    d = read_dump(write_dump(_as_arrays(rows), tmp_path / name))
    for f in ("step", "group", "reward"):
        assert np.array_equal(getattr(d, f), getattr(ref, f)), f
    for f in ("offsets", "logprobs", "rollout_logprobs", "policy_mask", "turn_ids"):
        assert np.array_equal(getattr(d.tokens, f), getattr(ref.tokens, f)), f
    assert np.array_equal(d.scalars["precision"], ref.scalars["precision"])


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz", "d.parquet", "dir"])
def test_writing_no_rows_is_refused_and_leaves_the_dump_readable(tmp_path, name):
    path = tmp_path / name
    with pytest.raises(InputError, match=r"^write_dump: no rows to write to .* \(an empty list, or an iterator "
                                         r"already used up\); nothing was written$"):
        write_dump([], path)
    assert not path.exists()
    write_dump(clean_rows(steps=1), path)
    with pytest.raises(InputError, match="no rows to write"):
        write_dump(iter(()), path)
    assert len(read_dump(path)) == 32  # nothing added that would make the dump unreadable


def test_a_directory_collects_parts_in_natural_order_and_files_combine(tmp_path):
    for s in (10, 2):
        write_dump([r for r in clean_rows(steps=1) if not r.update(step=s)], tmp_path / "run")
    (tmp_path / "run" / "notes.txt").write_text("ignored")
    assert [p.name for p in dump_files([tmp_path / "run"])] == ["part-00000.parquet", "part-00001.parquet"]
    # one file with token columns and one without: the second's rows have no tokens
    write_dump(clean_rows(steps=1, tokens=False), tmp_path / "plain.jsonl")
    d = read_dump([tmp_path / "run", tmp_path / "plain.jsonl"])
    assert sorted(set(d.step.tolist())) == [0, 2, 10]
    assert d.tokens.has_tokens.sum() == 64 and (~d.tokens.has_tokens).sum() == 32
    assert d.has("response_length") and d.has("logprobs")
    append = tmp_path / "a.jsonl"
    write_dump(clean_rows(steps=1), append)
    write_dump(clean_rows(seed=1, steps=1), append, append=True)  # other rows: the same ones are a repeat
    assert len(read_dump(append)) == 64
    parquet = tmp_path / "x.parquet"  # a parquet file is appended to as well (read and rewritten)
    write_dump(clean_rows(steps=1), parquet)
    write_dump(clean_rows(seed=1, steps=1), parquet, append=True)
    assert len(read_dump(parquet)) == 64


def test_rows_from_arrays_drops_padding_and_checks_its_inputs():
    lp = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-0.5, -0.25, 0.0, 0.0]])
    vm = torch.tensor([[True, True, True, False], [True, True, False, False]])
    rows = rows_from_arrays(step=[1, 2], group_ids=["a", "a"], rewards=torch.tensor([1.0, 0.0]), logprobs=lp,
                            rollout_logprobs=lp, policy_mask=vm, valid_mask=vm, turn_ids=vm.long() - 1,
                            truncated=[True, False])
    assert rows[0]["logprobs"] == [-1.0, -2.0, -3.0] and rows[1]["policy_mask"] == [True, True]
    assert rows[1]["turn_ids"] == [0, 0] and rows[1]["truncated"] is False and rows[1]["step"] == 2
    with pytest.raises(InputError, match="rollout_logprobs, policy_mask: the token columns come together"):
        rows_from_arrays(step=0, group_ids=[0, 0], rewards=[0, 1], logprobs=lp)
    with pytest.raises(InputError, match="group_ids: expected 2"):
        rows_from_arrays(step=0, group_ids=[0], rewards=[0, 1])
    with pytest.raises(ConfigError, match="colour: not an optional trajectory column"):
        rows_from_arrays(step=0, group_ids=[0], rewards=[0], colour=["red"])
    with pytest.raises(InputError, match="policy_mask: must be boolean"):
        rows_from_arrays(step=0, group_ids=[0, 0], rewards=[0, 1], logprobs=lp, rollout_logprobs=lp,
                         policy_mask=vm.float())


def _jsonl(tmp_path, rows, name="bad.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


GOOD = {"step": 0, "group": 1, "reward": 1.0, "logprobs": [-1.0, -0.5], "rollout_logprobs": [-1.0, -0.4],
        "policy_mask": [True, True]}


@pytest.mark.parametrize("row, match", [
    ({**GOOD, "step": "one"}, "line 2: column 'step': expected an integer, got 'one'"),
    ({**GOOD, "step": 1.5}, "line 2: column 'step': expected an integer"),
    ({**GOOD, "group": None}, "line 2: column 'group': expected an int or a string, got nothing"),
    ({**GOOD, "group": True}, "line 2: column 'group'"),
    ({**GOOD, "reward": None}, "line 2: column 'reward': expected a finite number, got nothing"),
    ({**GOOD, "reward": float("nan")}, "line 2: column 'reward': expected a finite number"),
    ({**GOOD, "logprobs": [-1.0, "x"]}, "line 2: column 'logprobs': element 1 is 'x', expected a number"),
    ({**GOOD, "logprobs": None}, "line 2: column 'logprobs': expected a list, got nothing"),
    ({**GOOD, "policy_mask": [True, 2]}, "line 2: column 'policy_mask': element 1 is 2, expected true/false"),
    ({**GOOD, "rollout_logprobs": [-1.0]}, "line 2: column 'rollout_logprobs': 1 values, but 'logprobs' has 2"),
    ({**GOOD, "turn_ids": [0]}, "line 2: column 'turn_ids': 1 values, but 'logprobs' has 2"),
    ({**GOOD, "turn_ids": [0, -3]}, "line 2: column 'turn_ids': element 1 is -3"),
    ({**GOOD, "precision": "high"}, "line 2: column 'precision': expected a number, got 'high'"),
    ({**GOOD, "truncated": "no"}, "line 2: column 'truncated': expected true/false"),
    ({**GOOD, "response_length": -1}, "line 2: column 'response_length': must be >= 0"),
    ({**GOOD, "response": 5}, "line 2: column 'response': expected text, got int"),
    ({**GOOD, "turns": {"tool": "x"}}, "line 2: column 'turns': expected a list of turns, got dict"),
    ({**GOOD, "turns": [{"tool": "x", "args": {}, "returned": []}]}, "line 2: column 'turns': turn 0 has no field "
                                                                     "'is_write'"),
    ({**GOOD, "turns": [{"tool": "x", "args": [], "returned": [], "is_write": False}]}, "turn 0: 'args' must be"),
    ({**GOOD, "turns": [{"tool": "x", "args": {}, "returned": [], "is_write": 1}]}, "turn 0: 'is_write' must be"),
    ({**GOOD, "turns": [{"tool": "x", "args": {}, "returned": [], "is_write": True, "process_score": "a"}]},
     "turn 0: 'process_score' must be a number or null"),
    ("{not json", "line 2: not valid JSON"),
    ("[1, 2]", "line 2: expected a JSON object"),
])
def test_a_malformed_jsonl_row_names_file_line_and_column(tmp_path, row, match):
    first = {**GOOD, "turn_ids": [0, 0]} if isinstance(row, dict) and "turn_ids" in row else GOOD
    p = _jsonl(tmp_path, [first, row])
    with pytest.raises(InputError, match=match) as err:
        read_dump(p)
    assert str(p) in str(err.value)


def test_file_level_errors(tmp_path):
    with pytest.raises(InputError, match="no such file or directory"):
        read_dump(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(InputError, match="not a dump"):
        read_dump(tmp_path / "x.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no .jsonl"):
        read_dump(tmp_path / "empty")
    with pytest.raises(InputError, match="holds no rows"):
        read_dump(_jsonl(tmp_path, [], "blank.jsonl"))
    with pytest.raises(InputError, match=r"column 'reward' is missing \(required: step, group, reward\)"):
        read_dump(_jsonl(tmp_path, [{"step": 0, "group": 0}], "noreward.jsonl"))
    with pytest.raises(InputError, match="column 'policy_mask' is missing: the token columns"):
        read_dump(_jsonl(tmp_path, [{k: v for k, v in GOOD.items() if k != "policy_mask"}], "two.jsonl"))
    with pytest.raises(InputError, match="line 2: column 'logprobs': missing here, present in other rows"):
        read_dump(_jsonl(tmp_path, [GOOD, {k: v for k, v in GOOD.items() if k not in ("logprobs",)}], "gap.jsonl"))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(InputError, match="junk.parquet: not a readable parquet file"):
        read_dump(tmp_path / "junk.parquet")
    bad_gz = tmp_path / "bad.jsonl.gz"
    bad_gz.write_bytes(b"\x1f\x8b garbage")
    with pytest.raises(InputError, match="bad.jsonl.gz: cannot be read"):
        read_dump(bad_gz)
    with gzip.open(tmp_path / "ok.jsonl.gz", "wt") as fh:
        fh.write(json.dumps(GOOD) + "\n")
    assert len(read_dump(tmp_path / "ok.jsonl.gz")) == 1


def test_a_malformed_parquet_row_names_file_row_and_column(tmp_path):
    def table(**cols):
        base = {"step": [0, 1], "group": [0, 0], "reward": [1.0, 0.0],
                "logprobs": [[-1.0], [-2.0]], "rollout_logprobs": [[-1.0], [-2.0]], "policy_mask": [[True], [True]]}
        base.update(cols)
        p = tmp_path / "t.parquet"
        pq.write_table(pa.table(base), p)
        return p

    with pytest.raises(InputError, match=r"t.parquet: row 2: column 'logprobs': expected a list, got nothing"):
        read_dump(table(logprobs=[[-1.0], None]))
    with pytest.raises(InputError, match=r"row 2: column 'policy_mask': element 0 is null"):
        read_dump(table(policy_mask=pa.array([[True], [None]], type=pa.list_(pa.bool_()))))
    with pytest.raises(InputError, match=r"row 1: column 'logprobs': element 0 is 'a', expected a number"):
        read_dump(table(logprobs=[["a"], ["b"]]))
    with pytest.raises(InputError, match=r"row 1: column 'logprobs': expected a list column, got double"):
        read_dump(table(logprobs=[-1.0, -2.0]))
    with pytest.raises(InputError, match=r"row 2: column 'reward': expected a finite number, got nothing"):
        read_dump(table(reward=[1.0, None]))
    d = read_dump(table(logprobs=pa.array([[None], [-2.0]], type=pa.list_(pa.float64()))))
    assert np.isnan(d.tokens.logprobs[0])  # a null log-prob is NaN: the placeholder check reports it


def test_schema_table_is_documented():
    doc = (__import__("pathlib").Path(__file__).parents[1] / "docs" / "diagnose.md").read_text()
    for c in COLUMNS:
        assert f"`{c.name}`" in doc, c.name


def test_progress_is_reported_while_a_large_jsonl_file_is_read(tmp_path):
    p = write_dump(clean_rows(steps=130, tokens=False), tmp_path / "big.jsonl")  # 4,160 lines
    calls = []
    read_dump(p, progress=lambda what, done, total: calls.append((what, done, total)))
    assert len(calls) == 3 and calls[-1][1] == calls[-1][2] == p.stat().st_size
    assert [c[1] for c in calls] == sorted(c[1] for c in calls) and all(c[0] == "read big.jsonl" for c in calls)
