"""``creditlab lab coverage``."""

from __future__ import annotations

import typer

from creditlab.cli._labs import lab_command
from creditlab.lab.coverage import LAB


@lab_command(LAB)
def coverage(cfg, state_dependent: bool = typer.Option(
        False, "--state-dependent", help="The policy also observes the correct-prefix length and a broken bit.")):
    """Credit geometries on a hard-prerequisite chain: C sweep, verifier-density sweep, shuffled
    control, dose-response. Resumes an interrupted run in the same --out directory."""
    return cfg.with_options(state_dependent=state_dependent or None)
