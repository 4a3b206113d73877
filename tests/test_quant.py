"""Fake-quant kernels against slow references and their format bounds."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from creditlab.errors import ConfigError
from creditlab.models.quant import (
    fp8_e4m3_round,
    quant_act,
    quant_bf16,
    quant_fp8_blockwise,
    quant_fp8_per_row,
    quant_int8_per_row,
    quant_kv,
    quant_weight,
)
from reference.ref_quant import (
    fp8_blockwise_ref,
    fp8_e4m3_values,
    fp8_per_row_ref,
    fp8_round_scalar,
    int8_per_row_ref,
)


def test_fp8_grid_has_the_format_values():
    grid = fp8_e4m3_values()
    assert len(grid) == 253  # 256 codes - 2 NaN - one duplicate zero
    assert max(grid) == 448.0 and min(x for x in grid if x > 0) == 2.0 ** -9


def test_fp8_cast_rounds_like_the_reference_on_every_grid_midpoint():
    grid = [g for g in fp8_e4m3_values() if g >= 0]
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:], strict=False)]
    pts = torch.tensor(grid + mids + [500.0, 1e4, -1e4], dtype=torch.float64)
    got = fp8_e4m3_round(pts)
    want = torch.tensor([fp8_round_scalar(float(x)) for x in pts], dtype=torch.float64)
    assert torch.equal(got, want)


def test_fp8_golden_values():
    x = torch.tensor([1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 447.0, 470.0, -1000.0])
    assert fp8_e4m3_round(x).tolist() == [1.0, 1.25, 0.0, 2.0 ** -8, 448.0, 448.0, -448.0]


@given(rows=st.integers(1, 4), cols=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_fp8_per_row_matches_reference(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64) * torch.rand(rows, 1, generator=g,
                                                                                 dtype=torch.float64) * 10
    assert torch.allclose(quant_fp8_per_row(x), fp8_per_row_ref(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape,block", [((8, 8), 4), ((7, 10), 4), ((5, 3), 8)])
def test_fp8_blockwise_matches_reference(shape, block):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w[0, 0] = 30.0  # one tile with a large outlier, the others untouched by it
    assert torch.allclose(quant_fp8_blockwise(w, block), fp8_blockwise_ref(w, block), rtol=0, atol=1e-12)


@given(rows=st.integers(1, 4), cols=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_int8_per_row_matches_reference(rows, cols, seed):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3
    assert torch.allclose(quant_int8_per_row(x), int8_per_row_ref(x), rtol=0, atol=1e-12)


@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-3, 1e3))
def test_round_trip_errors_within_format_bounds(seed, scale):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 64, generator=g) * scale
    # FP8 E4M3, per-row scale: relative error <= 2^-4 for values in the normal range
    s = x.abs().amax(-1, keepdim=True) / 448
    normal = (x / s).abs() >= 2.0 ** -6
    err = (quant_fp8_per_row(x) - x).abs()
    assert bool((err[normal] <= 2.0 ** -4 * x.abs()[normal] * (1 + 1e-6)).all())
    # and the block-wise weight scales
    s_blk = quant_fp8_blockwise(x, 32)
    for c0 in (0, 32):
        tile = x[:, c0:c0 + 32]
        ts = tile.abs().max() / 448
        nm = (tile / ts).abs() >= 2.0 ** -6
        e = (s_blk[:, c0:c0 + 32] - tile).abs()
        assert bool((e[nm] <= 2.0 ** -4 * tile.abs()[nm] * (1 + 1e-6)).all())
    # INT8: absolute error <= scale / 2
    s8 = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((quant_int8_per_row(x) - x).abs() <= s8 / 2 * (1 + 1e-6)).all())
    # bf16: relative error <= 2^-8
    assert bool(((quant_bf16(x) - x).abs() <= 2.0 ** -8 * x.abs()).all())


def test_quantizers_are_idempotent_and_keep_zero_rows():
    x = torch.randn(4, 32)
    x[1] = 0
    for q in (quant_fp8_per_row, quant_int8_per_row, lambda t: quant_fp8_blockwise(t, 8)):
        once = q(x)
        assert torch.isfinite(once).all() and (once[1] == 0).all()
        assert torch.allclose(q(once), once, rtol=1e-6, atol=1e-7)


def test_straight_through_gradients_and_fp32_identity():
    x = torch.randn(3, 16, requires_grad=True)
    for p in ("fp32", "bf16", "fp8", "int8"):
        y = quant_act(x, p) * 2 + quant_weight(x, p) + quant_kv(x, p)
        (g,) = torch.autograd.grad(y.sum(), x)
        assert torch.allclose(g, torch.full_like(g, 4.0))
    assert quant_act(x, "fp32") is x and quant_weight(x, "fp32") is x


def test_unknown_precision_is_a_config_error():
    with pytest.raises(ConfigError, match="precision"):
        quant_act(torch.zeros(2, 2), "fp4")
