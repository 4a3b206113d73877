"""FORK input records: parsing JSONL rows into :class:`ForkItem` with errors naming line and field.

Accepted shapes of one row (one JSON object per line):

* creditlab: ``{"id", "prompt": str, "response": str, "rubrics": [{"criterion", "points"}]}``;
* RubricHub-style: ``prompt`` as a chat message list (``[{"role", "content"}, ...]``) and the
  rubric list under ``Rubrics`` (items may use ``description``/``title`` and ``weight``/``score``);
* HealthBench rubric items: ``{"criterion", "points", "tags"}`` with negative points for pitfalls.

Which field is the response (:data:`RESPONSE_FIELDS`): ``response``, else ``completion``; a row
holding both with different texts is an error (choose with ``response_field``). ``answer``,
``output``, ``reference``, ``gold``... (:data:`REFERENCE_FIELDS`) are read as reference answers and
never scored unless ``response_field`` names one of them: scoring a reference would give it the
maximum reward. A row without a response is an error naming what it holds instead.

A response given as chat messages is every assistant message's text, concatenated in order (blank
line between); other roles are not scored, and the item's ``note`` says what was concatenated or
left out. A message without a ``role`` counts as the assistant's; ``content`` may be a string or a
list of ``{"type": "text", "text"}`` parts.

Numbers: rubric points must be 0 or between :data:`MIN_POINTS` and :data:`MAX_POINTS` in absolute
value (beyond, float32 sums overflow to inf or round to 0 and rewards turn NaN or vacuous).

``id`` falls back to ``prompt_id`` / ``uid`` (in a file where that value is on several rows without
an ``id``, e.g. several responses to one HealthBench prompt, the rows get ``<prompt_id>#1``,
``#2``... in file order, skipping an id another row states itself), then to a stable hash of what
the row holds to score (prompt, response, rubric criteria and points: rows that differ in any of
them get different ids) so that reruns recognise
the row; :attr:`ForkItem.id_from` says which. :attr:`ForkItem.input_hash` identifies what was scored
(prompt, response, rubric criteria and points), so that a resumed run can tell a row whose input
changed under the same id.

Text that is not text: a lone surrogate (a JSON ``"\\ud800"`` escape without its other half) in the
prompt, the response or a rubric criterion makes that item unscorable (:attr:`ForkItem.text_problem`;
it gets its own error row, the others are scored); in the ``id`` it makes the row a bad line (a row
needs an id that can be written).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from creditlab.errors import InputError
from creditlab.judge.base import lone_surrogate, text_problem

__all__ = ["MAX_POINTS", "MIN_POINTS", "REFERENCE_FIELDS", "RESPONSE_FIELDS", "ForkItem", "Rubric",
           "check_jsonl_text", "iter_jsonl_items", "parse_item", "parse_rubrics", "render_messages",
           "render_response"]

#: Fields read as the response, in this order, unless ``response_field`` names another one.
RESPONSE_FIELDS = ("response", "completion")
#: Fields read as reference (gold) answers: never scored unless ``response_field`` names one of them.
REFERENCE_FIELDS = ("answer", "output", "reference", "reference_answer", "reference_response", "gold",
                    "gold_answer", "gold_response", "ideal", "ideal_completion", "ideal_response",
                    "ideal_completions_data", "target", "expected", "expected_output", "ground_truth",
                    "solution")
#: Bounds of ``|points|`` (0 is allowed too): beyond them float32 sums overflow or round to 0.
MAX_POINTS = 1e6
MIN_POINTS = 1e-6


@dataclass(frozen=True)
class Rubric:
    """One weighted criterion; negative ``points`` = pitfall / absence rubric."""

    criterion: str
    points: float
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class ForkItem:
    """One response to score. ``response_field``: the input field it was read from; ``references``:
    reference-answer fields the row also holds (not scored); ``note``: what reading it decided (e.g.
    which chat messages were concatenated), carried into the result's ``note``."""

    id: str
    prompt: str
    response: str
    rubrics: tuple[Rubric, ...] = field(default_factory=tuple)
    response_field: str = "response"
    references: tuple[str, ...] = ()
    note: str | None = None
    id_from: str = "id"
    """Where ``id`` came from: the row's ``id``, ``prompt_id`` or ``uid`` field (``"prompt_id #k"`` when
    numbered), or ``"hash"`` of prompt, response and rubrics (a row without any of them)."""

    @property
    def text_problem(self) -> str | None:
        """Why the prompt, the response or a rubric criterion cannot be sent to a judge or written (a lone
        surrogate), naming the field; None when every text is text."""
        return text_problem([("prompt", self.prompt), (self.response_field, self.response),
                             *((f"rubrics[{k}].criterion", r.criterion) for k, r in enumerate(self.rubrics))])

    @property
    def input_hash(self) -> str:
        """SHA-256 (16 hex digits) of what is scored: prompt, response, rubric criteria and points."""
        return _input_hash(self.prompt, self.response, self.rubrics)


def _input_hash(prompt: str, response: str, rubrics: tuple[Rubric, ...]) -> str:
    data = json.dumps([prompt, response, [[r.criterion, r.points] for r in rubrics]], ensure_ascii=False)
    # surrogatepass: the same bytes as UTF-8 for text, and a hash for an item holding a lone surrogate too
    return hashlib.sha256(data.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _shown(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udXXX`` escapes (for messages and notes)."""
    return text if lone_surrogate(text) is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _first(obj: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for k in keys:
        if k in obj and obj[k] is not None:
            return k, obj[k]
    return None, None


def render_messages(value: Any, where: str, field_name: str, *, last_assistant: bool = False) -> str:
    """A string, a ``{"role", "content"}`` message or a message list rendered as text (``role: content``
    blocks; one message: its content). ``last_assistant``: only the last assistant message's content
    (kept for callers; responses are read by :func:`render_response`)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: field '{field_name}': expected a string or a list of chat messages")
    msgs = []
    for k, m in enumerate(value):
        text = _text(m.get("content")) if isinstance(m, dict) else None
        if text is None:
            raise InputError(f"{where}: field '{field_name}[{k}]': expected a message with a string 'content' (or "
                             "a list of text parts)")
        msgs.append((str(m.get("role", "user")), text))
    if last_assistant:
        answers = [c for r, c in msgs if r == "assistant"]
        return answers[-1] if answers else msgs[-1][1]
    if len(msgs) == 1:
        return msgs[0][1]
    return "\n\n".join(f"{r}: {c}" for r, c in msgs)


def _text(content: Any) -> str | None:
    """A message's text: a string, or the joined text of ``{"type": "text", "text"}`` parts; None when
    it holds no text (e.g. an assistant message that only calls tools)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        texts = [p["text"] for p in content if p.get("type", "text") == "text" and isinstance(p.get("text"), str)]
        return "\n".join(texts) if texts else None
    return None


def render_response(value: Any, where: str, field_name: str = "response") -> tuple[str, str | None]:
    """The text scored for a response and a note saying what was taken (None when nothing needs saying).

    A string is the response. A message or a message list: the text of every assistant message
    (a message without ``role`` counts as one), concatenated in order with a blank line between;
    messages of other roles, and assistant messages without text, are not scored and the note says
    so. No assistant text at all is an :class:`InputError` naming ``where`` and the field.
    """
    if isinstance(value, str):
        return value, None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: field '{field_name}': expected a string or a list of chat messages")
    scored: list[str] = []
    skipped: dict[str, int] = {}
    for k, m in enumerate(value):
        if not isinstance(m, dict):
            raise InputError(f"{where}: field '{field_name}[{k}]': expected a message object with 'role' and "
                             "'content'")
        role = m.get("role", "assistant")
        text = _text(m.get("content"))
        if m.get("content") is not None and text is None:
            raise InputError(f"{where}: field '{field_name}[{k}].content': expected a string or a list of text "
                             "parts")
        if role == "assistant" and text is not None:
            scored.append(text)
        else:
            what = _shown(str(role)) if role != "assistant" else "assistant (no text)"
            skipped[what] = skipped.get(what, 0) + 1
    if not scored:
        raise InputError(f"{where}: field '{field_name}': the message list holds no assistant message with text "
                         "to score")
    if len(scored) == 1 and not skipped:
        return scored[0], None
    note = f"response: {len(scored)} assistant message(s) of '{field_name}' scored, concatenated in order"
    if skipped:
        note += "; not scored: " + ", ".join(f"{n} {r} message(s)" for r, n in skipped.items())
    return "\n\n".join(scored), note


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
        if pts != 0 and not MIN_POINTS <= abs(pts) <= MAX_POINTS:
            shown = (f"{pts:.3g}" if isinstance(pts, float) or abs(pts) < 10**20
                     else f"an integer of {len(str(abs(pts)))} digits")
            raise InputError(f"{where}: field '{here}.{pk or 'points'}': {shown} is out of range: points must be 0 or "
                             f"between {MIN_POINTS:g} and {MAX_POINTS:g} in absolute value")
        tags = r.get("tags", ())
        if not isinstance(tags, list | tuple) or not all(isinstance(t, str) for t in tags):
            raise InputError(f"{where}: field '{here}.tags': expected a list of strings")
        out.append(Rubric(crit.strip(), float(pts), tuple(tags)))
    return tuple(out)


def _response(obj: dict[str, Any], where: str, response_field: str | None) -> tuple[str, str, str | None]:
    """``(field, text, note)`` of the row's response under the documented rule (module docstring)."""
    if response_field is not None:
        if obj.get(response_field) is None:
            raise InputError(f"{where}: field '{response_field}': missing (named by --response-field)")
        text, note = render_response(obj[response_field], where, response_field)
        return response_field, text, note
    present = [k for k in RESPONSE_FIELDS if obj.get(k) is not None]
    if not present:
        refs = [k for k in REFERENCE_FIELDS if obj.get(k) is not None]
        hint = ""
        if refs:
            hint = (f"; the row has {', '.join(repr(k) for k in refs)}, read as a reference answer and never "
                    f"scored as the response: if it holds the response to score, pass --response-field {refs[0]}")
        raise InputError(f"{where}: field 'response': missing (the response is read from "
                         f"{' or '.join(repr(k) for k in RESPONSE_FIELDS)}){hint}")
    rendered = [(k, *render_response(obj[k], where, k)) for k in present]
    if len({text for _, text, _ in rendered}) > 1:
        raise InputError(f"{where}: fields {' and '.join(repr(k) for k in present)} both hold a response and "
                         "they differ: pass --response-field to choose the one to score")
    return rendered[0]


def parse_item(obj: Any, where: str = "record", *, response_field: str | None = None) -> ForkItem:
    """One row (decoded JSON) into a :class:`ForkItem`; :class:`InputError` names ``where`` and the field.

    ``response_field``: the field holding the response (default: :data:`RESPONSE_FIELDS` in order).
    """
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    pk, prompt = _first(obj, ("prompt", "question", "messages"))
    if prompt is None:
        raise InputError(f"{where}: field 'prompt': missing")
    prompt_s = render_messages(prompt, where, pk or "prompt")
    rk, response_s, note = _response(obj, where, response_field)
    bk, rubrics = _first(obj, ("rubrics", "Rubrics", "rubric"))
    if rubrics is None:
        raise InputError(f"{where}: field 'rubrics': missing")
    parsed = parse_rubrics(rubrics, where, bk or "rubrics")
    ik, ident = _first(obj, ("id", "prompt_id", "uid"))
    if ident is None:  # everything that makes the row an item of its own: rows differing in any differ here
        ident = hashlib.sha1(json.dumps([prompt_s, response_s, [[r.criterion, r.points] for r in parsed]])
                             .encode()).hexdigest()[:16]
        ik = "hash"
    elif isinstance(ident, bool) or not isinstance(ident, str | int):
        raise InputError(f"{where}: field '{ik}': expected a string or an integer, got {ident!r}")
    elif isinstance(ident, str) and lone_surrogate(ident) is not None:
        raise InputError(f"{where}: field '{ik}': {ident!r} holds a lone surrogate (a '\\ud800'-style escape without "
                         "its other half), which cannot be written as a row's id; fix that character")
    refs = tuple(k for k in REFERENCE_FIELDS if k != rk and obj.get(k) is not None)
    if refs:
        also = f"scored '{rk}'; not scored: {', '.join(repr(k) for k in refs)} (read as a reference answer)"
        note = also if note is None else f"{note}; {also}"
    return ForkItem(str(ident), prompt_s, response_s, parsed, response_field=rk, references=refs, note=note,
                    id_from=ik or "hash")


_FORMAT_HINT = "expected JSON Lines: one JSON object per line, e.g. {\"id\", \"prompt\", \"response\", \"rubrics\"}"


def check_jsonl_text(text: str, name: str) -> None:
    """Raise one :class:`InputError` when ``text`` is not JSON Lines at all (a JSON array, one
    pretty-printed JSON document, CSV or TSV) instead of one error per line.

    A file in which some line among its first 50 non-blank lines is a JSON object is JSON Lines
    (its bad lines are reported one by one when read).
    """
    text = text.lstrip("\ufeff")
    lines = [ln.lstrip("\ufeff").strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln][:50]
    if not lines:
        return
    for ln in lines:
        try:
            if isinstance(json.loads(ln), dict):
                return
        except (ValueError, RecursionError):
            continue
    head = lines[0]
    if head.startswith("["):
        raise InputError(f"{name} is a JSON array, not JSON Lines; {_FORMAT_HINT} "
                         f"(convert it with: jq -c '.[]' {name} > {Path(name).stem}.jsonl)")
    if head.startswith("{"):
        raise InputError(f"{name} holds JSON spread over several lines (pretty-printed), not JSON Lines; "
                         f"{_FORMAT_HINT} (convert it with: jq -c . {name})")
    for sep, kind in (("\t", "TSV"), (",", "CSV")):
        if sep in head:
            raise InputError(f"{name} looks like {kind} (first line {head[:60]!r}), not JSON Lines; {_FORMAT_HINT}")
    raise InputError(f"{name} is not JSON Lines (no line is a JSON object; line 1 is {head[:60]!r}); "
                     f"{_FORMAT_HINT}")


def iter_jsonl_items(path: str | Path, *, response_field: str | None = None
                     ) -> Iterator[tuple[int, ForkItem | InputError]]:
    """Yield ``(line_number, item or the InputError of that line)``; blank lines are skipped.

    A UTF-8 byte order mark is ignored. Rows without an ``id`` whose ``prompt_id`` (or ``uid``) is on
    several such rows of the file get the id ``<prompt_id>#<k>``, k = 1, 2... in file order, skipping a
    ``k`` whose id another row of the file states itself (its ``id``, or a ``prompt_id`` on one row only).
    """
    rows: list[tuple[int, str, Any]] = []
    with open(path, encoding="utf-8-sig") as fh:
        for n, line in enumerate(fh, start=1):
            line = line.lstrip("\ufeff")
            if not line.strip():
                continue
            where = f"{Path(path).name}:{n}"
            try:
                obj: Any = json.loads(line)
            except json.JSONDecodeError as err:
                obj = InputError(f"{where}: not valid JSON ({err.msg} at column {err.colno})")
            except (ValueError, RecursionError) as err:  # an integer of > 4300 digits, nesting too deep
                obj = InputError(f"{where}: not valid JSON ({type(err).__name__}: {str(err)[:80] or 'too deep'})")
            rows.append((n, where, obj))
    keys: Counter[str] = Counter(k for _, _, o in rows if (k := _group_key(o)) is not None)
    # the ids rows state themselves (an 'id', or a prompt_id / uid on one row only): a generated
    # '<prompt_id>#k' never takes one, wherever in the file it is stated
    stated = {i for _, _, o in rows if (i := _stated_id(o, keys)) is not None}
    index: Counter[str] = Counter()
    for n, where, obj in rows:
        if isinstance(obj, InputError):
            yield n, obj
            continue
        key = _group_key(obj)
        if key is not None and keys[key] > 1:
            index[key] += 1  # counted on bad rows too: fixing one does not renumber the others
            while f"{key}#{index[key]}" in stated:
                index[key] += 1
        try:
            item = parse_item(obj, where, response_field=response_field)
        except InputError as err:
            yield n, err
            continue
        if key is not None and keys[key] > 1:
            item = replace(item, id=f"{key}#{index[key]}", id_from=f"{item.id_from} #k")
        yield n, item


def _stated_id(obj: Any, keys: Counter[str]) -> str | None:
    """The id a row states itself, as text: its ``id``, else its ``prompt_id`` / ``uid`` when no other row
    without ``id`` has that value (``keys``); None for a row named by a hash or numbered ``#k``."""
    if not isinstance(obj, dict):
        return None
    ident = obj.get("id")
    if ident is None:
        key = _group_key(obj)
        return key if key is not None and keys[key] == 1 else None
    return str(ident) if isinstance(ident, str | int) and not isinstance(ident, bool) else None


def _group_key(obj: Any) -> str | None:
    """The ``prompt_id`` / ``uid`` a row without ``id`` is named by (None: it has an ``id`` or neither)."""
    if not isinstance(obj, dict) or obj.get("id") is not None:
        return None
    _, key = _first(obj, ("prompt_id", "uid"))
    return str(key) if isinstance(key, str | int) and not isinstance(key, bool) else None
