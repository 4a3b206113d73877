"""The labs on the lab protocol give the stored rows recorded before they moved onto it.

``tests/golden/*.parquet`` were written by the pre-protocol labs from the tiny configurations
below (``time/*`` columns excluded: wall-clock timings).
"""

from pathlib import Path

import pandas as pd

from creditlab.lab.protocol import run_lab
from creditlab.lab.store import ResultStore

GOLDEN = Path(__file__).parent / "golden"


def _stored(out: Path) -> pd.DataFrame:
    return ResultStore(out / "store").frame().drop(columns=["cell_key"])


def _same_rows(got: pd.DataFrame, want: pd.DataFrame, keys: list[str]) -> None:
    cols = [c for c in want.columns if not c.startswith("time/")]
    assert set(cols) <= set(got.columns), sorted(set(cols) - set(got.columns))
    got = got[cols].sort_values(keys, kind="stable").reset_index(drop=True)
    want = want[cols].sort_values(keys, kind="stable").reset_index(drop=True)
    pd.testing.assert_frame_equal(got, want, check_dtype=False, check_exact=False, rtol=1e-6, atol=1e-7)


def test_coverage_rows_unchanged(tmp_path):
    from creditlab.lab.chain_trainer import ChainTrainConfig
    from creditlab.lab.coverage import LAB, CoverageConfig

    cfg = CoverageConfig(train=ChainTrainConfig(T=6, K=3, hidden=8, group=4, updates=8, eval_points=2), seeds=2,
                         Cs=(1, 4), vd_C=4, vds=(0.0, 1.0), shuffle_Cs=(4,), shuffle_vds=(1.0,), dose_C=2,
                         dose_ks=(1, 6), experiments=("c_sweep", "vd_sweep", "shuffle", "dose"))  # the recorded four
    run_lab(LAB, cfg, tmp_path, progress=False)
    _same_rows(_stored(tmp_path), pd.read_parquet(GOLDEN / "coverage_rows.parquet"),
               ["experiment", "arm", "C", "k", "vd", "exposure", "seed"])


def test_fork_rows_unchanged(tmp_path):
    from creditlab.lab.fork import LAB, ForkLabConfig

    cfg = ForkLabConfig(arms=("recall", "mean", "fork"), seeds=2, updates=6, prompts_per_update=4, group_size=4,
                        eval_every=3, eval_prompts=16, max_units=8, experiments=("train",))
    run_lab(LAB, cfg, tmp_path, progress=False)
    _same_rows(_stored(tmp_path), pd.read_parquet(GOLDEN / "fork_rows.parquet"), ["arm", "seed", "update"])
