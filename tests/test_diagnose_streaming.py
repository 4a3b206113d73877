"""creditlab diagnose reads in bounded memory: the same verdicts as the in-memory path it replaced, on every
kind of dump that path read, whatever the batch boundaries; a subset of steps; files in parallel.

The reference is the in-memory path as it was (tests/reference/diagnose_inmemory: every token read into
flat arrays, the checks and the trainers' metrics on them). Every dump of the corpus below is read by both,
with the default batches and with batches of a few kilobytes (so that rows, gzip members, cut-off lines and
line ends fall across batch boundaries), and every check's status, value, details, message and series, the
input warnings, the errors and the trainers' metrics must agree (values to float tolerance: the streaming
path sums per row, then over rows).
"""

from __future__ import annotations

import copy
import gzip
import json
import math
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import creditlab.diagnose.readers as readers
from creditlab.cli.main import main
from creditlab.diagnose import read_dump, run_checks, write_dump
from creditlab.diagnose.calibration import calibration
from creditlab.diagnose.report import diagnose
from creditlab.diagnose.steps import describe_steps, parse_steps
from creditlab.diagnose.trainer_metrics import trainer_metrics
from creditlab.errors import ConfigError, CreditlabError
from creditlab.lab.runner import ProcessPoolExecutorBackend, SerialExecutor, make_executor
from diagnose_synth import CHAIN_TURNS, clean_rows, token_row, topk_row, trend_rows
from reference.diagnose_inmemory import checks as old_checks
from reference.diagnose_inmemory import readers as old_readers
from reference.diagnose_inmemory import trainer_metrics as old_metrics

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = [ROOT / "src" / "creditlab" / "diagnose" / "examples" / "toolshop_fp8.jsonl.gz",
            ROOT / "docs" / "examples" / "toolshop_fp8.jsonl"]


# ------------------------------------------------------------------------------------------------
# the comparison


def _same(a, b, rel: float = 1e-9, tol: float = 1e-15) -> bool:
    """Equal, floats (and float arrays) to ``rel`` or ``tol`` (NaN equal to NaN)."""
    if isinstance(a, bool | np.bool_) or isinstance(b, bool | np.bool_):
        return bool(a) == bool(b) and type(a) is type(b) or a == b
    if isinstance(a, int | float | np.number) and isinstance(b, int | float | np.number):
        a, b = float(a), float(b)
        return (math.isnan(a) and math.isnan(b)) or a == b or abs(a - b) <= rel * max(abs(a), abs(b)) + tol
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return False
        if a.dtype.kind in "fc" or b.dtype.kind in "fc":
            return bool(np.allclose(a, b, rtol=rel, atol=tol, equal_nan=True))
        return bool((a == b).all())
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y, rel, tol) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], rel, tol) for k in a)
    return a == b


def _old(paths, **kw):
    """What the in-memory path gave: ("error", type, message) or (warnings, results, trainer metrics)."""
    try:
        d = old_readers.read_dump(paths, **kw)
        return d.warnings, old_checks.run_checks(d), old_metrics.trainer_metrics(d)
    except CreditlabError as err:
        return "error", type(err).__name__, str(err)


def _new(paths, **kw):
    try:
        d = read_dump(paths, tokens=False, **kw)
        return d.warnings, run_checks(d), trainer_metrics(d)
    except CreditlabError as err:
        return "error", type(err).__name__, str(err)


#: Details a check gained after the in-memory reader was frozen (tests/reference): new keys, compared elsewhere
#: (the transfer experiment's candidate units: tests/integrations/test_live_checks.py).
ADDED_DETAILS = {c: {"units", "domain", "in_domain"}
                 for c in ("mismatch.prefix_drift", "mismatch.sequence_ratio_length")}
#: Checks whose verdict follows the transfer run's calibration (diagnose/calibration.json), not the frozen reader's
#: thresholds: the same value and message, the calibration's status and sentence added (status info while the
#: calibration gives them no verdict).
CALIBRATED = ("mismatch.prefix_drift", "mismatch.sequence_ratio_length")


def assert_same_as_inmemory(paths, **kw) -> None:
    old, new = _old(paths, **kw), _new(paths, **kw)
    if old[0] == "error" or new[0] == "error":
        assert old == new
        return
    assert old[0] == new[0]  # the input warnings
    assert [r.id for r in old[1]] == [r.id for r in new[1]]
    for a, b in zip(old[1], new[1], strict=True):
        if a.id not in CALIBRATED or a.status == "skipped":
            assert a.status == b.status, (a.id, a.message, b.message)
            assert _same(a.value, b.value), (a.id, a.value, b.value)
            assert a.message == b.message, a.id
        elif calibration() is None or calibration().thresholds[a.id] is None:
            assert b.status == "info" and _same(a.value, b.value), (a.id, a.value, b.value)
            assert b.message.startswith(a.message + " No calibrated verdict: "), (a.id, b.message)
        for k in a.details.keys() | (b.details.keys() - ADDED_DETAILS.get(b.id, set())):
            assert _same(a.details.get(k), b.details.get(k)), (a.id, k, a.details.get(k), b.details.get(k))
        for k in a.series.keys() | b.series.keys():
            assert _same(a.series.get(k), b.series.get(k)), (a.id, k)
    # the trainers' metrics to 1e-12 as well: verl's chi2_token is E[r^2] - 1 over ratios near 1, where the order
    # of the sum shows at 1e-16 of the terms
    assert _same(old[2], new[2], tol=1e-12), "trainer_metrics"


# ------------------------------------------------------------------------------------------------
# the corpus: every kind of dump the diagnose tests and the exporters write


def _copied(rows):
    for r in rows:
        r["rollout_logprobs"] = list(r["logprobs"])
    return rows


def _padded(rows, extra=40):
    rows = copy.deepcopy(rows)
    L = max(len(r["logprobs"]) for r in rows) + extra
    for r in rows:
        n = L - len(r["logprobs"])
        r["logprobs"] += [0.0] * n
        r["rollout_logprobs"] += [0.0] * n
        r["policy_mask"] += [True] * n
        r["turn_ids"] += [r["turn_ids"][-1]] * n
    return rows


def _chain_rows(scored: bool):
    rows = []
    for i, r in enumerate(clean_rows(steps=4)):
        r["instruction"] = "exchange the item of ann"
        r["turns"] = [dict(t, process_score=(float(k % 2) if scored else None)) for k, t in enumerate(CHAIN_TURNS)]
        if i % 7 == 0:
            r["turns"] = None if i % 2 else []
        r["truncated"] = bool(i % 5 == 0)
        rows.append(r)
    return rows


def _verl_file(path: Path, step: int, n: int = 16) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"input": f"question {i // 4}", "output": "word " * (10 + i + step),
                                        "score": float((i + step) % 2), "step": step, "precision": 0.5 + i / 64,
                                        "gts": "x"}) + "\n" for i in range(n)))
    return path


def _trl_table(path: Path, step: int, rng) -> None:
    n, G = 32, 4
    ok = rng.integers(0, 2, n).astype(float)
    means = ok.reshape(-1, G).mean(1).repeat(G)
    path.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"step": [step] * n, "prompt": [f"prompt {i // G}" for i in range(n)],
                  "completion": [f"completion {i} " * (1 + i % 3) for i in range(n)], "pass_reward": ok,
                  "advantage": ok - means}).to_parquet(path / f"completions_{step:05d}.parquet")


def _gz_members(rows, *cuts):
    """The rows' lines in gzip members split at ``cuts``; the middle member cut off mid-stream."""
    lines = [json.dumps(r) + "\n" for r in rows]
    bounds = [0, *cuts, len(lines)]
    members = [gzip.compress("".join(lines[a:b]).encode()) for a, b in zip(bounds, bounds[1:], strict=False)]
    members[1] = members[1][: len(members[1]) // 2]
    return b"".join(members)


def _build(name: str, tmp: Path) -> list[Path]:
    """The dump ``name`` of the corpus, written under ``tmp``."""
    rng = np.random.default_rng(7)
    if name == "clean":
        return [write_dump(clean_rows(), tmp / "d.jsonl")]
    if name == "clean parquet directory":
        d = tmp / "parts"
        for s in range(4):
            write_dump([r for r in clean_rows(steps=4) if r["step"] == s], d)
        return [d]
    if name == "large mismatch":
        return [write_dump(clean_rows(noise=0.2), tmp / "d.parquet")]
    if name == "mismatch rising late":
        rows = []
        for s in range(8):
            rows += [dict(r, step=s) for r in clean_rows(seed=s, steps=1, noise=0.003 if s < 4 else 0.03)]
        return [write_dump(rows, tmp / "d.jsonl")]
    if name == "prefix drift, 24 turns":
        return [write_dump(clean_rows(noise=0.3, turns=24, steps=4, groups=2), tmp / "d.jsonl")]
    if name == "one turn, derived turns":
        rows = clean_rows(turns=1, steps=4)
        for r in rows[::2]:
            del r["turn_ids"]
        return [write_dump(rows[::2], tmp / "a.jsonl"), write_dump(rows[1::2], tmp / "b.jsonl")]
    if name == "top-k engine":
        return [write_dump([{"step": i // 8, "group": i // 4, "reward": float(i % 2), **topk_row(rng, 40, k=5)}
                            for i in range(64)], tmp / "d.jsonl")]
    if name == "leaked observations":
        return [write_dump(clean_rows(leak_obs=True, steps=4), tmp / "d.jsonl")]
    if name == "padding":
        return [write_dump(_padded(clean_rows(steps=4)), tmp / "d.jsonl")]
    if name == "engine zeros and NaN":
        rows = clean_rows(steps=4)
        for r in rows[:20]:
            r["rollout_logprobs"] = [0.0] * len(r["rollout_logprobs"])
        for r in rows[40:44]:
            r["rollout_logprobs"][9] = float("nan")
            r["logprobs"][12] = None
        return [write_dump(rows, tmp / "d.jsonl")]
    if name == "rejected, bypass rows":
        rows = clean_rows(steps=4)
        for i, r in enumerate(rows):
            if i % 3 == 0:
                r["rejected"] = [bool(m and k % 5 == 0) for k, m in enumerate(r["policy_mask"])]
        a = write_dump([dict(r, logprobs_source="learner") for r in rows if "rejected" in r], tmp / "a.jsonl")
        b = write_dump([dict(r, logprobs_source="rollout (verl bypass mode)") for r in rows if "rejected" not in r],
                       tmp / "b.jsonl")
        return [a, b]
    if name == "copied columns":
        return [write_dump(_copied(clean_rows(steps=4)), tmp / "d.jsonl")]
    if name == "one copied file":
        d = tmp / "dir"
        write_dump(clean_rows(steps=4), d)
        write_dump(_copied([dict(r, step=r["step"] + 4) for r in clean_rows(seed=1, steps=4)]), d)
        return [d]
    if name == "rows without tokens":
        d = tmp / "mixed"
        write_dump(clean_rows(steps=4), d)
        write_dump([dict(r, step=r["step"] + 4) for r in clean_rows(seed=1, steps=1, tokens=False)], d)
        return [d]
    if name == "trends with nulls":
        rows = trend_rows(length_growth=1.0, precision_drop=0.3, process_rise=0.6)
        for i, r in enumerate(rows):
            if i % 4 == 0:
                r["precision"] = r["response_length"] = None
        return [write_dump(rows, tmp / "d.jsonl")]
    if name == "turns and chains":
        return [write_dump(_chain_rows(scored=False), tmp / "a.jsonl")]
    if name == "scored turns":
        return [write_dump(_chain_rows(scored=True), tmp / "a.parquet")]
    if name == "verl rollout_data_dir":
        d = tmp / "rollouts"
        for s in range(1, 6):
            _verl_file(d / f"{s}.jsonl", s)
        return [d]
    if name == "TRL completions":
        for s in range(1, 5):
            _trl_table(tmp / "completions", s, rng)
        return [tmp / "completions"]
    if name == "gzip, cut and appended to":
        p = tmp / "d.jsonl.gz"
        p.write_bytes(_gz_members(clean_rows(steps=4), 40, 80))
        return [p]
    if name == "gzip stream cut off":
        p = tmp / "d.jsonl.gz"
        data = gzip.compress("".join(json.dumps(r) + "\n" for r in clean_rows(steps=4)).encode())
        p.write_bytes(data[: int(len(data) * 0.8)])
        return [p]
    if name == "torn lines, crlf":
        p = tmp / "d.jsonl"
        lines = [json.dumps(r) for r in clean_rows(steps=4)]
        half = lines[50][: len(lines[50]) // 2]
        p.write_bytes(("\r\n".join(lines[:50]) + "\r\n" + half + "\n" + "\r\n".join(lines[51:100]) + "\n"
                       + lines[100][:300]).encode())
        return [p]
    if name == "a step written twice":
        rows = clean_rows(steps=4)
        again = [r for r in rows if r["step"] == 2]
        return [write_dump(rows + again, tmp / "d.jsonl")]
    if name == "lengths in two units":
        a = write_dump(clean_rows(steps=4, tokens=False), tmp / "a.jsonl")
        b = _verl_file(tmp / "v" / "9.jsonl", 9)
        return [a, b]
    if name == "probabilities in logprobs":
        rows = clean_rows(steps=4)
        for r in rows:
            r["logprobs"] = [math.exp(v) for v in r["logprobs"]]
        return [write_dump(rows, tmp / "d.jsonl")]
    if name == "a positive rollout log-prob late":
        rows = clean_rows(steps=4)
        rows[100]["rollout_logprobs"][7] = 2.5
        return [write_dump(rows, tmp / "d.parquet")]
    if name == "a nested token column":
        rows = clean_rows(steps=2)
        rows[30]["logprobs"][3] = [-1.0, -2.0]
        return [write_dump(rows, tmp / "d.jsonl")]
    if name == "two runs":
        first = clean_rows(seed=0, steps=1, tokens=False)
        return [write_dump(first + [r for r in clean_rows(seed=s, steps=4, tokens=False) if r["step"] > 0],
                           tmp / f"seed={s}.jsonl") for s in (1, 2)]
    if name.startswith("example"):
        return [EXAMPLES[int(name[-1])]]
    raise KeyError(name)


CORPUS = ["clean", "clean parquet directory", "large mismatch", "mismatch rising late", "prefix drift, 24 turns",
          "one turn, derived turns", "top-k engine", "leaked observations", "padding", "engine zeros and NaN",
          "rejected, bypass rows", "copied columns", "one copied file", "rows without tokens", "trends with nulls",
          "turns and chains", "scored turns", "verl rollout_data_dir", "TRL completions", "gzip, cut and appended to",
          "gzip stream cut off", "torn lines, crlf", "a step written twice", "lengths in two units",
          "probabilities in logprobs", "a positive rollout log-prob late", "a nested token column", "two runs",
          "example 0", "example 1"]


@pytest.mark.parametrize("chunk", [None, 3000], ids=["batches of 8 MiB", "batches of 3 kB"])
@pytest.mark.parametrize("name", CORPUS)
def test_the_verdicts_are_those_of_the_in_memory_path(name, chunk, tmp_path, monkeypatch):
    paths = _build(name, tmp_path)
    if chunk is not None:
        monkeypatch.setattr(readers, "CHUNK_BYTES", chunk)
    assert_same_as_inmemory(paths)


@pytest.fixture(scope="module")
def agent_dumps(tmp_path_factory):
    """Dumps the toolshop agent writes (creditlab.train.toolshop_dump, as its lab's --dump does) with a base
    policy of a few seconds: real quantized rollouts, tool calls with process scores, an fp32 and an FP8
    engine."""
    import torch

    from creditlab.train.toolshop_base import BaseConfig, train_base
    from creditlab.train.toolshop_dump import dump_rollouts
    from creditlab.train.toolshop_rollout import make_tasks, rollout, sequence_logprobs, successful_read_scores

    base = BaseConfig(chain_lengths=(2, 3), n_demos=64, steps=40, batch_size=16, d_model=24, n_layer=1, max_len=96,
                      lr=1e-2)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = train_base(base)
        root = tmp_path_factory.mktemp("agent")
        out = {}
        for engine in ("fp32", "fp8"):
            path = root / f"{engine}.jsonl"
            for s in range(4):
                b = rollout(model, make_tasks(range(s * 16, (s + 1) * 16), base.chain_lengths), precision=engine,
                            max_len=96, generator=torch.Generator().manual_seed(s),
                            group_ids=[i // 4 for i in range(16)])
                dump_rollouts(b, b.success, s, path, logprobs=sequence_logprobs(model, b.tokens),
                              process_scores=successful_read_scores(b) if engine == "fp8" else None)
            out[engine] = path
        return out
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("engine", ["fp32", "fp8"])
def test_the_verdicts_on_the_toolshop_agents_dumps_are_those_of_the_in_memory_path(engine, agent_dumps,
                                                                                    monkeypatch):
    assert_same_as_inmemory([agent_dumps[engine]])
    monkeypatch.setattr(readers, "CHUNK_BYTES", 5000)
    assert_same_as_inmemory([agent_dumps[engine]])


@pytest.mark.parametrize("orjson", [True, False], ids=["orjson", "json"])
def test_the_json_parser_changes_nothing(orjson, tmp_path, monkeypatch):
    """orjson (when installed) and Python's json module read the same values; a line orjson refuses (NaN) goes
    to json."""
    if not orjson:
        monkeypatch.setattr(readers, "_orjson", None)
    rows = clean_rows(steps=4)
    rows[5]["rollout_logprobs"][8] = float("nan")  # written as NaN, which orjson refuses
    rows[9]["group"] = 2 ** 70  # beyond 64 bits: orjson would read a float
    p = write_dump(rows, tmp_path / "d.jsonl")
    assert_same_as_inmemory([p])
    assert 2 ** 70 in read_dump(p, tokens=False).group_labels


# ------------------------------------------------------------------------------------------------
# batches


def test_a_row_split_across_batches_is_read_whole(tmp_path, monkeypatch):
    rows = clean_rows(steps=4)
    p = write_dump(rows, tmp_path / "d.jsonl")
    whole = read_dump(p)
    for chunk in (1, 17, 1000, 4099):  # blocks smaller than a row: every row is split
        monkeypatch.setattr(readers, "CHUNK_BYTES", chunk)
        got = read_dump(p)
        assert np.array_equal(got.tokens.logprobs, whole.tokens.logprobs)
        assert np.array_equal(got.row_number, whole.row_number) and np.array_equal(got.step, whole.step)
        for f in ("usable", "sum_delta", "sum_k3", "first_flagged", "trl_max_abs", "verl_lp"):
            assert np.array_equal(getattr(got.rows, f), getattr(whole.rows, f)), f


def test_a_character_and_a_crlf_split_across_blocks_read_as_text_mode_does(tmp_path, monkeypatch):
    rows = [dict(r, instruction="héllo wörld — ✓") for r in clean_rows(steps=2, tokens=False)]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows)
    p = tmp_path / "d.jsonl"
    p.write_bytes(text.encode())
    for chunk in range(1, 40, 3):
        monkeypatch.setattr(readers, "CHUNK_BYTES", chunk)
        d = read_dump(p)
        assert d.texts["instruction"] == [r["instruction"] for r in rows]
        assert d.row_number.tolist() == list(range(1, len(rows) + 1))


def test_a_truncated_last_line_and_a_cut_gzip_are_warned_about_whatever_the_batches(tmp_path, monkeypatch):
    rows = clean_rows(steps=4)
    lines = [json.dumps(r) + "\n" for r in rows]
    p = tmp_path / "d.jsonl"
    p.write_text("".join(lines) + lines[0][:200])
    gz = tmp_path / "g.jsonl.gz"
    data = gzip.compress("".join(lines).encode())
    gz.write_bytes(data[: len(data) // 2])
    want = {str(x): _old([x]) for x in (p, gz)}
    for chunk in (64, 5000, None):
        if chunk:
            monkeypatch.setattr(readers, "CHUNK_BYTES", chunk)
        for x in (p, gz):
            got = read_dump([x], tokens=False)
            assert got.warnings == want[str(x)][0]
    assert f"line {len(rows) + 1} is incomplete (no end of line, not valid JSON)" in want[str(p)][0][0]
    assert want[str(gz)][0] and str(gz) in want[str(gz)][0][0]


def test_a_logprob_error_counts_the_whole_file_whatever_the_batches(tmp_path, monkeypatch):
    rows = clean_rows(steps=4)
    for r in rows[40:]:
        r["logprobs"] = [math.exp(v) for v in r["logprobs"]]
    p = write_dump(rows, tmp_path / "d.jsonl")
    q = write_dump(rows, tmp_path / "d.parquet")
    for path in (p, q):
        want = _old([path])
        assert want[0] == "error" and "policy tokens of this file are" in want[2]
        monkeypatch.setattr(readers, "CHUNK_BYTES", 2000)
        assert _new([path]) == want


# ------------------------------------------------------------------------------------------------
# bounded memory


def _agent_dump(path: Path, steps: int, per_step: int = 12, tokens: int = 1500) -> int:
    rng = np.random.default_rng(0)
    with open(path, "w") as fh:
        for s in range(steps):
            for i in range(per_step):
                fh.write(json.dumps({"step": s, "group": i // 4, "reward": float(i % 2),
                                     **token_row(rng, [tokens // 10] * 8, obs_len=tokens // 40)}) + "\n")
    return path.stat().st_size


def _peak(path: Path, **kw) -> int:
    tracemalloc.start()
    try:
        d = read_dump(path, **kw)
        run_checks(d)
        trainer_metrics(d)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_peak_memory_does_not_grow_with_the_steps(tmp_path, monkeypatch):
    """Twice the steps (twice the file) adds next to nothing to the peak of the streaming reader (per-row sums:
    a few hundred bytes a row), where the in-memory reader's peak grows with the file."""
    monkeypatch.setattr(readers, "CHUNK_BYTES", 1 << 20)
    small, big = tmp_path / "s.jsonl", tmp_path / "b.jsonl"
    n_small, n_big = _agent_dump(small, 8), _agent_dump(big, 16)
    assert n_big > 1.9 * n_small > 8e6
    p_small, p_big = _peak(small, tokens=False), _peak(big, tokens=False)
    assert p_big - p_small < 0.05 * (n_big - n_small), (p_small, p_big, n_small, n_big)
    assert p_big < 16 * (1 << 20)  # a batch's text, rows and token arrays at a time
    kept_small, kept_big = _peak(small, tokens=True), _peak(big, tokens=True)  # every token kept: grows with the file
    assert kept_big - kept_small > 0.3 * (n_big - n_small), (kept_small, kept_big)


# ------------------------------------------------------------------------------------------------
# a subset of steps


def test_step_selections_parse_as_documented():
    sel = parse_steps("0:100:10,250:260,7")
    assert sorted(s for s in range(300) if s in sel) == sorted({*range(0, 100, 10), 7, *range(250, 260)})
    assert [s for s in range(1, 31) if s in parse_steps("every:10")] == [10, 20, 30]
    assert [s for s in range(0, 31) if s in parse_steps("::10")] == [0, 10, 20, 30]
    assert [s for s in range(0, 10) if s in parse_steps(":3")] == [0, 1, 2]
    assert [s for s in range(0, 10) if s in parse_steps("7:")] == [7, 8, 9]
    assert parse_steps("5:20:5").mask(np.arange(25)).nonzero()[0].tolist() == [5, 10, 15]
    for bad in ("", "a", "5:3", "1:2:0", "every:0", "1;2", "1.5"):
        with pytest.raises(ConfigError, match="--steps"):
            parse_steps(bad)
    assert describe_steps([3]) == "3" and describe_steps(range(4, 9)) == "4-8"
    assert describe_steps([0, 10, 20, 30]) == "0, 10, ..., 30 (every 10)"
    assert describe_steps([1, 2, 5, 9, 11, 12, 13, 20, 21, 40]) == "1, 2, 5, 9, 11, 12, 13, 20 and 2 more (up to 40)"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "verl", "TRL"])
def test_a_step_subset_reads_as_the_rows_of_those_steps_alone(fmt, tmp_path):
    rng = np.random.default_rng(1)
    if fmt in ("jsonl", "parquet"):
        rows = clean_rows(steps=12)
        full = write_dump(rows, tmp_path / f"all.{fmt}")
        alone = write_dump([r for r in rows if r["step"] % 3 == 0], tmp_path / f"alone.{fmt}")
    elif fmt == "verl":
        full, alone = tmp_path / "all", tmp_path / "alone"
        for s in range(1, 13):
            _verl_file(full / f"{s}.jsonl", s)
            if s % 3 == 0:
                _verl_file(alone / f"{s}.jsonl", s)
    else:
        full, alone = tmp_path / "all", tmp_path / "alone"
        for s in range(1, 13):
            _trl_table(full, s, rng)
        alone.mkdir()
        for s in range(3, 13, 3):
            shutil.copy(full / f"completions_{s:05d}.parquet", alone)
    sub = read_dump(full, tokens=False, steps="every:3")
    ref = read_dump(alone, tokens=False)
    assert np.array_equal(sub.step, ref.step) and np.array_equal(sub.reward, ref.reward)
    assert sub.steps_selection == "every:3" and sorted(set(sub.step.tolist()) | set(sub.steps_not_read)) == \
        sorted(set(read_dump(full, tokens=False).step.tolist()))
    a, b = run_checks(sub), run_checks(ref)
    for x, y in zip(a, b, strict=True):
        assert x.status == y.status and _same(x.value, y.value), x.id
    if fmt == "jsonl":
        assert _same(trainer_metrics(sub), trainer_metrics(ref))


def test_a_verl_file_of_a_step_not_selected_is_not_opened(tmp_path):
    d = tmp_path / "rollouts"
    for s in range(1, 9):
        _verl_file(d / f"{s}.jsonl", s)
    with open(d / "5.jsonl", "a") as fh:  # damage past the first line: read, it would be an error
        fh.write("not json\n")
    dump = read_dump(d, tokens=False, steps="1:5")
    assert sorted(set(dump.step.tolist())) == [1, 2, 3, 4] and dump.steps_not_read == [5, 6, 7, 8]
    assert len(dump.files) == 4
    with pytest.raises(CreditlabError, match="5.jsonl: line 17: not valid JSON"):
        read_dump(d, tokens=False, steps="5")
    with pytest.raises(ConfigError, match=r"--steps: '100:200' selects none of the steps in the input \(1-8\)"):
        read_dump(d, tokens=False, steps="100:200")


def test_the_report_and_diagnose_json_say_which_steps_were_read(tmp_path):
    p = write_dump(clean_rows(steps=8), tmp_path / "d.jsonl")
    with pytest.raises(SystemExit) as ex:
        main(["diagnose", str(p), "--out", str(tmp_path / "o"), "--quiet", "--steps", "0:8:2"])
    assert ex.value.code == 0
    js = json.loads((tmp_path / "o" / "diagnose.json").read_text())
    assert js["input"]["steps_read"] == [0, 2, 4, 6] and js["input"]["steps_selection"] == "0:8:2"
    assert js["input"]["steps_not_read"] == [1, 3, 5, 7] and js["input"]["trajectories"] == 128
    report = (tmp_path / "o" / "report.md").read_text()
    assert ("Steps read: 4 of 8, selected by `--steps 0:8:2`: 0, 2, ..., 6 (every 2); not read: 1, 3, ..., 7 "
            "(every 2).") in report
    res = diagnose([p], tmp_path / "all")
    assert res.summary["steps_read"] == list(range(8)) and res.summary["steps_selection"] is None
    assert "Steps read: all 8 (0-7)." in (tmp_path / "all" / "report.md").read_text()


@pytest.mark.parametrize("argv, match", [
    (["--steps", "9:2"], "--steps: '9:2' selects no step"),
    (["--steps", "x"], "--steps: 'x' is not a step selection"),
    (["--steps", "100:"], "--steps: '100:' selects none of the steps in the input (0-1)"),
    (["--workers", "2", "--executor", "serial"], "--workers: --workers 2 with --executor serial"),
    (["--workers", "0"], "--workers: must be an integer >= 1"),
    (["--ray-address", "auto"], "--ray-address: needs --executor ray"),
])
def test_step_and_worker_mistakes_exit_2_with_one_line(argv, match, tmp_path, capsys):
    p = write_dump(clean_rows(steps=2), tmp_path / "d.jsonl")
    with pytest.raises(SystemExit) as ex:
        main(["diagnose", str(p), "--out", str(tmp_path / "o"), "--quiet", *argv])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and match in " ".join(err.split()) and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------------------------------
# files in parallel


def _fields(d) -> dict:
    out = {k: getattr(d, k) for k in ("files", "formats", "row_file", "row_number", "step", "group", "group_labels",
                                      "reward", "scalars", "warnings", "length_units", "reward_sources",
                                      "response_chars", "sources", "instruction")}
    out["rows"] = vars(d.rows) if d.rows is not None else None
    out["turns"] = vars(d.turn_stats) if d.turn_stats is not None else None
    return out


def test_files_read_in_parallel_give_the_serial_dump(tmp_path):
    d = tmp_path / "run"
    for s in range(6):
        rows = [dict(r, step=s) for r in _chain_rows(scored=True)[s * 8:(s + 1) * 8]]
        if s == 2:
            rows[0]["logprobs_source"] = "learner"
        write_dump(rows, d / f"{s}.jsonl")
    with open(d / "5.jsonl", "a") as fh:
        fh.write('{"step": 5, "gro')  # the newest file, still being written
    serial = read_dump(d, tokens=False)
    par = read_dump(d, tokens=False, executor=ProcessPoolExecutorBackend(2))
    assert _same(_fields(serial), _fields(par))
    assert serial.warnings and serial.warnings == par.warnings
    a, b = run_checks(serial), run_checks(par)
    assert [(r.status, r.message) for r in a] == [(r.status, r.message) for r in b]
    assert _same(_fields(read_dump(d, tokens=False, executor=SerialExecutor())), _fields(serial))


def test_an_error_in_parallel_is_the_one_a_serial_read_raises(tmp_path):
    d = tmp_path / "run"
    for s in range(4):
        rows = clean_rows(seed=s, steps=1, tokens=False)
        rows = [dict(r, step=s) for r in rows]
        if s in (1, 3):
            rows[4]["reward"] = "x"
        write_dump(rows, d / f"{s}.jsonl")
    with pytest.raises(CreditlabError) as serial:
        read_dump(d, tokens=False)
    with pytest.raises(CreditlabError) as par:
        read_dump(d, tokens=False, executor=make_executor(2))
    assert str(serial.value) == str(par.value) and "1.jsonl: line 5: column 'reward'" in str(par.value)


def test_the_cli_reads_files_with_workers(tmp_path, capsys):
    d = tmp_path / "run"
    for s in range(4):
        write_dump([dict(r, step=s) for r in clean_rows(seed=s, steps=1)], d / f"{s}.jsonl")
    outs = []
    for extra in ([], ["--workers", "2"]):
        out = tmp_path / f"o{len(outs)}"
        with pytest.raises(SystemExit) as ex:
            main(["diagnose", str(d), "--out", str(out), "--quiet", *extra])
        assert ex.value.code == 0
        outs.append(json.loads((out / "diagnose.json").read_text()))
    for a, b in zip(outs[0]["checks"], outs[1]["checks"], strict=True):
        assert a["status"] == b["status"] and a["message"] == b["message"]


def test_files_read_on_ray_give_the_serial_dump(tmp_path):
    pytest.importorskip("ray")
    d = tmp_path / "run"
    for s in range(3):
        write_dump([dict(r, step=s) for r in clean_rows(seed=s, steps=1)], d / f"{s}.jsonl")
    par = read_dump(d, tokens=False, executor=make_executor(2, "ray"))  # a local Ray instance for this read
    assert _same(_fields(par), _fields(read_dump(d, tokens=False)))
