"""The TRL integration against every tested TRL release, not only the installed one.

For each version of ``TESTED_VERSIONS`` other than the installed TRL, a throwaway virtual environment
holds that TRL wheel alone (``pip install --no-deps``) and reads everything else (torch, transformers,
accelerate, datasets, verl, creditlab's test tools...) from this environment, through a ``.pth`` file
that puts this environment's site-packages after its own: ``import trl`` finds the other release, the
rest is what this suite runs with. The TRL tests of this directory then run in it, with the trainer's
version check on (``CREDITLAB_ALLOW_UNTESTED_TRL`` unset)."""

from __future__ import annotations

import functools
import os
import re
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytest.importorskip("trl")

import trl  # noqa: E402

from creditlab.integrations.trl import TESTED_VERSIONS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# the test files that run TRL's code; ``-k trl`` picks the TRL tests of the mixed ones
TRL_TESTS = ["test_trl_trainer.py", "test_trl_dumps.py", "test_loss_equivalence.py", "test_registered_arm.py",
             "test_live_checks.py"]
OTHER_RELEASES = [v for v in TESTED_VERSIONS if v != trl.__version__]
# what pip says when it cannot reach the index (then the test is skipped, with pip's words)
OFFLINE = re.compile(r"No matching distribution found|Could not fetch URL|NewConnectionError|Max retries exceeded|"
                     r"Temporary failure in name resolution|Network is unreachable|ProxyError|ConnectTimeout|"
                     r"ReadTimeout|Name or service not known")

# A pytest plugin loaded in the other environment: it checks that ``trl`` is the release under test and
# not this environment's, and gives TRL 1.15.0's fused LM head a CPU path. That release computes the
# trainer's log-probs with a Triton kernel only (``trl.kernels.chunked_logprob`` imports triton and
# launches it on any tensor), so its GRPOTrainer cannot run on CPU (TRL 1.16.0 added a torch path); the
# stand-in below is the same computation in plain torch (autograd gives the gradient), used for CPU
# tensors only. Everything else is TRL's code.
PLUGIN = '''
import importlib.metadata

import torch
import trl
import trl.trainer.utils as _utils

assert trl.__version__ == importlib.metadata.version("trl") == {version!r}, (trl.__version__, trl.__file__)
assert trl.__file__.startswith({site!r}), trl.__file__

try:
    from trl.kernels import chunked_logprob as _chunked
    _HAS_CPU_PATH = hasattr(_chunked, "_use_triton")
except ImportError:  # no triton
    _HAS_CPU_PATH = False

if getattr(_utils, "add_fused_lm_head", None) is not None and not _HAS_CPU_PATH:
    _KERNEL = _utils.__dict__.get("_ChunkedLogProbFunction")

    class _TorchChunkedLogProb:
        @staticmethod
        def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
                  logit_scale=1.0, outputs=("log_probs",)):
            if _KERNEL is not None and hidden.device.type in ("cuda", "xpu"):
                return _KERNEL.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                     final_logit_softcapping, logit_scale, outputs)
            z = hidden @ weight.t() if bias is None else torch.addmm(bias, hidden, weight.t())
            z = z.float() * logit_scale
            if final_logit_softcapping is not None:
                z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
            logp = (z / temperature).log_softmax(-1)
            log_probs = logp.gather(-1, targets[:, None]).squeeze(-1)
            entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
            sq = torch.logsumexp(2 * logp, -1).detach() if "log_sum_sq_probs" in outputs else None
            mean = (z / temperature).mean(-1).detach() if "mean_logits" in outputs else None
            top1 = logp.argmax(-1) == targets if "is_top1" in outputs else None
            return log_probs, entropy, sq, mean, top1

    _utils._ChunkedLogProbFunction = _TorchChunkedLogProb
'''


def _this_site_packages() -> list[str]:
    dirs = [p for p in site.getsitepackages() if os.path.isdir(p)]
    return list(dict.fromkeys(dirs))


@functools.cache
def _env_with_trl(version: str, root: Path) -> Path:
    """A virtual environment under ``root`` with TRL ``version`` alone, this environment's packages after
    it; returns its interpreter. Skips when pip cannot reach the index."""
    env = root / f"trl-{version}"
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(env)
    python = env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
                          "--no-input", "--timeout", "20", "--retries", "1", "--target", purelib, f"trl=={version}"],
                         capture_output=True, text=True, timeout=300)
    if pip.returncode != 0:
        out = (pip.stdout + pip.stderr).strip()
        if OFFLINE.search(out):
            pytest.skip(f"pip could not download trl=={version}: {out.splitlines()[-1]}")
        raise AssertionError(f"pip install trl=={version} failed:\n{out}")
    # after the environment's own site-packages: site.addsitedir appends, and reads those folders' .pth
    # files too (an editable creditlab)
    lines = [f"import site; site.addsitedir({d!r})" for d in _this_site_packages()]
    Path(purelib, "zz_creditlab_parent_env.pth").write_text("\n".join(lines) + "\n")
    Path(purelib, "_creditlab_trl_release.py").write_text(PLUGIN.format(version=version, site=purelib))
    return python


@pytest.fixture(scope="session")
def trl_envs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl-releases")
    return lambda version: _env_with_trl(version, root)


@pytest.mark.skipif(not OTHER_RELEASES, reason="every tested TRL release is the installed one")
@pytest.mark.parametrize("version", OTHER_RELEASES)
def test_trl_tests_pass_with_every_other_tested_release(version, trl_envs, tmp_path):
    python = trl_envs(version)
    env = {k: v for k, v in os.environ.items() if k != "CREDITLAB_ALLOW_UNTESTED_TRL"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    cmd = [str(python), "-m", "pytest", "-p", "_creditlab_trl_release", "-p", "no:cacheprovider", "-o", "addopts=",
           "-q", "-x", "--disable-warnings", "--tb=short", "-k", "trl", f"--basetemp={tmp_path / 'basetemp'}",
           "--rootdir", str(ROOT), *[str(Path(__file__).parent / f) for f in TRL_TESTS]]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"TRL {version}: {' '.join(cmd)}\n{out[-6000:]}"
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 15, out[-2000:]  # the TRL tests ran, not a collection of none


def test_the_trl_extra_pins_the_tested_range():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.version import Version

    assert trl.__version__ in TESTED_VERSIONS
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["trl"]
    (req,) = [Requirement(r) for r in extra if Requirement(r).name == "trl"]
    tested = sorted(TESTED_VERSIONS, key=Version)
    assert {str(s) for s in req.specifier} == {f">={tested[0]}", f"<={tested[-1]}"}
