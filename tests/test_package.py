"""The distributions: ``python -m build`` makes an sdist and a wheel, and the wheel works installed.

The sdist and the wheel are built once per test session (``python -m build --no-isolation``: the
wheel is built from the sdist, so a file missing from the sdist fails here too; no download, the
dev extra installs ``build`` and setuptools). The installed-wheel test puts the wheel into a fresh
virtual environment outside the repository and runs the ``creditlab`` command from a directory
outside it, so the checkout's ``src/`` cannot leak in (``creditlab.__file__`` must be inside the
fresh environment). To stay within CI's time, that environment takes the heavy dependencies
(torch, pandas, ...) from the test environment instead of downloading them again: the wheel is
installed with ``pip install --no-deps``, then a ``.pth`` file appends the test environment's
site-packages *after* the fresh environment's own. What is tested is the wheel's own files: its
modules, its package data, its entry points and its metadata; its dependency list is checked by
reading the metadata, not by resolving it.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import site
import subprocess
import sys
import sysconfig
import tarfile
import time
import venv
import zipfile
from email.parser import Parser
from importlib.metadata import version
from pathlib import Path

import pytest

import creditlab

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = {"verl", "trl", "skyrl", "openrlhf", "ray", "offline", "docs", "dev"}


def _clean_env() -> dict[str, str]:
    """The environment of a subprocess that must see neither the checkout nor the test environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV",
                                                             "PYTHONSTARTUP", "PYTHONUSERBASE")}
    env["MPLBACKEND"] = "Agg"
    return env


@pytest.fixture(scope="session")
def dists(tmp_path_factory) -> dict[str, Path]:
    """``{"sdist": ..., "wheel": ...}`` built from the checkout, once per session."""
    pytest.importorskip("build", reason="the dev extra installs build")
    out = tmp_path_factory.mktemp("dist")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                       cwd=out, capture_output=True, text=True, env=_clean_env(), timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    sdists, wheels = sorted(out.glob("creditlab-*.tar.gz")), sorted(out.glob("creditlab-*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in out.iterdir())
    print(f"built {sdists[0].name} and {wheels[0].name} in {time.perf_counter() - t0:.1f} s")
    return {"sdist": sdists[0], "wheel": wheels[0]}


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(name).decode())


# --------------------------------------------------------------------------------------------
# the source tree


def test_version_flag_prints_the_package_version(capsys):
    from creditlab.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code in (0, None)
    assert capsys.readouterr().out.strip() == f"creditlab {creditlab.__version__}"


def test_a_missing_optional_dependency_is_one_line_naming_its_extra(monkeypatch, capsys):
    from creditlab.cli import main as cli_main

    def needs_trl(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'trl'", name="trl")

    monkeypatch.setattr(cli_main, "app", needs_trl)
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["anything"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == 'error: trl is not installed: pip install "creditlab[trl]"', err
    assert "\n" not in err

    # any other missing module (or a submodule of an installed package) is a bug: its traceback stays
    def needs_other(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'ray._private.x'", name="ray._private.x")

    monkeypatch.setattr(cli_main, "app", needs_other)
    with pytest.raises(ModuleNotFoundError):
        cli_main.main(["anything"])


def test_example_dump_is_the_docs_example():
    """The dump shipped as package data is ``docs/examples/toolshop_fp8.jsonl``, gzipped. After
    regenerating the docs example: ``gzip -9 -n -c docs/examples/toolshop_fp8.jsonl >
    src/creditlab/diagnose/examples/toolshop_fp8.jsonl.gz``."""
    from creditlab.diagnose.examples import example_path

    shipped = gzip.decompress(example_path().read_bytes())
    assert shipped == (ROOT / "docs" / "examples" / "toolshop_fp8.jsonl").read_bytes()
    with pytest.raises(KeyError, match="toolshop_fp8"):
        example_path("nope")


# --------------------------------------------------------------------------------------------
# the distributions


def _relative_targets(markdown: str) -> set[str]:
    """Relative link and image targets of a markdown text (no URL, no bare anchor)."""
    targets = set()
    for target in re.findall(r"\]\(([^)\s]+)\)", markdown):
        target = target.split("#", 1)[0]
        if target and not re.match(r"[a-z][a-z0-9+.-]*:", target):
            targets.add(target)
    return targets


def test_sdist_holds_what_the_readme_shows_and_links(dists):
    with tarfile.open(dists["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    readme = (ROOT / "README.md").read_text()
    shown = _relative_targets(readme)
    assert "docs/img/c_sweep.png" in shown and "docs/integrations.md" in shown  # the parser finds them
    missing = sorted(t for t in shown if t not in names)
    assert not missing, f"README targets missing from the sdist: {missing}"
    # and what those pages show and link (images, other pages), relative to the page
    for page in sorted(t for t in shown if t.endswith(".md")):
        folder = Path(page).parent
        for target in _relative_targets((ROOT / page).read_text()):
            path = os.path.normpath(folder / target)
            if (ROOT / path).is_file():  # links into the generated API pages or to directories are not files
                assert path in names, f"{page} links {target}, missing from the sdist"
    for name in ("README.md", "CHANGELOG.md", "pyproject.toml", "MANIFEST.in", "mkdocs.yml",
                 "src/creditlab/py.typed", "src/creditlab/diagnose/examples/toolshop_fp8.jsonl.gz",
                 "tests/test_package.py", "conftest.py", "tests/conftest.py"):
        assert name in names, name
    assert not [n for n in names if n.endswith((".pyc", ".pyo")) or "__pycache__" in n]


def test_unpacked_sdist_collects_and_runs_its_tests(dists, tmp_path):
    """The sdist is testable: unpacked outside the checkout, pytest collects its whole test tree (the
    root ``conftest.py`` holds the collection rules) and runs a few fast modules against the sdist's own
    ``src/`` (put first on the path, ahead of the checkout's editable install)."""
    with tarfile.open(dists["sdist"]) as tar:
        tar.extractall(tmp_path, filter="data")
    (root,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert (root / "conftest.py").is_file() and (root / "tests" / "conftest.py").is_file()
    env = _clean_env() | {"PYTHONPATH": str(root / "src")}

    def pytest_(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=root,
                              capture_output=True, text=True, env=env, timeout=600)

    where = subprocess.run([sys.executable, "-c", "import creditlab; print(creditlab.__file__)"], cwd=root,
                           capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert Path(where).resolve().is_relative_to(root.resolve()), f"{where} is not the sdist's own package"
    collected = pytest_("--collect-only", "-q")
    assert collected.returncode == 0, (collected.stdout + collected.stderr)[-4000:]
    per_file = {m[0]: int(m[1]) for m in re.findall(r"^(\S+\.py): (\d+)$", collected.stdout, re.M)}  # -qq
    assert sum(per_file.values()) >= 1000 and "tests/test_package.py" in per_file, collected.stdout[-2000:]
    ran = pytest_("-q", "tests/test_schedules.py", "tests/test_layers.py", "src/creditlab/core/schedules.py")
    assert ran.returncode == 0 and "[100%]" in ran.stdout, (ran.stdout + ran.stderr)[-4000:]


def test_wheel_contents_and_metadata(dists):
    with zipfile.ZipFile(dists["wheel"]) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "creditlab/py.typed" in names
    assert "creditlab/diagnose/examples/toolshop_fp8.jsonl.gz" in names
    if (ROOT / "src" / "creditlab" / "diagnose" / "calibration.json").is_file():  # diagnose's measured thresholds
        assert "creditlab/diagnose/calibration.json" in names
    assert "creditlab/diagnose/examples/__main__.py" in names
    assert not [n for n in names if n.startswith(("docs/", "tests/", "benchmarks/")) or n.endswith(".pyc")]
    assert re.search(r"^creditlab\s*=\s*creditlab\.cli\.main:main$", entry_points, re.M), entry_points

    meta = _metadata(dists["wheel"])
    assert meta["Name"] == "creditlab" and meta["Version"] == creditlab.__version__  # one version source
    assert EXTRAS <= set(meta.get_all("Provides-Extra"))
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist")]

    # a plain install computes the same intervals as the dev one: scipy (Student t) is a run-time dependency
    plain = {r.name for r in reqs if r.marker is None}
    assert {"torch", "numpy", "pandas", "scipy"} <= plain, plain

    def of(extra: str) -> dict[str, Requirement]:
        return {r.name: r for r in reqs if f'extra == "{extra}"' in str(r.marker)}

    assert str(of("verl")["verl"].specifier) == "==0.9.1"
    assert str(of("trl")["trl"].specifier) == "<=1.16.0,>=1.15.0"
    assert str(of("openrlhf")["openrlhf"].specifier) == "==0.11.2"
    skyrl = of("skyrl")
    assert str(skyrl["skyrl"].specifier) == "<=0.4.0,>=0.3.0"  # the two tested releases
    # what SkyRL's train modules import (its registry sync pickles with cloudpickle); orjson and pybase64
    # for 0.4.0's config, which only installs on Python >= 3.12
    assert {"ray", "jaxtyping", "loguru", "omegaconf", "pyyaml", "skyrl-gym", "torchdata", "cloudpickle",
            "orjson", "pybase64"} <= set(skyrl)
    for r in skyrl.values():
        want = '"3.12"' if r.name in ("orjson", "pybase64") else '"3.11"'
        assert f"python_version >= {want}" in str(r.marker), r
    # the CLI's one-line "pip install creditlab[EXTRA]" names an extra the package declares
    from creditlab.cli.main import EXTRAS as CLI_EXTRAS

    assert set(CLI_EXTRAS.values()) <= set(meta.get_all("Provides-Extra"))


@pytest.mark.slow
def test_installed_wheel_runs_outside_the_checkout(dists, tmp_path):
    t0 = time.perf_counter()
    assert ROOT not in tmp_path.resolve().parents, "the test must run outside the checkout"
    env_dir = tmp_path / "venv"
    pip_new_enough = tuple(int(p) for p in re.findall(r"\d+", version("pip"))[:2]) >= (22, 3)  # pip --python
    venv.create(env_dir, with_pip=not pip_new_enough, symlinks=os.name != "nt")
    bindir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    env = _clean_env()
    pip = ([sys.executable, "-m", "pip", "--python", str(python)] if pip_new_enough
           else [str(python), "-m", "pip"])
    r = subprocess.run([*pip, "install", "--no-deps", "--no-index", "--disable-pip-version-check", "-q",
                        str(dists["wheel"])], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]

    # the test environment's packages, after the fresh environment's own (its own creditlab wins)
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, env=env, check=True).stdout.strip()
    borrowed = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
                             + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else []))
    (Path(own) / "zz_test_environment.pth").write_text(
        "".join(f"{p}\n" for p in borrowed if Path(p).is_dir() and Path(p).resolve() != Path(own).resolve()))

    def run(*args: str, ok=(0,)) -> subprocess.CompletedProcess:
        r = subprocess.run([*args], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode in ok, f"{args} exited {r.returncode}:\n{(r.stdout + r.stderr)[-4000:]}"
        return r

    where = run(str(python), "-c", "import creditlab, creditlab.diagnose.examples as e; "
                                   "print(creditlab.__file__); print(e.example_path())").stdout.splitlines()
    for path in where:
        assert Path(path).resolve().is_relative_to(env_dir.resolve()), f"{path} is not from the installed wheel"

    creditlab_cmd = str(bindir / "creditlab")
    assert run(creditlab_cmd, "--version").stdout.strip() == f"creditlab {creditlab.__version__}"

    out = tmp_path / "coverage"
    run(creditlab_cmd, "lab", "coverage", "--quick", "--out", str(out))
    assert (out / "report.md").is_file() and list(out.glob("*.png"))

    dump = run(str(python), "-m", "creditlab.diagnose.examples").stdout.strip()
    assert Path(dump).resolve().is_relative_to(env_dir.resolve()) and dump.endswith(".jsonl.gz")
    report = tmp_path / "diagnose"
    run(creditlab_cmd, "diagnose", dump, "--out", str(report), "--quiet", ok=(0, 1))  # 1: a check fails
    assert (report / "report.md").is_file() and (report / "diagnose.json").is_file()
    assert json.loads((report / "diagnose.json").read_text())["input"]["trajectories"] == 64
    print(f"installed wheel: venv, install and three commands in {time.perf_counter() - t0:.1f} s")
