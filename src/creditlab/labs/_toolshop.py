"""What the three toolshop labs (:mod:`~creditlab.labs.toolshop`, :mod:`~creditlab.labs.mismatch`,
:mod:`~creditlab.labs.granularity`) share: the cached base policy (where it lives, built once in
the driver), the rollout dump files of their cells, and the knob rows they describe alike.

The base policy and its cache are :mod:`creditlab.train.toolshop_base`; the dump writer is
:mod:`creditlab.train.toolshop_dump`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from creditlab.train.toolshop_base import BaseConfig, default_cache_dir, prepare_base_policy
from creditlab.train.toolshop_grpo import GRPOConfig


class BasePolicyConfig:
    """Mixin of a toolshop lab's config (fields ``base``, ``cache_dir`` and ``dump_dir``); it adds
    no field (the annotations below only name the dataclass's own fields; a plain base class's
    annotations are not dataclass fields), so the config's fields, ``to_dict()`` and ``identity()``
    are the dataclass's own."""

    base: BaseConfig
    cache_dir: str | None
    dump_dir: str | None

    def cache(self) -> Path:
        """Where the base policy is cached: ``cache_dir``, or the user cache directory."""
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir(None)

    def context(self, dump: bool = False) -> dict[str, Any]:
        """The context of a cell (never part of its key): the cache directory, and ``dump_dir`` when
        ``dump`` and the run dumps rollouts."""
        return {"cache_dir": str(self.cache()), **({"dump_dir": self.dump_dir} if dump and self.dump_dir else {})}


class BasePolicyLab:
    """Mixin of a toolshop lab: :meth:`prepare` builds the shared base policy once in the driver."""

    name: str

    def prepare(self, cfg: Any, progress: bool = True) -> None:
        """Build the base policy once in the driver (cached), with a progress bar."""
        prepare_base_policy(cfg.base, cfg.cache(), f"{self.name} base policy", progress)


def fresh_dump(dump_dir: str | os.PathLike[str], name: str) -> Path:
    """``dump_dir/name``, its folder made and a stale file of that name removed: the cell is
    computed again from scratch, and so is its dump."""
    path = Path(dump_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    return path


def base_knob(b: BaseConfig) -> str:
    """The value of the ``base policy`` knob."""
    start = f", from base {b.init}" if b.init else ""
    return f"{b.n_demos} demos, noise {b.noise:g}, {b.steps} steps of {b.batch_size} at lr {b.lr:g}{start}"


def base_note(used: dict[str, BaseConfig], lab: dict[str, BaseConfig], what: str) -> str:
    """A sentence for a run whose base policies are not the lab's own (a ``--quick`` run's): which
    ones differ (``used`` and ``lab``: name -> config), and ``what`` they can and cannot show; empty
    when every one is the lab's."""
    other = [name for name, b in used.items() if b != lab[name]]
    if not other:
        return ""
    names = other[0] if len(other) == 1 else ", ".join(other[:-1]) + " and " + other[-1]
    return (f" This run's {names} {'is' if len(other) == 1 else 'are'} not the lab's (a quick build: fewer, "
            "smaller steps; its settings are in the configuration at the end): " + what)


def optim_knob(g: GRPOConfig) -> str:
    """The value of the ``optimisation`` knob."""
    return (f"lr {g.lr:g}, {g.minibatches} minibatches, clip {g.clip_low:g}/{g.clip_high:g}, "
            f"grad clip {g.grad_clip:g}")


def seeds_knob(seeds: int) -> tuple[str, str, str]:
    """The ``seeds`` knob row."""
    return ("seeds", str(seeds),
            "the fewest that give a 95% interval worth reading, for time; arms are paired seed by seed.")
