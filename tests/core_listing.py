"""The public tensor functions of ``creditlab.core`` that the per-function suites must each cover
(tests/test_core_meta.py, tests/test_core_cuda.py)."""

from __future__ import annotations

import importlib
import inspect


def public_core_functions(modules: tuple[str, ...]) -> list[str]:
    """``"module.name"`` of every function in the ``__all__`` of ``creditlab.core.<module>``, less
    constants, classes, the registries' own bookkeeping and parameter listings."""
    names = []
    for mod in modules:
        module = importlib.import_module(f"creditlab.core.{mod}")
        for name in module.__all__:
            obj = getattr(module, name)
            if not inspect.isfunction(obj) or name.startswith(("register", "unregister", "get_", "registered")):
                continue  # constants, classes, and the registries' own bookkeeping
            if name.endswith(("_params", "_needs")):
                continue
            names.append(f"{mod}.{name}")
    return names
