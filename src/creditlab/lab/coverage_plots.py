"""PNG plots of the coverage lab, with the analytic curves beside the measured ones."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from creditlab.core.diagnostics import expected_open_fraction, p_cover  # noqa: E402
from creditlab.lab.report import summarize  # noqa: E402

COLORS = {"uniform": "tab:blue", "concentrated": "tab:red", "targeted": "tab:green", "per_turn": "tab:orange",
          "shuffled": "tab:purple", "random_k": "tab:brown"}


def _band(ax, s: pd.DataFrame, x: str, arm: str, label: str | None = None) -> None:
    s = s.sort_values(x)
    ax.plot(s[x], s["mean"], "o-", color=COLORS.get(arm), label=label or arm, lw=1.8, ms=4)
    ax.fill_between(s[x], s["lo"], s["hi"], color=COLORS.get(arm), alpha=0.2)


def plot_c_sweep(df: pd.DataFrame, cfg, out: Path) -> None:
    T, K, k = cfg.train.T, cfg.train.K, cfg.k
    s = summarize(df, ["C", "arm"], "final_score")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
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
    fig.tight_layout()
    fig.savefig(out / "c_sweep.png", dpi=110)
    plt.close(fig)


def plot_vd_sweep(df: pd.DataFrame, cfg, out: Path) -> None:
    C = cfg.vd_C
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    grid = np.linspace(0, 1, 101)
    for ax, ex in zip(axes, ("independent", "prefix"), strict=True):
        sub = df[df["exposure"] == ex]
        if sub.empty:
            continue
        s = summarize(sub, ["vd", "arm"], "final_score")
        for arm in ("uniform", "targeted"):
            _band(ax, s[s["arm"] == arm], "vd", arm)
        analytic = expected_open_fraction(grid, C).numpy() if ex == "independent" else np.round(grid * C) / C
        ax.plot(grid, analytic, "--", color=COLORS["targeted"], alpha=0.7,
                label="analytic open fraction" + (" (geometric series)" if ex == "independent" else ""))
        ax.set(xlabel="verifier density V_d", title=f"{ex} exposure, C={C}", ylim=(0, 1.05))
        ax.legend(loc="upper left", fontsize=8)
    axes[0].set_ylabel("final score")
    fig.tight_layout()
    fig.savefig(out / "vd_sweep.png", dpi=110)
    plt.close(fig)


def plot_shuffle(df: pd.DataFrame, cfg, out: Path) -> None:
    s = summarize(df, ["C", "vd", "arm"], "final_score")
    confs = s[["C", "vd"]].drop_duplicates().sort_values(["C", "vd"], ascending=[True, False]).values.tolist()
    arms = ["uniform", "per_turn", "shuffled"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
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
    fig.tight_layout()
    fig.savefig(out / "shuffle.png", dpi=110)
    plt.close(fig)


def plot_dose(df: pd.DataFrame, cfg, out: Path) -> None:
    T, C = cfg.train.T, cfg.dose_C
    sub = df[df["arm"] == "random_k"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for value, style in (("final_score", "o-"), ("aulc", "s--")):
        s = summarize(sub, ["k"], value).sort_values("k")
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
    fig.tight_layout()
    fig.savefig(out / "dose.png", dpi=110)
    plt.close(fig)


def plot_curves(df: pd.DataFrame, cfg, out: Path) -> None:
    """Learning curves of the C sweep (mean over seeds)."""
    Cs = sorted(df["C"].unique())
    pick = [C for C in Cs if C in (cfg.k, cfg.k + 1, max(Cs))] or Cs[:3]
    fig, axes = plt.subplots(1, len(pick), figsize=(4 * len(pick), 3.6), sharey=True, squeeze=False)
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
    fig.tight_layout()
    fig.savefig(out / "c_sweep_curves.png", dpi=110)
    plt.close(fig)


def plot_all(frames: dict[str, pd.DataFrame], cfg, out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    made = []
    if "c_sweep" in frames:
        plot_c_sweep(frames["c_sweep"], cfg, out_dir)
        plot_curves(frames["c_sweep"], cfg, out_dir)
        made += [out_dir / "c_sweep.png", out_dir / "c_sweep_curves.png"]
    if "vd_sweep" in frames:
        plot_vd_sweep(frames["vd_sweep"], cfg, out_dir)
        made.append(out_dir / "vd_sweep.png")
    if "shuffle" in frames:
        plot_shuffle(frames["shuffle"], cfg, out_dir)
        made.append(out_dir / "shuffle.png")
    if "dose" in frames:
        plot_dose(frames["dose"], cfg, out_dir)
        made.append(out_dir / "dose.png")
    return made
