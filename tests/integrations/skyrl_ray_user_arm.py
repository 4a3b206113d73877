"""A correction arm registered at import by a module that is not creditlab, as a user's module does
(tests/integrations/test_skyrl_ray.py): a SkyRL worker that loads ``creditlab_ray_half_tis`` from
SkyRL's registry imports this module, and so knows the arm."""

from __future__ import annotations

from creditlab.core.correction import register_correction, tis_weights

ARM = "ray_half_tis"


@register_correction(ARM)
def ray_half_tis(old_logprobs, rollout_logprobs, policy_mask, valid_mask=None, *, cap: float = 2.0):
    """Truncated token IS shrunk halfway to 1: ``1 + (min(r, cap) - 1) / 2``."""
    w, metrics = tis_weights(old_logprobs, rollout_logprobs, policy_mask, valid_mask, cap=cap)
    return 1.0 + 0.5 * (w - 1.0), metrics
