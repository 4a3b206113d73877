"""Speed and memory of the InterQ-RL correction, measured side by side in one run.

    python benchmarks/bench_correction.py            # B=64, L=8192, ~32 segments per row
    python benchmarks/bench_correction.py --quick    # smaller, for a smoke run

Prints four figures:

1. vectorised ``interq_weights`` vs the loop reference of ``tests/reference`` (target >= 50x);
   the loop runs on ``--loop-rows`` rows and its time is scaled linearly to the full batch.
2. ``interq_weights`` vs one forward+backward of ``policy_loss`` on the same tensors
   (target: ratio <= 1, the correction costs no more than the loss it reweights).
3. time per token at L = 2k, 4k, 8k, 16k (target: flat, i.e. linear time).
4. peak extra memory of ``interq_weights`` as a multiple of its input tensors (target <= 8x),
   counted exactly: a dispatch mode records the bytes of every tensor storage created by an
   aten op during the call and frees them when the last tensor using them dies; the peak of
   live bytes is reported (temporary buffers internal to a single aten kernel are not seen).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from creditlab.core.correction import interq_weights  # noqa: E402
from creditlab.core.losses import policy_loss  # noqa: E402
from reference.ref_correction import ref_interq  # noqa: E402


def make_batch(B: int, L: int, n_segments: int, seed: int = 0):
    """Agent rollouts: a prompt, then ~n_segments actions separated by tool outputs, then padding."""
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
    rollout = old - delta
    return old, rollout, pm, vm


def timeit(fn, repeat: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--B", type=int, default=64)
    parser.add_argument("--L", type=int, default=8192)
    parser.add_argument("--segments", type=int, default=32)
    parser.add_argument("--loop-rows", type=int, default=8, help="rows the loop reference runs on")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1 keeps timings stable on a shared machine)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.B, args.L, args.loop_rows, args.repeat = 8, 2048, 2, 3
    B, L = args.B, args.L
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device cpu")
    old, rollout, pm, vm = make_batch(B, L, args.segments)
    eff = pm & vm
    n_seg = int((eff[:, 1:] & ~eff[:, :-1]).sum() + eff[:, 0].sum())
    print(f"batch B={B} L={L}: {int(eff.sum())} policy tokens, {n_seg} segments ({n_seg / B:.1f} per row)")

    # 1. vectorised vs loop reference
    t_vec = timeit(lambda: interq_weights(old, rollout, pm, vm), repeat=args.repeat)
    r = min(args.loop_rows, B)
    lists = (old[:r].double().tolist(), rollout[:r].double().tolist(), eff[:r].tolist())
    t0 = time.perf_counter()
    w_ref = ref_interq(*lists)[0]
    t_loop_rows = time.perf_counter() - t0
    t_loop = t_loop_rows * B / r
    w_sub, _ = interq_weights(old[:r], rollout[:r], pm[:r], vm[:r])
    err = (w_sub.double() - torch.tensor(w_ref, dtype=torch.float64)).abs().max().item()
    scaled = f", scaled from {r} rows ({t_loop_rows:.2f} s)" if r < B else ""
    print(f"[1] interq_weights {t_vec * 1e3:8.1f} ms | loop reference {t_loop:8.2f} s{scaled} | "
          f"speed-up {t_loop / t_vec:7.0f}x (target >= 50x) | max |diff| on those rows {err:.1e}")

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

    t_loss = timeit(loss_step, repeat=args.repeat)
    t_both = timeit(weighted_step, repeat=args.repeat)
    print(f"[2] policy_loss fwd+bwd {t_loss * 1e3:8.1f} ms | interq_weights {t_vec * 1e3:8.1f} ms | "
          f"ratio {t_vec / t_loss:5.2f} (target <= 1) | weighted step {t_both * 1e3:.1f} ms")

    # 3. linear scaling in L
    lengths = [512, 1024, 2048] if args.quick else [2048, 4096, 8192, 16384]
    per_token = []
    for Lk in lengths:
        o, ro, p, v = make_batch(B, Lk, max(1, args.segments * Lk // L), seed=2)
        tk = timeit(lambda o=o, ro=ro, p=p, v=v: interq_weights(o, ro, p, v), repeat=args.repeat)
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


if __name__ == "__main__":
    main()
