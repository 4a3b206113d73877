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


def _print_version(value: bool) -> None:
    if value:
        from creditlab import __version__

        typer.echo(f"creditlab {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version (creditlab X.Y.Z) and exit."),
) -> None:
    # the app's help is the Typer(help=...) above; this callback only carries the global --version
    pass


lab_app = typer.Typer(help="Run a lab: reproduce a failure and its fix on a CPU.", no_args_is_help=True)
fork_app = typer.Typer(help="FORK reward: score rubric-graded responses.", no_args_is_help=True)

app.add_typer(lab_app, name="lab")
app.add_typer(fork_app, name="fork")
# `creditlab diagnose DUMP...` is a single command on `app` itself (cli/diagnose_cmd.py): a sub-app
# group would need a sub-command name before the dump paths.
