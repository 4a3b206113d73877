"""Griffe extension for the API reference: two docstring habits of this code base, rendered well.

* Bare doctest blocks (``>>>`` lines and their output, outside an ``Examples:`` section) become
  fenced Python code; Markdown would otherwise read them as nested block quotes and their
  ``[...]`` outputs as links.
* An ``Args:`` entry documenting several parameters at once (``backoff_base, backoff_max: ...``)
  becomes one entry per parameter, so each is checked against the signature and none is reported
  as unknown.

* Sphinx roles (``:class:`~creditlab.judge.base.JudgeError```) become inline code of the name they
  show (``JudgeError``), instead of a stray ``:class:`` before it.

The docstrings themselves are unchanged; doctests still run them as written.
"""

from __future__ import annotations

import re

import griffe

_SECTION = re.compile(r"^(Args|Arguments|Parameters|Keyword Args|Keyword Arguments|Other Parameters):\s*$")
_ROLE = re.compile(r":(?:class|func|meth|data|attr|mod|exc|obj|const):`(~?)([^`]+)`")
_MULTI = re.compile(r"^(\s+)([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)+)(\s*(?:\([^)]*\))?\s*:\s*)(.*)$")


def rewrite(text: str) -> str:
    """The docstring ``text`` with bare doctest blocks fenced and multi-name parameter entries split."""
    out: list[str] = []
    lines = text.split("\n")
    in_args = in_fence = False
    entry_indent: int | None = None  # indentation of the entries of the current Args section
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith("```"):
            in_fence = not in_fence
        if in_fence:
            out.append(line)
            i += 1
            continue
        if _SECTION.match(line):
            in_args, entry_indent = True, None
        elif line and not line[0].isspace():
            in_args = False
        elif in_args and stripped and entry_indent is None:
            entry_indent = len(line) - len(line.lstrip())
        if stripped.startswith(">>>") and not line[0].isspace():
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i])
                i += 1
            out += ["```python", *block, "```"]
            continue
        m = _MULTI.match(line) if in_args and len(line) - len(line.lstrip()) == entry_indent else None
        if m:
            indent, names, sep, desc = m.groups()
            first, *rest = [n.strip() for n in names.split(",")]
            out.append(f"{indent}{first}{sep}{desc}")
            j = i + 1
            while j < len(lines) and lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) > len(indent):
                out.append(lines[j])  # the description's continuation lines stay with the first name
                j += 1
            out += [f"{indent}{name}: See `{first}`." for name in rest]
            i = j
            continue
        out.append(_ROLE.sub(_role, line))
        i += 1
    return "\n".join(out)


def _role(m: re.Match) -> str:
    name = m.group(2)
    return f"`{name.rsplit('.', 1)[-1] if m.group(1) else name}`"


class DocstringHabits(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and (">>>" in obj.docstring.value or "," in obj.docstring.value
                                           or ":`" in obj.docstring.value):
            obj.docstring.value = rewrite(obj.docstring.value)
