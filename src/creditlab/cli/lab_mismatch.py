"""``creditlab lab mismatch``."""

from __future__ import annotations

import os

from creditlab.cli._labs import lab_command
from creditlab.lab.mismatch import LAB
from creditlab.lab.toolshop_base import default_cache_dir


@lab_command(LAB)
def mismatch(cfg):
    """Quantized rollout engine vs learner in the multi-turn toolshop agent: arms fp32, naive, QAT,
    QAT+TIS, QAT+MIS, QAT+prefix, QAT+global, QAT+InterQ-RL at each engine precision of the dose
    (-e fp8 -e int8 -e nvfp4 -e mxfp4). The base policy is trained on first use (a few minutes on 2
    cores) and cached; set CREDITLAB_CACHE to choose where. Use --workers 2 on two cores."""
    import torch

    # One intra-op thread in this process, as the process executor gives each worker: the lab's
    # tensors are small, and a second thread on busy cores waits more than it works (a GRPO update
    # of the tiny trainer took 7x longer with two threads than with one on a shared 2-core machine).
    torch.set_num_threads(1)
    return cfg.with_options(cache_dir=str(default_cache_dir(os.environ.get("CREDITLAB_CACHE"))))
