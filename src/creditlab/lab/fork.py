"""The fork lab: what a recall-only rubric reward teaches, and what FORK teaches instead.

World: :class:`creditlab.envs.bagofunits.BagOfUnits` (rubric facts with known truth; a response is a
sequence of units: fact statements that are right or wrong, redundant restatements, filler). A
small permutation-equivariant policy (one shared MLP scores each fact slot from its confidence and
how often it was already stated; a second scores filler and stop) is trained with GRPO (group
baseline and std, :func:`creditlab.core.advantages.grpo_advantages`) under one reward per arm,
all computed by :func:`creditlab.core.precision.fork_scores` on the exact verdicts:

* ``recall``: rubric recall only (what rubric rewards do today);
* ``mean``: arithmetic mean of precision and recall;
* ``fork``: F-beta of precision and recall (beta = 1);
* ``f2`` (optional): F-beta with beta = 2.

Expected: recall-only grows the response with redundancy and wrong guesses (hedging); the mean
gives up recall to gain precision; FORK keeps recall, raises precision and cuts length.

Every (arm, seed) is one cell of the results store; arms share seeds, so the initial policy, the
training prompts and the evaluation batch are the same across arms (paired comparisons).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pandas as pd
import torch

from creditlab.core.advantages import grpo_advantages
from creditlab.envs.bagofunits import BagOfUnits, Prompts
from creditlab.errors import ConfigError
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import LabConfig, Table, register_lab
from creditlab.lab.report import paired_diff, read_diff, small_run_note, summarize
from creditlab.lab.runner import Cell

__all__ = ["LAB", "REWARD_ARMS", "FactPolicy", "ForkLab", "ForkLabConfig", "oracle_thresholds", "run_fork_cell",
           "run_oracle_cell"]

#: Reward arms of the lab (the FORK modes of :func:`creditlab.core.precision.fork_scores`).
REWARD_ARMS = ("recall", "mean", "fork", "f2")
EXPERIMENTS = ("train", "oracle")
METRICS = ("length", "recall", "precision", "f1", "necessary", "redundant", "wrong", "filler")
UNIT_METRICS = ("recall", "precision", "f1")  # in [0, 1]: their intervals are clipped to it


@dataclass(frozen=True)
class ForkLabConfig(LabConfig):
    """Configuration of the fork lab."""

    EXPERIMENTS: ClassVar[tuple[str, ...]] = EXPERIMENTS

    arms: tuple[str, ...] = ("recall", "mean", "fork", "f2")
    """Reward arms (from ``recall``, ``mean``, ``fork``, ``f2``)."""
    seeds: int = 8
    """Seeds per arm (paired across arms)."""
    updates: int = 400
    """GRPO updates per run."""
    prompts_per_update: int = 32
    """Prompts per update; each is sampled ``group_size`` times."""
    group_size: int = 8
    """GRPO group size."""
    lr: float = 0.01
    """Adam learning rate."""
    hidden: int = 32
    """Hidden width of the policy MLPs."""
    f_min: int = 3
    """Fewest rubric facts per prompt."""
    f_max: int = 6
    """Most rubric facts per prompt."""
    known_prob: float = 0.5
    """Probability that a fact is known (confidence 1); otherwise its confidence is U(0.05, 0.95)."""
    max_units: int = 16
    """Response length cap (units)."""
    tau: float = 0.75
    """Necessity threshold: one statement of a fact has credit 1, two restatements 1/2 each."""
    beta: float = 1.0
    """F-beta of the ``fork`` arm."""
    eval_every: int = 25
    """Updates between evaluations."""
    eval_prompts: int = 512
    """Prompts in the fixed evaluation batch (one sampled response each)."""
    experiments: tuple[str, ...] = EXPERIMENTS
    """``train`` (GRPO under each reward) and ``oracle`` (best fixed rule per reward, no learning)."""

    @classmethod
    def quick(cls) -> ForkLabConfig:
        """Under a minute on 2 cores."""
        return cls(arms=("recall", "mean", "fork"), seeds=3, updates=100, prompts_per_update=16, eval_every=20,
                   eval_prompts=128)

    def validate(self) -> None:
        bad = [a for a in self.arms if a not in REWARD_ARMS]
        if bad or not self.arms:
            raise ConfigError("arms", f"unknown {bad}; valid: {', '.join(REWARD_ARMS)}")
        for name in ("seeds", "updates", "prompts_per_update", "eval_every", "eval_prompts", "hidden"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                flag = f"--{name}" if name in ("seeds", "updates") else name
                raise ConfigError(flag, f"must be an integer >= 1, got {v!r}")
        if not self.experiments or any(e not in EXPERIMENTS for e in self.experiments):
            raise ConfigError("--experiment", f"got {list(self.experiments)}; valid: {', '.join(EXPERIMENTS)}")
        if self.group_size < 2:
            raise ConfigError("group_size", f"GRPO needs groups of at least 2, got {self.group_size}")
        if not self.lr > 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr}")
        if not self.tau > 0:
            raise ConfigError("tau", f"must be > 0, got {self.tau}")
        BagOfUnits(self.f_min, self.f_max, self.known_prob, self.max_units)  # its own checks


class FactPolicy(torch.nn.Module):
    """Permutation-equivariant policy over ``[state f for each fact slot] + [filler, stop]``.

    Fact-slot features: confidence, stated 0 / 1 / 2+ times, step / max_units. Global features
    (for filler and stop): step / max_units, share of facts not yet stated, mean and max confidence
    of the facts not yet stated, a constant.
    """

    def __init__(self, hidden: int):
        super().__init__()
        self.fact = torch.nn.Sequential(torch.nn.Linear(5, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        self.glob = torch.nn.Sequential(torch.nn.Linear(5, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))

    def forward(self, prompts: Prompts, counts: torch.Tensor, t: int, max_units: int) -> torch.Tensor:
        B, F = counts.shape
        step = torch.full((B, F), t / max_units)
        cnt = counts.clamp(max=2).long()
        fact_x = torch.stack([prompts.confidence, (cnt == 0).float(), (cnt == 1).float(), (cnt == 2).float(),
                              step], dim=2)  # (B, F, 5)
        fact_logits = self.fact(fact_x).squeeze(2)  # (B, F)
        unstated = prompts.fact_mask & (counts == 0)
        n_facts = prompts.fact_mask.sum(1).clamp_min(1).float()
        n_un = unstated.sum(1).float()
        conf_un = torch.where(unstated, prompts.confidence, torch.zeros_like(prompts.confidence))
        glob_x = torch.stack([step[:, 0], n_un / n_facts, conf_un.sum(1) / n_un.clamp_min(1),
                              conf_un.max(1).values, torch.ones(B)], dim=1)  # (B, 5)
        logits = torch.cat([fact_logits, self.glob(glob_x)], dim=1)  # (B, F + 2)
        mask = torch.cat([prompts.fact_mask, torch.ones(B, 2, dtype=torch.bool)], dim=1)
        return logits.masked_fill(~mask, float("-inf"))


def _rollout(env: BagOfUnits, policy: FactPolicy, prompts: Prompts, gen: torch.Generator):
    """Sample one response per prompt; returns (responses, summed log-prob (B,))."""
    resp = env.reset(prompts)
    logp = torch.zeros(prompts.fact_mask.shape[0])
    for t in range(env.max_units):
        if bool(resp.done.all()):
            break
        logits = policy(prompts, resp.counts, t, env.max_units)
        probs = torch.softmax(logits, dim=1)
        action = torch.multinomial(probs.detach(), 1, generator=gen).squeeze(1)
        lp = torch.log_softmax(logits, dim=1).gather(1, action[:, None]).squeeze(1)
        logp = logp + torch.where(resp.done.clone(), torch.zeros_like(lp), lp)
        env.step(prompts, resp, t, action, gen)
    return resp, logp


def _evaluate(env: BagOfUnits, policy: FactPolicy, prompts: Prompts, seed: int, cfg: ForkLabConfig) -> dict:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        resp, _ = _rollout(env, policy, prompts, gen)
    fork = env.score(prompts, resp, "fork", cfg.tau, 1.0)
    parts = env.anatomy(prompts, resp)
    return {"length": float(parts["length"].mean()), "recall": float(fork.recall.mean()),
            "precision": float(fork.precision.mean()), "f1": float(fork.reward.mean()),
            **{k: float(parts[k].mean()) for k in ("necessary", "redundant", "wrong", "filler")}}


def _init_linears(module: torch.nn.Module, generator: torch.Generator) -> torch.nn.Module:
    """Initialise every ``Linear`` of ``module`` as ``torch.nn.Linear.reset_parameters`` does, from
    ``generator`` (the same numbers as under ``torch.manual_seed`` with that seed, without touching
    the global generator)."""
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5), generator=generator)
            if layer.bias is not None:
                bound = 1 / math.sqrt(layer.weight.shape[1]) if layer.weight.shape[1] > 0 else 0
                torch.nn.init.uniform_(layer.bias, -bound, bound, generator=generator)
    return module


def run_fork_cell(arm: str, seed: int, config: dict) -> list[dict]:
    """Train one policy under ``arm`` with ``seed``; one row per evaluation point."""
    cfg = ForkLabConfig.from_dict(config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors; the sweep runs one process per core
    try:
        return _train(arm, seed, cfg)
    finally:
        torch.set_num_threads(threads)


def _train(arm: str, seed: int, cfg: ForkLabConfig) -> list[dict]:
    env = BagOfUnits(cfg.f_min, cfg.f_max, cfg.known_prob, cfg.max_units)
    with torch.device("meta"):  # built without drawing from the global generator, then initialised
        policy = FactPolicy(cfg.hidden)
    policy = _init_linears(policy.to_empty(device="cpu"), torch.Generator().manual_seed(seed))  # same in every arm
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    train_gen = torch.Generator().manual_seed(1_000 + seed)
    eval_prompts = env.sample_prompts(cfg.eval_prompts, torch.Generator().manual_seed(2_000_000 + seed))
    mode = "fork" if arm == "fork" else arm
    beta = cfg.beta if arm == "fork" else 1.0
    group_ids = torch.arange(cfg.prompts_per_update).repeat_interleave(cfg.group_size)
    rows = []
    for update in range(cfg.updates + 1):
        if update % cfg.eval_every == 0 or update == cfg.updates:
            rows.append({"arm": arm, "seed": seed, "update": update,
                         **_evaluate(env, policy, eval_prompts, 3_000_000 + seed * 1_000 + update, cfg)})
        if update == cfg.updates:
            break
        prompts = env.sample_prompts(cfg.prompts_per_update, train_gen).repeat(cfg.group_size)
        resp, logp = _rollout(env, policy, prompts, train_gen)
        reward = env.score(prompts, resp, mode, cfg.tau, beta).reward
        adv = grpo_advantages(reward, group_ids)
        loss = -(adv * logp).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
    return rows


def oracle_thresholds(cfg: ForkLabConfig, n_prompts: int = 2048, seed: int = 0) -> pd.DataFrame:
    """Best fixed rule "state each fact with confidence >= theta once, then stop", per reward.

    An analytic check of what each reward asks for, free of learning noise: for every theta on a
    grid, the expected reward of that rule is estimated on ``n_prompts`` prompts; the row of each
    arm is its best theta with the recall, precision and length of that rule.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: intra-op threads only add contention
    try:
        return _oracle(cfg, n_prompts, seed)
    finally:
        torch.set_num_threads(threads)


def _oracle(cfg: ForkLabConfig, n_prompts: int, seed: int) -> pd.DataFrame:
    L = min(cfg.f_max, cfg.max_units)
    env = BagOfUnits(cfg.f_min, cfg.f_max, cfg.known_prob, L)
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
            sc = env.score(prompts, resp, arm, cfg.tau, cfg.beta if arm == "fork" else 1.0)
            r = float(sc.reward.mean())
            if arm not in best or r > best[arm]["expected reward"] + 1e-9:
                best[arm] = {"arm": arm, "best theta": theta, "expected reward": r,
                             "recall": float(sc.recall.mean()), "precision": float(sc.precision.mean()),
                             "length": float(say.sum(1).float().mean())}
    return pd.DataFrame([best[a] for a in cfg.arms])


def run_oracle_cell(config: dict) -> list[dict]:
    """The ``oracle`` experiment as a cell: one row per reward arm (see :func:`oracle_thresholds`)."""
    return oracle_thresholds(ForkLabConfig.from_dict(config)).to_dict("records")


class ForkLab:
    """What a recall-only rubric reward teaches, and what FORK teaches instead (module docstring)."""

    name = "fork"
    summary = "FORK vs recall-only rubric rewards: GRPO in a bag-of-units world with known truth."
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
        return cells

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
        return tabs

    def plots(self, tabs: dict[str, Table], cfg: ForkLabConfig, out: Path) -> list[Path]:
        return _plot(tabs["fork_curves"].frame, cfg, out) if "fork_curves" in tabs else []

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
        return text


LAB = register_lab(ForkLab())


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
