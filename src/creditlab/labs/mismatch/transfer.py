"""The mismatch lab's transfer experiment (``-e transfer``): which unit of the prefix mismatch carries the
onset of rollback from one trajectory length to another.

``creditlab diagnose``'s ``mismatch.prefix_drift`` was calibrated on one world (trajectories of about 300
policy tokens). Its statistic, the RMS prefix log ratio at the last turn, grows with the tokens before that
turn for one and the same per-token process, so a threshold in it does not carry over to a run of another
length unless rollback itself begins at the same total drift. This experiment measures that: the phase map
(the base policy's mismatch before training against the rollback of training) in two worlds that differ in
the policy tokens per trajectory, on one trainer (dual clip 3, held-out success scored on each arm's rollout
engine, the 2-core budget), and three candidate units, each computed by the function the diagnose checks and
the live checks share (:func:`creditlab.core.diagnostics.batch_check_values`):

* ``total``: the RMS prefix log ratio at the last turn (``mismatch/prefix_drift``, nats);
* ``per_token``: K3 between engine and learner per policy token (``mismatch/k3``);
* ``ess``: the effective sample size, as a share of the trajectories, of the sequence ratios
  ``exp(sum_t delta_t)`` (``mismatch/trajectory_ess``; lower is worse).

Worlds (``transfer_worlds``): ``thoughts40``, the 2-core protocol's world (40 thoughts per action, its own base
policy), and ``thoughts24``, the lab's default world (24 thoughts per action, the shipped base policy), both on
chains of 5 to 8 calls. Points (``transfer_points``, ``arm@dose``): the naive and the QAT learner at engine
doses; every cell also trains the fp32 arm, whose rollback is the world's noise band. A gate cell per world
measures the units on the base policy's held-out trajectories; a training cell per (world, seed) trains every
point of that seed and the fp32 arm as one stacked program. The rule that judges them is
:data:`TRANSFER_STATED` (registered in docs/diagnose.md before the run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from creditlab.lab.experiment import Experiment, Prediction, Tables, Verdict
from creditlab.lab.protocol import Table
from creditlab.lab.report import ci_columns, sort_in_order
from creditlab.lab.runner import Cell
from creditlab.labs.mismatch.config import (
    CHAIN_LENGTHS,
    CHECKPOINT_EVERY,
    COMPUTE_CODE,
    ROLLBACK,
    THOUGHTS,
    TWO_CORE_THOUGHTS,
    MismatchConfig,
    _base_config,
    arm_triple,
)
from creditlab.train.toolshop_base import BaseConfig

__all__ = ["TRANSFER_STATED", "TRANSFER_WORLDS", "UNITS", "Transfer", "TransferWorld", "parse_point",
           "transfer_gate_cell", "transfer_points", "transfer_stack_cell", "unit_calibration"]


@dataclass(frozen=True)
class TransferWorld:
    """One world of the transfer experiment: its base policy and its trajectory and action lengths (the rest of
    the training settings are the run's ``grpo``)."""

    base: BaseConfig
    max_len: int
    max_action_len: int
    cache: str = ""
    """Where the base policy comes from, for the record."""


def _worlds() -> dict[str, TransferWorld]:
    two = MismatchConfig.two_core()
    return {
        "thoughts40": TransferWorld(two.base, two.grpo.max_len, two.grpo.max_action_len,
                                    "the 2-core protocol's base (committed in results/mismatch-2core)"),
        "thoughts24": TransferWorld(_base_config(), 384, THOUGHTS + 8, "shipped with creditlab"),
    }


#: The worlds, by name (:class:`TransferWorld`).
TRANSFER_WORLDS: dict[str, TransferWorld] = _worlds()
assert TRANSFER_WORLDS["thoughts40"].base.thoughts == TWO_CORE_THOUGHTS
assert tuple(TRANSFER_WORLDS["thoughts24"].base.chain_lengths) == CHAIN_LENGTHS

#: Candidate unit -> (column of the gate table, key of batch_check_values, direction: +1 larger is worse).
UNITS: dict[str, tuple[str, str, int]] = {
    "total": ("total", "mismatch/prefix_drift", +1),
    "per_token": ("per_token", "mismatch/k3", +1),
    "ess": ("ess", "mismatch/trajectory_ess", -1),
}
#: A point rolls back when its rollback exceeds the world's band in at least this share of its seeds, and is
#: stable when it does in at most :data:`STABLE_SHARE` of them (between: mixed, it constrains no threshold).
ROLLS_SHARE, STABLE_SHARE = 0.75, 0.25


def parse_point(point: str) -> tuple[str, str]:
    """``"naive@mxfp4"`` -> ``("naive", "mxfp4")``, checked against the lab's arms and doses."""
    from creditlab.errors import ConfigError
    from creditlab.labs.mismatch.config import DOSES

    arm, sep, dose = point.partition("@")
    if not sep or dose not in DOSES or arm not in ("naive", "qat"):
        raise ConfigError("transfer_points", f"got {point!r}; each is arm@dose with arm naive or qat and dose one of "
                                             f"{', '.join(DOSES)}")
    return arm, dose


def transfer_points(cfg: MismatchConfig) -> list[tuple[str, str]]:
    return [parse_point(p) for p in cfg.transfer_points]


def _grpo(cfg: MismatchConfig, w: TransferWorld):
    return replace(cfg.grpo, chain_lengths=tuple(w.base.chain_lengths), max_len=w.max_len,
                   max_action_len=w.max_action_len)


def transfer_gate_cell(config: dict, world: str, points: list[str], tasks: int, cache_dir: str) -> list[dict]:
    """World ``world`` before training: for each point (and the fp32 arm), the base policy's trajectories on
    ``tasks`` held-out tasks sampled by the point's engine (one each, the same uniforms for every engine), and the
    candidate units between that engine and the point's learner, computed by
    :func:`creditlab.core.diagnostics.batch_check_values` (the diagnose checks' and the live checks' values)."""
    import torch

    from creditlab.core.diagnostics import batch_check_values
    from creditlab.diagnose.checks import CHECK_PARAMS
    from creditlab.train.toolshop_base import base_policy
    from creditlab.train.toolshop_rollout import EVAL_SEED_OFFSET, make_tasks, rollout, sequence_logprobs

    cfg = MismatchConfig.from_dict(config)
    w = TRANSFER_WORLDS[world]
    g = _grpo(cfg, w)
    model = base_policy(w.base, cache_dir=cache_dir)
    ts = make_tasks(range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + tasks), g.chain_lengths)
    rows, batches = [], {}
    with torch.no_grad():
        for arm, dose in [("fp32", "fp32"), *(parse_point(p) for p in points)]:
            engine, learner, _ = arm_triple(arm, dose)
            if engine not in batches:
                batches[engine] = rollout(model, ts, precision=engine, max_len=g.max_len, max_turns=g.max_turns,
                                          max_action_len=g.max_action_len, temperature=g.temperature,
                                          generator=torch.Generator().manual_seed(0))
            b = batches[engine]
            old = sequence_logprobs(model, b.tokens, learner, g.temperature)
            v = batch_check_values(old, b.rollout_logprobs, b.policy_mask, CHECK_PARAMS)
            pm = b.policy_mask.bool()
            turns = torch.where(pm, b.turn_ids, torch.full_like(b.turn_ids, -1)).max(1).values + 1
            rows.append({"world": world, "arm": arm, "dose": dose, "engine": engine, "learner": learner,
                         "policy_tokens": float(pm.sum(1).double().mean()), "turns": float(turns.double().mean()),
                         "engine_success": float(b.success.double().mean()),
                         **{col: float(v[key]) for col, key, _ in UNITS.values()},
                         "total_first_turn": float(v["mismatch/prefix_drift/first_turn"]),
                         "seq_ratio": float(v["mismatch/sequence_ratio_length"]),
                         "turn_min_tokens": CHECK_PARAMS.turn_min_tokens, "seq_min_rows": CHECK_PARAMS.seq_min_rows})
    return rows


def transfer_stack_cell(config: dict, world: str, points: list[str], seed: int, cache_dir: str) -> list[dict]:
    """One seed of world ``world``: the fp32 arm and every point trained for the run's updates as one stacked
    program from the world's base policy (checkpointed, so an interrupted cell resumes), one row per model per
    update and the final evaluation row; held-out success on each arm's own engine, the fp32 engine's beside."""
    from creditlab.lab.protocol import code_fingerprint
    from creditlab.lab.runner import digest
    from creditlab.labs.mismatch.cells import UpdateProgress
    from creditlab.models.tiny_lm import StackedTinyLM
    from creditlab.train.toolshop_base import base_policy
    from creditlab.train.toolshop_grpo import train_grpo_stacked

    cfg = MismatchConfig.from_dict(config)
    w = TRANSFER_WORLDS[world]
    g = _grpo(cfg, w)
    members = [("fp32", "fp32"), *(parse_point(p) for p in points)]
    members.sort(key=lambda m: arm_triple(m[0], m[1])[1] == "fp32")  # one quantizer call per learner precision
    configs = []
    for arm, dose in members:
        engine, learner, corr = arm_triple(arm, dose)
        configs.append(replace(g, rollout_precision=engine, learner_precision=learner, correction=corr, seed=seed))
    stack = StackedTinyLM([base_policy(w.base, cache_dir=cache_dir)] * len(members))
    key = digest({"world": world, "points": points, "seed": seed, "config": config,
                  "code": code_fingerprint(COMPUTE_CODE)})
    ck = Path(cache_dir) / "checkpoints" / f"mismatch-transfer-{key}.pt"
    label = f"mismatch transfer {world} seed={seed} ({len(members)} models)"
    rows = train_grpo_stacked(stack, configs, eval_precision=None, eval_also="fp32", checkpoint=ck,
                              checkpoint_every=CHECKPOINT_EVERY, on_update=UpdateProgress(label, g.updates))
    ck.unlink(missing_ok=True)
    out = []
    for (arm, dose), model_rows in zip(members, rows, strict=True):
        out += [{"world": world, "arm": arm, "dose": dose, "seed": seed, **r} for r in model_rows]
    return out


# --------------------------------------------------------------------------------------------------------------
# tables


def _summary(df: pd.DataFrame, smooth: int) -> pd.DataFrame:
    from creditlab.labs.mismatch.comparison import score_curve

    rows = []
    for (world, arm, dose, seed), g in df.groupby(["world", "arm", "dose", "seed"], sort=False):
        ev = g.dropna(subset=["eval/success"]).sort_values("update")
        sc = score_curve(ev["update"].to_numpy(), ev["eval/success"].to_numpy(), smooth)
        row = {"world": world, "arm": arm, "dose": dose, "seed": int(seed), **sc,
               "final_fp32": float(ev["eval_fp32/success"].iloc[-smooth:].mean()) if "eval_fp32/success" in ev
               else math.nan,
               "k3_late": float(g.dropna(subset=["mismatch/k3"]).sort_values("update")["mismatch/k3"].iloc[-10:].mean())
               if "mismatch/k3" in g else math.nan,
               "grad_norm_max": float(g["grad_norm"].max()) if "grad_norm" in g else math.nan}
        rows.append(row)
    return sort_in_order(pd.DataFrame(rows), ["world", "dose", "arm", "seed"],
                         {"world": list(TRANSFER_WORLDS), "arm": ["fp32", "naive", "qat"]})


def world_band(summary: pd.DataFrame, world: str) -> float:
    """The world's noise band of rollback: the largest rollback of its fp32 arm, and at least ROLLBACK."""
    fp = summary[(summary["world"] == world) & (summary["arm"] == "fp32")]["rollback"]
    return max(ROLLBACK, float(fp.max())) if len(fp) else ROLLBACK


def transfer_map(summary: pd.DataFrame, gate: pd.DataFrame) -> pd.DataFrame:
    """Per world and point: the candidate units at the gate, the rollback over seeds (mean, 95% interval), how
    many seeds roll back beyond the world's band, and the point's class (``rolls back`` / ``stable`` /
    ``mixed``) by :data:`ROLLS_SHARE` / :data:`STABLE_SHARE`."""
    rows = []
    for (world, arm, dose), g in summary.groupby(["world", "arm", "dose"], sort=False):
        if arm == "fp32":
            continue
        band = world_band(summary, world)
        gr = gate[(gate["world"] == world) & (gate["arm"] == arm) & (gate["dose"] == dose)]
        k, n = int((g["rollback"] > band).sum()), len(g)
        cls = "rolls back" if k >= ROLLS_SHARE * n else "stable" if k <= STABLE_SHARE * n else "mixed"
        units = {c: float(gr[c].iloc[0]) if len(gr) else math.nan for c, _, _ in UNITS.values()}
        rows.append({"world": world, "arm": arm, "dose": dose,
                     "policy_tokens": float(gr["policy_tokens"].iloc[0]) if len(gr) else math.nan, **units,
                     **ci_columns(g["rollback"], "rollback"), "rolled_back": k, "seeds": n, "band": band,
                     "class": cls, "final": float(g["final"].mean())})
    return sort_in_order(pd.DataFrame(rows), ["world", "dose", "arm"],
                         {"world": list(TRANSFER_WORLDS), "arm": ["naive", "qat"]}) if rows else pd.DataFrame()


def unit_calibration(tmap: pd.DataFrame, worlds: list[str]) -> pd.DataFrame:
    """Per candidate unit, by the registered rule (:data:`TRANSFER_STATED`): in each world and pooled, the worst
    value among stable points and the best among points that roll back; whether one threshold separates them
    in every world at once (``separates``); the margin (|log| of the ratio of the two pooled values); whether each
    world brackets the onset (has both a stable and a rolling-back point)."""
    rows = []
    for unit, (col, _, sign) in UNITS.items():
        row: dict = {"unit": unit, "direction": "higher is worse" if sign > 0 else "lower is worse"}
        bracketed = True
        for w in [*worlds, "pooled"]:
            sub = tmap if w == "pooled" else tmap[tmap["world"] == w]
            st = sub[sub["class"] == "stable"][col].to_numpy(float)
            rb = sub[sub["class"] == "rolls back"][col].to_numpy(float)
            worst_stable = (st.max() if sign > 0 else st.min()) if st.size else math.nan
            best_rolling = (rb.min() if sign > 0 else rb.max()) if rb.size else math.nan
            row[f"stable_worst[{w}]"], row[f"rolls_best[{w}]"] = worst_stable, best_rolling
            if w != "pooled":
                bracketed &= bool(st.size and rb.size)
        s, r = row["stable_worst[pooled]"], row["rolls_best[pooled]"]
        sep = bool(math.isfinite(s) and math.isfinite(r) and (s < r if sign > 0 else s > r))
        row["bracketed"] = bracketed
        row["separates"] = sep and bracketed
        row["margin"] = abs(math.log(r / s)) if sep and s > 0 and r > 0 else math.nan
        rows.append(row)
    out = pd.DataFrame(rows)
    best = out[out["separates"]].sort_values("margin", ascending=False)
    out["picked"] = out["unit"] == (best["unit"].iloc[0] if len(best) else None)
    return out


# --------------------------------------------------------------------------------------------------------------
# the prediction

#: The rule as registered before the transfer run (docs/diagnose.md, "The transfer experiment"), word for word.
TRANSFER_STATED = (
    "**(T1)** A unit transfers: at least one of the three candidate units (total, per_token, ess) separates "
    "the stable points from the points that roll back in both worlds with one threshold. A point rolls back when "
    "its rollback (best - final held-out success on its own engine, windows of 3 evaluation points) exceeds its "
    "world's band (the largest rollback of that world's fp32 arm, and at least 0.03) in at least 3 of its 4 seeds, "
    "and is stable when it does in at most 1; a mixed point constrains nothing. A unit separates when every "
    "stable point of both worlds lies on the good side of every rolling-back point of both worlds. T1 holds when "
    "a unit separates; it fails when each world brackets the onset (has a stable and a rolling-back point) and no "
    "unit separates; it is not resolved when a world does not bracket the onset. Among units that separate, the "
    "one with the largest margin (|log| of the ratio of the worst stable to the best rolling-back value) is "
    "picked; the checks warn beyond the worst stable value and fail at or beyond the best rolling-back value, "
    "both taken exactly as measured.",
)


def transfer_verdict(cal: pd.DataFrame | None) -> Verdict:
    if cal is None or cal.empty:
        return Verdict.NOT_JUDGED
    if bool(cal["separates"].any()):
        return Verdict.HOLDS
    return Verdict.FAILS if bool(cal["bracketed"].all()) else Verdict.NOT_JUDGED


def _prediction() -> Prediction:
    def measured(t: Tables) -> str | None:
        if "transfer_units" not in t:
            return None
        cal = t["transfer_units"].frame
        how = {(True, True): "separates", (False, True): "overlaps"}
        parts = [f"{r['unit']}: {how.get((bool(r['separates']), bool(r['bracketed'])), 'onset not bracketed')}"
                 + (f" (margin {r['margin']:.3g})" if r["separates"] else "") for _, r in cal.iterrows()]
        picked = cal[cal["picked"]]
        return "; ".join(parts) + (f"; picked {picked['unit'].iloc[0]}" if len(picked) else "; none picked")

    def verdict(t: Tables) -> Verdict:
        return transfer_verdict(t["transfer_units"].frame if "transfer_units" in t else None)

    def note(v: Verdict, t: Tables) -> str:
        if v is Verdict.NOT_JUDGED and "transfer_units" in t:
            return "not resolved: a world does not bracket the onset of rollback"
        return ""

    return Prediction("T1 a unit of the prefix mismatch transfers between trajectory lengths", TRANSFER_STATED[0],
                      measured, verdict, note)


class Transfer(Experiment):
    """The transfer experiment (module docstring)."""

    name = "transfer"
    groups = ("transfer_gate", "transfer")
    fields = ("transfer_worlds", "transfer_points", "transfer_seeds", "transfer_tasks")

    def validate(self, cfg: MismatchConfig) -> None:
        from creditlab.errors import ConfigError
        from creditlab.lab.protocol import check_count

        check_count(cfg.transfer_seeds, "transfer_seeds")
        check_count(cfg.transfer_tasks, "transfer_tasks")
        if not cfg.transfer_worlds or any(w not in TRANSFER_WORLDS for w in cfg.transfer_worlds):
            raise ConfigError("transfer_worlds",
                              f"got {list(cfg.transfer_worlds)}; valid: {', '.join(TRANSFER_WORLDS)}")
        if not cfg.transfer_points or len(set(cfg.transfer_points)) != len(cfg.transfer_points):
            raise ConfigError("transfer_points", f"needs distinct points, got {list(cfg.transfer_points)}")
        transfer_points(cfg)

    def cells(self, cfg: MismatchConfig) -> list[Cell]:
        ident, ctx = cfg.identity(), cfg.context()
        points = list(cfg.transfer_points)
        cells = []
        for world in cfg.transfer_worlds:
            cells.append(Cell("transfer_gate", world, transfer_gate_cell,
                              {"config": ident, "world": world, "points": points, "tasks": cfg.transfer_tasks}, ctx))
            cells += [Cell("transfer", f"{world}/seed={s}", transfer_stack_cell,
                           {"config": ident, "world": world, "points": points, "seed": s}, ctx)
                      for s in range(cfg.transfer_seeds)]
        return cells

    def predictions_for(self, cfg: MismatchConfig) -> tuple[Prediction, ...]:
        """(T1), registered with the transfer protocol (none under the others)."""
        return (_prediction(),) if cfg.protocol == "transfer" else ()

    def tables(self, rows: dict[str, pd.DataFrame], cfg: MismatchConfig) -> dict[str, Table]:
        tabs: dict[str, Table] = {}
        gate = None
        if "transfer_gate" in rows:
            gate = rows["transfer_gate"]
            gate = gate[gate["world"].isin(cfg.transfer_worlds)]
            tabs["transfer_gate"] = Table(sort_in_order(gate, ["world", "dose", "arm"],
                                                        {"world": list(TRANSFER_WORLDS)}),
                                          "Transfer worlds before training: the candidate units at each point", ".3g")
        if "transfer" in rows:
            df = rows["transfer"]
            df = df[df["world"].isin(cfg.transfer_worlds)]
            summary = _summary(df, cfg.smooth)
            tabs["transfer_summary"] = Table(summary, "Transfer runs: one row per world, arm, dose and seed", ".3g")
            if gate is not None:
                tmap = transfer_map(summary, gate)
                if len(tmap):
                    tabs["transfer_map"] = Table(tmap, "Transfer phase map: the units at the gate against rollback",
                                                 ".3g", console=True)
                    tabs["transfer_units"] = Table(unit_calibration(tmap, list(cfg.transfer_worlds)),
                                                   "Candidate units: does one threshold separate both worlds?", ".4g",
                                                   console=True)
            cols = ["world", "arm", "dose", "seed", "update", "eval/success", "eval_fp32/success", "reward/success",
                    "mismatch/k3", "grad_norm"]
            curves = df[[c for c in cols if c in df.columns]].sort_values(["world", "dose", "arm", "seed", "update"])
            tabs["transfer_curves"] = Table(curves.reset_index(drop=True), "Transfer runs: every update", ".3g",
                                            report=False)
        return tabs

    def plots(self, tabs: Tables, cfg: MismatchConfig, out: Path) -> list[Path]:
        if "transfer_map" not in tabs:
            return []
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        tmap = tabs["transfer_map"].frame
        fig, axes = plt.subplots(1, len(UNITS), figsize=(4.6 * len(UNITS), 3.8))
        marks = {"thoughts40": "o", "thoughts24": "s"}
        colors = {"rolls back": "tab:red", "stable": "tab:green", "mixed": "tab:orange"}
        for ax, (unit, (col, _, sign)) in zip(axes, UNITS.items(), strict=True):
            for _, r in tmap.iterrows():
                c = colors[r["class"]]
                ax.errorbar(r[col], r["rollback"], yerr=[[max(r["rollback"] - r["rollback_lo"], 0)],
                                                         [max(r["rollback_hi"] - r["rollback"], 0)]],
                            fmt=marks.get(r["world"], "o"), color=c, alpha=0.8, capsize=2,
                            mfc=c if r["arm"] == "naive" else "white", mec=c)  # hollow: the QAT learner
                ax.annotate(r["dose"], (r[col], r["rollback"]), xytext=(4, 3), textcoords="offset points",
                            fontsize=6, alpha=0.7)
            ax.axhline(float(tmap["band"].max()), color="gray", lw=0.8, ls=":")
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # 1-2-5: readable, not crowded
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(f"{unit} ({'higher' if sign > 0 else 'lower'} is worse)")
            ax.set_ylabel("rollback (mean, 95% interval)")
        handles = [plt.Line2D([], [], marker=m, ls="", color="k", label=w) for w, m in marks.items()]
        handles += [plt.Line2D([], [], marker="o", ls="", color="k", label="naive (fp32) learner"),
                    plt.Line2D([], [], marker="o", ls="", color="k", mfc="white", label="QAT learner")]
        handles += [plt.Line2D([], [], marker="o", ls="", color=c, label=k) for k, c in colors.items()]
        axes[0].legend(handles=handles, fontsize=7)
        fig.suptitle("Transfer: the candidate units at the gate against rollback (label: the engine; dotted: the "
                     "largest fp32 band)", fontsize=10)
        fig.tight_layout()
        path = out / "mismatch_transfer.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return [path]

    def interpret(self, tabs: Tables, cfg: MismatchConfig) -> dict[str, str]:
        text: dict[str, str] = {}
        if "transfer_gate" in tabs:
            g = tabs["transfer_gate"].frame
            parts = [f"{w}: {r['policy_tokens']:.0f} policy tokens per trajectory, {r['turns']:.1f} turns"
                     for w, gw in g.groupby("world", sort=False) for _, r in gw.head(1).iterrows()]
            text["transfer_gate"] = ("The base policy of each world before training, on the same held-out tasks and "
                                     "sampling uniforms for every engine; the units are the values diagnose and the "
                                     "live checks compute on such a batch. " + "; ".join(parts) + ".")
        if "transfer_summary" in tabs:
            text["transfer_summary"] = (
                "One row per world, arm, dose and seed. final: mean held-out success on the arm's own engine over the "
                f"last {cfg.smooth} evaluation points; best: the largest mean of {cfg.smooth} consecutive points; "
                "rollback = best - final; final_fp32: final on the fp32 engine; k3_late: K3 per policy token over the "
                "last 10 updates; grad_norm_max: the largest pre-clip gradient norm.")
        if "transfer_map" in tabs:
            text["transfer_map"] = (
                "Per world and point: the units at the gate (total: RMS prefix log ratio at the last turn, nats; "
                "per_token: K3 per policy token; ess: trajectory ESS share), rollback over seeds with its 95% "
                "interval, the seeds whose rollback exceeds the world's band (band: the largest fp32 rollback, at "
                f"least {ROLLBACK:g}), and the class: rolls back (at least {ROLLS_SHARE:.0%} of seeds), stable (at "
                f"most {STABLE_SHARE:.0%}), mixed.")
        if "transfer_units" in tabs:
            cal = tabs["transfer_units"].frame
            picked = cal[cal["picked"]]
            text["transfer_units"] = (
                "Per unit: the worst stable and the best rolling-back value in each world and pooled; a unit "
                "separates when one threshold puts every stable point of both worlds on its good side and every "
                "rolling-back point on the other, and both worlds bracket the onset. "
                + (f"Picked: {picked['unit'].iloc[0]}." if len(picked) else "No unit is picked."))
        return text


EXPERIMENT = Transfer()
