"""The compiled (fused) quantizers give the eager ones' values bit for bit.

Inputs: every value and midpoint of the FP4 E2M1 and FP8 E4M3 grids and their float neighbours,
placed in blocks next to an anchor that fixes the block's scale, at power-of-two and arbitrary
scales; zero and negative-zero blocks; random tensors over a wide exponent range; the learner's
shapes (leading dims of a stack). Compiling is slow (seconds per kernel), so each kernel compiles
once for the module.
"""

from __future__ import annotations

import pytest
import torch

from creditlab.models import quant
from creditlab.models.quant import QUANTIZED, quant_act, quant_kv
from reference.ref_quant import fp4_e2m1_values, fp8_e4m3_values

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def _grid_rows(values: list[float], anchor: float, width: int, seed: int) -> torch.Tensor:
    """Rows of ``width`` holding ``values`` (and their float neighbours) in blocks that each start with
    ``+-anchor``, times a per-row scale: a power of two on even rows, arbitrary on odd ones."""
    v = torch.tensor(values, dtype=torch.float32)
    v = torch.cat([v, -v, torch.nextafter(v, v + 1), torch.nextafter(v, v - 1)])
    per_row = width - width // 16  # one anchor per block of 16
    n_rows = -(-v.numel() // per_row)
    v = torch.cat([v, torch.zeros(n_rows * per_row - v.numel())]).view(n_rows, width // 16, 15)
    anchors = torch.full((n_rows, width // 16, 1), anchor)
    anchors[:, 1::2] *= -1
    x = torch.cat([anchors, v], dim=-1).reshape(n_rows, width)
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 20, (n_rows, 1), generator=g).float())
    scale[1::2] *= torch.rand(n_rows // 2, 1, generator=g) + 0.5
    return x * scale


def _inputs(width: int) -> list[torch.Tensor]:
    fp4 = fp4_e2m1_values()
    mids4 = [(a + b) / 2 for a, b in zip(fp4, fp4[1:], strict=False)]
    fp8 = [g for g in fp8_e4m3_values() if g >= 0]
    mids8 = [(a + b) / 2 for a, b in zip(fp8, fp8[1:], strict=False)]
    g = torch.Generator().manual_seed(width)
    wide = torch.randn(3, 50, width, generator=g) * torch.exp2(torch.randint(-30, 10, (3, 50, 1), generator=g).float())
    wide[0, 0] = 0.0
    wide[0, 1] = -0.0
    wide[1, 2, :16] = 0.0  # a zero block in a non-zero row
    wide[2, 3, :32] = 1e-38  # blocks below E4M3's range of block scales
    return [_grid_rows(fp4 + mids4, 6.0, width, 1), _grid_rows(fp8 + mids8, 448.0, width, 2), wide]


@pytest.mark.parametrize("precision", QUANTIZED)
@pytest.mark.parametrize("width", [64, 256])
def test_fused_activation_quantizer_is_the_eager_one_bit_for_bit(precision, width):
    for x in _inputs(width):
        eager = quant_act(x, precision, fused=False)
        fused = quant_act(x, precision, fused=True)
        assert torch.equal(_bits(fused), _bits(eager)), precision


@pytest.mark.parametrize("precision", ["fp8", "nvfp4", "mxfp4"])
def test_fused_kv_quantizer_is_the_eager_one_bit_for_bit(precision):
    for x in _inputs(64):
        x = x.reshape(*x.shape[:-1], 4, 16)  # (..., heads, head_dim): one scale per token per head
        assert torch.equal(_bits(quant_kv(x, precision, fused=True)), _bits(quant_kv(x, precision, fused=False)))


def test_fused_quantizer_keeps_the_straight_through_gradient_and_the_size_rule():
    x = torch.randn(2, 8, 64, requires_grad=True)
    y = quant_act(x, "nvfp4", fused=True)
    (y * 3).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    assert torch.equal(y.detach(), quant_act(x.detach(), "nvfp4", fused=False))
    small = torch.randn(4, 64)
    assert small.numel() < quant.FUSE_MIN_NUMEL  # by size, small tensors stay eager: no compile for a test
    assert torch.equal(quant_act(small, "mxfp4"), quant_act(small, "mxfp4", fused=False))


def test_fused_quantizer_differs_from_another_format():
    """The comparison above is not vacuous: the fused kernel of one format is not another's."""
    x = _inputs(64)[2]
    assert not torch.equal(quant_act(x, "nvfp4", fused=True), quant_act(x, "mxfp4", fused=False))
