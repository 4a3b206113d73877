"""What the granularity lab's experiments share: the training run of a cell (:func:`run_arm`) and its
dump file, the per-run tables (final held-out results, means, paired differences, self-distillation,
curves), the OPSD plot, the teachers' reading, the arms' labels and colours, and what an experiment of
this lab gives beyond :class:`~creditlab.lab.experiment.Experiment` (:class:`GranularityExperiment`):
its rows of the lab's knobs and gates tables and its sentence of the description."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
import torch

from creditlab.errors import InputError
from creditlab.lab.experiment import Experiment
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.report import group_means, paired_diff, sort_in_order
from creditlab.lab.runner import Cell
from creditlab.labs._toolshop import fresh_dump
from creditlab.labs.granularity.config import ARMS, MULTI_TYPES, TASK_TYPES, GranularityConfig
from creditlab.labs.granularity.world import batch_stats, evaluate_types, process_scores
from creditlab.train.opsd import train_opsd
from creditlab.train.toolshop_base import BaseConfig, base_policy
from creditlab.train.toolshop_grpo import GRPOConfig, make_advantage, train_grpo
from creditlab.train.toolshop_rollout import RolloutBatch

# --------------------------------------------------------------------------------------------
# experiments


class GranularityExperiment(Experiment):
    """An experiment of the granularity lab: besides its cells, tables, plots, readings and predictions
    (:class:`~creditlab.lab.experiment.Prediction` s, judged in the lab's predictions table), its rows of the
    lab's ``knobs`` and ``gates`` tables and its sentence of the lab's description."""

    gate_reading: ClassVar[str] = ""
    """What its gate measures (its part of the gates table's reading; empty: it has no gate)."""
    gate_knob: ClassVar[str] = ""
    """Its gate's threshold (its part of the knobs table's ``gates`` row)."""

    def describe(self, cfg: GranularityConfig) -> str:
        """Its sentence of the lab's description when a run selects it."""
        return ""

    def knob_rows(self, cfg: GranularityConfig) -> list[tuple[str, str, str]]:
        """Its knobs: (knob, value in ``cfg``, why)."""
        return []

    def gate_rows(self, gates: pd.DataFrame, cfg: GranularityConfig) -> list[dict[str, Any]]:
        """Its rows of the gates table, from the rows of every gate cell of the run."""
        return []


# --------------------------------------------------------------------------------------------
# the training run of a cell


def run_config(cfg: GranularityConfig) -> dict[str, Any]:
    """The config of a regime experiment's run cell: the identity of ``cfg`` without the count of seeds
    and the list of repeats. A cell computes one seed (and one repeat): neither changes its rows, so
    they stay out of its key, and a run with more seeds reuses the cells of the first."""
    return {k: v for k, v in cfg.identity().items() if k not in ("seeds", "repeats")}


#: Where a cell's base policy, training and held-out task types come from: ``default`` (the lab's
#: arms), ``multi``, ``warm``, ``sweep`` (the repeat sweep, on the lab's base policy), and the two
#: action budgets of experiment budget on the short type: ``budget`` (``budget_turns``) and
#: ``budget_c2`` (C + 2), both in a ``budget_max_len`` context.
SETTINGS = ("default", "multi", "warm", "sweep", "budget", "budget_c2")


def setting_of(cfg: GranularityConfig, setting: str) -> tuple[BaseConfig, GRPOConfig, dict[str, tuple[int, ...]]]:
    """The base policy config, training config and held-out task types of ``setting``."""
    if setting == "multi":
        return cfg.multi_base, cfg.multi_grpo(), MULTI_TYPES
    if setting == "warm":
        return cfg.warm_base, cfg.grpo, TASK_TYPES
    if setting in ("default", "sweep"):
        return cfg.base, cfg.grpo, TASK_TYPES
    if setting in ("budget", "budget_c2"):
        g = replace(cfg.grpo, chain_lengths=TASK_TYPES["short"], max_len=cfg.budget_max_len,
                    max_turns=cfg.budget_turns if setting == "budget" else None)
        return cfg.budget_base, g, {"short": TASK_TYPES["short"]}
    raise InputError(f"setting: {setting!r} is not one of {SETTINGS}")


def gated_runs(cfg: GranularityConfig, name: str, gate_fn: Callable[..., list[dict]], arms: tuple[str, ...]
               ) -> list[Cell]:
    """The cells of a regime experiment with a gate: its gate (group ``gates``, measured before any run), then
    every arm of ``arms`` at each seed, trained in the experiment's own setting ``name``."""
    own = run_config(cfg)
    gate = Cell("gates", name, gate_fn, {"config": cfg.identity(), "gate": name}, cfg.context())
    return [gate, *(Cell(name, f"{arm}/seed={s}", run_arm, {"config": own, "arm": arm, "seed": s, "setting": name},
                         cfg.context(dump=True))
                    for s in range(cfg.seeds) for arm in arms)]


def dump_name(arm: str, seed: int, setting: str = "default", repeat: float | None = None) -> str:
    """The name of one training run's dump file (its one spelling: the run writes it, the arms'
    ``diagnose`` table reads it)."""
    if setting == "default":
        return f"granularity-{arm}-seed={seed}.jsonl"
    tag = f"-repeat={repeat:g}" if setting == "sweep" else ""
    return f"granularity-{setting}-{arm}{tag}-seed={seed}.jsonl"


def run_arm(config: dict, arm: str, seed: int, cache_dir: str, dump_dir: str | None = None,
            setting: str = "default", repeat: float | None = None) -> list[dict]:
    """One training run (a cell): ``arm`` from the cached base policy of ``setting``
    (:func:`setting_of`) with ``seed``, the process reward scoring a repeated read ``repeat``
    (default: the config's). Rows: one per update (training statistics of that update's rollouts,
    ``kind = "train"``) and one per evaluation point (held-out statistics per task type,
    ``kind = "eval"``); a ``sweep`` run also gets the verdict of ``creditlab diagnose``'s
    ``reward.process_hacking`` check on its own dump (``kind = "verdict"``; the dump goes to
    ``dump_dir``, or to a temporary file)."""
    import copy
    import tempfile

    cfg = GranularityConfig.from_dict(config)
    if repeat is not None:
        cfg = replace(cfg, repeat=float(repeat))
    base_cfg, grpo, types = setting_of(cfg, setting)
    model = base_policy(base_cfg, cache_dir=cache_dir)
    g = replace(grpo, seed=seed, eval_every=0)
    kind, what = ARMS[arm]
    extra: dict[int, dict[str, float]] = {}
    tmp = tempfile.TemporaryDirectory() if setting == "sweep" and not dump_dir else None
    where = tmp.name if tmp is not None else dump_dir
    path = fresh_dump(where, dump_name(arm, seed, setting, cfg.repeat)) if where else None
    evals: list[dict] = []
    scored: dict = {}  # the last batch on_rollouts scored, and its process scores

    def on_rollouts(k, batch, rewards, old):
        if k % cfg.grpo.eval_every == 0:
            evals.append({"kind": "eval", "update": float(k), **evaluate_types(model, cfg, types, grpo)})
        proc = process_scores(batch, cfg.repeat)
        scored.update(batch=batch, proc=proc)
        extra[k] = batch_stats(batch, cfg.repeat, proc)
        if path is not None:
            from creditlab.train.toolshop_dump import dump_rollouts

            dump_rollouts(batch, rewards, k, path, logprobs=old, process_scores=proc)

    if kind == "opsd":
        teacher = copy.deepcopy(model)
        rows = train_opsd(model, teacher, g, what, beta=cfg.beta, on_rollouts=on_rollouts)
    else:
        def scores(b: RolloutBatch) -> torch.Tensor:  # this update's, scored once in on_rollouts
            return scored["proc"] if scored.get("batch") is b else process_scores(b, cfg.repeat)

        # the registered ``prm`` geometry with the arm's schedule, as a trainer integration runs it
        adv = (make_advantage("prm", conserve=False, step_scores=scores, lam=cfg.schedule(arm))
               if kind == "prm" else None)
        rows = train_grpo(model, g, advantage=adv, on_rollouts=on_rollouts)
    evals.append({"kind": "eval", "update": float(g.updates), **evaluate_types(model, cfg, types, grpo)})
    keep = ("update", "grad_norm", "grad/clipped", "loss/", "opsd/", "episode/policy_tokens", "time/update_s",
            "adv/abs_mean")
    out = []
    for r in rows:
        k = int(r["update"])
        used = {"lam": r["adv/lam"]} if "adv/lam" in r else {}  # the weight the trainer used
        out.append({"kind": "train", **{n: v for n, v in r.items() if n.startswith(keep)}, **extra[k], **used})
    if setting == "sweep":
        out.append({"kind": "verdict", **_hacking_verdict(path)})
    if tmp is not None:
        tmp.cleanup()
    tag = {"repeat": cfg.repeat} if setting == "sweep" else {}
    return [{"arm": arm, "seed": seed, **tag, **r} for r in out + evals]


def _hacking_verdict(path: Path) -> dict:
    """The ``reward.process_hacking`` check of ``creditlab diagnose`` on one dump."""
    from creditlab.diagnose.checks import run_checks
    from creditlab.diagnose.readers import read_dump

    (r,) = run_checks(read_dump([path]), only=("reward.process_hacking",))
    return {"status": r.status, "value": math.nan if r.value is None else float(r.value), "message": r.message}


# --------------------------------------------------------------------------------------------
# tables


def _ordered(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Sorted by ``by``, arms in the order of :data:`ARMS`, task types in that of :data:`TASK_TYPES`."""
    return sort_in_order(df, by, {"arm": ARMS, "type": ("all", *MULTI_TYPES)})


EVAL_METRICS = ("success", "truncation", "tool_calls", "turns_success", "mixing", "good_share", "process",
                "response_tokens")


def _summary(df: pd.DataFrame, types: dict[str, tuple[int, ...]] = TASK_TYPES) -> pd.DataFrame:
    """One row per arm, seed and task type: the final held-out statistics, and the base policy's."""
    ev = df[df["kind"] == "eval"]
    rows = []
    for (arm, seed), g in ev.groupby(["arm", "seed"], sort=False):
        last = g[g["update"] == g["update"].max()].iloc[0]
        first = g[g["update"] == g["update"].min()].iloc[0]
        for t in ("all", *types):
            pre = "eval/" if t == "all" else f"eval/{t}/"
            row = {"arm": arm, "seed": int(seed), "type": t}
            row.update({m: last.get(pre + m, math.nan) for m in EVAL_METRICS})
            row["base_success"] = first.get(pre + "success", math.nan)
            row["gain"] = row["success"] - row["base_success"]
            rows.append(row)
    return _ordered(pd.DataFrame(rows), ["arm", "seed", "type"])


def _means(summary: pd.DataFrame) -> pd.DataFrame:
    means = group_means(summary, ["arm", "type"], [("success", UNIT), ("gain", DIFF), ("truncation", UNIT)],
                        ("tool_calls", "turns_success", "mixing"))
    return _ordered(means, ["arm", "type"])


def _diffs(summary: pd.DataFrame) -> pd.DataFrame:
    if "grpo" not in set(summary["arm"]):
        return pd.DataFrame()
    out = []
    for a in [a for a in ARMS if a != "grpo" and a in set(summary["arm"])]:
        merged = None
        for m in ("success", "truncation"):
            d = paired_diff(summary, a, "grpo", ["type"], m, bounds=DIFF).rename(
                columns={"mean": m, "lo": f"{m}_lo", "hi": f"{m}_hi"})
            merged = d if merged is None else merged.merge(d.drop(columns=["n"]), on=["diff", "type"])
        out.append(merged)
    res = pd.concat(out, ignore_index=True)
    return _ordered(res[["diff", "type", "success", "success_lo", "success_hi", "truncation", "truncation_lo",
                         "truncation_hi", "n"]], ["diff", "type"])


def _opsd(df: pd.DataFrame, U: int) -> pd.DataFrame:
    tr = df[(df["kind"] == "train") & df["arm"].isin(["opsd_ref", "opsd_advice", "grpo"])]
    rows = []
    for arm, g in tr.groupby("arm", sort=False):
        per_seed = g.groupby("seed")
        row = {"arm": arm, "updates": U}
        for c, name in (("opsd/reverse_kl", "reverse_kl"), ("opsd/forward_kl", "forward_kl"),
                        ("grad_norm", "grad_norm"), ("opsd/kl_top_share", "kl_top5_share"),
                        ("opsd/kl_top_token_share", "kl_top5_token_share")):
            row[name] = float(g[c].mean()) if c in g.columns and g[c].notna().any() else math.nan
        if "grad/clipped" in g.columns and g["grad/clipped"].notna().any():
            row["clipped_updates"] = float(per_seed["grad/clipped"].apply(lambda v: float((v > 0).sum())).mean())
        else:
            row["clipped_updates"] = math.nan
        first = g[g["update"] < U / 5]["response_tokens"].mean()
        last = g[g["update"] >= U - U / 5]["response_tokens"].mean()
        row.update({"response_tokens_early": first, "response_tokens_late": last})
        rows.append(row)
    return _ordered(pd.DataFrame(rows), ["arm"])


CURVE_COLUMNS = ("success", "process", "truncation", "tool_calls", "response_tokens", "lam", "grad_norm",
                 "grad/clipped", "opsd/reverse_kl", "opsd/forward_kl", "opsd/kl_top_share",
                 "opsd/kl_top_token_share", "loss/opsd", "short/success", "long/success", "short/truncation",
                 "long/truncation", "short/mixing", "long/mixing")


def _curves(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    tr = df[df["kind"] == "train"]
    cols = by + ["update"] + [c for c in (*CURVE_COLUMNS, "multi/success", "multi/truncation", "multi/mixing")
                              if c in tr.columns]
    return tr[cols].sort_values(by + ["update"]).reset_index(drop=True)


# --------------------------------------------------------------------------------------------
# labels, plots, readings

LABELS = {"grpo": "GRPO", "prm_fixed": "PRM fixed λ", "prm_decay": "PRM decayed λ", "opsd_ref": "OPSD ref-answer",
          "opsd_advice": "OPSD turn-advice"}
UNIT, DIFF = (0.0, 1.0), (-1.0, 1.0)
COLORS = {"grpo": "black", "prm_fixed": "tab:red", "prm_decay": "tab:green", "opsd_ref": "tab:blue",
          "opsd_advice": "tab:purple"}


def _line(ax, g: pd.DataFrame, col: str, color: str, label: str, style: str = "-") -> None:
    s = g.dropna(subset=[col]).groupby("update")[col]
    x = s.mean().index.to_numpy()
    ax.plot(x, s.mean().to_numpy(), style, color=color, label=label, lw=1.4)
    if s.size().min() > 1:
        ax.fill_between(x, s.min().to_numpy(), s.max().to_numpy(), color=color, alpha=0.1)


def _plot_opsd(curves: pd.DataFrame, cfg: GranularityConfig, out: Path, name: str = "granularity_opsd.png") -> Path:
    fig, axes = new_figure(1, 3, figsize=(14, 3.8))
    for arm in [a for a in ("grpo", "opsd_ref", "opsd_advice") if a in set(curves["arm"])]:
        g = curves[curves["arm"] == arm]
        if arm != "grpo":
            _line(axes[0], g, "opsd/reverse_kl", COLORS[arm], LABELS[arm])
        _line(axes[1], g, "grad_norm", COLORS[arm], LABELS[arm])
        _line(axes[2], g, "response_tokens", COLORS[arm], LABELS[arm])
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[1].axhline(cfg.grpo.grad_clip, color="gray", lw=0.8, ls="--")
    for ax, title in zip(axes, ("KL(student || teacher) per token", "gradient norm (before clipping)",
                                "policy tokens per episode"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("update")
        ax.legend(fontsize=8)
    return save(fig, out / name)


def _read_teachers(t: pd.DataFrame) -> str:
    d = t[t["type"] == "all"].set_index(["teacher", "placebo"])
    parts = []
    for kind, label in (("ref", "reference-answer"), ("advice", "turn-advice")):
        if (kind, False) in d.index:
            r, p = d.loc[(kind, False)], d.loc[(kind, True)]
            v = {n: float(r.get(n, math.nan)) for n in ("gap_good", "gap_bad", "preference")}
            parts.append(f"{label}: KL {r['reverse_kl']:.3g} per token (placebo {p['reverse_kl']:.3g}), teacher - "
                         f"student log-prob on good-turn tokens {v['gap_good']:+.3g} and bad-turn tokens "
                         f"{v['gap_bad']:+.3g}, preference {v['preference']:+.3g} (placebo "
                         f"{float(p.get('preference', math.nan)):+.3g})")
    return ("Before any training, on the base policy's own held-out rollouts: KL(student || teacher) per policy "
            "token, and the teacher-minus-student log-prob of the sampled tokens of good and of bad turns; "
            "preference = good - bad. The placebo puts another task's privileged tokens in the same place: a "
            "teacher whose preference is no larger than its placebo's is not using what it was told, and its "
            "KL is only the disturbance of an unfamiliar context. " + "; ".join(parts) + ".")
