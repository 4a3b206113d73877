"""The one small helper every public ``core`` function calls first.

A wrong shape, dtype, device, NaN/inf or a non-boolean mask raises
:class:`creditlab.errors.InputError` (a ``ValueError``) naming the argument.

Shape, dtype and device checks read no tensor value. Value checks (NaN/inf, signs, ranges) read one
boolean on the host; on ``meta`` tensors, which have no values, they are skipped (:func:`any_true`
is False there), so shape-only runs on ``meta`` exercise every other line of a function.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from creditlab.errors import InputError

Dim = int | str | None


def check_tensor(
    name: str,
    x: object,
    *,
    shape: Sequence[Dim] | None = None,
    ndim: int | None = None,
    floating: bool = False,
    boolean: bool = False,
    integer: bool = False,
    finite: bool = False,
    finite_where: torch.Tensor | None = None,
    dims: dict[str, int] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Validate ``x`` and return it.

    ``shape`` entries are ints (exact), ``None`` (any) or symbolic names such as ``"B"``; a
    symbolic name is bound in ``dims`` on first sight and must match afterwards, so one ``dims``
    dict shared across the checks of a function enforces consistent shapes between arguments.
    ``finite_where`` restricts the finiteness check to positions where the mask is True (masked
    positions may hold junk). ``device``: the device ``x`` must be on (e.g. the first argument's).
    ``finite=True`` costs one pass (the extremes of the checked values) and reads one boolean on the
    host (none on ``meta`` tensors, nor for an empty tensor).
    """
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise InputError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    if shape is not None:
        if x.dim() != len(shape):
            raise InputError(
                f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}"
            )
        for i, want in enumerate(shape):
            got = x.shape[i]
            if want is None:
                continue
            if isinstance(want, str):
                if dims is None:
                    continue
                bound = dims.setdefault(want, got)
                if bound != got:
                    raise InputError(
                        f"{name}: dimension {i} ({want}) is {got} but another argument has {want}={bound}"
                    )
            elif got != want:
                raise InputError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    if boolean and x.dtype != torch.bool:
        raise InputError(f"{name}: expected a boolean mask (torch.bool), got dtype {x.dtype}")
    if floating and not x.is_floating_point():
        raise InputError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if integer and (x.is_floating_point() or x.dtype == torch.bool or x.is_complex()):
        raise InputError(f"{name}: expected an integer tensor, got dtype {x.dtype}")
    if device is not None and x.device != device:
        raise InputError(f"{name}: is on device {x.device} but the other inputs are on {device}")
    if finite and x.is_floating_point() and x.numel() and x.device.type != "meta":
        # one pass and one read: the extremes of the checked values (NaN propagates to both)
        checked = x if finite_where is None else torch.where(finite_where, x, 0)
        lo, hi = torch.aminmax(checked)
        if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
            bad = ~torch.isfinite(x)
            if finite_where is not None:
                bad = bad & finite_where
            idx = tuple(int(i) for i in bad.nonzero()[0].tolist())
            raise InputError(f"{name}: contains NaN or inf (first at index {idx})")
    return x


def require_values(function: str, reason: str, *tensors: object) -> None:
    """Refuse ``meta`` tensors in a function that reads values on the host: an :class:`InputError`
    naming ``function`` and why it needs values (``reason``), instead of torch's error at the first
    read deep inside it. No host read; non-tensors are ignored."""
    if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tensors):
        raise InputError(f"{function}: needs tensors with values, got meta tensors (which have only shapes): "
                         f"{reason}")


def any_true(x: torch.Tensor) -> bool:
    """``bool(x.any())``: one host read; False on ``meta`` tensors (no values to check)."""
    return x.device.type != "meta" and bool(x.any())


def check_scalar(name: str, value: float, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False) -> float:
    """Validate a numeric scalar lies in ``[low, high]`` (or the open variants)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name}: expected a number, got {value!r}") from None
    if v != v:
        raise InputError(f"{name}: is NaN")
    if low is not None and (v < low or (low_open and v == low)):
        raise InputError(f"{name}: must be {'>' if low_open else '>='} {low}, got {v}")
    if high is not None and (v > high or (high_open and v == high)):
        raise InputError(f"{name}: must be {'<' if high_open else '<='} {high}, got {v}")
    return v
