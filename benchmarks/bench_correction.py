"""Speed and memory of the InterQ-RL correction, measured side by side in one run.

    python benchmarks/bench_correction.py            # B=64, L=8192, ~32 segments per row
    python benchmarks/bench_correction.py --quick    # B=8, L=2048: a smaller measurement
    python benchmarks/bench_correction.py --smoke    # tiny sizes, seconds: runs every figure's code (its
                                                     # numbers say nothing about speed)

A size given as an option (``--B``, ``--L``, ``--segments``, ``--repeat``) wins over ``--quick``'s and
``--smoke``'s; an option out of its range is refused in one line (exit code 2).

Prints six figures:

1. vectorised ``interq_weights`` vs the loop reference of ``tests/reference`` (target >= 50x);
   the loop runs on the whole batch unless ``--loop-rows`` limits it (then its time is scaled
   linearly to the full batch, and the output says so).
2. ``interq_weights`` vs one forward+backward of ``policy_loss`` on the same tensors
   (target: ratio <= 1, the correction costs no more than the loss it reweights).
3. time per token at L = 2k, 4k, 8k, 16k (target: flat, i.e. linear time).
4. peak extra memory of ``interq_weights`` as a multiple of its input tensors (target <= 8x),
   counted exactly: a dispatch mode records the bytes of every tensor storage created by an
   aten op during the call and frees them when the last tensor using them dies; the peak of
   live bytes is reported (temporary buffers internal to a single aten kernel are not seen).
5. what a trainer integration pays per batch for an arm and its diagnostics: ``correction_weights``
   (one InterQ pass shared with ``mismatch_metrics``) vs ``interq_weights`` then ``mismatch_metrics``
   (two passes, what the integrations did before); target: ratio < 1.
6. ``interq_weights`` against verl's token TIS (``rollout_corr_helper.compute_rollout_correction_weights``
   of the installed verl, ``rollout_is="token"``, on ``old - rollout``, the log ratio computed inside the
   timed call as verl does; the ratios are against verl with a float32 ``response_mask``, its fastest:
   verl's own int64 mask is timed beside it), interleaved in one run, with creditlab's
   input checks on (the default) and off (``check=False``), and creditlab's ``tis_weights`` beside them;
   target: InterQ with the checks on <= 1.0x verl's token TIS. Then the same with fewer policy tokens
   (blocks of actions turned into tool outputs): InterQ packs the policy tokens, verl's TIS works on all.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _common import integer  # noqa: E402
from _common import parser as bench_parser  # noqa: E402

from creditlab.core.correction import (  # noqa: E402
    correction_weights,
    interq_weights,
    mismatch_metrics,
    tis_weights,
)
from creditlab.core.losses import policy_loss  # noqa: E402
from reference.ref_correction import ref_interq  # noqa: E402


def tune_malloc() -> str:
    """Keep freed memory in the process (glibc): every benchmarked call then reuses warm pages.

    Without this, glibc returns large freed blocks to the OS and the next call page-faults them
    back in; in a virtual machine a page fault costs microseconds, so a kernel that allocates a
    few 4 MiB temporaries spends most of its time faulting (GPU trainers never see this: the
    CUDA caching allocator keeps its blocks). Applied to every function timed here alike.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return "malloc not tuned (no glibc)"
    ok = libc.mallopt(-3, 32 * 2**20) and libc.mallopt(-1, 2**30)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    return "glibc malloc tuned (mmap threshold 32 MiB, trim threshold 1 GiB)" if ok else "mallopt failed"


def make_batch(B: int, L: int, n_segments: int, seed: int = 0):
    """Agent rollouts: a prompt, then ~n_segments actions separated by tool outputs, then padding.

    Both log-probs are valid (<= 0): the learner's are uniform in [-3, 0], the engine's differ by a
    small noise plus rare larger jumps, and are capped at 0 (a log-prob above 0 is refused by the
    input checks)."""
    g = torch.Generator().manual_seed(seed)
    pm = torch.zeros(B, L, dtype=torch.bool)
    vm = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):  # setup only, not timed
        valid = L - int(torch.randint(0, L // 8 + 1, (1,), generator=g))
        vm[b, :valid] = True
        prompt = min(128, valid // 4)
        cuts = torch.sort(torch.randint(prompt, max(valid, prompt + 1), (2 * n_segments,), generator=g)).values
        for k in range(0, 2 * n_segments, 2):
            pm[b, int(cuts[k]):int(cuts[k + 1])] = True
    old = -torch.rand(B, L, generator=g) * 3.0
    delta = torch.randn(B, L, generator=g) * 0.02 + (torch.rand(B, L, generator=g) < 0.01) * 0.3
    rollout = (old - delta).clamp(max=0.0)
    return old, rollout, pm, vm


def timeit(fns: dict, repeat: int = 5, warmup: int = 1) -> dict[str, float]:
    """Best (minimum) wall time of each function, the functions interleaved round by round.

    Interleaving and the minimum make the comparison robust on a shared, busy machine: the
    functions being compared see the same background load, and the minimum is the run least
    disturbed by it.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: min(ts) for name, ts in times.items()}


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created by aten ops inside the mode and still alive."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.refs: dict[int, list[int]] = {}  # storage data_ptr -> [tracked tensors alive, nbytes]

    def _release(self, key: int) -> None:
        entry = self.refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in self.refs:
                self.refs[key][0] += 1
            elif key in inputs or st.nbytes() == 0:
                continue  # a view of (or in-place on) a tensor created outside the mode
            else:
                self.refs[key] = [1, st.nbytes()]
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, key)
        return out


#: sizes of a full run, of --quick and of --smoke (a size given on the command line wins over each)
FULL = {"B": 64, "L": 8192, "segments": 32, "repeat": 10}
QUICK = {**FULL, "B": 8, "L": 2048, "repeat": 3}
SMOKE = {"B": 4, "L": 256, "segments": 4, "repeat": 1}


def parser() -> argparse.ArgumentParser:
    ap = bench_parser(__doc__.splitlines()[0])
    ap.add_argument("--B", type=integer(1), help=f"rows (default {FULL['B']}; --quick {QUICK['B']}; --smoke "
                                                 f"{SMOKE['B']})")
    ap.add_argument("--L", type=integer(64), help=f"tokens per row (default {FULL['L']}; --quick {QUICK['L']}; "
                                                 f"--smoke {SMOKE['L']})")
    ap.add_argument("--segments", type=integer(1), help=f"actions per row, about (default {FULL['segments']}; "
                                                        f"--smoke {SMOKE['segments']})")
    ap.add_argument("--loop-rows", type=integer(1), default=None,
                    help="rows the loop reference runs on (default: all); its time is scaled to B rows")
    ap.add_argument("--repeat", type=integer(1), help=f"timings, the best kept (default {FULL['repeat']}; --quick "
                                                      f"{QUICK['repeat']}; --smoke {SMOKE['repeat']})")
    ap.add_argument("--threads", type=integer(1), default=1,
                    help="torch intra-op threads (1 keeps timings stable on a shared machine)")
    ap.add_argument("--no-malloc-tune", action="store_true", help="measure with the default glibc malloc")
    ap.add_argument("--quick", action="store_true", help="B=8, L=2048, best of 3")
    return ap


def sizes(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the sizes of the preset (--quick, --smoke, or a full run) where none was given;
    --quick with --smoke is refused in one line."""
    if args.quick and args.smoke:
        ap.error("--quick and --smoke are two presets of the sizes: give one (sizes given as options win over it)")
    for k, v in (SMOKE if args.smoke else QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    ap = parser()
    args = sizes(ap, ap.parse_args(argv))
    sys.stdout.reconfigure(line_buffering=True)
    torch.set_num_threads(args.threads)
    malloc = "default glibc malloc" if args.no_malloc_tune else tune_malloc()
    B, L = args.B, args.L
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device cpu, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {malloc}; "
          f"times are the best of {args.repeat}")
    old, rollout, pm, vm = make_batch(B, L, args.segments)
    eff = pm & vm
    if not eff.any():
        ap.error(f"--B {B} --L {L} --segments {args.segments}: the batch holds no policy token; give more rows, "
                 "tokens or segments")
    n_seg = int((eff[:, 1:] & ~eff[:, :-1]).sum() + eff[:, 0].sum())
    print(f"batch B={B} L={L}: {int(eff.sum())} policy tokens, {n_seg} segments ({n_seg / B:.1f} per row)")

    # 1. vectorised vs loop reference (the loop gets its natural input, Python lists)
    r = B if args.loop_rows is None else min(args.loop_rows, B)
    lists = (old[:r].double().tolist(), rollout[:r].double().tolist(), eff[:r].tolist())
    box = {}
    # timed apart, not interleaved: the loop's millions of Python objects evict the caches the
    # vectorised call would otherwise see warm
    t_vec = timeit({"vec": lambda: interq_weights(old, rollout, pm, vm)}, repeat=args.repeat)["vec"]
    t_loop_rows = timeit({"loop": lambda: box.__setitem__("w", ref_interq(*lists)[0])}, repeat=2, warmup=0)["loop"]
    t_loop = t_loop_rows * B / r
    w_sub, _ = interq_weights(old[:r], rollout[:r], pm[:r], vm[:r])
    w_ref = torch.tensor(box["w"], dtype=torch.float64)
    rel = ((w_sub.double() - w_ref).abs() / w_ref).max().item()
    scaled = f", scaled from {r} rows ({t_loop_rows:.2f} s)" if r < B else ""
    print(f"[1] interq_weights {t_vec * 1e3:8.1f} ms | loop reference {t_loop:8.2f} s{scaled} | "
          f"speed-up {t_loop / t_vec:5.0f}x (target >= 50x) | max relative diff (float32 vs float64 loop) {rel:.1e}")

    # 2. correction vs one forward+backward of the loss it reweights
    logprobs = (old + torch.randn(B, L, generator=torch.Generator().manual_seed(1)) * 0.05).requires_grad_(True)
    adv = torch.randn(B)

    def loss_step():
        loss, _ = policy_loss(logprobs, old, adv, eff)
        loss.backward()
        logprobs.grad = None

    def weighted_step():
        w, _ = interq_weights(old, rollout, pm, vm)
        loss, _ = policy_loss(logprobs, old, adv, eff, weights=w)
        loss.backward()
        logprobs.grad = None

    t = timeit({"loss": loss_step, "interq": lambda: interq_weights(old, rollout, pm, vm),
                "both": weighted_step}, repeat=args.repeat)
    print(f"[2] policy_loss fwd+bwd {t['loss'] * 1e3:8.1f} ms | interq_weights {t['interq'] * 1e3:8.1f} ms | "
          f"ratio {t['interq'] / t['loss']:5.2f} (target <= 1) | "
          f"weights + weighted loss fwd+bwd {t['both'] * 1e3:.1f} ms")

    # 3. linear scaling in L
    lengths = [64, 128, 256] if args.smoke else [512, 1024, 2048] if args.quick else [2048, 4096, 8192, 16384]
    per_token = []
    for Lk in lengths:
        o, ro, p, v = make_batch(B, Lk, max(1, args.segments * Lk // L), seed=2)
        tk = timeit({"k": lambda o=o, ro=ro, p=p, v=v: interq_weights(o, ro, p, v)}, repeat=args.repeat)["k"]
        per_token.append(tk / (B * Lk))
        print(f"[3] L={Lk:6d}: {tk * 1e3:8.1f} ms, {tk / (B * Lk) * 1e9:6.1f} ns/token")
    print(f"[3] time per token at L={lengths[-1]} / at L={lengths[0]}: {per_token[-1] / per_token[0]:.2f} "
          "(target ~1: linear)")

    # 4. peak extra memory
    input_bytes = sum(x.numel() * x.element_size() for x in (old, rollout, pm, vm))
    with LiveBytes() as mode:
        w, _ = interq_weights(old, rollout, pm, vm)
    out_bytes = w.numel() * w.element_size()
    print(f"[4] inputs {input_bytes / 2**20:.1f} MiB (float32 log-probs + two bool masks) | peak extra "
          f"{mode.peak / 2**20:.1f} MiB = {mode.peak / input_bytes:.2f}x inputs (target <= 8x; includes the "
          f"{out_bytes / 2**20:.1f} MiB float32 output)")

    # 5. an arm and its diagnostics, as the trainer integrations compute them once per batch
    t = timeit({"shared": lambda: correction_weights("interq", old, rollout, pm, vm),
                "separate": lambda: (interq_weights(old, rollout, pm, vm), mismatch_metrics(old, rollout, pm, vm))},
               repeat=args.repeat)
    print(f"[5] correction_weights (one InterQ pass) {t['shared'] * 1e3:8.1f} ms | interq_weights + mismatch_metrics "
          f"{t['separate'] * 1e3:8.1f} ms | ratio {t['shared'] / t['separate']:.2f} (target < 1)")

    # 6. against verl's token TIS, side by side, with creditlab's input checks on and off
    verl_tis = _verl_token_tis()
    if verl_tis is None:
        print("[6] verl is not installed (pip install 'creditlab[verl]'): no comparison with verl's token TIS")
        return
    rm_float, rm_int = eff.to(torch.float32), eff.to(torch.int64)
    t = timeit({"verl": lambda: verl_tis(old - rollout, rm_float, rollout_is="token", rollout_is_threshold=2.0),
                "verl_int": lambda: verl_tis(old - rollout, rm_int, rollout_is="token", rollout_is_threshold=2.0),
                "on": lambda: interq_weights(old, rollout, pm, vm),
                "off": lambda: interq_weights(old, rollout, pm, vm, check=False),
                "tis": lambda: tis_weights(old, rollout, pm, vm)}, repeat=args.repeat)
    v = t["verl"]
    print(f"[6] verl token TIS {v * 1e3:8.1f} ms (float32 response_mask; {t['verl_int'] * 1e3:.1f} ms with verl's "
          f"int64 one) | interq_weights checks on {t['on'] * 1e3:8.1f} ms = {t['on'] / v:.2f}x (target <= 1.0) | "
          f"checks off {t['off'] * 1e3:8.1f} ms = {t['off'] / v:.2f}x | creditlab tis_weights {t['tis'] * 1e3:8.1f} ms "
          f"= {t['tis'] / v:.2f}x")
    # InterQ's time follows the policy tokens (it packs them); verl's TIS works on every token. The same
    # batch with whole blocks of L/32 action tokens turned into tool tokens:
    g = torch.Generator().manual_seed(3)
    block = max(1, L // 32)
    for keep in (0.5, 0.25):
        blocks = torch.rand(B, -(-L // block), generator=g) < keep
        p2 = pm & blocks.repeat_interleave(block, 1)[:, :L]
        rm2 = (p2 & vm).to(torch.float32)
        if not rm2.any():  # a tiny batch (--B, --L) can lose all its policy tokens here
            print(f"[6] with {keep:.0%} of the blocks kept no policy token is left at B={B} L={L}: not timed")
            continue
        t = timeit({"verl": lambda rm2=rm2: verl_tis(old - rollout, rm2, rollout_is="token", rollout_is_threshold=2.0),
                    "on": lambda p2=p2: interq_weights(old, rollout, p2, vm)}, repeat=args.repeat)
        print(f"[6] with {float(rm2.mean()) * 100:.0f}% policy tokens: verl token TIS {t['verl'] * 1e3:8.1f} ms | "
              f"interq_weights checks on {t['on'] * 1e3:8.1f} ms = {t['on'] / t['verl']:.2f}x")


def _verl_token_tis():
    """verl's own ``compute_rollout_correction_weights`` (unwrapped if creditlab's verl integration is
    loaded), or None without verl."""
    try:
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
    except ImportError:
        return None
    return getattr(compute_rollout_correction_weights, "__creditlab_original__", compute_rollout_correction_weights)


if __name__ == "__main__":
    main()
