"""The mismatch lab's configuration, arms and constants."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

from creditlab.errors import ConfigError
from creditlab.lab.protocol import LabConfig, check_count
from creditlab.labs._toolshop import BasePolicyConfig
from creditlab.models.quant import QUANTIZED
from creditlab.train.toolshop_base import BaseConfig
from creditlab.train.toolshop_grpo import GRPOConfig

#: Arm -> (rollout engine, learner, correction); "P" is the engine precision of the dose.
ARMS: dict[str, tuple[str, str, str]] = {
    "fp32": ("fp32", "fp32", "none"),
    "naive": ("P", "fp32", "none"),
    "qat": ("P", "P", "none"),
    "qat_tis": ("P", "P", "tis"),
    "qat_mis": ("P", "P", "mis"),
    "qat_prefix": ("P", "P", "prefix"),
    "qat_global": ("P", "P", "global"),
    "qat_interq": ("P", "P", "interq"),
    # the ablation of the dual-clip protocol: masking only the tokens the engine found far likelier than the
    # learner (delta < -1, the lower side TIS acts on), and InterQ-RL composed with TIS
    "qat_mis_low": ("P", "P", "mis:lo=0.36787944117144233,hi=inf"),
    "qat_interq_tis": ("P", "P", "interq_tis"),
}
#: The arms of the paper-scale protocol (the default run), as registered: every arm but the dual-clip protocol's
#: ablation arms.
PAPER_ARMS = ("fp32", "naive", "qat", "qat_tis", "qat_mis", "qat_prefix", "qat_global", "qat_interq")
LABELS = {"fp32": "fp32", "naive": "naive", "qat": "QAT", "qat_tis": "QAT+TIS", "qat_mis": "QAT+MIS",
          "qat_prefix": "QAT+prefix", "qat_global": "QAT+global", "qat_interq": "QAT+InterQ",
          "qat_mis_low": "QAT+MIS(delta<-1)", "qat_interq_tis": "QAT+InterQxTIS"}
#: Engine precisions of the dose (``-e`` selects among them): every quantized format of the engine.
DOSES = QUANTIZED
DEFAULT_DOSES = ("fp8", "int8", "nvfp4")
#: Chain lengths (tool calls) of the lab's tasks, for the base policy and for training.
CHAIN_LENGTHS = (5, 6, 7, 8)
#: Thought tokens the demonstrator puts before every action (the lab's regime: see the knobs table).
THOUGHTS = 24
#: Thought tokens per action of the 2-core protocol (:meth:`MismatchConfig.two_core`).
TWO_CORE_THOUGHTS = 40
#: The gate: QAT's prefix drift entering the last turn, before training, must reach this (nats).
GATE_DRIFT = 0.5
#: Rollback threshold of the predictions (best - final held-out success).
ROLLBACK = 0.03
#: A training cell saves its models, optimizer and rows every this many updates (in the cache
#: directory's ``checkpoints/``, removed once the cell is stored), so an interrupted cell resumes where
#: it stopped, with the rows of an uninterrupted one; a cell that dumps rollouts does not.
CHECKPOINT_EVERY = 25
#: The code that computes the lab's cells (:func:`creditlab.lab.protocol.code_fingerprint`): a stored cell,
#: and a cell's checkpoint, is reused only while these modules are unchanged. The lab's tables, plots,
#: report and docs are not in it, so fixing one of them does not void a run. tests/test_compute_code.py
#: holds it to the modules the cells import.
COMPUTE_CODE = ("errors.py", "core/", "envs/", "models/", "train/", "lab/runner.py", "lab/store.py",
                "labs/_toolshop.py", "labs/mismatch/cells.py", "labs/mismatch/config.py", "labs/mismatch/estimator.py",
                "labs/mismatch/planted.py", "labs/mismatch/sample.py", "labs/mismatch/transfer.py")
UNIT, DIFF = (0.0, 1.0), (-1.0, 1.0)
METRICS = ("final", "best", "rollback", "aulc")


def arm_triple(arm: str, dose: str) -> tuple[str, str, str]:
    """(rollout engine, learner precision, correction) of ``arm`` at engine precision ``dose``."""
    if arm not in ARMS:
        raise ConfigError("arms", f"unknown arm {arm!r}; valid: {', '.join(ARMS)}")
    e, learner, corr = ARMS[arm]
    return (dose if e == "P" else e, dose if learner == "P" else learner, corr)


@dataclass(frozen=True)
class MismatchConfig(BasePolicyConfig, LabConfig):
    """Configuration of the mismatch lab."""

    OPTIONS: ClassVar[dict[str, str]] = {"updates": "grpo.updates"}
    EXPERIMENTS: ClassVar[tuple[str, ...]] = DOSES
    """The ``-e`` choices: the doses, and any other experiment of the lab's table, which sets them
    (``labs/mismatch/__init__.py``: adding an experiment does not touch this module, which computes cells)."""
    EXPERIMENT_TABLE: ClassVar[tuple] = ()
    """The lab's experiments, whose ``validate`` checks the fields each owns (set by ``labs/mismatch/__init__.py``
    from its table, as ``EXPERIMENTS``: this module, which the cells import, does not import the lab)."""
    PROTOCOLS: ClassVar[dict[str, str]] = {"two-core": "two_core", "dual-clip": "dual_clip", "transfer": "transfer"}
    SELECTION: ClassVar[tuple[str, ...]] = ("experiments", "cache_dir", "smooth", "dose_tasks", "dump_dir",
                                            "planted_strengths", "planted_arms", "planted_variants", "planted_seeds",
                                            "planted_updates", "planted_tasks", "estimator_doses",
                                            "estimator_batches", "estimator_planted_batches", "estimator_qat_updates",
                                            "sample_updates", "transfer_worlds", "transfer_points", "transfer_seeds",
                                            "transfer_tasks")

    base: BaseConfig = field(default_factory=lambda: _base_config())
    """Supervised warm start of the shared base policy (cached): chains of 5 to 8 tool calls, each
    action led by :data:`THOUGHTS` uniformly random thought tokens."""
    grpo: GRPOConfig = field(default_factory=lambda: _grpo_config(updates=400, tasks_per_update=8, group_size=8,
                                                                  eval_every=10, eval_tasks=256))
    """Outcome GRPO shared by every arm (its precisions, correction and seed are set per arm)."""
    seeds: int = 5
    """Paired seeds per arm (task stream, sampling uniforms, minibatch order)."""
    arms: tuple[str, ...] = PAPER_ARMS
    """Arms to train (see ARMS)."""
    dose_tasks: int = 256
    """Held-out trajectories of the base policy per engine in the dose table (passed to that cell,
    so it is in that cell's key, not in the run's identity)."""
    smooth: int = 3
    """Evaluation points averaged for final and best success (a window of smooth * eval_every updates);
    it only changes the tables, so it is not part of the run's identity."""
    experiments: tuple[str, ...] = DEFAULT_DOSES
    """Engine precisions of the dose to run (fp8, int8, nvfp4, mxfp4)."""
    protocol: str = "paper"
    """The registered protocol whose predictions a run tests (recorded at its start): ``paper`` (the
    paper-scale run), ``two-core`` (:meth:`two_core`) or ``dual-clip`` (:meth:`dual_clip`)."""
    map_doses: tuple[str, ...] = ()
    """Doses that run only ``map_arms`` x ``map_seeds`` (the phase map's points: the learner's drift
    against its rollback), not every arm; empty: every selected dose runs ``arms`` x ``seeds``."""
    map_arms: tuple[str, ...] = ("naive", "qat")
    """The arms of a ``map_doses`` dose."""
    map_seeds: int = 2
    """Paired seeds of a ``map_doses`` dose (seeds 0 .. map_seeds - 1, paired with the other doses')."""
    cache_dir: str | None = None
    """Where the base policy is cached (None: the user cache directory); never changes a number."""
    dump_dir: str | None = None
    """Write every training update's rollouts in the ``creditlab diagnose`` schema here (one JSONL
    file per dose, arm and seed, for the cells this run computes); never changes a number."""
    planted_strengths: tuple[float, ...] = (0.1, 0.2, 0.4)
    """Strengths of the planted engine (experiment ``planted``): at turn k it shifts the logits of the tool-call
    tokens by ``strength * (k + 1) * z``. This and the other fields of the planted and estimator experiments are
    passed to their cells (in their keys), so they are not part of the run's identity (SELECTION), and the
    other cells' keys do not depend on them."""
    planted_arms: tuple[str, ...] = ("none", "tis", "interq", "exact_prefix")
    """Arms of the planted experiment (``labs/mismatch/planted.py``, PLANTED_ARMS)."""
    planted_variants: tuple[str, ...] = ("thoughts", "thought_free")
    """Worlds of the planted experiment: the lab's 24-thought base, and a thought-free base."""
    planted_seeds: int = 4
    """Paired seeds of the planted experiment."""
    planted_updates: int = 50
    """Updates of every planted run (the rest of the training settings are ``grpo``'s)."""
    planted_tasks: int = 128
    """Held-out trajectories of the planted gate per world and strength."""
    estimator_doses: tuple[str, ...] = ("nvfp4", "mxfp4", "planted:0.2", "planted:0.4")
    """Doses of the known-answer test of the estimator (experiment ``estimator``): engine precisions, and planted
    engines (``planted:<strength>``, in the thought-free world of the planted experiment)."""
    estimator_batches: int = 64
    """Batches (of ``grpo.tasks_per_update`` x ``grpo.group_size``) per sampler in each estimator cell."""
    estimator_planted_batches: int = 256
    """Batches per sampler in an estimator cell at a planted dose (cheap; 64 did not resolve its bias)."""
    estimator_qat_updates: int = 30
    """Updates of QAT training (no correction) that make the estimator's QAT checkpoint."""
    sample_updates: int = 2
    """Updates of the per-token sample (experiment ``sample``; passed to its cell, not in the run's identity)."""
    transfer_worlds: tuple[str, ...] = ("thoughts40", "thoughts24")
    """Worlds of the transfer experiment (``labs/mismatch/transfer.py``): the 2-core protocol's 40-thought world and
    the lab's 24-thought world. This and the other transfer fields are passed to its cells (SELECTION)."""
    transfer_points: tuple[str, ...] = ("naive@fp8", "naive@nvfp4", "qat@nvfp4", "naive@mxfp4", "qat@mxfp4")
    """Points of the transfer experiment's phase map (``arm@dose``, arm naive or qat); the fp32 arm trains beside
    them in every cell (the world's noise band)."""
    transfer_seeds: int = 4
    """Paired seeds of the transfer experiment."""
    transfer_tasks: int = 128
    """Held-out trajectories per engine in the transfer experiment's gate."""
    eval_on: str = field(default="engine", metadata={"absent": "fp32"})
    """The engine that scores held-out success: ``engine`` (each arm's own rollout engine, the quantized
    endpoint users deploy: ``eval/*``, with the fp32 engine's score beside it in ``eval_fp32/*``) or ``fp32``
    (the fp32 engine only: the learned policy without its engine; the 2-core protocol's, registered
    before this field existed)."""

    @classmethod
    def quick(cls) -> MismatchConfig:
        """The full run's gate table (the same base policy, which ships with the package, on the same
        256 tasks: the same numbers) and a short run at NVFP4 (4 updates, one seed) of fp32 and of the
        quantized arms naive, QAT, QAT+TIS and QAT+InterQ (stacked in one cell: the lab's corrections at
        little cost), far too short for the predictions, which are about hundreds of updates. With ``-e estimator``,
        ``-e planted`` or ``-e sample``: those experiments at a size that only shows they run (2 batches at NVFP4 and
        a planted dose; the thought-free planted world at one strength, 2 updates; one update of tokens); with ``-e
        transfer``: the 24-thought world (its base ships) with the naive learner at NVFP4 and fp32, one seed."""
        return cls(grpo=_grpo_config(updates=4, tasks_per_update=4, group_size=4, eval_every=2, eval_tasks=32),
                   seeds=1, smooth=1, arms=("fp32", "naive", "qat", "qat_tis", "qat_interq"), experiments=("nvfp4",),
                   planted_strengths=(0.4,), planted_arms=("none", "interq"), planted_variants=("thought_free",),
                   planted_seeds=1, planted_updates=2, planted_tasks=16, estimator_doses=("nvfp4", "planted:0.4"),
                   estimator_batches=2, estimator_planted_batches=2, estimator_qat_updates=1, sample_updates=1,
                   transfer_worlds=("thoughts24",), transfer_points=("naive@nvfp4",), transfer_seeds=1,
                   transfer_tasks=16)

    @classmethod
    def two_core(cls) -> MismatchConfig:
        """The protocol registered for a 2-core CPU machine (``--protocol two-core``; docs/mismatch.md,
        "The 2-core protocol"): 40 thoughts per action (its own base policy, 576 positions), 100
        updates of 8 tasks x 4 rollouts, held-out success on 128 tasks every 10 updates; the main
        dose MXFP4 with fp32, naive, QAT, QAT+TIS, QAT+InterQ, QAT+prefix and QAT+global on 5 paired
        seeds; the phase map's other doses (fp8, int8, nvfp4) with the naive and QAT learners on 2."""
        base = BaseConfig(chain_lengths=CHAIN_LENGTHS, thoughts=TWO_CORE_THOUGHTS, max_len=576, batch_size=64,
                          steps=3000)
        grpo = GRPOConfig(chain_lengths=CHAIN_LENGTHS, max_len=544, max_action_len=TWO_CORE_THOUGHTS + 8,
                          updates=100, tasks_per_update=8, group_size=4, eval_every=10, eval_tasks=128)
        grpo = replace(grpo, clip_ratio_c=None)  # registered before the dual clip existed
        return cls(base=base, grpo=grpo, seeds=5, protocol="two-core",
                   arms=("fp32", "naive", "qat", "qat_tis", "qat_interq", "qat_prefix", "qat_global"),
                   experiments=("mxfp4", "fp8", "int8", "nvfp4"), map_doses=("fp8", "int8", "nvfp4"),
                   map_arms=("naive", "qat"), map_seeds=2, eval_on="fp32")

    @classmethod
    def dual_clip(cls) -> MismatchConfig:
        """The protocol registered to decide the 2-core run's InterQ result (``--protocol dual-clip``;
        docs/mismatch.md, "The dual-clip protocol"): the 2-core protocol's world, base policy and budget (40
        thoughts, 100 updates of 8 tasks x 4 rollouts, 128 held-out tasks every 10 updates), with a trainer
        that clips like verl (``clip_ratio_c = 3``) and held-out success scored on each arm's rollout engine
        (the fp32 engine beside it); at MXFP4 the ablation QAT, QAT+TIS, QAT+InterQ, QAT+MIS masking only
        delta < -1 and QAT+InterQxTIS on 8 paired seeds; and the known-answer test of the estimator and the
        planted mismatch."""
        two = cls.two_core()
        return cls(base=two.base, grpo=replace(two.grpo, clip_ratio_c=3.0), seeds=8, protocol="dual-clip",
                   arms=("qat", "qat_tis", "qat_interq", "qat_mis_low", "qat_interq_tis"),
                   experiments=("mxfp4", "estimator", "planted", "sample"), eval_on="engine")

    @classmethod
    def transfer(cls) -> MismatchConfig:
        """The protocol registered for ``creditlab diagnose``'s calibration across trajectory lengths (``--protocol
        transfer``; docs/diagnose.md, "The transfer experiment"): the dual-clip protocol's trainer and budget (dual
        clip 3, held-out success on each arm's rollout engine, 100 updates of 8 tasks x 4 rollouts, 128 held-out
        tasks every 10 updates) in two worlds, 40 and 24 thoughts per action, the phase map's points naive at FP8,
        NVFP4 and MXFP4 and QAT at NVFP4 and MXFP4 with the fp32 arm, on 4 paired seeds."""
        dual = cls.dual_clip()
        return replace(dual, protocol="transfer", experiments=("transfer",), seeds=4)

    def dose_runs(self, dose: str) -> tuple[tuple[str, ...], int]:
        """(arms, seeds) that run at ``dose``: ``map_arms`` x ``map_seeds`` for a ``map_doses`` dose,
        else ``arms`` x ``seeds``."""
        return (self.map_arms, self.map_seeds) if dose in self.map_doses else (self.arms, self.seeds)

    def validate(self) -> None:
        check_count(self.seeds, "--seeds")
        check_count(self.map_seeds, "map_seeds")
        if self.protocol not in ("paper", "two-core", "dual-clip", "transfer"):
            raise ConfigError("--protocol", f"unknown protocol {self.protocol!r}; valid: paper, two-core, dual-clip, "
                                            "transfer")
        if self.eval_on not in ("engine", "fp32"):
            raise ConfigError("eval_on", f"must be 'engine' or 'fp32', got {self.eval_on!r}")
        for a in self.map_arms:
            arm_triple(a, "fp8")
        if any(d not in DOSES for d in self.map_doses):
            raise ConfigError("map_doses", f"got {list(self.map_doses)}; valid: {', '.join(DOSES)}")
        if self.map_doses and (not self.map_arms or "fp32" in self.map_arms):
            raise ConfigError("map_arms", "a map dose needs quantized arms (the fp32 arm is shared by every dose)")
        if not self.arms or len(set(self.arms)) != len(self.arms):
            raise ConfigError("arms", f"needs distinct arms, got {list(self.arms)}")
        for a in self.arms:
            arm_triple(a, "fp8")
        valid = type(self).EXPERIMENTS
        if not self.experiments or any(e not in valid for e in self.experiments):
            raise ConfigError("--experiment", f"got {list(self.experiments)}; valid: {', '.join(valid)}")
        for e in type(self).EXPERIMENT_TABLE:  # the experiments check the fields they own
            e.validate(self)
        g = self.grpo
        if g.eval_every < 1:
            raise ConfigError("grpo.eval_every", "the lab scores held-out success over training: must be >= 1")
        if self.dose_tasks < 1:
            raise ConfigError("dose_tasks", f"must be >= 1, got {self.dose_tasks}")
        if self.smooth < 1 or self.smooth > g.updates // g.eval_every + 1:
            raise ConfigError("smooth", f"must be in [1, {g.updates // g.eval_every + 1}], got {self.smooth}")
        if g.max_len > self.base.max_len:
            raise ConfigError("grpo.max_len", f"{g.max_len} exceeds the model's {self.base.max_len}")
        if self.base.thoughts and g.max_action_len < self.base.thoughts + 6:
            raise ConfigError("grpo.max_action_len", f"{g.max_action_len} cannot hold {self.base.thoughts} thoughts "
                                                     "and the longest call (6 tokens)")
        if tuple(g.chain_lengths) != tuple(self.base.chain_lengths):
            raise ConfigError("grpo.chain_lengths", "must equal base.chain_lengths (the base policy's tasks)")
        if g.advantage != "grpo":
            raise ConfigError("grpo.advantage", "the mismatch lab trains outcome GRPO (advantage='grpo')")


def _base_config() -> BaseConfig:
    """The lab's base policy (full and ``--quick`` runs): the context holds C + 2 turns of (thoughts
    + call + observation) at C = 8; demonstrations in batches of 64 (each holds about 7x the policy
    tokens of a demonstration without thoughts); 3000 steps: at the toolshop default of 1000 this
    base solved 1.6% of held-out tasks (64 tasks, fp32).

    Its build ships with the package (:data:`creditlab.train.toolshop_base.SHIPPED_DIR`), so no run
    trains it: quicker builds that fit a first ``--quick`` (a few minutes) learn the tasks but not its
    regime (their QAT drift stayed near 0, docs/mismatch.md). Rebuilt, resumably, by ``python -c "from
    creditlab.labs.mismatch import MismatchConfig; from creditlab.train.toolshop_base import
    ship_base_policy; ship_base_policy(MismatchConfig().base, 'base-build', 'mismatch base policy')"``
    (into the package's directory; tests/test_shipped_bases.py checks it against this config)."""
    return BaseConfig(chain_lengths=CHAIN_LENGTHS, thoughts=THOUGHTS, max_len=416, batch_size=64, steps=3000)


def _grpo_config(**kw) -> GRPOConfig:
    return GRPOConfig(chain_lengths=CHAIN_LENGTHS, max_len=384, max_action_len=THOUGHTS + 8, **kw)
