"""Topic names come from the catalog only (schemas/topics.py), through ``KafkaSettings.topic()``, so a
``CHATPIPE_TOPIC_PREFIX`` deployment cannot miss one (issue 24).

Two checks: no string literal that starts with ``chat.`` outside schemas/topics.py in the code of
the tiers (docstrings and comments may name topics), and the gateway and worker paths that used to
carry their own literals produce to / read from the prefixed names.
"""

from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path

import schemas.topics as topics
from schemas.topics import BY_NAME, CATALOG

REPO = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("inference", "streams", "clients", "chatpipe", "spark_jobs", "transport", "schemas")
CATALOG_MODULE = REPO / "schemas" / "topics.py"
#: "chat."-strings that are not topics: the OpenAI API's object types.
NOT_TOPICS = {"chat.completion", "chat.completion.chunk"}
PREFIX = "p."


def docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (module, class, function)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def topic_literals(path: Path) -> list[str]:
    """``file:line: 'literal'`` for every string constant (f-string parts too) starting with ``chat.``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = docstring_nodes(tree)
    hits = sorted((node.lineno, node.col_offset, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                  and node.value.startswith("chat.") and node.value not in NOT_TOPICS)
    return [f"{path.relative_to(REPO)}:{line}: {value!r}" for line, _, value in hits]


def test_no_topic_name_literal_outside_the_catalog():
    files = [p for d in SOURCE_DIRS for p in sorted((REPO / d).rglob("*.py")) if p != CATALOG_MODULE]
    assert len(files) > 50, "the source tree was not found"
    found = [hit for path in files for hit in topic_literals(path)]
    assert not found, ("topic names written as literals (use a name from schemas/topics.py through "
                       "KafkaSettings.topic()):\n" + "\n".join(found))


def test_the_scan_sees_a_literal_in_code_and_not_in_a_docstring(tmp_path, monkeypatch):
    """The check itself: a literal in code is reported with its line, a docstring naming a topic is not."""
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    source = tmp_path / "mod.py"
    source.write_text('"""Reads ``chat.prompts``."""\n\ndef f(kafka):\n    """To chat.turns."""\n'
                      '    # chat.turns in a comment\n    return kafka.topic("chat.turns"), f"chat.replies.{kafka}", '
                      '"chat.completion"\n')
    assert topic_literals(source) == ["mod.py:6: 'chat.turns'", "mod.py:6: 'chat.replies.'"]


def test_every_name_constant_is_a_catalog_topic_and_every_topic_has_one():
    names = {value for attr, value in vars(topics).items()
             if attr.isupper() and isinstance(value, str) and value.startswith("chat.")}
    assert names <= set(BY_NAME), f"constants not in CATALOG: {sorted(names - set(BY_NAME))}"
    assert {spec.name for spec in CATALOG} <= names, f"no constant for {sorted({s.name for s in CATALOG} - names)}"


# -- the paths that had their own literals, under a prefix -----------------------------------------


class Recorder:
    """A producer that keeps (topic, record) and acknowledges at once."""

    def __init__(self, settings) -> None:
        self.settings = settings
        self.sent: list[tuple[str, object]] = []

    def send(self, topic, record, *, want_ack=True, **_):
        self.sent.append((topic, record))
        if want_ack:
            future = asyncio.get_running_loop().create_future()
            future.set_result(None)
            return future
        return None


async def test_gateway_sends_prompts_cancels_and_feedback_to_prefixed_topics(monkeypatch):
    from gateway import replies
    from gateway.keys import Principal
    from gateway.metrics import GatewayMetrics
    from gateway.openai_api import ChatCompletionRequest
    from gateway.service import GatewayService
    from gateway.settings import GatewaySettings
    from schemas.records import FeedbackKind
    from tests.gateway.test_gateway_units import FakeReader
    from transport.settings import KafkaSettings

    kafka = KafkaSettings(topic_prefix=PREFIX)
    created = []

    class Admin:
        def __init__(self, *_args, **_kwargs) -> None:
            pass

        def create_topic(self, name, partitions, config, exist_ok=False):
            created.append((name, partitions))

    monkeypatch.setattr(replies, "TopicAdmin", Admin)
    assert replies.ensure_reply_topic(kafka, "gw1", 3_600_000) == "p.chat.replies.gw1" == created[0][0]

    service = GatewayService(kafka, GatewaySettings(), GatewayMetrics())
    service.reply_topic, service.producer, service.reader = "p.chat.replies.gw1", Recorder(kafka), FakeReader()
    principal = Principal("acme", "ada", mac_secret=b"secret")  # feedback checks the request id's MAC
    body = ChatCompletionRequest(model="smollm2-135m-instruct", messages=[{"role": "user", "content": "hi"}])
    sub = await service.submit(principal, body, "conv-1", time.perf_counter())
    service.cancel(sub, "client_disconnected")
    await service.feedback(principal, request_id=sub.request_id, conversation_id="conv-1", kind=FeedbackKind.THUMBS_UP,
                           edited_text=None, comment=None, user=None)
    assert [t for t, _ in service.producer.sent] == ["p.chat.prompts", "p.chat.cancels", "p.chat.feedback"]


async def test_worker_sends_responses_and_follows_cancels_and_deletions_on_prefixed_topics(monkeypatch):
    from inference.worker.cancels import CancelListener
    from inference.worker.deletions import DeletionListener
    from inference.worker.replies import send_response
    from schemas.codec import default_codec
    from schemas.records import FinishReason, Response
    from transport import broadcast
    from transport.settings import KafkaSettings

    kafka = KafkaSettings(topic_prefix=PREFIX)
    producer = Recorder(kafka)
    await send_response(producer, Response(request_id="r", conversation_id="c", user_id="u", tenant="t", text="x",
                                           model="m", worker_id="w", tokens_in=1, tokens_out=1, queue_ms=0.0,
                                           ttft_ms=0.0, total_ms=0.0, finish_reason=FinishReason.STOP, created_at=1),
                        attempt="a1", parent_trace=None)
    assert [t for t, _ in producer.sent] == ["p.chat.responses"]

    followed = []

    class Tail:
        def __init__(self, _kafka, *, topics, **_kwargs) -> None:
            followed.extend(topics)

        def poll_messages(self, *_args):
            time.sleep(0.01)
            return []

        def close(self) -> None:
            pass

    monkeypatch.setattr(broadcast, "TailReader", Tail)
    loop = asyncio.get_running_loop()
    for listener in (CancelListener(kafka, default_codec()), DeletionListener(kafka, default_codec())):
        listener.start(loop, lambda _record: None, lambda exc: None)
        listener.close()
    assert followed == ["p.chat.cancels", "p.chat.deletions"]
