"""Live checks: ``creditlab diagnose``'s batch checks on every training step, in the trainer's own metrics.

Each step the integrations compute the values of the checks that one training batch can answer
(:data:`LIVE_CHECKS`) with :func:`batch_values`, on the batch's device and without a host read
(:func:`creditlab.core.diagnostics.batch_check_values`); the trainer reads them with its other
metrics of the step. The metric of check ``mismatch.k3`` is ``creditlab/mismatch/k3`` (the check id with
``/`` for ``.``; verl puts its ``rollout_corr/`` before it); ``mismatch.prefix_drift`` also logs the RMS
at the first counted turn, ``creditlab/mismatch/prefix_drift/first_turn``, to read its growth by,
and every step carries ``creditlab/mismatch/trajectory_ess`` (the trajectory ESS share of the batch's sequence
ratios, a candidate unit of the mismatch lab's transfer experiment, ``mismatch.prefix_drift``'s ``details.units``).

:class:`LiveWarnings` reads the values once they are numbers and logs one warning line when a check
crosses its warn threshold (the check registry's :class:`~creditlab.diagnose.checks.Threshold`, so the
same numbers as ``creditlab diagnose``), naming the check and its fix: once per run and check, and
again only after the value has gone back below the threshold.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from creditlab.core.diagnostics import batch_check_values
from creditlab.diagnose.calibration import calibration
from creditlab.diagnose.checks import CHECK_PARAMS, CHECKS, format_value

__all__ = ["FIRST_TURN", "LIVE_CHECKS", "PREFIX", "TRAJECTORY_ESS", "LiveWarnings", "batch_values", "metric_name",
           "to_floats"]

LOG = logging.getLogger("creditlab.integrations")
PREFIX = "creditlab/"
#: The checks whose values one training batch gives, in report order.
LIVE_CHECKS = ("mismatch.k3", "mismatch.prefix_drift", "mismatch.one_sided", "mismatch.placeholder_logprobs",
               "mismatch.nonfinite_logprobs", "mismatch.sequence_ratio_length", "baseline.degenerate_groups")
FIRST_TURN = "/first_turn"
#: The live value beside the checks': the trajectory ESS share of the batch's sequence ratios.
TRAJECTORY_ESS = "mismatch/trajectory_ess"
#: The transfer experiment's candidate units -> their key among batch_check_values' values.
UNIT_KEYS = {"total": "mismatch/prefix_drift", "per_token": "mismatch/k3", "ess": TRAJECTORY_ESS}


def metric_name(check_id: str, prefix: str = PREFIX) -> str:
    """``creditlab/mismatch/k3`` for ``mismatch.k3``."""
    return prefix + check_id.replace(".", "/")


def batch_values(old_logprobs: torch.Tensor | None, rollout_logprobs: torch.Tensor | None,
                 policy_mask: torch.Tensor, *, group_ids: torch.Tensor | None = None,
                 rewards: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The live check values of one padded batch as 0-dim tensors keyed by metric name (no host read).

    Without both log-prob tensors only ``baseline.degenerate_groups`` is computed (it needs
    ``group_ids`` and ``rewards``); a value a batch cannot give (e.g. the prefix drift of one-turn
    rollouts) is NaN.
    """
    if old_logprobs is None or rollout_logprobs is None:
        if group_ids is None or rewards is None:
            return {}
        zeros = torch.zeros(policy_mask.shape, dtype=torch.float32, device=policy_mask.device)
        values = batch_check_values(zeros, zeros, policy_mask.bool(), CHECK_PARAMS, group_ids=group_ids,
                                    rewards=rewards)
        return {metric_name("baseline.degenerate_groups"): values["baseline/degenerate_groups"]}
    values = batch_check_values(old_logprobs, rollout_logprobs, policy_mask.bool(), CHECK_PARAMS,
                                group_ids=group_ids, rewards=rewards)
    cal = calibration()
    unit = cal.thresholds.get("mismatch.prefix_drift") if cal is not None else None
    if unit is not None:  # the check's value is in the calibrated unit, as the dump check's
        values["mismatch/prefix_drift"] = values[UNIT_KEYS[unit.unit]]
    return {PREFIX + k: v for k, v in values.items()}


def to_floats(values: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """All values in one host read (NaN kept)."""
    if not values:
        return {}
    dev = next(iter(values.values())).device
    flat = torch.stack([v.detach().to(device=dev, dtype=torch.float64).reshape(()) for v in values.values()]).tolist()
    return dict(zip(values.keys(), flat, strict=True))


def _crossed(check_id: str, value: float) -> bool:
    """Whether ``value`` is at the warn level of the check's threshold (a threshold without a warn level,
    "warn when any is": above 0)."""
    th = CHECKS[check_id].threshold
    if th.warn is None and th.fail is None:  # no calibrated verdict (status info): nothing to cross
        return False
    if th.warn is None:
        return value > 0 if th.direction == "above" else value < 0
    return th.level(value) in ("warn", "fail")  # the check's own rule, measured or reasoned


class LiveWarnings:
    """One warning line per crossing of a live check's warn threshold, for one training run.

    ``observe(metrics, step)`` reads the live values in a step's metrics (floats, under ``prefix``): a
    check whose value crosses its warn threshold logs one line (``creditlab.integrations`` logger,
    level WARNING) naming the check, the value, the threshold and the fix; it stays quiet while the
    value stays there, and warns again only after a step below the threshold. Missing or NaN values
    change nothing. Returns the lines logged.
    """

    def __init__(self, prefix: str = PREFIX, logger: logging.Logger | None = None):
        self.prefix = prefix
        self.logger = logger or LOG
        self.active: set[str] = set()

    def observe(self, metrics: Mapping[str, Any], step: int | None = None) -> list[str]:
        lines = []
        for cid in LIVE_CHECKS:
            v = metrics.get(metric_name(cid, self.prefix))
            if v is None:
                continue
            v = float(v)
            if not math.isfinite(v):
                continue
            if not _crossed(cid, v):
                self.active.discard(cid)
                continue
            if cid in self.active:
                continue
            self.active.add(cid)
            check = CHECKS[cid]
            at = f" at step {step}" if step is not None else ""
            line = (f"creditlab: {cid} crossed its warn threshold{at}: {check.title} is {format_value(v)} "
                    f"({check.threshold.text()}). Fix: {check.fix}")
            self.logger.warning(line)
            lines.append(line)
        return lines
