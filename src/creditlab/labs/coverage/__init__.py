"""The coverage lab: when does concentrating the terminal advantage on a few steps hurt?

A hard-prerequisite chain (``creditlab.envs.chain``) trained with GRPO under different credit
geometries at equal total credit (:func:`creditlab.train.chain.train_chain`; the one-update protocol
is :func:`creditlab.train.chain.single_update`). Eight experiments:

* ``c_sweep``: chain length C at fixed budget k — ``uniform`` vs ``concentrated`` on the first k
  causal steps. Expected: tie while C <= k, uniform ahead for every C > k.
* ``vd_sweep``: verifier density V_d at C=10 — ``uniform`` vs ``targeted`` (independent local
  signal on the exposed causal steps only), under independent and prefix exposure. Expected:
  uniform flat, targeted rising with V_d and passing uniform only at high density.
* ``shuffle``: ``per_turn`` (credit where the verifier saw progress) vs ``shuffled`` (the same
  weights on random steps) vs ``uniform``, at a dense and at a sparse verifier.
* ``dose``: credit on k random steps per rollout (fixed total credit), dose k = 1..T.
* ``real_agent``: the regime of real tool agents, whose verifier sees one step (the final write) of a
  chain of C = 5..8 (V_d = 1/C): uniform vs credit targeted at the final step.
* ``crossing``: where targeted credit passes uniform, on a finer V_d grid near the crossing, for
  independent-step and state-dependent chains, with a bootstrap interval over seeds.
* ``single_update``: the one-update protocol: many paired seeds, one update per arm from shared
  rollouts of a partly trained base policy (same advantages, same binding grad-norm clip), and the
  exact held-out improvement per arm (binary, uniform, per_turn, shuffled, discretized, reward_to_go).
* ``capability``: the one-update protocol at fixed capability points: base policies pre-trained
  (uniform credit) until their exact chain completion first reaches a target (about 25% and 70%),
  at the final-write verifier (C = 6 and 8); a gate table of the achieved completion, then the arms
  and an equivalence test fixed in advance: the 95% interval of per_turn - shuffled inside
  +/- 0.25 x (uniform - binary).

Each experiment is a module of this package (an :class:`~creditlab.lab.experiment.Experiment`) and one
line of :data:`EXPERIMENT_TABLE`; the lab itself holds what they share: the config, the description.
Every experiment is a set of cells (one per configuration value, all seeds and arms of the value in
one batched tensor program), persisted in a results store as they finish, so an interrupted run
resumes where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from creditlab.errors import ConfigError
from creditlab.lab.experiment import ExperimentLab
from creditlab.lab.protocol import LabConfig, LabOption, check_count
from creditlab.labs.coverage import (
    c_sweep,
    capability,
    crossing,
    dose,
    real_agent,
    shuffle,
    single_update,
    vd_sweep,
)
from creditlab.labs.coverage._common import run_cell
from creditlab.labs.coverage.capability import capability_gate, capability_test
from creditlab.train.chain import ChainTrainConfig

__all__ = ["EXPERIMENTS", "EXPERIMENT_TABLE", "LAB", "CoverageConfig", "CoverageLab", "capability_gate",
           "capability_test", "run_cell"]

#: The lab's experiments, in report order (``-e`` selects among them; adding one is one line here).
EXPERIMENT_TABLE = (c_sweep.EXPERIMENT, vd_sweep.EXPERIMENT, shuffle.EXPERIMENT, dose.EXPERIMENT,
                    real_agent.EXPERIMENT, crossing.EXPERIMENT, single_update.EXPERIMENT, capability.EXPERIMENT)
EXPERIMENTS = tuple(e.name for e in EXPERIMENT_TABLE)
#: Config fields every experiment shares (the others each belong to one experiment's ``fields``).
SHARED_FIELDS = ("train", "seeds", "experiments")


@dataclass(frozen=True)
class CoverageConfig(LabConfig):
    """Configuration of the whole coverage lab."""

    OPTIONS: ClassVar[dict[str, str]] = {"updates": "train.updates", "state_dependent": "train.state_dependent"}
    EXPERIMENTS: ClassVar[tuple[str, ...]] = EXPERIMENTS

    train: ChainTrainConfig = field(default_factory=ChainTrainConfig)
    """Training configuration shared by every cell (T, K, policy size, group, updates, lr, clip)."""
    seeds: int = 16
    """Seeds per arm and configuration (paired across arms)."""
    k: int = 3
    """Credit budget of the concentrated arm in the C sweep (number of causal steps it covers)."""
    Cs: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 10, 12)
    """Chain lengths of the C sweep."""
    vd_C: int = 10
    """Chain length of the verifier-density sweep."""
    vds: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)
    """Verifier densities of the V_d sweep."""
    shuffle_Cs: tuple[int, ...] = (6, 10)
    """Chain lengths of the shuffled control."""
    shuffle_vds: tuple[float, ...] = (1.0, 0.5)
    """Verifier densities of the shuffled control (share of causal steps whose progress is seen)."""
    dose_C: int = 4
    """Chain length of the dose-response experiment."""
    dose_ks: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12)
    """Numbers of randomly drawn steps that receive the credit in the dose-response experiment."""
    real_agent_Cs: tuple[int, ...] = (5, 6, 7, 8)
    """Chain lengths of the real-agent regime (the verifier sees only the final write: V_d = 1/C)."""
    crossing_vds: tuple[float, ...] = (0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)
    """V_d grid of the crossing experiment (finer near where targeted credit passes uniform)."""
    crossing_bootstrap: int = 2000
    """Bootstrap resamples of the seeds for the crossing point's interval."""
    single_seeds: int = 48
    """Paired seeds of the single-update experiment."""
    single_settings: tuple[tuple[str, int], ...] = (("independent", 6), ("final", 6), ("final", 8))
    """(exposure, C) of the single-update experiment: a dense verifier (every causal step) and the
    real-agent verifier (final write only)."""
    single_base_updates: int = 15
    """Uniform-credit updates that make the shared base policy (partly trained: score about 0.4 at C=6)."""
    single_rollouts: int = 64
    """Shared rollouts of the single update (fewer groups with one reward for every rollout)."""
    single_clip: float = 0.02
    """Global grad-norm clip of the single update (binds for every arm whose gradient is not zero)."""
    single_step: float = 5.0
    """SGD step of the single update (the parameter change has norm step x clip)."""
    capability_Cs: tuple[int, ...] = (6, 8)
    """Chain lengths of the capability experiment (final-write verifier: V_d = 1/C)."""
    capability_targets: tuple[float, ...] = (0.25, 0.70)
    """Chain-completion targets of the capability points: each base is pre-trained until its exact
    completion first reaches the target."""
    capability_seeds: int = 200
    """Paired seeds of the capability experiment."""
    capability_lr: float = 0.003
    """Adam learning rate of the pre-training (a tenth of the training lr, so one update overshoots a
    target by little: at 0.03 one update carried completion from below 0.25 to up to 0.64)."""
    capability_max_updates: int = 3000
    """Most pre-training updates; a seed that has not reached a target by then is left out there."""
    capability_margin: float = 0.25
    """Equivalence band: per_turn - shuffled must lie inside +/- margin x (uniform - binary)."""
    capability_gate_reached: float = 0.9
    """Gate: the least share of seeds that must reach a target."""
    capability_gate_overshoot: float = 0.05
    """Gate: the most the mean achieved completion may exceed its target."""
    experiments: tuple[str, ...] = EXPERIMENTS
    """Which experiments to run."""

    def validate(self) -> None:
        """The shared fields, then each experiment's own (selected or not: a run into the same --out may
        select it later), then the selection."""
        self.train.validate()
        check_count(self.seeds, "--seeds")
        for e in EXPERIMENT_TABLE:
            e.validate(self)
        if not self.experiments:
            raise ConfigError("--experiment", f"select at least one of {', '.join(EXPERIMENTS)}")
        for e in self.experiments:
            if e not in EXPERIMENTS:
                raise ConfigError("--experiment", f"unknown experiment {e!r}; valid: {', '.join(EXPERIMENTS)}")

    @classmethod
    def quick(cls) -> CoverageConfig:
        """A reduced sweep that shows the same shapes in well under a minute on 2 cores."""
        return cls(train=ChainTrainConfig(updates=150, eval_points=10), seeds=6,
                   vds=(0.0, 0.5, 0.75, 0.9, 1.0), shuffle_Cs=(10,), dose_ks=(1, 2, 4, 8, 12),
                   real_agent_Cs=(5, 8), crossing_vds=(0.7, 0.8, 0.9, 1.0), crossing_bootstrap=500,
                   single_seeds=32, single_settings=(("independent", 6), ("final", 6)), capability_seeds=48)


class CoverageLab(ExperimentLab):
    """Credit geometries on a hard-prerequisite chain (see the module docstring)."""

    name = "coverage"
    summary = "Credit geometries on a hard-prerequisite chain: C sweep, V_d sweep, shuffled control, dose."
    help = ("Credit geometries on a hard-prerequisite chain: C sweep, verifier-density sweep, shuffled control, "
            "dose-response, the one-update protocol and its capability points. Resumes an interrupted run in the "
            "same --out directory.")
    quick_help = "Reduced run: every experiment, fewer seeds and updates: about 20 s on 2 cores (nothing to build)."
    config_type = CoverageConfig
    experiments = EXPERIMENT_TABLE
    options = (LabOption("state_dependent", "The policy also observes the correct-prefix length and a broken bit.",
                         bool),)

    def describe(self, cfg: CoverageConfig) -> str:
        t = cfg.train
        return (f"Chain of T={t.T} steps, K={t.K} actions, MLP policy (hidden {t.hidden}), GRPO with {t.group} "
                f"rollouts per update, {t.updates} updates, Adam lr {t.lr}, grad-norm clip {t.max_grad_norm}, "
                f"{'state-dependent' if t.state_dependent else 'independent-step'} observations, {cfg.seeds} paired "
                "seeds. Every arm gets the same total credit |A_i| per rollout. Score: exact expected reward "
                "(correct-prefix length / C) of the final policy. Intervals: 95% t-intervals over seeds; "
                "differences are paired by seed (same task, initial weights and noise).")


LAB = CoverageLab()
