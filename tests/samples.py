"""Hypothesis strategies and sample records, derived from the Avro schemas themselves.

Strategies come from the schema (not the dataclasses) so they cover exactly what the wire
format allows: Avro ``int`` is 32-bit, ``float`` is 32-bit, timestamps are epoch ms.
"""

from __future__ import annotations

import struct

from hypothesis import strategies as st

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
# fastavro reads timestamp-millis as datetime, which stops at year 9999.
TIMESTAMP_MS = (0, 253_402_300_799_000)


def _float32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def strategy_for(schema, named: dict | None = None):
    """A strategy of fastavro-writable values for a (raw JSON) Avro schema."""
    named = {} if named is None else named
    if isinstance(schema, str):
        if schema in named:
            return named[schema]
        short = schema.rsplit(".", 1)[-1]
        for name, strat in named.items():
            if name.rsplit(".", 1)[-1] == short:
                return strat
        return {
            "null": st.none(),
            "boolean": st.booleans(),
            "int": st.integers(*INT32),
            "long": st.integers(*INT64),
            "float": st.floats(width=32, allow_nan=False).map(_float32),
            "double": st.floats(allow_nan=False),
            "bytes": st.binary(max_size=64),
            "string": st.text(max_size=40),
        }[schema]
    if isinstance(schema, list):
        return st.one_of(*[strategy_for(s, named) for s in schema])
    kind = schema["type"]
    if kind == "record":
        fields = {f["name"]: strategy_for(f["type"], named) for f in schema["fields"]}
        strat = st.fixed_dictionaries(fields)
        named[schema.get("namespace", "") + "." + schema["name"]] = strat
        return strat
    if kind == "enum":
        strat = st.sampled_from(schema["symbols"])
        named[schema.get("namespace", "") + "." + schema["name"]] = strat
        return strat
    if kind == "array":
        return st.lists(strategy_for(schema["items"], named), max_size=4)
    if kind == "map":
        return st.dictionaries(st.text(max_size=20), strategy_for(schema["values"], named), max_size=4)
    if schema.get("logicalType") == "timestamp-millis":
        return st.integers(*TIMESTAMP_MS)
    return strategy_for(kind, named)


def sample_records() -> list:
    """One realistic instance of every record type, nested fields and optionals filled in."""
    from schemas import records as r

    conv = "conv-1"
    common = dict(conversation_id=conv, user_id="u-1", tenant="acme")
    return [
        r.PromptRequest(**common, model="smollm2", messages=[r.ChatMessage("user", "Hi there ✓")],
                        sampling=r.SamplingParams(max_tokens=32, temperature=0.0, seed=7, stop=["\n\n"]),
                        reply_to="chat.replies", reply_partition=2, priority=r.Priority.BATCH),
        r.InferenceRequest(**common, request_id="req-1", created_at=1_700_000_000_000, model="smollm2",
                           messages=[r.ChatMessage("system", "Be brief."), r.ChatMessage("user", "Hi")],
                           context_tokens=12, recalled_turn_ids=["t-0"]),
        r.TokenChunk(request_id="req-1", conversation_id=conv, index=3, text="lo", token_ids=[42, 7],
                     worker_id="w-1"),
        r.Response(**common, request_id="req-1", text="Hello!", model="smollm2", worker_id="w-1",
                   tokens_in=12, tokens_out=3, queue_ms=1.5, ttft_ms=20.25, total_ms=80.0,
                   finish_reason=r.FinishReason.STOP, created_at=1_700_000_000_000),
        r.Cancel(request_id="req-2", conversation_id=conv),
        r.ConversationTurn(**common, request_id="req-1", trace_id="4bf92f3577b34da6a3ce929d0e0e4736", turn_index=0,
                           system_prompt="Be brief.", prompt="Hi", answer="Hello!", model="smollm2", worker_id="w-1", tokens_in=12,
                           tokens_out=3, queue_ms=1.5, ttft_ms=20.25, total_ms=80.0,
                           finish_reason=r.FinishReason.LENGTH, created_at=1_700_000_000_000,
                           completed_at=1_700_000_000_080),
        r.Feedback(**common, request_id="req-1", kind=r.FeedbackKind.EDIT, edited_text="Hello.",
                   comment="shorter"),
        r.Deletion(scope=r.DeletionScope.CONVERSATION, user_id="u-1", tenant="acme", conversation_id=conv),
        r.WorkerStatus(worker_id="w-1", model="smollm2", state=r.WorkerState.SERVING, running=3, waiting=1,
                       kv_cache_used_tokens=900, kv_cache_total_tokens=4096, tokens_per_s=55.5,
                       model_versions=["acme-support@2"]),
        r.DeadLetter(source_topic="chat.prompts", source_partition=1, source_offset=99, key=b"k",
                     value=b"\x00\x01", headers=[r.Header("traceparent", b"00-..."), r.Header("x", None)],
                     error_type="DecodeError", error_message="bad marker", component="intake"),
        r.DeletionAudit(deletion_event_id="ev-1", scope=r.DeletionScope.USER, user_id="u-1", tenant="acme",
                        memory_points_deleted=12, conversations_cleared=2, component="streams.forget",
                        requested_at=1_700_000_000_000),
        r.EmbeddingRequest(tenant="acme", user_id="u-1", model="all-MiniLM-L6-v2", inputs=["a cat", "ein Hund"],
                           dimensions=384, reply_to="chat.replies.gw-1", reply_partition=0,
                           deadline_at=1_700_000_300_000),
        r.EmbeddingResult(request_id="req-1", model="all-MiniLM-L6-v2", dimensions=2, count=2,
                          vectors=b"\x00\x00\x80?" * 4, tokens_in=9, worker_id="streams.embeddings"),
        r.ModelVersion(name="acme-support", version=2, base_model="SmolLM2-135M-Instruct", base_model_sha256="ab" * 32,
                       adapter_uri="/models/acme-support/2/adapter", adapter_sha256="cd" * 32,
                       card_uri="/models/acme-support/2", lineage_uri="/models/acme-support/2/lineage.parquet",
                       dataset_uri="/datasets/ft", dataset_manifest_id="ef" * 32, tenant="acme",
                       data_tenants=["acme"], training_rows=120, hyperparameters={"lora_r": "16", "learning_rate": "0.0002"},
                       train_loss=0.5, eval_loss=0.7, eval_loss_before=2.1, eval_results={"planted_facts": 0.875},
                       state=r.ModelState.TAINTED, state_reason="erasure ev-1", canary_share=0.25, rule_min_rated=40),
        r.VersionStats(model="acme-support@2", turns=120, errors=2, rated=60, thumbs_up=45, thumbs_down=15,
                       regenerations=3, edits=1, ttft_ms_sum=2400.5, tokens_out=3000, decode_ms_sum=60000.0,
                       since=1_700_000_000_000),
        r.BatchJob(batch_id="batch_0a1b2c", tenant="acme", key_fingerprint="ab" * 32, input_file_id="file-0a1b2c3d4e5f",
                   endpoint="/v1/chat/completions", metadata={"job": "nightly"}, status=r.BatchStatus.FAILED,
                   errors=[r.BatchError(code="duplicate_custom_id", message="custom_id r1 is on line 1 already",
                                        param="custom_id", line=2)],
                   total=2, created_at=1_700_000_000, failed_at=1_700_000_001),
        r.BatchLineResult(batch_id="batch_0a1b2c", custom_id="r1", line=1, status_code=200, request_id="req-1",
                          body='{"object": "chat.completion"}', input_tokens=12, output_tokens=4),
        r.StoredResponse(response_id="resp_0a1b2c", tenant="acme", user_id="shop:ada", conversation_id="resp-0a1b2c",
                         previous_response_id="resp_9f8e7d", status="completed",
                         messages='[{"role": "user", "content": "hi"}]', body='{"object": "response"}'),
    ]
