"""Speed of the toolshop agent engine: rollout tokens/s and seconds per GRPO update.

Target (issue): 256 rollouts of up to 160 tokens per update, 100 updates in under 10 minutes on
2 CPU cores, i.e. under 6 s per update. Run:

    python benchmarks/bench_toolshop.py [--updates 3] [--threads 2] [--random-init]
    python benchmarks/bench_toolshop.py --smoke     # every measurement on tiny sizes, seconds

It measures, side by side in one run, the fp32 engine + fp32 learner and the FP8 (W8A8-KV8) engine
+ QAT learner, from the cached base policy (trained on first use, which it says before it starts and
then shows with steps and an ETA; cached under $CREDITLAB_CACHE or the user cache directory) or a
random init.

``--smoke``: the same measurements on 4 tasks x 2 rollouts of at most 64 tokens, one update, one
thread, from a tiny base policy built in a temporary cache directory: the code paths, not the speed.

Each figure also comes as achieved FLOP/s against the fp32 matmul peak measured in the same run on
the same threads ("x% of peak"); FLOPs counted are the model's matmuls only (the formula of
``bench_mismatch.FLOP_FORMULA``: 2 x matmul weights x tokens plus attention scores and values,
backward = 2x forward); fake quantization and the environment count as time, not as FLOPs.
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

import torch  # noqa: E402
from _common import cache_dir, integer, line_buffered, load_base, smoke_base
from _common import parser as bench_parser
from bench_mismatch import FLOP_FORMULA, decode_flops, forward_flops, matmul_peak, pct

from creditlab.envs.toolshop import VOCAB
from creditlab.models.tiny_lm import TinyLM
from creditlab.train.toolshop_base import BaseConfig
from creditlab.train.toolshop_grpo import GRPOConfig, train_grpo
from creditlab.train.toolshop_rollout import make_tasks, rollout


def _train_counted(model: TinyLM, cfg: GRPOConfig) -> tuple[list[dict], tuple[float, float]]:
    """``train_grpo``'s rows and the mean matmul FLOPs per update of its rollout and of its learner
    (old log-probs: one forward; each epoch: forward + backward of every row)."""
    shapes = []
    rows = train_grpo(model, cfg, on_rollouts=lambda k, batch, rewards, old: shapes.append(tuple(batch.tokens.shape)))
    roll = sum(decode_flops(model.cfg, B, L - 1) for B, L in shapes) / len(shapes)
    learn = sum((1 + 3 * cfg.epochs) * forward_flops(model.cfg, B, L) for B, L in shapes) / len(shapes)
    return rows, (roll, learn)


def parser() -> argparse.ArgumentParser:
    ap = bench_parser(__doc__)
    ap.add_argument("--updates", type=integer(1), default=None, help="updates per arm (default 3; --smoke: 1)")
    ap.add_argument("--threads", type=integer(1), default=None,
                    help="torch threads (default 2; --smoke: 1, where tiny ops on two busy threads mostly wait)")
    ap.add_argument("--random-init", action="store_true")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    line_buffered()
    with ExitStack() as stack:
        run(args, cache_dir(args.smoke, stack))


def run(args, cache: str) -> None:
    smoke = args.smoke
    updates = args.updates or (1 if smoke else 3)
    threads = args.threads or (1 if smoke else 2)
    # tasks x rollouts per task, rollout budget (the speed target's: 32 x 8 rollouts of up to 160 tokens)
    n_tasks, group, max_len = (4, 2, 64) if smoke else (32, 8, 160)
    torch.set_num_threads(1)
    peak1 = matmul_peak(3 if smoke else 20)
    torch.set_num_threads(threads)
    peak = max(matmul_peak(3 if smoke else 20), peak1)  # on shared cores more threads can measure less than one
    load = os.getloadavg()
    if smoke:
        print("--smoke: tiny sizes, the figures below say nothing about speed")
    print(f"matmul peak (40320x64 @ 64x64, fp32): {peak1 / 1e9:.0f} GFLOP/s on 1 thread, {peak / 1e9:.0f} on "
          f"{threads} (the reference of 'x% of peak'); load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}\n{FLOP_FORMULA}")
    bcfg = smoke_base(BaseConfig()) if smoke else BaseConfig()
    if args.random_init:
        model = TinyLM(bcfg.model_config(), generator=torch.Generator().manual_seed(0))
    else:
        t0 = time.perf_counter()
        model = load_base(bcfg, cache, "toolshop base policy")
        print(f"base policy ready in {time.perf_counter() - t0:.1f} s (cached after the first run)")
    print(f"threads={threads}, vocab={len(VOCAB)}, params={sum(p.numel() for p in model.parameters())}")
    tasks = [t for t in make_tasks(range(n_tasks), bcfg.chain_lengths) for _ in range(group)]
    for prec in ("fp32", "bf16", "fp8", "int8"):
        rollout(model, tasks[:16], precision=prec, max_len=max_len)  # warm-up
        t0 = time.perf_counter()
        b = rollout(model, tasks, precision=prec, max_len=max_len, generator=torch.Generator().manual_seed(0))
        dt = time.perf_counter() - t0
        n = int(b.valid_mask.sum())
        fl = decode_flops(model.cfg, len(tasks), b.tokens.size(1) - 1)
        print(f"rollout {prec:5s}: {len(tasks)} rollouts, {n} tokens (longest {b.tokens.size(1)}), {dt:.2f} s, "
              f"{n / dt:,.0f} tokens/s, success {float(b.success.mean()):.2f}, {pct(fl, dt, peak)}")
    res = {}
    arms = (("fp32 engine / fp32 learner", "fp32", "fp32"), ("fp8 engine / QAT learner", "fp8", "fp8"))
    grpo = GRPOConfig(updates=updates, tasks_per_update=n_tasks, group_size=group, max_len=max_len)
    for name, rp, lp in arms:
        m = TinyLM(model.cfg)
        m.load_state_dict(model.state_dict())
        cfg = replace(grpo, rollout_precision=rp, learner_precision=lp)
        rows, fl = _train_counted(m, cfg)
        per = sum(r["time/update_s"] for r in rows) / len(rows)
        roll = sum(r["time/rollout_s"] for r in rows) / len(rows)
        res[name] = per
        print(f"update {name}: {per:.2f} s/update (rollout {roll:.2f} s, {pct(fl[0], roll, peak)}; learner "
              f"{per - roll:.2f} s, {pct(fl[1], per - roll, peak)}), 100 updates ~ {100 * per / 60:.1f} min")
    a, b = res.values()
    print(f"ratio fp8+QAT / fp32 seconds per update: {b / a:.2f}")
    # Worst case: every rollout runs the full budget (an untrained policy on C=8 tasks with a
    # large action budget never writes), the size the speed target is stated at.
    rnd = TinyLM(bcfg.model_config(), generator=torch.Generator().manual_seed(0))
    long_tasks = [t for t in make_tasks(range(n_tasks), (8,)) for _ in range(group)]
    for prec in ("fp32", "fp8"):
        t0 = time.perf_counter()
        b = rollout(rnd, long_tasks, precision=prec, max_len=max_len, max_turns=60,
                    generator=torch.Generator().manual_seed(0))
        dt = time.perf_counter() - t0
        n = int(b.valid_mask.sum())
        fl = decode_flops(rnd.cfg, len(long_tasks), b.tokens.size(1) - 1)
        print(f"full-length rollout {prec:5s}: {n} tokens (longest {b.tokens.size(1)}), {dt:.2f} s, "
              f"{n / dt:,.0f} tokens/s, {pct(fl, dt, peak)}")
    for rp, lp in (("fp32", "fp32"), ("fp8", "fp8")):
        cfg = replace(grpo, max_turns=60, chain_lengths=(8,), rollout_precision=rp, learner_precision=lp)
        m = TinyLM(rnd.cfg)
        m.load_state_dict(rnd.state_dict())
        rows, fl = _train_counted(m, cfg)
        per = sum(r["time/update_s"] for r in rows) / len(rows)
        print(f"full-length update {rp} engine / {lp} learner: {per:.2f} s/update ({pct(sum(fl), per, peak)}) "
              f"({rows[-1]['episode/length']:.0f} tokens per rollout), "
              f"100 updates ~ {100 * per / 60:.1f} min")


if __name__ == "__main__":
    main()
