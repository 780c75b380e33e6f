"""The plain-fastavro producing example (examples/python/produce_prompt.py, docs/producing.md) run as a
user runs it: a subprocess against the real pipeline (streams worker, inference worker with the default
model; the session's ``pipeline`` fixture), talking to it only through Kafka.

The Java example (examples/java) is not run here: it would add a Maven build to CI (docs/producing.md).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import uuid

import pytest

from chatpipe.testing.worker import REPO

pytestmark = [pytest.mark.integration, pytest.mark.model]
EXAMPLE = REPO / "examples" / "python" / "produce_prompt.py"
USAGE = re.compile(r"^usage: prompt_tokens=(\d+) completion_tokens=(\d+) finish_reason=(STOP|LENGTH)$", re.M)


def run_example(bootstrap: str, prefix: str, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    # cwd outside the repo: the example must find the schemas relative to itself, not to the caller
    return subprocess.run([sys.executable, str(EXAMPLE), "--bootstrap-servers", bootstrap, "--topic-prefix", prefix,
                           "--timeout-s", str(timeout_s), *args],
                          capture_output=True, text=True, timeout=timeout_s + 60, cwd=EXAMPLE.parents[2].parent)


def test_example_imports_no_chatpipe_code():
    """The example is for teams without chatpipe installed: an import of one of our packages would make
    it work here and fail for them."""
    ours = {"chatpipe", "schemas", "transport", "streams", "inference", "spark_jobs", "infra", "tests"}
    tree = ast.parse(EXAMPLE.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & ours, f"the example imports chatpipe code: {sorted(imported & ours)}"


def test_example_prints_the_streamed_answer_and_usage(pipeline):
    """A PromptRequest v2 in single-object encoding, produced by plain fastavro, is decoded by streams,
    answered by the worker on the example's own (newly created) reply topic, and the example prints the
    answer and the final chunk's usage. Guards the whole documented contract: fingerprint, body, key,
    reply address and the v2 final chunk. A fresh user id keeps memory from other tests out of the
    context, so greedy decoding gives the model's plain answer."""
    kafka = pipeline.kafka
    run = run_example(kafka.bootstrap_servers, kafka.topic_prefix, "--prompt", "What is the capital of France?",
                      "--user-id", f"producer-{uuid.uuid4().hex[:8]}", "--max-tokens", "16")
    assert run.returncode == 0, f"exit {run.returncode}\nstdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    usage = USAGE.search(run.stdout)
    assert usage, f"no usage line in:\n{run.stdout}"
    answer = run.stdout[:usage.start()].strip()
    assert answer, "the example printed no answer text"
    assert "Paris" in answer, f"not the answer to the prompt that was sent: {answer!r}"
    prompt_tokens, completion_tokens = int(usage[1]), int(usage[2])
    assert prompt_tokens > 7 and 0 < completion_tokens <= 16, usage[0]
    assert f"reply {kafka.topic_prefix}replies." in run.stderr, "the example did not use its own reply topic"


def test_example_reports_the_reason_of_an_error_chunk(pipeline):
    """A prompt the pipeline refuses (its last message is from the assistant) is answered with a final
    chunk carrying error_code/error on the reply address; the example must exit 2 and print both, not
    wait for its timeout or print an empty answer. The example's own new reply topic is used: the
    streams worker must keep serving after a refusal to a topic it never wrote to (it once lost its
    producer's metadata there), so a normal prompt right after is answered too."""
    kafka = pipeline.kafka
    run = run_example(kafka.bootstrap_servers, kafka.topic_prefix, "--prompt", "I am the assistant.",
                      "--role", "assistant", timeout_s=120)
    assert run.returncode == 2, f"exit {run.returncode}\nstdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert "error: invalid_request: " in run.stderr, run.stderr
    assert "the last message is from 'assistant'" in run.stderr, run.stderr
    assert "usage:" not in run.stdout
    after = run_example(kafka.bootstrap_servers, kafka.topic_prefix, "--prompt", "Say hello.", timeout_s=120)
    assert after.returncode == 0, f"not answered after a refusal:\n{after.stderr}"


def test_example_exits_3_when_no_answer_comes(kafka_stack, topic_admin):
    """With nobody serving the prompts topic, the example must give up after --timeout-s with exit 3,
    not hang or exit 0."""
    prefix = f"idle{uuid.uuid4().hex[:6]}."
    topic_admin.create_topic(f"{prefix}chat.prompts", 1)
    run = run_example(kafka_stack.bootstrap_servers, prefix, "--prompt", "Anyone there?", timeout_s=3)
    assert run.returncode == 3, f"exit {run.returncode}\nstdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert "error: no final chunk within 3 s" in run.stderr
