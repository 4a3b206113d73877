"""What the benchmarks share: line-buffered output, ``--smoke``, and the base policy with progress.

``--smoke`` runs a benchmark's real code paths on tiny sizes in seconds (the test suite runs every
benchmark that way: tests/test_benchmarks.py); its figures say nothing about speed. A smoke builds its
base policy from :func:`smoke_base` in a temporary cache directory, so it never reads or writes the user
cache. A full run loads the lab's base policy from ``$CREDITLAB_CACHE`` (or the user cache directory) and
says before it builds one that is not there yet, then prints the build's steps with an ETA.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: bench_fork and bench_diagnose need no torch
    from creditlab.train.toolshop_base import BaseConfig

#: The smoke's base policy: the lab's tasks, vocabulary and context, a model and a training of seconds.
SMOKE_BASE = {"n_demos": 32, "steps": 4, "batch_size": 8, "n_layer": 1, "n_head": 2, "d_model": 16}


def start(description: str | None = None) -> argparse.ArgumentParser:
    """Line-buffered stdout (a benchmark piped to a file or run without a terminal prints as it goes)
    and an argument parser with ``--smoke``."""
    sys.stdout.reconfigure(line_buffering=True)
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, seconds: exercise the benchmark's code paths (its figures mean nothing); "
                         "the base policy is a tiny one built in a temporary cache directory")
    return ap


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
