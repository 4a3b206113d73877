"""creditlab inside SkyRL (tested with SkyRL 0.3.0 and 0.4.0): policy losses with the rollout correction
arms, advantage estimators, FORK reward environment, rollout dumps.

Import this module in the driver script before ``initialize_ray(cfg)`` (SkyRL's own custom-algorithm
pattern): importing it registers everything in SkyRL's registries
(``skyrl.backends.skyrl_train.utils.ppo_utils.PolicyLossRegistry`` / ``AdvantageEstimatorRegistry``).
SkyRL's ``initialize_ray`` calls ``sync_registries()``, which serialises every registered function
with cloudpickle for SkyRL's named registry Ray actors; a worker's ``PolicyLossRegistry.get`` loads
from there the names it lacks. creditlab's entries are :class:`SkyRLFunction` objects that pickle
by reference, as a module-level function of this module and three strings (no code, closure or
module state): loading one in a worker imports ``creditlab.integrations.skyrl`` there, which
registers everything in that process, so creditlab must be installed where the workers run. An arm or
geometry registered outside creditlab travels as the name of the module that registered it, which
the worker imports; one registered in the driver script itself cannot be imported there, and calling
its loss in a worker raises a :class:`ConfigError` that says so. Importing this module again, or
calling :func:`install`, changes nothing; :func:`install` syncs with SkyRL's actors itself when Ray is
already initialised.

* **Policy losses** ``trainer.algorithm.policy_loss_type: creditlab_<arm>`` for every arm of
  :data:`creditlab.core.correction.CORRECTIONS` (``creditlab_interq``, ``creditlab_prefix``,
  ``creditlab_global``, ``creditlab_tis``, ``creditlab_mis``, ``creditlab_seq_is``, ``creditlab_geo``,
  ``creditlab_none``; call :func:`install` again after ``register_correction``). SkyRL runs its
  off-policy correction inside the loss, per micro-batch, from ``old_log_probs - rollout_logprobs``
  on the ``loss_mask`` (0 on tool / observation tokens); so does creditlab: the arm's weights
  multiply creditlab's clipped PPO surrogate (:func:`creditlab.core.losses.policy_loss`), reduced as
  a token sum (SkyRL pre-scales the advantages for its ``loss_reduction``). The arm's parameters
  live in ``trainer.algorithm.creditlab.correction_params``. SkyRL's masks
  (``off_policy_correction.sequence_mask_metric``, outlier and token masks) still compose with it;
  its TIS (``off_policy_correction.tis_ratio_type``) is refused (two corrections).
* **Advantage estimators** ``trainer.algorithm.advantage_estimator: creditlab_<geometry>`` for every
  geometry of :data:`creditlab.core.credit.GEOMETRIES`, knobs in ``trainer.algorithm.creditlab``
  (:class:`~creditlab.integrations._common.CreditSettings`), the same names and token layout as the
  verl integration. A turn is a maximal run of 1s of the policy mask: SkyRL hands estimators only
  ``response_mask`` (every response token), so per-turn geometries need the ``loss_mask``, which
  :class:`CreditlabTrainerMixin` passes (and the global step, for the PRM ``decay`` schedule).
* **FORK reward** as the skyrl-gym environment ``creditlab_fork`` (:class:`ForkEnv`) and the plain
  function :func:`fork_reward`.
* **Rollout dumps** for ``creditlab diagnose``: :func:`dump_rows` / :func:`dump_batch`
  on SkyRL's ``TrainingInputBatch``; :class:`CreditlabTrainerMixin` writes one per step when
  ``trainer.algorithm.creditlab.dump_dir`` is set.
* **Live checks**: :func:`live_metrics`, the values of ``creditlab diagnose``'s batch checks on a
  ``TrainingInputBatch`` as ``creditlab/<check>`` floats (:class:`CreditlabTrainerMixin` does not log
  them yet).

The names of the integration contract (:data:`creditlab.integrations.CONTRACT`): :data:`TESTED_VERSIONS`,
:data:`ALLOW_UNTESTED_ENV`, :func:`check_version`, :func:`install`, :func:`dump_rows`, :func:`fork_reward`,
:func:`live_metrics`.

``trainer.algorithm.creditlab`` is the field of :class:`CreditlabAlgorithmConfig`; build the config
with :data:`CreditlabSkyRLConfig` (SkyRL's ``make_config``), e.g.
``CreditlabSkyRLConfig.from_cli_overrides(sys.argv[1:])``.
"""

from __future__ import annotations

import contextvars
import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from creditlab.integrations import import_trainer, installed_version

skyrl = import_trainer("skyrl")

from creditlab.core import correction, credit
from creditlab.core._checks import check_tensor
from creditlab.errors import ConfigError, CreditlabError, InputError
from creditlab.integrations import _live
from creditlab.integrations._common import (
    CreditSettings,
    cached_fork_reward,
    check_tested_version,
    group_ids,
    run_sync,
    token_reward_advantages,
)

#: SkyRL versions this module was tested against (``CREDITLAB_ALLOW_UNTESTED_SKYRL=1`` lets another through).
TESTED_VERSIONS = ("0.3.0", "0.4.0")
#: Set to ``1`` to let an untested SkyRL version through (:func:`check_version`).
ALLOW_UNTESTED_ENV = "CREDITLAB_ALLOW_UNTESTED_SKYRL"
#: Registered names start with this: ``creditlab_<arm>`` (losses), ``creditlab_<geometry>`` (estimators).
PREFIX = "creditlab_"
#: The loss of creditlab's method, InterQ-RL.
DEFAULT_POLICY_LOSS = PREFIX + "interq"
#: skyrl-gym id of :class:`ForkEnv`.
FORK_ENV = "creditlab_fork"
#: Keys of ``trainer.algorithm.creditlab`` besides the :class:`CreditSettings` fields.
LOSS_KEYS = ("correction_params", "dual_clip")
DUMP_KEYS = ("dump_dir",)


def _skyrl_version() -> str:
    return installed_version("skyrl")


def check_version(version: str | None = None) -> str:
    """``version`` (default: the installed SkyRL's) when it is in :data:`TESTED_VERSIONS` or
    ``CREDITLAB_ALLOW_UNTESTED_SKYRL=1`` is set; otherwise a one-line :class:`CreditlabError` naming it
    (checked when this module is imported)."""
    found = _skyrl_version() if version is None else version
    return check_tested_version(__name__, "SkyRL", found, TESTED_VERSIONS, ALLOW_UNTESTED_ENV)


check_version()

try:
    from skyrl.backends.skyrl_train.utils import off_policy_correction_utils, ppo_utils
except Exception as err:  # pydantic refuses skyrl.tinker.types (imported by skyrl.backends) on Python < 3.12
    if type(err).__name__ == "PydanticUserError" and sys.version_info < (3, 12):
        raise CreditlabError(
            f"SkyRL {_skyrl_version()}: skyrl.backends (its trainer, workers and registries) does not import on "
            f"Python {sys.version_info.major}.{sys.version_info.minor} with pydantic 2 ({err}); use Python >= 3.12"
        ) from err
    raise
from skyrl.train.config import AlgorithmConfig, make_config  # noqa: E402
from skyrl_gym.envs import registration as _gym_registration  # noqa: E402
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput  # noqa: E402

__all__ = [
    "ADVANTAGE_ESTIMATOR",
    "DEFAULT_POLICY_LOSS",
    "ESTIMATORS",  # noqa: F822  (module __getattr__: live views of the registries)
    "FORK_ENV",
    "POLICY_LOSSES",  # noqa: F822
    "POLICY_LOSS",
    "PREFIX",
    "ALLOW_UNTESTED_ENV",
    "TESTED_VERSIONS",
    "CreditlabAlgorithmConfig",
    "CreditlabSkyRLConfig",
    "CreditlabTrainerMixin",
    "ForkEnv",
    "SkyRLFunction",
    "check_version",
    "dump_batch",
    "dump_rows",
    "fork_reward",
    "install",
    "live_metrics",
    "set_global_step",
]


def __getattr__(name: str):
    if name == "ESTIMATORS":
        return tuple(PREFIX + g for g in credit.GEOMETRIES)
    if name == "POLICY_LOSSES":
        return tuple(PREFIX + a for a in correction.CORRECTIONS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class CreditlabAlgorithmConfig(AlgorithmConfig):
    """SkyRL's ``AlgorithmConfig`` with creditlab's section ``trainer.algorithm.creditlab``: the
    :class:`CreditSettings` knobs of the estimators (``conserve``, ``prm_lambda``, ...),
    ``correction_params`` (the arm's parameters, e.g. ``{alpha_g: 0.5}``), ``dual_clip`` (apply
    ``clip_ratio_c`` as SkyRL's ``dual_clip`` loss does; default false, as its ``regular``) and
    ``dump_dir``."""

    creditlab: dict = field(default_factory=dict)


#: ``SkyRLTrainConfig`` whose ``trainer.algorithm`` is a :class:`CreditlabAlgorithmConfig`.
CreditlabSkyRLConfig = make_config(algorithm_cls=CreditlabAlgorithmConfig)


def _section(config: Any) -> dict:
    if config is None:
        return {}
    section = config.get("creditlab", None) if hasattr(config, "get") else getattr(config, "creditlab", None)
    if section is None:
        return {}
    if not hasattr(section, "items"):
        raise ConfigError("trainer.algorithm.creditlab", f"must be a mapping, got {section!r}")
    return dict(section.items())


def _get(config: Any, name: str, default: Any) -> Any:
    if config is None:
        return default
    if hasattr(config, "get") and not hasattr(config, "__dataclass_fields__"):
        return config.get(name, default)
    return getattr(config, name, default)


def _settings(config: Any) -> CreditSettings:
    section = {k: v for k, v in _section(config).items() if k not in LOSS_KEYS + DUMP_KEYS}
    return CreditSettings.from_mapping(section, "trainer.algorithm.creditlab")


# --------------------------------------------------------------------------------------------
# global step and policy mask handed to the estimators (SkyRL passes neither)

_STEP: list[int | None] = [None]
_POLICY_MASK: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("creditlab_skyrl_policy_mask",
                                                                                   default=None)


def set_global_step(step: int | None) -> None:
    """The trainer's global step, read by the PRM schedule and the random keys of the estimators
    (:class:`CreditlabTrainerMixin` sets it every step)."""
    _STEP[0] = None if step is None else int(step)


# --------------------------------------------------------------------------------------------
# policy losses


def _loss_fn(arm: str):
    def policy_loss_fn(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                       config: Any = None, loss_mask: torch.Tensor | None = None,
                       rollout_logprobs: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, correction.DeviceMetrics]:
        # SkyRL calls this once per micro-batch: it reads no tensor value on the host. The metrics
        # are a DeviceMetrics, read in one transfer where SkyRL's worker reads them (after its backward
        # pass); NaN/inf inputs are counted (creditlab/nonfinite_tokens, .../correction/nonfinite_tokens)
        # instead of raising. SkyRL's own masks (off_policy_correction) read what they read.
        from creditlab.core.losses import policy_loss

        where = "trainer.algorithm"
        section = _section(config)
        params = section.get("correction_params", None) or {}
        if not hasattr(params, "items"):
            raise ConfigError(f"{where}.creditlab.correction_params", f"must be a mapping, got {params!r}")
        params = dict(params.items())
        opc = _get(config, "off_policy_correction", None)
        if opc is not None and _get(opc, "tis_ratio_type", None) is not None:
            raise ConfigError(f"{where}.off_policy_correction.tis_ratio_type",
                              f"must be null with {PREFIX + arm!r} (creditlab computes the correction)")
        mask = torch.ones_like(log_probs) if loss_mask is None else loss_mask
        metrics = correction.DeviceMetrics()
        if rollout_logprobs is not None and opc is not None:
            # SkyRL's sequence / outlier / token masks compose with the arm (its TIS is refused above)
            _, opc_metrics, mask = off_policy_correction_utils.compute_off_policy_correction(
                old_log_probs, rollout_logprobs, mask, opc)
            metrics.add(opc_metrics)
        pm = mask > 0
        weights = None
        if rollout_logprobs is not None:
            with torch.no_grad():
                d = (old_log_probs.detach() - rollout_logprobs.detach()).double()
                # two parts <= 0 whose difference is the log ratio (core's log-prob check)
                w, m = correction.correction_weights(arm, d.clamp(max=0), (-d).clamp(max=0), pm, params=params,
                                                     check=False, sync=False)
            weights = w.to(log_probs.dtype)
            metrics.add(m, prefix="creditlab/")
        elif arm != "none":
            raise ConfigError("generator.sampling_params.logprobs",
                              f"{PREFIX + arm!r} needs the rollout engine's log-probs (rollout_logprobs), "
                              "which SkyRL did not pass")
        dual = bool(section.get("dual_clip", False))
        loss, lm = policy_loss(log_probs, old_log_probs, advantages, pm,
                               clip_low=float(_get(config, "eps_clip_low", 0.2)),
                               clip_high=float(_get(config, "eps_clip_high", 0.2)),
                               clip_ratio_c=float(_get(config, "clip_ratio_c", 3.0)) if dual else None,
                               weights=weights, agg="seq_mean_token_sum", check_finite=False)
        # SkyRL's reduction: the token sum (advantages arrive pre-scaled for its loss_reduction)
        loss = loss * pm.any(dim=1).sum().to(loss.dtype)
        metrics.add({"clip_ratio": lm["loss/clip_frac"], "creditlab/approx_kl": lm["loss/approx_kl"],
                     "creditlab/weight_mean": lm["loss/weight_mean"],
                     "creditlab/nonfinite_tokens": lm["loss/nonfinite_tokens"]})
        return loss, metrics

    policy_loss_fn.__name__ = policy_loss_fn.__qualname__ = f"creditlab_{arm}_policy_loss"
    policy_loss_fn.__doc__ = (f"SkyRL policy loss ``{PREFIX}{arm}``: creditlab's clipped surrogate times the "
                              f"``{arm}`` correction weights (see the module docstring).")
    return policy_loss_fn


# --------------------------------------------------------------------------------------------
# advantage estimators


def _advantages(geometry: str, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                config: Any = None, loss_mask: torch.Tensor | None = None, **kwargs: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """SkyRL advantage estimator ``creditlab_<geometry>``: per-turn credit geometry ``geometry``
    broadcast to the tokens of each turn (see the module docstring)."""
    settings = _settings(config)
    if _get(config, "grpo_norm_by_std", True) is False or kwargs.get("grpo_norm_by_std", True) is False:
        raise ConfigError("trainer.algorithm.grpo_norm_by_std",
                          "creditlab estimators always normalise by the group std; set it to true")
    dims: dict[str, int] = {}
    check_tensor("response_mask", response_mask, shape=("B", "L"), dims=dims)
    check_tensor("token_level_rewards", token_level_rewards, shape=("B", "L"), floating=True, finite=True,
                 dims=dims)
    policy = loss_mask if loss_mask is not None else _POLICY_MASK.get()
    if policy is None or tuple(policy.shape) != tuple(response_mask.shape):
        policy = response_mask
    adv = token_reward_advantages(geometry, token_level_rewards, (policy > 0) & (response_mask > 0),
                                  group_ids(index, "SkyRL's uids"), step=_STEP[0], settings=settings)
    return adv, adv.clone()


# --------------------------------------------------------------------------------------------
# what SkyRL's registries hold
#
# SkyRL serialises its registered functions with cloudpickle: sync_registries() (initialize_ray calls
# it) and register() once Ray is up send them to its registry actor, and every process that looks a
# name up loads what it lacks from there. cloudpickle pickles a function by value unless
# ``module.qualname`` resolves to it, and by value a function drags along the globals it reads (a
# closure over this module reached the ContextVar above, which no pickler takes). So SkyRL's
# registries get SkyRLFunction objects, which pickle as a call of the module-level _lookup (by
# reference) with three strings.

#: ``SkyRLFunction.kind`` of the policy losses and of the advantage estimators.
POLICY_LOSS, ADVANTAGE_ESTIMATOR = "policy loss", "advantage estimator"
_FIELDS = {POLICY_LOSS: "trainer.algorithm.policy_loss_type",
           ADVANTAGE_ESTIMATOR: "trainer.algorithm.advantage_estimator"}

_LOSS_FNS: dict[str, SkyRLFunction] = {}
_ESTIMATOR_FNS: dict[str, SkyRLFunction] = {}


def _table(kind: str) -> dict[str, SkyRLFunction]:
    if kind == POLICY_LOSS:
        return _LOSS_FNS
    if kind == ADVANTAGE_ESTIMATOR:
        return _ESTIMATOR_FNS
    raise ConfigError("kind", f"must be {POLICY_LOSS!r} or {ADVANTAGE_ESTIMATOR!r}, got {kind!r}")


def _family(kind: str) -> Any:
    return correction.CORRECTIONS if kind == POLICY_LOSS else credit.GEOMETRIES


class SkyRLFunction:
    """A creditlab policy loss (``kind`` :data:`POLICY_LOSS`, ``key`` an arm of
    :data:`~creditlab.core.correction.CORRECTIONS`) or advantage estimator (:data:`ADVANTAGE_ESTIMATOR`,
    a geometry of :data:`~creditlab.core.credit.GEOMETRIES`) as it sits in SkyRL's registry under
    ``creditlab_<key>``; called as SkyRL calls that registry's functions.

    It pickles by reference: as ``_lookup(kind, key, origin)``, a module-level function of this
    module. Loading it in another process (a Ray worker that looks the name up) imports
    ``creditlab.integrations.skyrl``, which registers every creditlab loss and estimator there; for an
    arm or geometry registered outside creditlab it also imports ``origin``, the module that
    registered it; then it returns that process's own object for the name. No function, closure or
    module state travels.
    """

    def __init__(self, kind: str, key: str, origin: str | None = None) -> None:
        _table(kind)  # checks kind
        self.kind, self.key, self.origin = kind, key, origin
        self.__name__ = self.__qualname__ = PREFIX + key
        self.__doc__ = (f"SkyRL policy loss ``{PREFIX}{key}``: creditlab's clipped surrogate times the ``{key}`` "
                        "correction weights (see creditlab.integrations.skyrl)." if kind == POLICY_LOSS else
                        f"SkyRL advantage estimator ``{PREFIX}{key}``: per-turn credit geometry ``{key}`` "
                        "broadcast to the tokens of each turn (see creditlab.integrations.skyrl).")
        self.origin_error: str | None = None  # why importing ``origin`` failed, for the call's error
        self._loss: Any = None  # _loss_fn(key), built at the first call (the arm may not exist before)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.key not in _family(self.kind):
            why = f" (importing {self.origin} failed: {self.origin_error})" if self.origin_error else ""
            raise ConfigError(_FIELDS[self.kind], (
                f"{self.__name__!r}: {_family(self.kind).family} {self.key!r} is not registered in this process "
                f"(pid {os.getpid()}){why}; register it when an importable module (not the driver script) is "
                "imported, then call creditlab.integrations.skyrl.install(): the processes that load "
                f"{self.__name__!r} from SkyRL's registry import that module"))
        if self.kind == ADVANTAGE_ESTIMATOR:
            return _advantages(self.key, *args, **kwargs)
        if self._loss is None:
            self._loss = _loss_fn(self.key)
        return self._loss(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[str, str, str | None]]:
        return _lookup, (self.kind, self.key, self.origin)

    def __repr__(self) -> str:
        return f"<creditlab SkyRL {self.kind} {self.__name__!r}>"


def _origin(kind: str, key: str) -> str | None:
    """The module to import for ``key`` in another process: the one that registered it, unless it is
    creditlab's own (importing this module registers those) or the driver script (not importable)."""
    module = getattr(_family(kind).get(key, None), "__module__", None)
    if not module or module == "__main__" or module == "creditlab" or module.startswith("creditlab."):
        return None
    return module


def _lookup(kind: str, key: str, origin: str | None = None) -> SkyRLFunction:
    """The :class:`SkyRLFunction` of ``kind`` for ``key`` in this process (what one unpickles to). Never
    raises for a missing arm or geometry: SkyRL loads every name of its registry actor at a lookup,
    and one failure would fail them all; calling the function raises instead."""
    error = None
    if PREFIX + key not in _table(kind) and origin is not None and key not in _family(kind):
        try:
            importlib.import_module(origin)
        except Exception as err:  # reported by the call
            error = f"{type(err).__name__}: {err}"
    fn = _function(kind, key, origin)
    fn.origin_error = fn.origin_error or error
    return fn


def _function(kind: str, key: str, origin: str | None) -> SkyRLFunction:
    table = _table(kind)
    if PREFIX + key not in table:
        table[PREFIX + key] = SkyRLFunction(kind, key, origin)
    return table[PREFIX + key]


# --------------------------------------------------------------------------------------------
# registration


def _register(registry: Any, name: str, fn: Any) -> bool:
    current = registry._functions.get(name)
    if current is fn:
        return False
    if current is not None:
        if not getattr(current, "__module__", "").startswith("creditlab."):
            raise CreditlabError(f"SkyRL {registry._function_type} {name!r} is already registered by "
                                 f"{current.__module__}")
        registry.unregister(name)
    registry.register(name, fn)
    return True


def install() -> dict[str, tuple[str, ...]]:
    """Register ``creditlab_<arm>`` in SkyRL's ``PolicyLossRegistry`` and ``creditlab_<geometry>`` in its
    ``AdvantageEstimatorRegistry`` for every arm and geometry registered now, and the skyrl-gym
    environment ``creditlab_fork`` (after :func:`check_version`; idempotent: call again after registering
    an arm or a geometry), and sync with SkyRL's registry actor when Ray is initialised.

    Returns what SkyRL now takes from creditlab, by config field: ``trainer.algorithm.policy_loss_type``,
    ``trainer.algorithm.advantage_estimator`` and ``environment.env_class``.
    """
    import ray

    check_version()
    for kind, registry, keys in ((POLICY_LOSS, ppo_utils.PolicyLossRegistry, correction.CORRECTIONS),
                                 (ADVANTAGE_ESTIMATOR, ppo_utils.AdvantageEstimatorRegistry, credit.GEOMETRIES)):
        for key in list(keys):
            _register(registry, PREFIX + key, _function(kind, key, _origin(kind, key)))
    _install_fork_env()
    if ray.is_initialized():
        ppo_utils.sync_registries()
    return {"trainer.algorithm.policy_loss_type": tuple(PREFIX + a for a in correction.CORRECTIONS),
            "trainer.algorithm.advantage_estimator": tuple(PREFIX + g for g in credit.GEOMETRIES),
            "environment.env_class": (FORK_ENV,)}


# --------------------------------------------------------------------------------------------
# trainer hook


class CreditlabTrainerMixin:
    """Put before SkyRL's ``RayPPOTrainer`` (``class Trainer(CreditlabTrainerMixin, RayPPOTrainer)``,
    returned by your ``BasePPOExp.get_trainer``): ``compute_advantages_and_returns`` hands the
    creditlab estimators the batch's ``loss_mask`` (the turns) and the global step, and writes the
    batch to ``trainer.algorithm.creditlab.dump_dir`` (:func:`dump_batch`) when it is set."""

    def compute_advantages_and_returns(self, data: Any) -> Any:
        set_global_step(getattr(self, "global_step", None))
        mask = data.get("loss_mask", None) if hasattr(data, "get") else None
        token = _POLICY_MASK.set(mask)
        try:
            out = super().compute_advantages_and_returns(data)
        finally:
            _POLICY_MASK.reset(token)
        algorithm = self.cfg.trainer.algorithm
        path = _section(algorithm).get("dump_dir")
        if path:
            dump_batch(out, path, step=getattr(self, "global_step", 0))
        return out


# --------------------------------------------------------------------------------------------
# rollout dumps


def dump_rows(data: Any, step: int = 0) -> list[dict[str, Any]]:
    """Dump rows (docs/diagnose.md) of a SkyRL ``TrainingInputBatch``, one per response.

    Reads ``loss_mask`` (the policy mask: 0 on tool / observation tokens), ``response_mask`` (the
    response tokens), the reward as the row sum of ``rewards``, the group from ``metadata["uids"]``,
    and, when both are there, the learner's ``action_log_probs`` and the engine's
    ``rollout_logprobs`` as the token columns. Rows added by SkyRL's padding
    (``metadata["pad_size"]``) are dropped.
    """
    from creditlab.diagnose.schema import LEARNER, rows_from_arrays

    meta = getattr(data, "metadata", None) or {}
    if "uids" not in meta:
        raise InputError("data.metadata: needs 'uids' (the GRPO group of each response)")
    for key in ("loss_mask", "response_mask", "rewards"):
        if data.get(key, None) is None:
            raise InputError(f"data: needs {key!r} to dump a SkyRL batch")
    B = len(meta["uids"])
    pm = data["loss_mask"][:B].detach().cpu() > 0
    valid = (data["response_mask"][:B].detach().cpu() > 0) | pm
    reward = data["rewards"][:B].detach().cpu().double().sum(-1)
    token: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    old, rollout = data.get("action_log_probs", None), data.get("rollout_logprobs", None)
    if old is not None and rollout is not None:
        token = {"logprobs": old[:B].detach().cpu().double(), "rollout_logprobs": rollout[:B].detach().cpu().double(),
                 "policy_mask": pm, "valid_mask": valid}
        extra["logprobs_source"] = [LEARNER] * B
    return rows_from_arrays(step=int(step), group_ids=[str(u) for u in meta["uids"]], rewards=reward,
                            response_length=pm.sum(1), **token, **extra)


def dump_batch(data: Any, path: str | os.PathLike, step: int = 0) -> Any:
    """Write :func:`dump_rows` of ``data`` to ``path`` (a directory gets one parquet part
    per call, a ``*.jsonl`` file is appended to); returns the file written."""
    from creditlab.diagnose.schema import write_dump

    return write_dump(dump_rows(data, step), path, append=True)


def live_metrics(data: Any) -> dict[str, float]:
    """The live check values (:mod:`creditlab.integrations._live`) of a SkyRL ``TrainingInputBatch`` as
    ``creditlab/<check>`` floats, read in one host read (NaN ones left out).

    From the batch :func:`dump_rows` reads: the learner's ``action_log_probs`` and the engine's
    ``rollout_logprobs`` on the ``loss_mask`` (without both, only ``baseline/degenerate_groups``), the
    groups from ``metadata["uids"]`` and the rewards as the row sums of ``rewards``; rows added by
    SkyRL's padding are left out.
    """
    meta = getattr(data, "metadata", None) or {}
    pm = data.get("loss_mask", None)
    if pm is None:
        return {}
    uids = meta.get("uids")
    B = len(uids) if uids is not None else pm.shape[0]
    pm = pm[:B] > 0
    old, rollout = data.get("action_log_probs", None), data.get("rollout_logprobs", None)
    if old is None or rollout is None:
        old = rollout = None
    else:
        old, rollout = old[:B], rollout[:B]
    groups = rewards = None
    if uids is not None and data.get("rewards", None) is not None:
        groups = group_ids(uids, "SkyRL's uids").to(pm.device)
        rewards = data["rewards"][:B].sum(-1)
    values = _live.to_floats(_live.batch_values(old, rollout, pm, group_ids=groups, rewards=rewards))
    return {k: v for k, v in values.items() if v == v}


# --------------------------------------------------------------------------------------------
# FORK reward


def fork_reward(prompt: Any, response: str, rubrics: Any, *, item_id: str = "", **judge: Any) -> dict[str, float]:
    """FORK of one response: ``{"score", "precision", "recall"}``. ``rubrics`` is a list of
    ``{"criterion", "points"}`` records (or its JSON text), ``prompt`` a string or chat messages;
    ``judge`` are the options of :func:`creditlab.integrations._common.cached_fork_reward` (``judge``,
    ``base_url``, ``model``, ``beta``, ...). A judge failure raises :class:`CreditlabError`."""
    from creditlab.rewards.items import ForkItem, parse_rubrics, render_messages

    where = f"sample {item_id or '?'}"
    item = ForkItem(item_id, render_messages(prompt, where, "prompt"), str(response),
                    parse_rubrics(rubrics, where, "ground_truth"))
    reward = cached_fork_reward(**judge)
    res = run_sync(reward.score([item]))[0]
    if res.reward is None:
        raise CreditlabError(f"FORK reward of {where}: {res.error}")
    return {"score": float(res.reward), "precision": float(res.precision), "recall": float(res.recall)}


class ForkEnv(BaseTextEnv):
    """skyrl-gym environment ``creditlab_fork``: one turn, rewarded with FORK.

    The dataset row's ``reward_spec.ground_truth`` holds the rubrics and ``reward_spec.judge`` the
    judge options (``judge``, ``base_url``, ``model``, ``beta``, ...; an ``env_config`` mapping, as a
    ``SkyRLGymConfig`` field ``creditlab_fork`` would pass, overrides them). ``metadata`` carries
    ``precision`` and ``recall``.
    """

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
        super().__init__()
        extras = extras or {}
        spec = extras.get("reward_spec") or {}
        if "ground_truth" not in spec:
            raise InputError("extras.reward_spec: needs 'ground_truth' (the rubrics) for creditlab_fork")
        self.rubrics = spec["ground_truth"]
        self.judge = dict(spec.get("judge") or {})
        if env_config is not None and hasattr(env_config, "items"):
            self.judge.update(env_config.items())
        self.item_id = str((extras.get("extra_info") or {}).get("index", ""))
        self.prompt: Any = None

    def init(self, prompt):
        self.prompt = prompt
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        res = fork_reward(self.prompt, action, self.rubrics, item_id=self.item_id, **self.judge)
        return BaseTextEnvStepOutput(observations=[], reward=res["score"], done=True,
                                     metadata={"precision": res["precision"], "recall": res["recall"]})


def _install_fork_env() -> None:
    if FORK_ENV not in _gym_registration.registry:
        _gym_registration.register(id=FORK_ENV, entry_point=f"{__name__}:ForkEnv")


install()
