"""MkDocs hook: the API reference, one page per creditlab package, generated from the source tree.

Every public module (a name without a leading underscore) of ``src/creditlab/<package>/`` gets a
mkdocstrings section on ``api/<package>.md``, so a new module is in the reference without editing
any page; ``api/index.md`` lists the packages with the first line of their docstrings. The pages
exist only in the built site (``mkdocs build``), not in ``docs/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from mkdocs.structure.files import File

SRC = Path(__file__).resolve().parents[2] / "src" / "creditlab"
#: Packages of the reference, in the order of the layers (bottom first); ``cli`` is documented by ``--help``.
PACKAGES = ("core", "envs", "models", "judge", "rewards", "diagnose", "train", "lab", "labs", "integrations")


def _summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def _modules(package: str) -> list[str]:
    return sorted(p.stem for p in (SRC / package).glob("*.py") if not p.stem.startswith("_"))


def pages() -> dict[str, str]:
    """``{src_uri: markdown}`` of every generated page."""
    out = {}
    rows = [f"| [`creditlab.{p}`]({p}.md) | {_summary(SRC / p / '__init__.py')} |" for p in PACKAGES]
    out["api/index.md"] = "\n".join([
        "# API reference", "",
        "Generated from the docstrings of the installed source (`src/creditlab`), one page per package, "
        "in the order of the layers, bottom first: a package imports only from those above it in this "
        "table, imports inside functions included (`envs` and `models` sit side by side: neither imports "
        "the other), and `creditlab.errors` is importable from every package; the command line, "
        "`creditlab.cli`, is the top layer and is documented by `--help` "
        "([design.md](../design.md#1-architecture)). Shapes use the letters of the vocabulary "
        "(`B` trajectories, `L` tokens, `T` steps, ...).", "",
        "| package | what it holds |", "|---|---|", *rows,
        "| [`creditlab.errors`](errors.md) | The typed errors every layer raises. |", ""])
    for p in PACKAGES:
        lines = [f"# `creditlab.{p}`", "", f"::: creditlab.{p}", "    options:", "      members: false",
                 "      show_root_heading: false", ""]
        lines += [f"::: creditlab.{p}.{m}\n" for m in _modules(p)]
        out[f"api/{p}.md"] = "\n".join(lines)
    out["api/errors.md"] = "\n".join(["# `creditlab.errors`", "", "::: creditlab.errors", "    options:",
                                      "      show_root_heading: false", ""])
    return out


def on_files(files, config):
    for uri, content in pages().items():
        files.append(File.generated(config, uri, content=content))
    return files
