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

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pandas as pd

from creditlab.core.diagnostics import expected_open_fraction, p_cover
from creditlab.errors import ConfigError
from creditlab.lab.chain_trainer import ChainTrainConfig, ModelSpec, train_chain
from creditlab.lab.report import paired_diff, summarize, to_markdown
from creditlab.lab.runner import Cell, run_cells
from creditlab.lab.store import ResultStore

__all__ = ["EXPERIMENTS", "CoverageConfig", "build_cells", "run_coverage", "run_cell"]

EXPERIMENTS = ("c_sweep", "vd_sweep", "shuffle", "dose")


@dataclass(frozen=True)
class CoverageConfig:
    """Configuration of the whole coverage lab."""

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
        if self.seeds < 1:
            raise ConfigError("seeds", f"must be >= 1, got {self.seeds}")
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
        for e in self.experiments:
            if e not in EXPERIMENTS:
                raise ConfigError("experiments", f"unknown experiment {e!r}; valid: {', '.join(EXPERIMENTS)}")

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
    tag = hashlib.sha256(json.dumps(train_d, sort_keys=True).encode()).hexdigest()[:10]
    cells = []
    for name, specs in groups.items():
        payload = [asdict(s) for s in specs]
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:10]
        cells.append(Cell(key=f"{experiment}/{name}/{tag}-{digest}", fn=run_cell,
                          kwargs={"experiment": experiment, "specs": payload, "train": train_d}))
    return cells


def build_cells(cfg: CoverageConfig) -> dict[str, list[Cell]]:
    """The cells of each selected experiment."""
    cfg.validate()
    S = range(cfg.seeds)
    out: dict[str, list[Cell]] = {}
    if "c_sweep" in cfg.experiments:
        out["c_sweep"] = _cells_of("c_sweep", {
            f"C={C}": [ModelSpec(seed=s, C=C, arm=a, k=cfg.k) for a in ("uniform", "concentrated") for s in S]
            for C in cfg.Cs}, cfg.train)
    if "vd_sweep" in cfg.experiments:
        out["vd_sweep"] = _cells_of("vd_sweep", {
            f"{ex}/vd={vd}": [ModelSpec(seed=s, C=cfg.vd_C, arm=a, vd=vd, exposure=ex)
                              for a in ("uniform", "targeted") for s in S]
            for ex in ("independent", "prefix") for vd in cfg.vds}, cfg.train)
    if "shuffle" in cfg.experiments:
        out["shuffle"] = _cells_of("shuffle", {
            f"C={C}/vd={vd}": [ModelSpec(seed=s, C=C, arm=a, vd=vd) for a in ("uniform", "per_turn", "shuffled")
                               for s in S]
            for C in cfg.shuffle_Cs for vd in cfg.shuffle_vds}, cfg.train)
    if "dose" in cfg.experiments:
        groups = {f"k={k}": [ModelSpec(seed=s, C=cfg.dose_C, arm="random_k", k=k) for s in S] for k in cfg.dose_ks}
        groups["uniform"] = [ModelSpec(seed=s, C=cfg.dose_C, arm="uniform", k=cfg.train.T) for s in S]
        out["dose"] = _cells_of("dose", groups, cfg.train)
    return out


def run_coverage(cfg: CoverageConfig, out_dir: str | Path, *, workers: int = 1,
                 progress: bool = True) -> dict[str, pd.DataFrame]:
    """Run (or resume) the lab; writes ``<exp>.parquet``, ``<exp>.md``, PNG plots and ``report.md``."""
    out_dir = Path(out_dir)
    store = ResultStore(out_dir / "store")
    cells = build_cells(cfg)
    frames: dict[str, pd.DataFrame] = {}
    all_cells = [c for cs in cells.values() for c in cs]
    df_all = run_cells(all_cells, store, workers=workers, desc="coverage lab", progress=progress)
    for name, cs in cells.items():
        keys = {c.key for c in cs}
        df = df_all[df_all["cell_key"].isin(keys)].drop(columns=["cell_key"]).reset_index(drop=True)
        df = df.sort_values(["arm", "C", "k", "vd", "exposure", "seed"], kind="stable").reset_index(drop=True)
        frames[name] = df
        df.to_parquet(out_dir / f"{name}.parquet", index=False)  # the parquet keeps the learning curves
        (out_dir / f"{name}.md").write_text(to_markdown(df.drop(columns=["curve", "eval_at"])))
    from creditlab.lab.coverage_plots import plot_all

    plot_all(frames, cfg, out_dir)
    (out_dir / "report.md").write_text(report_markdown(frames, cfg))
    return frames


def summary_tables(frames: dict[str, pd.DataFrame], cfg: CoverageConfig) -> dict[str, pd.DataFrame]:
    """Mean and 95% interval per arm and configuration, and the paired differences between arms."""
    T = cfg.train.T
    tabs: dict[str, pd.DataFrame] = {}
    if "c_sweep" in frames:
        df = frames["c_sweep"]
        s = summarize(df, ["C", "arm"], "final_score")
        s["P_cover"] = [float(p_cover(T, C, cfg.k)) for C in s["C"]]
        tabs["c_sweep"] = s
        tabs["c_sweep_diff"] = paired_diff(df, "uniform", "concentrated", ["C"], "final_score")
    if "vd_sweep" in frames:
        df = frames["vd_sweep"]
        s = summarize(df, ["exposure", "vd", "arm"], "final_score")
        s["open_fraction"] = [float(expected_open_fraction(v, cfg.vd_C)) if e == "independent" else
                              round(v * cfg.vd_C) / cfg.vd_C for e, v in zip(s["exposure"], s["vd"], strict=True)]
        tabs["vd_sweep"] = s
        tabs["vd_sweep_diff"] = paired_diff(df, "targeted", "uniform", ["exposure", "vd"], "final_score")
    if "shuffle" in frames:
        df = frames["shuffle"]
        tabs["shuffle"] = summarize(df, ["C", "vd", "arm"], "final_score")
        tabs["shuffle_diff"] = pd.concat([
            paired_diff(df, "per_turn", "shuffled", ["C", "vd"], "final_score"),
            paired_diff(df, "per_turn", "uniform", ["C", "vd"], "final_score"),
            paired_diff(df, "shuffled", "uniform", ["C", "vd"], "final_score"),
        ], ignore_index=True)
    if "dose" in frames:
        df = frames["dose"]
        s = summarize(df, ["arm", "k"], "final_score")
        s["aulc"] = summarize(df, ["arm", "k"], "aulc")["mean"]
        s["P_cover"] = [float(p_cover(T, cfg.dose_C, k)) for k in s["k"]]
        tabs["dose"] = s
    return tabs


def report_markdown(frames: dict[str, pd.DataFrame], cfg: CoverageConfig) -> str:
    tabs = summary_tables(frames, cfg)
    t = cfg.train
    lines = [
        "# Coverage lab report", "",
        f"Chain of T={t.T} steps, K={t.K} actions, MLP policy (hidden {t.hidden}), GRPO with {t.group} rollouts "
        f"per update, {t.updates} updates, Adam lr {t.lr}, grad-norm clip {t.max_grad_norm}, "
        f"{'state-dependent' if t.state_dependent else 'independent-step'} observations, {cfg.seeds} paired seeds. "
        "Score: exact expected reward (correct-prefix length / C) of the final policy. "
        "Intervals: 95% t-intervals over seeds; differences are paired by seed.", "",
    ]
    sections = [
        ("c_sweep", f"## C sweep (k={cfg.k})", "uniform vs concentrated on the first k causal steps."),
        ("c_sweep_diff", "### Paired difference uniform - concentrated", ""),
        ("vd_sweep", f"## Verifier-density sweep (C={cfg.vd_C})",
         "targeted = independent local signal on exposed causal steps only; `open_fraction` is the "
         "analytic share of the chain that targeted credit can open (geometric series for independent "
         "exposure, the exposed prefix for prefix exposure)."),
        ("vd_sweep_diff", "### Paired difference targeted - uniform", ""),
        ("shuffle", "## Shuffled control", "per_turn = credit on the steps where the verifier saw progress "
         "(among the exposed causal steps); shuffled = the same weights permuted to random steps."),
        ("shuffle_diff", "### Paired differences", ""),
        ("dose", f"## Dose-response of coverage (C={cfg.dose_C})",
         "credit concentrated on k steps drawn at random per rollout, same total credit; P_cover is the "
         "analytic probability that one rollout's credit covers the whole chain."),
    ]
    for key, title, text in sections:
        if key in tabs:
            lines += [title, ""] + ([text, ""] if text else []) + [to_markdown(tabs[key]), ""]
    lines += ["Plots: " + ", ".join(f"`{n}.png`" for n in frames), ""]
    return "\n".join(lines)


def config_with(cfg: CoverageConfig, *, seeds: int | None = None, updates: int | None = None) -> CoverageConfig:
    """``cfg`` with the seed count and/or update count overridden (the CLI's knobs)."""
    if updates is not None:
        cfg = replace(cfg, train=replace(cfg.train, updates=updates))
    if seeds is not None:
        cfg = replace(cfg, seeds=seeds)
    return cfg
