"""``chatpipe forget USER --tenant T [--conversation C] [--verify]``: erase a user, or check what remains.

Without ``--verify``: produce one ``Deletion`` to ``chat.deletions`` (key ``<tenant>/<user>``, the
log kept forever) and print its event id once the broker has it; the stores erase downstream
(docs/privacy.md). ``USER`` is the user id as the pipeline stores it: what the gateway answered
as ``user_id`` (a multi-user key's users are ``<namespace>:<user>``).

With ``--verify``: search memory, conversation state, the archive, datasets and the topics for
that user's data and print what remains per store, plus which stores acknowledged the user's
deletions (``chatpipe/erasure_verify.py``). Exit code 1 when something remains that a deletion
should have removed, 0 otherwise (copies on topics until retention are listed, not failures).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import BootstrapServers, TopicPrefix, build_settings, console, err_console
from chatpipe.options import option
from streams.cache_settings import CacheSettings  # pydantic only: the flags are made from its fields
from streams.memory_settings import MemorySettings  # pydantic only: the flags are made from its fields
from streams.settings import StreamsSettings



def forget(
    user: Annotated[str, typer.Argument(help="User id as stored (the gateway's answer says it: user_id)")],
    tenant: Annotated[str, typer.Option("--tenant", "-t", help="The user's tenant")],
    conversation: Annotated[Optional[str], typer.Option("--conversation", "-c", help="Only this conversation of the user")] = None,
    verify: Annotated[bool, typer.Option("--verify", help="Do not erase: search every store and report what remains")] = False,
    reason: Annotated[str, typer.Option("--reason", help="Deletion.reason")] = "operator_request",
    archive_dir: Annotated[Optional[Path], option(StreamsSettings, "archive_dir")] = None,
    memory_path: Annotated[Optional[Path], option(MemorySettings, "path", "--memory-path")] = None,
    qdrant_url: Annotated[Optional[str], option(MemorySettings, "url", "--qdrant-url")] = None,
    datasets_dir: Annotated[Optional[Path], typer.Option("--datasets-dir", help="Folder the dataset builds are under (checked with --verify)")] = None,
    cache_url: Annotated[Optional[str], option(CacheSettings, "url", "--cache-url", help="The response cache's Redis "
                                               "(checked with --verify); empty = the local stack's, when it runs")] = None,
    bootstrap_servers: BootstrapServers = None,
    topic_prefix: TopicPrefix = None,
) -> None:
    """Erase a user (or one conversation) from every store, or --verify what remains of them."""
    from transport.admin import TopicAdmin
    from transport.settings import KafkaSettings

    if not user.strip() or not tenant.strip():
        raise typer.BadParameter("USER and --tenant must not be empty")
    if conversation is not None and not conversation.strip():
        raise typer.BadParameter("--conversation must not be empty (leave it out to forget the whole user)")
    kafka = build_settings(KafkaSettings, bootstrap_servers=bootstrap_servers, topic_prefix=topic_prefix)
    TopicAdmin(kafka).check_reachable()
    if verify:
        _verify(kafka, user, tenant, conversation, archive_dir, memory_path, qdrant_url, datasets_dir, cache_url)
    else:
        _produce(kafka, user, tenant, conversation, reason)


def _produce(kafka, user: str, tenant: str, conversation: str | None, reason: str) -> None:
    from schemas.codec import default_codec
    from schemas.errors import ChatpipeError
    from schemas.records import Deletion, DeletionScope
    from schemas.topics import DELETIONS, deletion_key
    from transport import clients
    from transport.partitioning import LIBRDKAFKA_PARTITIONER

    scope = DeletionScope.CONVERSATION if conversation else DeletionScope.USER
    deletion = Deletion(scope=scope, tenant=tenant, user_id=user, conversation_id=conversation, reason=reason)
    outcome: list = []
    producer = clients.producer(kafka, {"acks": "all", "enable.idempotence": True, "message.timeout.ms": 30_000,
                                        "partitioner": LIBRDKAFKA_PARTITIONER})
    topic = kafka.topic(DELETIONS)
    producer.produce(topic, default_codec().encode(deletion), deletion_key(tenant, user),
                     on_delivery=lambda err, _msg: outcome.append(err))
    producer.flush(35)
    if not outcome or outcome[0] is not None:
        raise ChatpipeError(f"the deletion was not stored on {topic} ({outcome[0] if outcome else 'no answer'}); "
                            "nothing will be erased: retry")
    what = f"conversation {conversation} of {tenant}/{user}" if conversation else f"user {tenant}/{user}"
    console.print(f"deletion {deletion.event_id} of {what} is on {topic}; "
                  f"check with: chatpipe forget --verify {user} --tenant {tenant}"
                  f"{f' --conversation {conversation}' if conversation else ''}")


def _verify(kafka, user: str, tenant: str, conversation: str | None, archive_dir: Path | None,
            memory_path: Path | None, qdrant_url: str | None, datasets_dir: Path | None,
            cache_url: str | None = None) -> None:
    from streams.app import changelog_topic
    from chatpipe.commands.cache import local_cache
    from chatpipe.erasure_verify import verify
    from streams.erasures import Subject

    streams = build_settings(StreamsSettings, archive_dir=archive_dir)
    memory = build_settings(MemorySettings, path=memory_path, url=qdrant_url)
    report = verify(kafka, Subject(tenant, user, conversation), memory=memory, archive_dir=streams.archive_dir,
                    datasets_dir=datasets_dir, changelog=changelog_topic(kafka, streams),
                    cache=local_cache(cache_url) or CacheSettings(url=None),
                    progress=lambda line: err_console.print(f"[dim]… {line}[/]"))
    name = f"{tenant}/{user}{f'/{conversation}' if conversation else ''}"
    if report.until_ms is None:
        console.print(f"{name}: no deletion on chat.deletions; everything found counts as remaining")
    else:
        console.print(f"{name}: {len(report.deletions)} deletion(s); the newest covering one was made at "
                      f"{report.until_ms} (epoch ms): what was made by then must be gone")
    for store in report.stores:
        if not store.checked:
            verdict = "not checked"
        elif store.failed:
            verdict = f"REMAINS: {store.remaining}"
        elif not store.must_be_empty:
            verdict = f"{store.remaining} until retention/compaction"
        else:
            verdict = "clean"
        extra = [f"{store.newer} newer (after the deletion)"] if store.newer else []
        extra += [f"{store.affected} affected (built before the deletion)"] if store.affected else []
        console.print(f"{store.store:9} {verdict}{'; ' + ', '.join(extra) if extra else ''}")
        for line in store.details:
            console.print(f"          {line}", highlight=False, soft_wrap=True)
    if report.failed:
        console.print("something remains that the deletion should have removed")
        sys.exit(1)
    console.print("nothing remains that the deletion should have removed")


def register(app: typer.Typer) -> None:
    app.command()(forget)
