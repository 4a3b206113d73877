"""The docs tables that show a committed run's numbers are that run's tables.

``scripts/docs_tables.py`` renders each marked block of docs/mismatch.md and docs/granularity.md from the
run directories under results/; ``--check`` names every block the page holds differently. After a run
changes: ``python scripts/docs_tables.py`` rewrites the blocks, then read the prose around them again.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
_spec = importlib.util.spec_from_file_location("scripts_docs_tables", ROOT / "scripts" / "docs_tables.py")
docs_tables = sys.modules.setdefault("scripts_docs_tables", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(docs_tables)

pytestmark = pytest.mark.skipif(not RESULTS.is_dir(), reason="the committed runs (results/) are not in an sdist")


@pytest.mark.parametrize("page", docs_tables.pages())
def test_each_generated_table_is_its_runs(page):
    stale = docs_tables.check(page=page)
    assert not stale, "\n".join(stale) + "\n(python scripts/docs_tables.py rewrites them from results/)"


def _docs_copy(tmp_path: Path) -> Path:
    docs = tmp_path / "docs"
    docs.mkdir()
    for page in docs_tables.pages():
        shutil.copy(ROOT / "docs" / page, docs / page)
    return docs


def test_the_check_catches_a_typed_number_and_the_rewrite_restores_it(tmp_path, capsys):
    docs = _docs_copy(tmp_path)
    page = docs / "mismatch.md"
    text = page.read_text(encoding="utf-8")
    row = "| MXFP4 | QAT | 0.365 [0.30, 0.43] |"
    assert text.count(row) == 1, "the planted change needs a row of the mismatch-means block"
    page.write_text(text.replace(row, row.replace("0.365", "0.366")), encoding="utf-8")

    assert docs_tables.main(["--check", "--docs", str(docs)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "table mismatch-means is stale" in out[0] and "0.366" in out[0], out
    assert page.read_text(encoding="utf-8") != text  # --check writes nothing

    assert docs_tables.main(["--docs", str(docs)]) == 0
    assert page.read_text(encoding="utf-8") == text
    assert docs_tables.main(["--check", "--docs", str(docs)]) == 0


def test_the_check_catches_a_changed_run(tmp_path):
    """A stored value that changes (here in a copy of the 50-update budget run) makes its blocks stale."""
    results = tmp_path / "results"
    for run in ("granularity-budget/run", "granularity-budget/run100", "granularity-budget/run100-8seeds"):
        (results / run).mkdir(parents=True)
        for table in (RESULTS / run).glob("*.parquet"):
            shutil.copy(table, results / run / table.name)
    means = results / "granularity-budget/run/budget_means.parquet"
    df = pd.read_parquet(means)
    df.loc[(df["budget"] == "long") & (df["arm"] == "prm_fixed"), "truncation"] = 0.2
    df.to_parquet(means)

    stale = docs_tables.check(results=results, page="granularity.md")
    assert [line.split(": table ")[1].split()[0] for line in stale] == ["budget-means-50", "budget-verdicts-50"], stale
    assert "20.0%" in stale[0]


def test_a_block_without_markers_is_named(tmp_path):
    docs = _docs_copy(tmp_path)
    page = docs / "granularity.md"
    lines = page.read_text(encoding="utf-8").split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("<!-- table: budget-gate "))
    del lines[start]
    page.write_text("\n".join(lines), encoding="utf-8")
    stale = docs_tables.check(docs=docs, page="granularity.md")
    assert stale == ["docs/granularity.md: table budget-gate has no markers in the page"], stale


@pytest.mark.parametrize("value, spec, text", [
    (0.0625, ".3f", "0.063"),  # half away from zero, as the pages round by hand
    (-0.125, "+.2f", "-0.13"),
    (-0.0038, "+.2f", "-0.00"),
    (0.0, "+.3f", "0"),  # an exact integer prints as one
    (1.0, ".2f", "1"),
    (0.0651, ".1%", "6.5%"),
    (0.0417, "+.1f|x100", "+4.2"),
    (-0.00649, ".2f|abs|fine", "0.006"),
    (0.0357, ".2f|fine", "0.036"),
    (0.255, ".2f|fine", "0.26"),
    (0.00376, ".2f|sci", "3.8e-3"),
    (3.4e-13, ".2f|sci", "3.4e-13"),
    (0.237, ".2f|sci", "0.24"),
    (True, "|True=yes,False=no", "yes"),
    ("warn", "|fail=1,*=0", "0"),
])
def test_number_formats(value, spec, text):
    assert docs_tables.Numbers().format_field(value, spec) == text
