"""``FORKReward``: runs a :class:`~creditlab.judge.base.Judge` over responses and applies the FORK math.

Per response, at most one judge call per stage (so at most 5 requests with an HTTP judge):
``unitize`` and ``coverage`` in parallel, then ``match`` and ``correctness`` in parallel, then the
unit credits (:func:`creditlab.core.precision.unit_credit`), then ``threshold`` (when
``tau="judge"``), then :func:`creditlab.core.precision.fork_scores`.

A judge failure is an explicit error on that item (``reward=None``, ``error`` set), never a silent
0 or 0.5; the TRL-style ``__call__`` returns ``None`` for it (TRL skips ``None`` rewards).

Items that cannot be scored are errors too, found before any judge call: no rubric, only
zero-weight rubrics, or only negative (pitfall) rubrics give recall no denominator (scoring them
would turn one bad training row into a maximum reward). Pitfall-only items can be scored by a
convention a user opts into, ``pitfall_only="absence"``: recall is 1 when no pitfall is violated and
0 otherwise (the item then measures only what the response avoided). So is an item whose prompt,
response or a rubric holds a lone surrogate (:attr:`~creditlab.rewards.items.ForkItem.text_problem`):
no judge can be sent it. An empty response is scored 0 without judging, with a ``note``.

``beta`` belongs to ``mode="fork"`` alone: ``f2`` is F-beta with beta 2, ``recall`` and ``mean`` have
none, and giving another beta with them is refused. What every result records (``mode``, ``beta``)
is what was computed: ``beta`` is 2.0 under ``f2`` and None under ``recall`` and ``mean``.

>>> import asyncio
>>> from creditlab.rewards.items import ForkItem, Rubric
>>> class Toy:  # a judge whose answers are written down (see creditlab.judge for real ones)
...     name, can_judge_correctness = "toy", True
...     async def unitize(self, prompt, response): return response.split(". ")
...     async def coverage(self, prompt, response, rubrics): return [True, False]
...     async def match(self, prompt, rubrics, units): return [[True, True, False], [False, False, False]]
...     async def correctness(self, prompt, units): return [True, True, True]
...     async def threshold(self, prompt, units, credits): return 0.5
>>> item = ForkItem("a", "q", "Rest. Sleep. Eat", (Rubric("rest", 3.0), Rubric("hydrate", 1.0)))
>>> r = asyncio.run(FORKReward(Toy()).score([item]))[0]
>>> round(r.precision, 4), r.recall, round(r.reward, 4), r.credits
(0.6667, 0.75, 0.7059, [0.5, 0.5, 0.0])
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import itertools
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from creditlab.core.precision import COMBINE_MODES, fork_scores_one, unit_credit_one
from creditlab.errors import ConfigError, InputError
from creditlab.judge.base import Judge, JudgeError, track_usage
from creditlab.rewards.items import (
    MAX_POINTS,
    MIN_POINTS,
    ForkItem,
    Rubric,
    parse_rubrics,
    render_messages,
    render_response,
)

__all__ = ["BETA_MAX", "BETA_MIN", "FORKReward", "ForkResult", "beta_conflict", "effective_beta"]

#: Items :meth:`FORKReward.score` starts per event-loop pass.
START_BATCH = 32

#: Range of ``beta``: beyond it F-beta equals precision (or recall) to 6 decimals, and from about 1e19
#: ``beta**2`` overflows float32 and rewards turn NaN.
BETA_MIN, BETA_MAX = 1e-3, 1e3


#: The beta each combine mode fixes itself (None: the mode has no beta); ``fork`` takes the caller's.
MODE_BETA: dict[str, float | None] = {"f2": 2.0, "recall": None, "mean": None}


def beta_conflict(mode: str, beta: float | None) -> str | None:
    """Why ``beta`` cannot go with ``mode`` (None: it can; ``beta=None`` means not given)."""
    if beta is None or mode not in MODE_BETA:
        return None
    fixed = MODE_BETA[mode]
    if fixed is None:
        return f"mode {mode!r} has no beta (it ignores precision's weight against recall); drop beta"
    if float(beta) != fixed:
        return (f"mode {mode!r} is F-beta with beta = {fixed:g}, not {float(beta):g}; drop beta, or use mode 'fork' "
                f"with beta {float(beta):g}")
    return None


def effective_beta(mode: str, beta: float | None) -> float | None:
    """The beta ``mode`` computes with: the given one (default 1) for ``fork``, the mode's own otherwise."""
    if mode in MODE_BETA:
        return MODE_BETA[mode]
    return 1.0 if beta is None else float(beta)


@dataclass
class ForkResult:
    """Score of one response. ``N`` (necessity) and ``C`` (correctness) are aligned with ``units``;
    ``coverage`` with the item's rubrics. ``reward`` is None exactly when ``error`` is set."""

    id: str
    reward: float | None
    precision: float | None = None
    recall: float | None = None
    units: list[str] = field(default_factory=list)
    credits: list[float] = field(default_factory=list)
    N: list[bool] = field(default_factory=list)
    C: list[bool] = field(default_factory=list)
    coverage: list[bool] = field(default_factory=list)
    n_units: int = 0
    length_words: int = 0
    tau: float | None = None
    requests: int = 0
    cache_hits: int = 0
    error: str | None = None
    error_kind: str | None = None
    """``input`` (the item cannot be scored), else the judge's failure kind (``timeout``,
    ``http_500``, ``invalid_reply``, ``endpoint_down``...)."""
    note: str | None = None
    assume_correct: bool = False
    judge: str = ""
    judge_quality: str = ""
    mode: str = "fork"
    beta: float | None = 1.0
    """The F-beta parameter the reward was computed with (2.0 for ``f2``; None for ``recall`` and
    ``mean``, which have none)."""
    input_hash: str | None = None
    """:attr:`ForkItem.input_hash` of what was scored (prompt, response, rubrics): a resumed run
    compares it to tell a row whose input changed under the same id."""

    def to_row(self) -> dict[str, Any]:
        return asdict(self)


class FORKReward:
    """FORK reward over a judge.

    Args:
        judge: any :class:`~creditlab.judge.base.Judge`.
        beta: F-beta parameter of ``mode="fork"`` (default 1); beta > 1 favours recall. ``f2`` fixes it
            at 2 and ``recall`` / ``mean`` have none: another value with them is a :class:`ConfigError`.
        tau: ``"judge"`` (the judge's threshold stage picks it per response) or a fixed float > 0.
        mode: ``fork`` (F-beta), or a baseline under the same API: ``recall``, ``mean``, ``f2``.
        assume_correct: treat every unit as factually correct and skip the correctness stage.
            Required for judges that cannot judge correctness (the offline judge); recorded in
            every result.
        pitfall_only: what an item whose rubrics are all negative gets: ``"error"`` (default: it
            cannot be scored) or ``"absence"`` (reward = recall = 1 when no pitfall is violated,
            else 0, in every mode; precision None: no unit can serve a rubric).
    """

    PITFALL_ONLY = ("error", "absence")

    def __init__(self, judge: Judge, beta: float | None = None, tau: str | float = "judge", *, mode: str = "fork",
                 assume_correct: bool = False, pitfall_only: str = "error"):
        if not isinstance(judge, Judge):
            raise ConfigError("judge", f"{type(judge).__name__} does not implement the Judge protocol")
        if mode not in COMBINE_MODES:
            raise ConfigError("mode", f"unknown {mode!r}; valid: {', '.join(COMBINE_MODES)}")
        if beta is not None and (isinstance(beta, bool) or not isinstance(beta, int | float)
                                 or not BETA_MIN <= beta <= BETA_MAX):
            raise ConfigError("beta", f"must be a number between {BETA_MIN:g} and {BETA_MAX:g}, got {beta!r}")
        problem = beta_conflict(mode, beta)
        if problem is not None:
            raise ConfigError("beta", f"beta={beta!r} with mode={mode!r}: {problem}")
        if tau != "judge":
            try:
                tau = float(tau)
            except (TypeError, ValueError):
                raise ConfigError("tau", f"must be 'judge' or a number > 0, got {tau!r}") from None
            if not tau > 0:
                raise ConfigError("tau", f"must be > 0, got {tau}")
        if pitfall_only not in self.PITFALL_ONLY:
            raise ConfigError("pitfall_only", f"unknown {pitfall_only!r}; valid: {', '.join(self.PITFALL_ONLY)}")
        if not judge.can_judge_correctness and not assume_correct:
            raise ConfigError("assume_correct", f"judge {judge.name} cannot judge factual correctness; pass "
                                                "assume_correct=True (--assume-correct) to score anyway")
        self.judge = judge
        #: the beta the rewards are computed with (None: the mode has none)
        self.beta = effective_beta(mode, beta)
        self.tau = tau
        self.mode = mode
        self.assume_correct = assume_correct
        self.pitfall_only = pitfall_only
        #: the :class:`ForkResult` list of the last ``__call__`` (errors, units... for logging)
        self.last_results: list[ForkResult] = []

    # -- async API -------------------------------------------------------------------------------------
    async def score(self, items: Sequence[ForkItem], *, max_in_flight: int | None = None) -> list[ForkResult]:
        """Score every item concurrently (the judge bounds its own concurrency); results in input order.

        At most ``max_in_flight`` items are in progress at once (default :meth:`default_in_flight`,
        twice the judge's request slots, which keeps every slot busy): the next item starts when one
        finishes. Items that cannot have a slot yet are not prepared yet, so the event loop reads the
        replies instead of preparing requests that would wait (started all at once, a thousand items
        delayed the first replies by half a second and the connections' opening by tens of
        milliseconds). The first items start :data:`START_BATCH` at a time, one event-loop pass apart,
        so the first connections open while the others prepare.
        """
        max_in_flight = self._in_flight_bound(max_in_flight)
        results: list[ForkResult | None] = [None] * len(items)
        todo = iter(enumerate(items))

        async def run() -> None:
            for k, it in todo:
                results[k] = await self.score_one(it)

        workers: list[asyncio.Future[None]] = []
        try:
            for k in range(min(max_in_flight, len(items))):
                workers.append(asyncio.ensure_future(run()))
                if (k + 1) % START_BATCH == 0:
                    await asyncio.sleep(0)
            await asyncio.gather(*workers)
        except BaseException:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        return results  # type: ignore[return-value]

    async def score_iter(self, items: Iterable[ForkItem], *, max_in_flight: int | None = None
                         ) -> AsyncIterator[ForkResult]:
        """Yield results as they finish (any order), with at most ``max_in_flight`` items in progress.

        Each item runs its stages to the end before a new one starts, so results come from the first
        seconds of a run and an interrupted run has finished (and its caller written) everything it
        yielded; what is lost is at most the items in flight. ``items`` is read lazily. The default
        bound is twice the requests the judge keeps on the wire (``concurrency`` per endpoint), enough
        to keep every slot busy: an item has one or two requests outstanding at a time. Closing the
        iterator (or cancelling its consumer) cancels the items in flight.
        """
        max_in_flight = self._in_flight_bound(max_in_flight)
        source = iter(items)
        pending: set[asyncio.Future[ForkResult]] = set()
        exhausted = False
        try:
            while True:
                while not exhausted and len(pending) < max_in_flight:
                    item = next(source, None)
                    if item is None:
                        exhausted = True
                    else:
                        pending.add(asyncio.ensure_future(self.score_one(item)))
                if not pending:
                    return
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                # an item that raised (a judge's own bug, a missing package) raises here, once: the other
                # items that raised in the same pass are marked retrieved (no "Task exception was never
                # retrieved" report at exit)
                failed = [f for f in done if not f.cancelled() and f.exception() is not None]
                if failed:
                    raise failed[0].exception()
                for fut in done:
                    yield fut.result()
        finally:
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    def _in_flight_bound(self, max_in_flight: int | None) -> int:
        """``max_in_flight``, or :meth:`default_in_flight` when None; below 1 is an error naming it."""
        if max_in_flight is None:
            return self.default_in_flight()
        if max_in_flight < 1:
            raise ConfigError("max_in_flight", f"must be >= 1, got {max_in_flight}")
        return max_in_flight

    def default_in_flight(self) -> int:
        """Items :meth:`score_iter` keeps in progress by default: twice the judge's request slots
        (``concurrency`` times the number of endpoints; 32 for a judge without these attributes)."""
        slots = int(getattr(self.judge, "concurrency", 16)) * len(getattr(self.judge, "base_urls", ()) or (None,))
        return max(2, 2 * slots)

    async def score_one(self, item: ForkItem) -> ForkResult:
        base = {"id": item.id, "assume_correct": self.assume_correct, "judge": self.judge.name,
                "judge_quality": str(getattr(self.judge, "quality", "unknown")), "mode": self.mode,
                "beta": self.beta, "length_words": len(item.response.split()), "input_hash": item.input_hash}
        reason = self.unscorable(item)
        if reason is not None:
            return _noted(ForkResult(reward=None, error=f"item {item.id!r} cannot be scored: {reason}",
                                     error_kind="input", **base), item)
        if not item.response.strip():
            return _noted(ForkResult(reward=0.0, precision=0.0, recall=0.0,
                                     note="empty response: scored 0 without judging", **base), item)
        with track_usage() as usage:
            try:
                res = await self._score(item, base)
            except JudgeError as err:
                res = ForkResult(reward=None, error=str(err), error_kind=err.kind, **base)
        res.requests = usage.requests
        res.cache_hits = usage.cache_hits
        return _noted(res, item)

    def unscorable(self, item: ForkItem) -> str | None:
        """Why ``item`` cannot be scored: a text no judge can be sent, or no recall denominator (None when
        it can be scored)."""
        problem = item.text_problem
        if problem is not None:
            return problem
        if not item.rubrics:
            return "it has no rubric, so recall has no denominator"
        for k, r in enumerate(item.rubrics):
            if not (r.points == 0 or MIN_POINTS <= abs(r.points) <= MAX_POINTS):
                return (f"rubric {k} has points {r.points!r}, out of range (0, or between {MIN_POINTS:g} and "
                        f"{MAX_POINTS:g} in absolute value)")
        if all(r.points == 0 for r in item.rubrics):
            return "every rubric has 0 points, so recall has no denominator"
        if all(r.points <= 0 for r in item.rubrics) and self.pitfall_only == "error":
            return ("it has only negative (pitfall) rubrics, so recall has no denominator; opt into the "
                    "absence convention (pitfall_only='absence', --pitfall-only absence) to score it")
        return None

    async def _score(self, item: ForkItem, base: dict[str, Any]) -> ForkResult:
        j = self.judge
        criteria = [r.criterion for r in item.rubrics]
        if all(r.points <= 0 for r in item.rubrics):  # pitfall-only, opted into the absence convention
            coverage = await j.coverage(item.prompt, item.response, criteria)
            _expect("coverage", "coverage flags", coverage, len(criteria), bool)
            violated = any(c and r.points < 0 for c, r in zip(coverage, item.rubrics, strict=True))
            score = 0.0 if violated else 1.0
            return ForkResult(reward=score, precision=None, recall=score, coverage=list(coverage),
                              note="pitfall-only item (absence convention): reward = 1 when no pitfall is "
                                   "violated, else 0; precision is not defined", **base)
        units, coverage = await asyncio.gather(j.unitize(item.prompt, item.response),
                                               j.coverage(item.prompt, item.response, criteria))
        _expect("unitize", "units", units, None, str)
        _expect("coverage", "coverage flags", coverage, len(criteria), bool)
        if units and criteria:
            if self.assume_correct:
                match = await j.match(item.prompt, criteria, units)
                correct = [True] * len(units)
            else:
                match, correct = await asyncio.gather(j.match(item.prompt, criteria, units),
                                                      j.correctness(item.prompt, units))
        elif units:
            match = []
            correct = [True] * len(units) if self.assume_correct else await j.correctness(item.prompt, units)
        else:
            match, correct = [[] for _ in criteria], []
        _expect("match", "match rows", match, len(criteria), list)
        if not match or set(map(len, match)) != {len(units)} or \
                set(map(type, itertools.chain.from_iterable(match))) - {bool}:  # else every row is n bools
            for row in match:
                _expect("match", "match entries in a row", row, len(units), bool)
        _expect("correctness", "correctness flags", correct, len(units), bool)

        # one response: the math of core.precision.fork_scores on plain floats (fork_scores_one)
        n = len(units)
        points = [float(r.points) for r in item.rubrics]
        credits = unit_credit_one(match, [w > 0 for w in points])
        tau: float | None
        if self.tau != "judge":
            tau = float(self.tau)
        elif n and max(credits) > 0:
            tau = await j.threshold(item.prompt, units, credits)
            if isinstance(tau, bool) or not isinstance(tau, int | float) or not tau > 0:
                raise JudgeError("threshold", "invalid_reply", f"tau must be > 0, got {tau!r}")
        else:
            tau = None  # no unit has credit: no threshold makes one necessary, so none is asked for
        out = fork_scores_one(match, coverage, points, correct, tau=float(tau) if tau is not None else 1.0,
                              beta=self.beta if self.beta is not None else 1.0, mode=self.mode)
        return ForkResult(
            reward=round(out.reward, 6), precision=round(out.precision, 6), recall=round(out.recall, 6),
            units=list(units), credits=[round(c, 6) for c in credits], N=out.necessary,
            C=list(correct), coverage=list(coverage), n_units=n, tau=None if tau is None else float(tau), **base)

    # -- TRL-style reward function -----------------------------------------------------------------
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        """TRL reward-function signature: one float per completion, ``None`` where the judge failed.

        Rubrics come from the dataset column ``rubrics`` (or ``Rubrics``), one list per sample.
        Prompts and completions may be strings or chat message lists.
        """
        results = _run_sync(self.score(trl_items(prompts, completions, **kwargs)))
        self.last_results = results
        return [r.reward for r in results]


def trl_items(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[ForkItem]:
    """FORK items from a TRL reward-function call: prompts and completions (strings or chat message
    lists) and the dataset column ``rubrics`` (or ``Rubrics``), one rubric list per sample."""
    rubrics = kwargs.get("rubrics", kwargs.get("Rubrics"))
    if rubrics is None or len(rubrics) != len(completions):
        raise InputError("rubrics: pass one rubric list per completion (a dataset column 'rubrics')")
    if len(prompts) != len(completions):
        raise InputError(f"prompts: {len(prompts)} prompts for {len(completions)} completions")
    items = []
    for k, (p, c, rs) in enumerate(zip(prompts, completions, rubrics, strict=True)):
        where = f"sample {k}"
        parsed = tuple(r if isinstance(r, Rubric) else parse_rubrics([r], where)[0] for r in rs) \
            if isinstance(rs, list) else parse_rubrics(rs, where)
        response, note = render_response(c, where, "completion")
        items.append(ForkItem(str(k), render_messages(p, where, "prompt"), response, parsed,
                              response_field="completion", note=note))
    return items


def _noted(res: ForkResult, item: ForkItem) -> ForkResult:
    """``res`` with the item's reading note (e.g. which chat messages were scored) added to its note."""
    if item.note:
        res.note = item.note if not res.note else f"{res.note}; {item.note}"
    return res


def _expect(stage: str, what: str, value: Any, n: int | None, typ: type) -> None:
    if isinstance(value, list) and (n is None or len(value) == n) and \
            (not value or set(map(type, value)) == {typ}):  # exactly ``typ`` (the usual case), in C
        return
    if not isinstance(value, list) or (n is not None and len(value) != n) or \
            not all(isinstance(v, typ) for v in value):
        got = len(value) if isinstance(value, list) else type(value).__name__
        want = f"{n} " if n is not None else ""
        raise JudgeError(stage, "invalid_reply", f"judge returned {got} {what}, expected a list of {want}"
                                                 f"{typ.__name__}")


def _run_sync(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with cf.ThreadPoolExecutor(1) as ex:  # called from inside a running loop (e.g. a notebook)
        return ex.submit(asyncio.run, coro).result()
