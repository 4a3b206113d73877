"""``python -m creditlab.diagnose.examples [NAME]``: print the path of a shipped example dump."""

from __future__ import annotations

import sys

from creditlab.diagnose.examples import EXAMPLES, example_path


def main(argv: list[str] | None = None) -> int:
    """Print the path of the example named by the first argument (default ``toolshop_fp8``)."""
    args = sys.argv[1:] if argv is None else argv
    name = args[0] if args else "toolshop_fp8"
    if name not in EXAMPLES:
        print(f"error: no example dump {name!r}; examples: {', '.join(EXAMPLES)}", file=sys.stderr)
        return 2
    print(example_path(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
