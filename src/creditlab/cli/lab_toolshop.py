"""``creditlab lab toolshop``."""

from __future__ import annotations

import os

import typer

from creditlab.cli._labs import lab_command
from creditlab.core.correction import CORRECTIONS, get_correction
from creditlab.lab.toolshop import LAB
from creditlab.lab.toolshop_base import default_cache_dir


@lab_command(LAB)
def toolshop(
    cfg,
    rollout_precision: str = typer.Option("fp32", "--rollout-precision",
                                          help="Rollout engine: fp32, bf16, fp8 (W8A8-KV8), int8 (W8A8)."),
    learner_precision: str = typer.Option("fp32", "--learner-precision",
                                          help="Learner: fp32, or the engine's precision for a QAT learner."),
    correction: str = typer.Option("none", "--correction",
                                   help=f"Per-token correction weights: {', '.join(CORRECTIONS)}."),
):
    """Multi-turn outcome GRPO on toolshop: success and K3(engine||learner) over updates, plus the
    execution-mismatch table of the base policy. The base policy is trained on first use (about two
    minutes on 2 cores) and cached; set CREDITLAB_CACHE to choose where."""
    from creditlab.errors import ConfigError

    try:
        get_correction(correction)
    except ConfigError as err:
        raise ConfigError("--correction", str(err).split(": ", 1)[-1]) from None
    cache = default_cache_dir(os.environ.get("CREDITLAB_CACHE"))
    return cfg.with_options(rollout_precision=rollout_precision, learner_precision=learner_precision,
                            correction=correction, cache_dir=str(cache))
