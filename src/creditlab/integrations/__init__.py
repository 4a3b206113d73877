"""Trainer integrations (each imports its trainer library; import the one you use).

* ``creditlab.integrations.verl``: rollout correction (InterQ-RL as ``rollout_is_weights``),
  registered advantage estimators and policy loss, FORK reward function, rollout dumps. Load it in
  every verl process with ``VERL_USE_EXTERNAL_MODULES=creditlab.integrations.verl``.
* ``creditlab.integrations.trl``: ``CreditlabGRPOTrainer`` and the FORK GRPO reward function.
* ``creditlab.integrations.skyrl``: policy losses for every correction arm, credit geometries and PRM
  mixing as advantage estimators, the FORK reward as a skyrl-gym environment, rollout dumps,
  registered through SkyRL's own registries.
* ``creditlab.integrations.openrlhf``: the rollout correction arms through OpenRLHF's ``PolicyLoss``, FORK
  as its ``reward_func``, rollout dumps and live checks from its ``Experience`` objects (OpenRLHF has no
  registry: :func:`~creditlab.integrations.openrlhf.install` patches two of its methods, run in every
  OpenRLHF process as Ray's ``worker_process_setup_hook``).

A missing trainer library is one ``ImportError`` line naming its extra (``pip install
"creditlab[trl]"``).

They build on ``core``, ``judge``, ``rewards`` and the dump schema of ``diagnose``, never on the
trainers or labs of creditlab. An edge of the package, like the CLI: a trainer process loads an
integration without our command, so an integration reads its own environment variables (e.g.
``CREDITLAB_ALLOW_UNTESTED_VERL``). See docs/integrations.md.

The integration contract
------------------------
Every module of :data:`INTEGRATIONS` (``creditlab.integrations.<name>``, ``<name>`` also its pip extra)
does the duties of :data:`CONTRACT`, each under the same name; what a duty takes is the trainer's own
object (a verl ``DataProto``, TRL's output dict, a SkyRL ``TrainingInputBatch``, OpenRLHF ``Experience``
objects), what it means and
returns is the same in every integration:

* ``TESTED_VERSIONS``: the trainer versions the module was tested with, a tuple of version strings.
* ``ALLOW_UNTESTED_ENV``: the environment variable that, set to ``1``, lets another version through
  (``CREDITLAB_ALLOW_UNTESTED_<TRAINER>``).
* ``check_version(version=None) -> str``: the trainer's version (default: the installed one), returned
  when it is tested or allowed; otherwise a :class:`~creditlab.errors.CreditlabError` of one line naming
  the version found, the tested ones and ``ALLOW_UNTESTED_ENV``.
* ``install() -> dict[str, tuple[str, ...]]``: registers creditlab in the trainer (after
  ``check_version()``; idempotent: a second call changes nothing) and returns what it registered:
  ``{where: names}``, ``where`` the trainer's config field that takes the names (``"wrapped"``: the
  trainer functions creditlab wraps, by dotted path), ``names`` what that field now accepts from
  creditlab. A trainer without registries returns ``{}`` (TRL: creditlab is a ``GRPOTrainer``
  subclass and a reward function, passed as objects).
* ``dump_rows(batch, ...) -> list[dict]``: the rows of one training batch in creditlab's rollout dump
  schema (docs/diagnose.md; ``creditlab.diagnose.write_dump`` writes them, ``creditlab diagnose``
  reads them), one per response.
* ``fork_reward``: the FORK reward (:mod:`creditlab.rewards.fork`) in the shape of the trainer's reward
  hook: verl's custom reward function itself (async, one sample per call), a factory of TRL's batched
  reward function (TRL passes no options to a reward function: the judge options go to the factory),
  SkyRL's per-response function (the skyrl-gym environment ``creditlab_fork`` calls it), a factory of
  OpenRLHF's ``reward_func(queries, prompts, labels)`` (the file of ``--reward.remote_url``). A judge
  failure is never a score of 0.
* ``live_metrics(batch, ...) -> dict[str, float]``: the values of ``creditlab diagnose``'s batch checks
  (:data:`creditlab.integrations._live.LIVE_CHECKS`) on one batch, read in one host read, keyed as the
  trainer logs them (``creditlab/<check id with / for .>``; verl: ``rollout_corr/creditlab/...``), NaN
  values left out.

The names the duties had before the contract (``rows_from_dataproto``, ``check_trl_version``...) are gone,
as the CHANGELOG lists: creditlab is not yet released and keeps no aliases. Adding a trainer:
docs/contributing.md, "Adding a trainer".
Importing this package imports no trainer library: :func:`integration` imports one module on demand.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from creditlab.errors import ConfigError

__all__ = ["CONTRACT", "INTEGRATIONS", "import_trainer", "installed_version", "integration"]

#: The integration modules, ``creditlab.integrations.<name>``; ``<name>`` is also the pip extra that
#: installs the tested trainer (``pip install "creditlab[<name>]"``).
INTEGRATIONS = ("verl", "trl", "skyrl", "openrlhf")

#: The duties every integration module does, under these names (the module docstring has the details).
CONTRACT: dict[str, str] = {
    "TESTED_VERSIONS": "tuple of the trainer versions (strings) the module was tested with",
    "ALLOW_UNTESTED_ENV": "name of the environment variable that, set to 1, lets an untested version through",
    "check_version": "check_version(version=None) -> str: the trainer version if tested or allowed, "
                     "else a one-line CreditlabError naming it, the tested versions and ALLOW_UNTESTED_ENV",
    "install": "install() -> {config field or 'wrapped': names}: registers creditlab in the trainer "
               "(after check_version; idempotent) and returns what it registered ({} without registries)",
    "dump_rows": "dump_rows(batch, ...) -> list[dict]: one row per response of a trainer batch, in the rollout "
                 "dump schema that creditlab diagnose reads",
    "fork_reward": "the FORK reward in the shape of the trainer's reward hook (a factory of it where the "
                   "trainer passes no options); a judge failure is never a score of 0",
    "live_metrics": "live_metrics(batch, ...) -> {metric: float}: diagnose's batch checks on one batch, keyed "
                    "as the trainer logs them (creditlab/...; verl: rollout_corr/creditlab/...), NaN left out",
}

def integration(name: str) -> ModuleType:
    """The module ``creditlab.integrations.<name>``, imported now (which imports the trainer library and,
    for verl and SkyRL, registers creditlab in it)."""
    if name not in INTEGRATIONS:
        raise ConfigError("integration", f"unknown {name!r}; valid: {', '.join(INTEGRATIONS)}")
    return importlib.import_module(f"{__name__}.{name}")


#: How each trainer is written in messages.
_LABELS = {"verl": "verl", "trl": "TRL", "skyrl": "SkyRL", "openrlhf": "OpenRLHF"}


def import_trainer(name: str) -> ModuleType:
    """The trainer library of the integration ``name``, imported; when it is not installed, one
    :class:`ImportError` line naming the extra that installs it (not a traceback into our import). A
    missing module *inside* an installed trainer is re-raised as it is: that is the trainer's problem."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:
            raise
        raise ImportError(f'creditlab.integrations.{name} needs {_LABELS[name]}: pip install "creditlab[{name}]"'
                          ) from None


def installed_version(name: str) -> str:
    """The installed version of the trainer ``name`` by its package metadata (else its ``__version__``, else
    ``"unknown"``): what :func:`check_version` compares with the tested versions."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return getattr(importlib.import_module(name), "__version__", "unknown")
