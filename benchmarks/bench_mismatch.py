"""Where the mismatch lab's time goes, and what stacking the arms into one program buys.

Run (one torch thread, as each lab worker):

    python benchmarks/bench_mismatch.py [--dose nvfp4] [--updates 3] [--batch-tasks 8]
    python benchmarks/bench_mismatch.py --smoke     # every section on tiny sizes, seconds

Side by side in one run, from the lab's cached base policy (built on first use: it says so, then prints
the build's steps with an ETA; the lab's base is 3000 steps, tens of minutes on 2 cores):

1. a GRPO update of the seven quantized arms of one seed as one stack, split into rollout (the
   engine's decode steps), learner log-probs, correction weights and metrics, and optimisation;
2. the share of quantization: one learner forward of the same tokens in fp32 and in each
   precision, one decode step likewise;
3. the same updates run one arm at a time (seven stacks of one model): the speed-up of stacking;
4. the estimated wall time of the full lab at one dose (3 seeds) with 1 and 2 workers.

Each phase is also given as achieved FLOP/s against the matmul peak of one thread measured in the
same run (:func:`matmul_peak`), "x% of peak". FLOPs counted are the model's matmuls only
(:data:`FLOP_FORMULA`); fake quantization, the environment and the optimizer count as time, not as
FLOPs.

``--smoke`` runs every section on tiny sizes in seconds (a base policy of a few steps and a one-layer
model built in a temporary cache directory, 2 tasks x 2 rollouts, 96-token rollouts, 4 held-out tasks,
decode steps at position 40, one update): the code paths, not the speed.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import replace

# as the creditlab command runs (cli/_process.py): PyTorch reads it at its first large allocation
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import cache_dir, integer, line_buffered, load_base, smoke_base  # noqa: E402
from _common import parser as bench_parser  # noqa: E402

from creditlab.labs.mismatch import DOSES, MismatchConfig, arm_triple  # noqa: E402
from creditlab.models.tiny_lm import StackedTinyLM  # noqa: E402
from creditlab.train.toolshop_grpo import train_grpo_stacked  # noqa: E402
from creditlab.train.toolshop_rollout import make_tasks, rollout_stacked, stacked_logprobs  # noqa: E402

FLOP_FORMULA = ("FLOPs = model matmuls only: 2 x (block linear + LM head weights) x tokens, plus attention scores "
                "and values 2 x 2 x d_model x (causal key positions) per token and layer; backward = 2x forward; "
                "fake quantization, environment, optimizer: time, not FLOPs")


def matmul_peak(reps: int = 20) -> float:
    """FLOP/s of one fp32 matmul ``(40320, 64) @ (64, 64)`` on the current threads (best of ``reps``),
    into a preallocated output: the arithmetic, not the page faults of a fresh 10 MB result (which
    without huge pages cost more than the product itself)."""
    a, b, c = torch.randn(40320, 64), torch.randn(64, 64), torch.empty(40320, 64)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return 2 * 40320 * 64 * 64 / best


def copy_bandwidth(reps: int = 10) -> float:
    """Bytes/s of one copy of a 64 MiB fp32 tensor into a preallocated one (read + write), best of ``reps``:
    the memory roofline of a pass that streams its operands."""
    a, b = torch.randn(16 << 20), torch.empty(16 << 20)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 4 / best


def kv_read_bytes(cfg, rows: int, pos: int) -> float:
    """Bytes of keys and values one decode step at position ``pos`` reads from the KV cache (fp32)."""
    return 2 * cfg.n_layer * rows * cfg.d_model * pos * 4


def _matmul_params(cfg) -> int:
    d = cfg.d_model
    return cfg.n_layer * (3 * d * d + d * d + 2 * cfg.mlp_ratio * d * d) + cfg.vocab_size * d


def forward_flops(cfg, rows: int, length: int) -> float:
    """Matmul FLOPs of a full causal forward of ``rows`` sequences of ``length`` tokens."""
    attn = 4 * cfg.d_model * cfg.n_layer * length * (length + 1) / 2  # scores + values over causal pairs
    return rows * (2 * _matmul_params(cfg) * length + attn)


def decode_flops(cfg, rows: int, steps: int) -> float:
    """Matmul FLOPs of ``steps`` one-token decode steps of ``rows`` rows from position 0."""
    attn = 4 * cfg.d_model * cfg.n_layer * steps * (steps + 1) / 2
    return rows * (2 * _matmul_params(cfg) * steps + attn)


def pct(flops: float, seconds: float, peak: float) -> str:
    return f"{100 * flops / max(seconds, 1e-12) / peak:5.1f}% of peak"


def _configs(cfg: MismatchConfig, arms: list[str], dose: str, updates: int, tasks: int):
    g = replace(cfg.grpo, updates=updates, tasks_per_update=tasks, eval_every=0)
    out = []
    for a in arms:
        e, lp, c = arm_triple(a, dose)
        out.append(replace(g, rollout_precision=e, learner_precision=lp, correction=c, seed=0))
    return out


def _train(base, configs) -> tuple[float, list[dict]]:
    """Wall time and model 0's update rows; each row gets ``shape/L`` (the padded batch length) and
    ``shape/B`` (rows per model)."""
    stack = StackedTinyLM([base] * len(configs))
    shapes: dict[int, tuple[int, int]] = {}

    def seen(k, m, batch, rewards, old):
        shapes[k] = tuple(batch.tokens.shape)

    t0 = time.perf_counter()
    rows = train_grpo_stacked(stack, configs, eval_precision=None, on_rollouts=seen)
    wall = time.perf_counter() - t0
    rows = [r for r in rows[0] if "time/update_s" in r]
    for k, r in enumerate(rows):
        r["shape/B"], r["shape/L"] = shapes[k]
    return wall, rows


#: --smoke: rollouts this long, decode steps timed from this position
SMOKE_LEN, SMOKE_POS = 96, 40


def parser() -> argparse.ArgumentParser:
    ap = bench_parser(__doc__)
    ap.add_argument("--dose", default="nvfp4", choices=DOSES, help="the engine precision of the quantized arms")
    ap.add_argument("--updates", type=integer(1), default=None, help="updates per timing (default 3; --smoke: 1)")
    ap.add_argument("--batch-tasks", type=integer(1), default=None, help="tasks per update (default: the lab's)")
    ap.add_argument("--skip-unstacked", action="store_true", help="skip 3. (the arms one at a time)")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    line_buffered()
    with ExitStack() as stack:
        run(args, cache_dir(args.smoke, stack))


def run(args, cache: str) -> None:
    torch.set_num_threads(1)
    smoke = args.smoke
    updates = args.updates or (1 if smoke else 3)
    peak = matmul_peak(3 if smoke else 20)
    bandwidth = copy_bandwidth(2 if smoke else 10)
    cfg = MismatchConfig()
    pos = 160
    if smoke:
        print("--smoke: tiny sizes, the figures below say nothing about speed")
        cfg = replace(cfg, base=smoke_base(cfg.base),
                      grpo=replace(cfg.grpo, max_len=SMOKE_LEN, tasks_per_update=2, group_size=2, eval_tasks=4))
        pos = SMOKE_POS
    tasks = args.batch_tasks or cfg.grpo.tasks_per_update
    base = load_base(cfg.base, cache, "mismatch base policy")
    load = os.getloadavg()
    print(f"dose {args.dose}, {tasks} tasks x {cfg.grpo.group_size} rollouts per update, {updates} updates, "
          f"1 thread; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    arms = [a for a in cfg.arms if a != "fp32"]  # the lab's default run's quantized arms
    mcfg = base.cfg
    print(f"matmul peak of one thread (40320x64 @ 64x64, fp32): {peak / 1e9:.0f} GFLOP/s; copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s (read + write); THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE')}"
          f"\n{FLOP_FORMULA}")

    # 1. one stack of the seven quantized arms
    wall, rows = _train(base, _configs(cfg, arms, args.dose, updates, tasks))
    parts = {k: float(np.mean([r[f"time/{k}"] for r in rows]))
             for k in ("rollout_s", "old_logprobs_s", "weights_metrics_s", "optimize_s", "update_s")}
    each = ", ".join(f"{r['time/update_s']:.2f}" for r in rows)
    print(f"seconds per update, in order: {each} (the first pays for compiling the fused quantizers, once per process)")
    steps = float(np.mean([r["time/decode_steps"] for r in rows]))
    M, g = len(arms), cfg.grpo
    fl = {"rollout_s": 0.0, "old_logprobs_s": 0.0, "weights_metrics_s": 0.0, "optimize_s": 0.0}
    for r in rows:  # per update, averaged below
        fwd = M * forward_flops(mcfg, r["shape/B"], r["shape/L"])
        fl["rollout_s"] += M * decode_flops(mcfg, r["shape/B"], int(r["time/decode_steps"])) / len(rows)
        fl["old_logprobs_s"] += fwd / len(rows)  # every row's forward once
        # forward + backward (2x) of every row per epoch, less the first minibatch's forward
        fl["optimize_s"] += (g.epochs * 3 * fwd - fwd / g.minibatches) / len(rows)
    fl["update_s"] = sum(fl.values())
    print(f"\n1. one update of {len(arms)} arms as one stack: {parts['update_s']:.2f} s "
          f"({parts['update_s'] / len(arms):.2f} s per arm), {fl['update_s'] / 1e9:.1f} GFLOP, "
          f"{pct(fl['update_s'], parts['update_s'], peak)}")
    per_step = 1000 * parts["rollout_s"] / steps
    for k, label in (("rollout_s", f"rollout ({steps:.0f} decode steps, {per_step:.1f} ms each)"),
                     ("old_logprobs_s", "learner log-probs (first minibatch with grad + the rest)"),
                     ("weights_metrics_s", "correction weights and mismatch metrics"),
                     ("optimize_s", "optimisation (forward + backward of the other minibatches, AdamW)")):
        share = f"{pct(fl[k], parts[k], peak)}" if fl[k] else ""
        print(f"   {label:70s} {parts[k]:6.2f} s  {100 * parts[k] / parts['update_s']:4.0f}%  {share}")

    # 2. quantization's share: the same tokens through the learner and the engine in each precision
    stack = StackedTinyLM([base] * len(arms))
    seeds = list(range(tasks))
    batch_tasks = [t for t in make_tasks(seeds, cfg.grpo.chain_lengths) for _ in range(cfg.grpo.group_size)]
    B = len(batch_tasks)
    u = torch.rand(len(arms), B, cfg.grpo.max_len, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    batch = rollout_stacked(stack, [batch_tasks] * len(arms), u, precision=args.dose, max_len=cfg.grpo.max_len,
                            max_turns=cfg.grpo.max_turns, max_action_len=cfg.grpo.max_action_len)  # the lab's horizon
    print(f"\n2. quantization: learner forward of {len(arms)} x {B} x {batch.tokens.size(-1)} tokens; one decode step "
          f"of {len(arms)} x {B} rows at position {pos}; forward + backward of the same tokens")
    last = batch.tokens.size(-1) - 1  # (a smoke's short rollouts: its last token again)
    base_fwd = None
    for prec in ("fp32", "int8", "fp8", "nvfp4", "mxfp4"):
        with torch.no_grad():
            stacked_logprobs(stack, batch.tokens, prec)
            t0 = time.perf_counter()
            stacked_logprobs(stack, batch.tokens, prec)
            fwd = time.perf_counter() - t0
            kv = stack.init_cache(B, prec, max(cfg.grpo.max_len, pos + 10))
            for t in range(pos):
                stack.step(batch.tokens[:, :, min(t, last)], kv)
            t0 = time.perf_counter()
            for t in range(pos, pos + 10):
                stack.step(batch.tokens[:, :, min(t, last)], kv)
            dec = (time.perf_counter() - t0) / 10
        stack.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        stacked_logprobs(stack, batch.tokens, prec).sum().backward()
        fb = time.perf_counter() - t0
        base_fwd = base_fwd or (fwd, dec, fb)
        f_fwd = len(arms) * forward_flops(mcfg, B, batch.tokens.size(-1))
        f_dec = len(arms) * (decode_flops(mcfg, B, pos + 10) - decode_flops(mcfg, B, pos)) / 10
        kv_bytes = len(arms) * kv_read_bytes(mcfg, B, pos + 5)
        print(f"   {prec:6s} forward {fwd:6.2f} s ({fwd / base_fwd[0]:4.1f}x fp32, {pct(f_fwd, fwd, peak)})   "
              f"decode step {1000 * dec:6.1f} ms ({dec / base_fwd[1]:4.1f}x fp32, {pct(f_dec, dec, peak)}; KV-cache "
              f"reads {kv_bytes / 1e6:.0f} MB, {100 * kv_bytes / dec / bandwidth:4.1f}% of copy bandwidth)   "
              f"forward + backward "
              f"{fb:6.2f} s ({fb / base_fwd[2]:4.1f}x fp32, {pct(3 * f_fwd, fb, peak)})")

    # 3. one arm at a time
    if not args.skip_unstacked:
        t_one = 0.0
        for a in arms:
            w, _ = _train(base, _configs(cfg, [a], args.dose, updates, tasks))
            t_one += w
        print(f"\n3. the same {updates} updates one arm at a time: {t_one:.1f} s, as one stack: {wall:.1f} s; "
              f"stacking is {t_one / wall:.2f}x faster")

    # 4. the full lab at one dose: training updates only (held-out evaluation comes on top)
    g = cfg.grpo
    per_model = parts["update_s"] / len(arms)
    cell = len(arms) * g.updates * per_model
    total = cfg.seeds * cell + cfg.seeds * g.updates * per_model  # + the fp32 cell (cheaper: no quantizer)
    print(f"\n4. training updates of one dose ({cfg.seeds} seeds x {len(cfg.arms)} arms x {g.updates} updates) at this "
          f"speed: about {total / 60:.0f} min with 1 worker, {max(total / 2, cell) / 60:.0f} min with --workers 2")
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
