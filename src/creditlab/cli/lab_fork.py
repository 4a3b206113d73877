"""``creditlab lab fork``."""

from __future__ import annotations

from creditlab.cli._labs import lab_command
from creditlab.lab.fork import LAB


@lab_command(LAB)
def fork(cfg):
    """FORK in a bag-of-units world: GRPO under recall-only, arithmetic-mean and FORK rewards, and the
    best fixed rule per reward. Resumes an interrupted run in the same --out directory."""
    return cfg
