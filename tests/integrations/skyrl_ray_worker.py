"""What the Ray tasks of tests/integrations/test_skyrl_ray.py run in SkyRL's Ray workers.

The workers import this module by name (the test puts this folder on the workers' ``PYTHONPATH``). It
imports no creditlab module: a worker has creditlab only once it loads a creditlab function from
SkyRL's registry actor, as a worker of a SkyRL training run does.

SkyRL 0.3.0's ``skyrl.backends`` package ``__init__`` imports ``skyrl.tinker.types``, which pydantic 2
refuses on Python < 3.12; there this module, like tests/integrations/test_skyrl.py, loads
``skyrl.backends`` without running that ``__init__`` (its submodules, the registries, are SkyRL's
unchanged code). On Python >= 3.12 nothing is changed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import Any

import torch


def load_backends_without_init() -> None:
    """Make ``skyrl.backends`` importable on Python < 3.12 (see the module docstring)."""
    if "skyrl.backends" in sys.modules:
        return
    try:
        import skyrl.backends  # noqa: F401
    except Exception as err:
        if type(err).__name__ != "PydanticUserError":
            raise
        for name in [m for m in sys.modules if m == "skyrl.backends" or m.startswith("skyrl.backends.")]:
            del sys.modules[name]
        spec = importlib.util.find_spec("skyrl.backends")
        mod = types.ModuleType("skyrl.backends")
        mod.__path__ = list(spec.submodule_search_locations)
        mod.__spec__, mod.__file__, mod.__package__ = spec, spec.origin, "skyrl.backends"
        sys.modules["skyrl.backends"] = mod


load_backends_without_init()

#: The config the calls get: SkyRL's AlgorithmConfig fields the losses read, as the DictConfig of a
#: worker's overridden loss config (a plain mapping travels to a worker without importing creditlab).
CONFIG = {"eps_clip_low": 0.2, "eps_clip_high": 0.28, "clip_ratio_c": 3.0, "grpo_norm_by_std": True,
          "off_policy_correction": {"tis_ratio_type": None, "sequence_mask_metric": None,
                                    "outlier_token_is_threshold_low": None, "outlier_token_is_threshold_high": None,
                                    "token_mask_is_threshold_low": None, "token_mask_is_threshold_high": None},
          "creditlab": {}}


def inputs(seed: int = 0, B: int = 4, L: int = 12) -> dict[str, Any]:
    """Small tensors in SkyRL's layout: learner / engine log-probs, ``loss_mask`` (0 on observation
    tokens), per-sequence advantages, a reward on each row's last policy token, two groups of uids."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, L)
    for i in range(B):  # two turns with an observation between them
        a = int(torch.randint(2, 4, (1,), generator=g))
        mask[i, :a] = 1
        mask[i, a + 2: a + 2 + int(torch.randint(1, 4, (1,), generator=g))] = 1
    old = -(torch.rand(B, L, generator=g) * 2 + 0.05)
    rollout = torch.where(mask > 0, (old - 0.3 * torch.rand(B, L, generator=g)).clamp(max=0), torch.zeros(B, L))
    log_probs = (old + 0.1 * torch.randn(B, L, generator=g)).clamp(max=0)
    advantages = torch.randn(B, 1, generator=g).expand(B, L) * mask / mask.sum()
    rewards = torch.zeros(B, L)
    last = L - 1 - torch.argmax(mask.flip(1), dim=1)
    rewards[torch.arange(B), last] = torch.rand(B, generator=g)
    return {"log_probs": log_probs, "old_log_probs": old, "rollout_logprobs": rollout, "loss_mask": mask,
            "advantages": advantages, "rewards": rewards, "uids": [f"p{i // 2}" for i in range(B)]}


def call_registered(losses: list[str], estimators: list[str], seed: int = 0,
                    config: dict[str, Any] | None = None, watch: tuple[str, ...] = (), step: int = 5
                    ) -> dict[str, Any]:
    """Look every name up in SkyRL's registries and call it as SkyRL's worker (losses) and trainer
    (estimators) do, at global ``step`` (which the random keys of some geometries read; set as
    creditlab's trainer mixin sets it, once the lookups have imported creditlab); returns the values,
    the gradients, the metrics, and which of the modules in ``watch`` (plus
    ``creditlab.integrations.skyrl``) this process had imported before and after."""
    from omegaconf import OmegaConf
    from skyrl.backends.skyrl_train.utils import ppo_utils

    watch = ("creditlab.integrations.skyrl", *watch)
    before = {m: m in sys.modules for m in watch}
    cfg = OmegaConf.create(config if config is not None else CONFIG)
    x = inputs(seed)
    out: dict[str, Any] = {"pid": os.getpid(), "losses": {}, "estimators": {}}
    loss_fns = {name: ppo_utils.PolicyLossRegistry.get(name) for name in losses}
    estimator_fns = {name: ppo_utils.AdvantageEstimatorRegistry.get(name) for name in estimators}
    if "creditlab.integrations.skyrl" in sys.modules:
        sys.modules["creditlab.integrations.skyrl"].set_global_step(step)
    for name, fn in loss_fns.items():
        lp = x["log_probs"].clone().requires_grad_(True)
        loss, metrics = fn(lp, x["old_log_probs"], x["advantages"], config=cfg, loss_mask=x["loss_mask"],
                           rollout_logprobs=x["rollout_logprobs"])
        loss.backward()
        out["losses"][name] = {"loss": loss.detach(), "grad": lp.grad, "metrics": dict(metrics),
                               "type": f"{type(fn).__module__}.{type(fn).__qualname__}"}
    for name, fn in estimator_fns.items():
        adv, ret = fn(token_level_rewards=x["rewards"], response_mask=x["loss_mask"], index=x["uids"], config=cfg)
        out["estimators"][name] = {"advantages": adv, "returns": ret,
                                   "type": f"{type(fn).__module__}.{type(fn).__qualname__}"}
    out["imported_before"] = before
    out["imported_after"] = {m: m in sys.modules for m in watch}
    return out


def skyrl_registry_access(loss_name: str, estimator_name: str) -> tuple[Any, Any, Any, Any]:
    """The Ray task of SkyRL's own ``test_registry_cross_ray_process``
    (tests/backends/skyrl_train/utils/test_ppo_utils.py): look a policy loss and an advantage estimator
    up and call them as that test does."""
    import numpy as np
    from skyrl.backends.skyrl_train.utils.ppo_utils import AdvantageEstimatorRegistry, PolicyLossRegistry
    from skyrl.train.config import AlgorithmConfig

    policy_loss = PolicyLossRegistry.get(loss_name)
    adv_estimator = AdvantageEstimatorRegistry.get(estimator_name)
    loss, loss_metrics = policy_loss(log_probs=torch.tensor([[0.1]]), old_log_probs=torch.tensor([[0.2]]),
                                     advantages=torch.tensor([[1.0]]),
                                     config=AlgorithmConfig(policy_loss_type=loss_name))
    adv, ret = adv_estimator(token_level_rewards=torch.tensor([[1.0, 2.0]]), response_mask=torch.tensor([[1.0, 1.0]]),
                             index=np.array(["0", "0"]))
    return loss, loss_metrics, adv, ret
