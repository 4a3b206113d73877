"""Trainer integrations (each imports its trainer library; import the one you use).

* :mod:`creditlab.integrations.verl`: rollout correction (InterQ-RL as ``rollout_is_weights``),
  registered advantage estimators and policy loss, FORK reward function. Load it in every verl
  process with ``VERL_USE_EXTERNAL_MODULES=creditlab.integrations.verl``.
* :mod:`creditlab.integrations.trl`: ``CreditlabGRPOTrainer`` and the FORK GRPO reward function.

See docs/integrations.md.
"""
