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

Every (arm, seed) is one cell of the results store; arms share seeds, so the initial policy, the
training prompts and the evaluation batch are the same across arms (paired comparisons).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import pandas as pd
import torch

from creditlab.envs.bagofunits import BagOfUnits, Prompts
from creditlab.errors import ConfigError
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import LabConfig, Table, check_count
from creditlab.lab.report import ci_columns, paired_diff, read_diff, small_run_note, summarize, to_markdown
from creditlab.lab.runner import Cell
from creditlab.train.bagofunits import (
    REWARD_ARMS,
    BagTrainConfig,
    bag_stream,
    eval_seed,
    make_env,
    new_policy,
    pearson,
    reward_of,
    rollout,
    train_bag,
)
from creditlab.train.common import generator, single_thread

__all__ = ["LAB", "ForkLab", "ForkLabConfig", "chosen_flips", "noise_calibration", "oracle_thresholds",
           "run_fork_cell", "run_noise_cell", "run_oracle_cell", "run_pitfall_cell"]

EXPERIMENTS = ("train", "oracle", "map", "deletion", "noise", "winrate", "pitfalls")
#: The correlation of the FORK paper's judge with its reference.
PAPER_R = 0.714
#: Largest |measured r - target r| at the chosen flip rate for the gate to pass.
GATE_TOL = 0.02


METRICS = ("length", "recall", "precision", "f1", "necessary", "redundant", "wrong", "filler")
UNIT_METRICS = ("recall", "precision", "f1")  # in [0, 1]: their intervals are clipped to it


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
        if not self.arms:
            raise ConfigError("arms", f"needs at least one of {', '.join(REWARD_ARMS)}")
        for a in (*self.arms, *self.map_arms):
            reward_of(a, self.beta)
        if "map" in self.experiments:
            if "recall" not in self.map_arms:
                raise ConfigError("map_arms", "the map compares every arm with 'recall': include it")
            for k in self.map_known:
                if not 0.0 <= k <= 1.0:
                    raise ConfigError("map_known", f"shares must be in [0, 1], got {k}")
            if self.map_seeds < 1 or self.map_updates < 1:
                raise ConfigError("map_seeds", "map_seeds and map_updates must be >= 1")
        if not 0.0 <= self.deletion_noise <= 0.5:
            raise ConfigError("deletion_noise", f"must be in [0, 0.5], got {self.deletion_noise}")
        self._validate_regime()
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

    def _validate_regime(self) -> None:
        """The fields of the noisy judge, the win rate and the pitfalls."""
        if not (0.0 <= self.judge_flip <= 0.5):
            raise ConfigError("judge_flip", f"must be in [0, 0.5], got {self.judge_flip}")
        for name in ("quality_wrong", "quality_pitfall", "pitfall_points"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(name, f"must be finite and >= 0, got {v}")
        if not math.isfinite(self.pitfall_prior):
            raise ConfigError("pitfall_prior", f"must be finite, got {self.pitfall_prior}")
        for name in ("noise_seeds", "noise_updates", "noise_calib_prompts", "pitfall_seeds", "pitfall_updates"):
            check_count(getattr(self, name), name)
        for a in (*self.noise_arms, *self.pitfall_arms):
            reward_of(a, self.beta)
        if {"noise", "winrate"} & set(self.experiments) and "fork" not in self.noise_arms:
            raise ConfigError("noise_arms", "the noise and winrate experiments compare fork with the others: "
                                            "include it")
        if "pitfalls" in self.experiments and not self.pitfall_arms:
            raise ConfigError("pitfall_arms", "needs at least one arm")
        if not self.pitfall_weights or any(not (math.isfinite(w) and w >= 0) for w in self.pitfall_weights):
            raise ConfigError("pitfall_weights", f"points finite and >= 0; got {list(self.pitfall_weights)}")
        flips = self.noise_flips
        if not flips or any(not (0.0 <= f <= 0.5) for f in flips) or 0.0 not in flips:
            raise ConfigError("noise_flips", f"flip rates in [0, 0.5], 0 included; got {list(flips)}")
        if not self.noise_targets or any(not (0.0 < t <= 1.0) for t in self.noise_targets):
            raise ConfigError("noise_targets", f"correlations in (0, 1]; got {list(self.noise_targets)}")



def run_fork_cell(arm: str, seed: int, config: dict) -> list[dict]:
    """Train one policy under ``arm`` with ``seed``; one row per evaluation point."""
    cfg = ForkLabConfig.from_dict(config)
    with single_thread():  # tiny tensors; the sweep runs one process per core
        return train_bag(arm, seed, cfg)


def oracle_thresholds(cfg: ForkLabConfig, n_prompts: int = 2048, seed: int = 0) -> pd.DataFrame:
    """Best fixed rule "state each fact with confidence >= theta once, then stop", per reward.

    An analytic check of what each reward asks for, free of learning noise: for every theta on a
    grid, the expected reward of that rule is estimated on ``n_prompts`` prompts; the row of each
    arm is its best theta with the recall, precision and length of that rule.
    """
    with single_thread():  # small tensors: intra-op threads only add contention
        return _oracle(cfg, n_prompts, seed)


def _oracle(cfg: ForkLabConfig, n_prompts: int, seed: int) -> pd.DataFrame:
    L = min(cfg.f_max, cfg.max_units)
    env = BagOfUnits(cfg.f_min, cfg.f_max, cfg.known_prob, L, lenient=cfg.lenient)
    gen = torch.Generator().manual_seed(seed)
    prompts = env.sample_prompts(n_prompts, gen)
    right = torch.rand(prompts.confidence.shape, generator=gen) < prompts.confidence  # (B, F)
    best: dict[str, dict] = {}
    for theta in torch.linspace(0.0, 1.0, 21).tolist():
        say = prompts.fact_mask & (prompts.confidence >= theta - 1e-9)  # (B, F) one unit per stated fact
        resp = env.reset(prompts)
        resp.fact[:, :L] = torch.where(say, torch.arange(cfg.f_max)[None, :], -1)[:, :L]
        resp.correct[:, :L] = (say & right)[:, :L]
        resp.unit_mask[:, :L] = say[:, :L]
        for arm in cfg.arms:
            mode, b = reward_of(arm, cfg.beta)
            sc = env.score(prompts, resp, mode, cfg.tau, b)
            r = float(sc.reward.mean())
            if arm not in best or r > best[arm]["expected reward"] + 1e-9:
                best[arm] = {"arm": arm, "best theta": theta, "expected reward": r,
                             "recall": float(sc.recall.mean()), "precision": float(sc.precision.mean()),
                             "length": float(say.sum(1).float().mean())}
    return pd.DataFrame([best[a] for a in cfg.arms])


def run_map_cell(arm: str, seed: int, known: float, lenient: bool, config: dict) -> list[dict]:
    """One ``map`` run: GRPO under ``arm`` with the share ``known`` of known facts and the judge's
    leniency; rows of the initial and the final policy."""
    base = ForkLabConfig.from_dict(config)
    cfg = replace(base, known_prob=known, lenient=lenient, updates=base.map_updates, eval_every=base.map_updates)
    with single_thread():
        rows = train_bag(arm, seed, cfg)
    return [{**r, "known": known, "lenient": lenient} for r in rows]


def _first_statements(env: BagOfUnits, prompts: Prompts, resp) -> torch.Tensor:
    """``(B, U)`` bool: the first correct statement of each fact (the truly necessary units)."""
    f_ids = torch.arange(env.f_max)[None, :, None]
    m = (resp.fact[:, None, :] == f_ids) & resp.correct[:, None, :] & resp.unit_mask[:, None, :]
    m &= prompts.fact_mask[:, :, None]
    return (m & (torch.cumsum(m.to(torch.int32), dim=2) == 1)).any(dim=1)


def run_deletion_cell(seed: int, config: dict) -> list[dict]:
    """Necessity deletion curves on the initial policy's responses (one evaluation batch): units
    deleted in ascending order of the credit-split necessity (FORK's unit credit), of a direct
    per-unit necessity guess that is wrong with probability ``deletion_noise`` (the generic
    criteria baseline), and of the truth (the first correct statement of each fact)."""
    from creditlab.core.precision import deletion_curve, unit_credit

    cfg = ForkLabConfig.from_dict(config)
    env = BagOfUnits(cfg.f_min, cfg.f_max, cfg.known_prob, cfg.max_units, lenient=cfg.lenient)
    policy = new_policy(cfg.hidden, seed)
    prompts = env.sample_prompts(cfg.eval_prompts, torch.Generator().manual_seed(eval_seed(seed)))
    gen = generator("fork/deletion", seed)
    with torch.no_grad():
        resp, _ = rollout(env, policy, prompts, gen)
    match, _ = env.verdicts(prompts, resp)
    rubrics = prompts.fact_mask & (prompts.points > 0)
    truth = _first_statements(env, prompts, resp)
    flip = torch.rand(truth.shape, generator=gen) < cfg.deletion_noise
    jitter = 1e-3 * torch.rand(truth.shape, generator=gen)  # ties broken at random, not by position
    scores = {"credit split (FORK)": unit_credit(match, rubrics, resp.unit_mask) + jitter,
              "direct guess": (truth ^ flip).float() + jitter, "truth": truth.float() + jitter}
    rows = []
    n_units = float(resp.unit_mask.sum(1).float().mean())
    n = resp.unit_mask.sum(1)  # (B,) units per response
    fracs = torch.linspace(0, 1, 11)
    k = torch.floor(fracs[None, :] * n[:, None]).long()  # (B, 11): units deleted at each share of the response
    has = n > 0
    for name, sc in scores.items():
        curve, m = deletion_curve(match, prompts.points, rubrics, resp.unit_mask, sc)
        free = float(m["reward/fork/deletion_free_frac"])
        at = curve.gather(1, k)[has].mean(0)  # mean recall after deleting that share of each response
        rows += [{"seed": seed, "predictor": name, "deleted_share": float(f), "recall": float(v), "free_frac": free,
                  "mean_units": n_units} for f, v in zip(fracs.tolist(), at.tolist(), strict=True)]
    return rows


def noise_calibration(cfg: ForkLabConfig) -> pd.DataFrame:
    """r per flip rate: Pearson correlation between the FORK F1 a noisy judge gives the initial
    policies' responses and the exact F1 (``noise_calib_prompts`` prompts for each of the
    ``noise_seeds`` initial policies, pooled; the same noise draw reused across rates, so r is
    monotone up to the sampling noise of one draw). Also the r of recall and of precision, and the
    lowest and highest r of one policy. Computed in the pitfall-free world of ``cfg``."""
    with single_thread():
        return _calibration(json.dumps(replace(cfg, pitfalls=False).identity(), sort_keys=True)).copy()


@functools.lru_cache(maxsize=8)
def _calibration(ident: str) -> pd.DataFrame:
    cfg = ForkLabConfig.from_dict(json.loads(ident))
    env = make_env(cfg)
    exact, noisy_by_flip = [], {f: [] for f in cfg.noise_flips}
    for seed in range(cfg.noise_seeds):
        gen = torch.Generator().manual_seed(bag_stream("calib", seed))
        prompts = env.sample_prompts(cfg.noise_calib_prompts, gen)
        with torch.no_grad():
            resp, _ = rollout(env, new_policy(cfg.hidden, seed), prompts, gen)
        truth = env.score(prompts, resp, "fork", cfg.tau, 1.0)
        exact.append(truth)
        for f in cfg.noise_flips:  # one draw of uniforms per seed, thresholded at each rate
            noisy_by_flip[f].append(env.score(prompts, resp, "fork", cfg.tau, 1.0, f,
                                              torch.Generator().manual_seed(bag_stream("calib_judge", seed))))
    cat = lambda scores, key: torch.cat([getattr(x, key) for x in scores])  # noqa: E731
    rows = []
    for f in cfg.noise_flips:
        noisy = noisy_by_flip[f]
        per_seed = [pearson(n.reward, t.reward) for n, t in zip(noisy, exact, strict=True)]
        rows.append({"flip": f, "r": pearson(cat(noisy, "reward"), cat(exact, "reward")),
                     "r_min_policy": min(per_seed), "r_max_policy": max(per_seed),
                     "r_recall": pearson(cat(noisy, "recall"), cat(exact, "recall")),
                     "r_precision": pearson(cat(noisy, "precision"), cat(exact, "precision")),
                     "responses": int(sum(len(t.reward) for t in exact))})
    return pd.DataFrame(rows)


def chosen_flips(calib: pd.DataFrame, targets: tuple[float, ...]) -> pd.DataFrame:
    """Per target r: the grid's flip rate whose measured r is closest to it (the lower rate on a
    tie), its measured r and whether it passes the gate (within :data:`GATE_TOL`)."""
    rows = []
    for t in targets:
        gap = (calib["r"] - t).abs()
        i = int(gap.idxmin())  # first (lowest-rate) minimum: the grid is in ascending order
        r = float(calib.loc[i, "r"])
        rows.append({"target_r": t, "flip": float(calib.loc[i, "flip"]), "measured_r": r,
                     "gap": abs(r - t), "gate": "pass" if abs(r - t) <= GATE_TOL else "FAIL"})
    return pd.DataFrame(rows)


def run_calibration_cell(config: dict) -> list[dict]:
    """The noise calibration as a cell (its rows are the gate table's source)."""
    return noise_calibration(ForkLabConfig.from_dict(config)).to_dict("records")


def run_noise_cell(arm: str, seed: int, target: float, flip: float, config: dict) -> list[dict]:
    """One ``noise`` run: GRPO under ``arm`` on the verdicts of a judge flipping each with
    probability ``flip`` (chosen for the correlation ``target``), no pitfalls; extended evaluation
    (exact verdicts) of the initial and the final policy."""
    base = ForkLabConfig.from_dict(config)
    cfg = replace(base, judge_flip=flip, pitfalls=False, updates=base.noise_updates, eval_every=base.noise_updates)
    with single_thread():
        rows = train_bag(arm, seed, cfg, extended=True)
    return [{**r, "target_r": target, "flip": flip} for r in rows]


def run_pitfall_cell(arm: str, seed: int, points: float, config: dict) -> list[dict]:
    """One ``pitfalls`` run: GRPO under ``arm`` in the world with pitfalls, the absence rubric worth
    ``points`` in the reward's rubric (judge noise as ``judge_flip``); extended evaluation of the
    initial policy and every quarter of training."""
    base = ForkLabConfig.from_dict(config)
    cfg = replace(base, pitfalls=True, pitfall_points=points, updates=base.pitfall_updates,
                  eval_every=max(1, base.pitfall_updates // 4))
    with single_thread():
        return [{**r, "pitfall_points": points} for r in train_bag(arm, seed, cfg, extended=True)]


def run_oracle_cell(config: dict) -> list[dict]:
    """The ``oracle`` experiment as a cell: one row per reward arm (see :func:`oracle_thresholds`)."""
    return oracle_thresholds(ForkLabConfig.from_dict(config)).to_dict("records")


class ForkLab:
    """What a recall-only rubric reward teaches, and what FORK teaches instead (module docstring)."""

    name = "fork"
    summary = "FORK vs recall-only rubric rewards: GRPO in a bag-of-units world with known truth."
    help = ("FORK in a bag-of-units world: GRPO under recall-only, arithmetic-mean and FORK rewards, and the best "
            "fixed rule per reward. Resumes an interrupted run in the same --out directory.")
    quick_help = ("Reduced run: every experiment, small: about 50 s on 2 cores (nothing to build; load average "
                  "2-3).")
    config_type = ForkLabConfig

    def describe(self, cfg: ForkLabConfig) -> str:
        return (f"Bag-of-units world: {cfg.f_min}-{cfg.f_max} rubric facts per prompt, a fact known with probability "
                f"{cfg.known_prob}, responses of at most {cfg.max_units} units. GRPO ({cfg.prompts_per_update} prompts "
                f"x {cfg.group_size} rollouts, {cfg.updates} updates, Adam lr {cfg.lr}) under the rewards "
                f"{', '.join(cfg.arms)} (FORK beta = {cfg.beta}, necessity tau = {cfg.tau}), {cfg.seeds} paired "
                f"seeds: the same initial policy, training prompts and evaluation batch ({cfg.eval_prompts} prompts) "
                "in every arm. Verdicts are exact (the world knows which units are right, redundant or filler).")

    def cells(self, cfg: ForkLabConfig) -> list[Cell]:
        ident = cfg.identity()
        cells = []
        if "train" in cfg.experiments:
            cells += [Cell("train", f"arm={arm}/seed={seed}", run_fork_cell,
                           {"arm": arm, "seed": seed, "config": ident})
                      for seed in range(cfg.seeds) for arm in cfg.arms]
        if "oracle" in cfg.experiments:
            cells.append(Cell("oracle", "oracle", run_oracle_cell, {"config": ident}))
        if "map" in cfg.experiments:
            cells += [Cell("map", f"known={k}/lenient={len_}/arm={arm}/seed={seed}", run_map_cell,
                           {"arm": arm, "seed": seed, "known": k, "lenient": len_, "config": ident})
                      for k in cfg.map_known for len_ in cfg.map_lenient for arm in cfg.map_arms
                      for seed in range(cfg.map_seeds)]
        if "deletion" in cfg.experiments:
            cells += [Cell("deletion", f"seed={seed}", run_deletion_cell, {"seed": seed, "config": ident})
                      for seed in range(cfg.seeds)]
        return cells + self._regime_cells(cfg, ident)

    def _regime_cells(self, cfg: ForkLabConfig, ident: dict) -> list[Cell]:
        """Cells of ``noise``, ``winrate`` and ``pitfalls``; ``winrate`` is the exact-judge part of
        ``noise`` (the same cells, shared when both run)."""
        cells: list[Cell] = []
        flips: dict[float, float] = {}
        if "noise" in cfg.experiments:
            cells.append(Cell("noise_calibration", "calibration", run_calibration_cell, {"config": ident}))
            gate = chosen_flips(noise_calibration(cfg), cfg.noise_targets)
            flips = dict(zip(gate["target_r"], gate["flip"], strict=True))
        if "winrate" in cfg.experiments:
            flips.setdefault(1.0, 0.0)
        for target, flip in flips.items():
            cells += [Cell("noise", f"target={target:g}/flip={flip:g}/arm={arm}/seed={seed}", run_noise_cell,
                           {"arm": arm, "seed": seed, "target": float(target), "flip": float(flip), "config": ident})
                      for seed in range(cfg.noise_seeds) for arm in cfg.noise_arms]
        if "pitfalls" in cfg.experiments:
            cells += [Cell("pitfalls", f"points={w:g}/arm={arm}/seed={seed}", run_pitfall_cell,
                           {"arm": arm, "seed": seed, "points": float(w), "config": ident})
                      for w in cfg.pitfall_weights for seed in range(cfg.pitfall_seeds) for arm in cfg.pitfall_arms]
        return cells

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

    def tables(self, rows: dict[str, pd.DataFrame], cfg: ForkLabConfig) -> dict[str, Table]:
        tabs: dict[str, Table] = {}
        if "train" in rows:
            df = rows["train"].sort_values(["arm", "seed", "update"]).reset_index(drop=True)
            tabs["fork_curves"] = Table(df, "Evaluation over training, every run", report=False)
            summary = summary_tables(df, cfg)
            tabs["fork_final"] = Table(summary["final"], "Final policies (mean [95% CI] over seeds)", console=True)
            if len(summary["paired"]):
                tabs["fork_paired"] = Table(summary["paired"], "Paired differences (same seeds)", console=True)
        if "oracle" in rows:
            order = {a: i for i, a in enumerate(cfg.arms)}
            o = rows["oracle"].sort_values("arm", key=lambda c: c.map(order)).reset_index(drop=True)
            tabs["fork_oracle"] = Table(o, "Best fixed rule 'state each fact with confidence >= theta once' per "
                                           "reward (no learning)", console=True)
        if "map" in rows:
            df = rows["map"]
            tabs["fork_map_runs"] = Table(df, "map: every run (initial and final policy)", report=False)
            tabs["fork_map"] = Table(map_table(df[df["update"] == cfg.map_updates], cfg),
                                     "Where FORK keeps recall and where it trades it (final policies, means over "
                                     "seeds)", console=True)
        if "deletion" in rows:
            df = rows["deletion"]
            tabs["fork_deletion_curve"] = Table(
                df.groupby(["predictor", "deleted_share"], sort=False)["recall"].mean().reset_index(),
                "Deletion curves: mean recall after deleting a share of each response's units", report=False)
            free = df.drop_duplicates(["seed", "predictor"])
            s = summarize(free, ["predictor"], "free_frac", (0.0, 1.0))
            s["mean_units"] = float(free["mean_units"].mean())
            tabs["fork_deletion"] = Table(s, "Necessity check: share of a response's units deleted before recall "
                                             "drops (initial policy)")
        return tabs | regime_tables(rows, cfg)

    def plots(self, tabs: dict[str, Table], cfg: ForkLabConfig, out: Path) -> list[Path]:
        made = _plot(tabs["fork_curves"].frame, cfg, out) if "fork_curves" in tabs else []
        if "fork_map" in tabs:
            made.append(_plot_map(tabs["fork_map"].frame, out))
        if "fork_deletion_curve" in tabs:
            made.append(_plot_deletion(tabs["fork_deletion_curve"].frame, out))
        if "fork_noise" in tabs:
            made.append(_plot_noise(tabs["fork_noise_calibration"].frame, tabs["fork_noise"].frame, cfg, out))
        if "fork_winrate" in tabs:
            made.append(_plot_winrate(tabs["fork_winrate"].frame, out))
        if "fork_pitfalls" in tabs:
            made.append(_plot_pitfalls(tabs["fork_pitfalls"].frame, out))
        return made

    def interpret(self, tabs: dict[str, Table], cfg: ForkLabConfig) -> dict[str, str]:
        text: dict[str, str] = {}
        few = small_run_note(cfg.seeds)
        if "fork_final" in tabs:
            text["fork_final"] = (
                "Length, recall, precision and the anatomy of the final policies' responses (units that are "
                "necessary, redundant restatements, wrong facts, filler), with the initial policy for reference. "
                "Expected: recall-only grows the response with redundancy and wrong guesses; FORK keeps recall, "
                "raises precision and cuts length; the mean gives up more recall." + few)
        if "fork_paired" in tabs:
            d = tabs["fork_paired"].frame.rename(columns={"pairs": "n"})
            text["fork_paired"] = " ".join(
                read_diff(g, ["metric"], what) for what, g in d.groupby("diff", sort=False))
        if "fork_oracle" in tabs:
            o = tabs["fork_oracle"].frame
            text["fork_oracle"] = (
                "What each reward asks for without learning noise: the best confidence threshold theta for the rule "
                "'state each fact whose confidence is at least theta, once'. "
                + "; ".join(f"{r['arm']}: theta {r['best theta']:.2f}, recall {r['recall']:.2f}, precision "
                            f"{r['precision']:.2f}" for _, r in o.iterrows())
                + ". A reward that rewards guessing picks a low theta.")
        if "fork_map" in tabs:
            m = tabs["fork_map"].frame
            parts = []
            for lenient in cfg.map_lenient:
                g = m[(m["lenient"] == lenient) & (m["arm"] == "fork")].sort_values("known")
                parts.append(f"{'lenient' if lenient else 'strict'} judge, fork: relative recall change "
                             + ", ".join(f"{r:+.0%} at {k:g}" for k, r in zip(g["known"], g["rel_recall"], strict=True))
                             + "; length ratio " + ", ".join(f"{x:.1f}x" for x in g["length_ratio"]))
            text["fork_map"] = (
                f"Each cell trains every arm from the same initial policies ({cfg.map_seeds} paired seeds, "
                f"{cfg.map_updates} updates) with a share `known` of the facts known for sure (the rest are guesses "
                "with confidence U(0.05, 0.95)) and a lenient or strict judge (a strict judge matches only the first "
                "statement of a fact to its rubric). length_ratio = recall-only length / arm length; rel_recall = "
                "(arm recall - recall-only recall) / recall-only recall; extra_redundant / extra_wrong: the share "
                "of recall-only's extra units (over the arm) that are restatements / wrong guesses. "
                + "; ".join(parts) + "." + small_run_note(cfg.map_seeds))
        if "fork_deletion" in tabs:
            d = tabs["fork_deletion"].frame.set_index("predictor")["mean"]
            units = tabs["fork_deletion"].frame["mean_units"].iloc[0]
            text["fork_deletion"] = (
                f"Units of the initial policy's responses (mean {units:.1f} per response) deleted in ascending "
                "order of predicted necessity; free_frac is the share deleted before recall falls below its start. "
                + "; ".join(f"{p}: {v:.2f}" for p, v in d.items())
                + f". The direct guess is wrong about a unit with probability {cfg.deletion_noise:g}; 'truth' deletes "
                "every unit but the first correct statement of each fact (the ceiling)." + few)
        return text | regime_texts(tabs, cfg)


LAB = ForkLab()


def map_table(final: pd.DataFrame, cfg: ForkLabConfig) -> pd.DataFrame:
    """Per (known, lenient, arm): means over seeds and the comparison with the recall-only arm."""
    cols = ["length", "recall", "precision", "redundant", "wrong", "filler"]
    m = final.groupby(["known", "lenient", "arm"])[cols].mean().reset_index()
    m["n"] = final.groupby(["known", "lenient", "arm"]).size().values
    ref = m[m["arm"] == "recall"].set_index(["known", "lenient"])
    out = []
    for _, r in m.iterrows():
        base = ref.loc[(r["known"], r["lenient"])]
        extra = base["length"] - r["length"]
        row = {**r.to_dict(), "length_ratio": base["length"] / r["length"] if r["length"] > 0 else float("nan"),
               "rel_recall": (r["recall"] - base["recall"]) / base["recall"] if base["recall"] > 0 else float("nan")}
        row["extra_redundant"] = (base["redundant"] - r["redundant"]) / extra if extra > 0.05 else float("nan")
        row["extra_wrong"] = (base["wrong"] - r["wrong"]) / extra if extra > 0.05 else float("nan")
        out.append(row)
    order = {a: i for i, a in enumerate(cfg.map_arms)}
    df = pd.DataFrame(out)
    return df.sort_values(["lenient", "known", "arm"], key=lambda c: c.map(order) if c.name == "arm" else c,
                          ascending=[False, True, True]).reset_index(drop=True)


def _plot_map(m: pd.DataFrame, out: Path) -> Path:
    colors = {"recall": "tab:red", "mean": "tab:blue", "fork": "tab:green", "f2": "tab:purple"}
    leniencies = sorted(m["lenient"].unique(), reverse=True)
    fig, axes = new_figure(2, len(leniencies), figsize=(5.5 * len(leniencies), 7), squeeze=False)
    for j, lenient in enumerate(leniencies):
        sub = m[(m["lenient"] == lenient) & (m["arm"] != "recall")]
        for arm, g in sub.groupby("arm", sort=False):
            g = g.sort_values("known")
            c = colors.get(arm, "tab:olive")
            axes[0][j].plot(g["known"], 100 * g["rel_recall"], "o-", color=c, label=arm)
            axes[1][j].plot(g["known"], g["length_ratio"], "o-", color=c, label=arm)
        judge = "lenient judge (paraphrases match)" if lenient else "strict judge (first statement only)"
        axes[0][j].axhline(0, color="grey", lw=1)
        axes[0][j].set(title=judge, xlabel="share of facts known", ylabel="recall change vs recall-only (%)")
        axes[1][j].axhline(1, color="grey", lw=1)
        axes[1][j].set(xlabel="share of facts known", ylabel="length ratio recall-only / arm")
        axes[0][j].legend(fontsize=8)
    return save(fig, out / "fork_map.png")


def _plot_deletion(curves: pd.DataFrame, out: Path) -> Path:
    fig, ax = new_figure(figsize=(7, 4.2))
    for name, g in curves.groupby("predictor", sort=False):
        ax.plot(g["deleted_share"], g["recall"], "o-", label=name, lw=1.8, ms=3)
    ax.set(xlabel="share of each response's units deleted (least necessary first)", ylabel="mean recall",
           ylim=(0, 1.05),
           title="necessity deletion curves (initial policy's responses)")
    ax.legend(fontsize=8)
    return save(fig, out / "fork_deletion.png")


def summary_tables(df: pd.DataFrame, cfg: ForkLabConfig) -> dict[str, pd.DataFrame]:
    """Final-point means with 95% intervals per arm (``final``), and paired differences FORK - others
    (``paired``)."""
    final = df[df["update"] == cfg.updates]
    start = df[df["update"] == 0]
    rows = []
    for arm in cfg.arms:
        row: dict[str, object] = {"arm": arm}
        for m in METRICS:
            s = summarize(final[final["arm"] == arm], ["arm"], m, (0.0, 1.0) if m in UNIT_METRICS else None).iloc[0]
            row[m] = f"{s['mean']:.3f} [{s['lo']:.3f}, {s['hi']:.3f}]"
        rows.append(row)
    init: dict[str, object] = {"arm": "initial policy"}
    for m in METRICS:
        init[m] = f"{start[m].mean():.3f}"
    tables = {"final": pd.DataFrame([init, *rows])}
    diffs = []
    if "fork" in cfg.arms:
        for other in cfg.arms:
            if other == "fork":
                continue
            for m in ("length", "recall", "precision", "wrong", "redundant"):
                d = paired_diff(final, "fork", other, [], m)
                diffs.append({"diff": f"fork - {other}", "metric": m, "mean": d["mean"].iloc[0],
                              "lo": d["lo"].iloc[0], "hi": d["hi"].iloc[0], "pairs": int(d["n"].iloc[0])})
    tables["paired"] = pd.DataFrame(diffs)
    return tables


def _plot(df: pd.DataFrame, cfg: ForkLabConfig, out: Path) -> list[Path]:
    colors = {"recall": "tab:red", "mean": "tab:blue", "fork": "tab:green", "f2": "tab:purple"}
    panels = [("length", "response length (units)"), ("recall", "recall"), ("precision", "precision"),
              ("wrong", "wrong units per response"), ("redundant", "redundant units per response"),
              ("f1", "F1 of P and Rec")]
    fig, axes = new_figure(2, 3, figsize=(13, 7))
    for ax, (m, title) in zip(axes.flat, panels, strict=True):
        for arm in cfg.arms:
            g = df[df["arm"] == arm].groupby("update")[m]
            mean, sd, n = g.mean(), g.std().fillna(0.0), g.count()
            half = 1.96 * sd / n.clip(lower=1) ** 0.5
            ax.plot(mean.index, mean.values, color=colors[arm], label=arm)
            ax.fill_between(mean.index, (mean - half).values, (mean + half).values, color=colors[arm], alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("GRPO update")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(title="reward")
    fig.suptitle(f"fork lab: GRPO under rewards {', '.join(cfg.arms)} ({cfg.seeds} seeds, mean ± 95% CI)")
    curves = save(fig, out / "fork_curves.png")

    final = df[df["update"] == cfg.updates]
    fig, ax = new_figure(figsize=(7, 4.2))
    parts = ["necessary", "redundant", "wrong", "filler"]
    pcolors = ["tab:green", "tab:orange", "tab:red", "tab:gray"]
    bottom = [0.0] * len(cfg.arms)
    for part, c in zip(parts, pcolors, strict=True):
        vals = [float(final[final["arm"] == a][part].mean()) for a in cfg.arms]
        ax.bar(list(cfg.arms), vals, bottom=bottom, color=c, label=part)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("units per response (final policy)")
    ax.set_title("anatomy of the final responses")
    ax.legend()
    anatomy = save(fig, out / "fork_anatomy.png")
    return [curves, anatomy]


# ------------------------------------------------------------------------------------------------
# the paper's regime: noisy judge, win rate, pitfalls


#: Range of the metrics the tables give intervals for (an interval is clipped to it).
BOUNDS = {"f1": (0.0, 1.0), "win_rate": (0.0, 1.0), "absence": (0.0, 1.0), "absence_change": (-1.0, 1.0)}


def _ci(values, name: str) -> dict[str, float]:
    return ci_columns(values, name, BOUNDS.get(name))


def _paired(final: pd.DataFrame, arms: tuple[str, ...], metrics: tuple[str, ...], by: list[str]) -> pd.DataFrame:
    """FORK minus every other arm, paired by seed, per group of ``by``, for each metric."""
    out = []
    for other in arms:
        if other == "fork":
            continue
        for m in metrics:
            d = paired_diff(final, "fork", other, by, m)
            d.insert(len(by) + 1, "metric", m)
            out.append(d)
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame()


def _arm_rows(final: pd.DataFrame, start: pd.DataFrame, arms: tuple[str, ...], cis: tuple[str, ...],
              means: tuple[str, ...]) -> pd.DataFrame:
    """One row per arm (means with 95% intervals over seeds for ``cis``, plain means for ``means``),
    after the initial policy's row (the same policy and evaluation samples in every arm at update 0)."""
    first = start[start["arm"] == arms[0]]
    rows = [{"arm": "initial policy", **{k: v for c in cis for k, v in _ci(first[c], c).items()},
             **{c: float(first[c].mean()) for c in means}, "n": len(first)}]
    for arm in arms:
        g = final[final["arm"] == arm]
        rows.append({"arm": arm, **{k: v for c in cis for k, v in _ci(g[c], c).items()},
                     **{c: float(g[c].mean()) for c in means}, "n": len(g)})
    return pd.DataFrame(rows)


def regime_tables(rows: dict[str, pd.DataFrame], cfg: ForkLabConfig) -> dict[str, Table]:
    """The tables of ``noise``, ``winrate`` and ``pitfalls``."""
    tabs: dict[str, Table] = {}
    if "noise_calibration" in rows and "noise" in cfg.experiments:
        calib = rows["noise_calibration"].sort_values("flip").reset_index(drop=True)
        tabs["fork_noise_calibration"] = Table(calib, "Noisy judge: r with the exact FORK F1 per flip rate (initial "
                                                      "policies' responses)")
        tabs["fork_noise_gate"] = Table(chosen_flips(calib, cfg.noise_targets),
                                        "Gate: the flip rate chosen per target correlation", console=True)
    if "noise" in rows:
        df = rows["noise"]
        final = df[df["update"] == cfg.noise_updates]
        if "noise" in cfg.experiments:
            by = ["target_r", "flip"]
            t = _noise_table(final, cfg)
            tabs["fork_noise"] = Table(t, "Trained on a noisy judge, evaluated on the exact verdicts (final "
                                          "policies)", console=True)
            tabs["fork_noise_paired"] = Table(_paired(final, cfg.noise_arms, ("f1", "win_rate", "quality"), by),
                                              "FORK's lead at each judge noise (paired seeds)", console=True)
        exact = df[df["flip"] == 0.0]
        if "winrate" in cfg.experiments and len(exact):
            fin, start = exact[exact["update"] == cfg.noise_updates], exact[exact["update"] == 0]
            tabs["fork_winrate"] = Table(
                _arm_rows(fin, start, cfg.noise_arms, ("win_rate", "quality"), ("length", "recall", "precision")),
                "Win rate against the initial policy's responses (true quality, no rubric; exact judge)",
                console=True)
            tabs["fork_winrate_paired"] = Table(_paired(fin, cfg.noise_arms, ("win_rate", "quality"), []),
                                                "Win rate: FORK minus the other arms (paired seeds)")
    if "pitfalls" in rows:
        tabs |= _pitfall_tables(rows["pitfalls"], cfg)
    return tabs


def _pitfall_tables(df: pd.DataFrame, cfg: ForkLabConfig) -> dict[str, Table]:
    key = ["pitfall_points", "arm", "seed"]
    fin, start = df[df["update"] == cfg.pitfall_updates], df[df["update"] == 0]
    gain = fin.set_index(key)["absence"] - start.set_index(key)["absence"]
    fin = fin.merge(gain.rename("absence_change").reset_index(), on=key)
    parts, paired = [], []
    for w in cfg.pitfall_weights:
        f, s0 = fin[fin["pitfall_points"] == w], start[start["pitfall_points"] == w].assign(absence_change=0.0)
        t = _arm_rows(f, s0, cfg.pitfall_arms, ("absence", "absence_change", "win_rate"),
                      ("sweep", "quality", "recall", "precision", "length"))
        parts.append(t.assign(pitfall_points=w)[["pitfall_points", *t.columns]])
        if "fork" in cfg.pitfall_arms and len(cfg.pitfall_arms) > 1:
            paired.append(_paired(f, cfg.pitfall_arms, ("absence", "win_rate"), ["pitfall_points"]))
    tabs = {"fork_pitfalls": Table(pd.concat(parts, ignore_index=True), "Absence rubric (no sweeping claims): "
                                   "satisfaction before and after training", console=True),
            "fork_pitfalls_curves": Table(df.sort_values(key + ["update"]).reset_index(drop=True),
                                          "pitfalls: every evaluation point", report=False)}
    if paired:
        tabs["fork_pitfalls_paired"] = Table(pd.concat(paired, ignore_index=True),
                                             "Pitfalls: FORK minus the other arms (paired seeds)")
    return tabs


def _noise_table(final: pd.DataFrame, cfg: ForkLabConfig) -> pd.DataFrame:
    out = []
    order = {a: i for i, a in enumerate(cfg.noise_arms)}
    for (target, flip, arm), g in final.groupby(["target_r", "flip", "arm"]):
        out.append({"target_r": target, "flip": flip, "arm": arm, **_ci(g["f1"], "f1"),
                    **_ci(g["win_rate"], "win_rate"),
                    **{c: float(g[c].mean()) for c in ("quality", "recall", "precision", "length", "wrong")},
                    "judge_r_final": float(g["judge_r"].mean()), "n": len(g)})
    t = pd.DataFrame(out)
    return t.sort_values(["target_r", "arm"], key=lambda c: c.map(order) if c.name == "arm" else -c).reset_index(
        drop=True)


def _fmt_diff(d: pd.DataFrame, metric: str, other: str) -> str:
    r = d[(d["metric"] == metric) & (d["diff"] == f"fork - {other}")]
    if r.empty:
        return "-"
    r = r.iloc[0]
    ci = "" if math.isnan(r["lo"]) else f" [{r['lo']:+.3f}, {r['hi']:+.3f}]"
    return f"{r['mean']:+.3f}{ci}"


def regime_texts(tabs: dict[str, Table], cfg: ForkLabConfig) -> dict[str, str]:
    """The interpretations of :func:`regime_tables`."""
    text: dict[str, str] = {}
    if "fork_noise_calibration" in tabs:
        g = tabs["fork_noise_gate"].frame
        text["fork_noise_calibration"] = (
            "A noisy judge flips each verdict (rubric met, unit matches rubric, unit correct) with probability p. "
            "r is the Pearson correlation of its FORK F1 with the exact one on "
            f"{int(tabs['fork_noise_calibration'].frame['responses'].iloc[0])} "
            "responses of the initial policies (one noise draw, thresholded at each rate). Chosen rates: "
            + "; ".join(f"r {t:g} -> p = {f:g} (measured r {r:.3f}, {gate})"
                        for t, f, r, gate in zip(g["target_r"], g["flip"], g["measured_r"], g["gate"], strict=True))
            + f". The paper's judge agreed with its reference at r = {PAPER_R}.")
        text["fork_noise_gate"] = (
            f"The gate passes where the measured r at the chosen rate is within {GATE_TOL} of its target; the arms "
            "of the noise experiment train at these rates. "
            + ("Every target passes." if (g["gate"] == "pass").all() else
               "Some targets FAIL: the grid of flip rates (noise_flips) does not reach them; their runs are at the "
               "closest rate, and their rows say which r they had."))
    if "fork_noise" in tabs:
        d = tabs["fork_noise_paired"].frame
        parts = []
        for (t, f), g in d.groupby(["target_r", "flip"], sort=False):
            parts.append(f"r {t:g} (p = {f:g}): F1 fork - recall {_fmt_diff(g, 'f1', 'recall')}, fork - mean "
                         f"{_fmt_diff(g, 'f1', 'mean')}; win rate fork - recall {_fmt_diff(g, 'win_rate', 'recall')}, "
                         f"fork - mean {_fmt_diff(g, 'win_rate', 'mean')}")
        text["fork_noise"] = (
            "Each arm trains on the noisy judge's verdicts and is evaluated on the exact ones (F1 of true precision "
            "and recall; win rate against the initial policy by true quality). judge_r_final: the noisy judge's r "
            "on the final policy's own responses. Prediction: FORK's lead over recall-only and over the mean keeps "
            f"its sign at r = {PAPER_R}. " + "; ".join(parts) + "." + small_run_note(cfg.noise_seeds))
        text["fork_noise_paired"] = " ".join(read_diff(g, ["target_r", "metric"], what)
                                             for what, g in d.groupby("diff", sort=False))
    if "fork_winrate" in tabs:
        w = tabs["fork_winrate"].frame.set_index("arm")
        d = tabs["fork_winrate_paired"].frame
        text["fork_winrate"] = (
            "Win rate: the share of evaluation prompts on which the arm's response has a higher true quality than the "
            "initial policy's response to the same prompt (ties count half; true quality = points of the facts stated "
            f"correctly - {cfg.quality_wrong:g} per incorrect unit - {cfg.quality_pitfall:g} for a pitfall; padding "
            "earns nothing). " + "; ".join(f"{a}: {r['win_rate']:.3f}" for a, r in w.iterrows())
            + ". Prediction: FORK's win rate well above recall-only's." + small_run_note(cfg.noise_seeds))
        text["fork_winrate_paired"] = read_diff(d, ["metric"], "fork - other")
    if "fork_pitfalls" in tabs:
        t = tabs["fork_pitfalls"].frame
        parts = [f"absence rubric worth {w:g} points in the reward: " + ", ".join(
            f"{r['arm']} {r['absence']:.3f} ({r['absence_change']:+.3f}, {r['sweep']:.2f} sweeps/response)"
            for _, r in g.iterrows()) for w, g in t.groupby("pitfall_points", sort=False)]
        text["fork_pitfalls"] = (
            "World with pitfalls: a sweep on fact f ('it is A, B or C') always matches rubric f, is incorrect and "
            "violates the prompt's absence rubric (0 points: the absence rubric is left out of the reward's rubric, "
            "only the evaluation knows it). absence = share of responses satisfying it (change from the initial "
            "policy, paired by seed). " + "; ".join(parts)
            + ". Prediction: FORK raises absence satisfaction, recall-only lowers it."
            + small_run_note(cfg.pitfall_seeds))
        if "fork_pitfalls_paired" in tabs:
            text["fork_pitfalls_paired"] = read_diff(tabs["fork_pitfalls_paired"].frame, ["pitfall_points", "metric"],
                                                     "fork - other")
    return text


_COLORS = {"recall": "tab:red", "mean": "tab:blue", "fork": "tab:green", "f2": "tab:purple"}


def _plot_noise(calib: pd.DataFrame, t: pd.DataFrame, cfg: ForkLabConfig, out: Path) -> Path:
    fig, axes = new_figure(1, 3, figsize=(15, 4.2))
    axes[0].plot(calib["flip"], calib["r"], "k.-", label="FORK F1")
    axes[0].plot(calib["flip"], calib["r_recall"], ".--", color="tab:red", label="recall")
    axes[0].plot(calib["flip"], calib["r_precision"], ".--", color="tab:blue", label="precision")
    axes[0].axhline(PAPER_R, color="grey", lw=1, ls=":")
    for f in sorted(set(t["flip"])):
        axes[0].axvline(f, color="tab:green", lw=0.8, alpha=0.5)
    axes[0].set(xlabel="flip rate p of each verdict", ylabel="r(noisy judge, exact)", title="calibration (initial "
                "policies' responses)")
    axes[0].legend(fontsize=8)
    for ax, m, label in ((axes[1], "f1", "true F1 of final policy"), (axes[2], "win_rate", "win rate vs initial")):
        for arm, g in t.groupby("arm", sort=False):
            g = g.sort_values("target_r")
            c = _COLORS.get(arm, "tab:olive")
            ax.plot(g["target_r"], g[m], "o-", color=c, label=arm)
            ax.fill_between(g["target_r"], g[f"{m}_lo"], g[f"{m}_hi"], color=c, alpha=0.15)
        ax.axvline(PAPER_R, color="grey", lw=1, ls=":")
        ax.set(xlabel="judge's r with the truth (target; 1 = exact)", ylabel=label, title=label)
        ax.invert_xaxis()
        ax.legend(fontsize=8)
    fig.suptitle(f"fork lab: training on a noisy judge ({cfg.noise_seeds} seeds, {cfg.noise_updates} updates)")
    return save(fig, out / "fork_noise.png")


def _bars(ax, t: pd.DataFrame, m: str, title: str) -> None:
    arms = list(t["arm"])
    mean = t[m].to_numpy(float)
    lo, hi = t[f"{m}_lo"].to_numpy(float), t[f"{m}_hi"].to_numpy(float)
    err = [[0 if math.isnan(x) else v - x for v, x in zip(mean, lo, strict=True)],
           [0 if math.isnan(x) else x - v for v, x in zip(mean, hi, strict=True)]]
    ax.bar(arms, mean, yerr=err, capsize=4, color=[_COLORS.get(a, "tab:gray") for a in arms])
    ax.set(title=title)
    ax.tick_params(axis="x", labelsize=8)


def _plot_winrate(t: pd.DataFrame, out: Path) -> Path:
    fig, ax = new_figure(figsize=(6, 4))
    _bars(ax, t, "win_rate", "win rate against the initial policy (true quality; ties half)")
    ax.axhline(0.5, color="grey", lw=1, ls=":")
    ax.set(ylim=(0, 1), ylabel="win rate")
    return save(fig, out / "fork_winrate.png")


def _plot_pitfalls(t: pd.DataFrame, out: Path) -> Path:
    weights = list(dict.fromkeys(t["pitfall_points"]))
    fig, axes = new_figure(len(weights), 2, figsize=(11, 3.6 * len(weights)), squeeze=False)
    for i, w in enumerate(weights):
        g = t[t["pitfall_points"] == w]
        _bars(axes[i][0], g, "absence", f"absence-rubric satisfaction (absence rubric: {w:g} points in the reward)")
        axes[i][0].set(ylim=(0, 1.05), ylabel="share of responses")
        _bars(axes[i][1], g, "win_rate", f"win rate against the initial policy ({w:g} points)")
        axes[i][1].axhline(0.5, color="grey", lw=1, ls=":")
        axes[i][1].set(ylim=(0, 1), ylabel="win rate")
    return save(fig, out / "fork_pitfalls.png")
