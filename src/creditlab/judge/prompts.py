"""Prompts, reply schemas and reply validation of the five judge stages.

Every request is two messages: a system message with the stage's instructions and a user message
holding one JSON object (``{"task": stage, ...}``) with the question, the response, the rubrics
(``R1..RJ``) and the units (``U1..Un``). Replies are one JSON object validated by a pydantic model,
then checked against what was asked: the rubric and unit ids in the reply must be exactly those
asked about. Bump :data:`PROMPT_VERSION` whenever a prompt or schema changes (it is part of the
cache key).
"""

from __future__ import annotations

import functools
import json
import math
import operator
import re
from collections.abc import Sequence
from json.encoder import encode_basestring as _enc  # what json.dumps(ensure_ascii=False) writes for a str
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError

from creditlab.judge.base import lone_surrogate

__all__ = [
    "PROMPT_VERSION",
    "ReplyInvalid",
    "StageRequest",
    "build_messages",
    "extract_json",
    "parse_reply",
    "parse_stage_reply",
    "payload_for",
    "reply_schema",
    "stage_request",
]

PROMPT_VERSION = "fork-judge-v1"


class ReplyInvalid(Exception):
    """The judge replied, but the reply is unusable (not JSON, wrong schema, wrong ids)."""


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore")


class UnitItem(_Reply):
    id: str
    text: str


class UnitizeReply(_Reply):
    units: list[UnitItem]


class CoverageItem(_Reply):
    id: str
    met: bool


class CoverageReply(_Reply):
    rubrics: list[CoverageItem]


class MatchItem(_Reply):
    id: str
    units: list[str]


class MatchReply(_Reply):
    rubrics: list[MatchItem]


class CorrectItem(_Reply):
    id: str
    correct: bool


class CorrectnessReply(_Reply):
    units: list[CorrectItem]


class ThresholdReply(_Reply):
    tau: float


_MODELS: dict[str, type[_Reply]] = {
    "unitize": UnitizeReply,
    "coverage": CoverageReply,
    "match": MatchReply,
    "correctness": CorrectnessReply,
    "threshold": ThresholdReply,
}

_FORMAT = {
    "unitize": '{"units": [{"id": "U1", "text": "..."}, ...]}',
    "coverage": '{"rubrics": [{"id": "R1", "met": true}, ...]}',
    "match": '{"rubrics": [{"id": "R1", "units": ["U2", "U5"]}, ...]}',
    "correctness": '{"units": [{"id": "U1", "correct": true}, ...]}',
    "threshold": '{"tau": 0.5}',
}

_INSTRUCTIONS = {
    "unitize": (
        "You split an answer into units. A unit is one self-contained sentence-sized claim or "
        "instruction. Keep the original wording; replace pronouns by what they refer to; drop "
        "greetings, headings, pleasantries and discourse markers. Number the units U1, U2, ... "
        "in order of appearance. An answer with no content gives an empty list."
    ),
    "coverage": (
        "You grade an answer against rubric criteria R1..RJ. For each criterion say whether the "
        "answer meets it (met = true/false). Some criteria describe a mistake to avoid: they are "
        "met when the answer makes that mistake. Grade every criterion exactly once."
    ),
    "match": (
        "You are given rubric criteria R1..RJ and the units U1..Un of an answer. For each "
        "criterion list the units that contribute to meeting it (possibly none). A unit may "
        "contribute to several criteria. List every criterion exactly once; use only the given ids."
    ),
    "correctness": (
        "You check facts. For each unit U1..Un of an answer to the question, say whether it is "
        "factually correct. Be strict: any factual error in a unit makes it incorrect. A unit "
        "with no factual content (advice, structure) is correct unless it is misleading."
    ),
    "threshold": (
        "Each unit of an answer carries a credit: the share of rubric criteria it serves (a "
        "criterion served by K units gives 1/K to each). Choose the threshold tau > 0 such that "
        "the units with credit >= tau are the necessary ones and the rest are padding or "
        "repetition."
    ),
}


def _ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{k + 1}" for k in range(n)]


def build_messages(stage: str, payload: dict[str, Any]) -> list[dict[str, str]]:
    """The chat messages of one stage request; ``payload`` already holds ids (see :func:`payload_for`)."""
    system = (
        f"{_INSTRUCTIONS[stage]}\nReply with one JSON object and nothing else, of the form "
        f"{_FORMAT[stage]}."
    )
    user = json.dumps({"task": stage, **payload}, ensure_ascii=False, sort_keys=True)
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def payload_for(stage: str, *, prompt: str, response: str | None = None,
                rubrics: Sequence[str] = (), units: Sequence[str] = (),
                credits: Sequence[float] = ()) -> dict[str, Any]:
    """The JSON payload of one stage: only the fields that stage needs."""
    p: dict[str, Any] = {"question": prompt}
    if stage in ("unitize", "coverage"):
        p["answer"] = response
    if stage in ("coverage", "match"):
        p["rubrics"] = [{"id": i, "criterion": r} for i, r in zip(_ids("R", len(rubrics)), rubrics, strict=True)]
    if stage in ("match", "correctness", "threshold"):
        p["units"] = [{"id": i, "text": u} for i, u in zip(_ids("U", len(units)), units, strict=True)]
    if stage == "threshold":
        for item, c in zip(p["units"], credits, strict=True):
            item["credit"] = round(float(c), 6)
    return p


class StageRequest(NamedTuple):
    """One stage request as the judge client sends it: the messages of :func:`build_messages` and the
    rubric and unit ids the reply must cover (what :func:`parse_stage_reply` checks it against)."""

    stage: str
    messages: list[dict[str, str]]
    rubric_ids: tuple[str, ...]
    unit_ids: tuple[str, ...]

    def payload_ids(self) -> dict[str, Any]:
        """The ids as :func:`payload_for` holds them (all :func:`parse_reply` reads of a payload)."""
        return {"rubrics": [{"id": i} for i in self.rubric_ids], "units": [{"id": i} for i in self.unit_ids]}


@functools.cache
def _system(stage: str) -> str:
    return (f"{_INSTRUCTIONS[stage]}\nReply with one JSON object and nothing else, of the form "
            f"{_FORMAT[stage]}.")


@functools.lru_cache(maxsize=512)
def _id_tuple(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(_ids(prefix, n))


@functools.lru_cache(maxsize=512)
def _id_index(prefix: str, n: int) -> dict[str, int]:
    return {i: k for k, i in enumerate(_id_tuple(prefix, n))}


def _num(x: float) -> str:
    """A float as ``json.dumps`` writes it."""
    if x != x:
        return "NaN"
    if x in (math.inf, -math.inf):
        return "Infinity" if x > 0 else "-Infinity"
    return float.__repr__(x)


def stage_request(stage: str, *, prompt: str, response: str | None = None, rubrics: Sequence[str] = (),
                  units: Sequence[str] = (), credits: Sequence[float] = ()) -> StageRequest:
    """``build_messages(stage, payload_for(stage, ...))`` and the ids, without the intermediate payload.

    The user message is written field by field in the order ``json.dumps(..., sort_keys=True)``
    writes it, so the messages are the same strings, character for character (a test compares them
    on random text); arguments that are not plain strings take the reference path.
    """
    if stage not in _INSTRUCTIONS:
        raise KeyError(stage)
    nr = len(rubrics) if stage in ("coverage", "match") else 0
    nu = len(units) if stage in ("match", "correctness", "threshold") else 0
    plain = type(prompt) is str and (response is None or type(response) is str) and \
        set(map(type, rubrics)) <= _STR and set(map(type, units)) <= _STR
    if not plain or (stage == "threshold" and len(credits) != nu):
        messages = build_messages(stage, payload_for(stage, prompt=prompt, response=response, rubrics=rubrics,
                                                     units=units, credits=credits))
        return StageRequest(stage, messages, _id_tuple("R", nr), _id_tuple("U", nu))
    parts = []
    if stage in ("unitize", "coverage"):
        parts.append('"answer": ' + ("null" if response is None else _enc(response)))
    parts.append('"question": ' + _enc(prompt))
    if nr:
        parts.append('"rubrics": [' + ", ".join(
            f'{{"criterion": {_enc(r)}, "id": "R{k}"}}' for k, r in enumerate(rubrics, 1)) + "]")
    elif stage in ("coverage", "match"):
        parts.append('"rubrics": []')
    parts.append(f'"task": "{stage}"')
    if stage == "threshold":
        parts.append('"units": [' + ", ".join(
            f'{{"credit": {_num(round(float(c), 6))}, "id": "U{k}", "text": {_enc(u)}}}'
            for k, (u, c) in enumerate(zip(units, credits, strict=True), 1)) + "]")
    elif nu:
        parts.append('"units": [' + ", ".join(f'{{"id": "U{k}", "text": {_enc(u)}}}' for k, u in enumerate(units, 1))
                     + "]")
    elif stage in ("match", "correctness"):
        parts.append('"units": []')
    messages = [{"role": "system", "content": _system(stage)},
                {"role": "user", "content": "{" + ", ".join(parts) + "}"}]
    return StageRequest(stage, messages, _id_tuple("R", nr), _id_tuple("U", nu))


def _strict(schema: Any) -> Any:
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items() if k != "title"}
        if out.get("type") == "object":
            out["additionalProperties"] = False
            out["required"] = list(out.get("properties", {}))
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def _schema_json(stage: str) -> str:
    return json.dumps(_strict(_MODELS[stage].model_json_schema()))


def reply_schema(stage: str) -> dict[str, Any]:
    """JSON schema of a stage's reply for structured output (``response_format: json_schema``)."""
    return json.loads(_schema_json(stage))


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def extract_json(text: str) -> Any:
    """Parse a JSON object out of plain text: the whole text, a fenced block, or the outermost braces."""
    text = text.strip()
    try:  # the whole text first (the usual reply), before looking for fences and braces
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    candidates = [m.group(1) for m in _FENCE.finditer(text)]
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start:end + 1])
    for c in candidates:
        try:
            return json.loads(c)
        except json.JSONDecodeError:
            continue
    raise ReplyInvalid(f"no JSON object in the reply (first 80 chars: {text[:80]!r})")


def _exact_ids(kind: str, got: list[str], want: list[str]) -> None:
    if len(got) != len(set(got)):
        dup = sorted({g for g in got if got.count(g) > 1})
        raise ReplyInvalid(f"duplicate {kind} ids {dup}")
    if set(got) != set(want):
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        raise ReplyInvalid(f"{kind} ids do not match the request (missing {missing}, unknown {extra})")


def parse_reply(stage: str, data: Any, payload: dict[str, Any]) -> Any:
    """Validate a decoded reply against the stage schema and the ids asked about.

    Returns the stage result: ``list[str]`` units, ``list[bool]`` coverage (rubric order),
    ``list[list[bool]]`` match (J x n), ``list[bool]`` correctness (unit order) or ``float`` tau.
    Raises :class:`ReplyInvalid` saying what is wrong.
    """
    try:
        reply = _MODELS[stage].model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise ReplyInvalid(f"reply does not fit the {stage} schema at {loc or '<root>'}: {first['msg']}") from None
    rubric_ids = [r["id"] for r in payload.get("rubrics", [])]
    unit_ids = [u["id"] for u in payload.get("units", [])]
    if isinstance(reply, UnitizeReply):
        units = [u.text.strip() for u in reply.units]
        if any(not u for u in units):
            raise ReplyInvalid("empty unit text")
        for k, u in enumerate(units):
            if lone_surrogate(u) is not None:  # could be neither asked about nor written to a results file
                raise ReplyInvalid(f"unit {k + 1} holds a lone surrogate (a '\\ud800'-style escape without its "
                                   "other half): write every character as itself")
        return units
    if isinstance(reply, CoverageReply):
        _exact_ids("rubric", [r.id for r in reply.rubrics], rubric_ids)
        met = {r.id: r.met for r in reply.rubrics}
        return [met[i] for i in rubric_ids]
    if isinstance(reply, MatchReply):
        _exact_ids("rubric", [r.id for r in reply.rubrics], rubric_ids)
        known = set(unit_ids)
        rows = {}
        for r in reply.rubrics:
            bad = sorted(set(r.units) - known)
            if bad:
                raise ReplyInvalid(f"rubric {r.id} lists unknown unit ids {bad}")
            rows[r.id] = set(r.units)
        return [[u in rows[j] for u in unit_ids] for j in rubric_ids]
    if isinstance(reply, CorrectnessReply):
        _exact_ids("unit", [u.id for u in reply.units], unit_ids)
        ok = {u.id: u.correct for u in reply.units}
        return [ok[i] for i in unit_ids]
    assert isinstance(reply, ThresholdReply)
    if not math.isfinite(reply.tau) or reply.tau <= 0:
        raise ReplyInvalid(f"tau must be finite and > 0, got {reply.tau}")
    return float(reply.tau)


def parse_stage_reply(req: StageRequest, data: Any) -> Any:
    """:func:`parse_reply` for a :class:`StageRequest`: the same result, or the same :class:`ReplyInvalid`.

    Replies made of exactly the JSON types the schema names (``str``, ``bool``, lists, a ``float``
    tau), with the ids in the order they were asked, are checked here by hand; any other reply (ids
    reordered, coercible types such as ``"true"``, anything wrong) goes through :func:`parse_reply`,
    which coerces or says what is wrong. A test holds the two equal on random replies.
    """
    fast = _fast_reply(req, data)
    if fast is not None:
        return fast
    return parse_reply(req.stage, data, req.payload_ids())


def _fast_reply(req: StageRequest, data: Any) -> Any:
    """The parsed reply when it is plainly valid, else None (then the reference path decides).

    Checks run over whole lists in C (``map``, ``set`` of the element types) rather than element by
    element: this runs for every reply of every request.
    """
    if type(data) is not dict:
        return None
    stage = req.stage
    if stage == "threshold":
        tau = data.get("tau")
        if type(tau) is float and math.isfinite(tau) and tau > 0:
            return tau
        return None
    rows = data.get("units" if stage in ("unitize", "correctness") else "rubrics")
    if type(rows) is not list:
        return None
    want = req.rubric_ids if stage in ("coverage", "match") else req.unit_ids
    if not rows:
        return [] if stage == "unitize" or not want else None
    if set(map(type, rows)) != _DICT:
        return None
    try:
        ids = tuple(map(_GET_ID, rows))
        if stage == "unitize":
            texts = list(map(_GET_TEXT, rows))
        else:
            if ids != want:
                return None
            if stage == "match":
                listed = list(map(_GET_UNITS, rows))
            else:
                flags = list(map(_GET_MET if stage == "coverage" else _GET_CORRECT, rows))
    except KeyError:
        return None
    if stage == "unitize":
        if set(map(type, ids)) != _STR or set(map(type, texts)) != _STR:
            return None
        texts = list(map(str.strip, texts))
        if not all(texts) or (not all(map(str.isascii, texts)) and
                              any(lone_surrogate(t) is not None for t in texts)):
            return None  # the reference path says what is wrong
        return texts
    if stage != "match":
        return flags if set(map(type, flags)) == _BOOL else None
    if set(map(type, listed)) != _LIST:
        return None
    index = _id_index("U", len(req.unit_ids))
    n = len(req.unit_ids)
    out = []
    try:
        for units in listed:
            row = [False] * n
            for u in units:
                row[index[u]] = True  # KeyError: not a unit id asked about (or not a string)
            out.append(row)
    except (KeyError, TypeError):
        return None
    return out


_DICT, _STR, _BOOL, _LIST = {dict}, {str}, {bool}, {list}
_GET_ID, _GET_TEXT, _GET_UNITS = operator.itemgetter("id"), operator.itemgetter("text"), operator.itemgetter("units")
_GET_MET, _GET_CORRECT = operator.itemgetter("met"), operator.itemgetter("correct")
