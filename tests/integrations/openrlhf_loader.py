"""OpenRLHF 0.11.2 for the tests: its real modules, installed from the package registry without its
dependencies and loaded without the GPU stack they do not use.

OpenRLHF's base dependencies pin deepspeed, flash-attn, vllm's transformers (5.15.0, where skyrl 0.3.0 pins
``<=5.8.0``) and more: it does not install on a CPU machine next to the other trainers. Its own tests load
its modules by path; so do these:

* :func:`openrlhf_root` runs ``pip install --no-deps --target <cache> openrlhf==0.11.2`` once (the cache is
  ``.pytest_cache/openrlhf-0.11.2`` of the checkout, or ``$CREDITLAB_OPENRLHF_SRC``; an install goes to a
  temporary folder renamed into place, so concurrent sessions do not see half of one) and removes the
  ``tests`` package the wheel also ships. A registry that cannot be reached skips the tests with the reason.
* :func:`load_openrlhf` appends the cache to ``sys.path`` (after everything else: ``import openrlhf`` and
  its distribution metadata, ``importlib.metadata.version("openrlhf")``) and imports the modules creditlab's
  integration uses with OpenRLHF's unchanged code: ``openrlhf.models.loss`` (``PolicyLoss``),
  ``openrlhf.trainer.ppo_utils.experience`` (``Experience``), ``...experience_maker``
  (``RemoteExperienceMaker``), ``openrlhf.utils.agent`` (``SingleTurnAgentExecutor``, which loads a
  ``reward_func`` file). The packages whose ``__init__`` imports the GPU stack (``openrlhf.models`` imports
  its ``Actor`` with flash-attn and deepspeed, ``openrlhf.utils`` its DeepSpeed strategy,
  ``openrlhf.trainer.ray`` vLLM) are registered as bare packages over their real folders; two imports
  nothing here calls stand in while a module is loaded, then are removed again: ``deepspeed`` (imported
  by ``openrlhf.models.utils`` for ``set_z3_leaf_modules`` only) and ``openrlhf.trainer.ray.launcher``
  (Ray actor groups, a type annotation of the experience maker).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

VERSION = "0.11.2"
ROOT = Path(__file__).resolve().parents[2]
#: pip's messages when the package registry cannot be reached
_OFFLINE = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
            "Network is unreachable", "No matching distribution found", "Could not fetch URL", "ProxyError",
            "ConnectTimeoutError", "Max retries exceeded")
_LOADED: dict[str, types.ModuleType] = {}


def openrlhf_root() -> Path:
    """The folder holding OpenRLHF 0.11.2's package (``openrlhf/``) and its ``.dist-info``, installed once."""
    cache = Path(os.environ.get("CREDITLAB_OPENRLHF_SRC") or ROOT / ".pytest_cache" / f"openrlhf-{VERSION}")
    if (cache / "openrlhf" / "models" / "loss.py").is_file() and (cache / f"openrlhf-{VERSION}.dist-info").is_dir():
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.parent / f".openrlhf-{VERSION}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--quiet",
                        "--disable-pip-version-check", "--target", str(tmp), f"openrlhf=={VERSION}"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        out = (r.stdout + r.stderr).strip()
        if any(s in out for s in _OFFLINE):
            pytest.skip(f"openrlhf=={VERSION} cannot be installed: the package registry is unreachable "
                        f"({out.splitlines()[-1] if out else 'pip failed'})", allow_module_level=True)
        pytest.fail(f"pip install --no-deps openrlhf=={VERSION} failed:\n{out[-3000:]}")
    shutil.rmtree(tmp / "tests", ignore_errors=True)  # the wheel's own test package: never on our path
    try:
        os.replace(tmp, cache)
    except OSError:  # another session installed it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return cache


def _bare_package(name: str, folder: Path) -> None:
    """``name`` as a package over ``folder`` whose ``__init__`` is not run."""
    if name in sys.modules:
        return
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    module = importlib.util.module_from_spec(spec)
    module.__path__ = [str(folder)]
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


def _import_with(name: str, stand_ins: dict[str, types.ModuleType]) -> types.ModuleType:
    """Import ``name`` with ``stand_ins`` in ``sys.modules`` for the time of the import (where the real module
    is not importable), then put back what was there."""
    saved = {k: sys.modules.get(k) for k in stand_ins}
    for k, m in stand_ins.items():
        if saved[k] is None:
            sys.modules[k] = m
    try:
        return importlib.import_module(name)
    finally:
        for k, m in saved.items():
            if m is None:
                sys.modules.pop(k, None)


def load_openrlhf() -> dict[str, types.ModuleType]:
    """OpenRLHF's real modules used by creditlab's integration and its tests (see the module docstring):
    ``{"loss", "experience", "experience_maker", "agent"}``."""
    if _LOADED:
        return _LOADED
    root = openrlhf_root()
    if str(root) not in sys.path:
        sys.path.append(str(root))
    importlib.invalidate_caches()
    import openrlhf

    pkg = Path(openrlhf.__file__).parent
    assert pkg.resolve() == (root / "openrlhf").resolve(), f"another openrlhf is importable: {openrlhf.__file__}"
    for name in ("models", "utils", "trainer", "trainer/ppo_utils", "trainer/ray"):
        if name == "trainer":
            importlib.import_module("openrlhf.trainer")  # its __init__ is empty
            continue
        _bare_package("openrlhf." + name.replace("/", "."), pkg / name)
    deepspeed = types.ModuleType("deepspeed")
    launcher = types.ModuleType("openrlhf.trainer.ray.launcher")
    launcher.RayActorGroup = type("RayActorGroup", (), {})
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    _LOADED["loss"] = _import_with("openrlhf.models.loss", {} if has_deepspeed else {"deepspeed": deepspeed})
    _LOADED["experience"] = importlib.import_module("openrlhf.trainer.ppo_utils.experience")
    _LOADED["experience_maker"] = _import_with("openrlhf.trainer.ppo_utils.experience_maker",
                                               {"openrlhf.trainer.ray.launcher": launcher})
    _LOADED["agent"] = importlib.import_module("openrlhf.utils.agent")
    return _LOADED


def parse_command_line(argv: list[str]) -> dict:
    """OpenRLHF's own command line of ``python -m openrlhf.cli.train_ppo_ray`` parsed by its real parser and
    checked by its real validation (the ``__main__`` block of ``openrlhf/cli/train_ppo_ray.py``, run in a
    subprocess), stopped where it starts training: the nested ``args`` as a dict. Its imports of Ray actors,
    vLLM engines and the DeepSpeed strategy are stand-ins there (``train`` is never run past its first line:
    Ray reports itself initialised and the strategy stand-in stops the run with the arguments)."""
    import json

    root = openrlhf_root()
    code = r'''
import json, runpy, sys, types
sys.path.append(sys.argv[1])
class Parsed(Exception):
    pass
def stand_in(name, **attrs):
    m = types.ModuleType(name); m.__dict__.update(attrs); sys.modules[name] = m; return m
def stop(args):
    def plain(x):
        return {k: plain(v) for k, v in vars(x).items()} if isinstance(x, types.SimpleNamespace) else x
    raise Parsed(json.dumps(plain(args), default=str))
stand_in("ray", is_initialized=lambda: True, init=lambda *a, **k: None)
stand_in("ray.util"); stand_in("ray.util.placement_group", placement_group=None)
import openrlhf
stand_in("openrlhf.trainer.ray", create_vllm_engines=None, __path__=[])
stand_in("openrlhf.trainer.ray.launcher", RayActorGroup=None, ReferenceModelActor=None, RewardModelActor=None)
stand_in("openrlhf.trainer.ray.ppo_actor", PolicyModelActor=None)
stand_in("openrlhf.trainer.ray.ppo_critic", CriticModelActor=None)
stand_in("openrlhf.utils", get_strategy=stop, __path__=[openrlhf.__path__[0] + "/utils"])
sys.argv = ["train_ppo_ray.py", *sys.argv[2:]]
try:
    runpy.run_path(openrlhf.__path__[0] + "/cli/train_ppo_ray.py", run_name="__main__")
except Parsed as p:
    print("ARGS " + str(p)); sys.exit(0)
sys.exit("train_ppo_ray.py returned without reaching train()")
'''
    r = subprocess.run([sys.executable, "-c", code, str(root), *argv], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("ARGS ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-3000:]
    return json.loads(lines[-1][len("ARGS "):])
