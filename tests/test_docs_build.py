"""The documentation site builds with ``mkdocs build --strict``: a broken link, a missing page or a
docstring the API reference cannot render fails CI here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # the theme's end-of-life banner
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(site)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-6000:]
    for page in ["index.html", "fork/index.html", "design/index.html", "api/index.html", "api/judge/index.html"]:
        assert (site / page).is_file(), page
    judge = (site / "api/judge/index.html").read_text()
    assert "OpenAIJudge" in judge and "endpoint_stats" in judge  # generated from the docstrings
    # a module added to a package is in its page without editing anything
    assert "creditlab.lab.runner.RayExecutor" in (site / "api/lab/index.html").read_text()


def test_doctest_blocks_and_grouped_parameters_render_as_written():
    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    try:
        griffe_docstrings = pytest.importorskip("griffe_docstrings")
    finally:
        sys.path.pop(0)
    text = "Sum.\n\nArgs:\n    a, b: the terms,\n        any numbers.\n    c: scale.\n\n>>> f(1, 2)\n[3]\n\nEnd."
    assert griffe_docstrings.rewrite(text) == (
        "Sum.\n\nArgs:\n    a: the terms,\n        any numbers.\n    b: See `a`.\n    c: scale.\n\n"
        "```python\n>>> f(1, 2)\n[3]\n```\n\nEnd.")
    assert griffe_docstrings.rewrite("A :class:`~creditlab.judge.base.JudgeError` or :func:`run_lab`.") == \
        "A `JudgeError` or `run_lab`."
