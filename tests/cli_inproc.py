"""The ``creditlab`` command run in this process, for the tests of the CLI.

:func:`run_inproc` is cheaper than a subprocess (``python -m creditlab.cli.main``) and returns what one
returns, so a test can take either (each class of mistakes keeps one subprocess case).
"""

from __future__ import annotations

import contextlib
import io
import subprocess


def run_inproc(*args) -> subprocess.CompletedProcess:
    """``creditlab ARGS`` in this process: its exit code, stdout and stderr as a
    :class:`subprocess.CompletedProcess` (a non-integer exit code counts as 1)."""
    from creditlab.cli.main import main

    err, out = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
