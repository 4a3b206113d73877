"""The ``capability`` experiment of the coverage lab.

The one-update protocol at fixed capability points: base policies pre-trained (uniform credit)
until their exact chain completion first reaches a target (about 25% and 70%), at the final-write
verifier (C = 6 and 8); a gate table of the achieved completion, then the arms and an equivalence test
fixed in advance: the 95% interval of per_turn - shuffled inside +/- 0.25 x (uniform - binary).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from creditlab.errors import ConfigError
from creditlab.lab.experiment import Experiment, Prediction, Verdict
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table
from creditlab.lab.report import mean_ci, read_diff, small_run_note, sort_in_order, summarize
from creditlab.lab.runner import Cell
from creditlab.labs.coverage._common import (
    COLORS,
    DIFF,
    SINGLE_ARMS,
    _paired_improvements,
    runs_table,
)
from creditlab.models.batched_mlp import BatchedMLP
from creditlab.train.chain import ChainTrainConfig, ModelSpec, pretrain_to_completion, single_update_from

if TYPE_CHECKING:
    from creditlab.labs.coverage import CoverageConfig


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


#: What the capability experiment predicts at each completion target (written before the full run).
CAPABILITY_PREDICTIONS = {0.25: "null: per_turn - shuffled interval contains 0",
                          0.70: "per_turn < uniform, and per_turn - shuffled inside the band"}

#: The capability experiment's predictions as written before its full run (docs/coverage-report.md,
#: "Predictions (written before the full run)"), word for word: what a run records at its start.
CAPABILITY_STATED = (
    "1. **A null at 25%** (the paper's capability floor), at C = 6 and at C = 8: the 95% interval of "
    "per_turn − shuffled contains 0. Falsified at a C where it excludes 0.",
    "2. **per_turn < uniform at 70%**, at C = 6 and at C = 8: the 95% interval of per_turn − uniform lies "
    "below 0. Falsified at a C where its upper end is >= 0.",
    "3. **The equivalence holds at 70%**, at C = 6 and at C = 8: the 95% interval of per_turn − shuffled "
    "lies inside ±0.25 × (uniform − binary). Falsified at a C where it reaches past either end of the "
    "band (or the band is empty).",
)


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


def _rows_verdict(test: pd.DataFrame, rule) -> Verdict:
    """``rule`` (a row of ``capability_test`` -> held, None when it cannot tell) at every row, as one verdict
    (:meth:`Verdict.every`: fails at any row that fails, holds when every row holds)."""
    return Verdict.every(Verdict.of(rule(r)) for _, r in test.iterrows())


def _known(*values: float) -> bool:
    return not any(np.isnan(v) for v in values)


def verdict_null(test: pd.DataFrame) -> Verdict:
    """Prediction 1 on rows of ``capability_test``: the 95% interval of per_turn - shuffled contains 0 at
    every row; not judged at a row without an interval (one seed), or without rows."""
    return _rows_verdict(test, lambda r: bool(r["lo"] <= 0.0 <= r["hi"]) if _known(r["lo"], r["hi"]) else None)


def verdict_below(test: pd.DataFrame) -> Verdict:
    """Prediction 2 on rows of ``capability_test``: the 95% interval of per_turn - uniform lies below 0 at every
    row."""
    return _rows_verdict(test, lambda r: bool(r["pu_hi"] < 0) if _known(r["pu_hi"]) else None)


def verdict_equivalent(test: pd.DataFrame) -> Verdict:
    """Prediction 3 on rows of ``capability_test``: the 95% interval of per_turn - shuffled lies inside +/- band
    at every row (fails at a row with an empty band)."""
    return _rows_verdict(test, lambda r: bool(r["band"] > 0 and r["lo"] > -r["band"] and r["hi"] < r["band"])
                         if _known(r["lo"], r["hi"], r["band"]) else None)


def capability_verdict(test: pd.DataFrame) -> Verdict:
    """The verdict of what the capability experiment predicts (:data:`CAPABILITY_PREDICTIONS`) on rows of
    ``capability_test`` at one target (the table's ``verdict`` column: one row each): prediction 1 at 25%,
    predictions 2 and 3 together at 70% (holds when both hold, fails when either fails, else not judged); not
    judged at any other target."""
    if test.empty or test["target"].nunique() != 1:
        return Verdict.NOT_JUDGED
    key = round(float(test["target"].iloc[0]), 6)
    if key == 0.25:
        return verdict_null(test)
    if key == 0.70:
        return Verdict.every((verdict_below(test), verdict_equivalent(test)))
    return Verdict.NOT_JUDGED


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
        out.append({"C": int(C), "target": float(target), "achieved": float(arms.loc[
            (arms["C"] == C) & (arms["target"] == target) & (arms["arm"] == "uniform"), "completion"].mean()),
            "n": len(w), "per_turn-shuffled": ps, "lo": lo, "hi": hi, "uniform-binary": ub, "band": band,
            "equivalent": equivalent, "null": null, "per_turn-uniform": pu, "pu_lo": pu_lo, "pu_hi": pu_hi,
            "per_turn<uniform": below, "predicted": CAPABILITY_PREDICTIONS.get(round(float(target), 6), "-")})
    test = pd.DataFrame(out)
    verdicts = [capability_verdict(test.iloc[[i]]) for i in range(len(test))]
    said = test["predicted"] != "-" if len(test) else pd.Series(dtype=bool)
    test["holds"] = [v is Verdict.HOLDS if p else np.nan for v, p in zip(verdicts, said, strict=True)]
    test["verdict"] = [v.value if p else "-" for v, p in zip(verdicts, said, strict=True)]
    return test


def _points(tabs: Mapping[str, Table], target: float) -> pd.DataFrame | None:
    """The rows of ``capability_test`` at ``target``, with the gate of their point (None: no such row)."""
    if "capability_test" not in tabs:
        return None
    t = tabs["capability_test"].frame
    t = t[np.isclose(t["target"], target)]
    if t.empty:
        return None
    gate = tabs["capability_gate"].frame if "capability_gate" in tabs else pd.DataFrame(columns=["C", "target", "gate"])
    passed = {(int(c), round(float(g), 6)) for c, g, ok in zip(gate["C"], gate["target"], gate["gate"], strict=True)
              if ok == "pass"}
    return t.assign(passes=[(int(c), round(float(g), 6)) in passed for c, g in zip(t["C"], t["target"], strict=True)])


def _judge(tabs: Mapping[str, Table], target: float, rule) -> Verdict:
    """``rule`` on the points at ``target`` that pass their gate; a point that fails its gate is not judged (the
    docs page: its predictions are not counted as tested), so the prediction does not hold there."""
    t = _points(tabs, target)
    if t is None:
        return Verdict.NOT_JUDGED
    verdict = rule(t[t["passes"]])
    return Verdict.NOT_JUDGED if verdict is Verdict.HOLDS and not t["passes"].all() else verdict


def _measured(tabs: Mapping[str, Table], target: float, diff: str) -> str | None:
    """Per C at ``target``: the paired difference ``diff`` (``per_turn-shuffled`` with the band, or
    ``per_turn-uniform``) with its 95% interval, and the points that failed their gate."""
    t = _points(tabs, target)
    if t is None:
        return None
    lo, hi = ("lo", "hi") if diff == "per_turn-shuffled" else ("pu_lo", "pu_hi")
    parts = []
    for _, r in t.iterrows():
        part = f"C={int(r['C'])}: {r[diff]:+.4f} [{r[lo]:+.4f}, {r[hi]:+.4f}]"
        if diff == "per_turn-shuffled" and round(float(target), 6) == 0.70:
            part += f", band +/-{r['band']:.2g}" if r["band"] > 0 else ", empty band"
        parts.append(part + ("" if r["passes"] else " (gate failed: not judged)"))
    return "; ".join(parts)


#: The capability experiment's predictions, judged on its ``capability_test`` and ``capability_gate`` tables.
PREDICTIONS = (
    Prediction("1: a null at 25%: per_turn - shuffled's interval contains 0 at every C", CAPABILITY_STATED[0],
               measured=lambda tabs: _measured(tabs, 0.25, "per_turn-shuffled"),
               verdict=lambda tabs: _judge(tabs, 0.25, verdict_null)),
    Prediction("2: per_turn < uniform at 70%: per_turn - uniform's interval below 0 at every C", CAPABILITY_STATED[1],
               measured=lambda tabs: _measured(tabs, 0.70, "per_turn-uniform"),
               verdict=lambda tabs: _judge(tabs, 0.70, verdict_below)),
    Prediction("3: the equivalence at 70%: per_turn - shuffled's interval inside the band at every C",
               CAPABILITY_STATED[2], measured=lambda tabs: _measured(tabs, 0.70, "per_turn-shuffled"),
               verdict=lambda tabs: _judge(tabs, 0.70, verdict_equivalent)),
)


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
        said = {"holds": "holds", "fails": "does not hold", "not judged": "not judged (no interval)"}
        verdict = "" if r["predicted"] == "-" else f" Predicted: {r['predicted']}; {said[r['verdict']]}."
        parts.append(f"{_point(r)}: per_turn - shuffled {r['per_turn-shuffled']:+.4f} [{r['lo']:+.4f}, "
                     f"{r['hi']:+.4f}], {'inside' if r['equivalent'] else 'not inside'} {band}; per_turn - uniform "
                     f"{r['per_turn-uniform']:+.4f} [{r['pu_lo']:+.4f}, {r['pu_hi']:+.4f}].{verdict}")
    text["capability_test"] = (
        f"Equivalence test fixed in advance: the 95% interval of the paired mean per_turn - shuffled must lie "
        f"inside +/- {cfg.capability_margin} x (uniform - binary) of the same point. " + " ".join(parts))
    text["capability_diff"] = " ".join(read_diff(g, ["C", "target"], what) for what, g in
                                       tabs["capability_diff"].frame.groupby("diff", sort=False))
    return text


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


class Capability(Experiment):
    """The one-update protocol at fixed capability points, with a gate and an equivalence test."""

    name = "capability"
    fields = ("capability_Cs", "capability_targets", "capability_seeds", "capability_lr", "capability_max_updates",
              "capability_margin", "capability_gate_reached", "capability_gate_overshoot")
    predictions = PREDICTIONS

    def validate(self, cfg: CoverageConfig) -> None:
        if self.name in cfg.experiments:
            for C in cfg.capability_Cs:
                if not 1 <= C <= cfg.train.T:
                    raise ConfigError("capability_Cs", f"must be in [1, T={cfg.train.T}], got {C}")
        if not cfg.capability_Cs or not cfg.capability_targets:
            raise ConfigError("capability_Cs", "needs at least one chain length and one completion target")
        for t in cfg.capability_targets:
            if not 0.0 < t <= 1.0:
                raise ConfigError("capability_targets", f"completion targets must be in (0, 1], got {t}")
        if len(set(cfg.capability_targets)) != len(cfg.capability_targets):
            raise ConfigError("capability_targets", f"targets must be distinct, got {cfg.capability_targets}")
        if cfg.capability_seeds < 2:
            raise ConfigError("capability_seeds", f"needs >= 2 paired seeds, got {cfg.capability_seeds}")
        if not cfg.capability_lr > 0 or cfg.capability_max_updates < 1:
            raise ConfigError("capability_lr", f"needs capability_lr > 0 and capability_max_updates >= 1, got "
                                               f"{cfg.capability_lr}, {cfg.capability_max_updates}")
        if not cfg.capability_margin > 0:
            raise ConfigError("capability_margin", f"must be > 0, got {cfg.capability_margin}")
        if not 0.0 <= cfg.capability_gate_reached <= 1.0 or cfg.capability_gate_overshoot < 0:
            raise ConfigError("capability_gate_reached", "gate share must be in [0, 1] and the overshoot >= 0")

    def cells(self, cfg: CoverageConfig) -> list[Cell]:
        return [Cell("capability", f"final/C={C}", run_capability_cell,
                     {"C": C, "targets": list(cfg.capability_targets), "seeds": cfg.capability_seeds,
                      "train": asdict(cfg.train), "lr": cfg.capability_lr,
                      "max_updates": cfg.capability_max_updates, "step": cfg.single_step,
                      "clip": cfg.single_clip, "rollouts": cfg.single_rollouts})
                for C in cfg.capability_Cs]

    def tables(self, rows: dict[str, pd.DataFrame], cfg: CoverageConfig) -> dict[str, Table]:
        rows, tabs = runs_table(self.name, rows[self.name])
        df = rows
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

    def plots(self, tabs, cfg: CoverageConfig, out: Path) -> list[Path]:
        if "capability_test" not in tabs:
            return []
        return [plot_capability(tabs["capability_test"].frame, tabs["capability"].frame, out)]

    def interpret(self, tabs, cfg: CoverageConfig) -> dict[str, str]:
        return capability_text(tabs, cfg)


EXPERIMENT = Capability()
