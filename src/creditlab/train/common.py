"""What every training loop of :mod:`creditlab.train` shares: one torch thread, the seed streams, the optimizer."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch

from creditlab.errors import ConfigError

__all__ = ["adamw", "generator", "seed_stream", "single_thread", "task_rng"]


@contextmanager
def single_thread():
    """Run torch on one intra-op thread inside the block, then restore the setting.

    The trainer's tensors are small (hundreds of models x a few hundred floats each): extra intra-op
    threads only add synchronisation, and on a busy machine OpenMP spin-waiting made a 2-thread run
    8x slower than a 1-thread run (measured: 11.4 s vs 1.4 s for 100 updates of the full C sweep).
    Parallelism comes from running cells in separate processes instead.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------
# seed streams

def _hashed(*parts: object) -> int:
    """A 63-bit seed hashed from the parts (``random.Random("-".join(parts)).getrandbits(63)``)."""
    return random.Random("-".join(map(str, parts))).getrandbits(63)


#: Every derived seed of the trainers and labs: ``kind -> f(*parts)``. The arithmetic is the
#: historical one, so stored numbers do not move; see :func:`seed_stream` for the table.
_STREAMS: dict[str, Callable[..., int]] = {
    "chain/train": lambda seed: int(seed) * 15_485_863 + 3,
    "chain/exposure": lambda seed, C: int(seed) * 7_368_787 + int(C) * 101 + 5,
    "chain/single_update": lambda seed, C: int(seed) * 15_485_863 + int(C) * 7_919 + 11,
    "bag/train": lambda seed: 1_000 + seed,
    "bag/eval_prompts": lambda seed: 2_000_000 + seed,
    "bag/eval_sample": lambda seed, update: 3_000_000 + seed * 1_000 + update,
    "fork/deletion": lambda seed: 4_000_000 + seed,
    "grpo/sampling": lambda seed: seed,
    "grpo/eval": lambda seed: seed + 1,
    "grpo/uniforms": lambda tag, seed, update: _hashed("u", tag, seed, update),
    "grpo/eval_uniforms": lambda: _hashed("eval"),
    "grpo/perm": lambda seed, update: _hashed("perm", seed, update),
    "granularity/eval": lambda: 12345,
    "granularity/teacher": lambda: 54321,
}


def seed_stream(kind: str, *parts: int | str) -> int:
    """The seed of the random stream ``kind`` for ``parts`` (one place for every derived seed).

    =======================  =================  ======================================  ============================
    kind                     parts              seed                                    draws
    =======================  =================  ======================================  ============================
    ``chain/train``          seed               ``seed * 15_485_863 + 3``               chain noise and keys
    ``chain/exposure``       seed, C            ``seed * 7_368_787 + C * 101 + 5``      exposed causal steps
    ``chain/single_update``  seed, C            ``seed * 15_485_863 + C * 7_919 + 11``  single-update rollouts
    ``bag/train``            seed               ``1_000 + seed``                        bag training prompts, samples
    ``bag/eval_prompts``     seed               ``2_000_000 + seed``                    fixed evaluation prompts
    ``bag/eval_sample``      seed, update       ``3_000_000 + seed * 1_000 + update``   one evaluation's samples
    ``fork/deletion``        seed               ``4_000_000 + seed``                    fork deletion-curve samples
    ``grpo/sampling``        seed               ``seed``                                GRPO/OPSD samples, minibatches
    ``grpo/eval``            seed               ``seed + 1``                            train_grpo's evaluation
    ``grpo/uniforms``        tag, seed, update  hashed ``u-tag-seed-update``            stacked sampling uniforms
    ``grpo/eval_uniforms``   (none)             hashed ``eval``                         stacked evaluation uniforms
    ``grpo/perm``            seed, update       hashed ``perm-seed-update``             stacked minibatch order
    ``granularity/eval``     (none)             ``12345``                               per-type evaluation
    ``granularity/teacher``  (none)             ``54321``                               teacher-cell rollouts
    =======================  =================  ======================================  ============================

    "hashed" is ``random.Random("-".join(map(str, parts))).getrandbits(63)``. The task stream of
    toolshop GRPO is a Python ``random.Random`` rather than a seed: :func:`task_rng`.
    """
    try:
        fn = _STREAMS[kind]
    except KeyError:
        raise ConfigError("seed_stream", f"unknown stream {kind!r}; valid: {', '.join(_STREAMS)}") from None
    return fn(*parts)


def generator(kind: str, *parts: int | str) -> torch.Generator:
    """A fresh CPU ``torch.Generator`` seeded with :func:`seed_stream` ``(kind, *parts)``."""
    return torch.Generator().manual_seed(seed_stream(kind, *parts))


def task_rng(seed: int, update: int) -> random.Random:
    """The Python RNG of the toolshop GRPO task stream of one update (``random.Random(f"grpo-{seed}-{update}")``)."""
    return random.Random(f"grpo-{seed}-{update}")


# ----------------------------------------------------------------------------------------------
# optimizer

def adamw(params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.AdamW:
    """The AdamW of the toolshop RL trainers: no weight decay, ``betas=(0.9, 0.99)``."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
