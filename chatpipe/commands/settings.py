"""``chatpipe settings docs [--write | --check]``: every CHATPIPE_* variable, from the settings classes."""

from __future__ import annotations

from typing import Annotated

import typer

settings_app = typer.Typer(help="The CHATPIPE_* variables of every settings class.", no_args_is_help=True)


@settings_app.command("docs")
def docs(
    write: Annotated[bool, typer.Option("--write", help="Write docs/settings.md instead of printing it")] = False,
    check: Annotated[bool, typer.Option("--check", help="Exit 1 when docs/settings.md is not what the classes say")] = False,
) -> None:
    """Print (or write, or check) docs/settings.md: name, type, default, owner and help of every variable."""
    from chatpipe import settings_doc

    code = settings_doc.main(["--write"] if write else ["--check"] if check else [])
    if code:
        raise typer.Exit(code)


@settings_app.command("check")
def check_unique() -> None:
    """Exit 1 when one variable is defined by two settings classes with different defaults or types."""
    from chatpipe import settings_doc
    from chatpipe.commands.common import print_error

    problems = settings_doc.conflicts()
    for line in problems:
        print_error(line)
    if problems:
        raise typer.Exit(1)
    typer.echo(f"{len({e.name for e in settings_doc.all_entries()})} variables, one definition each")


def register(app: typer.Typer) -> None:
    app.add_typer(settings_app, name="settings")
