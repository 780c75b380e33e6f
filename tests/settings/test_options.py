"""Flags made from settings fields (chatpipe/options.py): name, help and default from the field, and
flag > variable > default when the command builds its settings from the flags it was given."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from typer.testing import CliRunner

from chatpipe.commands.common import build_settings
from chatpipe.options import option


class _Demo(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHATPIPE_DEMO_", frozen=True)
    max_pending: int = Field(32, ge=1, description="Requests in flight before 429")


app = typer.Typer(rich_markup_mode=None)


@app.command()
def serve(max_pending: Annotated[Optional[int], option(_Demo, "max_pending")] = None) -> None:
    typer.echo(build_settings(_Demo, max_pending=max_pending).max_pending)


def test_help_says_the_description_variable_and_default():
    out = CliRunner().invoke(app, ["--help"], terminal_width=200).output
    assert "--max-pending" in out
    assert "Requests in flight before 429 [env CHATPIPE_DEMO_MAX_PENDING; default 32]" in " ".join(out.split())


def test_flag_beats_variable_beats_default(monkeypatch):
    runner = CliRunner()
    assert runner.invoke(app, []).output.strip() == "32"
    monkeypatch.setenv("CHATPIPE_DEMO_MAX_PENDING", "7")
    assert runner.invoke(app, []).output.strip() == "7"
    assert runner.invoke(app, ["--max-pending", "3"]).output.strip() == "3"


def test_the_real_commands_show_their_variables():
    from chatpipe.cli import app as cli

    out = " ".join(CliRunner().invoke(cli, ["gateway", "--help"], terminal_width=200).output.split())
    assert "HTTP port [env CHATPIPE_GATEWAY_PORT; default 8000]" in out
    out = " ".join(CliRunner().invoke(cli, ["cluster", "up", "--help"], terminal_width=200).output.split())
    assert "[env CHATPIPE_CLUSTER_BROKERS; default 3]" in out
