"""FORK reward math: unit-level precision, signed rubric recall and their F-beta.

Rubric rewards are recall ("is what should be there, there?"); FORK adds precision ("how much of
what is there should be?") at the level of sentence-sized *units* of the response.

Batched over ragged inputs as padded tensors with masks. ``B`` responses, ``J`` rubric slots,
``U`` unit slots; ``rubric_mask (B, J)`` and ``unit_mask (B, U)`` say which slots are real, and
values at padded positions are ignored (junk there changes nothing).

For one response with rubrics ``(r_j, w_j)`` and units ``u_1..u_n``:

* matching ``m_ji = 1[unit i contributes to rubric j]``, ``K_j = sum_i m_ji``;
  credit split ``a_ji = m_ji / K_j`` (0 when ``K_j = 0``); unit credit ``c_i = sum_j a_ji`` over
  the *positive* rubrics (a unit that matches a pitfall rubric earns nothing for it). K
  paraphrases of one rubric get ``1/K`` each; a unit serving several rubrics accumulates credit.
* necessity ``N_i = 1[c_i >= tau]`` with ``tau > 0``, so a unit with no credit is never necessary.
* precision ``P = sum_i N_i C_i / n`` with correctness ``C_i in {0, 1}``; ``P = 0`` when ``n = 0``.
* recall ``Rec = clip(sum_j w_j s_j / sum_{w_j > 0} w_j, 0, 1)`` with coverage ``s_j in {0, 1}``.
  HealthBench convention: for a negative-weight (pitfall / absence) rubric ``s_j = 1`` means the
  pitfall is present (the criterion is "met"), so it subtracts ``|w_j|``. With no positive rubric
  recall is vacuous: 1 when no pitfall is met, else 0.
* ``F_beta = (1 + beta^2) P Rec / (beta^2 P + Rec)``, 0 when ``P = Rec = 0``; beta > 1 favours
  recall.

Baselines under the same API (:func:`combine_rewards`): ``recall`` (recall-only, what rubric
rewards do today), ``mean`` (arithmetic mean of P and Rec), ``f2`` (F-beta with beta = 2) and
``fork`` (F-beta with the caller's beta).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from creditlab.core._checks import any_true, check_scalar, check_tensor, require_values
from creditlab.errors import InputError

__all__ = [
    "COMBINE_MODES",
    "ForkScores",
    "combine_rewards",
    "credit_split",
    "deletion_curve",
    "f_beta",
    "fork_scores",
    "fork_scores_one",
    "necessity",
    "signed_recall",
    "unit_credit",
    "unit_credit_one",
    "unit_precision",
]

COMBINE_MODES = ("fork", "recall", "mean", "f2")


def _check_match(match: torch.Tensor, rubric_mask: torch.Tensor, unit_mask: torch.Tensor,
                 dims: dict[str, int]) -> None:
    check_tensor("match", match, shape=("B", "J", "U"), boolean=True, dims=dims)
    check_tensor("rubric_mask", rubric_mask, shape=("B", "J"), boolean=True, dims=dims)
    check_tensor("unit_mask", unit_mask, shape=("B", "U"), boolean=True, dims=dims)


def credit_split(match: torch.Tensor, rubric_mask: torch.Tensor, unit_mask: torch.Tensor) -> torch.Tensor:
    """Credit split ``a_ji = m_ji / K_j`` with ``K_j = sum_i m_ji``; ``(B, J, U)`` float32.

    Args:
        match: ``(B, J, U)`` bool, ``m_ji``.
        rubric_mask: ``(B, J)`` bool, real rubric slots.
        unit_mask: ``(B, U)`` bool, real unit slots.

    Rows with ``K_j = 0`` and padded slots get 0.

    >>> m = torch.tensor([[[True, True, False], [False, False, True]]])
    >>> credit_split(m, torch.tensor([[True, True]]), torch.tensor([[True, True, True]]))
    tensor([[[0.5000, 0.5000, 0.0000],
             [0.0000, 0.0000, 1.0000]]])
    """
    _check_match(match, rubric_mask, unit_mask, {})
    m = match & rubric_mask[:, :, None] & unit_mask[:, None, :]  # (B, J, U)
    k = m.sum(dim=2, keepdim=True)  # (B, J, 1) K_j
    return m.float() / k.clamp_min(1).float()


def unit_credit(match: torch.Tensor, rubric_mask: torch.Tensor, unit_mask: torch.Tensor) -> torch.Tensor:
    """Unit credit ``c_i = sum_j a_ji`` over the rubrics in ``rubric_mask``; ``(B, U)`` float32.

    Pass ``rubric_mask & (weights > 0)`` to count positive rubrics only, as :func:`fork_scores`
    does. Padded units get 0.
    """
    return credit_split(match, rubric_mask, unit_mask).sum(dim=1)


def necessity(credits: torch.Tensor, tau: torch.Tensor | float, unit_mask: torch.Tensor) -> torch.Tensor:
    """Necessity ``N_i = 1[c_i >= tau]`` on real units; ``(B, U)`` bool.

    ``tau`` is a float or a ``(B,)`` tensor (one threshold per response, e.g. chosen by a judge);
    it must be > 0 so that a unit with no credit is never necessary.
    """
    dims: dict[str, int] = {}
    check_tensor("unit_mask", unit_mask, shape=("B", "U"), boolean=True, dims=dims)
    check_tensor("credits", credits, shape=("B", "U"), floating=True, finite=True,
                 finite_where=unit_mask, dims=dims)
    tau_t = _as_batch("tau", tau, credits.shape[0], dims, credits.device)
    if any_true((tau_t <= 0) | ~torch.isfinite(tau_t)):
        raise InputError(f"tau: must be finite and > 0, got {tau_t.tolist()}")
    # Credits are sums of 1/K fractions; a small tolerance keeps 1/3 + 1/3 + 1/3 >= 1.
    return (credits >= tau_t[:, None].to(credits.dtype) - 1e-6) & unit_mask


def unit_precision(necessary: torch.Tensor, correct: torch.Tensor, unit_mask: torch.Tensor) -> torch.Tensor:
    """Precision ``P = sum_i N_i C_i / n`` over real units; ``(B,)`` float32; 0 when ``n = 0``."""
    dims: dict[str, int] = {}
    check_tensor("necessary", necessary, shape=("B", "U"), boolean=True, dims=dims)
    check_tensor("correct", correct, shape=("B", "U"), boolean=True, dims=dims)
    check_tensor("unit_mask", unit_mask, shape=("B", "U"), boolean=True, dims=dims)
    good = (necessary & correct & unit_mask).sum(dim=1).float()
    n = unit_mask.sum(dim=1).float()
    return good / n.clamp_min(1)


def signed_recall(coverage: torch.Tensor, weights: torch.Tensor, rubric_mask: torch.Tensor) -> torch.Tensor:
    """Signed rubric recall ``clip(sum_j w_j s_j / sum_{w_j>0} w_j, 0, 1)``; ``(B,)`` float32.

    Args:
        coverage: ``(B, J)`` bool, ``s_j`` (criterion met; for a pitfall: the pitfall is present).
        weights: ``(B, J)`` float, rubric points ``w_j`` (negative = pitfall / absence rubric).
        rubric_mask: ``(B, J)`` bool.

    With no positive rubric: 1 when no pitfall is met, else 0.

    >>> signed_recall(torch.tensor([[True, False, True]]), torch.tensor([[3.0, 1.0, -2.0]]),
    ...               torch.tensor([[True, True, True]]))
    tensor([0.2500])
    """
    dims: dict[str, int] = {}
    check_tensor("rubric_mask", rubric_mask, shape=("B", "J"), boolean=True, dims=dims)
    check_tensor("coverage", coverage, shape=("B", "J"), boolean=True, dims=dims)
    check_tensor("weights", weights, shape=("B", "J"), floating=True, finite=True,
                 finite_where=rubric_mask, dims=dims)
    w = torch.where(rubric_mask, weights, torch.zeros_like(weights)).float()
    s = (coverage & rubric_mask).float()
    pos_total = w.clamp_min(0).sum(dim=1)
    earned = (w * s).sum(dim=1)
    rec = (earned / pos_total.clamp_min(1e-12)).clamp(0.0, 1.0)
    pitfall_met = ((w < 0) & (s > 0)).any(dim=1)
    vacuous = torch.where(pitfall_met, torch.zeros_like(rec), torch.ones_like(rec))
    return torch.where(pos_total > 0, rec, vacuous)


def f_beta(p: torch.Tensor, rec: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """``F_beta = (1 + beta^2) P Rec / (beta^2 P + Rec)``; 0 where ``P = Rec = 0``.

    >>> f_beta(torch.tensor([0.5, 0.0, 1.0]), torch.tensor([1.0, 0.0, 0.5]))
    tensor([0.6667, 0.0000, 0.6667])
    """
    dims: dict[str, int] = {}
    check_tensor("p", p, shape=("B",), floating=True, finite=True, dims=dims)
    check_tensor("rec", rec, shape=("B",), floating=True, finite=True, dims=dims)
    check_scalar("beta", beta, low=0.0, low_open=True)
    b2 = float(beta) ** 2
    den = b2 * p + rec
    return torch.where(den > 0, (1 + b2) * p * rec / den.clamp_min(1e-12), torch.zeros_like(den))


def combine_rewards(p: torch.Tensor, rec: torch.Tensor, mode: str = "fork", beta: float = 1.0) -> torch.Tensor:
    """Reward from precision and recall under one of :data:`COMBINE_MODES`; ``(B,)``.

    ``fork``: F-beta with ``beta``; ``recall``: Rec (precision ignored); ``mean``: (P + Rec) / 2;
    ``f2``: F-beta with beta = 2.
    """
    if mode == "fork":
        return f_beta(p, rec, beta)
    if mode == "f2":
        return f_beta(p, rec, 2.0)
    dims: dict[str, int] = {}
    check_tensor("p", p, shape=("B",), floating=True, finite=True, dims=dims)
    check_tensor("rec", rec, shape=("B",), floating=True, finite=True, dims=dims)
    if mode == "recall":
        return rec.clone()
    if mode == "mean":
        return 0.5 * (p + rec)
    raise InputError(f"mode: unknown combine mode {mode!r}; valid: {', '.join(COMBINE_MODES)}")


class ForkScores(NamedTuple):
    """Output of :func:`fork_scores`. Shapes: ``(B,)`` per response, ``(B, U)`` per unit."""

    reward: torch.Tensor
    precision: torch.Tensor
    recall: torch.Tensor
    credits: torch.Tensor
    necessary: torch.Tensor
    n_units: torch.Tensor
    metrics: dict[str, float]


def fork_scores(
    match: torch.Tensor,
    coverage: torch.Tensor,
    weights: torch.Tensor,
    correct: torch.Tensor,
    rubric_mask: torch.Tensor,
    unit_mask: torch.Tensor,
    tau: torch.Tensor | float,
    beta: float = 1.0,
    mode: str = "fork",
) -> ForkScores:
    """The whole FORK pipeline from judge verdicts to rewards.

    Args:
        match: ``(B, J, U)`` bool, unit i contributes to rubric j.
        coverage: ``(B, J)`` bool, rubric met (pitfall: present).
        weights: ``(B, J)`` float rubric points, negative for pitfalls.
        correct: ``(B, U)`` bool, ``C_i``.
        rubric_mask: ``(B, J)`` bool; unit_mask: ``(B, U)`` bool.
        tau: necessity threshold, float or ``(B,)``, > 0.
        beta: F-beta parameter (``mode="fork"``).
        mode: one of :data:`COMBINE_MODES`.

    Metrics (means over the batch): ``reward/fork/{reward,precision,recall,n_units,
    necessary_frac,correct_frac,absence_satisfaction}``; absence satisfaction is the share of
    pitfall rubrics not met (1 when the batch has none).
    """
    require_values("fork_scores", "it returns its metrics as Python floats (read on the host)",
                   match, coverage, weights, correct, rubric_mask, unit_mask, tau, beta, mode)
    dims: dict[str, int] = {}
    _check_match(match, rubric_mask, unit_mask, dims)
    check_tensor("weights", weights, shape=("B", "J"), floating=True, finite=True,
                 finite_where=rubric_mask, dims=dims)
    check_tensor("correct", correct, shape=("B", "U"), boolean=True, dims=dims)
    positive = rubric_mask & (torch.where(rubric_mask, weights, torch.zeros_like(weights)) > 0)
    credits = unit_credit(match, positive, unit_mask)
    nec = necessity(credits, tau, unit_mask)
    p = unit_precision(nec, correct, unit_mask)
    rec = signed_recall(coverage, weights, rubric_mask)
    reward = combine_rewards(p, rec, mode, beta)
    n = unit_mask.sum(dim=1)
    pitfalls = rubric_mask & (torch.where(rubric_mask, weights, torch.zeros_like(weights)) < 0)
    n_pit = int(pitfalls.sum())
    met_pit = int((pitfalls & coverage).sum())
    n_real = max(int(n.sum()), 1)
    metrics = {
        "reward/fork/reward": float(reward.mean()) if reward.numel() else 0.0,
        "reward/fork/precision": float(p.mean()) if p.numel() else 0.0,
        "reward/fork/recall": float(rec.mean()) if rec.numel() else 0.0,
        "reward/fork/n_units": float(n.float().mean()) if n.numel() else 0.0,
        "reward/fork/necessary_frac": float(nec.sum()) / n_real,
        "reward/fork/correct_frac": float((correct & unit_mask).sum()) / n_real,
        "reward/fork/absence_satisfaction": 1.0 - met_pit / n_pit if n_pit else 1.0,
    }
    return ForkScores(reward, p, rec, credits, nec, n, metrics)


def deletion_curve(match: torch.Tensor, weights: torch.Tensor, rubric_mask: torch.Tensor, unit_mask: torch.Tensor,
                   scores: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Necessity deletion curve: recall after deleting the ``k`` least necessary units, ``k = 0..U``.

    Units are deleted in ascending order of ``scores`` (a predicted necessity, e.g. the unit
    credits; ties in index order); a rubric stays met while at least one unit matching it remains
    (coverage is taken from ``match``, for pitfall rubrics too: deleting the unit that commits a
    pitfall removes the violation). A good necessity predictor deletes many units before recall
    drops.

    Args:
        match: ``(B, J, U)`` bool; weights: ``(B, J)`` float; rubric_mask ``(B, J)``, unit_mask ``(B, U)``.
        scores: ``(B, U)`` float, higher = more necessary.

    Returns:
        ``curve (B, U + 1)``: recall after ``k`` deletions (constant once every real unit is gone),
        and metrics: ``reward/fork/deletion_free_frac``, the mean share of a response's units that
        can be deleted before recall falls below its starting value.

    >>> m = torch.tensor([[[True, False, False], [False, True, False]]])
    >>> curve, _ = deletion_curve(m, torch.tensor([[1.0, 1.0]]), torch.tensor([[True, True]]),
    ...                           torch.tensor([[True, True, True]]), torch.tensor([[1.0, 0.5, 0.0]]))
    >>> curve
    tensor([[1.0000, 1.0000, 0.5000, 0.0000]])
    """
    require_values("deletion_curve", "it returns its metrics as Python floats (read on the host)",
                   match, weights, rubric_mask, unit_mask, scores)
    dims: dict[str, int] = {}
    _check_match(match, rubric_mask, unit_mask, dims)
    check_tensor("weights", weights, shape=("B", "J"), floating=True, finite=True, finite_where=rubric_mask,
                 dims=dims)
    check_tensor("scores", scores, shape=("B", "U"), floating=True, finite=True, finite_where=unit_mask, dims=dims)
    B, J, U = match.shape
    # Deletion order: real units by ascending score (stable), padding last.
    key = torch.where(unit_mask, scores.double(), torch.full_like(scores, float("inf"), dtype=torch.float64))
    order = torch.sort(key, dim=1, stable=True).indices  # (B, U)
    dev = match.device
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(U, device=dev).expand(B, U).contiguous())  # (B, U)
    m = match & rubric_mask[:, :, None] & unit_mask[:, None, :]
    # A rubric is met after k deletions iff its last-deleted matching unit has rank >= k.
    last = torch.where(m, rank[:, None, :], torch.full_like(rank[:, None, :], -1)).amax(dim=2)  # (B, J)
    k = torch.arange(U + 1, device=dev)
    n = unit_mask.sum(dim=1)  # (B,)
    k_eff = torch.minimum(k[None, :], n[:, None])  # (B, U+1): no deletions past the real units
    met = k_eff[:, None, :] <= last[:, :, None]  # (B, J, U+1)
    w = torch.where(rubric_mask, weights, torch.zeros_like(weights)).float()
    pos_total = w.clamp_min(0).sum(dim=1, keepdim=True)  # (B, 1)
    earned = (w[:, :, None] * met.float()).sum(dim=1)  # (B, U+1)
    rec = (earned / pos_total.clamp_min(1e-12)).clamp(0.0, 1.0)
    pitfall_met = ((w[:, :, None] < 0) & met).any(dim=1)
    vacuous = torch.where(pitfall_met, torch.zeros_like(rec), torch.ones_like(rec))
    curve = torch.where(pos_total > 0, rec, vacuous)
    # Units deletable before recall first drops below its start.
    drop = curve < curve[:, :1] - 1e-6  # (B, U+1)
    first_drop = torch.where(drop.any(dim=1), drop.float().argmax(dim=1), n + 1)
    free = (first_drop - 1).clamp(min=0).minimum(n).float() / n.clamp_min(1).float()
    has_units = n > 0
    metrics = {"reward/fork/deletion_free_frac": float(free[has_units].mean()) if bool(has_units.any()) else 0.0}
    return curve, metrics


def _as_batch(name: str, value: torch.Tensor | float, b: int, dims: dict[str, int],
              device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        check_tensor(name, value, shape=("B",), floating=True, dims=dims, device=device)
        return value
    return torch.full((b,), check_scalar(name, value), dtype=torch.float32, device=device)


# ------------------------------------------------------------------------------------------------
# One response on plain numbers: the judge client's path
# ------------------------------------------------------------------------------------------------

def unit_credit_one(match: Sequence[Sequence[bool]], positive: Sequence[bool]) -> list[float]:
    """:func:`unit_credit` of one response on plain lists: ``match[j][i]`` (J rubrics x n units),
    ``positive[j]`` (the rubric counts); ``n`` credits.

    Python floats (double precision) instead of float32 tensors: a judge client scores one response
    at a time, where tiny tensors cost more than the arithmetic. The tensor version stays the
    reference; the two agree to float32 rounding (about 1e-7, tested on random inputs), far below
    the 6 decimals a result keeps.
    """
    n = len(match[0]) if match else 0
    credits = [0.0] * n
    for row, pos in zip(match, positive, strict=True):
        k = sum(1 for v in row if v) if pos else 0
        if k:
            share = 1.0 / k
            credits = [c + share if v else c for c, v in zip(credits, row, strict=True)]
    return credits


class ForkOne(NamedTuple):
    """:func:`fork_scores_one`'s result for one response."""

    reward: float
    precision: float
    recall: float
    credits: list[float]
    necessary: list[bool]


def fork_scores_one(match: Sequence[Sequence[bool]], coverage: Sequence[bool], weights: Sequence[float],
                    correct: Sequence[bool], tau: float, beta: float = 1.0, mode: str = "fork") -> ForkOne:
    """:func:`fork_scores` of one response on plain lists (``match[j][i]``, ``coverage[j]``,
    ``weights[j]``, ``correct[i]``) in Python floats (see :func:`unit_credit_one`)."""
    if mode not in COMBINE_MODES:
        raise InputError(f"mode: unknown combine mode {mode!r}; valid: {', '.join(COMBINE_MODES)}")
    tau = float(check_scalar("tau", tau))
    if not (tau > 0 and math.isfinite(tau)):
        raise InputError(f"tau: must be finite and > 0, got {[tau]}")
    w = [float(x) for x in weights]
    credits = unit_credit_one(match, [x > 0 for x in w])
    n = len(correct)
    nec = [c >= tau - 1e-6 for c in credits]  # the tolerance of necessity()
    p = sum(1 for a, b in zip(nec, correct, strict=True) if a and b) / max(n, 1)
    pos_total = sum(x for x in w if x > 0)
    earned = sum(x for x, s in zip(w, coverage, strict=True) if s)
    if pos_total > 0:
        rec = min(max(earned / pos_total, 0.0), 1.0)
    else:
        rec = 0.0 if any(x < 0 and s for x, s in zip(w, coverage, strict=True)) else 1.0
    if mode == "recall":
        reward = rec
    elif mode == "mean":
        reward = 0.5 * (p + rec)
    else:
        b2 = float(check_scalar("beta", beta, low=0.0, low_open=True)) ** 2 if mode == "fork" else 4.0
        den = b2 * p + rec
        reward = (1 + b2) * p * rec / den if den > 0 else 0.0
    return ForkOne(reward, p, rec, credits, nec)
