"""``chatpipe chat``: an interactive terminal chat against the gateway (clients/chat_session.py).

Streams each answer as it arrives and keeps the conversation; ``/up`` ``/down`` ``/regen``
``/edit <text>`` send feedback on the last answer (to ``chat.feedback``), ``/new`` starts over,
``/quit`` ends. Reads stdin when it is not a terminal, one message or command per line, so it
can be scripted: ``printf 'Hi\\n/up\\n' | chatpipe chat``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import build_settings, err_console, print_error
from chatpipe.options import option
from clients.settings import ClientSettings  # pydantic only: the flags are made from its fields

Url = Annotated[Optional[str], option(ClientSettings, "gateway_url", "--url")]
ApiKey = Annotated[Optional[str], option(ClientSettings, "api_key")]
StateDir = Annotated[Optional[Path], option(ClientSettings, "state_dir",
                                            help="Local stack's state folder, for its keys file")]
Model = Annotated[Optional[str], option(ClientSettings, "chat_model", "--model")]


def fail(exc: Exception) -> typer.Exit:
    """Print ``exc`` as one error line (no wrapping, no markup) and return the exit to raise."""
    print_error(" ".join(str(exc).split()))
    return typer.Exit(1)


def connect(settings):
    """(client, model id) for ``settings``; raises :class:`typer.Exit` after one error line."""
    from clients.gateway_client import GatewayClient
    from clients.settings import find_api_key
    from schemas.errors import ChatpipeError

    try:
        client = GatewayClient(settings.gateway_url, find_api_key(settings), timeout_s=settings.chat_timeout_s)
    except ChatpipeError as exc:
        raise fail(exc) from None
    try:
        model = settings.chat_model or (client.models() or [None])[0]
        if model is None:
            raise fail(RuntimeError(f"the gateway at {settings.gateway_url} lists no model"))
    except ChatpipeError as exc:
        client.close()
        raise fail(exc) from None
    return client, model


def show(text: str) -> None:
    """An answer's text as it streams in: written at once, no newline added."""
    sys.stdout.write(text)
    sys.stdout.flush()


def _terminal_lines():
    while True:
        try:
            yield input("you> ")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D / Ctrl-C at the prompt: leave
            print()
            return


def chat(
    url: Url = None,
    api_key: ApiKey = None,
    state_dir: StateDir = None,
    model: Model = None,
    max_tokens: Annotated[Optional[int], option(ClientSettings, "chat_max_tokens", "--max-tokens", "-n")] = None,
    temperature: Annotated[Optional[float], option(ClientSettings, "chat_temperature", "--temperature")] = None,
) -> None:
    """Chat with the pipeline through the gateway; /up /down /regen /edit <text> /new /quit."""
    from clients.chat_session import HELP, ChatSession, run_chat

    settings = build_settings(ClientSettings, gateway_url=url, api_key=api_key, state_dir=state_dir,
                              chat_model=model, chat_max_tokens=max_tokens, chat_temperature=temperature)
    client, model_id = connect(settings)
    session = ChatSession(client, model=model_id, max_tokens=settings.chat_max_tokens,
                          temperature=settings.chat_temperature, on_text=show)
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401 - line editing and history for input()

        err_console.print(f"chatting with {model_id} at {settings.gateway_url}; {HELP}", markup=False, highlight=False)
    with client:
        failures = run_chat(session, _terminal_lines() if interactive else sys.stdin, out=sys.stdout,
                            err=sys.stderr, echo=not interactive)
    # A script learns from the exit code whether every line went through.
    raise typer.Exit(1 if failures and not interactive else 0)


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)
