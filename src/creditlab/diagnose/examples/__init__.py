"""Example rollout dumps shipped with the package, to try ``creditlab diagnose`` on.

``toolshop_fp8``: 64 trajectories (4 steps x 16 tasks in groups of 4) of the toolshop agent, sampled
by an FP8 (W8A8-KV8) rollout engine and scored by an fp32 learner; the same rows as
``docs/examples/toolshop_fp8.jsonl`` of the source tree (``docs/examples/make_toolshop_dump.py``
writes it), gzipped. ``python -m creditlab.diagnose.examples`` prints its path::

    creditlab diagnose "$(python -m creditlab.diagnose.examples)" --out runs/diagnose-example
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["EXAMPLES", "example_path"]

#: Example name -> file name in this package's directory.
EXAMPLES = {"toolshop_fp8": "toolshop_fp8.jsonl.gz"}


def example_path(name: str = "toolshop_fp8") -> Path:
    """The path of the example dump ``name`` (a ``.jsonl.gz`` file ``creditlab diagnose`` reads).

    Raises :class:`KeyError` naming the examples for an unknown name.

    >>> example_path().name
    'toolshop_fp8.jsonl.gz'
    """
    if name not in EXAMPLES:
        raise KeyError(f"no example dump {name!r}; examples: {', '.join(EXAMPLES)}")
    return Path(__file__).with_name(EXAMPLES[name])
