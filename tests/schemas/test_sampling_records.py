"""Issue 23's records: PromptRequest v5 / InferenceRequest v3 sampling fields, TokenChunk v3
choice_index and logprobs, Response v2 choice_index; older versions still read (as the defaults:
no penalties, no logprobs, one choice, free text), and the rules of schemas/requests.py."""

from __future__ import annotations

import json

import pytest

from schemas.codec import HEADER_LEN, default_codec, to_avro_dict
from schemas.records import (ChatMessage, FinishReason, InferenceRequest, PromptRequest, Response, SamplingParams,
                             TokenChunk, TokenLogprob, TopLogprob)
from schemas.registry import default_registry
from schemas.requests import (LIMITS, RequestRuleError, check_prompt_request, check_record_sampling, check_sampling,
                              response_format_of, response_format_text)

codec = default_codec()
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
FULL = SamplingParams(max_tokens=32, temperature=0.5, seed=7, presence_penalty=0.5, frequency_penalty=-1.25,
                      logprobs=True, top_logprobs=3, n=4, response_format=response_format_text(JSON_SCHEMA))


def prompt(sampling: SamplingParams = FULL) -> PromptRequest:
    return PromptRequest(conversation_id="c1", user_id="ada", tenant="acme", model="m",
                         messages=[ChatMessage("user", "hi")], sampling=sampling)


def inference(sampling: SamplingParams = FULL) -> InferenceRequest:
    return InferenceRequest(request_id="r1", conversation_id="c1", user_id="ada", tenant="acme", created_at=1,
                            model="m", messages=[ChatMessage("user", "hi")], sampling=sampling)


def older(record, name: str, version: int) -> bytes:
    """``record`` written by a producer of ``version`` (only the fields that version has)."""
    schema = default_registry().version(name, version).parsed
    fields = {f["name"]: f for f in schema["fields"]}
    data = {k: v for k, v in to_avro_dict(record).items() if k in fields}
    if "sampling" in data:
        sampling_fields = {f["name"] for f in fields["sampling"]["type"]["fields"]}
        data["sampling"] = {k: v for k, v in data["sampling"].items() if k in sampling_fields}
    data["schema_version"] = version
    encoded = codec.encode_dict(name, data, version=version)
    assert encoded[2:HEADER_LEN] == default_registry().version(name, version).fingerprint
    return encoded


def test_the_new_sampling_fields_round_trip_in_both_requests():
    for record in (prompt(), inference()):
        decoded = codec.decode(codec.encode(record))
        assert decoded.sampling == FULL and decoded.schema_version == record.schema_version
    assert (prompt().schema_version, inference().schema_version) == (8, 5)
    assert json.loads(FULL.response_format) == JSON_SCHEMA  # key order kept: the schema's property order


@pytest.mark.parametrize("name, record, version", [("PromptRequest", prompt(), 4), ("PromptRequest", prompt(), 2),
                                                   ("InferenceRequest", inference(), 2)])
def test_requests_of_older_versions_read_as_the_defaults(name, record, version):
    decoded = codec.decode(older(record, name, version))
    s = decoded.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.logprobs, s.top_logprobs, s.n, s.response_format) == \
        (0.0, 0.0, False, 0, 1, None)
    assert (s.max_tokens, s.temperature, s.seed) == (32, 0.5, 7) and decoded.schema_version == version


def chunk(**kw) -> TokenChunk:
    return TokenChunk(request_id="r1", conversation_id="c1", index=3, text="é", token_ids=[2756, 9],
                      worker_id="w", **kw)


def test_a_chunk_carries_its_choice_and_one_logprob_per_token():
    logprobs = [TokenLogprob("\ufffd", -0.25, b"\xc3", [TopLogprob("\ufffd", -0.25, b"\xc3"), TopLogprob("e", -2.0, b"e")]),
                TokenLogprob("\ufffd", -0.01, b"\xa9", [])]
    decoded = codec.decode(codec.encode(chunk(choice_index=1, logprobs=logprobs)))
    assert decoded.choice_index == 1 and decoded.logprobs == logprobs and decoded.schema_version == 4
    assert b"".join(lp.bytes for lp in decoded.logprobs).decode() == "é"  # bytes of a split character join up
    assert codec.decode(codec.encode(chunk())).logprobs is None


def test_chunks_and_responses_of_older_versions_read_as_choice_0_without_logprobs():
    decoded = codec.decode(older(chunk(choice_index=2, logprobs=[]), "TokenChunk", 2))
    assert (decoded.choice_index, decoded.logprobs, decoded.token_ids) == (0, None, [2756, 9])
    response = Response(request_id="r1", conversation_id="c1", user_id="ada", tenant="acme", text="hi", model="m",
                        worker_id="w", tokens_in=3, tokens_out=1, queue_ms=0.0, ttft_ms=1.0, total_ms=2.0,
                        finish_reason=FinishReason.STOP, created_at=1, choice_index=3)
    assert codec.decode(codec.encode(response)).choice_index == 3
    assert codec.decode(older(response, "Response", 1)).choice_index == 0


# -- the rules -------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, field, says", [
    (dict(presence_penalty=2.5), "presence_penalty", "[-2, 2]"),
    (dict(frequency_penalty=-2.01), "frequency_penalty", "[-2, 2]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty", "[-2, 2]"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs", "[0, 20]"),
    (dict(logprobs=True, top_logprobs=-1), "top_logprobs", "[0, 20]"),
    (dict(top_logprobs=2), "top_logprobs", "set logprobs to true"),
    (dict(n=0), "n", "[1, 8]"),
    (dict(n=9), "n", "at most 8 choices"),
    (dict(response_format="{not json"), "response_format", "not JSON"),
    (dict(response_format='{"type": "yaml"}'), "response_format.type", "json_object"),
    (dict(response_format='["json_object"]'), "response_format", "not an object"),
    (dict(response_format='{"type": "json_schema"}'), "response_format.json_schema", "missing"),
    (dict(response_format='{"type": "json_schema", "json_schema": {"schema": 3}}'),
     "response_format.json_schema.schema", "as an object"),
    (dict(response_format='{"type":"json_object","x":"' + "y" * LIMITS.max_response_format_chars + '"}'),
     "response_format", "over the limit"),
])
def test_each_rule_names_its_field(fields, field, says):
    with pytest.raises(RequestRuleError) as caught:
        check_record_sampling(SamplingParams(**fields))
    assert caught.value.field == field and says in str(caught.value), str(caught.value)


def test_streams_refuses_a_record_outside_the_rules():
    from streams.errors import InvalidPromptError
    from streams.prompts import parse_prompt

    with pytest.raises(InvalidPromptError, match="n must be in"):
        parse_prompt(prompt(SamplingParams(n=20)))
    check_prompt_request(prompt())  # the full one is valid


def test_the_gateway_form_and_the_record_form_of_response_format_agree():
    check_sampling(logprobs=True, top_logprobs=20, n=8, presence_penalty=-2, frequency_penalty=2,
                   response_format=JSON_SCHEMA)
    assert response_format_text({"type": "text"}) is None and response_format_text(None) is None
    assert response_format_of('{"type": "text"}') is None
    assert response_format_of(response_format_text({"type": "json_object"})) == {"type": "json_object"}
    text = response_format_text({"type": "json_schema", "json_schema": {"name": "ü", "schema": {"description": "é"}}})
    assert "ü" in text and " " not in text  # compact, not escaped: the record's length is its characters
