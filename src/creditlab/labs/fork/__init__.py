"""The fork lab: what a recall-only rubric reward teaches, and what FORK teaches instead.

World: :class:`creditlab.envs.bagofunits.BagOfUnits` (rubric facts with known truth; a response is a
sequence of units: fact statements that are right or wrong, redundant restatements, filler). A
small permutation-equivariant policy (one shared MLP scores each fact slot from its confidence and
how often it was already stated; a second scores filler and stop) is trained with GRPO (group
baseline and std, :func:`creditlab.core.advantages.grpo_advantages`; the policy, the loop and its
reward arms are :mod:`creditlab.train.bagofunits`) under one reward per arm, all computed by
:func:`creditlab.core.precision.fork_scores` on the exact verdicts:

* ``recall``: rubric recall only (what rubric rewards do today);
* ``mean``: arithmetic mean of precision and recall;
* ``fork``: F-beta of precision and recall (beta = 1);
* ``f2`` (optional): F-beta with beta = 2; ``f<beta>`` (e.g. ``f1.5``): FORK with that beta.

Experiments: ``train`` (the arms above), ``oracle`` (best fixed rule per reward, no learning),
``map`` (where FORK keeps recall and where it trades recall for precision: a sweep over the share
of facts the policy knows and the judge's leniency on paraphrases) and ``deletion`` (the necessity
check: deletion curves of the credit-split necessity against a noisy direct necessity guess), and
three in the regime of the FORK paper:

* ``noise``: a judge as noisy as a real one. The arms train on the verdicts of a judge that flips
  each verdict with probability ``p`` and are evaluated on the exact ones. ``p`` is chosen per
  target correlation (``noise_targets``; the paper's judge agreed with its reference at r = 0.714) by
  measuring, on the initial policies' responses, the Pearson r between the noisy judge's FORK F1
  and the exact one on a grid of rates (the gate table ``fork_noise_gate``);
* ``winrate``: the rubric-free headline metric: the share of prompts on which an arm's response has
  a higher true quality than the initial policy's (ties count half), exact judge;
* ``pitfalls``: a world with a tempting pitfall (a sweeping claim buys recall for sure, is incorrect
  and violates an absence rubric): absence-rubric satisfaction before and after training.

Expected: recall-only grows the response with redundancy and wrong guesses (hedging); the mean
gives up recall to gain precision; FORK keeps recall, raises precision and cuts length.

Each experiment is a module of this package and one line of :data:`EXPERIMENT_TABLE`.

Every (arm, seed) is one cell of the results store; arms share seeds, so the initial policy, the
training prompts and the evaluation batch are the same across arms (paired comparisons).
"""

from __future__ import annotations

import dataclasses

from creditlab.lab.experiment import ExperimentLab
from creditlab.lab.report import to_markdown
from creditlab.labs.fork import deletion, noise, oracle, pitfalls, train, winrate
from creditlab.labs.fork import map as map_experiment
from creditlab.labs.fork.config import EXPERIMENTS, GATE_TOL, PAPER_R, ForkLabConfig
from creditlab.labs.fork.noise import chosen_flips, noise_calibration, run_noise_cell
from creditlab.labs.fork.oracle import oracle_thresholds, run_oracle_cell
from creditlab.labs.fork.pitfalls import run_pitfall_cell
from creditlab.labs.fork.train import run_fork_cell
from creditlab.train.bagofunits import BagTrainConfig

__all__ = ["EXPERIMENTS", "EXPERIMENT_TABLE", "GATE_TOL", "LAB", "PAPER_R", "SHARED_FIELDS", "ForkLab", "ForkLabConfig",
           "chosen_flips", "noise_calibration", "oracle_thresholds", "run_fork_cell", "run_noise_cell",
           "run_oracle_cell", "run_pitfall_cell"]

#: The lab's experiments, in report order (``-e`` selects among them).
EXPERIMENT_TABLE = (train.EXPERIMENT, oracle.EXPERIMENT, map_experiment.EXPERIMENT, deletion.EXPERIMENT,
                    noise.EXPERIMENT, winrate.EXPERIMENT, pitfalls.EXPERIMENT)
#: Config fields every experiment shares: the training run, the world and the reward, the arms and seeds.
SHARED_FIELDS = (*(f.name for f in dataclasses.fields(BagTrainConfig)), "arms", "seeds", "experiments")


class ForkLab(ExperimentLab):
    """What a recall-only rubric reward teaches, and what FORK teaches instead (module docstring)."""

    name = "fork"
    summary = "FORK vs recall-only rubric rewards: GRPO in a bag-of-units world with known truth."
    help = ("FORK in a bag-of-units world: GRPO under recall-only, arithmetic-mean and FORK rewards, and the best "
            "fixed rule per reward. Resumes an interrupted run in the same --out directory.")
    quick_help = ("Reduced run: every experiment, small: about 50 s on 2 cores (nothing to build; load average "
                  "2-3).")
    config_type = ForkLabConfig
    experiments = EXPERIMENT_TABLE
    predictions_name = "fork_predictions"  # predictions 1-5 (creditlab.labs.fork.verdicts), judged on the run

    def describe(self, cfg: ForkLabConfig) -> str:
        return (f"Bag-of-units world: {cfg.f_min}-{cfg.f_max} rubric facts per prompt, a fact known with probability "
                f"{cfg.known_prob}, responses of at most {cfg.max_units} units. GRPO ({cfg.prompts_per_update} prompts "
                f"x {cfg.group_size} rollouts, {cfg.updates} updates, Adam lr {cfg.lr}) under the rewards "
                f"{', '.join(cfg.arms)} (FORK beta = {cfg.beta}, necessity tau = {cfg.tau}), {cfg.seeds} paired "
                f"seeds: the same initial policy, training prompts and evaluation batch ({cfg.eval_prompts} prompts) "
                "in every arm. Verdicts are exact (the world knows which units are right, redundant or filler).")

    def prepare(self, cfg: ForkLabConfig, progress: bool = True) -> None:
        """With ``noise``: measure the judge-noise calibration in the driver and print its gate
        table before any arm trains (the cells use the same, deterministic, calibration)."""
        if "noise" not in cfg.experiments:
            return
        gate = chosen_flips(noise_calibration(cfg), cfg.noise_targets)
        if progress:
            print("fork lab gate: flip rate of the noisy judge per target correlation with the exact FORK F1 "
                  "(measured on the initial policies' responses)")
            print(to_markdown(gate))


LAB = ForkLab()
