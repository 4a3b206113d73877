"""Fake-quant kernels against slow references and their format bounds."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from creditlab.errors import ConfigError
from creditlab.models.quant import (
    PRECISIONS,
    fp4_e2m1_round,
    fp8_e4m3_round,
    quant_act,
    quant_bf16,
    quant_fp4_blockwise,
    quant_fp8_blockwise,
    quant_fp8_per_row,
    quant_int8_per_row,
    quant_kv,
    quant_weight,
)
from reference.ref_quant import (
    fp4_blockwise_ref,
    fp4_e2m1_values,
    fp4_round_scalar,
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
    for p in PRECISIONS:
        y = quant_act(x, p) * 2 + quant_weight(x, p) + quant_kv(x, p)
        (g,) = torch.autograd.grad(y.sum(), x)
        assert torch.allclose(g, torch.full_like(g, 4.0))
    assert quant_act(x, "fp32") is x and quant_weight(x, "fp32") is x


def test_unknown_precision_is_a_config_error():
    with pytest.raises(ConfigError, match="precision"):
        quant_act(torch.zeros(2, 2), "fp2")


# ------------------------------------------------------------------------------------------------
# FP4 E2M1 and its block scales (NVFP4: 16 per block, FP8 scales; MXFP4: 32 per block, 2^k scales)


def test_fp4_grid_has_the_format_values():
    grid = fp4_e2m1_values()
    assert grid == [-6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_fp4_round_matches_the_table_on_every_value_and_midpoint():
    grid = fp4_e2m1_values()
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:], strict=False)]
    near = [m + d for m in mids for d in (-1e-3, 1e-3)]
    pts = torch.tensor(grid + mids + near + [6.5, 7.0, 100.0, -9.0], dtype=torch.float64)
    want = torch.tensor([fp4_round_scalar(float(x)) for x in pts], dtype=torch.float64)
    for dtype in (torch.float64, torch.float32):
        assert torch.equal(fp4_e2m1_round(pts.to(dtype)).double(), want)


def test_fp4_golden_ties_go_to_even_mantissa():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 5.01, 7.0])
    assert fp4_e2m1_round(x).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -4.0, 6.0, 6.0]


@pytest.mark.parametrize(("block", "scale"), [(16, "e4m3"), (32, "e8m0"), (4, "e4m3"), (8, "e8m0")])
@pytest.mark.parametrize("cols", [16, 37, 64])
def test_fp4_blockwise_matches_reference(block, scale, cols):
    g = torch.Generator().manual_seed(cols + block)
    x = torch.randn(3, cols, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, cols, dtype=torch.float64)
    x[1, :block] = 0.0  # an all-zero block
    got = quant_fp4_blockwise(x, block, scale)
    assert torch.allclose(got, fp4_blockwise_ref(x, block, scale), rtol=0, atol=1e-12)


@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-3, 1e3))
def test_fp4_round_trip_within_format_bounds(seed, scale):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    s_row = x.abs().amax(-1, keepdim=True) / (448 * 6)
    for block, fmt in ((16, "e4m3"), (32, "e8m0")):
        q = quant_fp4_blockwise(x, block, fmt)
        for c0 in range(0, 64, block):
            tile, qt = x[:, c0:c0 + block], q[:, c0:c0 + block]
            amax = tile.abs().amax(-1, keepdim=True)
            if fmt == "e8m0":
                s = torch.exp2(torch.floor(torch.log2(amax)) - 2)
            else:
                s = fp8_e4m3_round(amax / 6 / s_row) * s_row
            err, a = (qt - tile).abs(), tile.abs() / s
            # inside the grid: half the largest step (2 s); above 6 s: saturation
            assert bool((err[a <= 6] <= s.expand_as(a)[a <= 6] * (1 + 1e-12)).all())
            assert torch.allclose(qt[a > 6].abs(), 6 * s.expand_as(a)[a > 6])
            # normal range of E2M1 (|x| / s >= 1): relative error at most 1/4
            assert bool((err[a >= 1] <= tile.abs()[a >= 1] / 4 * (1 + 1e-12)).all())


def test_fp4_is_idempotent_and_through_every_entry_point():
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(3))
    for p, block, fmt in (("nvfp4", 16, "e4m3"), ("mxfp4", 32, "e8m0")):
        once = quant_fp4_blockwise(x, block, fmt)
        assert torch.equal(quant_fp4_blockwise(once, block, fmt), once)
        assert torch.equal(quant_act(x, p), once) and torch.equal(quant_weight(x, p), once)
        assert torch.equal(quant_kv(x, p), quant_fp8_per_row(x))  # W4A4-KV8: the cache stays FP8
        assert len(torch.unique(once[0, :block] / once[0, :block].abs().max())) <= 15


def test_fp4_batched_leading_dims_are_rows():
    x = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(4))
    flat = quant_fp4_blockwise(x.reshape(6, 40), 16, "e4m3").reshape(2, 3, 40)
    assert torch.equal(quant_fp4_blockwise(x, 16, "e4m3"), flat)


def test_fp4_unknown_scale_format_is_a_config_error():
    with pytest.raises(ConfigError, match="scale"):
        quant_fp4_blockwise(torch.ones(2, 16), 16, "e5m2")


def test_fp8_blockwise_of_a_stack_is_each_weight_alone():
    w = torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(5))
    w[1, 0, 0] = 50.0
    stacked = quant_fp8_blockwise(w, 16)
    for i in range(3):
        assert torch.equal(stacked[i], quant_fp8_blockwise(w[i], 16))


def _wide_fp32(n: int, seed: int, lo: int = -40, hi: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(lo, hi, (n,), generator=g).float())
    return torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), -float("inf")])])


def test_fp32_arithmetic_fp8_rounding_is_the_cast_bit_for_bit():
    grid = [g for g in fp8_e4m3_values() if g >= 0]
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:], strict=False)]
    pts = torch.tensor(grid + mids, dtype=torch.float32)
    pts = torch.cat([pts, -pts, torch.nextafter(pts, pts + 1), torch.nextafter(pts, pts - 1), _wide_fp32(200_000, 1)])
    cast = pts.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(fp8_e4m3_round(pts).view(torch.int32), cast.view(torch.int32))  # signed zeros too


def test_fp32_arithmetic_fp4_rounding_is_the_table_bit_for_bit():
    grid = fp4_e2m1_values()
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:], strict=False)]
    pts = torch.tensor(grid + mids, dtype=torch.float32)
    pts = torch.cat([pts, torch.nextafter(pts, pts + 1), torch.nextafter(pts, pts - 1), _wide_fp32(200_000, 2, -12, 5)])
    want = fp4_e2m1_round(pts.double()).float()  # the table (bucketize) path
    assert torch.equal(fp4_e2m1_round(pts).view(torch.int32), want.view(torch.int32))


def _fp4_blockwise_table(x: torch.Tensor, block: int, scale: str) -> torch.Tensor:
    """The fp32 block quantizer with the cast and the E2M1 table (the eager formulas of the format)."""
    n = x.shape[-1]
    xb = torch.nn.functional.pad(x, (0, -n % block)).reshape(*x.shape[:-1], -1, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    if scale == "e4m3":
        s_row = amax.amax(dim=-2, keepdim=True).clamp_min(1e-30) / (448.0 * 6.0)
        s = (amax / 6.0 / s_row).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype) * s_row
    else:
        s = torch.exp2(torch.floor(torch.log2(amax.clamp_min(1e-30))) - 2)
    ok = s > 0
    e2m1 = fp4_e2m1_round((xb / torch.where(ok, s, 1.0)).double()).float()
    q = torch.where(ok, e2m1 * s, 0.0)
    return q.reshape(*q.shape[:-2], -1)[..., :n]


@pytest.mark.parametrize(("block", "scale"), [(16, "e4m3"), (32, "e8m0")])
def test_fp32_block_quantizers_are_the_cast_and_table_formulas_bit_for_bit(block, scale):
    g = torch.Generator().manual_seed(block)
    x = torch.randn(3, 64, 96, generator=g) * torch.logspace(-6, 3, 96)
    x[0, 0, :block] = 0.0
    x[0, 1, :block] = -0.0
    got = quant_fp4_blockwise(x, block, scale)
    assert torch.equal(got.view(torch.int32), _fp4_blockwise_table(x, block, scale).view(torch.int32))
    s = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 448.0
    want = (x / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32) * s
    assert torch.equal(quant_fp8_per_row(x).view(torch.int32), want.view(torch.int32))
    s = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 127.0
    want = torch.clamp(torch.round(x / s), -127.0, 127.0) * s
    assert torch.equal(quant_int8_per_row(x).view(torch.int32), want.view(torch.int32))


# ------------------------------------------------------------------------------------------------
# EngineFormat: the engine format, parsed once where it enters


def test_engine_format_is_its_name_everywhere_a_key_or_table_reads_it():
    import json
    import pickle

    from creditlab.lab.runner import digest
    from creditlab.models.quant import PRECISIONS, EngineFormat

    for name in PRECISIONS:
        f = EngineFormat.parse(name)
        assert f == name and hash(f) == hash(name) and f"{f}" == name and repr(f) == repr(name)
        assert json.dumps({"dose": f}) == json.dumps({"dose": name})
        assert digest({"dose": f}) == digest({"dose": name})  # cell keys unchanged
        back = pickle.loads(pickle.dumps(f))
        assert back == name and isinstance(back, EngineFormat)
        assert EngineFormat.parse(f) is f  # parsing a parsed format is free


def test_engine_format_properties():
    from creditlab.models.quant import FP4_BLOCK, QUANTIZED, EngineFormat

    q = {p: EngineFormat(p) for p in ("fp32", "bf16", "fp8", "int8", "nvfp4", "mxfp4")}
    assert [p for p, f in q.items() if f.quantized] == list(QUANTIZED)
    assert {p: f.fp4_block for p, f in q.items() if f.fp4_block} == FP4_BLOCK
    assert {p: f.kv_cache for p, f in q.items()} == {"fp32": "fp32", "bf16": "bf16", "fp8": "fp8", "int8": "fp32",
                                                       "nvfp4": "fp8", "mxfp4": "fp8"}
    # quant_kv stores what kv_cache says
    x = torch.randn(2, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    for p, f in q.items():
        assert torch.equal(quant_kv(x, p), quant_kv(x, f.kv_cache)), p


@pytest.mark.parametrize("bad", ["fp6", "FP8", "", None, 8])
def test_engine_format_error_names_the_field_it_came_from(bad):
    from creditlab.models.quant import EngineFormat
    from creditlab.train.toolshop_grpo import GRPOConfig

    with pytest.raises(ConfigError, match=r"^--dose: unknown precision"):
        EngineFormat.parse(bad, "--dose")
    with pytest.raises(ConfigError, match=r"^rollout_precision: unknown precision"):
        GRPOConfig(rollout_precision=bad)


def test_a_config_holds_its_formats_parsed():
    from creditlab.models.quant import EngineFormat
    from creditlab.train.toolshop_grpo import GRPOConfig

    c = GRPOConfig(rollout_precision="nvfp4", learner_precision="fp32")
    assert isinstance(c.rollout_precision, EngineFormat) and c.rollout_precision.quantized
    assert not c.learner_precision.quantized
