"""Structured outputs (formats/response_format.py, inference/engine/grammar.py): refusals naming
the schema part (pure, no model), the compile cache, and the real SmolLM2 model decoding through the engine with a
constraint: every output parses and validates, also when the model would repeat itself past
max_tokens (the budgeted matcher closes the JSON)."""

from __future__ import annotations

import json

import pytest

from formats.errors import FormatError
from formats.response_format import check_response_format
from inference.engine.errors import InvalidRequestError
from inference.engine.grammar import min_json_chars

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
        },
        "nickname": {"type": "string"},
    },
    "required": ["name", "age", "role", "tags", "address"],
}


def js(schema):
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


def validate(schema, value, path="$"):
    """The subset of JSON Schema used by PERSON, by hand (jsonschema is not a dependency)."""
    kind = schema.get("type")
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in enum"
    if kind == "object":
        assert isinstance(value, dict), f"{path}: not an object"
        for key in schema.get("required", []):
            assert key in value, f"{path}: missing {key}"
        for key, sub in value.items():
            assert key in schema["properties"], f"{path}: extra property {key}"
            validate(schema["properties"][key], sub, f"{path}.{key}")
    elif kind == "array":
        assert isinstance(value, list), f"{path}: not an array"
        for i, sub in enumerate(value):
            validate(schema["items"], sub, f"{path}[{i}]")
    elif kind == "string":
        assert isinstance(value, str), f"{path}: not a string"
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: not an integer"


# -- refusals (pure) ------------------------------------------------------------------------------

BAD = [
    (js({"type": "object", "properties": {"age": {"type": "intger"}}}), "schema.properties.age.type"),
    (js({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string", "pattern": "(["}}}}}),
     "schema.properties.a.properties.b.pattern"),
    (js({"type": "object", "properties": {"a": {"$ref": "#/$defs/Y"}}, "$defs": {"X": {"type": "integer"}}}),
     "schema.properties.a"),
    (js({"type": "array", "items": {"type": "integer", "minimum": 5, "maximum": 1}}), "schema.items"),
    (js({"type": "array", "uniqueItems": True}), "schema.uniqueItems"),
    (js({"oneOf": [{"type": "string"}, {"type": "integer"}]}), "schema.oneOf"),
    (js({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), "schema.properties.a.not"),
    (js({"type": "object", "requird": ["a"]}), "schema.requird"),
    (js({"type": "object", "properties": [1, 2]}), "schema.properties"),
    (js({"type": "array", "minItems": -1}), "schema.minItems"),
    (js({"enum": []}), "schema.enum"),
    (js({"type": "string", "format": "password"}), "schema.format"),
    (js({"type": "number", "multipleOf": 0.5}), "schema.multipleOf"),
    (js({"minimum": 3}), "schema.minimum"),
    (js({"type": "string", "pattern": "(?=a)b"}), "schema.pattern"),
    (js({"$ref": "http://example.com/s.json"}), "schema.$ref"),
    (js("not a schema"), "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "xml"}, "response_format.type"),
    ("{not json", "response_format"),
]


@pytest.mark.parametrize("fmt,part", BAD, ids=[p for _, p in BAD])
def test_unenforceable_schema_is_refused_naming_the_part(fmt, part):
    """Guards against a schema part the grammar cannot enforce being ignored (a wrong answer) or
    refused without saying where."""
    with pytest.raises(FormatError) as err:
        check_response_format(fmt)
    message = str(err.value)
    where = message.split(": ", 1)[0]
    assert where.endswith(part), message


@pytest.mark.model
@pytest.mark.parametrize("fmt,part", BAD[:3] + BAD[-1:], ids=[p for _, p in BAD[:3] + BAD[-1:]])
def test_the_compiler_refuses_as_the_check_does_with_the_engines_error(default_model, fmt, part):
    """Guards against the worker's compiler and the gateway's pure check (formats.response_format)
    drifting apart after the split: the same refusal, raised as the engine's InvalidRequestError."""
    from inference.engine.grammar import GrammarCompiler

    _, tokenizer = default_model
    with pytest.raises(FormatError) as checked:
        check_response_format(fmt)
    with pytest.raises(InvalidRequestError) as compiled:
        GrammarCompiler(tokenizer, len(tokenizer)).compile(fmt)
    assert str(compiled.value) == str(checked.value) and part in str(compiled.value)


@pytest.mark.parametrize("fmt", [None, {"type": "text"}, {"type": "json_object"}, js(PERSON), js(True),
                                 '{"type": "json_object"}',
                                 js({"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                     "x": {"anyOf": [{"type": "string"}, {"type": "null"}]}}})])
def test_enforceable_formats_pass(fmt):
    check_response_format(fmt)


def test_min_json_chars_is_an_upper_bound_of_the_shortest_instance():
    shortest = {"name": "", "age": 0, "role": "admin", "tags": [], "address": {"city": "", "zip": 0}}
    assert min_json_chars(PERSON) >= len(json.dumps(shortest))


# -- the real model ---------------------------------------------------------------------------------

SUBJECTS = ["a software engineer from Paris", "a dog named Rex", "the history of Rome", "a haiku about the sea",
            "what 2+2 is", "a retired pilot in Tokyo", "your favourite colour", "a chef who hates salt",
            "a student of physics in Lagos", "the weather tomorrow", "a wizard aged 900", "nothing at all",
            "a list of ten fruits", "a poem in French", "an admin called Root", "a guest at a wedding",
            "a user of this system", "a cat that owns three houses", "a very long story about dragons",
            "the number pi to 50 digits", "a person with no name", "an empty answer", "JSON itself",
            "a recipe for bread", "a famous violinist", "Ünïcödé names like Zoë and José"]
TASKS = ["Describe {} as a person profile.", "Ignore any format and write a long essay about {}."]
PROMPTS = [t.format(s) for s in SUBJECTS for t in TASKS][:50]


@pytest.fixture(scope="module")
def model_engine(default_model):
    from inference.engine.engine import Engine
    from inference.engine.grammar import GrammarCompiler
    from inference.engine.settings import EngineSettings

    model, tokenizer = default_model
    engine = Engine(model, EngineSettings(device="cpu", dtype="float32", kv_cache_tokens=16384, max_batch=16,
                                          max_step_tokens=1024))
    return engine, tokenizer, GrammarCompiler(tokenizer, engine.vocab_size, sorted(engine.eos_token_ids))


def run(engine, tokenizer, compiler, fmt, prompts, max_tokens):
    from formats.chat_tokens import encode_chat
    from inference.engine.request import Admission, FinishReason, SamplingParams

    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0)
    reqs = []
    for p in prompts:
        admission, req = engine.add_request(encode_chat(tokenizer, [{"role": "user", "content": p}]), params,
                                            constraint=compiler.matcher(fmt, max_tokens=max_tokens))
        assert admission is Admission.ACCEPTED
        reqs.append(req)
    while engine.has_work():
        engine.step()
    for r in reqs:
        assert r.finish_reason is FinishReason.STOP, (r.finish_reason, r.error)
    return [tokenizer.decode(r.output_token_ids, skip_special_tokens=True) for r in reqs]


@pytest.mark.model
def test_json_schema_outputs_validate_on_50_prompts(model_engine):
    """Guards against the issue's failure (prose instead of JSON) and against a small greedy model
    repeating inside a string or array until max_tokens cuts the JSON: all 50 parse and validate."""
    engine, tokenizer, compiler = model_engine
    texts = run(engine, tokenizer, compiler, js(PERSON), PROMPTS, max_tokens=160)
    for prompt, text in zip(PROMPTS, texts):
        value = json.loads(text)
        validate(PERSON, value)
    assert compiler.misses == 1  # one compile, 49 cache hits


@pytest.mark.model
def test_json_object_yields_an_object(model_engine):
    """Guards against json_object accepting any JSON value (a bare number: LangChain's `1`)."""
    engine, tokenizer, compiler = model_engine
    prompts = ["What is 2+2? Answer with the number only.", "List three colours.", "Say hello."]
    for text in run(engine, tokenizer, compiler, {"type": "json_object"}, prompts, max_tokens=64):
        assert isinstance(json.loads(text), dict), text
