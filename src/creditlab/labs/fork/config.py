"""The fork lab's configuration (the experiments' fields are listed in their modules' ``fields``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from creditlab.envs.bagofunits import BagOfUnits
from creditlab.errors import ConfigError
from creditlab.lab.protocol import LabConfig, check_count
from creditlab.train.bagofunits import REWARD_ARMS, BagTrainConfig, reward_of

#: The lab's experiments (the names of its table, in report order; a test checks they match).
EXPERIMENTS = ("train", "oracle", "map", "deletion", "noise", "winrate", "pitfalls")
#: The correlation of the FORK paper's judge with its reference.
PAPER_R = 0.714
#: Largest |measured r - target r| at the chosen flip rate for the gate to pass.
GATE_TOL = 0.02


@dataclass(frozen=True)
class ForkLabConfig(BagTrainConfig, LabConfig):
    """Configuration of the fork lab: the training run of every cell (the fields of
    :class:`~creditlab.train.bagofunits.BagTrainConfig`: updates, prompts, group size, the world, the
    reward's tau and beta, evaluation) and the lab's own fields below."""

    EXPERIMENTS: ClassVar[tuple[str, ...]] = EXPERIMENTS

    arms: tuple[str, ...] = ("recall", "mean", "fork", "f2")
    """Reward arms (from ``recall``, ``mean``, ``fork``, ``f2``)."""
    seeds: int = 8
    """Seeds per arm (paired across arms)."""
    map_known: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    """``map``: shares of facts the policy knows (``known_prob``)."""
    map_lenient: tuple[bool, ...] = (True, False)
    """``map``: judge leniencies (True: paraphrases match the rubric; False: only the first statement)."""
    map_arms: tuple[str, ...] = ("recall", "mean", "fork", "f1.5")
    """``map``: reward arms (``f1.5``: a recall-leaning FORK)."""
    map_seeds: int = 4
    """``map``: paired seeds per cell."""
    map_updates: int = 200
    """``map``: GRPO updates per run."""
    deletion_noise: float = 0.25
    """``deletion``: probability that the direct necessity guess is wrong about a unit."""
    noise_targets: tuple[float, ...] = (1.0, 0.85, PAPER_R, 0.55)
    """``noise``: target correlations r of the noisy judge with the truth (1.0: the exact judge)."""
    noise_flips: tuple[float, ...] = tuple(round(0.01 * i, 2) for i in range(31))
    """``noise``: grid of flip rates the calibration measures r on (must include 0)."""
    noise_calib_prompts: int = 2048
    """``noise``: calibration prompts per initial policy (one per seed of ``noise_seeds``)."""
    noise_arms: tuple[str, ...] = ("recall", "mean", "fork")
    """``noise`` and ``winrate``: reward arms (include ``fork``: it is compared with the others)."""
    noise_seeds: int = 4
    """``noise`` and ``winrate``: paired seeds per cell."""
    noise_updates: int = 200
    """``noise`` and ``winrate``: GRPO updates per run."""
    pitfall_arms: tuple[str, ...] = ("recall", "mean", "fork")
    """``pitfalls``: reward arms."""
    pitfall_weights: tuple[float, ...] = (1.0, 0.0)
    """``pitfalls``: points of the absence rubric in the reward's rubric (0: left out of it, so only the
    evaluation knows the pitfall); one run per value."""
    pitfall_seeds: int = 4
    """``pitfalls``: paired seeds."""
    pitfall_updates: int = 200
    """``pitfalls``: GRPO updates per run."""
    experiments: tuple[str, ...] = EXPERIMENTS
    """``train``, ``oracle``, ``map``, ``deletion``, ``noise``, ``winrate``, ``pitfalls`` (module docstring)."""

    @classmethod
    def quick(cls) -> ForkLabConfig:
        """About 50 s on 2 cores (measured at load average 2-3)."""
        return cls(arms=("recall", "mean", "fork"), seeds=3, updates=100, prompts_per_update=16, eval_every=20,
                   eval_prompts=128, map_known=(0.25, 1.0), map_arms=("recall", "fork"), map_seeds=1, map_updates=50,
                   noise_targets=(1.0, PAPER_R, 0.55), noise_calib_prompts=1024, noise_seeds=2, noise_updates=50,
                   pitfall_seeds=2, pitfall_updates=50)

    def validate(self) -> None:
        """The shared fields (the training run, the world, the reward), then each experiment's own
        fields (selected or not: a later run into the same --out may select it), then the selection."""
        from creditlab.labs.fork import EXPERIMENT_TABLE

        if not self.arms:
            raise ConfigError("arms", f"needs at least one of {', '.join(REWARD_ARMS)}")
        for a in self.arms:
            reward_of(a, self.beta)
        for e in EXPERIMENT_TABLE:
            e.validate(self)
        self._validate_world()
        for name in ("seeds", "updates", "prompts_per_update", "eval_every", "eval_prompts", "hidden"):
            check_count(getattr(self, name), f"--{name}" if name in ("seeds", "updates") else name)
        if not self.experiments or any(e not in EXPERIMENTS for e in self.experiments):
            raise ConfigError("--experiment", f"got {list(self.experiments)}; valid: {', '.join(EXPERIMENTS)}")
        if self.group_size < 2:
            raise ConfigError("group_size", f"GRPO needs groups of at least 2, got {self.group_size}")
        if not self.lr > 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr}")
        if not self.tau > 0:
            raise ConfigError("tau", f"must be > 0, got {self.tau}")
        BagOfUnits(self.f_min, self.f_max, self.known_prob, self.max_units, lenient=self.lenient)  # its checks

    def _validate_world(self) -> None:
        """The fields of the noisy judge, true quality and the pitfalls of the world."""
        if not (0.0 <= self.judge_flip <= 0.5):
            raise ConfigError("judge_flip", f"must be in [0, 0.5], got {self.judge_flip}")
        for name in ("quality_wrong", "quality_pitfall", "pitfall_points"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(name, f"must be finite and >= 0, got {v}")
        if not math.isfinite(self.pitfall_prior):
            raise ConfigError("pitfall_prior", f"must be finite, got {self.pitfall_prior}")

