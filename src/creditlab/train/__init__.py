"""Training loops and rollout engines of the labs, each usable on its own.

* ``creditlab.train.chain``: batched GRPO of many small MLP policies in the hard-prerequisite chain
  (``creditlab.envs.chain``), every seed and arm of a cell as one tensor program (the coverage lab).
* ``creditlab.train.bagofunits``: the GRPO loop of the FORK bag-of-units world (``FactPolicy``,
  ``train_bag``; the fork lab).
* ``creditlab.train.toolshop_rollout``: the rollout engine of the multi-turn tool world (batched
  episodes of a tiny transformer agent, optionally through a fake-quant engine) and its evaluation.
* ``creditlab.train.toolshop_base``: the supervised base policy every toolshop run starts from,
  cached on disk under a directory the caller passes.
* ``creditlab.train.toolshop_grpo``: GRPO of toolshop agents (``train_grpo``) and of several arms
  trained as one stacked model (``train_grpo_stacked``), with correction arms and PRM mixing.
* ``creditlab.train.opsd``: on-policy self-distillation from a frozen teacher with privileged
  context (``train_opsd``, ``teacher_contexts``, ``teacher_logits``).
* ``creditlab.train.toolshop_dump``: rollout dumps in the schema of ``creditlab diagnose``.
* ``creditlab.train.common``: what the loops share.

This package imports ``core``, ``envs``, ``models`` and the dump schema of ``diagnose``, never the lab
machinery (``creditlab.lab``) or a lab (``creditlab.labs``); it reads no environment variable.
"""
