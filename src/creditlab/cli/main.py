"""Entry point of the ``creditlab`` console script.

Typed creditlab errors (bad configuration, bad input) are printed as one line naming the
parameter or record, with a non-zero exit code and no traceback.
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

__all__ = ["app", "main"]


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; a :class:`CreditlabError` exits with code 2 and a one-line message."""
    try:
        app(args=argv, prog_name="creditlab")
    except CreditlabError as err:
        from rich.markup import escape

        # escaped: a message may hold brackets (pip install "creditlab[ray]") that rich would eat as markup
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(str(err))}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
