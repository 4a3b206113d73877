"""A counter of host reads for the tests of the trainers' hot paths.

A host read is anything that needs a tensor's value on the CPU and so, on an accelerator, waits for
the device: reading a value (``.item()``, ``bool()``, ``float()``, ``.tolist()``, ``.numpy()``) and
the aten ops whose output shape depends on the values (``nonzero``, ``masked_select``, boolean
indexing, ``unique``, ...), which synchronise on CUDA. On CPU tensors none of them costs anything,
so :class:`HostSyncs` records them instead: the values are read through patched ``Tensor`` methods,
the ops through a ``TorchDispatchMode``. Each record names the function that made the call (the
first frame outside torch and this module), so a test can tell creditlab's reads from a trainer's own.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: ops whose output shape depends on the values, or that read one value
_SYNCING_OPS = {
    aten._local_scalar_dense.default,  # item(), bool(), float(), int() of a tensor
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    aten.bincount.default,
}
#: Tensor methods that read values without an aten op (the scalar ones go through _local_scalar_dense)
_METHODS = ("tolist", "numpy", "__array__")


@dataclass(frozen=True)
class Sync:
    what: str  # the method or aten op
    caller: str  # "module:function" that made the call

    @property
    def creditlab(self) -> bool:
        return self.caller.startswith("creditlab.")


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module != __name__ and module != "torch" and not module.startswith("torch."):
            return f"{module}:{frame.f_code.co_qualname}"
        frame = frame.f_back
    return "?"


class _Ops(TorchDispatchMode):
    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNCING_OPS:
            self.record(str(func))
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
                self.record(f"{func} with a boolean mask")
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.record(str(func))
        elif func in (aten._to_copy.default, aten.copy_.default):
            src = args[1] if func is aten.copy_.default else args[0]
            target = args[0].device if func is aten.copy_.default else kwargs.get("device")
            if isinstance(src, torch.Tensor) and src.device.type not in ("cpu", "meta") and target is not None \
                    and torch.device(target).type == "cpu":
                self.record(f"{func} to the host")
        return func(*args, **kwargs)


class HostSyncs:
    """``with HostSyncs() as syncs: ...`` then ``syncs.records`` (:class:`Sync` each, in order),
    ``syncs.creditlab`` (the ones creditlab's code made)."""

    def __init__(self):
        self.records: list[Sync] = []

    @property
    def creditlab(self) -> list[Sync]:
        return [r for r in self.records if r.creditlab]

    def _record(self, what: str) -> None:
        self.records.append(Sync(what, _caller()))

    def __enter__(self) -> HostSyncs:
        self.records.clear()
        self._saved = {n: getattr(torch.Tensor, n) for n in _METHODS}

        def wrap(name, f):
            def counted(t, *args, **kwargs):
                self._record(name)
                return f(t, *args, **kwargs)
            return counted

        for name, f in self._saved.items():
            setattr(torch.Tensor, name, wrap(name, f))
        self._mode = _Ops(self._record)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for name, f in self._saved.items():
            setattr(torch.Tensor, name, f)
