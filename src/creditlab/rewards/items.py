"""FORK input records: parsing JSONL rows into :class:`ForkItem` with errors naming line and field.

Accepted shapes of one row (one JSON object per line):

* creditlab: ``{"id", "prompt": str, "response": str, "rubrics": [{"criterion", "points"}]}``;
* RubricHub-style: ``prompt`` as a chat message list (``[{"role", "content"}, ...]``) and the
  rubric list under ``Rubrics`` (items may use ``description``/``title`` and ``weight``/``score``);
* HealthBench rubric items: ``{"criterion", "points", "tags"}`` with negative points for pitfalls.

The response is read from ``response`` (or ``completion`` / ``answer`` / ``output``; a message or
message list takes the last assistant content). ``id`` falls back to ``prompt_id`` / ``uid``, then
to a stable hash of prompt and response so that reruns recognise the row.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from creditlab.errors import InputError

__all__ = ["ForkItem", "Rubric", "iter_jsonl_items", "parse_item", "parse_rubrics", "render_messages"]


@dataclass(frozen=True)
class Rubric:
    """One weighted criterion; negative ``points`` = pitfall / absence rubric."""

    criterion: str
    points: float
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class ForkItem:
    id: str
    prompt: str
    response: str
    rubrics: tuple[Rubric, ...] = field(default_factory=tuple)


def _first(obj: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for k in keys:
        if k in obj and obj[k] is not None:
            return k, obj[k]
    return None, None


def render_messages(value: Any, where: str, field_name: str, *, last_assistant: bool = False) -> str:
    """A string, a ``{"role", "content"}`` message or a message list rendered as text."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: field '{field_name}': expected a string or a list of chat messages")
    msgs = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise InputError(f"{where}: field '{field_name}[{k}]': expected a message with a string 'content'")
        msgs.append((str(m.get("role", "user")), m["content"]))
    if last_assistant:
        answers = [c for r, c in msgs if r == "assistant"]
        return answers[-1] if answers else msgs[-1][1]
    if len(msgs) == 1:
        return msgs[0][1]
    return "\n\n".join(f"{r}: {c}" for r, c in msgs)


def parse_rubrics(value: Any, where: str, field_name: str = "rubrics") -> tuple[Rubric, ...]:
    """Parse a rubric list (or its JSON string) into :class:`Rubric` records."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise InputError(f"{where}: field '{field_name}': a string that is not a JSON rubric list") from None
    if not isinstance(value, list):
        raise InputError(f"{where}: field '{field_name}': expected a list of rubric objects")
    out = []
    for k, r in enumerate(value):
        here = f"{field_name}[{k}]"
        if not isinstance(r, dict):
            raise InputError(f"{where}: field '{here}': expected an object with 'criterion' and 'points'")
        ck, crit = _first(r, ("criterion", "description", "title", "rubric"))
        if not isinstance(crit, str) or not crit.strip():
            raise InputError(f"{where}: field '{here}.criterion': missing or not a non-empty string")
        pk, pts = _first(r, ("points", "weight", "score"))
        if isinstance(pts, bool) or not isinstance(pts, int | float) or pts != pts or abs(pts) == float("inf"):
            raise InputError(f"{where}: field '{here}.{pk or 'points'}': expected a finite number, got {pts!r}")
        tags = r.get("tags", ())
        if not isinstance(tags, list | tuple) or not all(isinstance(t, str) for t in tags):
            raise InputError(f"{where}: field '{here}.tags': expected a list of strings")
        out.append(Rubric(crit.strip(), float(pts), tuple(tags)))
    return tuple(out)


def parse_item(obj: Any, where: str = "record") -> ForkItem:
    """One row (decoded JSON) into a :class:`ForkItem`; :class:`InputError` names ``where`` and the field."""
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    pk, prompt = _first(obj, ("prompt", "question", "messages"))
    if prompt is None:
        raise InputError(f"{where}: field 'prompt': missing")
    prompt_s = render_messages(prompt, where, pk or "prompt")
    rk, response = _first(obj, ("response", "completion", "answer", "output"))
    if response is None:
        raise InputError(f"{where}: field 'response': missing")
    response_s = render_messages(response, where, rk or "response", last_assistant=True)
    bk, rubrics = _first(obj, ("rubrics", "Rubrics", "rubric"))
    if rubrics is None:
        raise InputError(f"{where}: field 'rubrics': missing")
    parsed = parse_rubrics(rubrics, where, bk or "rubrics")
    ik, ident = _first(obj, ("id", "prompt_id", "uid"))
    if ident is None:
        ident = hashlib.sha1(json.dumps([prompt_s, response_s]).encode()).hexdigest()[:16]
    elif not isinstance(ident, str | int):
        raise InputError(f"{where}: field '{ik}': expected a string or an integer")
    return ForkItem(str(ident), prompt_s, response_s, parsed)


def iter_jsonl_items(path: str | Path) -> Iterator[tuple[int, ForkItem | InputError]]:
    """Yield ``(line_number, item or the InputError of that line)``; blank lines are skipped."""
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{Path(path).name}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                yield n, InputError(f"{where}: not valid JSON ({err.msg} at column {err.colno})")
                continue
            try:
                yield n, parse_item(obj, where)
            except InputError as err:
                yield n, err
