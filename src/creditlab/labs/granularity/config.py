"""The granularity lab's configuration, its task types and its arms (the experiments' own fields are
listed in their modules' ``fields``; the checks of those fields are theirs too)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

from creditlab.core.schedules import Schedule
from creditlab.envs.toolshop import MULTI_EXCHANGE
from creditlab.errors import ConfigError
from creditlab.lab.protocol import LabConfig, check_count
from creditlab.labs._toolshop import BasePolicyConfig
from creditlab.train.toolshop_base import BaseConfig
from creditlab.train.toolshop_grpo import GRPOConfig

#: Task types: name -> chain lengths (a task of the type draws one, cycling over the list).
TASK_TYPES: dict[str, tuple[int, ...]] = {"short": (2, 3, 4), "long": (7, 8)}
#: Every chain length of the task types (the base policy's and training's chain lengths).
TASK_CHAIN_LENGTHS = (2, 3, 4, 7, 8)
#: The multi-exchange type (experiment ``multi``): 3-4 independent short exchanges per episode, graded
#: outcome (share solved), budget 2 (C + 2) (:class:`creditlab.envs.toolshop.MultiTask`).
MULTI_TYPES: dict[str, tuple[int, ...]] = {**TASK_TYPES, "multi": (MULTI_EXCHANGE,)}
#: The task mix of experiment ``multi``: short 3/7, long 2/7, multi 2/7 of the tasks.
MULTI_CHAIN_LENGTHS = (*TASK_CHAIN_LENGTHS, MULTI_EXCHANGE, MULTI_EXCHANGE)
#: Arm -> (kind, what); kinds: grpo (outcome), prm (mixed process reward), opsd (self-distillation).
#: Each arm is an experiment of its own (``-e grpo``...), trained from the lab's base policy.
ARMS: dict[str, tuple[str, str]] = {
    "grpo": ("grpo", "outcome"),
    "prm_fixed": ("prm", "fixed"),
    "prm_decay": ("prm", "decay"),
    "opsd_ref": ("opsd", "ref"),
    "opsd_advice": ("opsd", "advice"),
}
#: The experiments beyond the arms, in the paper's regime (each on its own setting, with a gate): the
#: multi-exchange type, the repeat sweep, the self-distillation teachers warm-started on their hints.
REGIME_EXPERIMENTS = ("multi", "repeat", "warm", "budget")
#: Every experiment (``-e``), in report order: the arms, then the regime experiments.
EXPERIMENTS = (*ARMS, *REGIME_EXPERIMENTS)
#: The code that computes the lab's cells (:func:`creditlab.lab.protocol.code_fingerprint`): a stored cell
#: is reused only while these modules are unchanged, so changing another lab, the docs or the CLI does not
#: void a run. The lab's own package is in it whole (its cells and tables share modules), and so is
#: ``diagnose/``: the repeat sweep's cells store ``creditlab diagnose``'s verdict on their dumps.
#: tests/test_compute_code.py holds it to the modules the cells import.
COMPUTE_CODE = ("errors.py", "core/", "envs/", "models/", "rewards/", "diagnose/", "train/", "lab/runner.py",
                "lab/store.py", "labs/_toolshop.py", "labs/granularity/")
#: The base policies of ``--quick``, built on first use in about a minute together: the lab's in 700
#: steps of 32 demonstrations at lr 1e-2 (the full one: 1000 of 128 at 3e-3); the three-type one in
#: 200 steps of 32 from it (full: 400 of 64); the warm-started one in 300 steps of 32 at lr 1e-2 from
#: it too (full: 1000 of 128 from scratch). What they can and cannot show: docs/granularity.md.
QUICK_BASE = BaseConfig(chain_lengths=TASK_CHAIN_LENGTHS, steps=700, batch_size=32, lr=1e-2)
QUICK_MULTI_BASE = BaseConfig(chain_lengths=MULTI_CHAIN_LENGTHS, max_len=320, steps=200, batch_size=32, lr=1e-3,
                              init=QUICK_BASE.key())
QUICK_WARM_BASE = BaseConfig(chain_lengths=TASK_CHAIN_LENGTHS, privileged=0.5, steps=300, batch_size=32, lr=1e-2,
                             init=QUICK_BASE.key())


def parse_repeats(text: str) -> tuple[float, ...]:
    """The ``--repeats`` values: comma-separated numbers in [0, 1], e.g. ``0.25,0.5,0.75,1``."""
    try:
        vals = tuple(float(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise ConfigError("repeats", f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not 0.0 <= v <= 1.0 for v in vals) or len(set(vals)) != len(vals):
        raise ConfigError("repeats", f"expected distinct numbers in [0, 1], got {text!r}")
    return vals


@dataclass(frozen=True)
class GranularityConfig(BasePolicyConfig, LabConfig):
    """Configuration of the granularity lab."""

    OPTIONS: ClassVar[dict[str, str]] = {"updates": "grpo.updates"}
    EXPERIMENTS: ClassVar[tuple[str, ...]] = EXPERIMENTS
    SELECTION: ClassVar[tuple[str, ...]] = ("experiments", "cache_dir", "dump_dir")

    base: BaseConfig = field(default_factory=lambda: BaseConfig(chain_lengths=TASK_CHAIN_LENGTHS))
    """Supervised warm start of the shared base policy (cached), on every chain length of the mix."""
    grpo: GRPOConfig = field(default_factory=lambda: GRPOConfig(
        updates=50, tasks_per_update=16, group_size=8, chain_lengths=TASK_CHAIN_LENGTHS, eval_every=10,
        clip_ratio_c=None))
    """Training shared by every arm (outcome GRPO's settings; OPSD uses its lr, minibatches, grad clip). No dual
    clip (``clip_ratio_c=None``): the lab's registered runs, committed under results/, were made without it, and
    its engine is the learner's (fp32 rollouts), where the ratio of a minibatch step stays near 1."""
    seeds: int = 3
    """Paired seeds per arm (task stream, sampling, minibatch order)."""
    lam: float = 0.5
    """Weight of the process advantage (fixed arm; start of the decayed arm)."""
    decay_start: float = 0.4
    """Decayed arm: the weight starts to fall at this fraction of the updates (20 of 50)."""
    decay_end: float = 0.6
    """Decayed arm: the weight reaches 0 at this fraction of the updates (30 of 50)."""
    decay_power: float = 3.0
    """Decayed arm: the power of the decay (cubic)."""
    repeat: float = 0.25
    """Process score of a read that returned nothing new."""
    beta: float = 0.5
    """OPSD: generalised JSD interpolation (0 forward KL(teacher||student), 1 reverse KL)."""
    eval_per_type: int = 128
    """Held-out tasks per task type at each evaluation (fixed, the same for every arm and seed)."""
    experiments: tuple[str, ...] = tuple(ARMS)
    """Arms to run (grpo, prm_fixed, prm_decay, opsd_ref, opsd_advice) and experiments: ``multi``
    (GRPO and the decayed PRM on short, long and multi-exchange tasks), ``repeat`` (fixed and
    decayed PRM at each ``repeats`` value, judged by ``creditlab diagnose``), ``warm`` (GRPO and both
    OPSD teachers from the base policy warm-started on the teachers' hints)."""
    multi_base: BaseConfig = field(default_factory=lambda: BaseConfig(
        chain_lengths=MULTI_CHAIN_LENGTHS, max_len=320, steps=400, batch_size=64, lr=1e-3,
        init=BaseConfig(chain_lengths=TASK_CHAIN_LENGTHS).key()))
    """Experiment multi: the base policy of the three-type mix (a longer context: 320 tokens), started
    from the lab's base policy and trained 400 steps of 64 demonstrations at lr 1e-3, for time: its
    sequences are twice as long, and a fresh build of that size did not learn the tasks."""
    multi_max_len: int = 320
    """Experiment multi: token budget of a trajectory (the multi-exchange budget is 16-36 turns)."""
    warm_base: BaseConfig = field(default_factory=lambda: BaseConfig(chain_lengths=TASK_CHAIN_LENGTHS,
                                                                     privileged=0.5))
    """Experiment warm: the base policy with half of its demonstrations carrying a teacher's hint."""
    budget_base: BaseConfig = field(default_factory=lambda: BaseConfig(
        chain_lengths=MULTI_CHAIN_LENGTHS, max_len=320, steps=400, batch_size=64, lr=1e-3,
        init=BaseConfig(chain_lengths=TASK_CHAIN_LENGTHS).key()))
    """Experiment budget: its base policy, by default the three-type one of experiment multi (one cache
    entry for both): a 320-token context whose positions its multi-exchange demonstrations train."""
    budget_turns: int = 12
    """Experiment budget: the long action budget of a short task (3 C at its longest chain, C = 4)."""
    budget_max_len: int = 320
    """Experiment budget: token budget of a trajectory at both action budgets (C + 2 and ``budget_turns``)."""
    repeats: str = "0.25,0.5,0.75,1.0"
    """Experiment repeat: the values of ``repeat`` swept (comma-separated, CLI --repeats)."""
    cache_dir: str | None = None
    """Where the base policy is cached (None: the user cache directory); never changes a number."""
    dump_dir: str | None = None
    """Write every training update's rollouts in the ``creditlab diagnose`` schema here (one JSONL
    file per arm and seed, for the cells this run computes); never changes a number."""

    @classmethod
    def quick(cls) -> GranularityConfig:
        """Every arm and experiment for 6 updates of 4 tasks x 4, one seed, from the quick base
        policies (:data:`QUICK_BASE`, :data:`QUICK_MULTI_BASE`, :data:`QUICK_WARM_BASE`)."""
        return cls(base=QUICK_BASE, multi_base=QUICK_MULTI_BASE, warm_base=QUICK_WARM_BASE,
                   budget_base=QUICK_MULTI_BASE,
                   grpo=GRPOConfig(updates=6, tasks_per_update=4, group_size=4, chain_lengths=TASK_CHAIN_LENGTHS,
                                   eval_every=3, clip_ratio_c=None),
                   seeds=1, eval_per_type=16, experiments=EXPERIMENTS)

    def arms(self) -> tuple[str, ...]:
        """The arms selected (the experiments that are arms)."""
        return tuple(e for e in self.experiments if e in ARMS)

    def multi_grpo(self) -> GRPOConfig:
        """Experiment multi's training: the lab's, on the three-type mix with the longer budget."""
        return replace(self.grpo, chain_lengths=tuple(self.multi_base.chain_lengths), max_len=self.multi_max_len)

    def bases(self) -> list[BaseConfig]:
        """The base policies the selected experiments need (each its own cache entry)."""
        out = [self.base] if self.arms() or "repeat" in self.experiments else []
        for exp, b in (("multi", self.multi_base), ("warm", self.warm_base), ("budget", self.budget_base)):
            if exp in self.experiments:
                if b.init == self.base.key() and self.base not in out:
                    out.append(self.base)  # it starts from the lab's base policy (the quick ones do)
                if b not in out:
                    out.append(b)
        return out

    def validate(self) -> None:
        """The selection, then each experiment's own fields (selected or not: a later run into the same
        --out may select it), then the shared fields."""
        from creditlab.labs.granularity import EXPERIMENT_TABLE

        check_count(self.seeds, "--seeds")
        if not self.experiments or any(e not in EXPERIMENTS for e in self.experiments):
            raise ConfigError("--experiment", f"got {list(self.experiments)}; valid: {', '.join(EXPERIMENTS)}")
        for e in EXPERIMENT_TABLE:
            e.validate(self)
        g = self.grpo
        if g.eval_every < 1:
            raise ConfigError("grpo.eval_every", "the lab scores held-out success over training: must be >= 1")
        if g.max_len > self.base.max_len:
            raise ConfigError("grpo.max_len", f"{g.max_len} exceeds the model's {self.base.max_len}")
        if tuple(g.chain_lengths) != tuple(self.base.chain_lengths):
            raise ConfigError("grpo.chain_lengths", "must equal base.chain_lengths (the base policy's tasks)")
        if not set(g.chain_lengths) <= {c for cs in TASK_TYPES.values() for c in cs}:
            raise ConfigError("grpo.chain_lengths", f"every chain length must belong to a task type {TASK_TYPES}")
        if g.advantage != "grpo" or g.correction != "none" or g.rollout_precision != "fp32":
            raise ConfigError("grpo", "the granularity lab trains fp32 outcome GRPO without a correction")
        if not 0 < self.decay_start <= self.decay_end <= 1:
            raise ConfigError("decay_start", "needs 0 < decay_start <= decay_end <= 1")
        if not 0.0 <= self.beta <= 1.0:
            raise ConfigError("beta", f"must be in [0, 1], got {self.beta}")
        if not 0.0 <= self.repeat <= 1.0:
            raise ConfigError("repeat", f"must be in [0, 1], got {self.repeat}")
        if self.lam < 0:
            raise ConfigError("lam", f"must be >= 0, got {self.lam}")
        if self.eval_per_type < 1:
            raise ConfigError("eval_per_type", f"must be >= 1, got {self.eval_per_type}")

    def schedule(self, arm: str) -> Schedule:
        """The process weight of a PRM arm: the :class:`~creditlab.core.schedules.Schedule` record the
        trainer integrations hold too (``prm_schedule`` / ``prm_lambda`` / ``prm_start`` ...), the decayed
        arm's start and end scaled to the run length."""
        if arm == "prm_fixed":
            return Schedule("constant", l0=self.lam)
        U = self.grpo.updates
        return Schedule("decay", l0=self.lam, start=self.decay_start * U, end=self.decay_end * U,
                        power=self.decay_power)
