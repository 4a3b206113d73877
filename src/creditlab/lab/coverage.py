"""The coverage lab: when does concentrating the terminal advantage on a few steps hurt?

A hard-prerequisite chain (``creditlab.envs.chain``) trained with GRPO under different credit
geometries at equal total credit. Four experiments:

* ``c_sweep``: chain length C at fixed budget k — ``uniform`` vs ``concentrated`` on the first k
  causal steps. Expected: tie while C <= k, uniform ahead for every C > k.
* ``vd_sweep``: verifier density V_d at C=10 — ``uniform`` vs ``targeted`` (independent local
  signal on the exposed causal steps only), under independent and prefix exposure. Expected:
  uniform flat, targeted rising with V_d and passing uniform only at high density.
* ``shuffle``: ``per_turn`` (credit where the verifier saw progress) vs ``shuffled`` (the same
  weights on random steps) vs ``uniform``, at a dense and at a sparse verifier.
* ``dose``: credit on k random steps per rollout (fixed total credit), dose k = 1..T.

Every experiment is a set of cells (one per configuration value, all seeds and arms of the value in
one batched tensor program), persisted in a results store as they finish, so an interrupted run
resumes where it stopped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import pandas as pd

from creditlab.core.diagnostics import expected_open_fraction, p_cover
from creditlab.errors import ConfigError
from creditlab.lab.chain_trainer import ChainTrainConfig, ModelSpec, train_chain
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import LabConfig, Table, register_lab
from creditlab.lab.report import paired_diff, read_diff, small_run_note, summarize
from creditlab.lab.runner import Cell

__all__ = ["EXPERIMENTS", "LAB", "CoverageConfig", "CoverageLab", "run_cell"]

EXPERIMENTS = ("c_sweep", "vd_sweep", "shuffle", "dose")
UNIT, DIFF = (0.0, 1.0), (-1.0, 1.0)  # range of a score and of a difference of two scores (interval clipping)


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
    experiments: tuple[str, ...] = EXPERIMENTS
    """Which experiments to run."""

    def validate(self) -> None:
        self.train.validate()
        T = self.train.T
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1:
            raise ConfigError("--seeds", f"must be an integer >= 1, got {self.seeds!r}")
        if self.k < 1:
            raise ConfigError("k", f"must be >= 1, got {self.k}")
        for C in (*self.Cs, self.vd_C, *self.shuffle_Cs, self.dose_C):
            if C < 1:
                raise ConfigError("C", f"must be >= 1, got {C}")
            if C > T:
                raise ConfigError("C", f"the chain (C={C}) cannot be longer than the episode (T={T})")
        for vd in (*self.vds, *self.shuffle_vds):
            if not 0.0 <= vd <= 1.0:
                raise ConfigError("vd", f"verifier density must be in [0, 1], got {vd}")
        for k in self.dose_ks:
            if not 1 <= k <= T:
                raise ConfigError("k", f"dose k must be in [1, T={T}], got {k}")
        if not self.experiments:
            raise ConfigError("--experiment", f"select at least one of {', '.join(EXPERIMENTS)}")
        for e in self.experiments:
            if e not in EXPERIMENTS:
                raise ConfigError("--experiment", f"unknown experiment {e!r}; valid: {', '.join(EXPERIMENTS)}")

    @classmethod
    def quick(cls) -> CoverageConfig:
        """A reduced sweep that shows the same shapes in well under a minute on 2 cores."""
        return cls(train=ChainTrainConfig(updates=150, eval_points=10), seeds=6,
                   vds=(0.0, 0.5, 0.75, 0.9, 1.0), shuffle_Cs=(10,), dose_ks=(1, 2, 4, 8, 12))


def run_cell(experiment: str, specs: list[dict], train: dict) -> list[dict]:
    """Train one cell (module-level so a process pool can run it); one row per model."""
    cfg = ChainTrainConfig(**train)
    models = [ModelSpec(**s) for s in specs]
    out = train_chain(models, cfg)
    rows = []
    for m, spec in enumerate(models):
        curve = out["curve"][m]
        rows.append({
            "experiment": experiment, **spec.row(),
            "final_score": float(out["final_score"][m]), "aulc": float(curve.mean()),
            "curve": [float(v) for v in curve], "eval_at": [int(v) for v in out["eval_at"]],
            **{f"cfg_{k}": v for k, v in asdict(cfg).items()},
        })
    return rows


def _cells_of(experiment: str, groups: dict[str, list[ModelSpec]], train: ChainTrainConfig) -> list[Cell]:
    train_d = asdict(train)
    return [Cell(experiment, name, run_cell, {"experiment": experiment, "specs": [asdict(s) for s in specs],
                                              "train": train_d})
            for name, specs in groups.items()]


class CoverageLab:
    """Credit geometries on a hard-prerequisite chain (see the module docstring)."""

    name = "coverage"
    summary = "Credit geometries on a hard-prerequisite chain: C sweep, V_d sweep, shuffled control, dose."
    config_type = CoverageConfig

    def describe(self, cfg: CoverageConfig) -> str:
        t = cfg.train
        return (f"Chain of T={t.T} steps, K={t.K} actions, MLP policy (hidden {t.hidden}), GRPO with {t.group} "
                f"rollouts per update, {t.updates} updates, Adam lr {t.lr}, grad-norm clip {t.max_grad_norm}, "
                f"{'state-dependent' if t.state_dependent else 'independent-step'} observations, {cfg.seeds} paired "
                "seeds. Every arm gets the same total credit |A_i| per rollout. Score: exact expected reward "
                "(correct-prefix length / C) of the final policy. Intervals: 95% t-intervals over seeds; "
                "differences are paired by seed (same task, initial weights and noise).")

    def cells(self, cfg: CoverageConfig) -> list[Cell]:
        S = range(cfg.seeds)
        out: list[Cell] = []
        if "c_sweep" in cfg.experiments:
            out += _cells_of("c_sweep", {
                f"C={C}": [ModelSpec(seed=s, C=C, arm=a, k=cfg.k) for a in ("uniform", "concentrated") for s in S]
                for C in cfg.Cs}, cfg.train)
        if "vd_sweep" in cfg.experiments:
            out += _cells_of("vd_sweep", {
                f"{ex}/vd={vd}": [ModelSpec(seed=s, C=cfg.vd_C, arm=a, vd=vd, exposure=ex)
                                  for a in ("uniform", "targeted") for s in S]
                for ex in ("independent", "prefix") for vd in cfg.vds}, cfg.train)
        if "shuffle" in cfg.experiments:
            out += _cells_of("shuffle", {
                f"C={C}/vd={vd}": [ModelSpec(seed=s, C=C, arm=a, vd=vd) for a in ("uniform", "per_turn", "shuffled")
                                   for s in S]
                for C in cfg.shuffle_Cs for vd in cfg.shuffle_vds}, cfg.train)
        if "dose" in cfg.experiments:
            groups = {f"k={k}": [ModelSpec(seed=s, C=cfg.dose_C, arm="random_k", k=k) for s in S]
                      for k in cfg.dose_ks}
            groups["uniform"] = [ModelSpec(seed=s, C=cfg.dose_C, arm="uniform", k=cfg.train.T) for s in S]
            out += _cells_of("dose", groups, cfg.train)
        return out

    def tables(self, rows: dict[str, pd.DataFrame], cfg: CoverageConfig) -> dict[str, Table]:
        """Per experiment: the runs (one row per model, with its learning curve; not in the report),
        the mean and 95% interval per arm and configuration, and paired differences between arms."""
        T = cfg.train.T
        tabs: dict[str, Table] = {}
        for name in cfg.experiments:
            df = rows[name].sort_values(["arm", "C", "k", "vd", "exposure", "seed"], kind="stable")
            rows[name] = df.reset_index(drop=True)
            tabs[f"{name}_runs"] = Table(rows[name], f"{name}: every run", report=False)
        if "c_sweep" in rows:
            df = rows["c_sweep"]
            s = summarize(df, ["C", "arm"], "final_score", UNIT)
            s["P_cover"] = [float(p_cover(T, C, cfg.k)) for C in s["C"]]
            tabs["c_sweep"] = Table(s, f"C sweep (k={cfg.k}): uniform vs concentrated on the first k causal steps")
            tabs["c_sweep_diff"] = Table(paired_diff(df, "uniform", "concentrated", ["C"], "final_score", bounds=DIFF),
                                         "C sweep: paired difference uniform - concentrated", console=True)
        if "vd_sweep" in rows:
            df = rows["vd_sweep"]
            s = summarize(df, ["exposure", "vd", "arm"], "final_score", UNIT)
            s["open_fraction"] = [float(expected_open_fraction(v, cfg.vd_C)) if e == "independent" else
                                  round(v * cfg.vd_C) / cfg.vd_C
                                  for e, v in zip(s["exposure"], s["vd"], strict=True)]
            tabs["vd_sweep"] = Table(s, f"Verifier-density sweep (C={cfg.vd_C}): uniform vs targeted")
            d = paired_diff(df, "targeted", "uniform", ["exposure", "vd"], "final_score", bounds=DIFF)
            tabs["vd_sweep_diff"] = Table(d, "V_d sweep: paired difference targeted - uniform", console=True)
        if "shuffle" in rows:
            df = rows["shuffle"]
            tabs["shuffle"] = Table(summarize(df, ["C", "vd", "arm"], "final_score", UNIT),
                                    "Shuffled control: uniform, per_turn, shuffled")
            tabs["shuffle_diff"] = Table(pd.concat([
                paired_diff(df, "per_turn", "shuffled", ["C", "vd"], "final_score", bounds=DIFF),
                paired_diff(df, "per_turn", "uniform", ["C", "vd"], "final_score", bounds=DIFF),
                paired_diff(df, "shuffled", "uniform", ["C", "vd"], "final_score", bounds=DIFF),
            ], ignore_index=True), "Shuffled control: paired differences", console=True)
        if "dose" in rows:
            df = rows["dose"]
            s = summarize(df, ["arm", "k"], "final_score", UNIT)
            s["aulc"] = summarize(df, ["arm", "k"], "aulc")["mean"]
            s["P_cover"] = [float(p_cover(T, cfg.dose_C, k)) for k in s["k"]]
            tabs["dose"] = Table(s, f"Dose-response of coverage (C={cfg.dose_C})")
        return tabs

    def plots(self, tabs: dict[str, Table], cfg: CoverageConfig, out: Path) -> list[Path]:
        made: list[Path] = []
        runs = {name: tabs[f"{name}_runs"].frame for name in cfg.experiments}
        if "c_sweep" in runs:
            made += [plot_c_sweep(runs["c_sweep"], cfg, out), plot_curves(runs["c_sweep"], cfg, out)]
        if "vd_sweep" in runs:
            made.append(plot_vd_sweep(runs["vd_sweep"], cfg, out))
        if "shuffle" in runs:
            made.append(plot_shuffle(runs["shuffle"], cfg, out))
        if "dose" in runs:
            made.append(plot_dose(runs["dose"], cfg, out))
        return made

    def interpret(self, tabs: dict[str, Table], cfg: CoverageConfig) -> dict[str, str]:
        few = small_run_note(cfg.seeds)
        text: dict[str, str] = {}
        if "c_sweep" in tabs:
            s = tabs["c_sweep"].frame
            conc = s[s["arm"] == "concentrated"].set_index("C")["mean"]
            text["c_sweep"] = (
                f"Final score per chain length C for uniform credit and credit concentrated on the first k={cfg.k} "
                f"causal steps; P_cover is the analytic chance that k random steps cover the whole chain. Expected: "
                f"a tie while C <= k, uniform ahead for every C > k. Concentrated scores "
                + ", ".join(f"{v:.2f} at C={c}" for c, v in conc.items()) + "." + few)
            text["c_sweep_diff"] = read_diff(tabs["c_sweep_diff"].frame, ["C"], "uniform - concentrated")
        if "vd_sweep" in tabs:
            text["vd_sweep"] = (
                "Final score against the verifier density V_d (share of causal steps whose local correctness the "
                "verifier sees): targeted credit goes only to those steps, uniform ignores the verifier. "
                "open_fraction is the analytic share of the chain that targeted credit can open (geometric "
                "series for independent exposure, the exposed prefix for prefix exposure). Expected: uniform "
                "flat, targeted rising with V_d and passing uniform only at high density." + few)
            text["vd_sweep_diff"] = read_diff(tabs["vd_sweep_diff"].frame, ["exposure", "vd"], "targeted - uniform")
        if "shuffle" in tabs:
            text["shuffle"] = (
                "per_turn puts the credit on the steps where the verifier saw progress (among the exposed causal "
                "steps); shuffled permutes the same weights to random steps of the rollout (same concentration, "
                "no aim). If targeting helped because it aims well, per_turn would beat shuffled." + few)
            d = tabs["shuffle_diff"].frame
            text["shuffle_diff"] = " ".join(read_diff(g, ["C", "vd"], what)
                                            for what, g in d.groupby("diff", sort=False))
        if "dose" in tabs:
            s = tabs["dose"].frame
            rk = s[s["arm"] == "random_k"].sort_values("k")
            text["dose"] = (
                f"Credit on k steps drawn at random per rollout (same total credit), C={cfg.dose_C}; P_cover is the "
                "analytic chance that one rollout's credit covers the chain. Final score by k: "
                + ", ".join(f"{m:.2f} (k={int(k)})" for k, m in zip(rk["k"], rk["mean"], strict=True))
                + ". Expected: rising with k toward uniform as coverage grows." + few)
        return text


LAB = register_lab(CoverageLab())


# --------------------------------------------------------------------------------------------
# plots (analytic curves beside the measured ones)

COLORS = {"uniform": "tab:blue", "concentrated": "tab:red", "targeted": "tab:green", "per_turn": "tab:orange",
          "shuffled": "tab:purple", "random_k": "tab:brown"}


def _band(ax, s: pd.DataFrame, x: str, arm: str, label: str | None = None) -> None:
    s = s.sort_values(x)
    ax.plot(s[x], s["mean"], "o-", color=COLORS.get(arm), label=label or arm, lw=1.8, ms=4)
    ax.fill_between(s[x], s["lo"], s["hi"], color=COLORS.get(arm), alpha=0.2)


def plot_c_sweep(df: pd.DataFrame, cfg, out: Path) -> Path:
    T, K, k = cfg.train.T, cfg.train.K, cfg.k
    s = summarize(df, ["C", "arm"], "final_score", UNIT)
    fig, (a1, a2) = new_figure(1, 2, figsize=(11, 4.2))
    for arm in ("uniform", "concentrated"):
        _band(a1, s[s["arm"] == arm], "C", arm)
    Cs = np.arange(1, T + 1)
    # concentrated credit can only teach the first k causal steps; the rest stay at chance 1/K
    ceiling = [(min(C, k) + sum(K ** -j for j in range(1, C - min(C, k) + 1))) / C for C in Cs]
    a1.plot(Cs, ceiling, "--", color=COLORS["concentrated"], alpha=0.7, label="analytic: untaught steps at chance 1/K")
    a1.axvline(k, color="grey", ls=":", lw=1)
    a1.text(k + 0.1, 0.05, f"C = k = {k}", color="grey")
    a1.set(xlabel="chain length C", ylabel="final score (expected prefix / C)", ylim=(0, 1.05),
           title=f"C sweep: credit on k={k} causal steps vs uniform")
    a1.legend(loc="lower left", fontsize=8)
    pc = np.array([float(p_cover(T, C, k)) for C in Cs])
    pos = pc > 0
    a2.semilogy(Cs[pos], pc[pos], "s-", color="black", label=f"P_cover(T={T}, C, k={k})")
    a2.plot(Cs[~pos], np.full((~pos).sum(), 1e-4), "kv", mfc="none", label="P_cover = 0 (C > k)")
    a2.set(xlabel="chain length C", ylabel="probability (log)",
           title="analytic: a random k-step update covers the chain")
    a2.set_ylim(5e-5, 2)
    a2.legend(fontsize=8)
    return save(fig, out / "c_sweep.png")


def plot_vd_sweep(df: pd.DataFrame, cfg, out: Path) -> Path:
    C = cfg.vd_C
    fig, axes = new_figure(1, 2, figsize=(11, 4.2), sharey=True)
    grid = np.linspace(0, 1, 101)
    for ax, ex in zip(axes, ("independent", "prefix"), strict=True):
        sub = df[df["exposure"] == ex]
        if sub.empty:
            continue
        s = summarize(sub, ["vd", "arm"], "final_score", UNIT)
        for arm in ("uniform", "targeted"):
            _band(ax, s[s["arm"] == arm], "vd", arm)
        analytic = expected_open_fraction(grid, C).numpy() if ex == "independent" else np.round(grid * C) / C
        ax.plot(grid, analytic, "--", color=COLORS["targeted"], alpha=0.7,
                label="analytic open fraction" + (" (geometric series)" if ex == "independent" else ""))
        ax.set(xlabel="verifier density V_d", title=f"{ex} exposure, C={C}", ylim=(0, 1.05))
        ax.legend(loc="upper left", fontsize=8)
    axes[0].set_ylabel("final score")
    return save(fig, out / "vd_sweep.png")


def plot_shuffle(df: pd.DataFrame, cfg, out: Path) -> Path:
    s = summarize(df, ["C", "vd", "arm"], "final_score", UNIT)
    confs = s[["C", "vd"]].drop_duplicates().sort_values(["C", "vd"], ascending=[True, False]).values.tolist()
    arms = ["uniform", "per_turn", "shuffled"]
    fig, ax = new_figure(figsize=(8, 4.2))
    w = 0.26
    for i, arm in enumerate(arms):
        ys, lo, hi = [], [], []
        for C, vd in confs:
            r = s[(s["C"] == C) & (s["vd"] == vd) & (s["arm"] == arm)].iloc[0]
            ys.append(r["mean"])
            lo.append(r["mean"] - r["lo"])
            hi.append(r["hi"] - r["mean"])
        ax.bar(np.arange(len(confs)) + (i - 1) * w, ys, w, yerr=[lo, hi], color=COLORS[arm], label=arm, capsize=3)
    ax.set_xticks(range(len(confs)), [f"C={int(C)}, V_d={vd:g}" for C, vd in confs])
    ax.set(ylabel="final score", ylim=(0, 1.05), title="shuffled control: same concentration, no aim")
    ax.legend(fontsize=8)
    return save(fig, out / "shuffle.png")


def plot_dose(df: pd.DataFrame, cfg, out: Path) -> Path:
    T, C = cfg.train.T, cfg.dose_C
    sub = df[df["arm"] == "random_k"]
    fig, ax = new_figure(figsize=(7, 4.2))
    for value, style in (("final_score", "o-"), ("aulc", "s--")):
        s = summarize(sub, ["k"], value, UNIT).sort_values("k")
        ax.plot(s["k"], s["mean"], style, color="tab:brown", label=f"random k steps: {value}")
        ax.fill_between(s["k"], s["lo"], s["hi"], color="tab:brown", alpha=0.15)
    u = df[df["arm"] == "uniform"]
    if not u.empty:
        ax.axhline(u["final_score"].mean(), color=COLORS["uniform"], ls=":", label="uniform: final_score")
    ks = np.arange(1, T + 1)
    ax2 = ax.twinx()
    ax2.plot(ks, [float(p_cover(T, C, k)) for k in ks], "k-.", alpha=0.6, label="P_cover(T, C, k)")
    ax2.set_ylabel("P_cover (analytic)")
    ax2.set_ylim(0, 1.05)
    ax.set(xlabel="steps receiving credit per rollout (k)", ylabel="score", ylim=(0, 1.05),
           title=f"dose-response of coverage (C={C}, T={T})")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="lower right")
    return save(fig, out / "dose.png")


def plot_curves(df: pd.DataFrame, cfg, out: Path) -> Path:
    """Learning curves of the C sweep (mean over seeds)."""
    Cs = sorted(df["C"].unique())
    pick = [C for C in Cs if C in (cfg.k, cfg.k + 1, max(Cs))] or Cs[:3]
    fig, axes = new_figure(1, len(pick), figsize=(4 * len(pick), 3.6), sharey=True, squeeze=False)
    for ax, C in zip(axes[0], pick, strict=True):
        for arm in ("uniform", "concentrated"):
            sub = df[(df["C"] == C) & (df["arm"] == arm)]
            if sub.empty:
                continue
            curves = np.stack(sub["curve"].map(np.asarray).to_list())
            x = np.asarray(sub["eval_at"].iloc[0])
            ax.plot(x, curves.mean(0), color=COLORS[arm], label=arm)
            ax.fill_between(x, curves.min(0), curves.max(0), color=COLORS[arm], alpha=0.12)
        ax.set(title=f"C={C}", xlabel="update", ylim=(0, 1.05))
    axes[0][0].set_ylabel("score (mean; band = min..max over seeds)")
    axes[0][0].legend(fontsize=8)
    return save(fig, out / "c_sweep_curves.png")
