"""The erasure canary (issue 19): one user's data in every store, one DELETE, then nothing of it left.

Through the real stack (the gateway tests' ``pipeline``, ``chatpipe/testing/gateway.py``: ``chatpipe streams``,
an inference worker with the default model, a gateway, on the session's broker under a topic prefix of
its own, shared with the gateway tests): a user
tells facts in three conversations and gives feedback; the archive is flushed and a dataset is
built from it (Spark local); ``DELETE /v1/users/{user}``; within the time docs/privacy.md states
for memory, state and archive (seconds: the audits of ``streams.forget`` and ``streams.archive``),
``chatpipe forget --verify`` finds nothing in memory, state, the archive and a dataset built after
the deletion, and reports the dataset built before it as affected. Another user's data stays.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

from chatpipe.testing.streams import REPO, Tap
from schemas.codec import default_codec
from schemas.records import DeletionAudit

pytestmark = [pytest.mark.integration, pytest.mark.model]
MODEL = "smollm2-135m-instruct"
#: docs/privacy.md: memory, conversation state and the archive are erased within seconds of the
#: Deletion reaching the streams worker; a loaded 2-core machine gets a generous margin.
ERASED_WITHIN_S = 60


@pytest.fixture(scope="module")
def stack(pipeline):
    """The folder's whole pipeline (tests/gateway/conftest.py), shared with the gateway tests: the canary's users
    are its own (a run id in their names), and every check below is about them alone."""
    return pipeline


def auth() -> dict[str, str]:
    from chatpipe.testing.gateway import API_KEY

    return {"Authorization": f"Bearer {API_KEY}"}


def tell(url: str, user: str, conversation: str, text: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "system", "content": "Answer briefly."},
                                         {"role": "user", "content": text}],
            "max_tokens": 12, "temperature": 0, "user": user}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300,
                        headers={**auth(), "X-Chatpipe-Conversation-Id": conversation})
    assert answer.status_code == 200, answer.text
    return answer


def build_dataset(stack, out: Path) -> None:
    now = int(time.time() * 1000)
    result = subprocess.run(
        [sys.executable, "-m", "chatpipe.cli", "job", "finetune-dataset", "--out", str(out), "--source", "archive",
         "--archive-dir", str(stack.streams.archive_dir), "--topic-prefix", stack.kafka.topic_prefix,
         "--since", str(now - 3_600_000), "--until", str(now + 3_600_000), "--master", "local[2]",
         "--shuffle-partitions", "2", "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def forget_verify(stack, user_id: str, datasets: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "chatpipe.cli", "forget", "--verify", user_id, "--tenant", "acme",
         "--archive-dir", str(stack.streams.archive_dir), "--memory-path", str(stack.streams.memory_dir),
         "--datasets-dir", str(datasets), "--bootstrap-servers", stack.kafka.bootstrap_servers,
         "--topic-prefix", stack.kafka.topic_prefix],
        cwd=REPO, capture_output=True, text=True, timeout=600)


def report_of(stack, user_id: str, datasets: Path):
    from chatpipe.erasure_verify import verify
    from streams.app import changelog_topic
    from streams.erasures import Subject
    from streams.memory_settings import MemorySettings
    from streams.settings import StreamsSettings

    return {s.store: s for s in verify(stack.kafka, Subject("acme", user_id, None),
                                       memory=MemorySettings(path=stack.streams.memory_dir),
                                       archive_dir=stack.streams.archive_dir, datasets_dir=datasets,
                                       changelog=changelog_topic(stack.kafka, StreamsSettings())).stores}


def test_one_delete_leaves_nothing_of_the_user_in_memory_state_archive_or_a_new_dataset(stack):
    from chatpipe.testing.gateway import API_KEY
    from gateway.keys import default_user
    from streams.archive_erasure import archive_files

    run = uuid.uuid4().hex[:6]
    ada, bob = f"ada-{run}", f"bob-{run}"
    ada_id, bob_id = f"{default_user(API_KEY)}:{ada}", f"{default_user(API_KEY)}:{bob}"  # a multi-user key's users
    facts = {f"ada-{run}-c1": "My name is Ada and my cat is called Zanzibar.",
             f"ada-{run}-c2": "I live in Lisbon and I work as a lighthouse keeper.",
             f"ada-{run}-c3": "My favourite colour is teal."}
    first = None
    for conversation, fact in facts.items():
        answer = tell(stack.url, ada, conversation, fact)
        first = first or (conversation, answer.headers["X-Chatpipe-Request-Id"])
    tell(stack.url, bob, f"bob-{run}-c1", "My dog is called Biscuit.")
    feedback = httpx.post(f"{stack.url}/v1/feedback", headers=auth(), timeout=30,
                          json={"request_id": first[1], "conversation_id": first[0], "kind": "thumbs_up", "user": ada})
    assert feedback.status_code == 202, feedback.text

    # Every store holds Ada's data: memory (3 turns), state (3 conversations), archive (3 turns + 1 feedback).
    datasets = stack.root / "datasets"
    deadline = time.monotonic() + 120
    while True:
        found = report_of(stack, ada_id, datasets)
        if (found["memory"].remaining, found["state"].remaining, found["archive"].remaining) == (3, 3, 4):
            break
        assert time.monotonic() < deadline, {k: (s.remaining, s.details) for k, s in found.items()}
        time.sleep(1)
    build_dataset(stack, datasets / "before")
    before = report_of(stack, ada_id, datasets)["datasets"]
    assert before.affected == 1 and before.remaining == 0, before.details  # built before any deletion: affected

    audits = Tap(stack.kafka, "chat.deletions.audit")
    try:
        answer = httpx.delete(f"{stack.url}/v1/users/{ada}", headers=auth(), timeout=30)
        assert answer.status_code == 202, answer.text
        deletion_id = answer.json()["event_id"]
        assert answer.json()["user_id"] == ada_id
        # streams (memory + state, archive: one audit each per conversation partition; the model registry:
        # one) and the one inference worker (its prefix cache) acknowledge: 6 + 6 + 1 + 1
        got = audits.records(14, timeout_s=ERASED_WITHIN_S,
                             where=lambda r: isinstance(r, DeletionAudit) and r.deletion_event_id == deletion_id)
    finally:
        audits.close()
    by_component = defaultdict(list)
    for audit in got:
        by_component[audit.component].append(audit)
    # streams.models: the model registry looked at (no version was trained on the user: 0 tainted)
    assert set(by_component) == {"streams.forget", "streams.archive", "streams.models", "inference.worker:gw-test-worker"}
    assert [a.conversations_cleared for a in by_component["streams.models"]] == [0]
    assert [len(by_component[c]) for c in ("streams.forget", "streams.archive")] == [6, 6]
    assert sum(a.memory_points_deleted for a in by_component["streams.forget"]) == 3
    assert sum(a.conversations_cleared for a in by_component["streams.forget"]) == 3
    assert sum(a.conversations_cleared for a in by_component["streams.archive"]) == 3

    build_dataset(stack, datasets / "after")
    verified = forget_verify(stack, ada_id, datasets)
    out = verified.stdout
    assert verified.returncode == 0, out + verified.stderr[-2000:]
    for store in ("memory", "state", "archive"):
        assert any(line.startswith(store) and "clean" in line for line in out.splitlines()), out
    assert str(datasets / "before") in out and "affected" in out, out
    assert str(datasets / "after") not in out, "the dataset built after the deletion must not hold the user"
    after = report_of(stack, ada_id, datasets)
    assert (after["memory"].remaining, after["state"].remaining, after["archive"].remaining) == (0, 0, 0)
    assert after["datasets"].affected == 1 and after["datasets"].remaining == 0
    assert after["audits"].remaining == 0, after["audits"].details
    # nothing of Ada is in any archive file (decoded, not only counted by the verifier)
    codec = default_codec()
    from transport.archive import read_messages

    for topic in ("chat.turns", "chat.feedback"):
        for path in archive_files(stack.streams.archive_dir, stack.kafka.topic(topic)):
            assert not [m for m in read_messages(path) if ada_id.encode() in (m.value or b"")
                        and codec.decode(m.value).user_id == ada_id], path
    # the other user of the same key and tenant keeps everything
    control = report_of(stack, bob_id, datasets)
    assert control["memory"].remaining == 1 and control["archive"].remaining == 1
    assert forget_verify(stack, bob_id, datasets).returncode == 1, "data and no deletion: the verifier says it remains"
