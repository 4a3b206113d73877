"""The mismatch lab's planted experiment: a state-changing mismatch whose behaviour policy is known exactly.

The quantized engines of the dose experiments leave a small mismatch, spread over thought tokens that no state
depends on. This experiment plants the regime InterQ-RL is about instead. The rollout engine is the learner's
own fp32 model with the logits of its tool-call tokens shifted at turn ``k`` by ``s (k + 1) z`` (``z`` a fixed
random direction over the tool-call tokens, :func:`creditlab.train.toolshop_rollout.planted_direction`): the
engine writes other calls than the learner would, more so at every later turn, so an early difference changes
the states that later turns see; and its log-probs are the shifted distribution's, so ``mu / pi`` is exact.

Two worlds (``planted_variants``): ``thoughts``, the mismatch lab's shipped base policy (24 thoughts per action,
chains of 5 to 8 calls), and ``thought_free``, a base policy whose every policy token is a call (the toolshop's
thought-free base on chains of 2 to 8, trained here on chains of 7 and 8). At each planted strength
(``planted_strengths``) the arms ``none``, ``tis``, ``interq`` and ``exact_prefix`` (the untruncated prefix
ratio ``exp(E_t)``: the ``prefix`` arm with an envelope no batch reaches) train on ``planted_seeds`` paired seeds
for ``planted_updates`` updates, every model of a (world, seed) in one stacked cell. Held-out success is scored
by the learner's own policy (the fp32 engine without the shift: what the correction is for, the gradient of the
learner's return) and, beside it, by the planted engine (``eval_engine/*``).

A gate cell measures each world at each strength before training: the engine's success, K3 per policy token and
on the calls, the prefix drift entering the last turn, and how many held-out trajectories take another path than
the unshifted engine's with the same uniforms (``diverged``): the mismatch must change states for the experiment
to test anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from creditlab.lab.experiment import Experiment, Prediction, Tables, Verdict
from creditlab.lab.protocol import Table
from creditlab.lab.report import group_means, paired_diff, read_diff, sort_in_order
from creditlab.lab.runner import Cell
from creditlab.labs.mismatch.config import CHAIN_LENGTHS, DIFF, THOUGHTS, UNIT, MismatchConfig, _base_config
from creditlab.train.toolshop_base import BaseConfig

__all__ = ["PLANTED_ARMS", "PLANTED_STATED", "PLANTED_WORLDS", "Planted", "PlantedWorld", "planted_gate_cell",
           "planted_stack_cell", "planted_verdict"]

#: Arm -> the correction the learner applies (a spec of :func:`creditlab.core.correction.parse_correction`).
PLANTED_ARMS: dict[str, str] = {
    "none": "none",
    "tis": "tis",
    "interq": "interq",
    # exp(E_t) itself: the prefix arm's envelope exp(+-1e6 sqrt(n)) is never reached
    "exact_prefix": "prefix:eps_low=1e6,eps_high=1e6",
}


@dataclass(frozen=True)
class PlantedWorld:
    """One world of the planted experiment: its base policy and the GRPO settings that differ from the lab's."""

    base: BaseConfig
    chain_lengths: tuple[int, ...]
    max_len: int
    max_action_len: int
    cache: str = ""
    """Where the base policy comes from, for the record (a run finds it in ``CREDITLAB_CACHE`` or among the
    package's shipped bases)."""


#: The worlds: the lab's shipped 24-thought base (its default protocol's world), and the toolshop's thought-free
#: base of the granularity lab (chains 2, 3, 4, 7, 8; shipped with creditlab too), on its longest chains.
PLANTED_WORLDS: dict[str, PlantedWorld] = {
    "thoughts": PlantedWorld(_base_config(), CHAIN_LENGTHS, 384, THOUGHTS + 8, "shipped with creditlab"),
    "thought_free": PlantedWorld(BaseConfig(chain_lengths=(2, 3, 4, 7, 8)), (7, 8), 160, 8,
                                 "shipped with creditlab (the granularity lab's base)"),
}


def _grpo(cfg: MismatchConfig, world: PlantedWorld, updates: int):
    return replace(cfg.grpo, chain_lengths=world.chain_lengths, max_len=world.max_len,
                   max_action_len=world.max_action_len, updates=updates, rollout_precision="fp32",
                   learner_precision="fp32", correction="none")


def planted_gate_cell(config: dict, world: str, strengths: list[float], tasks: int, cache_dir: str) -> list[dict]:
    """The planted world ``world`` before training: on ``tasks`` held-out tasks, one trajectory each, for
    strength 0 and each planted strength, with the same sampling uniforms: the engine's success, K3 per
    policy token and on the calls, the prefix drift entering the last turn, and the share of trajectories
    whose tokens differ from the unshifted engine's (``diverged``)."""
    import torch

    from creditlab.labs.mismatch.cells import gate_metrics
    from creditlab.models.tiny_lm import StackedTinyLM
    from creditlab.train.toolshop_base import base_policy
    from creditlab.train.toolshop_rollout import EVAL_SEED_OFFSET, make_tasks, rollout_stacked, stacked_logprobs

    cfg = MismatchConfig.from_dict(config)
    w = PLANTED_WORLDS[world]
    g = _grpo(cfg, w, 1)
    strengths = (0.0, *strengths)
    model = base_policy(w.base, cache_dir=cache_dir)
    stack = StackedTinyLM([model] * len(strengths))
    ts = make_tasks(range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + tasks), g.chain_lengths)
    u = torch.rand(tasks, g.max_len, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        b = rollout_stacked(stack, [ts] * len(strengths), u.expand(len(strengths), -1, -1), precision="fp32",
                            max_len=g.max_len, max_turns=g.max_turns, max_action_len=g.max_action_len,
                            temperature=g.temperature, plant=strengths)
        old = stacked_logprobs(stack, b.tokens, "fp32", g.temperature)
    rows = []
    for m, s in enumerate(strengths):
        gm = gate_metrics(old[m], b.rollout_logprobs[m], b.policy_mask[m], b.turn_ids[m], b.tokens[m], b.entropy[m])
        diverged = (b.tokens[m] != b.tokens[0]).any(1).float().mean()
        rows.append({"world": world, "strength": s, "engine_success": float(b.success[m].mean()),
                     "tool_calls": float(b.n_calls[m].float().mean()), "diverged": float(diverged),
                     **{k: v for k, v in gm.items() if k in ("policy_tokens", "thought_tokens", "drift_last",
                                                            "k3_thought", "k3_action")},
                     "k3": _k3(old[m], b.rollout_logprobs[m], b.policy_mask[m])})
    return rows


def _k3(old, rollout_lp, pm) -> float:
    d = (old - rollout_lp).double()[pm]
    return float((d.exp() - 1 - d).mean()) if d.numel() else math.nan


def planted_stack_cell(config: dict, world: str, strengths: list[float], arms: list[str], updates: int, seed: int,
                       cache_dir: str) -> list[dict]:
    """One seed of world ``world``: every (planted strength, arm) model trained for ``updates`` updates as one
    stacked program from the world's base policy, one row per model per update and the final evaluation row."""
    from creditlab.labs.mismatch.cells import UpdateProgress
    from creditlab.models.tiny_lm import StackedTinyLM
    from creditlab.train.toolshop_base import base_policy
    from creditlab.train.toolshop_grpo import train_grpo_stacked

    cfg = MismatchConfig.from_dict(config)
    w = PLANTED_WORLDS[world]
    g = _grpo(cfg, w, updates)
    members = [(s, a) for s in strengths for a in arms]
    configs = [replace(g, plant=s, correction=PLANTED_ARMS[a], seed=seed) for s, a in members]
    stack = StackedTinyLM([base_policy(w.base, cache_dir=cache_dir)] * len(members))
    label = f"mismatch planted {world} seed={seed} ({len(members)} models)"
    # the learner's own policy scores first (eval/*), the planted engine beside it (eval_engine/*)
    rows = train_grpo_stacked(stack, configs, eval_precision="fp32", eval_also="engine",
                              on_update=UpdateProgress(label, g.updates))
    out = []
    for (s, a), model_rows in zip(members, rows, strict=True):
        out += [{"world": world, "strength": s, "arm": a, "seed": seed, **r} for r in model_rows]
    return out


# --------------------------------------------------------------------------------------------------------------
# tables


def _summary(df: pd.DataFrame, cfg: MismatchConfig) -> pd.DataFrame:
    rows = []
    for (world, s, arm, seed), g in df.groupby(["world", "strength", "arm", "seed"], sort=False):
        ev = g.dropna(subset=["eval/success"]).sort_values("update")
        tr = g.dropna(subset=["mismatch/k3"]).sort_values("update")
        last = ev.iloc[-cfg.smooth:]
        rows.append({"world": world, "strength": float(s), "arm": arm, "seed": int(seed),
                     "final": float(last["eval/success"].mean()), "start": float(ev["eval/success"].iloc[0]),
                     "aulc": float(ev["eval/success"].mean()),
                     "final_engine": float(last["eval_engine/success"].mean()) if "eval_engine/success" in last
                     else math.nan,
                     "k3": float(tr["mismatch/k3"].mean()),
                     "weight_max": float(tr["correction/weight_max"].mean()) if "correction/weight_max" in tr
                     else math.nan,
                     "grad_norm_max": float(tr["grad_norm"].max())})
    out = pd.DataFrame(rows)
    return sort_in_order(out, ["world", "strength", "arm", "seed"], {"arm": list(PLANTED_ARMS),
                                                                     "world": list(PLANTED_WORLDS)})


def _means(summary: pd.DataFrame) -> pd.DataFrame:
    m = group_means(summary, ["world", "strength", "arm"], [("final", UNIT), ("aulc", UNIT), ("final_engine", UNIT)],
                    ("k3", "weight_max", "grad_norm_max"))
    return sort_in_order(m, ["world", "strength", "arm"], {"arm": list(PLANTED_ARMS), "world": list(PLANTED_WORLDS)})


#: The paired differences the predictions read: (arm, reference).
PLANTED_DIFFS = (("interq", "tis"), ("interq", "none"), ("tis", "none"), ("exact_prefix", "none"),
                 ("interq", "exact_prefix"))


def _diffs(summary: pd.DataFrame) -> pd.DataFrame:
    out = []
    for a, b in PLANTED_DIFFS:
        if not {a, b} <= set(summary["arm"]):
            continue
        for metric in ("final", "final_engine"):
            d = paired_diff(summary, a, b, ["world", "strength"], metric, bounds=DIFF)
            out.append(d.assign(metric=metric))
    if not out:
        return pd.DataFrame()
    res = pd.concat(out, ignore_index=True)
    return res[["diff", "metric", "world", "strength", "mean", "lo", "hi", "n"]]


# --------------------------------------------------------------------------------------------------------------
# the prediction


#: The predictions as registered before the planted run (docs/mismatch.md, "The dual-clip protocol"), word for word.
PLANTED_STATED = (
    "**(P1)** In the planted world, at the strongest planted strength, InterQ beats TIS: the paired "
    "difference interq - tis of final held-out success (the learner's own policy, the mean of the last 3 "
    "evaluation points) has a 95% interval above 0, in each of the two worlds (with thoughts, thought-free). It "
    "fails in a world where the interval lies below 0, and is not resolved where it spans 0.",
    "**(P2)** At the strongest planted strength InterQ beats no correction: interq - none, read as (P1).",
)


def planted_verdict(diff: pd.DataFrame, a: str, b: str, world: str, strength: float) -> Verdict:
    """(P1)/(P2) in one world: ``holds`` when the 95% interval of ``a - b`` (final) lies above 0, ``fails`` when it
    lies below 0, ``not judged`` when it spans 0 (not resolved) or the pair was not run."""
    r = _row(diff, a, b, world, strength)
    if r is None or not (math.isfinite(r["lo"]) and math.isfinite(r["hi"])):
        return Verdict.NOT_JUDGED
    return Verdict.HOLDS if r["lo"] > 0 else Verdict.FAILS if r["hi"] < 0 else Verdict.NOT_JUDGED


def _row(diff: pd.DataFrame, a: str, b: str, world: str, strength: float):
    if diff is None or diff.empty:
        return None
    sel = diff[(diff["diff"] == f"{a} - {b}") & (diff["metric"] == "final") & (diff["world"] == world)
               & np.isclose(diff["strength"], strength)]
    return None if sel.empty else sel.iloc[0]


def _prediction(stated: str, pid: str, a: str, b: str, world: str, strength: float) -> Prediction:
    def measured(t: Tables) -> str | None:
        r = _row(t["planted_diffs"].frame if "planted_diffs" in t else None, a, b, world, strength)
        if r is None:
            return None
        interval = (f" [{r['lo']:+.3f}, {r['hi']:+.3f}]" if math.isfinite(r["lo"]) and math.isfinite(r["hi"])
                    else " (no interval)")
        return f"{a} - {b} final {r['mean']:+.3f}{interval}, {int(r['n'])} seeds"

    def verdict(t: Tables) -> Verdict:
        return planted_verdict(t["planted_diffs"].frame if "planted_diffs" in t else None, a, b, world, strength)

    def note(v: Verdict, t: Tables) -> str:
        r = _row(t["planted_diffs"].frame if "planted_diffs" in t else None, a, b, world, strength)
        if v is not Verdict.NOT_JUDGED or r is None:
            return ""
        if not (math.isfinite(r["lo"]) and math.isfinite(r["hi"])):
            return "one seed: no interval"
        return "not resolved: the interval spans 0"

    return Prediction(f"{pid} {world}, strength {strength:g}: {a} beats {b}", stated, measured, verdict, note)


class Planted(Experiment):
    """The planted, state-changing mismatch (module docstring)."""

    name = "planted"
    groups = ("planted_gate", "planted")
    fields = ("planted_strengths", "planted_arms", "planted_seeds", "planted_updates", "planted_variants",
              "planted_tasks")

    def validate(self, cfg: MismatchConfig) -> None:
        from creditlab.errors import ConfigError
        from creditlab.lab.protocol import check_count

        check_count(cfg.planted_seeds, "planted_seeds")
        check_count(cfg.planted_updates, "planted_updates")
        check_count(cfg.planted_tasks, "planted_tasks")
        if not cfg.planted_strengths or any(not (math.isfinite(s) and s > 0) for s in cfg.planted_strengths):
            raise ConfigError("planted_strengths", f"needs strengths > 0, got {list(cfg.planted_strengths)}")
        if not cfg.planted_arms or any(a not in PLANTED_ARMS for a in cfg.planted_arms):
            raise ConfigError("planted_arms", f"got {list(cfg.planted_arms)}; valid: {', '.join(PLANTED_ARMS)}")
        if not cfg.planted_variants or any(v not in PLANTED_WORLDS for v in cfg.planted_variants):
            raise ConfigError("planted_variants",
                              f"got {list(cfg.planted_variants)}; valid: {', '.join(PLANTED_WORLDS)}")

    def cells(self, cfg: MismatchConfig) -> list[Cell]:
        ident, ctx = cfg.identity(), cfg.context()
        cells = []
        for world in cfg.planted_variants:
            cells.append(Cell("planted_gate", world, planted_gate_cell,
                              {"config": ident, "world": world, "strengths": list(cfg.planted_strengths),
                               "tasks": cfg.planted_tasks}, ctx))
            cells += [Cell("planted", f"{world}/seed={s}", planted_stack_cell,
                           {"config": ident, "world": world, "strengths": list(cfg.planted_strengths),
                            "arms": list(cfg.planted_arms), "updates": cfg.planted_updates, "seed": s}, ctx)
                      for s in range(cfg.planted_seeds)]
        return cells

    def predictions_for(self, cfg: MismatchConfig) -> tuple[Prediction, ...]:
        """(P1) and (P2) in each world, registered with the dual-clip protocol (none under the others)."""
        if cfg.protocol != "dual-clip":
            return ()
        top = max(cfg.planted_strengths)
        return tuple(_prediction(PLANTED_STATED[i], pid, a, b, w, top)
                     for i, (pid, a, b) in enumerate((("P1", "interq", "tis"), ("P2", "interq", "none")))
                     for w in cfg.planted_variants)

    def tables(self, rows: dict[str, pd.DataFrame], cfg: MismatchConfig) -> dict[str, Table]:
        tabs: dict[str, Table] = {}
        if "planted_gate" in rows:
            gate = rows["planted_gate"]
            gate = gate[gate["world"].isin(cfg.planted_variants)]
            tabs["planted_gate"] = Table(sort_in_order(gate, ["world", "strength"], {"world": list(PLANTED_WORLDS)}),
                                         "Planted worlds before training: the engine at each strength", ".3g")
        if "planted" in rows:
            df = rows["planted"]
            df = df[df["world"].isin(cfg.planted_variants) & df["arm"].isin(cfg.planted_arms)]
            summary = _summary(df, cfg)
            tabs["planted_summary"] = Table(summary, "Planted runs: one row per world, strength, arm and seed", ".3g")
            tabs["planted_means"] = Table(_means(summary), "Planted runs: means over seeds with 95% intervals",
                                          ".3g", console=True)
            d = _diffs(summary)
            if len(d):
                tabs["planted_diffs"] = Table(d, "Planted runs: paired differences between arms (same seeds)", ".3g")
            cols = ["world", "strength", "arm", "seed", "update", "eval/success", "reward/success", "mismatch/k3",
                    "correction/weight_max", "grad_norm"]
            curves = df[[c for c in cols if c in df.columns]].sort_values(["world", "strength", "arm", "seed",
                                                                           "update"])
            tabs["planted_curves"] = Table(curves.reset_index(drop=True), "Planted runs: every update", ".3g",
                                           report=False)
        return tabs

    def plots(self, tabs: Tables, cfg: MismatchConfig, out: Path) -> list[Path]:
        if "planted_curves" not in tabs:
            return []
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        curves = tabs["planted_curves"].frame.dropna(subset=["eval/success"])
        worlds = [w for w in cfg.planted_variants if w in set(curves["world"])]
        strengths = sorted(set(curves["strength"]))
        fig, axes = plt.subplots(len(worlds), len(strengths), figsize=(3.6 * len(strengths), 3.0 * len(worlds)),
                                 squeeze=False, sharey=True)
        colors = {"none": "tab:blue", "tis": "tab:orange", "interq": "tab:green", "exact_prefix": "tab:red"}
        for i, w in enumerate(worlds):
            for j, s in enumerate(strengths):
                ax = axes[i][j]
                sub = curves[(curves["world"] == w) & np.isclose(curves["strength"], s)]
                for arm, g in sub.groupby("arm", sort=False):
                    y = g.groupby("update")["eval/success"]
                    m, lo, hi = y.mean(), y.min(), y.max()
                    ax.plot(m.index, m.values, color=colors.get(arm), label=arm)
                    ax.fill_between(m.index, lo.values, hi.values, color=colors.get(arm), alpha=0.12)
                ax.set_title(f"{w}, strength {s:g}", fontsize=9)
                ax.set_xlabel("update")
                if j == 0:
                    ax.set_ylabel("held-out success (learner)")
        axes[0][0].legend(fontsize=8)
        fig.suptitle("Planted mismatch: mean over seeds, band = seed range", fontsize=10)
        fig.tight_layout()
        path = out / "mismatch_planted.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return [path]

    def interpret(self, tabs: Tables, cfg: MismatchConfig) -> dict[str, str]:
        text: dict[str, str] = {}
        if "planted_gate" in tabs:
            g = tabs["planted_gate"].frame
            parts = []
            for w, gw in g.groupby("world", sort=False):
                base = gw[gw["strength"] == 0]
                top = gw[gw["strength"] == gw["strength"].max()]
                if len(base) and len(top):
                    b, t = base.iloc[0], top.iloc[0]
                    parts.append(
                        f"{w}: at strength {t['strength']:g} the engine's success is {t['engine_success']:.3f} against "
                        f"{b['engine_success']:.3f} unshifted, {t['diverged']:.0%} of the trajectories take another "
                        f"path, K3 on calls {t['k3_action']:.3g}, drift entering the last turn "
                        f"{t['drift_last']:.3g} nat")
            text["planted_gate"] = ("Each world before training, on the same held-out tasks and sampling uniforms at "
                                    "every strength (0: the unshifted engine). " + "; ".join(parts) + ".")
        if "planted_summary" in tabs:
            text["planted_summary"] = (
                "One row per world, planted strength, arm and seed. final: mean held-out success of the learner's own "
                f"policy (fp32, no shift) over the last {cfg.smooth} evaluation points; start: its first point (the "
                "base policy); aulc: the mean over all points; final_engine: final on the planted engine; k3, "
                "weight_max, grad_norm_max as in the means table.")
        if "planted_means" in tabs:
            text["planted_means"] = (
                "final: mean held-out success of the learner's own policy (fp32, no shift) over the last "
                f"{cfg.smooth} evaluation points; final_engine: the same on the planted engine; k3: "
                "mean K3(engine || learner) per policy token over training; weight_max: the mean per-update largest "
                "correction weight; grad_norm_max: the largest pre-clip gradient norm of any update.")
        if "planted_diffs" in tabs:
            d = tabs["planted_diffs"].frame
            cols = ["world", "strength", "mean", "lo", "hi", "n"]
            parts = [read_diff(g[cols], ["world", "strength"], f"{what} ({m})")
                     for (what, m), g in d.groupby(["diff", "metric"], sort=False)]
            text["planted_diffs"] = "Paired differences of final held-out success, same seeds. " + " ".join(parts)
        return text


EXPERIMENT = Planted()
