"""The toolshop lab on the lab protocol: golden rows, resume, outputs, CLI errors."""

from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from creditlab.lab.protocol import run_lab
from creditlab.lab.store import ResultStore
from creditlab.labs.toolshop import LAB, ToolshopLabConfig
from creditlab.train.toolshop_base import BaseConfig
from creditlab.train.toolshop_grpo import GRPOConfig
from golden_compare import assert_rows_match

GOLDEN = Path(__file__).parent / "golden"
TINY_BASE = BaseConfig(n_demos=64, steps=30, batch_size=16, d_model=32, n_layer=1, max_len=96)


def _tiny(cache, seeds=2):
    return ToolshopLabConfig(base=replace(TINY_BASE, chain_lengths=(2,)),
                             grpo=GRPOConfig(updates=2, tasks_per_update=2, group_size=2, chain_lengths=(2,),
                                             max_len=48, eval_every=1, eval_tasks=4),
                             seeds=seeds, mismatch_tasks=4, cache_dir=str(cache))


def test_rows_unchanged_outputs_and_resume(tmp_path):
    cfg = _tiny(tmp_path / "cache")
    res = run_lab(LAB, cfg, tmp_path / "out", progress=False)
    out = tmp_path / "out"
    for name in ("updates.parquet", "summary.md", "mismatch.md", "toolshop_success_k3.png", "report.md"):
        assert (out / name).exists(), name
    stored = ResultStore(out / "store").frame()
    want = pd.read_parquet(GOLDEN / "toolshop_rows.parquet")
    cols = [c for c in want.columns if not c.startswith("time/")]
    got = stored[stored["cell_key"].str.startswith("grpo/")][cols]
    assert_rows_match(got, want[cols], ["seed", "update"], max_tokens=48)  # float-noise tolerances, any CPU
    mismatch = pd.read_parquet(GOLDEN / "toolshop_mismatch.parquet")
    quantized = lambda f: f["engine"].ne("fp32") | f["learner"].ne("fp32")  # noqa: E731
    assert_rows_match(res.tables["mismatch"].frame, mismatch, list(mismatch.columns[:2]), max_tokens=160,
                      quantized=quantized)
    assert len(res.tables["updates"].frame) == 2 * 3  # seeds x (two updates + the final evaluation row)
    again = run_lab(LAB, cfg, out, progress=False)
    assert again.computed == 0
    pd.testing.assert_frame_equal(again.tables["updates"].frame, res.tables["updates"].frame)
    # the cache directory is not part of the run's identity: another cache, same run, nothing recomputed
    moved = run_lab(LAB, replace(cfg, cache_dir=str(tmp_path / "cache2")), out, progress=False)
    assert moved.computed == 0


@pytest.mark.parametrize(("args", "flag"), [
    (["--rollout-precision", "fp4"], "--rollout-precision"),
    (["--correction", "magic"], "--correction"),
    (["--seeds", "0"], "--seeds"),
])
def test_cli_errors_name_the_flag(tmp_path, args, flag, capsys):
    from creditlab.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["lab", "toolshop", "--quick", "--out", str(tmp_path / "x"), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def half_tis_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, cap: float = 2.0):
    """A correction arm registered by this test module: truncated token IS shrunk halfway to 1."""
    from creditlab.core.correction import tis_weights

    w, metrics = tis_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask, cap=cap)
    return 1.0 + 0.5 * (w - 1.0), metrics


def test_a_correction_registered_elsewhere_runs_in_the_toolshop_lab(tmp_path):
    from creditlab.core.correction import registered_correction

    def first_update(correction):
        g = replace(_tiny(tmp_path / "cache", seeds=1).grpo, rollout_precision="fp8", correction=correction)
        cfg = replace(_tiny(tmp_path / "cache", seeds=1), grpo=g, experiments=("grpo",))
        res = run_lab(LAB, cfg, tmp_path / correction, progress=False)
        return res.tables["updates"].frame.iloc[0]  # update 0: same base policy, same rollouts in both runs

    tis = first_update("tis")
    with registered_correction("half_tis", half_tis_weights):
        half = first_update("half_tis")
    assert tis["mismatch/k3"] == half["mismatch/k3"] > 0  # the same fp8 rollouts against the fp32 learner
    # float32 near 1: the deviation from 1 carries ~1e-3 relative rounding
    assert half["loss/weight_mean"] - 1 == pytest.approx(0.5 * (tis["loss/weight_mean"] - 1), rel=1e-3)
    assert tis["loss/weight_mean"] != 1.0


def test_dump_writes_rollouts_that_diagnose_reads(tmp_path):
    from creditlab.diagnose.report import diagnose

    cfg = replace(_tiny(tmp_path / "cache", seeds=1), experiments=("grpo",), dump_dir=str(tmp_path / "dump"))
    res = run_lab(LAB, cfg, tmp_path / "out", progress=False)
    files = sorted((tmp_path / "dump").glob("*.jsonl"))
    assert [f.name for f in files] == ["toolshop-seed=0.jsonl"]
    rows = files[0].read_text().splitlines()
    assert len(rows) == cfg.grpo.updates * cfg.grpo.tasks_per_update * cfg.grpo.group_size
    d = diagnose(files, tmp_path / "diag")
    status = {r.id: r.status for r in d.results}
    assert status["mismatch.k3"] == "ok" and status["mismatch.placeholder_logprobs"] == "ok"  # fp32 engine
    # the dump is not part of the run's identity: the same run without it reads every cell back
    assert run_lab(LAB, replace(cfg, dump_dir=None), tmp_path / "out", progress=False).computed == 0
    assert res.computed == 2


def test_dump_is_refused_by_labs_without_rollouts(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "creditlab.cli.main", "lab", "fork", "--quick", "--out",
                        str(tmp_path / "o"), "--dump", str(tmp_path / "d")], capture_output=True, text=True)
    assert r.returncode == 2 and "--dump" in r.stderr and "Traceback" not in r.stderr
