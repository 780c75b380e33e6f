"""Encoded sizes of the pipeline's records for one LMSYS-shaped exchange, measured with the real codec.

``measure_record_sizes`` builds, from real texts (``bench/capacity.py`` passes the model's own answers
and its prompts), turns of the LMSYS-Chat-1M mean sizes (a ~70-token prompt, a ~215-token answer) and
encodes each record one exchange puts on Kafka with ``schemas.codec`` (Avro single-object encoding:
what is on the wire), then archives the turns with ``transport.archive.write_file`` (Avro container,
deflate: what the archive holds on disk) and serialises the Qdrant payload the memory stores per turn.
The figures land in ``capacity/figures.py`` with the run they come from.
"""

from __future__ import annotations

import collections
import json
import tempfile
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from schemas.codec import default_codec
from schemas.records import (ChatMessage, ConversationTurn, FinishReason, InferenceRequest, PromptRequest, Response,
                             SamplingParams, TokenChunk, now_ms)
from transport import tracing
from transport.archive import ArchivedMessage, write_file

RECALLED_TURNS = 4  # MemorySettings.recall_limit: recalled turns an InferenceRequest's context may carry


def approx_tokens(text: str) -> int:
    """~4 characters a token (English BPE); only when no tokenizer is given."""
    return max(1, round(len(text) / 4))


def lmsys_turns(prompts: Sequence[str], answers: Sequence[str], count: Callable[[str], int] = approx_tokens,
                prompt_tokens: float = 69.5, answer_tokens: float = 214.5) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of about the LMSYS mean sizes, cut and joined from the given texts."""
    pieces = [a.strip() for a in answers if a.strip()]
    if not pieces or not prompts:
        raise ValueError("need prompts and answers to build turns from")
    turns, i = [], 0
    while i < len(pieces):
        answer, n = [], 0
        while i < len(pieces) and n < answer_tokens:
            answer.append(pieces[i])
            n += count(pieces[i])
            i += 1
        if n < answer_tokens * 0.8:
            break  # the leftover is too short to be a turn of that size
        prompt = prompts[len(turns) % len(prompts)]
        while count(prompt) < prompt_tokens * 0.8:
            prompt = f"{prompt} {prompts[(len(turns) + 1) % len(prompts)]}"
        turns.append((prompt, " ".join(answer)))
    if not turns:
        raise ValueError("the answers are too short to make one LMSYS-sized turn")
    return turns


def measure_record_sizes(prompts: Sequence[str], answers: Sequence[str], count: Callable[[str], int] = approx_tokens,
                         *, recalled_turns: int = RECALLED_TURNS) -> dict[str, float]:
    """Mean bytes per record of each kind, and the archive's bytes per turn (deflate and raw)."""
    codec = default_codec()
    turns = lmsys_turns(prompts, answers, count)
    header = tracing.with_traceparent(None)  # every record carries a traceparent (transport/tracing.py)
    header_bytes = sum(len(k) + len(v or b"") for k, v in header)
    sums: dict[str, float] = collections.defaultdict(float)
    archived: list[ArchivedMessage] = []
    chunks = 0
    for n, (prompt, answer) in enumerate(turns):
        conv, user, tenant, rid = str(uuid.uuid4()), f"user-{n:08d}", "acme", str(uuid.uuid4())
        now = now_ms()
        history: list[ChatMessage] = []
        for m in range(recalled_turns):  # recalled turns: other exchanges of the user
            p, a = turns[(n + m + 1) % len(turns)]
            history += [ChatMessage("user", p), ChatMessage("assistant", a)]
        system, asked = ChatMessage("system", "You are a helpful assistant."), ChatMessage("user", prompt)
        request = dict(request_id=rid, conversation_id=conv, user_id=user, tenant=tenant, created_at=now,
                       model="chat-model", sampling=SamplingParams(), reply_to="chat.replies.gw-1", reply_partition=0)
        records = {
            "PromptRequest": PromptRequest(conversation_id=conv, user_id=user, tenant=tenant, model="chat-model",
                                           messages=[asked], reply_to="chat.replies.gw-1", reply_partition=0),
            "InferenceRequest (prompt only)": InferenceRequest(**request, messages=[system, asked], context_tokens=90),
            f"InferenceRequest ({recalled_turns} recalled turns)": InferenceRequest(
                **request, messages=[system, *history, asked],
                recalled_turn_ids=[str(uuid.uuid4()) for _ in range(recalled_turns)]),
            "Response": Response(request_id=rid, conversation_id=conv, user_id=user, tenant=tenant, text=answer,
                                 model="chat-model", worker_id="worker-7f9c2", tokens_in=90, tokens_out=215,
                                 queue_ms=12.5, ttft_ms=80.1, total_ms=4100.0, finish_reason=FinishReason.STOP,
                                 created_at=now),
            "ConversationTurn": ConversationTurn(conversation_id=conv, user_id=user, tenant=tenant, request_id=rid,
                                                 trace_id=uuid.uuid4().hex, turn_index=1, prompt=prompt, answer=answer,
                                                 model="chat-model", worker_id="worker-7f9c2", tokens_in=90,
                                                 tokens_out=215, queue_ms=12.5, ttft_ms=80.1, total_ms=4100.0,
                                                 finish_reason=FinishReason.STOP, created_at=now, completed_at=now),
        }
        for name, record in records.items():
            sums[name] += len(codec.encode(record))
        # One TokenChunk per text increment (~ per token), the last one final.
        n_tokens = max(1, count(answer))
        step = len(answer) / n_tokens
        for i in range(n_tokens):
            text = answer[round(i * step):round((i + 1) * step)]
            chunk = TokenChunk(request_id=rid, conversation_id=conv, index=i, text=text, token_ids=[1234],
                               worker_id="worker-7f9c2")
            sums["TokenChunk"] += len(codec.encode(chunk))
            chunks += 1
        turn_bytes = codec.encode(records["ConversationTurn"])
        archived.append(ArchivedMessage(topic="chat.turns", partition=0, offset=n, timestamp=now, key=conv.encode(),
                                        value=turn_bytes, headers=tuple(header)))
        payload = {"turn_id": str(uuid.uuid4()), "tenant": tenant, "user_id": user, "conversation_id": conv,
                   "turn_index": 1, "prompt": prompt, "answer": answer, "created_at": now}
        sums["Qdrant payload (JSON)"] += len(json.dumps(payload).encode())
    out = {name: total / (chunks if name == "TokenChunk" else len(turns)) for name, total in sums.items()}
    out["TokenChunks per answer"] = chunks / len(turns)
    out["Kafka headers per record (traceparent)"] = float(header_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "part-00000-0-1.avro"
        write_file(path, archived)
        out["archive bytes per turn (deflate)"] = path.stat().st_size / len(archived)
    out["archive bytes per turn (raw: value + key + headers)"] = (
        sum(len(m.value) + len(m.key) for m in archived) / len(archived) + header_bytes)
    out["turns measured"] = float(len(turns))
    out["prompt tokens per turn"] = sum(count(p) for p, _ in turns) / len(turns)
    out["answer tokens per turn"] = sum(count(a) for _, a in turns) / len(turns)
    return out
