"""Command-line interface (typer). Registries of names live here, at the edge."""
