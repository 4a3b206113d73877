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
* ``stop``: end of the response (also ends at ``max_units``).

The rubric truth is exact, so the judge verdicts are known: ``match[f, i] = unit i is a correct
statement of fact f``, ``coverage[f] = any(match[f])``, ``correct[i]``. Rewards come from
:func:`creditlab.core.precision.fork_scores`.

The policy observes, per fact slot, ``c_f`` and how many times it has stated fact f so far (not
whether those statements were right), plus the step; a good FORK policy states each fact it is
reasonably sure of once and stops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from creditlab.core.precision import ForkScores, fork_scores
from creditlab.errors import ConfigError

__all__ = ["BagOfUnits", "Prompts", "Responses"]


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
    bool, ``unit_mask (B, L)`` bool, ``counts (B, F_max)`` statements per fact, ``done (B,)``."""

    fact: torch.Tensor
    correct: torch.Tensor
    unit_mask: torch.Tensor
    counts: torch.Tensor
    done: torch.Tensor


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
    """

    def __init__(self, f_min: int = 3, f_max: int = 6, known_prob: float = 0.5, max_units: int = 16,
                 max_points: int = 3, lenient: bool = True):
        if not 1 <= f_min <= f_max:
            raise ConfigError("f_min", f"need 1 <= f_min <= f_max, got {f_min}, {f_max}")
        if not 0.0 <= known_prob <= 1.0:
            raise ConfigError("known_prob", f"must be in [0, 1], got {known_prob}")
        if max_units < 1:
            raise ConfigError("max_units", f"must be >= 1, got {max_units}")
        self.f_min, self.f_max, self.known_prob = f_min, f_max, known_prob
        self.max_units, self.max_points = max_units, max_points
        self.lenient = bool(lenient)
        self.n_actions = f_max + 2  # state f (f_max slots), filler, stop
        self.FILLER, self.STOP = f_max, f_max + 1

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
        )

    def action_mask(self, prompts: Prompts) -> torch.Tensor:
        """``(B, A)`` bool: fact slots that exist, filler and stop."""
        b = prompts.fact_mask.shape[0]
        return torch.cat([prompts.fact_mask, torch.ones(b, 2, dtype=torch.bool)], dim=1)

    def step(self, prompts: Prompts, resp: Responses, t: int, action: torch.Tensor, gen: torch.Generator) -> None:
        """Apply ``action (B,)`` at position ``t`` to the responses not yet done (in place)."""
        live = ~resp.done
        stop = action == self.STOP
        emit = live & ~stop
        is_fact = emit & (action < self.f_max)
        f = action.clamp(max=self.f_max - 1)
        c = prompts.confidence.gather(1, f[:, None]).squeeze(1)
        right = torch.rand(action.shape[0], generator=gen) < c
        resp.fact[:, t] = torch.where(is_fact, f, torch.full_like(f, -1))
        resp.correct[:, t] = torch.where(is_fact, right, emit)  # filler is correct
        resp.unit_mask[:, t] = emit
        resp.counts += torch.nn.functional.one_hot(f, self.f_max).float() * is_fact[:, None].float()
        resp.done |= live & stop

    def verdicts(self, prompts: Prompts, resp: Responses) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact judge verdicts: ``match (B, F, L)`` and ``coverage (B, F)``."""
        f_ids = torch.arange(self.f_max)[None, :, None]
        match = (resp.fact[:, None, :] == f_ids) & resp.correct[:, None, :] & resp.unit_mask[:, None, :]
        match &= prompts.fact_mask[:, :, None]
        if not self.lenient:  # only the first correct statement of each fact matches its rubric
            match &= (torch.cumsum(match.to(torch.int32), dim=2) == 1)
        return match, match.any(dim=2)

    def score(self, prompts: Prompts, resp: Responses, mode: str, tau: float = 0.75, beta: float = 1.0) -> ForkScores:
        match, coverage = self.verdicts(prompts, resp)
        return fork_scores(match, coverage, prompts.points, resp.correct, prompts.fact_mask, resp.unit_mask,
                           tau=tau, beta=beta, mode=mode)

    def anatomy(self, prompts: Prompts, resp: Responses) -> dict[str, torch.Tensor]:
        """Per response ``(B,)``: length, necessary (first correct statement of a fact), redundant
        (further correct statements of a covered fact), wrong and filler unit counts."""
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
                "filler": filler.float()}
