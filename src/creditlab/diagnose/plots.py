"""The PNGs of a diagnosis, one per check that has a series to show.

Figures are ``matplotlib.figure.Figure`` objects rendered by the Agg canvas: no pyplot, no backend
selection, no global matplotlib state (a library must not change process-wide settings).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

from creditlab.diagnose.calibration import calibration
from creditlab.diagnose.checks import TURN_MIN_TOKENS, UNIT_WORDS, CheckResult

__all__ = ["PHASE_PLOTS", "PLOTS", "plot_phase", "plot_result"]


def _figure(figsize: tuple[float, float] = (7, 4.2)):
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.subplots()


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    return path


def _steps_axis(ax) -> None:
    ax.set_xlabel("training step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _thresholds(ax, r: CheckResult) -> None:
    for level, color in (("warn", "#d9a400"), ("fail", "#c0392b")):
        v = getattr(r.threshold, level)
        if v is not None and v > 0:
            ax.axhline(v, color=color, lw=1, ls=":", label=f"{level} threshold")


def _legend_of_both(ax, bx=None) -> None:
    """One legend for the lines of ``ax`` and of its twin axis ``bx`` (None: no twin)."""
    lines = list(ax.get_lines()) + (list(bx.get_lines()) if bx is not None else [])
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="best")


def _k3(r: CheckResult, path: Path) -> Path:
    s = r.series
    fig, ax = _figure()
    y = np.asarray(s["k3"], dtype=float)
    floor = 1e-16
    ax.plot(s["steps"], np.maximum(y, floor), marker="o", ms=3, color="#1f77b4", label="K3 per policy token")
    ax.set_yscale("log")
    _thresholds(ax, r)
    _steps_axis(ax)
    ax.set_ylabel("K3(engine || learner)")
    ax.set_title(f"Execution mismatch over steps ({r.status})")
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _prefix(r: CheckResult, path: Path) -> Path:
    s = r.series
    n = np.asarray(s["tokens"])
    keep = n >= TURN_MIN_TOKENS  # the turns the check reads
    t = np.asarray(s["turn"])[keep]
    fig = Figure(figsize=(9, 4.2), layout="constrained")
    ax, bx = fig.subplots(1, 2)
    ax.plot(t, np.asarray(s["prefix_rms"])[keep], marker="o", color="#c0392b", label="prefix E_t (RMS)")
    ax.plot(t, np.asarray(s["current_rms"])[keep], marker="o", color="#1f77b4", label="current delta_t (RMS)")
    _thresholds(ax, r)
    ax.set_xlabel("turn")
    ax.set_ylabel("log ratio, nats (RMS)")
    ax.set_title(f"Prefix vs current log ratio by turn ({TURN_MIN_TOKENS}+ tokens)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    bx.plot(t, np.asarray(s["prefix_mean"])[keep], marker="o", color="#c0392b", label="prefix (mean)")
    bx.plot(t, np.asarray(s["current_mean"])[keep], marker="o", color="#1f77b4", label="current (mean)")
    bx.axhline(0, color="grey", lw=0.8)
    for a in (ax, bx):
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    bx.set_xlabel("turn")
    bx.set_ylabel("log ratio, nats (mean)")
    bx.set_title("Signed mean (learner - engine)")
    bx.legend(fontsize=8)
    bx.grid(alpha=0.3)
    hidden = s.get("not_drawn")  # (turns, first, last, --max-turns): turns the value reads, not drawn
    note = ""
    if hidden:
        k, a, b, m = hidden
        note = (f"; {k} later turn{'s' if k > 1 else ''} ({a}-{b}) not drawn (--max-turns {m}), the value reads "
                "them")
    fig.suptitle(f"mismatch.prefix_drift ({r.status}){note}", fontsize=10)
    return _save(fig, path)


def _quartiles(r: CheckResult, path: Path) -> Path:
    s = r.series
    fig, ax = _figure()
    x = np.arange(len(s["prod_med"]))
    labels = [f"{lo:.0f}-{hi:.0f}" for lo, hi in zip(s["lo"], s["hi"], strict=True)]
    for name, color, dx, label in (("prod", "#c0392b", -0.08, "product exp(sum delta)"),
                                   ("geo", "#1f77b4", 0.08, "geometric exp(mean delta)")):
        med, lo, hi = (np.asarray(s[f"{name}_{k}"]) for k in ("med", "q25", "q75"))
        ax.errorbar(x + dx, med, yerr=[med - lo, hi - med], fmt="o-", color=color, capsize=4, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    for v, color in ((r.threshold.warn, "#d9a400"), (r.threshold.fail, "#c0392b")):
        if v is not None:
            for y in (np.exp(v), np.exp(-v)):
                ax.axhline(y, color=color, lw=1, ls=":")
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    ticks = [t for t in (1e-3, 0.01, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 4, 10, 100, 1e3) if lo <= t <= hi]
    ax.set_yticks(ticks)
    ax.set_ylim(lo, hi)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(x, labels)
    ax.set_xlabel("response length quartile (policy tokens)")
    ax.set_ylabel("sequence weight (median, 25-75%)")
    ax.set_title(f"Sequence weight by length ({r.status}); dotted: exp(+-threshold)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, path)


def _over_steps(r: CheckResult, path: Path, title: str, left: tuple[str, tuple], right: tuple[str, tuple]) -> Path:
    """Series of ``r`` over training steps on two axes: ``left`` / ``right`` are ``(y label, lines)``, each
    line ``(series key, label, plot style)``; a line whose series the check has not got is left out, and so
    is the right axis when none of its lines is there."""
    s = r.series
    fig, ax = _figure()
    axes = {"left": ax, "right": None}
    for side, (ylabel, lines) in (("left", left), ("right", right)):
        drawn = [(key, label, style) for key, label, style in lines if key in s]
        if not drawn:
            continue
        target = axes[side] = axes[side] or ax.twinx()
        for key, label, style in drawn:
            target.plot(s["steps"], s[key], label=label, **style)
        target.set_ylabel(ylabel)
    _steps_axis(ax)
    _legend_of_both(ax, axes["right"])
    ax.set_title(f"{title} ({r.status})")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _length(r: CheckResult, path: Path) -> Path:
    dot = {"marker": "o", "ms": 3}
    return _over_steps(
        r, path, "Length and reward over steps",
        (f"mean response length ({r.series.get('unit', '')})",
         (("length", "response length", {**dot, "color": "#2c3e50"}),)),
        ("mean reward / precision",
         (("reward", "reward", {"marker": "s", "ms": 3, "color": "#27ae60"}),
          ("precision", "precision", {"marker": "^", "ms": 3, "ls": "--", "color": "#8e44ad"}))))


def _process(r: CheckResult, path: Path) -> Path:
    return _over_steps(
        r, path, "Process vs outcome reward over steps",
        ("mean reward",
         (("process", "process reward", {"marker": "o", "ms": 3, "color": "#e67e22"}),
          ("outcome", "outcome reward", {"marker": "s", "ms": 3, "color": "#27ae60"}))),
        ("tool calls / truncation rate",
         (("tool_calls", "tool calls", {"ls": "--", "color": "#7f8c8d"}),
          ("truncated", "truncation rate", {"ls": ":", "color": "#34495e"}))))


def _degenerate(r: CheckResult, path: Path) -> Path:
    s = r.series
    fig, ax = _figure()
    ax.plot(s["steps"], s["share"], marker="o", ms=3, color="#8e44ad", label="zero-variance groups")
    _thresholds(ax, r)
    ax.set_ylim(-0.02, 1.02)
    _steps_axis(ax)
    ax.set_ylabel("share of groups")
    ax.set_title(f"Groups with all rewards equal ({r.status})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


PLOTS: dict[str, tuple[str, Callable[[CheckResult, Path], Path]]] = {
    "mismatch.k3": ("k3_over_steps.png", _k3),
    "mismatch.prefix_drift": ("prefix_by_turn.png", _prefix),
    "mismatch.sequence_ratio_length": ("weight_by_length_quartile.png", _quartiles),
    "reward.length_hacking": ("length_reward_over_steps.png", _length),
    "reward.process_hacking": ("process_outcome_over_steps.png", _process),
    "baseline.degenerate_groups": ("degenerate_groups_over_steps.png", _degenerate),
}
"""Check id -> (file name, drawing function)."""


def plot_result(r: CheckResult, out: Path) -> Path | None:
    """Draw the plot of ``r`` into ``out`` (None for a skipped check or one without a plot)."""
    if r.status == "skipped" or r.id not in PLOTS or not r.series:
        return None
    name, fn = PLOTS[r.id]
    return fn(r, Path(out) / name)


PHASE_PLOTS = {"mismatch.prefix_drift": "phase_map_prefix_drift.png",
               "mismatch.sequence_ratio_length": "phase_map_sequence_ratio.png"}
"""Calibrated check id -> the file of its phase-map plot (:func:`plot_phase`)."""
_CLASS_COLORS = {"rolls back": "#c0392b", "stable": "#27ae60", "mixed": "#d9a400"}
_WORLD_MARKS = ("o", "s", "^", "D")


def plot_phase(r: CheckResult, out: Path) -> Path | None:
    """Where this dump sits on the transfer run's phase map: the run's points (x: the check's unit at the base
    policy, y: the rollback of training, mean and 95% interval over seeds; colour: rolls back / stable / mixed;
    marker: the world), the measured thresholds, and this dump's value (a vertical line; outside the measured
    domain, dashed). The unit is the calibration's for the check, else the prefix drift's statistic (total).
    None without a calibration, a point or a value for this dump."""
    cal = calibration()
    units = r.details.get("units") if r.details else None
    if cal is None or r.id not in PHASE_PLOTS or not cal.points or not units:
        return None
    t = cal.thresholds.get(r.id)
    unit = t.unit if t is not None else ("seq_ratio" if r.id == "mismatch.sequence_ratio_length" else "total")
    mine = units.get(unit)
    pts = [p for p in cal.points if p.get(unit) is not None and p[unit] > 0]
    if mine is None or not np.isfinite(mine) or not pts:
        return None
    fig, ax = _figure((7, 4.2))
    worlds = list(cal.worlds)
    for p in pts:
        lo, hi = p["rollback_lo"], p["rollback_hi"]
        yerr = None if lo is None or hi is None else [[max(p["rollback"] - lo, 0)], [max(hi - p["rollback"], 0)]]
        ax.errorbar(p[unit], p["rollback"], yerr=yerr, fmt=_WORLD_MARKS[worlds.index(p["world"]) % 4],
                    color=_CLASS_COLORS.get(p["class"], "gray"), capsize=2, alpha=0.85)
        ax.annotate(f"{p['arm']}@{p['dose']}", (p[unit], p["rollback"]), fontsize=6, alpha=0.7,
                    xytext=(3, 3), textcoords="offset points")
    if t is not None:
        for level, color in (("warn", "#d9a400"), ("fail", "#c0392b")):
            ax.axvline(getattr(t, level), color=color, lw=1, ls=":", label=f"{level} threshold")
    inside = r.details.get("in_domain", True)
    ax.axvline(mine, color="#2c3e50", lw=1.6, ls="-" if inside else "--",
               label=f"this dump: {mine:.3g}" + ("" if inside else " (outside the measured domain)"))
    for w, m in zip(worlds, _WORLD_MARKS, strict=False):
        ax.plot([], [], m, color="gray", ls="", label=w)
    for k, c in _CLASS_COLORS.items():
        ax.plot([], [], "o", color=c, ls="", label=k)
    if min(p[unit] for p in pts) > 0 and mine > 0:
        ax.set_xscale("log")
    ax.set_xlabel(f"{UNIT_WORDS[unit]} at the base policy")
    ax.set_ylabel("rollback (best - final held-out success)")
    verdict = "calibrated" if t is not None else "no calibrated verdict"
    ax.set_title(f"{r.id} on the transfer run's phase map ({verdict}; {r.status})", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    return _save(fig, Path(out) / PHASE_PLOTS[r.id])
