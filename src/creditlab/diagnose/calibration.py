"""Where ``creditlab diagnose``'s measured thresholds come from, and the domain they were measured on.

The mismatch lab's transfer run (``creditlab lab mismatch --protocol transfer``, docs/diagnose.md, "The transfer
experiment") puts the prefix mismatch of two worlds (trajectories of about 200 and 300 policy tokens) against
the rollback of training, and its registered rule (T1) picks the unit, if any, in which one threshold separates
the points that roll back from those that do not in both worlds. ``calibration.json`` beside this module holds
what the checks need from that run: the rule's verdict, the picked unit, the thresholds taken exactly as
measured, the domain (policy tokens per trajectory and turns the gate measured) and the phase map's points (for
the report's plot). It is written from the run's committed tables by ``python scripts/diagnose_calibration.py``
(tests/test_diagnose_calibration.py holds it to them), never by hand.

Without the file (a run not finished yet) :func:`calibration` returns None and the checks keep the 2-core run's
thresholds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["CALIBRATION_FILE", "Calibration", "MeasuredThreshold", "calibration", "load_calibration"]

CALIBRATION_FILE = Path(__file__).with_name("calibration.json")


@dataclass(frozen=True)
class MeasuredThreshold:
    """One check's thresholds, as the rule took them: ``warn`` the worst value of a point that did not roll back
    (a value beyond it warns), ``fail`` the best value of one that did (a value at it fails), in ``unit``."""

    unit: str
    warn: float
    fail: float
    direction: str  # "above": larger is worse; "below": smaller is worse


@dataclass(frozen=True)
class Calibration:
    run: str
    manifest: dict[str, Any]
    verdict: str
    """T1's verdict: ``holds``, ``fails`` or ``not judged``."""
    unit: str | None
    """The picked unit (``total``, ``per_token``, ``ess``), None when T1 does not hold."""
    thresholds: dict[str, MeasuredThreshold | None]
    worlds: tuple[str, ...]
    policy_tokens: tuple[float, float]
    turns: tuple[float, float]
    points: tuple[dict[str, Any], ...] = field(default=())
    why: str = ""
    """Why there is no calibrated verdict (T1 not holding), in one clause; empty when T1 holds."""

    def domain(self) -> dict[str, Any]:
        """What the thresholds were measured on, for ``details.domain``."""
        return {"worlds": list(self.worlds), "policy_tokens_per_trajectory": list(self.policy_tokens),
                "turns": list(self.turns), "run": self.run, "manifest": self.manifest}

    def in_domain(self, policy_tokens: float, turns: float) -> bool:
        """Whether a dump's mean policy tokens per trajectory and mean turns lie inside the measured ranges."""
        lo, hi = self.policy_tokens
        tlo, thi = self.turns
        return bool(math.isfinite(policy_tokens) and math.isfinite(turns) and lo <= policy_tokens <= hi
                    and tlo <= turns <= thi)

    def outside(self, policy_tokens: float, turns: float) -> str:
        """The sentence that says a dump is outside the domain (empty inside it)."""
        if self.in_domain(policy_tokens, turns):
            return ""
        lo, hi = self.policy_tokens
        tlo, thi = self.turns
        return (f"This dump lies outside the calibration's domain ({policy_tokens:,.0f} policy tokens and "
                f"{turns:.1f} turns per trajectory; measured on {lo:,.0f}-{hi:,.0f} and {tlo:.1f}-{thi:.1f}, "
                f"{self.run}): the verdict extrapolates, so it warns at most.")


def load_calibration(path: Path | str) -> Calibration:
    """A :class:`Calibration` from the JSON ``scripts/diagnose_calibration.py`` writes."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    th = {cid: (MeasuredThreshold(**t) if t is not None else None) for cid, t in raw["thresholds"].items()}
    return Calibration(run=raw["run"], manifest=raw["manifest"], verdict=raw["verdict"], unit=raw["unit"],
                       thresholds=th, worlds=tuple(raw["worlds"]), policy_tokens=tuple(raw["policy_tokens"]),
                       turns=tuple(raw["turns"]), points=tuple(raw["points"]), why=raw.get("why", ""))


@cache
def calibration() -> Calibration | None:
    """The package's calibration (``calibration.json``), None while the transfer run has not written one."""
    return load_calibration(CALIBRATION_FILE) if CALIBRATION_FILE.is_file() else None
