"""``creditlab lab granularity``."""

from __future__ import annotations

import os

from creditlab.cli._labs import lab_command
from creditlab.lab.granularity import LAB
from creditlab.lab.toolshop_base import default_cache_dir


@lab_command(LAB)
def granularity(cfg):
    """Credit granularity on the toolshop agent: outcome GRPO, GRPO + an evidence process reward with a
    fixed or decayed weight, on-policy self-distillation from a reference-answer or a turn-advice teacher
    (-e selects arms), on short (C = 2-4) and long (C = 7-8) tasks. The base policy is trained on first use
    (a few minutes on 2 cores) and cached; set CREDITLAB_CACHE to choose where. Use --workers 2 on two cores."""
    import torch

    torch.set_num_threads(1)  # one intra-op thread, as each process worker gets (see lab_mismatch)
    return cfg.with_options(cache_dir=str(default_cache_dir(os.environ.get("CREDITLAB_CACHE"))))
