"""Trainer integrations (each imports its trainer library; import the one you use).

* ``creditlab.integrations.verl``: rollout correction (InterQ-RL as ``rollout_is_weights``),
  registered advantage estimators and policy loss, FORK reward function, rollout dumps. Load it in
  every verl process with ``VERL_USE_EXTERNAL_MODULES=creditlab.integrations.verl``.
* ``creditlab.integrations.trl``: ``CreditlabGRPOTrainer`` and the FORK GRPO reward function.
* ``creditlab.integrations.skyrl``: policy losses for every correction arm, credit geometries and PRM
  mixing as advantage estimators, the FORK reward as a skyrl-gym environment, rollout dumps,
  registered through SkyRL's own registries.

A missing trainer library is one ``ImportError`` line naming its extra (``pip install
"creditlab[trl]"``).

They build on ``core``, ``judge``, ``rewards`` and the dump schema of ``diagnose``, never on the
trainers or labs of creditlab. An edge of the package, like the CLI: a trainer process loads an
integration without our command, so an integration reads its own environment variables (e.g.
``CREDITLAB_ALLOW_UNTESTED_VERL``). See docs/integrations.md.
"""
