"""Fake-quantization kernels for the rollout engine and the quantization-aware learner.

Every kernel returns a tensor of the input's dtype and shape holding values on the quantized grid
(quantize, then dequantize), so a model runs unchanged in fp32 arithmetic while seeing exactly the
rounding a low-precision engine applies. Gradients pass straight through (the value of
``x + (q(x) - x).detach()``, in one autograd node) when the learner is quantization-aware; the
FP8, INT8 and FP4 kernels themselves return detached values.

Formats (the recipes of FP8/INT8 inference engines, e.g. DeepSeek-V3's block-wise FP8 and
SmoothQuant-style W8A8):

- **FP8 E4M3** (``float8_e4m3fn``: 4 exponent bits, bias 7, 3 mantissa bits, max 448, no inf).
  Weights: one scale per ``block x block`` tile, ``s = amax(tile) / 448``. Activations: one scale per
  token (row), ``s = amax(row) / 448``. KV cache: one scale per token per head. Rounding is
  round-to-nearest-even: on fp32 by arithmetic on the exponent bits (bit for bit the cast to
  ``torch.float8_e4m3fn``, several times cheaper), otherwise by that cast (both checked against a
  table-based reference in the tests). For values in the normal range the relative round-trip error is at most
  ``2^-4`` (half a unit in the last of 3 mantissa bits).
- **INT8** symmetric: weights one scale per output channel, activations one per token,
  ``s = amax / 127``, ``q = clamp(round(x / s), -127, 127)``; round-trip error at most ``s / 2``.
- **bf16**: round to nearest even bfloat16 (8 exponent bits, 7 mantissa bits).
- **FP4 E2M1** (2 exponent bits, bias 1, 1 mantissa bit: the 15 values 0, +-0.5, +-1, +-1.5, +-2,
  +-3, +-4, +-6), round to nearest, ties to even mantissa, saturating at +-6 (on fp32 by the same
  exponent-bit arithmetic, without a lookup table). Every FP4 tensor has a
  shared scale per block of contiguous elements along the last dimension (the reduction dimension
  of a linear layer: input features of a weight, the hidden features of a token), in the two
  formats of current FP4 serving stacks:

  * **NVFP4** (``nvfp4``): blocks of 16, each block scale ``amax(block) / 6`` stored in FP8 E4M3
    relative to an fp32 scale per row ``amax(row) / (448 * 6)`` (two-level scaling, as NVIDIA's
    NVFP4 recipe; per row rather than per tensor, so a token's grid does not depend on the other
    tokens of its batch). A block scale that rounds down saturates its largest element at 6.
  * **MXFP4** (``mxfp4``): blocks of 32 with a power-of-two (E8M0) scale
    ``2^(floor(log2 amax(block)) - 2)`` (OCP Microscaling spec; elements above 6 saturate).

  A weight is quantized per output row in blocks of its input features, an activation per token.
  For values whose scaled magnitude is at least 1 (the normal range of E2M1) the relative
  round-trip error against the decoded block scale is at most 1/4 (half the step of 1 mantissa
  bit); the absolute error is at most half the grid step times the block scale.
"""

from __future__ import annotations

import torch

from creditlab.errors import ConfigError

__all__ = [
    "FP4_BLOCK",
    "FP4_MAX",
    "FP8_MAX",
    "INT8_MAX",
    "PRECISIONS",
    "QUANTIZED",
    "FUSE_MIN_NUMEL",
    "EngineFormat",
    "fused_kernel",
    "fp4_e2m1_round",
    "fp8_e4m3_round",
    "quant_fp4_blockwise",
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
FP4_MAX = 6.0
#: Block size of each FP4 format (elements sharing one scale).
FP4_BLOCK = {"nvfp4": 16, "mxfp4": 32}
PRECISIONS = ("fp32", "bf16", "fp8", "int8", "nvfp4", "mxfp4")
#: The precisions whose engine runs low-bit GEMMs (weights and activations on a quantized grid).
QUANTIZED = ("fp8", "int8", "nvfp4", "mxfp4")
_TINY = 1e-30


class EngineFormat(str):
    """An engine's number format (one of :data:`PRECISIONS`), parsed once where it enters: a config field,
    a CLI flag or a public entry point. It is the format's name as a ``str`` (equal to it, hashed, printed,
    pickled and written to JSON as it), so cell keys, manifests and tables read the same; what the code
    asks of a format is a property here instead of a membership test at each use.

    A lab's dose, a trainer's ``rollout_precision`` / ``learner_precision`` and a model's ``precision``
    are all an :class:`EngineFormat`: :meth:`parse` names the field the value came from in its error,
    and returns a value that is already parsed as it is (the entry points below a config re-parse for
    direct callers at the cost of one ``isinstance``).
    """

    __slots__ = ()

    def __new__(cls, value: str = "fp32", field: str = "precision") -> EngineFormat:
        if isinstance(value, EngineFormat):
            return value
        if not isinstance(value, str) or value not in PRECISIONS:
            raise ConfigError(field, f"unknown precision {value!r}; valid: {', '.join(PRECISIONS)}")
        return super().__new__(cls, value)

    @classmethod
    def parse(cls, value: str, field: str = "precision") -> EngineFormat:
        """``value`` as a format; a :class:`ConfigError` naming ``field`` if it is not one."""
        return cls(value, field)

    def __getnewargs__(self) -> tuple[str]:
        return (str(self),)

    @property
    def quantized(self) -> bool:
        """Whether the engine runs low-bit GEMMs (weights and activations on a quantized grid)."""
        return self in QUANTIZED

    @property
    def fp4_block(self) -> int | None:
        """Elements sharing one scale for an FP4 format (:data:`FP4_BLOCK`); None for the others."""
        return FP4_BLOCK.get(self)

    @property
    def kv_cache(self) -> str:
        """The format the KV cache stores keys and values in (:func:`quant_kv`): ``fp8`` for the fp8 and
        FP4 engines, ``bf16`` for bf16, exact (``fp32``) for int8 (W8A8 only) and fp32."""
        return "fp8" if self in ("fp8", "nvfp4", "mxfp4") else "bf16" if self == "bf16" else "fp32"


def ste(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Straight-through estimator: the value of ``q``, the gradient of ``x``.

    Without a gradient to carry it returns ``q`` itself: the same values, since ``q - x`` is exact
    for every quantizer here (``q`` lies within a factor 2 of ``x`` or is 0, Sterbenz's lemma), so
    ``x + (q - x) == q`` bit for bit, and two fewer passes over the tensor.
    """
    if not (x.requires_grad and torch.is_grad_enabled()):
        return q
    return _StraightThrough.apply(x, q)


class _StraightThrough(torch.autograd.Function):
    """``x + (q - x).detach()`` without its two passes: the value of ``q`` (the same bits, see
    :func:`ste`), the gradient of ``x`` (identity)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return q.view_as(q)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ARG004
        return grad, None


#: The exponent field of an IEEE fp32: ``bits & _EXP_BITS`` read as a float is ``2^floor(log2 |y|)``
#: for a normal ``y`` (0 for 0).
_EXP_BITS = 0x7F800000


def _round_to_step_(y: torch.Tensor, mantissa_bits: int, min_step: float) -> torch.Tensor:
    """Round fp32 ``y`` in place to ``mantissa_bits`` bits below its leading one, ties to even, on a
    grid no finer than ``min_step`` (the subnormal step of the target format); returns ``y``.

    The grid step ``max(2^floor(log2 |y|) * 2^-mantissa_bits, min_step)`` comes from the exponent bits
    of ``y``; it is a power of two, so ``y / step`` and ``round(.) * step`` are exact and
    :func:`torch.round` (half to even) is the whole rounding: what a cast to the narrow format does,
    in a few vectorised passes without a table or a per-element conversion routine. A value that
    rounds up to the next power of two lands on it exactly (the carry into the exponent).
    """
    step = (y.view(torch.int32) & _EXP_BITS).view(torch.float32)
    step.mul_(2.0 ** -mantissa_bits).clamp_min_(min_step)
    return y.div_(step).round_().mul_(step)


def _fp8_e4m3_round_(y: torch.Tensor) -> torch.Tensor:
    """:func:`fp8_e4m3_round` of a fresh fp32 tensor, in place."""
    return _round_to_step_(y.clamp_(-FP8_MAX, FP8_MAX), 3, 2.0 ** -9)


def fp8_e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest FP8 E4M3 value (ties to even), saturating at +-448.

    fp32 rounds arithmetically (:func:`_round_to_step_`: 3 mantissa bits, subnormal step 2^-9), bit
    for bit the cast to ``torch.float8_e4m3fn`` (tested on every value and midpoint of the grid and
    on random inputs) at a fraction of its cost; other dtypes go through the cast.
    """
    if x.dtype == torch.float32:
        return _fp8_e4m3_round_(x.detach().clone())
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def quant_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bfloat16 and back."""
    return x.to(torch.bfloat16).to(x.dtype)


def _row_amax(x: torch.Tensor) -> torch.Tensor:
    """``x.abs().amax(-1, keepdim=True)`` without the tensor of absolute values: ``max(amax, -amin)``,
    the same numbers (negation and maximum are exact), about half the time on wide rows."""
    return torch.maximum(x.amax(dim=-1, keepdim=True), x.amin(dim=-1, keepdim=True).neg_())


def quant_fp8_per_row(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 with one scale per row (last dim): per token for activations, per token per head for
    a KV tensor of shape ``(..., head_dim)``."""
    s = _row_amax(x.detach()).clamp_min(_TINY) / FP8_MAX
    y = x.detach() / s
    if y.dtype == torch.float32:
        return _fp8_e4m3_round_(y).mul_(s)
    return fp8_e4m3_round(y) * s


def quant_fp8_blockwise(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 E4M3 for a ``(..., out, in)`` weight (leading dims: a stack of weights, each with its own
    tiles) with one scale per ``block x block`` tile (edge tiles may be smaller)."""
    *lead, out_f, in_f = w.shape
    nb_o, nb_i = -(-out_f // block), -(-in_f // block)
    pad = torch.zeros(*lead, nb_o * block, nb_i * block, dtype=w.dtype, device=w.device)
    pad[..., :out_f, :in_f] = w.detach()
    tiles = pad.view(*lead, nb_o, block, nb_i, block)
    s = tiles.abs().amax(dim=(-3, -1), keepdim=True).clamp_min(_TINY) / FP8_MAX  # (..., nb_o, 1, nb_i, 1)
    s_full = s.expand(*lead, nb_o, block, nb_i, block).reshape(*lead, nb_o * block, nb_i * block)
    s_full = s_full[..., :out_f, :in_f]
    return fp8_e4m3_round(w / s_full) * s_full


#: The non-negative E2M1 values, and the boundaries between neighbours: a tie goes to the even
#: mantissa, i.e. down at 0.25, 1.25, 2.5, 5 and up at 0.75, 1.75, 3.5.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)
_E2M1_TABLES: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _e2m1_tables(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (dtype, device)
    if key not in _E2M1_TABLES:
        mids = torch.tensor([(a + b) / 2 for a, b in zip(_E2M1, _E2M1[1:], strict=False)], dtype=dtype)
        # bucketize puts a value equal to a boundary in the lower bucket: a tie that goes up gets
        # the next smaller float as its boundary
        up = torch.tensor(_E2M1_TIE_UP)
        bounds = torch.where(up, torch.nextafter(mids, torch.tensor(-1.0, dtype=dtype)), mids)
        _E2M1_TABLES[key] = (bounds.to(device), torch.tensor(_E2M1, dtype=dtype, device=device))
    return _E2M1_TABLES[key]


def fp4_e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest FP4 E2M1 value (ties to even mantissa), saturating at +-6.

    Values above the last boundary (5) land on 6, so saturation needs no clamp; ties: 0.25 -> 0,
    0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4 (tested against a table built from
    the bits).
    """
    if x.dtype == torch.float32:
        return _fp4_e2m1_round_(x.detach().clone())
    bounds, grid = _e2m1_tables(x.dtype, x.device)
    return torch.copysign(grid[torch.bucketize(x.abs(), bounds)], x)


def _fp4_e2m1_round_(y: torch.Tensor) -> torch.Tensor:
    """:func:`fp4_e2m1_round` of a fresh fp32 tensor, in place, without the table: clamp to +-6
    (every value above the last boundary rounds to 6, and nothing at most 6 rounds above it), then
    1 mantissa bit with the subnormal step 0.5 (:func:`_round_to_step_`); ties go to the even
    mantissa as ``torch.round`` goes half to even."""
    return _round_to_step_(y.clamp_(-FP4_MAX, FP4_MAX), 1, 0.5)


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """``x`` ``(..., n)`` as ``(..., ceil(n / block), block)``, zero-padded at the end; and ``n``."""
    n = x.shape[-1]
    pad = -n % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, block), n


def quant_fp4_blockwise(x: torch.Tensor, block: int = 16, scale: str = "e4m3", *, _sync: bool = True) -> torch.Tensor:
    """FP4 E2M1 with one shared scale per ``block`` contiguous elements of the last dimension
    (an edge block may be shorter).

    ``scale="e4m3"`` (NVFP4): block scale ``e4m3(amax(block) / 6 / s_row) * s_row`` with the fp32
    row scale ``s_row = amax(row) / (448 * 6)``. ``scale="e8m0"`` (MXFP4): block scale
    ``2^(floor(log2 amax(block)) - 2)``. Elements are ``fp4_e2m1_round(x / scale) * scale``; an
    all-zero block stays zero.
    """
    xb, n = _blocks(x.detach(), block)  # (..., nb, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)  # (..., nb, 1)
    if scale == "e4m3":
        s_row = amax.amax(dim=-2, keepdim=True).clamp_min(_TINY) / (FP8_MAX * FP4_MAX)  # (..., 1, 1)
        s = fp8_e4m3_round(amax / FP4_MAX / s_row) * s_row
    elif scale == "e8m0":
        s = torch.exp2(torch.floor(torch.log2(amax.clamp_min(_TINY))) - 2)
    else:
        raise ConfigError("scale", f"must be 'e4m3' (NVFP4) or 'e8m0' (MXFP4), got {scale!r}")
    ok = s > 0
    if xb.dtype == torch.float32:
        q = _fp4_e2m1_round_(xb / torch.where(ok, s, 1.0)).mul_(s)
        if not _sync or not bool(ok.all()):  # a block of scale 0 (all zero, or below E4M3's range) is +0
            q = torch.where(ok, q, 0.0)
    else:
        q = torch.where(ok, fp4_e2m1_round(xb / torch.where(ok, s, 1.0)) * s, 0.0)
    return q.reshape(*q.shape[:-2], -1)[..., :n].to(x.dtype)


def _fp4(x: torch.Tensor, precision: str, sync: bool = True) -> torch.Tensor:
    return quant_fp4_blockwise(x, FP4_BLOCK[precision], "e4m3" if precision == "nvfp4" else "e8m0", _sync=sync)


def quant_int8_per_row(x: torch.Tensor) -> torch.Tensor:
    """Symmetric INT8 with one scale per row (last dim): per output channel for a ``(out, in)`` weight,
    per token for activations."""
    s = _row_amax(x.detach()).clamp_min(_TINY) / INT8_MAX
    return (x.detach() / s).round_().clamp_(-INT8_MAX, INT8_MAX).mul_(s)


def quant_weight(w: torch.Tensor, precision: str, *, block: int = 32) -> torch.Tensor:
    """The weight as the engine of ``precision`` stores it (straight-through gradient); ``block`` is
    the FP8 tile size (the FP4 formats have their own, :data:`FP4_BLOCK`)."""
    if precision == "fp32":
        return w
    if precision == "bf16":
        return ste(w, quant_bf16(w))
    if precision == "fp8":
        return ste(w, quant_fp8_blockwise(w, block))
    if precision == "int8":
        return ste(w, quant_int8_per_row(w))
    if precision in FP4_BLOCK:  # blocks of the input features of each output row
        return ste(w, _fp4(w, precision))
    EngineFormat.parse(precision)
    raise AssertionError  # unreachable


def quant_act(x: torch.Tensor, precision: str, *, fused: bool | None = None) -> torch.Tensor:
    """A linear layer's input activation (per-token scales), straight-through gradient.

    ``fused``: through the compiled kernel of :func:`fused_kernel` (True), eagerly (False), or by
    size (None: fused from :data:`FUSE_MIN_NUMEL` elements on); the same values either way.
    """
    if precision == "fp32":
        return x
    if precision == "bf16":
        return ste(x, quant_bf16(x))
    if precision not in QUANTIZED:
        EngineFormat.parse(precision)
    return ste(x, _dispatch(precision, x, fused))


def _values(x: torch.Tensor, fmt: str, sync: bool = True) -> torch.Tensor:
    """The quantized values (detached) of a per-row quantizer of format ``fmt`` (a :data:`QUANTIZED`
    precision; a KV cache of every FP8-cache precision is ``"fp8"``)."""
    if fmt == "fp8":
        return quant_fp8_per_row(x)
    if fmt == "int8":
        return quant_int8_per_row(x)
    return _fp4(x, fmt, sync)


#: Tensors of at least this many elements go through the compiled kernels when ``fused=None``
#: (a learner's activations: ``M x B x L x width``, tens of millions); smaller ones (a decode step's
#: ``M x B x width``, tests) stay eager, where a kernel's call overhead is not won back.
FUSE_MIN_NUMEL = 1 << 20
_KERNELS: dict[str, object] = {}
_FUSE_BROKEN: list[str] = []  # why compiling failed on this machine (then every call runs eagerly)


def fused_kernel(fmt: str):
    """The compiled kernel (``torch.compile``, inductor) of the per-row quantizer of format ``fmt``
    (``fp8``, ``int8``, ``nvfp4``, ``mxfp4``; an FP8 KV cache is ``fp8``), on rows ``(n, width)``
    (every quantizer here is per row, so a tensor is quantized as its rows; ``n`` is dynamic): one
    fused pass per tensor where the eager quantizer makes ten or more (scale, clamp, exponent bits,
    round, rescale), on the same fp32 arithmetic, so the same values bit for bit (tested on every
    representable value and midpoint, and on random tensors). Compiled on first use per process and
    width (seconds; inductor keeps the generated code in its on-disk cache, so a later process mostly
    loads it), kept for the process."""
    if fmt not in _KERNELS:
        _KERNELS[fmt] = torch.compile(_KERNEL_BODIES[fmt], dynamic=True, fullgraph=True)
    return _KERNELS[fmt]


# One function per kernel: torch.compile caches compiled graphs per code object, so kernels sharing
# one function would share (and exhaust) its recompilation limit. Compiled code reads nothing on the
# host (sync=False: a zero block is masked unconditionally, the same values).
def _fused_fp8(x: torch.Tensor) -> torch.Tensor:
    return quant_fp8_per_row(x)


def _fused_int8(x: torch.Tensor) -> torch.Tensor:
    return quant_int8_per_row(x)


def _fused_nvfp4(x: torch.Tensor) -> torch.Tensor:
    return _fp4(x, "nvfp4", sync=False)


def _fused_mxfp4(x: torch.Tensor) -> torch.Tensor:
    return _fp4(x, "mxfp4", sync=False)


_KERNEL_BODIES = {"fp8": _fused_fp8, "int8": _fused_int8, "nvfp4": _fused_nvfp4, "mxfp4": _fused_mxfp4}


def _dispatch(fmt: str, x: torch.Tensor, fused: bool | None) -> torch.Tensor:
    """``x``'s quantized values in format ``fmt``, through the compiled kernel or eagerly (``fused``)."""
    if fused is None:
        fused = (x.numel() >= FUSE_MIN_NUMEL and x.dtype == torch.float32 and x.device.type == "cpu"
                 and not _FUSE_BROKEN)
    if not fused:
        return _values(x.detach(), fmt)
    try:
        return fused_kernel(fmt)(x.detach().reshape(-1, x.shape[-1])).view(x.shape)
    except Exception as err:  # no C++ compiler, or inductor refuses this machine: the eager kernel, said once
        if fused is True and not _FUSE_BROKEN:
            raise
        if not _FUSE_BROKEN:
            import warnings

            _FUSE_BROKEN.append(f"{type(err).__name__}: {err}")
            warnings.warn(f"creditlab: the compiled quantizers failed ({_FUSE_BROKEN[0][:200]}); running the "
                          "eager ones (the same values, slower)", RuntimeWarning, stacklevel=3)
        return _values(x.detach(), fmt)


def quant_kv(x: torch.Tensor, precision: str, *, fused: bool | None = None) -> torch.Tensor:
    """A key/value tensor ``(B, H, L, head_dim)`` as the KV cache stores it: FP8 per token per head
    (KV8) for ``fp8`` and the FP4 engines (W4A4-KV8, as FP4 serving stacks keep an FP8 cache), bf16
    for ``bf16``; ``int8`` (W8A8 only) and ``fp32`` keep it exact. ``fused``: as :func:`quant_act`."""
    if precision in ("fp8", "nvfp4", "mxfp4"):
        return ste(x, _dispatch("fp8", x, fused))  # W4A4-KV8 / W8A8-KV8: an FP8 cache
    if precision == "bf16":
        return ste(x, quant_bf16(x))
    EngineFormat.parse(precision)
    return x
