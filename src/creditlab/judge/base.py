"""The :class:`Judge` protocol every FORK judge implements, its typed error and request accounting.

A judge answers five stages about one response, each in at most one request (very large rubric
sets are chunked): ``unitize`` (split the response into sentence-sized units), ``coverage`` (is
each rubric met?), ``match`` (which units contribute to which rubric), ``correctness`` (is each
unit factually correct?) and ``threshold`` (the necessity threshold tau from the units and their
credits). So scoring one response costs at most 5 requests whatever its number of rubrics and
units.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from creditlab.errors import CreditlabError

__all__ = ["STAGES", "Judge", "JudgeError", "Usage", "check_stage_text", "current_usage", "lone_surrogate",
           "text_problem", "track_usage"]

STAGES = ("unitize", "coverage", "match", "correctness", "threshold")


class JudgeError(CreditlabError):
    """A judge stage failed for good (retries and re-asks exhausted, or a non-retryable error).

    ``stage`` names the stage; ``kind`` is a short machine-readable reason (``http_500``,
    ``timeout``, ``invalid_reply``, ``http_401``...).
    """

    def __init__(self, stage: str, kind: str, message: str):
        self.stage = stage
        self.kind = kind
        super().__init__(f"judge {stage}: {kind}: {message}")


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> int | None:
    """Index of the first surrogate code point (U+D800..U+DFFF) of ``text``, None when it has none.

    A JSON ``\\ud800`` escape decodes to one (a valid pair of escapes decodes to the one character it
    stands for): half of a UTF-16 pair, which no Unicode encoding can write, so such a text can be
    neither sent to a judge nor written to a results file.
    """
    if text.isascii():
        return None
    m = _SURROGATE.search(text)
    return None if m is None else m.start()


def text_problem(fields: Iterable[tuple[str, str]]) -> str | None:
    """What makes one of the ``(field name, text)`` pairs unusable as text (None: nothing)."""
    for name, text in fields:
        if isinstance(text, str):
            at = lone_surrogate(text)
            if at is not None:
                return (f"field '{name}' holds a lone surrogate (U+{ord(text[at]):04X} at character {at}), half of "
                        "a UTF-16 pair that is not text in any Unicode encoding (a JSON '\\ud800'-style escape "
                        "without its other half); fix or drop that character in the input")
    return None


def _clean(text: object) -> bool:
    return not isinstance(text, str) or text.isascii() or _SURROGATE.search(text) is None


def check_stage_text(stage: str, prompt: str, response: str | None = None, rubrics: Sequence[str] = (),
                     units: Sequence[str] = ()) -> None:
    """Raise :class:`JudgeError` (kind ``input``, naming the field) when a text given to a judge stage
    holds a lone surrogate: it can be neither sent (no encoding writes it) nor cached nor written."""
    if _clean(prompt) and _clean(response) and all(map(_clean, rubrics)) and all(map(_clean, units)):
        return
    problem = text_problem([("prompt", prompt), ("response", response),  # type: ignore[list-item]
                            *((f"rubrics[{k}]", r) for k, r in enumerate(rubrics)),
                            *((f"units[{k}]", u) for k, u in enumerate(units))])
    if problem is not None:
        raise JudgeError(stage, "input", problem)


@dataclass
class Usage:
    """Requests caused by one item (or one block of work), counted by the judge that makes them.

    ``requests``: HTTP requests sent (each retry and re-ask counts); ``cache_hits``: stage answers
    served from the cache; ``shared``: answers taken from an identical request already in flight.
    """

    requests: int = 0
    cache_hits: int = 0
    shared: int = 0
    retries: int = 0
    reasks: int = 0


_USAGE: ContextVar[Usage | None] = ContextVar("creditlab_judge_usage", default=None)


def current_usage() -> Usage | None:
    """The :class:`Usage` of the enclosing :func:`track_usage` block, if any."""
    return _USAGE.get()


@contextlib.contextmanager
def track_usage() -> Iterator[Usage]:
    """Count the judge requests made inside the block (asyncio tasks started inside inherit it)."""
    usage = Usage()
    token = _USAGE.set(usage)
    try:
        yield usage
    finally:
        _USAGE.reset(token)


@runtime_checkable
class Judge(Protocol):
    """Five async stages; lists are aligned with the rubrics / units passed in."""

    name: str
    #: False when the judge cannot check facts (the offline judge): scoring then needs an explicit
    #: ``assume_correct`` and records it in every result.
    can_judge_correctness: bool

    async def unitize(self, prompt: str, response: str) -> list[str]: ...

    async def coverage(self, prompt: str, response: str, rubrics: Sequence[str]) -> list[bool]: ...

    async def match(self, prompt: str, rubrics: Sequence[str], units: Sequence[str]) -> list[list[bool]]:
        """``J x n`` matrix: ``[j][i]`` is True when unit i contributes to rubric j."""
        ...

    async def correctness(self, prompt: str, units: Sequence[str]) -> list[bool]: ...

    async def threshold(self, prompt: str, units: Sequence[str], credits: Sequence[float]) -> float: ...
