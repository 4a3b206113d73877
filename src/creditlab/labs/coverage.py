"""The coverage lab: when does concentrating the terminal advantage on a few steps hurt?

A hard-prerequisite chain (``creditlab.envs.chain``) trained with GRPO under different credit
geometries at equal total credit (:func:`creditlab.train.chain.train_chain`; the one-update protocol
is :func:`creditlab.train.chain.single_update`). Eight experiments:

* ``c_sweep``: chain length C at fixed budget k — ``uniform`` vs ``concentrated`` on the first k
  causal steps. Expected: tie while C <= k, uniform ahead for every C > k.
* ``vd_sweep``: verifier density V_d at C=10 — ``uniform`` vs ``targeted`` (independent local
  signal on the exposed causal steps only), under independent and prefix exposure. Expected:
  uniform flat, targeted rising with V_d and passing uniform only at high density.
* ``shuffle``: ``per_turn`` (credit where the verifier saw progress) vs ``shuffled`` (the same
  weights on random steps) vs ``uniform``, at a dense and at a sparse verifier.
* ``dose``: credit on k random steps per rollout (fixed total credit), dose k = 1..T.
* ``real_agent``: the regime of real tool agents, whose verifier sees one step (the final write) of a
  chain of C = 5..8 (V_d = 1/C): uniform vs credit targeted at the final step.
* ``crossing``: where targeted credit passes uniform, on a finer V_d grid near the crossing, for
  independent-step and state-dependent chains, with a bootstrap interval over seeds.
* ``single_update``: the one-update protocol: many paired seeds, one update per arm from shared
  rollouts of a partly trained base policy (same advantages, same binding grad-norm clip), and the
  exact held-out improvement per arm (binary, uniform, per_turn, shuffled, discretized, reward_to_go).
* ``capability``: the one-update protocol at fixed capability points: base policies pre-trained
  (uniform credit) until their exact chain completion first reaches a target (about 25% and 70%),
  at the final-write verifier (C = 6 and 8); a gate table of the achieved completion, then the arms
  and an equivalence test fixed in advance: the 95% interval of per_turn - shuffled inside
  +/- 0.25 x (uniform - binary).

Every experiment is a set of cells (one per configuration value, all seeds and arms of the value in
one batched tensor program), persisted in a results store as they finish, so an interrupted run
resumes where it stopped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import pandas as pd

from creditlab.core.diagnostics import expected_open_fraction, p_cover
from creditlab.errors import ConfigError
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import LabConfig, LabOption, Table, check_count
from creditlab.lab.report import mean_ci, paired_diff, read_diff, small_run_note, sort_in_order, summarize
from creditlab.lab.runner import Cell
from creditlab.models.batched_mlp import BatchedMLP
from creditlab.train.chain import (
    ChainTrainConfig,
    ModelSpec,
    pretrain_to_completion,
    single_update,
    single_update_from,
    train_chain,
)

__all__ = ["EXPERIMENTS", "LAB", "CoverageConfig", "CoverageLab", "run_cell"]

EXPERIMENTS = ("c_sweep", "vd_sweep", "shuffle", "dose", "real_agent", "crossing", "single_update", "capability")
SINGLE_ARMS = ("binary", "uniform", "per_turn", "shuffled", "discretized", "reward_to_go")
#: Kinds of chain of the crossing experiment: the policy sees the step index only, or also the
#: correct-prefix length and a broken bit (``ChainTrainConfig.state_dependent``).
CHAIN_KINDS = ("independent_step", "state_dependent")
#: The crossing points the credit-granularity paper reports (targeted passes uniform at this V_d).
PAPER_CROSSING = {"independent_step": 0.95, "state_dependent": 0.81}
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
    real_agent_Cs: tuple[int, ...] = (5, 6, 7, 8)
    """Chain lengths of the real-agent regime (the verifier sees only the final write: V_d = 1/C)."""
    crossing_vds: tuple[float, ...] = (0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)
    """V_d grid of the crossing experiment (finer near where targeted credit passes uniform)."""
    crossing_bootstrap: int = 2000
    """Bootstrap resamples of the seeds for the crossing point's interval."""
    single_seeds: int = 48
    """Paired seeds of the single-update experiment."""
    single_settings: tuple[tuple[str, int], ...] = (("independent", 6), ("final", 6), ("final", 8))
    """(exposure, C) of the single-update experiment: a dense verifier (every causal step) and the
    real-agent verifier (final write only)."""
    single_base_updates: int = 15
    """Uniform-credit updates that make the shared base policy (partly trained: score about 0.4 at C=6)."""
    single_rollouts: int = 64
    """Shared rollouts of the single update (fewer groups with one reward for every rollout)."""
    single_clip: float = 0.02
    """Global grad-norm clip of the single update (binds for every arm whose gradient is not zero)."""
    single_step: float = 5.0
    """SGD step of the single update (the parameter change has norm step x clip)."""
    capability_Cs: tuple[int, ...] = (6, 8)
    """Chain lengths of the capability experiment (final-write verifier: V_d = 1/C)."""
    capability_targets: tuple[float, ...] = (0.25, 0.70)
    """Chain-completion targets of the capability points: each base is pre-trained until its exact
    completion first reaches the target."""
    capability_seeds: int = 200
    """Paired seeds of the capability experiment."""
    capability_lr: float = 0.003
    """Adam learning rate of the pre-training (a tenth of the training lr, so one update overshoots a
    target by little: at 0.03 one update carried completion from below 0.25 to up to 0.64)."""
    capability_max_updates: int = 3000
    """Most pre-training updates; a seed that has not reached a target by then is left out there."""
    capability_margin: float = 0.25
    """Equivalence band: per_turn - shuffled must lie inside +/- margin x (uniform - binary)."""
    capability_gate_reached: float = 0.9
    """Gate: the least share of seeds that must reach a target."""
    capability_gate_overshoot: float = 0.05
    """Gate: the most the mean achieved completion may exceed its target."""
    experiments: tuple[str, ...] = EXPERIMENTS
    """Which experiments to run."""

    def validate(self) -> None:
        self.train.validate()
        T = self.train.T
        check_count(self.seeds, "--seeds")
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
        new_Cs = [*(self.real_agent_Cs if "real_agent" in self.experiments else ()),
                  *((c for _, c in self.single_settings) if "single_update" in self.experiments else ())]
        for C in new_Cs:
            if not 1 <= C <= T:
                raise ConfigError("C", f"must be in [1, T={T}], got {C}")
        for vd in self.crossing_vds:
            if not 0.0 <= vd <= 1.0:
                raise ConfigError("vd", f"verifier density must be in [0, 1], got {vd}")
        for ex, _ in self.single_settings:
            if ex not in ("independent", "prefix", "final"):
                raise ConfigError("single_settings", f"unknown exposure {ex!r}")
        if self.single_seeds < 2 or self.crossing_bootstrap < 1 or self.single_rollouts < 2:
            raise ConfigError("single_seeds", "single_seeds >= 2, single_rollouts >= 2, crossing_bootstrap >= 1")
        self._validate_capability()
        if not self.experiments:
            raise ConfigError("--experiment", f"select at least one of {', '.join(EXPERIMENTS)}")
        for e in self.experiments:
            if e not in EXPERIMENTS:
                raise ConfigError("--experiment", f"unknown experiment {e!r}; valid: {', '.join(EXPERIMENTS)}")

    def _validate_capability(self) -> None:
        if "capability" in self.experiments:
            for C in self.capability_Cs:
                if not 1 <= C <= self.train.T:
                    raise ConfigError("capability_Cs", f"must be in [1, T={self.train.T}], got {C}")
        if not self.capability_Cs or not self.capability_targets:
            raise ConfigError("capability_Cs", "needs at least one chain length and one completion target")
        for t in self.capability_targets:
            if not 0.0 < t <= 1.0:
                raise ConfigError("capability_targets", f"completion targets must be in (0, 1], got {t}")
        if len(set(self.capability_targets)) != len(self.capability_targets):
            raise ConfigError("capability_targets", f"targets must be distinct, got {self.capability_targets}")
        if self.capability_seeds < 2:
            raise ConfigError("capability_seeds", f"needs >= 2 paired seeds, got {self.capability_seeds}")
        if not self.capability_lr > 0 or self.capability_max_updates < 1:
            raise ConfigError("capability_lr", f"needs capability_lr > 0 and capability_max_updates >= 1, got "
                                               f"{self.capability_lr}, {self.capability_max_updates}")
        if not self.capability_margin > 0:
            raise ConfigError("capability_margin", f"must be > 0, got {self.capability_margin}")
        if not 0.0 <= self.capability_gate_reached <= 1.0 or self.capability_gate_overshoot < 0:
            raise ConfigError("capability_gate_reached", "gate share must be in [0, 1] and the overshoot >= 0")

    @classmethod
    def quick(cls) -> CoverageConfig:
        """A reduced sweep that shows the same shapes in well under a minute on 2 cores."""
        return cls(train=ChainTrainConfig(updates=150, eval_points=10), seeds=6,
                   vds=(0.0, 0.5, 0.75, 0.9, 1.0), shuffle_Cs=(10,), dose_ks=(1, 2, 4, 8, 12),
                   real_agent_Cs=(5, 8), crossing_vds=(0.7, 0.8, 0.9, 1.0), crossing_bootstrap=500,
                   single_seeds=32, single_settings=(("independent", 6), ("final", 6)), capability_seeds=48)


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


def run_single_cell(exposure: str, C: int, seeds: int, train: dict, base_updates: int, step: float, clip: float,
                    rollouts: int) -> list[dict]:
    """The single-update experiment at one (exposure, C): every arm of :data:`SINGLE_ARMS` for each seed."""
    cfg = ChainTrainConfig(**train)
    specs = [ModelSpec(seed=s, C=C, arm=a, vd=1.0, exposure=exposure) for a in SINGLE_ARMS for s in range(seeds)]
    out = single_update(specs, cfg, base_updates=base_updates, step=step, clip=clip, rollouts=rollouts)
    vd = 1.0 / C if exposure == "final" else 1.0
    return [{"experiment": "single_update", **spec.row(), "vd": vd, "before": float(out["before"][m]),
             "after": float(out["after"][m]), "improvement": float(out["after"][m] - out["before"][m]),
             "grad_norm": float(out["grad_norm"][m]), "binding": bool(out["binding"][m])}
            for m, spec in enumerate(specs)]


def run_capability_cell(C: int, targets: list[float], seeds: int, train: dict, lr: float, max_updates: int,
                        step: float, clip: float, rollouts: int) -> list[dict]:
    """The capability experiment at one C: pre-train one base per seed until its chain completion
    first reaches each target (gate rows), then one update per arm of :data:`SINGLE_ARMS` from the
    bases that reached it (arm rows)."""
    cfg = ChainTrainConfig(**train)
    targets = [float(t) for t in targets]
    pre = pretrain_to_completion(list(range(seeds)), C, replace(cfg, lr=lr), targets=tuple(targets),
                                 max_updates=max_updates)
    common = {"experiment": "capability", "C": C, "k": 0, "vd": 1.0 / C, "exposure": "final"}
    nan = float("nan")
    rows = []
    for i, target in enumerate(targets):
        reached = pre["reached"][i]
        for sd in range(seeds):
            rows.append({**common, "row": "gate", "seed": sd, "arm": "base", "target": target,
                         "reached": bool(reached[sd]), "pretrain_updates": int(pre["updates"][i, sd]),
                         "completion": float(pre["completion"][i, sd]), "score": float(pre["score"][i, sd]),
                         "before": nan, "after": nan, "improvement": nan, "completion_gain": nan, "grad_norm": nan,
                         "binding": False, "rollout_completion": nan})
        ok = [sd for sd in range(seeds) if bool(reached[sd])]
        if not ok:
            continue
        base = BatchedMLP(**{k: v[ok] for k, v in pre["policies"][i].params().items()})
        specs = [ModelSpec(seed=sd, C=C, arm=a, exposure="final") for a in SINGLE_ARMS for sd in ok]
        out = single_update_from(base, [(sd, C) for sd in ok], specs, cfg, step=step, clip=clip, rollouts=rollouts)
        for m, spec in enumerate(specs):
            rows.append({**common, "row": "arm", "seed": spec.seed, "arm": spec.arm, "target": target,
                         "reached": True, "pretrain_updates": int(pre["updates"][i, spec.seed]),
                         "completion": float(out["completion_before"][m]), "score": float(out["before"][m]),
                         "before": float(out["before"][m]), "after": float(out["after"][m]),
                         "improvement": float(out["after"][m] - out["before"][m]),
                         "completion_gain": float(out["completion_after"][m] - out["completion_before"][m]),
                         "grad_norm": float(out["grad_norm"][m]), "binding": bool(out["binding"][m]),
                         "rollout_completion": float(out["rollout_completion"][m])})
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
    help = ("Credit geometries on a hard-prerequisite chain: C sweep, verifier-density sweep, shuffled control, "
            "dose-response, the one-update protocol and its capability points. Resumes an interrupted run in the "
            "same --out directory.")
    quick_help = "Reduced run: every experiment, fewer seeds and updates: about 20 s on 2 cores (nothing to build)."
    config_type = CoverageConfig
    options = (LabOption("state_dependent", "The policy also observes the correct-prefix length and a broken bit.",
                         bool),)

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
        if "real_agent" in cfg.experiments:
            out += _cells_of("real_agent", {
                f"C={C}": [ModelSpec(seed=s, C=C, arm=a, exposure="final") for a in ("uniform", "targeted", "per_turn")
                           for s in S]
                for C in cfg.real_agent_Cs}, cfg.train)
        if "crossing" in cfg.experiments:
            for chain in CHAIN_KINDS:
                train = replace(cfg.train, state_dependent=chain == "state_dependent")
                out += _cells_of("crossing", {
                    f"{chain}/vd={vd}": [ModelSpec(seed=s, C=cfg.vd_C, arm=a, vd=vd) for a in ("uniform", "targeted")
                                         for s in S]
                    for vd in cfg.crossing_vds}, train)
        if "single_update" in cfg.experiments:
            out += [Cell("single_update", f"{ex}/C={C}", run_single_cell,
                         {"exposure": ex, "C": C, "seeds": cfg.single_seeds, "train": asdict(cfg.train),
                          "base_updates": cfg.single_base_updates, "step": cfg.single_step, "clip": cfg.single_clip,
                          "rollouts": cfg.single_rollouts})
                    for ex, C in cfg.single_settings]
        if "capability" in cfg.experiments:
            out += [Cell("capability", f"final/C={C}", run_capability_cell,
                         {"C": C, "targets": list(cfg.capability_targets), "seeds": cfg.capability_seeds,
                          "train": asdict(cfg.train), "lr": cfg.capability_lr,
                          "max_updates": cfg.capability_max_updates, "step": cfg.single_step,
                          "clip": cfg.single_clip, "rollouts": cfg.single_rollouts})
                    for C in cfg.capability_Cs]
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
        if "real_agent" in rows:
            df = rows["real_agent"]
            s = summarize(df, ["C", "arm"], "final_score", UNIT)
            s.insert(1, "V_d", [1.0 / C for C in s["C"]])
            tabs["real_agent"] = Table(s, "Real-agent regime: the verifier sees only the final write (V_d = 1/C)")
            tabs["real_agent_diff"] = Table(pd.concat([
                paired_diff(df, "targeted", "uniform", ["C"], "final_score", bounds=DIFF),
                paired_diff(df, "per_turn", "uniform", ["C"], "final_score", bounds=DIFF),
            ], ignore_index=True), "Real-agent regime: paired differences", console=True)
        if "crossing" in rows:
            independent, dependent = CHAIN_KINDS
            df = rows["crossing"].assign(chain=lambda d: np.where(d["cfg_state_dependent"], dependent, independent))
            rows["crossing"] = df
            tabs["crossing_curve"] = Table(
                paired_diff(df, "targeted", "uniform", ["chain", "vd"], "final_score", bounds=DIFF),
                f"Crossing (C={cfg.vd_C}, independent exposure): paired difference targeted - uniform by V_d")
            tabs["crossing"] = Table(crossing_table(df, cfg), "Crossing point: the V_d at which targeted credit "
                                                              "passes uniform (bootstrap 95% interval over seeds)",
                                     console=True)
        if "single_update" in rows:
            df = rows["single_update"]
            tabs["single_update"] = Table(single_update_table(df), "Single update from shared rollouts: held-out "
                                                                   "improvement per arm")
            tabs["single_update_diff"] = Table(single_update_diffs(df), "Single update: paired differences",
                                               console=True)
        if "capability" in rows:
            df = rows["capability"]
            tabs["capability_gate"] = Table(capability_gate(df, cfg), "Capability points: gate (pre-training until "
                                            "the chain completion first reaches the target)", console=True)
            arms = df[df["row"] == "arm"]
            if len(arms):  # no arm row: no seed reached any target (the gate table says so)
                tabs["capability"] = Table(capability_arm_table(arms), "Capability points: held-out improvement of "
                                                                       "one update per arm", ".4f")
                tabs["capability_test"] = Table(capability_test(arms, cfg), "Capability points: per_turn - "
                                                "shuffled against the equivalence band, and per_turn - uniform",
                                                ".4f", console=True)
                tabs["capability_diff"] = Table(capability_diffs(arms), "Capability points: paired differences",
                                                ".4f")
        return tabs

    def plots(self, tabs: dict[str, Table], cfg: CoverageConfig, out: Path) -> list[Path]:
        made: list[Path] = []
        runs = {name: tabs[f"{name}_runs"].frame for name in cfg.experiments if f"{name}_runs" in tabs}
        if "c_sweep" in runs:
            made += [plot_c_sweep(runs["c_sweep"], cfg, out), plot_curves(runs["c_sweep"], cfg, out)]
        if "vd_sweep" in runs:
            made.append(plot_vd_sweep(runs["vd_sweep"], cfg, out))
        if "shuffle" in runs:
            made.append(plot_shuffle(runs["shuffle"], cfg, out))
        if "dose" in runs:
            made.append(plot_dose(runs["dose"], cfg, out))
        if "real_agent" in runs:
            made.append(plot_real_agent(tabs["real_agent"].frame, out))
        if "crossing" in tabs:
            made.append(plot_crossing(tabs["crossing_curve"].frame, tabs["crossing"].frame, out))
        if "single_update" in tabs:
            made.append(plot_single_update(tabs["single_update"].frame, out))
        if "capability_test" in tabs:
            made.append(plot_capability(tabs["capability_test"].frame, tabs["capability"].frame, out))
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
        if "real_agent" in tabs:
            s = tabs["real_agent"].frame
            piv = s.pivot(index="C", columns="arm", values="mean")
            text["real_agent"] = (
                "A real tool agent's state-diff verifier sees one step of a chain of 5-8 causal steps (the final "
                "write), so V_d = 1/C is 0.12-0.20, far left on the V_d axis: targeted credit can only teach the "
                "step it sees and per_turn credit falls back to uniform on every failed rollout. Final score: "
                + "; ".join(f"C={C}: uniform {r['uniform']:.2f}, targeted {r['targeted']:.2f}, per_turn "
                            f"{r['per_turn']:.2f}" for C, r in piv.iterrows()) + "." + few)
            text["real_agent_diff"] = " ".join(read_diff(g, ["C"], what) for what, g in
                                               tabs["real_agent_diff"].frame.groupby("diff", sort=False))
        if "crossing" in tabs:
            text["crossing_curve"] = (
                "Paired difference targeted - uniform of the final score on a finer V_d grid, for chains whose "
                "policy sees only the step index (independent-step) and chains whose policy also sees the "
                "correct-prefix length and a broken bit (state-dependent)." + few)
            parts = []
            for _, r in tabs["crossing"].frame.iterrows():
                if np.isnan(r["crossing"]):
                    parts.append(f"{r['chain']}: targeted does not pass uniform on the grid (up to V_d = 1)")
                else:
                    ci = ("no interval" if np.isnan(r["lo"]) else f"95% interval [{r['lo']:.2f}, {r['hi']:.2f}]")
                    parts.append(f"{r['chain']}: crossing at V_d = {r['crossing']:.2f} ({ci}; "
                                 f"{r['no_crossing_share']:.0%} of bootstrap resamples never cross) against the "
                                 f"paper's {r['paper']:.2f}")
            text["crossing"] = ("The crossing is the smallest V_d from which the mean paired difference stays >= 0 "
                                "on the grid, interpolated linearly; its interval resamples seeds. "
                                + "; ".join(parts) + ".")
        if "single_update" in tabs:
            s = tabs["single_update"].frame
            text["single_update"] = (
                f"One update per arm from the same base policy ({cfg.single_base_updates} uniform-credit updates), "
                f"the same {cfg.single_rollouts} rollouts and advantages, a grad-norm clip of {cfg.single_clip} "
                f"(the share of updates where it binds is in the table) and one SGD step of {cfg.single_step}; the "
                "improvement is the exact expected reward after minus before, so no evaluation batch adds noise. "
                "Seeds whose base policy is already deterministic (every arm's gradient zero) are left out and "
                "counted. A binary reward has no gradient when no rollout completes the chain (zero_grad). "
                "gain_share is the arm's mean improvement over uniform's (the dense reward's).")
            text["single_update_diff"] = " ".join(
                read_diff(g, ["exposure", "C"], what) for what, g in tabs["single_update_diff"].frame.groupby(
                    "diff", sort=False))
        if "capability_gate" in tabs:
            text.update(capability_text(tabs, cfg))
        return text


LAB = CoverageLab()


# --------------------------------------------------------------------------------------------
# crossing point and single-update tables


def _last_crossing(vds: np.ndarray, D: np.ndarray) -> float:
    """Smallest V_d from which ``D`` stays >= 0 on the grid (linear interpolation into the last
    negative interval); ``vds[0]`` when ``D`` is never negative, NaN when it ends negative."""
    neg = np.nonzero(D < 0)[0]
    if len(neg) == 0:
        return float(vds[0])
    i = int(neg[-1])
    if i == len(vds) - 1:
        return float("nan")
    return float(vds[i] + (0.0 - D[i]) * (vds[i + 1] - vds[i]) / (D[i + 1] - D[i]))


def crossing_table(df: pd.DataFrame, cfg: CoverageConfig) -> pd.DataFrame:
    """Per chain type: the crossing V_d of the mean paired difference targeted - uniform, and its
    bootstrap 95% interval over seeds (percentiles of the resamples that cross)."""
    rng = np.random.default_rng(0)
    out = []
    for chain in CHAIN_KINDS:
        sub = df[df["chain"] == chain]
        if sub.empty:
            continue
        wide = sub.pivot_table(index=["seed", "vd"], columns="arm", values="final_score")
        d = (wide["targeted"] - wide["uniform"]).unstack("vd").sort_index(axis=1)  # (seeds, vds)
        vds, mat = d.columns.to_numpy(dtype=float), d.to_numpy()
        est = _last_crossing(vds, mat.mean(0))
        boots = np.array([_last_crossing(vds, mat[rng.integers(0, len(mat), len(mat))].mean(0))
                          for _ in range(cfg.crossing_bootstrap)]) if len(mat) > 1 else np.array([])
        ok = boots[~np.isnan(boots)]
        lo, hi = (np.percentile(ok, [2.5, 97.5]) if len(ok) else (np.nan, np.nan))
        out.append({"chain": chain, "crossing": est, "lo": float(lo), "hi": float(hi),
                    "no_crossing_share": float(np.isnan(boots).mean()) if len(boots) else np.nan,
                    "paper": PAPER_CROSSING[chain], "seeds": len(mat)})
    return pd.DataFrame(out)


def _live(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of the seeds where some arm has a gradient (a deterministic base policy moves no arm)."""
    alive = df.groupby(["exposure", "C", "seed"])["grad_norm"].transform("max") > 0
    return df[alive]


def single_update_table(df: pd.DataFrame) -> pd.DataFrame:
    live = _live(df)
    s = summarize(live, ["exposure", "C", "arm"], "improvement", DIFF)
    extra = live.groupby(["exposure", "C", "arm"]).agg(
        positive=("improvement", lambda v: int((v > 0).sum())), zero_grad=("grad_norm", lambda v: int((v == 0).sum())),
        binding=("binding", "mean")).reset_index()
    s = s.merge(extra, on=["exposure", "C", "arm"])
    uni = s[s["arm"] == "uniform"].set_index(["exposure", "C"])["mean"]
    s["gain_share"] = [m / uni.loc[(e, C)] if uni.loc[(e, C)] != 0 else np.nan
                       for e, C, m in zip(s["exposure"], s["C"], s["mean"], strict=True)]
    dead = df.groupby(["exposure", "C"])["seed"].nunique() - live.groupby(["exposure", "C"])["seed"].nunique()
    s["seeds_left_out"] = [int(dead.loc[(e, C)]) for e, C in zip(s["exposure"], s["C"], strict=True)]
    s.insert(2, "V_d", [1.0 / C if e == "final" else 1.0 for e, C in zip(s["exposure"], s["C"], strict=True)])
    return s


def single_update_diffs(df: pd.DataFrame) -> pd.DataFrame:
    """Paired differences of the improvement between arms (same seed = same base policy and rollouts),
    with the number of seeds where the first arm improved more."""
    live = _live(df)
    pairs = [("per_turn", "shuffled"), ("per_turn", "uniform"), ("shuffled", "uniform"), ("discretized", "uniform"),
             ("binary", "uniform"), ("reward_to_go", "uniform")]
    return _paired_improvements(live, pairs, ["exposure", "C"])


def _paired_improvements(df: pd.DataFrame, pairs: list[tuple[str, str]], by: list[str]) -> pd.DataFrame:
    """:func:`paired_diff` of the improvement for each pair of arms within each group of ``by`` (rows
    paired by seed), with ``pairs_positive``: the seeds where the first arm improved more."""
    wide = df.pivot_table(index=[*by, "seed"], columns="arm", values="improvement")
    rows = []
    for a, b in pairs:
        d = paired_diff(df, a, b, by, "improvement", bounds=(-2.0, 2.0))
        d["pairs_positive"] = [int(((wide[a] - wide[b]).xs(key, level=tuple(by)) > 0).sum())
                               for key in zip(*(d[c] for c in by), strict=True)]
        rows.append(d)
    return pd.concat(rows, ignore_index=True)


# --------------------------------------------------------------------------------------------
# capability points

#: What the capability experiment predicts at each completion target (written before the full run).
CAPABILITY_PREDICTIONS = {0.25: "null: per_turn - shuffled interval contains 0",
                          0.70: "per_turn < uniform, and per_turn - shuffled inside the band"}


def capability_gate(df: pd.DataFrame, cfg: CoverageConfig) -> pd.DataFrame:
    """Per (C, target): the completion the bases achieved (seeds that reached the target), the
    pre-training it took (updates), how many seeds reached it, and whether the point passes the gate."""
    g = df[df["row"] == "gate"]
    out = []
    for (C, target), sub in g.groupby(["C", "target"], sort=True):
        ok = sub[sub["reached"].astype(bool)]
        n, r = len(sub), len(ok)
        achieved = float(ok["completion"].mean()) if r else np.nan
        passed = r > 0 and r / n >= cfg.capability_gate_reached and achieved - target <= cfg.capability_gate_overshoot
        out.append({"C": int(C), "V_d": 1.0 / C, "target": float(target), "achieved": achieved,
                    "achieved_min": float(ok["completion"].min()) if r else np.nan,
                    "achieved_max": float(ok["completion"].max()) if r else np.nan,
                    "base_score": float(ok["score"].mean()) if r else np.nan,
                    "updates_mean": float(ok["pretrain_updates"].mean()) if r else np.nan,
                    "updates_min": int(ok["pretrain_updates"].min()) if r else -1,
                    "updates_max": int(ok["pretrain_updates"].max()) if r else -1,
                    "seeds": n, "reached": r, "gate": "pass" if passed else "fail"})
    return pd.DataFrame(out)


def capability_arm_table(arms: pd.DataFrame) -> pd.DataFrame:
    """Per (C, target, arm): the mean improvement with its 95% interval, how many seeds improved, had
    no gradient, had the clip bind, and the mean gain in chain completion."""
    by = ["C", "target", "arm"]
    s = summarize(arms, by, "improvement", DIFF)
    extra = arms.groupby(by).agg(
        positive=("improvement", lambda v: int((v > 0).sum())), zero_grad=("grad_norm", lambda v: int((v == 0).sum())),
        binding=("binding", "mean"), completion_gain=("completion_gain", "mean"),
        base_completion=("completion", "mean"), rollout_completion=("rollout_completion", "mean")).reset_index()
    s = s.merge(extra, on=by)
    return sort_in_order(s, by, {"arm": SINGLE_ARMS})


def _paired(w: pd.DataFrame, a: str, b: str) -> tuple[float, float, float]:
    return mean_ci((w[a] - w[b]).to_numpy(), bounds=(-2.0, 2.0))


def capability_test(arms: pd.DataFrame, cfg: CoverageConfig) -> pd.DataFrame:
    """Per (C, target): per_turn - shuffled (paired mean, 95% interval) against the equivalence band
    +/- margin x (uniform - binary), per_turn - uniform, and the verdicts the predictions name."""
    wide = arms.pivot_table(index=["C", "target", "seed"], columns="arm", values="improvement")
    out = []
    for (C, target), w in wide.groupby(level=["C", "target"], sort=True):
        ps, lo, hi = _paired(w, "per_turn", "shuffled")
        pu, pu_lo, pu_hi = _paired(w, "per_turn", "uniform")
        ub = float((w["uniform"] - w["binary"]).mean())
        band = cfg.capability_margin * ub
        equivalent = bool(band > 0 and lo > -band and hi < band)
        null = bool(lo <= 0.0 <= hi)
        below = bool(pu_hi < 0)
        key = round(float(target), 6)
        predicted = CAPABILITY_PREDICTIONS.get(key, "-")
        holds = {0.25: null, 0.70: below and equivalent}.get(key, np.nan)
        out.append({"C": int(C), "target": float(target), "achieved": float(arms.loc[
            (arms["C"] == C) & (arms["target"] == target) & (arms["arm"] == "uniform"), "completion"].mean()),
            "n": len(w), "per_turn-shuffled": ps, "lo": lo, "hi": hi, "uniform-binary": ub, "band": band,
            "equivalent": equivalent, "null": null, "per_turn-uniform": pu, "pu_lo": pu_lo, "pu_hi": pu_hi,
            "per_turn<uniform": below, "predicted": predicted, "holds": holds})
    return pd.DataFrame(out)


def capability_diffs(arms: pd.DataFrame) -> pd.DataFrame:
    """Paired differences of the improvement between arms per (C, target), with the number of seeds
    where the first arm improved more."""
    pairs = [("per_turn", "shuffled"), ("per_turn", "uniform"), ("shuffled", "uniform"), ("binary", "uniform"),
             ("discretized", "uniform"), ("reward_to_go", "binary"), ("reward_to_go", "uniform")]
    return _paired_improvements(arms, pairs, ["C", "target"])


def _point(r: pd.Series) -> str:
    return f"C={int(r['C'])} at {r['target']:.0%} (achieved {r['achieved']:.3f}, {int(r['n'])} seeds)"


def capability_text(tabs: dict[str, Table], cfg: CoverageConfig) -> dict[str, str]:
    """The written reading of the capability tables."""
    gate = tabs["capability_gate"].frame
    failed = [f"C={int(r['C'])} at {r['target']:.0%}" for _, r in gate.iterrows() if r["gate"] != "pass"]
    text = {"capability_gate": (
        f"Each seed's base is pre-trained with uniform credit (Adam lr {cfg.capability_lr}, {cfg.train.group} "
        f"rollouts per update) and snapshotted at the first update after which its exact chain completion (the "
        f"probability that the whole chain is right, what the final-write verifier sees) is >= the target; at most "
        f"{cfg.capability_max_updates} updates. achieved is the mean completion of the snapshots (min and max beside "
        f"it), updates the pre-training they took. Gate: at least {cfg.capability_gate_reached:.0%} of the seeds "
        f"reach the target and the mean achieved completion is at most target + {cfg.capability_gate_overshoot}. "
        + (f"Failed: {', '.join(failed)}; the predictions there are not tested." if failed else
           "Every point passes.") + small_run_note(cfg.capability_seeds))}
    text["capability"] = (
        "One update per arm from each base (the single-update protocol: shared rollouts and advantages, "
        f"{cfg.single_rollouts} rollouts, grad-norm clip {cfg.single_clip}, SGD step {cfg.single_step}); the "
        "improvement is the exact expected reward after minus before. rollout_completion is the share of the "
        "shared rollouts that completed the chain; completion_gain the change of the exact completion. At the "
        "final-write verifier per_turn and shuffled differ only on completed rollouts; reward_to_go is fed the "
        "visible progress, so its return is 1[chain complete] up to the final causal step (close to binary), not "
        "the terminal reward (which would make it uniform).")
    if "capability_test" not in tabs:
        return text
    parts = []
    for _, r in tabs["capability_test"].frame.iterrows():
        band = (f"the band +/-{r['band']:.2g} (uniform - binary = {r['uniform-binary']:+.2g})" if r["band"] > 0
                else f"an empty band (uniform - binary = {r['uniform-binary']:+.2g} <= 0)")
        verdict = ("" if r["predicted"] == "-" else
                   f" Predicted: {r['predicted']}; {'holds' if r['holds'] else 'does not hold'}.")
        parts.append(f"{_point(r)}: per_turn - shuffled {r['per_turn-shuffled']:+.4f} [{r['lo']:+.4f}, "
                     f"{r['hi']:+.4f}], {'inside' if r['equivalent'] else 'not inside'} {band}; per_turn - uniform "
                     f"{r['per_turn-uniform']:+.4f} [{r['pu_lo']:+.4f}, {r['pu_hi']:+.4f}].{verdict}")
    text["capability_test"] = (
        f"Equivalence test fixed in advance: the 95% interval of the paired mean per_turn - shuffled must lie "
        f"inside +/- {cfg.capability_margin} x (uniform - binary) of the same point. " + " ".join(parts))
    text["capability_diff"] = " ".join(read_diff(g, ["C", "target"], what) for what, g in
                                       tabs["capability_diff"].frame.groupby("diff", sort=False))
    return text


# --------------------------------------------------------------------------------------------
# plots (analytic curves beside the measured ones)

COLORS = {"uniform": "tab:blue", "concentrated": "tab:red", "targeted": "tab:green", "per_turn": "tab:orange",
          "shuffled": "tab:purple", "random_k": "tab:brown", "binary": "tab:gray", "discretized": "tab:cyan",
          "reward_to_go": "tab:olive"}


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


def plot_real_agent(s: pd.DataFrame, out: Path) -> Path:
    fig, ax = new_figure(figsize=(7, 4.2))
    for arm in ("uniform", "targeted", "per_turn"):
        _band(ax, s[s["arm"] == arm], "C", arm)
    ax.set(xlabel="chain length C (the verifier sees the final write only: V_d = 1/C)", ylabel="final score",
           ylim=(0, 1.05), title="real-agent regime: one visible step")
    ax.legend(fontsize=8)
    return save(fig, out / "real_agent.png")


def plot_crossing(curve: pd.DataFrame, cross: pd.DataFrame, out: Path) -> Path:
    fig, ax = new_figure(figsize=(8, 4.4))
    colors = {"independent_step": "tab:blue", "state_dependent": "tab:green"}
    for chain, g in curve.groupby("chain"):
        g = g.sort_values("vd")
        c = colors.get(chain)
        ax.plot(g["vd"], g["mean"], "o-", color=c, label=f"{chain}: targeted - uniform")
        ax.fill_between(g["vd"], g["lo"], g["hi"], color=c, alpha=0.15)
        r = cross[cross["chain"] == chain]
        if len(r) and not np.isnan(r["crossing"].iloc[0]):
            ax.axvline(r["crossing"].iloc[0], color=c, lw=1.5)
            if not np.isnan(r["lo"].iloc[0]):
                ax.axvspan(r["lo"].iloc[0], r["hi"].iloc[0], color=c, alpha=0.08)
        if len(r):
            ax.axvline(r["paper"].iloc[0], color=c, ls="--", lw=1, label=f"{chain}: paper {r['paper'].iloc[0]:.2f}")
    ax.axhline(0, color="grey", lw=1)
    ax.set(xlabel="verifier density V_d", ylabel="final score difference", title="where targeted credit passes "
           "uniform (solid: measured crossing, band: bootstrap 95%)")
    ax.legend(fontsize=7, loc="lower right")
    return save(fig, out / "crossing.png")


def plot_single_update(s: pd.DataFrame, out: Path) -> Path:
    settings = s[["exposure", "C"]].drop_duplicates().values.tolist()
    fig, axes = new_figure(1, len(settings), figsize=(4.2 * len(settings), 4.0), sharey=True, squeeze=False)
    for ax, (ex, C) in zip(axes[0], settings, strict=True):
        g = s[(s["exposure"] == ex) & (s["C"] == C)].set_index("arm").reindex(list(SINGLE_ARMS))
        x = np.arange(len(g))
        ax.bar(x, g["mean"], yerr=[g["mean"] - g["lo"], g["hi"] - g["mean"]], capsize=3,
               color=[COLORS.get(a, "tab:gray") for a in g.index])
        ax.set_xticks(x, list(g.index), rotation=35, ha="right", fontsize=8)
        vd = 1.0 / C if ex == "final" else 1.0
        ax.set_title(f"{'final write only' if ex == 'final' else 'every causal step'} (C={C}, V_d={vd:.2f})",
                     fontsize=9)
        ax.axhline(0, color="grey", lw=1)
    axes[0][0].set_ylabel("held-out improvement of one update")
    return save(fig, out / "single_update.png")


def plot_capability(test: pd.DataFrame, arms: pd.DataFrame, out: Path) -> Path:
    """Per C: per_turn - shuffled and per_turn - uniform with 95% intervals at each capability point,
    the equivalence band shaded; beside it, the mean improvement of every arm."""
    Cs = sorted(test["C"].unique())
    fig, axes = new_figure(2, len(Cs), figsize=(4.8 * len(Cs), 7.6), squeeze=False)
    for j, C in enumerate(Cs):
        ax, ax2 = axes[0][j], axes[1][j]
        t = test[test["C"] == C].sort_values("target")
        x = np.arange(len(t))
        ax.set_xlim(-0.6, len(t) - 0.4)
        for xi, band in zip(x, t["band"], strict=True):
            if band > 0:
                ax.fill_between([xi - 0.35, xi + 0.35], -band, band, color="grey", alpha=0.25, lw=0,
                                label="equivalence band" if xi == 0 else None)
            note = f"band +/-{band:.2g}" if band > 0 else "empty band\n(uniform <= binary)"
            ax.annotate(note, (xi + 0.3, 0), textcoords="offset points", xytext=(0, -14), ha="center", fontsize=7,
                        color="dimgrey")
        ax.errorbar(x - 0.08, t["per_turn-shuffled"], yerr=[t["per_turn-shuffled"] - t["lo"],
                    t["hi"] - t["per_turn-shuffled"]], fmt="o", color=COLORS["per_turn"], capsize=4,
                    label="per_turn - shuffled")
        ax.errorbar(x + 0.08, t["per_turn-uniform"], yerr=[t["per_turn-uniform"] - t["pu_lo"],
                    t["pu_hi"] - t["per_turn-uniform"]], fmt="s", color=COLORS["uniform"], capsize=4,
                    label="per_turn - uniform")
        ax.axhline(0, color="black", lw=0.8)
        labels = [f"{tg:.0%} (achieved {a:.2f})" for tg, a in zip(t["target"], t["achieved"], strict=True)]
        ax.set_xticks(x, labels, fontsize=8)
        ax.set(title=f"C={C}, final write only (V_d={1 / C:.2f})", ylabel="paired difference of improvement")
        ax.legend(fontsize=7)
        a = arms[arms["C"] == C]
        w = 0.8 / len(SINGLE_ARMS)
        for i, arm in enumerate(SINGLE_ARMS):
            g = a[a["arm"] == arm].sort_values("target")
            if g.empty:
                continue
            ax2.bar(np.arange(len(g)) + (i - (len(SINGLE_ARMS) - 1) / 2) * w, g["mean"], w,
                    yerr=[g["mean"] - g["lo"], g["hi"] - g["mean"]], color=COLORS.get(arm), label=arm, capsize=2)
        ax2.set_xticks(x, labels, fontsize=8)
        ax2.axhline(0, color="black", lw=0.8)
        ax2.set(ylabel="held-out improvement of one update", xlabel="capability point (chain completion)")
        ax2.legend(fontsize=7, ncol=2)
    return save(fig, out / "capability.png")
