"""Fake-quantization kernels for the rollout engine and the quantization-aware learner.

Every kernel returns a tensor of the input's dtype and shape holding values on the quantized grid
(quantize, then dequantize), so a model runs unchanged in fp32 arithmetic while seeing exactly the
rounding a low-precision engine applies. Gradients pass straight through (``x + (q(x) - x).detach()``)
when the learner is quantization-aware.

Formats (the recipes of FP8/INT8 inference engines, e.g. DeepSeek-V3's block-wise FP8 and
SmoothQuant-style W8A8):

- **FP8 E4M3** (``float8_e4m3fn``: 4 exponent bits, bias 7, 3 mantissa bits, max 448, no inf).
  Weights: one scale per ``block x block`` tile, ``s = amax(tile) / 448``. Activations: one scale per
  token (row), ``s = amax(row) / 448``. KV cache: one scale per token per head. Rounding is
  round-to-nearest-even, done by a cast to ``torch.float8_e4m3fn`` (checked against a table-based
  reference in the tests). For values in the normal range the relative round-trip error is at most
  ``2^-4`` (half a unit in the last of 3 mantissa bits).
- **INT8** symmetric: weights one scale per output channel, activations one per token,
  ``s = amax / 127``, ``q = clamp(round(x / s), -127, 127)``; round-trip error at most ``s / 2``.
- **bf16**: round to nearest even bfloat16 (8 exponent bits, 7 mantissa bits).
"""

from __future__ import annotations

import torch

from creditlab.errors import ConfigError

__all__ = [
    "FP8_MAX",
    "INT8_MAX",
    "PRECISIONS",
    "check_precision",
    "fp8_e4m3_round",
    "quant_act",
    "quant_bf16",
    "quant_fp8_blockwise",
    "quant_fp8_per_row",
    "quant_int8_per_row",
    "quant_kv",
    "quant_weight",
    "ste",
]

FP8_MAX = 448.0
INT8_MAX = 127.0
PRECISIONS = ("fp32", "bf16", "fp8", "int8")
_TINY = 1e-30


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ConfigError("precision", f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    return precision


def ste(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Straight-through estimator: the value of ``q``, the gradient of ``x``."""
    return x + (q - x).detach()


def fp8_e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest FP8 E4M3 value (ties to even), saturating at +-448."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def quant_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bfloat16 and back."""
    return x.to(torch.bfloat16).to(x.dtype)


def quant_fp8_per_row(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 with one scale per row (last dim): per token for activations, per token per head for
    a KV tensor of shape ``(..., head_dim)``."""
    s = x.detach().abs().amax(dim=-1, keepdim=True).clamp_min(_TINY) / FP8_MAX
    return fp8_e4m3_round(x / s) * s


def quant_fp8_blockwise(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 E4M3 for a ``(out, in)`` weight with one scale per ``block x block`` tile (edge tiles may be
    smaller)."""
    out_f, in_f = w.shape
    nb_o, nb_i = -(-out_f // block), -(-in_f // block)
    pad = torch.zeros(nb_o * block, nb_i * block, dtype=w.dtype, device=w.device)
    pad[:out_f, :in_f] = w.detach()
    tiles = pad.view(nb_o, block, nb_i, block)
    s = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp_min(_TINY) / FP8_MAX  # (nb_o,1,nb_i,1)
    s_full = s.expand(nb_o, block, nb_i, block).reshape(nb_o * block, nb_i * block)[:out_f, :in_f]
    return fp8_e4m3_round(w / s_full) * s_full


def quant_int8_per_row(x: torch.Tensor) -> torch.Tensor:
    """Symmetric INT8 with one scale per row (last dim): per output channel for a ``(out, in)`` weight,
    per token for activations."""
    s = x.detach().abs().amax(dim=-1, keepdim=True).clamp_min(_TINY) / INT8_MAX
    return torch.clamp(torch.round(x / s), -INT8_MAX, INT8_MAX) * s


def quant_weight(w: torch.Tensor, precision: str, *, block: int = 32) -> torch.Tensor:
    """The weight as the engine of ``precision`` stores it (straight-through gradient)."""
    if precision == "fp32":
        return w
    if precision == "bf16":
        return ste(w, quant_bf16(w))
    if precision == "fp8":
        return ste(w, quant_fp8_blockwise(w, block))
    if precision == "int8":
        return ste(w, quant_int8_per_row(w))
    check_precision(precision)
    raise AssertionError  # unreachable


def quant_act(x: torch.Tensor, precision: str) -> torch.Tensor:
    """A linear layer's input activation (per-token scales), straight-through gradient."""
    if precision == "fp32":
        return x
    if precision == "bf16":
        return ste(x, quant_bf16(x))
    if precision == "fp8":
        return ste(x, quant_fp8_per_row(x))
    if precision == "int8":
        return ste(x, quant_int8_per_row(x))
    check_precision(precision)
    raise AssertionError


def quant_kv(x: torch.Tensor, precision: str) -> torch.Tensor:
    """A key/value tensor ``(B, H, L, head_dim)`` as the KV cache stores it: FP8 per token per head
    (KV8) for ``fp8``, bf16 for ``bf16``; ``int8`` (W8A8 only) and ``fp32`` keep it exact."""
    if precision == "fp8":
        return ste(x, quant_fp8_per_row(x))
    if precision == "bf16":
        return ste(x, quant_bf16(x))
    check_precision(precision)
    return x
