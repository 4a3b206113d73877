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
check: deletion curves of the credit-split necessity against a noisy direct necessity guess).

Expected: recall-only grows the response with redundancy and wrong guesses (hedging); the mean
gives up recall to gain precision; FORK keeps recall, raises precision and cuts length.

Every (arm, seed) is one cell of the results store; arms share seeds, so the initial policy, the
training prompts and the evaluation batch are the same across arms (paired comparisons).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import pandas as pd
import torch

from creditlab.envs.bagofunits import BagOfUnits, Prompts
from creditlab.errors import ConfigError
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import LabConfig, Table, check_count
from creditlab.lab.report import paired_diff, read_diff, small_run_note, summarize
from creditlab.lab.runner import Cell
from creditlab.train.bagofunits import REWARD_ARMS, BagTrainConfig, eval_seed, new_policy, reward_of, rollout, train_bag
from creditlab.train.common import generator, single_thread

__all__ = ["LAB", "ForkLab", "ForkLabConfig", "oracle_thresholds", "run_fork_cell", "run_oracle_cell"]

EXPERIMENTS = ("train", "oracle", "map", "deletion")


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
    experiments: tuple[str, ...] = EXPERIMENTS
    """``train``, ``oracle``, ``map``, ``deletion`` (see the module docstring)."""

    @classmethod
    def quick(cls) -> ForkLabConfig:
        """Under a minute on 2 cores."""
        return cls(arms=("recall", "mean", "fork"), seeds=3, updates=100, prompts_per_update=16, eval_every=20,
                   eval_prompts=128, map_known=(0.25, 1.0), map_arms=("recall", "fork"), map_seeds=1, map_updates=50)

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


def run_oracle_cell(config: dict) -> list[dict]:
    """The ``oracle`` experiment as a cell: one row per reward arm (see :func:`oracle_thresholds`)."""
    return oracle_thresholds(ForkLabConfig.from_dict(config)).to_dict("records")


class ForkLab:
    """What a recall-only rubric reward teaches, and what FORK teaches instead (module docstring)."""

    name = "fork"
    summary = "FORK vs recall-only rubric rewards: GRPO in a bag-of-units world with known truth."
    help = ("FORK in a bag-of-units world: GRPO under recall-only, arithmetic-mean and FORK rewards, and the best "
            "fixed rule per reward. Resumes an interrupted run in the same --out directory.")
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
        return tabs

    def plots(self, tabs: dict[str, Table], cfg: ForkLabConfig, out: Path) -> list[Path]:
        made = _plot(tabs["fork_curves"].frame, cfg, out) if "fork_curves" in tabs else []
        if "fork_map" in tabs:
            made.append(_plot_map(tabs["fork_map"].frame, out))
        if "fork_deletion_curve" in tabs:
            made.append(_plot_deletion(tabs["fork_deletion_curve"].frame, out))
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
        return text


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
