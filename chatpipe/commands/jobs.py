"""Placeholder until this command group is built; registers nothing."""

import typer


def register(app: typer.Typer) -> None:
    return None
