"""Slow, obvious references for the fake-quant kernels of ``creditlab.models.quant``."""

from __future__ import annotations

import math

import torch


def fp8_e4m3_values() -> list[float]:
    """Every finite value of FP8 E4M3 (fn variant: no inf, only S.1111.111 is NaN), from the bits."""
    vals = set()
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            if e == 0:
                v = (m / 8) * 2.0 ** (1 - 7)  # subnormal
            else:
                v = (1 + m / 8) * 2.0 ** (e - 7)
            vals.add(v)
            vals.add(-v)
    return sorted(vals)


_GRID = fp8_e4m3_values()


def _mantissa_even(v: float) -> bool:
    """True when v's last mantissa bit is 0 (ties go to such values)."""
    a = abs(v)
    if a == 0:
        return True
    e = max(math.floor(math.log2(a)), -6)
    m = round(a / 2.0 ** e * 8) if a >= 2.0 ** -6 else round(a / 2.0 ** -9)
    return m % 2 == 0


def fp8_round_scalar(x: float) -> float:
    """Nearest FP8 E4M3 value, ties to even mantissa, saturating at +-448."""
    x = max(-448.0, min(448.0, x))
    best = min(_GRID, key=lambda g: abs(g - x))
    d = abs(best - x)
    ties = [g for g in _GRID if abs(abs(g - x) - d) <= 1e-12 * max(1.0, abs(x))]
    if len(ties) > 1:
        even = [g for g in ties if _mantissa_even(g)]
        best = even[0]
    return best


def fp8_per_row_ref(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    flat, o = x.reshape(-1, x.shape[-1]), out.view(-1, x.shape[-1])
    for r in range(flat.shape[0]):
        amax = max(abs(float(v)) for v in flat[r])
        s = max(amax, 1e-30) / 448.0
        for c in range(flat.shape[1]):
            o[r, c] = fp8_round_scalar(float(flat[r, c]) / s) * s
    return out


def fp8_blockwise_ref(w: torch.Tensor, block: int) -> torch.Tensor:
    out = torch.empty_like(w)
    R, C = w.shape
    for r0 in range(0, R, block):
        for c0 in range(0, C, block):
            tile = w[r0:r0 + block, c0:c0 + block]
            amax = max(abs(float(v)) for v in tile.reshape(-1))
            s = max(amax, 1e-30) / 448.0
            for r in range(tile.shape[0]):
                for c in range(tile.shape[1]):
                    out[r0 + r, c0 + c] = fp8_round_scalar(float(tile[r, c]) / s) * s
    return out


def int8_per_row_ref(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    flat, o = x.reshape(-1, x.shape[-1]), out.view(-1, x.shape[-1])
    for r in range(flat.shape[0]):
        amax = max(abs(float(v)) for v in flat[r])
        s = max(amax, 1e-30) / 127.0
        for c in range(flat.shape[1]):
            q = float(flat[r, c]) / s
            fl = math.floor(q)
            frac = q - fl
            qi = fl + 1 if frac > 0.5 or (frac == 0.5 and fl % 2 == 1) else fl  # half to even
            o[r, c] = max(-127, min(127, qi)) * s
    return out


def fp4_e2m1_values() -> list[float]:
    """Every value of FP4 E2M1 (2 exponent bits, bias 1, 1 mantissa bit, no inf or NaN), from the bits."""
    vals = set()
    for e in range(4):
        for m in range(2):
            v = (m / 2) * 2.0 ** (1 - 1) if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
            vals.add(v)
            vals.add(-v)
    return sorted(vals)


_GRID4 = fp4_e2m1_values()


def _fp4_mantissa_bit(v: float) -> int:
    a = abs(v)
    if a < 1:  # subnormals 0 and 0.5
        return int(a == 0.5)
    e = math.floor(math.log2(a))
    return int(round((a / 2.0 ** e - 1) * 2))


def fp4_round_scalar(x: float) -> float:
    """Nearest FP4 E2M1 value, ties to even mantissa, saturating at +-6."""
    x = max(-6.0, min(6.0, x))
    d = min(abs(g - x) for g in _GRID4)
    ties = [g for g in _GRID4 if abs(abs(g - x) - d) <= 1e-12]
    if len(ties) > 1:
        ties = [g for g in ties if _fp4_mantissa_bit(g) == 0]
    return ties[0] if ties[0] != 0 else 0.0


def fp4_blockwise_ref(x: torch.Tensor, block: int, scale: str) -> torch.Tensor:
    """One scale per ``block`` elements of each row: NVFP4 (``e4m3``: FP8 block scale relative to the
    row scale amax/(448*6)) or MXFP4 (``e8m0``: 2^(floor(log2 amax) - 2))."""
    out = torch.empty_like(x)
    flat, o = x.reshape(-1, x.shape[-1]), out.view(-1, x.shape[-1])
    n = flat.shape[1]
    for r in range(flat.shape[0]):
        row = [float(v) for v in flat[r]]
        s_row = max(max(abs(v) for v in row), 1e-30) / (448.0 * 6.0)
        for c0 in range(0, n, block):
            blk = row[c0:c0 + block]
            amax = max(abs(v) for v in blk)
            if scale == "e4m3":
                s = fp8_round_scalar(amax / 6.0 / s_row) * s_row
            else:
                s = 2.0 ** (math.floor(math.log2(amax)) - 2) if amax > 0 else 0.0
            for j, v in enumerate(blk):
                o[r, c0 + j] = fp4_round_scalar(v / s) * s if s > 0 else 0.0
    return out
