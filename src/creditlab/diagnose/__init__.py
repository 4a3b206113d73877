"""Diagnostics on rollout dumps: read a dump, run the checks, write a report.

The schema of a rollout dump (``schema``), its readers (``readers``), the checks (``checks``), the
plots and the report (``report``). Layering: uses ``creditlab.core`` (the metrics) only, never the
trainers or the lab machinery; ``creditlab.train`` and ``creditlab.integrations`` write dumps in its
schema.
"""

from creditlab.diagnose.checks import CHECKS, CheckResult, Threshold, register_check, run_checks
from creditlab.diagnose.readers import Dump, read_dump
from creditlab.diagnose.schema import COLUMNS, rows_from_arrays, write_dump

__all__ = [
    "CHECKS",
    "COLUMNS",
    "CheckResult",
    "Dump",
    "Threshold",
    "read_dump",
    "register_check",
    "rows_from_arrays",
    "run_checks",
    "write_dump",
]
