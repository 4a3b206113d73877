"""Bag-of-units world: the FORK verbosity failure with known truth, vectorised over a batch.

Each prompt has ``F`` rubric facts (ragged: ``F`` varies between prompts, at most ``F_max``), each
with points ``w_f`` and a *confidence* ``c_f``: the probability that a statement the policy makes
about fact f is correct (``c_f = 1`` for a fact the policy knows; in (0, 1) for one it would guess).
A response is a sequence of units built by actions:

* ``state f`` (one action per fact slot): a unit about fact f, correct with probability ``c_f``
  (independently each time, so repeating a guess is hedging: "it is A — or B"); a correct unit
  matches rubric f, a wrong one matches nothing and is incorrect (``C = 0``); a second correct unit
  on the same fact is a redundant paraphrase;
* ``filler``: a correct unit that serves no rubric (padding);
* ``stop``: end of the response (also ends at ``max_units``);
* ``sweep f`` (only in a world with ``pitfalls``; one action per fact slot): a sweeping claim that
  lists the answer to fact f among wrong alternatives ("it is A, B or C"). It always matches
  rubric f (the right answer is in the list), so it buys recall for sure where a plain statement
  is a guess; it is incorrect (``C = 0``: it states wrong alternatives), and it commits the
  prompt's pitfall. With ``pitfalls`` each prompt has one absence rubric ("makes no sweeping
  claims", points ``-pitfall_points``) after its fact rubrics, met (violated) by any sweep.

The rubric truth is exact, so the judge verdicts are known: ``match[f, i] = unit i is a correct
statement of fact f``, ``coverage[f] = any(match[f])``, ``correct[i]``. Rewards come from
:func:`creditlab.core.precision.fork_scores`.

The policy observes, per fact slot, ``c_f`` and how many times it has stated fact f so far (not
whether those statements were right), plus the step; a good FORK policy states each fact it is
reasonably sure of once and stops.

Judge noise (:func:`flip_verdicts`, ``score(..., flip=p)``): a noisy judge flips each verdict it
gives (rubric met, unit matches rubric, unit correct) independently with probability ``p``, on the
real rubric and unit slots only. The world's truth (:meth:`BagOfUnits.anatomy`,
:meth:`BagOfUnits.quality`, :meth:`BagOfUnits.absence`) never sees the noise.

True quality (:meth:`BagOfUnits.quality`), the rubric-free measure of a response: the points of
the facts it states correctly (a plain correct statement; a sweep does not count), minus
``wrong_cost`` per incorrect unit (wrong guesses and sweeps), minus ``pitfall_cost`` when it
commits the pitfall. Redundant restatements and filler earn nothing and cost nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from creditlab.core.precision import ForkScores, fork_scores
from creditlab.errors import ConfigError

__all__ = ["BagOfUnits", "Prompts", "Responses", "Rubric", "flip_verdicts"]


@dataclass(frozen=True)
class Prompts:
    """A batch of ``B`` prompts. ``fact_mask (B, F_max)`` bool, ``points`` and ``confidence`` ``(B, F_max)``."""

    fact_mask: torch.Tensor
    points: torch.Tensor
    confidence: torch.Tensor

    def repeat(self, g: int) -> Prompts:
        """Each prompt ``g`` times in a row (a GRPO group)."""
        return Prompts(*(x.repeat_interleave(g, dim=0) for x in (self.fact_mask, self.points, self.confidence)))


@dataclass
class Responses:
    """Units of ``B`` responses: ``fact (B, L)`` long (fact slot, -1 for filler), ``correct (B, L)``
    bool, ``unit_mask (B, L)`` bool, ``counts (B, F_max)`` statements per fact (sweeps included),
    ``done (B,)``, ``sweep (B, L)`` bool (the unit is a sweeping claim; all False without pitfalls)."""

    fact: torch.Tensor
    correct: torch.Tensor
    unit_mask: torch.Tensor
    counts: torch.Tensor
    done: torch.Tensor
    sweep: torch.Tensor


@dataclass(frozen=True)
class Rubric:
    """The rubric of a batch as :func:`~creditlab.core.precision.fork_scores` takes it, ``J`` slots:
    the ``F_max`` fact rubrics, then (with pitfalls) the absence rubric. ``match (B, J, L)``,
    ``coverage (B, J)``, ``weights (B, J)``, ``rubric_mask (B, J)``; ``correct (B, L)``."""

    match: torch.Tensor
    coverage: torch.Tensor
    weights: torch.Tensor
    rubric_mask: torch.Tensor
    correct: torch.Tensor


def flip_verdicts(verdicts: torch.Tensor, mask: torch.Tensor, uniforms: torch.Tensor, rate: float) -> torch.Tensor:
    """A noisy judge's verdicts: each verdict in ``mask`` flipped where ``uniforms < rate``.

    ``verdicts`` and ``mask`` bool, ``uniforms`` float in [0, 1), all of one shape; verdicts
    outside ``mask`` (padding) are returned unchanged.
    """
    if verdicts.shape != mask.shape or verdicts.shape != uniforms.shape:
        raise ValueError(f"flip_verdicts: shapes differ: {tuple(verdicts.shape)}, {tuple(mask.shape)}, "
                         f"{tuple(uniforms.shape)}")
    return verdicts ^ ((uniforms < rate) & mask)


class BagOfUnits:
    """The world: prompt sampling, stepping, judge verdicts and rewards.

    Args:
        f_min, f_max: number of rubric facts per prompt, uniform in ``[f_min, f_max]``.
        known_prob: probability that a fact is known (``c_f = 1``); otherwise ``c_f ~ U(0.05, 0.95)``.
        max_units: response length cap.
        max_points: rubric points are uniform integers in ``[1, max_points]``.
        lenient: the judge's leniency on paraphrases. Lenient (default): every correct statement of
            fact f matches rubric f, so K restatements split its credit (1/K each). Strict: only the
            first correct statement matches; a restatement matches nothing (credit 0).
        pitfalls: add the ``sweep f`` actions and one absence rubric per prompt (module docstring).
        pitfall_points: points the absence rubric subtracts when violated (0: the rubric the reward
            sees has no absence item; the world still knows which responses commit the pitfall).
    """

    def __init__(self, f_min: int = 3, f_max: int = 6, known_prob: float = 0.5, max_units: int = 16,
                 max_points: int = 3, lenient: bool = True, pitfalls: bool = False, pitfall_points: float = 1.0):
        if not 1 <= f_min <= f_max:
            raise ConfigError("f_min", f"need 1 <= f_min <= f_max, got {f_min}, {f_max}")
        if not 0.0 <= known_prob <= 1.0:
            raise ConfigError("known_prob", f"must be in [0, 1], got {known_prob}")
        if max_units < 1:
            raise ConfigError("max_units", f"must be >= 1, got {max_units}")
        self.f_min, self.f_max, self.known_prob = f_min, f_max, known_prob
        self.max_units, self.max_points = max_units, max_points
        if not (math.isfinite(pitfall_points) and pitfall_points >= 0):
            raise ConfigError("pitfall_points", f"must be finite and >= 0, got {pitfall_points}")
        self.lenient = bool(lenient)
        self.pitfalls, self.pitfall_points = bool(pitfalls), float(pitfall_points)
        # state f (f_max slots), filler, stop, then with pitfalls sweep f (f_max slots)
        self.n_actions = f_max + 2 + (f_max if self.pitfalls else 0)
        self.FILLER, self.STOP, self.SWEEP = f_max, f_max + 1, f_max + 2

    def sample_prompts(self, b: int, gen: torch.Generator) -> Prompts:
        F = self.f_max
        n = torch.randint(self.f_min, self.f_max + 1, (b,), generator=gen)
        fact_mask = torch.arange(F)[None, :] < n[:, None]  # (B, F)
        points = torch.randint(1, self.max_points + 1, (b, F), generator=gen).float()
        known = torch.rand(b, F, generator=gen) < self.known_prob
        guess = 0.05 + 0.9 * torch.rand(b, F, generator=gen)
        confidence = torch.where(known, torch.ones_like(guess), guess)
        return Prompts(fact_mask, points * fact_mask, confidence * fact_mask)

    def reset(self, prompts: Prompts) -> Responses:
        b, L = prompts.fact_mask.shape[0], self.max_units
        return Responses(
            fact=torch.full((b, L), -1, dtype=torch.long),
            correct=torch.zeros(b, L, dtype=torch.bool),
            unit_mask=torch.zeros(b, L, dtype=torch.bool),
            counts=torch.zeros(b, self.f_max),
            done=torch.zeros(b, dtype=torch.bool),
            sweep=torch.zeros(b, L, dtype=torch.bool),
        )

    def action_mask(self, prompts: Prompts) -> torch.Tensor:
        """``(B, A)`` bool: fact slots that exist, filler and stop (and with pitfalls the sweeps of
        the fact slots that exist)."""
        b = prompts.fact_mask.shape[0]
        parts = [prompts.fact_mask, torch.ones(b, 2, dtype=torch.bool)]
        return torch.cat(parts + [prompts.fact_mask] * self.pitfalls, dim=1)

    def step(self, prompts: Prompts, resp: Responses, t: int, action: torch.Tensor, gen: torch.Generator) -> None:
        """Apply ``action (B,)`` at position ``t`` to the responses not yet done (in place)."""
        live = ~resp.done
        stop = action == self.STOP
        emit = live & ~stop
        is_fact = emit & (action < self.f_max)
        is_sweep = emit & (action >= self.SWEEP)  # never without pitfalls
        f = torch.where(action >= self.SWEEP, action - self.SWEEP, action).clamp(max=self.f_max - 1)
        c = prompts.confidence.gather(1, f[:, None]).squeeze(1)
        right = torch.rand(action.shape[0], generator=gen) < c  # drawn for every row, whatever the action
        about = is_fact | is_sweep
        resp.fact[:, t] = torch.where(about, f, torch.full_like(f, -1))
        resp.correct[:, t] = torch.where(is_fact, right, emit & ~is_sweep)  # filler is correct, a sweep is not
        resp.unit_mask[:, t] = emit
        resp.sweep[:, t] = is_sweep
        resp.counts += torch.nn.functional.one_hot(f, self.f_max).float() * about[:, None].float()
        resp.done |= live & stop

    def verdicts(self, prompts: Prompts, resp: Responses) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact judge verdicts on the fact rubrics: ``match (B, F, L)`` and ``coverage (B, F)``
        (a correct statement of fact f, or a sweep on f, matches rubric f)."""
        f_ids = torch.arange(self.f_max)[None, :, None]
        match = ((resp.fact[:, None, :] == f_ids) & (resp.correct | resp.sweep)[:, None, :]
                 & resp.unit_mask[:, None, :])
        match &= prompts.fact_mask[:, :, None]
        if not self.lenient:  # only the first matching unit of each fact matches its rubric
            match &= (torch.cumsum(match.to(torch.int32), dim=2) == 1)
        return match, match.any(dim=2)

    def rubric(self, prompts: Prompts, resp: Responses) -> Rubric:
        """The exact verdicts on the whole rubric: the fact rubrics, then with pitfalls the absence
        rubric (weight ``-pitfall_points``; its matching units are the sweeps, and it is met when
        there is one; left out of ``rubric_mask`` when ``pitfall_points`` is 0)."""
        match, coverage = self.verdicts(prompts, resp)
        weights, mask = prompts.points, prompts.fact_mask
        if self.pitfalls:
            b = mask.shape[0]
            sweeps = resp.sweep & resp.unit_mask
            match = torch.cat([match, sweeps[:, None, :]], dim=1)
            coverage = torch.cat([coverage, sweeps.any(dim=1, keepdim=True)], dim=1)
            weights = torch.cat([weights, torch.full((b, 1), -self.pitfall_points)], dim=1)
            mask = torch.cat([mask, torch.full((b, 1), self.pitfall_points > 0)], dim=1)
        return Rubric(match, coverage, weights, mask, resp.correct)

    def noisy_rubric(self, rubric: Rubric, unit_mask: torch.Tensor, flip: float, gen: torch.Generator) -> Rubric:
        """The verdicts of a judge that flips each one (rubric met, unit matches rubric, unit correct)
        with probability ``flip`` (:func:`flip_verdicts`); uniforms drawn from ``gen`` in that order."""
        m_mask = rubric.rubric_mask[:, :, None] & unit_mask[:, None, :]
        coverage = flip_verdicts(rubric.coverage, rubric.rubric_mask,
                                 torch.rand(rubric.coverage.shape, generator=gen), flip)
        match = flip_verdicts(rubric.match, m_mask, torch.rand(rubric.match.shape, generator=gen), flip)
        correct = flip_verdicts(rubric.correct, unit_mask, torch.rand(rubric.correct.shape, generator=gen), flip)
        return Rubric(match, coverage, rubric.weights, rubric.rubric_mask, correct)

    def score(self, prompts: Prompts, resp: Responses, mode: str, tau: float = 0.75, beta: float = 1.0,
              flip: float = 0.0, gen: torch.Generator | None = None) -> ForkScores:
        """FORK scores of the responses under reward ``mode``; with ``flip > 0`` the verdicts are a
        noisy judge's (:meth:`noisy_rubric`, uniforms drawn from ``gen``)."""
        r = self.rubric(prompts, resp)
        if flip > 0:
            if gen is None:
                raise ValueError("score: a noisy judge (flip > 0) needs a generator")
            r = self.noisy_rubric(r, resp.unit_mask, flip, gen)
        return fork_scores(r.match, r.coverage, r.weights, r.correct, r.rubric_mask, resp.unit_mask,
                           tau=tau, beta=beta, mode=mode)

    def quality(self, prompts: Prompts, resp: Responses, wrong_cost: float = 1.0,
                pitfall_cost: float = 2.0) -> torch.Tensor:
        """True quality ``(B,)`` (module docstring): points of the facts stated correctly, minus
        ``wrong_cost`` per incorrect unit, minus ``pitfall_cost`` when a sweep commits the pitfall."""
        f_ids = torch.arange(self.f_max)[None, :, None]
        right = (resp.fact[:, None, :] == f_ids) & (resp.correct & resp.unit_mask)[:, None, :]
        stated = (right & prompts.fact_mask[:, :, None]).any(dim=2)  # (B, F)
        earned = (prompts.points * stated.float()).sum(dim=1)
        wrong = (resp.unit_mask & ~resp.correct).sum(dim=1).float()
        return earned - wrong_cost * wrong - pitfall_cost * (~self.absence(resp)).float()

    def absence(self, resp: Responses) -> torch.Tensor:
        """``(B,)`` bool: the response satisfies its absence rubric (no sweep; always True without pitfalls)."""
        return ~(resp.sweep & resp.unit_mask).any(dim=1)

    def anatomy(self, prompts: Prompts, resp: Responses) -> dict[str, torch.Tensor]:
        """Per response ``(B,)``: length, necessary (first correct statement of a fact), redundant
        (further correct statements of a covered fact), wrong (incorrect units, sweeps included),
        filler and sweep unit counts."""
        f_ids = torch.arange(self.f_max)[None, :, None]  # the truth, whatever the judge's leniency
        match = (resp.fact[:, None, :] == f_ids) & resp.correct[:, None, :] & resp.unit_mask[:, None, :]
        match &= prompts.fact_mask[:, :, None]
        correct_per_fact = match.sum(dim=2)  # (B, F)
        first = (correct_per_fact > 0).sum(dim=1)
        length = resp.unit_mask.sum(dim=1)
        wrong = (resp.unit_mask & ~resp.correct).sum(dim=1)
        filler = (resp.unit_mask & (resp.fact < 0)).sum(dim=1)
        return {"length": length.float(), "necessary": first.float(),
                "redundant": (correct_per_fact.sum(dim=1) - first).float(), "wrong": wrong.float(),
                "filler": filler.float(), "sweep": (resp.unit_mask & resp.sweep).sum(dim=1).float()}
