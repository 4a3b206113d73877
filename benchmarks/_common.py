"""What the benchmarks share: line-buffered output, ``--smoke``, options checked in one line, and the base
policy with progress.

``--smoke`` runs a benchmark's real code paths on tiny sizes in seconds (the test suite runs every
benchmark that way: tests/test_benchmarks.py); its figures say nothing about speed. A smoke builds its
base policy from :func:`smoke_base` in a temporary cache directory, so it never reads or writes the user
cache. A full run loads the lab's base policy from ``$CREDITLAB_CACHE`` (or the user cache directory) and
says before it builds one that is not there yet, then prints the build's steps with an ETA.

Every option that takes a value is checked as it is parsed (:func:`integer`, :func:`number`, or
choices): a value out of range exits 2 with one line naming the option, before anything runs
(tests/test_benchmarks.py holds every benchmark to it).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:  # imported where used: bench_fork and bench_diagnose need no torch
    from creditlab.train.toolshop_base import BaseConfig

#: The smoke's base policy: the lab's tasks, vocabulary and context, a model and a training of seconds.
SMOKE_BASE = {"n_demos": 32, "steps": 4, "batch_size": 8, "n_layer": 1, "n_head": 2, "d_model": 16}


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``bench_x.py: error: argument --B: must be an integer
    >= 1, got '0'``, exit code 2 (argparse's own prints the usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def integer(low: int = 1) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= low``. ``refuses``: values it refuses (for the tests)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return v

    parse.refuses = (str(low - 1), "1.5", "nan")  # type: ignore[attr-defined]
    return parse


def number(low: float = 0.0, high: float | None = None, *, above: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number ``>= low`` (``above``: ``> low``) and ``<= high``."""
    want = f"a number {'>' if above else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v) or v < low or (above and v == low) or (high is not None and v > high):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return v

    refuses = ["nan", "inf", str(low if above else low - 1)] + ([str(high + 1)] if high is not None else [])
    parse.refuses = tuple(refuses)  # type: ignore[attr-defined]
    return parse


def parser(description: str | None = None) -> Parser:
    """An argument parser with ``--smoke`` whose errors are one line (:class:`Parser`)."""
    ap = Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, seconds: exercise the benchmark's code paths (its figures mean nothing); "
                         "the base policy is a tiny one built in a temporary cache directory")
    return ap


def line_buffered() -> None:
    """Line-buffered stdout: a benchmark piped to a file or run without a terminal prints as it goes."""
    sys.stdout.reconfigure(line_buffering=True)


def start(description: str | None = None) -> Parser:
    """Line-buffered stdout and an argument parser with ``--smoke`` (:func:`parser`)."""
    line_buffered()
    return parser(description)


def smoke_base(cfg: BaseConfig) -> BaseConfig:
    """``cfg`` with :data:`SMOKE_BASE`'s model and training (same tasks, thoughts and context)."""
    return replace(cfg, **SMOKE_BASE)


def cache_dir(smoke: bool, stack: ExitStack) -> str:
    """The base-policy cache: a temporary directory removed when ``stack`` closes (``smoke``), else
    ``$CREDITLAB_CACHE`` or the user cache directory."""
    from creditlab.train.toolshop_base import default_cache_dir

    if smoke:
        return stack.enter_context(tempfile.TemporaryDirectory(prefix="creditlab-bench-smoke-"))
    return str(default_cache_dir(os.environ.get("CREDITLAB_CACHE")))


def load_base(cfg: BaseConfig, cache: str, label: str = "base policy", every_s: float = 15.0):
    """The base policy of ``cfg`` from ``cache``; when it is not there, a line saying it is built now
    (steps, where it goes), then its progress (step, loss, elapsed, ETA) about every ``every_s`` seconds
    and at each tenth of the steps."""
    from creditlab.train.toolshop_base import base_policy

    path = Path(cache) / f"toolshop-base-{cfg.key()}.safetensors"
    if path.exists():
        return base_policy(cfg, cache_dir=cache)
    print(f"{label}: not in the cache yet; building it now ({cfg.steps} steps of {cfg.batch_size} demonstrations, "
          f"d_model {cfg.d_model}, {cfg.n_layer} layers) into {cache}; later runs load it")
    t0 = time.perf_counter()
    state = {"last": t0}
    tenth = max(1, cfg.steps // 10)

    def progress(k: int, loss: float) -> None:
        now = time.perf_counter()
        done = k + 1
        if done == cfg.steps or done % tenth == 0 or now - state["last"] >= every_s:
            state["last"] = now
            eta = (now - t0) / done * (cfg.steps - done)
            print(f"{label}: step {done}/{cfg.steps}, loss {loss:.3f}, {now - t0:.0f} s, ETA {eta:.0f} s")

    model = base_policy(cfg, cache_dir=cache, progress=progress)
    print(f"{label}: built in {time.perf_counter() - t0:.1f} s")
    return model


def load_line() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
