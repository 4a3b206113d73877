"""The typer apps. Command modules import these and register their commands on them."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="creditlab",
    help="Find and fix the silent failures of agentic RL training: reward, execution, credit.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
lab_app = typer.Typer(help="Run a lab: reproduce a failure and its fix on a CPU.", no_args_is_help=True)
fork_app = typer.Typer(help="FORK reward: score rubric-graded responses.", no_args_is_help=True)

app.add_typer(lab_app, name="lab")
app.add_typer(fork_app, name="fork")
# `creditlab diagnose DUMP...` is a single command on `app` itself (cli/diagnose_cmd.py): a sub-app
# group would need a sub-command name before the dump paths.
