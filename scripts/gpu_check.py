"""The GPU check: what creditlab's CPU suite cannot measure, in one run of under 8 minutes on one GPU.

    python scripts/gpu_check.py --out results/gpu-check/<date>-<gpu>   # in a checkout with pip install -e ".[dev]"

Four steps, each with its own time limit inside an overall budget (``--budget``, default 450 s), each
writing its results to ``--out`` (a new folder) as it finishes, then ``summary.md`` with all of them:

1. ``core_cuda.txt`` / ``core_cuda.xml``: the core suite on the device, ``CREDITLAB_TEST_DEVICE=cuda python -m
   pytest tests/test_core_cuda.py`` (every public ``creditlab.core`` function on the GPU against the CPU).
2. ``timings.json`` / ``timings.md``: InterQ-RL (``interq_weights``, input checks on and off), the hot path
   the trainers take per micro-batch (``correction_weights(..., check=False, sync=False)``), ``tis_weights``
   and ``policy_loss`` (forward+backward, plain and weighted) timed side by side with verl's token TIS
   (``rollout_corr_helper.compute_rollout_correction_weights(..., rollout_is="token")``, the installed
   verl's own function) on the device, at the shapes of ``benchmarks/bench_correction.py`` (B=64, L=8192,
   ~32 segments per row, the same batch builder), interleaved, best of ``--repeat``, with
   ``torch.cuda.synchronize()`` around each call.
3. ``syncs.json``: host syncs on the hot path, counted with ``torch.cuda.set_sync_debug_mode("warn")``
   (one warning per synchronizing CUDA call, recorded with the line that made it): every arm through
   ``correction_weights(..., check=False, sync=False)``, ``policy_loss(..., check_finite=False)`` forward and
   backward, verl's ``creditlab_ppo`` loss, the live checks' ``batch_values`` (all expected at 0), and for
   contrast ``interq_weights`` with its checks on and verl's token TIS.
4. ``trl/``: a few GRPO steps of ``CreditlabGRPOTrainer`` with InterQ-RL on the GPU: the TRL recipe in its
   tiny configuration (``examples/trl/grpo_creditlab.py --tiny --device cuda``), its dump and its
   ``creditlab diagnose`` report.

Without a CUDA device it refuses to start: one line on stderr, exit code 2, nothing written. Exit code 0
when every step ran and passed, 1 otherwise (``summary.md`` says which).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the shapes of benchmarks/bench_correction.py's full run
SHAPES = {"B": 64, "L": 8192, "segments": 32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a new folder for the results")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check (default 450)")
    ap.add_argument("--repeat", type=int, default=20, help="timings per function, the best kept (default 20)")
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps of the TRL run (default 3)")
    return ap.parse_args(argv)


# --------------------------------------------------------------------------------------------
# the batch and the timer


def make_batch(device: str, B: int, L: int, segments: int, seed: int = 0):
    """benchmarks/bench_correction.py's batch (its own builder), on ``device``."""
    import importlib.util

    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_correction", ROOT / "benchmarks" / "bench_correction.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return tuple(t.to(device) for t in bench.make_batch(B, L, segments, seed=seed))


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timeit(fns: dict[str, Callable[[], object]], device: str, repeat: int, warmup: int = 2) -> dict[str, float]:
    """Best wall time of each function (seconds), interleaved round by round, synchronised around each call."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in times.items()}


def _verl_token_tis():
    try:
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
    except ImportError:
        return None
    return getattr(compute_rollout_correction_weights, "__creditlab_original__", compute_rollout_correction_weights)


def hot_path_calls(device: str, B: int, L: int, segments: int) -> dict[str, Callable[[], object]]:
    """The calls timed and sync-counted, on one batch: name -> call."""
    import torch

    from creditlab.core.correction import CORRECTIONS, correction_weights, interq_weights, tis_weights
    from creditlab.core.losses import policy_loss
    from creditlab.integrations._live import batch_values

    old, rollout, pm, vm = make_batch(device, B, L, segments)
    eff = pm & vm
    g = torch.Generator(device="cpu").manual_seed(1)
    lp = (old + (torch.randn(B, L, generator=g) * 0.05).to(device)).clamp(max=0).requires_grad_(True)
    adv = torch.randn(B, generator=g).to(device)
    groups = (torch.arange(B) // 8).to(device)
    rewards = torch.rand(B, generator=g).to(device)
    w_hot, _ = correction_weights("interq", old, rollout, pm, vm, check=False, sync=False)

    def loss_step(weights=None):
        loss, _ = policy_loss(lp, old, adv, eff, weights=weights, check_finite=False)
        loss.backward()
        lp.grad = None

    calls: dict[str, Callable[[], object]] = {
        "interq_weights (checks on)": lambda: interq_weights(old, rollout, pm, vm),
        "interq_weights (checks off)": lambda: interq_weights(old, rollout, pm, vm, check=False),
        "correction_weights interq (hot path: check=False, sync=False)":
            lambda: correction_weights("interq", old, rollout, pm, vm, check=False, sync=False),
        "tis_weights": lambda: tis_weights(old, rollout, pm, vm),
        "policy_loss fwd+bwd": loss_step,
        "policy_loss fwd+bwd with InterQ weights": lambda: loss_step(w_hot),
        "live checks batch_values": lambda: batch_values(old, rollout, eff, group_ids=groups, rewards=rewards),
    }
    for arm in CORRECTIONS:
        calls[f"correction_weights {arm} (hot path)"] = (
            lambda arm=arm: correction_weights(arm, old, rollout, pm, vm, check=False, sync=False))
    verl_tis = _verl_token_tis()
    if verl_tis is not None:
        rm = eff.to(torch.float32)
        calls["verl token TIS (float32 response_mask)"] = (
            lambda: verl_tis(old - rollout, rm, rollout_is="token", rollout_is_threshold=2.0))
        try:
            import creditlab.integrations.verl as cv

            calls["verl creditlab_ppo loss fwd"] = lambda: cv.compute_policy_loss_creditlab(
                old, lp, adv[:, None].expand_as(old), eff, config={"clip_ratio": 0.2}, rollout_is_weights=w_hot)
        except Exception as err:  # noqa: BLE001 - reported, not fatal
            calls["verl creditlab_ppo loss fwd (not loaded)"] = None
            print(f"gpu_check: creditlab.integrations.verl not loaded: {err}", file=sys.stderr)
    return {k: v for k, v in calls.items() if v is not None}


#: the calls whose host syncs must be 0 (the trainers' hot paths)
HOT = ("correction_weights", "policy_loss", "live checks", "verl creditlab_ppo")
#: the timing table: (row, call) with the ratio to verl's token TIS
TIMED = ("interq_weights (checks on)", "interq_weights (checks off)",
         "correction_weights interq (hot path: check=False, sync=False)", "tis_weights", "policy_loss fwd+bwd",
         "policy_loss fwd+bwd with InterQ weights", "verl token TIS (float32 response_mask)")


def time_calls(device: str, B: int, L: int, segments: int, repeat: int) -> list[dict]:
    calls = hot_path_calls(device, B, L, segments)
    t = timeit({k: calls[k] for k in TIMED if k in calls}, device, repeat)
    verl = t.get("verl token TIS (float32 response_mask)")
    return [{"call": k, "ms": v * 1e3, "x_verl_token_tis": None if verl is None else v / verl} for k, v in t.items()]


def count_syncs(device: str, B: int, L: int, segments: int) -> list[dict]:
    """Synchronizing CUDA calls per call, with the lines that made them (CUDA only)."""
    import torch

    calls = hot_path_calls(device, B, L, segments)
    out = []
    for name, fn in calls.items():
        fn()  # warm-up: lazy initialisation is not the hot path
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        hits = [w for w in caught if "synchroniz" in str(w.message)]
        out.append({"call": name, "syncs": len(hits), "hot_path": name.startswith(HOT),
                    "where": sorted({f"{w.filename}:{w.lineno}" for w in hits})[:20]})
    return out


# --------------------------------------------------------------------------------------------
# the run


class Steps:
    """Runs the steps within the budget and collects their status for summary.md."""

    def __init__(self, out: Path, budget: float):
        self.out, self.deadline, self.rows = out, time.monotonic() + budget, []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, limit: float, fn: Callable[[float], str]) -> None:
        timeout = min(limit, self.left())
        if timeout < 10:
            self.rows.append((name, "not run", f"the budget is spent ({self.left():.0f} s left)", 0.0))
            return
        t0 = time.monotonic()
        try:
            status = fn(timeout)
            ok = "ok" if not status.startswith("FAILED") else "FAILED"
        except Exception as err:  # noqa: BLE001 - one failed step does not stop the others
            status, ok = f"FAILED: {type(err).__name__}: {err}", "FAILED"
        self.rows.append((name, ok, status, time.monotonic() - t0))
        print(f"gpu_check: {name}: {ok} ({time.monotonic() - t0:.0f} s) {status}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False): run it on a machine with a GPU",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"gpu_check: {out} is not empty: give a new folder", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    import creditlab

    env = {"started": started, "gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
           "torch": torch.__version__, "creditlab": creditlab.__version__, "python": platform.python_version(),
           "git": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(), "shapes": SHAPES, "repeat": args.repeat}
    for lib in ("verl", "trl", "transformers"):
        try:
            env[lib] = __import__(lib).__version__
        except Exception:  # noqa: BLE001
            env[lib] = None
    (out / "env.json").write_text(json.dumps(env, indent=1))
    steps = Steps(out, args.budget)
    device = "cuda"

    def core(timeout: float) -> str:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_core_cuda.py",
                            f"--junitxml={out / 'core_cuda.xml'}"], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "CREDITLAB_TEST_DEVICE": "cuda"}, timeout=timeout)
        (out / "core_cuda.txt").write_text(r.stdout + r.stderr)
        last = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
        return last if r.returncode == 0 else f"FAILED (exit {r.returncode}): {last}"

    def timings(timeout: float) -> str:
        rows = time_calls(device, SHAPES["B"], SHAPES["L"], SHAPES["segments"], args.repeat)
        (out / "timings.json").write_text(json.dumps(rows, indent=1))
        lines = [f"| call | ms (best of {args.repeat}) | / verl token TIS |", "|---|---|---|"]
        lines += [f"| {r['call']} | {r['ms']:.3f} | "
                  f"{'-' if r['x_verl_token_tis'] is None else format(r['x_verl_token_tis'], '.2f')} |" for r in rows]
        (out / "timings.md").write_text("\n".join(lines) + "\n")
        return "; ".join(f"{r['call']}: {r['ms']:.2f} ms" for r in rows[:3])

    def syncs(timeout: float) -> str:
        rows = count_syncs(device, SHAPES["B"], SHAPES["L"], SHAPES["segments"])
        (out / "syncs.json").write_text(json.dumps(rows, indent=1))
        bad = [r["call"] for r in rows if r["hot_path"] and r["syncs"]]
        return (f"FAILED: host syncs on the hot path: {bad}" if bad
                else f"0 on every hot-path call ({sum(r['hot_path'] for r in rows)} calls)")

    def trl(timeout: float) -> str:
        r = subprocess.run([sys.executable, str(ROOT / "examples" / "trl" / "grpo_creditlab.py"), "--tiny", "--device",
                            "cuda", "--steps", str(args.steps), "--output-dir", str(out / "trl")], cwd=ROOT,
                           capture_output=True, text=True, timeout=timeout)
        (out / "trl.txt").write_text(r.stdout + r.stderr)
        report = out / "trl" / "diagnose" / "diagnose.json"
        if not report.exists():
            return f"FAILED (exit {r.returncode}): no diagnose report; see trl.txt"
        code = json.loads(report.read_text())["exit_code"]
        return f"{args.steps} GRPO steps on the GPU, creditlab diagnose exit code {code}"

    steps.run("core suite on the device (tests/test_core_cuda.py)", 200, core)
    steps.run("timings at bench_correction's shapes", 120, timings)
    steps.run("host syncs on the hot path", 60, syncs)
    steps.run("TRL GRPO steps with InterQ-RL on the GPU", 150, trl)
    lines = [f"# GPU check, {env['gpu']}, {started}", "",
             f"torch {env['torch']} (CUDA {env['cuda']}), creditlab {env['creditlab']}, verl {env['verl']}, "
             f"TRL {env['trl']}, commit {env['git'][:12]}", "",
             "| step | status | result | seconds |", "|---|---|---|---|"]
    lines += [f"| {n} | {ok} | {msg} | {s:.0f} |" for n, ok, msg, s in steps.rows]
    if (out / "timings.md").exists():
        lines += ["", "## Timings", "", (out / "timings.md").read_text()]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print(f"gpu_check: wrote {out / 'summary.md'}")
    return 0 if all(ok == "ok" for _, ok, _, _ in steps.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
