"""``creditlab lab coverage``."""

from __future__ import annotations

from creditlab.cli._apps import lab_app


@lab_app.command("coverage")
def coverage() -> None:
    """Placeholder removed when the coverage lab lands."""
    raise SystemExit("coverage lab not yet built")
