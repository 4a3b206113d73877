"""SkyRL's training entrypoint with creditlab: SkyRL's custom-algorithm pattern (examples/train/algorithms
in SkyRL's repository), with creditlab's policy losses, estimators and FORK environment registered by
importing ``creditlab.integrations.skyrl`` before ``initialize_ray``, its config section
``trainer.algorithm.creditlab`` (``CreditlabSkyRLConfig``) and ``CreditlabTrainerMixin`` before SkyRL's
``RayPPOTrainer`` (the turns from the ``loss_mask``, the global step for the PRM schedule, a dump per step).

    python examples/skyrl/main_creditlab.py trainer.algorithm.policy_loss_type=creditlab_interq ...

run_creditlab.sh passes the overrides. SkyRL's trainer needs Python >= 3.12 (docs/integrations.md).
"""

from __future__ import annotations

import sys

import ray
from skyrl.train.utils.utils import initialize_ray, validate_cfg

# importing it registers creditlab's losses, estimators and the creditlab_fork environment in SkyRL
from creditlab.integrations.skyrl import CreditlabSkyRLConfig, CreditlabTrainerMixin


def trainer_class():
    """SkyRL's ``RayPPOTrainer`` with ``CreditlabTrainerMixin`` before it: the mixin hands creditlab's
    estimators the turns (``loss_mask``) and the global step, and writes each step's batch to
    ``trainer.algorithm.creditlab.dump_dir``. (Built here, not at import: SkyRL's trainer module needs
    Python >= 3.12, the config part of this script does not.)"""
    from skyrl.train.trainer import RayPPOTrainer

    class CreditlabTrainer(CreditlabTrainerMixin, RayPPOTrainer):
        pass

    return CreditlabTrainer


def make_exp(cfg):
    """SkyRL's ``BasePPOExp`` building the trainer of :func:`trainer_class`."""
    from skyrl.train.entrypoints.main_base import BasePPOExp

    trainer = trainer_class()

    class CreditlabExp(BasePPOExp):
        def get_trainer(self, *args, **kwargs):
            return trainer(*args, **kwargs)

    return CreditlabExp(cfg)


@ray.remote(num_cpus=1)
def skyrl_entrypoint(cfg):
    make_exp(cfg).run()


def config(argv: list[str]):
    """SkyRL's config with creditlab's section, from Hydra-style overrides, checked by SkyRL's validate_cfg
    (the loss and the estimator must be in its registries)."""
    cfg = CreditlabSkyRLConfig.from_cli_overrides(argv)
    validate_cfg(cfg)
    return cfg


def main() -> None:
    cfg = config(sys.argv[1:])
    initialize_ray(cfg)  # syncs SkyRL's registries, creditlab's entries included, to its Ray actors
    ray.get(skyrl_entrypoint.remote(cfg))


if __name__ == "__main__":
    main()
