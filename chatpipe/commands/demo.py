"""``chatpipe demo``: a short scripted conversation through the gateway (clients/demo.py).

The last step of the README's run command: it shows streaming and recall of an earlier fact,
prints per-turn time to first token and tokens, then how to chat and how to stop the stack.
Exits 1 when the recall turn's answer lacks the fact (the answer is printed either way).
"""

from __future__ import annotations

from typing import Annotated

import typer

from chatpipe.commands.chat import ApiKey, Model, StateDir, Url, connect, fail, show
from chatpipe.commands.common import build_settings


def demo(
    url: Url = None,
    api_key: ApiKey = None,
    state_dir: StateDir = None,
    model: Model = None,
    wait_s: Annotated[float, typer.Option("--wait-s", min=0, help="Wait this long for the gateway to become ready")] = 120.0,
) -> None:
    """Run a short scripted conversation through the gateway: streaming, then recall of turn 1's fact."""
    import sys

    from clients.chat_session import ChatSession
    from clients.demo import MAX_TOKENS, run_demo, summary
    from clients.gateway_client import GatewayClient
    from clients.settings import ClientSettings
    from schemas.errors import ChatpipeError

    settings = build_settings(ClientSettings, gateway_url=url, api_key=api_key, state_dir=state_dir, chat_model=model)
    try:
        with GatewayClient(settings.gateway_url, None, timeout_s=10) as probe:  # /healthz needs no key
            probe.wait_healthy(wait_s)
    except ChatpipeError as exc:
        raise fail(exc) from None
    client, model_id = connect(settings)
    out = sys.stdout
    # temperature 0: the same answers every run, so the recall turn is reliable with a small model
    session = ChatSession(client, model=model_id, max_tokens=MAX_TOKENS, temperature=0.0, on_text=show)
    out.write(f"chatpipe demo: {model_id} through the gateway at {settings.gateway_url} "
              f"(answers stream as they are generated; at most {MAX_TOKENS} tokens each)\n")
    try:
        with client:
            result = run_demo(session, out)
    except ChatpipeError as exc:
        out.write("\n")
        raise fail(exc) from None
    for line in summary(result):
        out.write(line + "\n")
    out.write("\nChat with it:   .venv/bin/chatpipe chat\n"
              "Watch turns:    .venv/bin/chatpipe tail chat.turns\n"
              "Stop the stack: .venv/bin/chatpipe down\n")
    out.flush()
    raise typer.Exit(0 if result.recalled else 1)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
