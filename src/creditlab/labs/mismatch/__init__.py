"""The mismatch lab: does a multi-turn agent trained on quantized rollouts need execution-prefix correction?

Reads top to bottom:

1. build (or load from the cache) one base policy: the toolshop agent's supervised warm start on
   chains of 5 to 8 tool calls (:func:`creditlab.train.toolshop_base.base_policy`);
2. train it with multi-turn outcome GRPO under every arm, a triple (rollout engine, learner,
   correction): ``fp32`` (fp32, fp32, none), ``naive`` (P, fp32, none), ``qat`` (P, P-QAT, none)
   and ``qat_tis``, ``qat_mis``, ``qat_prefix``, ``qat_global``, ``qat_interq`` (P, P-QAT, that
   correction of :data:`creditlab.core.correction.CORRECTIONS`), where the engine precision ``P``
   (fp8, int8, nvfp4, mxfp4) is the dose of residual mismatch;
3. every arm starts from the same base policy and, seed for seed, sees the same tasks, the same
   sampling uniforms and the same minibatch order (common random numbers,
   :func:`creditlab.train.toolshop_grpo.train_grpo_stacked`), and is evaluated on the same held-out
   tasks by the same fp32 engine with the same sampling uniforms;
4. tables: ``summary`` (per arm, dose and seed: final and best held-out success, rollback, AULC,
   interaction cost, cap exhaustion, K3 early and late), ``curves`` (per update), ``by_turn`` (the
   prefix and current log ratio by turn index), paired differences against QAT and against fp32;
   plots: success over updates, K3 over updates, the prefix/current fingerprint, rollback and
   final success against the dose.

Experiments: one per dose (:mod:`~creditlab.labs.mismatch.dose`, ``-e fp8`` ...: its cells), and the
comparison across the doses a run selects (:mod:`~creditlab.labs.mismatch.comparison`, in every run:
the tables above, the phase map, diagnose's calibration and agreement, the plots and the predictions
(a)-(d)); each is a line of :data:`EXPERIMENT_TABLE`. The lab itself holds what they share: the config
(:mod:`~creditlab.labs.mismatch.config`), the knobs, the gate (:mod:`~creditlab.labs.mismatch.gate`)
and the description.

Cells: one per (dose, seed) holding the seven quantized arms of that seed as one stacked tensor
program, and one holding the fp32 arm of every seed (it does not depend on the dose). A cell's
rows depend only on its arguments; every finished cell is stored at once (resumable).
"""

from __future__ import annotations

import pandas as pd

from creditlab.lab.experiment import ExperimentLab
from creditlab.lab.protocol import Table
from creditlab.lab.report import knobs_table, small_run_note
from creditlab.labs._toolshop import BasePolicyLab, base_knob, optim_knob, seeds_knob
from creditlab.labs.mismatch import comparison, estimator, planted, sample, transfer
from creditlab.labs.mismatch.cells import ENTROPY_BINS, gate_metrics, run_dose_cell, run_stack
from creditlab.labs.mismatch.comparison import (
    PREDICTIONS_STATED,
    REGISTRATIONS,
    TWO_CORE_STATED,
    Registration,
    calibration_scope,
    diagnose_agreement,
    fp32_band,
    fp32_saturation,
    late_rollbacks,
    phase_map,
    prefix_drift_calibration,
    score_curve,
    verdict_less_stable,
    verdict_rolls_back,
    verdict_stays,
)
from creditlab.labs.mismatch.config import (
    ARMS,
    COMPUTE_CODE,
    DOSES,
    GATE_DRIFT,
    LABELS,
    MismatchConfig,
    arm_triple,
)
from creditlab.labs.mismatch.dose import Dose
from creditlab.labs.mismatch.gate import diagnose_drift, gate_table, read_dose, read_gate

__all__ = ["ARMS", "DOSES", "ENTROPY_BINS", "EXPERIMENTS", "EXPERIMENT_TABLE", "LAB", "PREDICTIONS_STATED",
           "MismatchConfig", "MismatchLab", "REGISTRATIONS", "Registration", "SHARED_FIELDS", "TWO_CORE_STATED",
           "arm_triple", "calibration_scope", "diagnose_agreement", "diagnose_drift", "fp32_band", "fp32_saturation",
           "gate_metrics", "gate_table", "late_rollbacks", "phase_map", "prefix_drift_calibration", "run_dose_cell",
           "run_stack", "score_curve", "verdict_less_stable", "verdict_rolls_back", "verdict_stays"]


def _doses(cfg: MismatchConfig) -> list[str]:
    """The doses a run selects (its experiments that are doses), in the selection's order."""
    return [e for e in cfg.experiments if e in DOSES]


def _knobs(cfg: MismatchConfig) -> pd.DataFrame:
    """Each knob with its value in this run, the lab's default, and why the default is what it is."""
    return knobs_table(_knob_rows(cfg), _knob_rows(MismatchConfig()))


def _knob_rows(cfg: MismatchConfig) -> list[tuple[str, str, str]]:
    g, b = cfg.grpo, cfg.base
    return [
        ("chain lengths", ", ".join(map(str, g.chain_lengths)),
         "5 to 8 tool calls (7 turns on average, up to C + 2): a long interaction history for the mismatch to "
         "compound over, and a base policy at about 0.4 held-out success that GRPO does not saturate at once "
         "(at C = 4 outcome GRPO reached 0.96 in 100 updates)."),
        ("thought tokens per action", str(b.thoughts),
         "reward-neutral free tokens before every call, uniformly random in the demonstrations, so the trained "
         "policy keeps entropy where an LLM agent keeps it (its free text) while its tool calls become "
         "deterministic. Per-token K3 is largest at high entropy, and the prefix drift grows with the policy "
         "tokens before the last turn: with 24 thoughts a successful episode of C calls holds about C x 28 "
         "policy tokens (140-225 at C = 5-8, inside the 150-400 of LLM agent turns' regime), against 20-29 "
         "without thoughts. 32 would cost a third more decode steps per update for a few more tokens."),
        ("context", f"model {b.max_len}, trajectory {g.max_len}, action {g.max_action_len} tokens",
         "C + 2 = 10 turns at C = 8 of (thoughts + call + observation) fit; an action holds its thoughts and "
         "the longest call."),
        ("base policy", base_knob(b),
         "the toolshop defaults, with the chain lengths, the thoughts and the context above; demonstrations in "
         "batches of 64 (each holds 7x the tokens of one without thoughts); one base policy shared by every arm "
         "and seed."),
        ("updates", str(g.updates),
         "as in the paper: its QAT run peaks near 300 updates and rolls back between 300 and 400; the time of a "
         "run is linear in updates."),
        ("rollouts per update", f"{g.tasks_per_update} tasks x {g.group_size}",
         "a quarter of the toolshop lab's 256, for time: the cost of a run is linear in rollouts per update."),
        ("optimisation", optim_knob(g), "GRPOConfig defaults, as in the toolshop lab; not tuned."),
        ("dual clip", "off" if g.clip_ratio_c is None else f"clip_ratio_c = {g.clip_ratio_c:g}",
         "verl's default (3): for a negative advantage the token loss is capped at -A x clip_ratio_c, so a token the "
         "learner finds far likelier than the sampler did cannot dominate an update. Off in the 2-core protocol, "
         "registered before the trainer had it."),
        ("held-out evaluation", f"{g.eval_tasks} tasks every {g.eval_every} updates, "
         + ("each arm's rollout engine (fp32 engine beside it)" if cfg.eval_on == "engine" else "fp32 engine")
         + ", sampled",
         ("scored on the engine an arm rolls out with (the quantized endpoint a user deploys, the metric of the "
          "paper), with the fp32 engine's score beside it (the learned policy without its engine)"
          if cfg.eval_on == "engine" else
          "one evaluation for every arm (the fp32 engine measures the learned policy, not its engine)")
         + f"; sampled at temperature {g.temperature:g} like training, with the same uniforms for every arm and "
         "evaluation, so arms and evaluation points differ only by their policies (and engines)."),
        ("final / best window", f"{cfg.smooth} evaluation points",
         "a single point has a standard error of about 0.03 at 256 tasks, so best-minus-last of raw points reads "
         "noise as rollback; means of a window (and the fp32 arm as the no-mismatch reference) keep it honest."),
        seeds_knob(cfg.seeds),
        ("correction parameters", "core defaults",
         "TIS cap 2, MIS [0.5, 2], InterQ eps 0.025 / 0.05, alpha_g 0.5 (prefix: alpha 1); not tuned. "
         "QAT+MIS(delta<-1) masks only the tokens with a ratio below e^-1 (mis:lo=e^-1,hi=inf), the lower side TIS "
         "acts on in this world; QAT+InterQxTIS is the registered arm interq_tis (InterQ's weight times TIS's)."),
        ("doses", ", ".join(_doses(cfg)),
         "engine precisions of current serving stacks: FP8 W8A8-KV8, INT8 W8A8, FP4 W4A4-KV8 (NVFP4: E2M1 in "
         "blocks of 16 with FP8 scales; MXFP4, blocks of 32 with power-of-two scales, is available as -e mxfp4)."),
    ]


#: The lab's experiments, in report order (``-e`` selects among them; adding one is one line here): one per
#: dose, in the order of :data:`DOSES`, and the comparison across the doses a run selects (in every run).
EXPERIMENT_TABLE = (*(Dose(d) for d in DOSES), estimator.EXPERIMENT, planted.EXPERIMENT, sample.EXPERIMENT,
                    transfer.EXPERIMENT, comparison.EXPERIMENT)
#: The ``-e`` choices: every experiment but those that run in every selection.
EXPERIMENTS = tuple(e.name for e in EXPERIMENT_TABLE if not e.always)
MismatchConfig.EXPERIMENTS = EXPERIMENTS  # the config (in the lab's compute code) takes them from this table
MismatchConfig.EXPERIMENT_TABLE = EXPERIMENT_TABLE
#: Config fields every experiment shares (the others each belong to one experiment's ``fields``).
SHARED_FIELDS = ("base", "grpo", "seeds", "arms", "dose_tasks", "experiments", "cache_dir", "dump_dir", "eval_on")


#: Base policies that the source repository commits beside a run (not shipped with the package): config key ->
#: the folder holding it, for ``CREDITLAB_CACHE``.
COMMITTED_BASES = {"f2af6f5721dd887d": "results/mismatch-2core"}
#: Seconds per base-build step on this project's 2-core machine (docs/mismatch.md): 0.54 and 0.99 for the lab's
#: base (1625 s and 2955 s for 3000 steps of 64), 1.01 for the 2-core protocol's (3037 s).
BUILD_S_PER_STEP = (0.5, 1.0)
#: A full build's measured wall time (s) on that machine, by config key: the 2-core protocol's base.
BUILD_MEASURED = {"f2af6f5721dd887d": 3037}


class MismatchLab(ExperimentLab, BasePolicyLab):
    """Quantized-rollout GRPO of the toolshop agent under each correction arm (module docstring)."""

    name = "mismatch"
    summary = "Quantized rollout engine vs learner in a multi-turn agent: QAT, TIS, MIS, prefix, InterQ-RL."
    help = ("Quantized rollout engine vs learner in the multi-turn toolshop agent: arms fp32, naive, QAT, QAT+TIS, "
            "QAT+MIS, QAT+prefix, QAT+global, QAT+InterQ-RL at each engine precision of the dose (-e fp8 -e int8 "
            "-e nvfp4 -e mxfp4). The default protocol's base policy ships with creditlab (its build takes 27-49 "
            "minutes on 2 cores), so neither a default run nor --quick trains it. The base policy of --protocol "
            "two-core (576 positions) does not ship: a run that finds none in the cache builds it first (about 50 "
            "minutes on 2 cores) and says so before it starts; the source repository commits it in "
            "results/mismatch-2core (CREDITLAB_CACHE=results/mismatch-2core). A build of your own in the cache "
            "(CREDITLAB_CACHE) comes first. Use --workers 2 on two cores.")
    quick_help = ("Reduced run: the full run's gate table (the same shipped base policy on the same 256 tasks) and "
                  "fp32, naive, QAT, QAT+TIS and QAT+InterQ at NVFP4 for 4 updates, one seed: about 70 s on 2 "
                  "cores, cold or warm (nothing is built; load average 2-3.7).")
    config_type = MismatchConfig
    experiments = EXPERIMENT_TABLE
    gate_groups = ("dose",)
    compute_code = COMPUTE_CODE
    # One intra-op thread in the CLI process, as the process executor gives each worker: the lab's
    # tensors are small, and a second thread on busy cores waits more than it works (a GRPO update
    # of the tiny trainer took 7x longer with two threads than with one on a shared 2-core machine).
    threads = 1

    def build_note(self, cfg: MismatchConfig) -> str | None:
        """The line said before ``prepare`` builds a base policy that is neither cached nor shipped (the 2-core
        protocol's, from a pip install): what, about how long, where, and how to load a committed one instead;
        None when the base policy is stored."""
        from creditlab.train.toolshop_base import base_file, resume_step

        b, cache = cfg.base, cfg.cache()
        if base_file(b, cache) is not None:
            return None
        key, done = b.key(), resume_step(b, cache)
        if key in BUILD_MEASURED:
            took = BUILD_MEASURED[key]
            minutes = max(1, round(took * (b.steps - done) / b.steps / 60))
            how_long = f"about {minutes} minutes on 2 cores ({took} s measured)"
        else:
            lo, hi = (max(1, round((b.steps - done) * s / 60)) for s in BUILD_S_PER_STEP)
            how_long = f"about {lo}-{hi} minutes on 2 cores"
        where = COMMITTED_BASES.get(key)
        instead = (f"its build is committed in the source repository's {where}/: stop (Ctrl-C) and rerun with "
                   f"CREDITLAB_CACHE=<checkout>/{where} to load it instead" if where else
                   f"to load a build made elsewhere, stop (Ctrl-C) and rerun with CREDITLAB_CACHE set to the folder "
                   f"holding toolshop-base-{key}.safetensors")
        return (f"mismatch lab: this run's base policy (toolshop-base-{key}: {b.thoughts} thoughts per action, "
                f"{b.max_len} positions) is neither in the cache {cache} nor shipped with creditlab, so it is built "
                f"first: {b.steps - done} optimizer steps{f' (resuming at step {done})' if done else ''}, {how_long}, "
                f"cached in {cache} (an interrupted build resumes); {instead}.")

    def describe(self, cfg: MismatchConfig) -> str:
        g = cfg.grpo
        arms = ", ".join(f"{LABELS[a]} ({'/'.join(arm_triple(a, 'P'))})" for a in cfg.arms)
        return (
            f"Multi-turn outcome GRPO of the tiny toolshop agent on chains of {', '.join(map(str, g.chain_lengths))} "
            f"tool calls, from one supervised base policy ({cfg.base.n_demos} noisy demonstrations). Arms "
            f"(rollout engine / learner / correction, P = the engine precision of the dose): {arms}. Doses: "
            f"{', '.join(_doses(cfg)) or 'none'}. {g.updates} updates of {g.tasks_per_update} tasks x {g.group_size} "
            f"rollouts, {g.minibatches} AdamW steps per update (lr {g.lr:g}), {cfg.seeds} paired seed(s): every arm "
            "sees the same tasks, sampling uniforms and minibatch order seed for seed. Held-out success: "
            f"{g.eval_tasks} fixed tasks every {g.eval_every} updates, sampled (temperature {g.temperature:g}) by "
            + ("each arm's own rollout engine (and, beside it, by the fp32 engine)" if cfg.eval_on == "engine" else
               "the fp32 engine")
            + f" with the same uniforms for every arm and every evaluation. Dual clip: "
            f"{'off' if g.clip_ratio_c is None else g.clip_ratio_c}. Final success is the mean "
            f"of the last {cfg.smooth} evaluation points, best the largest mean of {cfg.smooth} consecutive points, "
            "rollback = best - final." + self._map_note(cfg))

    @staticmethod
    def _map_note(cfg: MismatchConfig) -> str:
        mapped = [d for d in cfg.experiments if d in cfg.map_doses]
        if not mapped:
            return ""
        return (f" The phase map's doses {', '.join(mapped)} run only {', '.join(LABELS[a] for a in cfg.map_arms)} "
                f"on {cfg.map_seeds} paired seed(s) (seeds 0-{cfg.map_seeds - 1}).")

    def gate(self, rows: dict[str, pd.DataFrame], cfg: MismatchConfig) -> Table | None:
        if "dose" not in rows:
            return None
        return Table(gate_table(rows["dose"]), f"Gate: the base policy before training (QAT's drift entering the "
                                               f"last turn >= {GATE_DRIFT:g} nat)", ".3g", console=True)

    def lab_tables(self, rows: dict[str, pd.DataFrame], cfg: MismatchConfig) -> dict[str, Table]:
        """The knobs, then the gate and the dose it is made of (what every experiment shares)."""
        tabs = {"knobs": Table(_knobs(cfg), "Knobs chosen for this lab, and why")}
        if "dose" in rows:
            tabs["gate"] = self.gate(rows, cfg)
            tabs["dose"] = Table(rows["dose"], "The dose: engine/learner mismatch of the base policy", ".3g")
        return tabs

    def interpret(self, tabs: dict[str, Table], cfg: MismatchConfig) -> dict[str, str]:
        text: dict[str, str] = {
            "knobs": "Every setting of this run that a person chose, with the reason; none was tuned to make an arm "
                     "win or lose. Settings not listed are the defaults of GRPOConfig and BaseConfig (the toolshop "
                     "lab's) and of the correction arms in creditlab.core.correction."}
        if "dose" in tabs:
            text["gate"] = read_gate(tabs["gate"].frame)
            text["dose"] = read_dose(tabs["dose"].frame, cfg)
        text.update(super().interpret(tabs, cfg))
        if self.predictions_name in tabs:
            short = (f" This run has {cfg.grpo.updates} updates: the predictions are about rollback after hundreds of "
                     "updates (QAT peaks near 300 in the paper), so these verdicts test nothing."
                     if cfg.grpo.updates < 100 else "")
            text[self.predictions_name] += (
                f" The mismatch lab's (a)-(d) are those of the {cfg.protocol} registration of docs/mismatch.md, judged "
                "at each dose and arm on the summary table (and (b) on the paired differences with fp32)."
                + short + small_run_note(cfg.seeds))
        return text


LAB = MismatchLab()
