"""A generated chat log with planted cases, for tests and the benchmark.

:func:`generate` makes conversations of random pseudo-words (no two ordinary turns are
near-duplicates) and plants, among them, one or more of each case the fine-tuning job must
handle; :class:`Planted` says where each should end up (kept, or dropped at a step with a
reason). Writers turn the log into Kafka-shaped messages (``to_messages``) for the archive
or a real topic. Pure Python; no pyspark.
"""

from __future__ import annotations

import hashlib
import random
import zlib
from dataclasses import dataclass, field, fields

from schemas.codec import AvroCodec
from schemas.records import ConversationTurn, Feedback, FeedbackKind, FinishReason
from transport.archive import ArchivedMessage

START_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
SPAN_MS = 3 * 3600 * 1000     # the log covers three hours
MODELS = ("smollm2-135m", "acme-support@2")  # a base model and a fine-tuned version (name@version)

#: Planted PII strings by kind; none may appear anywhere in the job's output.
PII = {
    "email": "jane.roe+ml@example-corp.com",
    "phone": "+1 415-555-0132",
    "card": "4539 1488 0343 6467",  # Luhn-valid
    "ipv4": "203.0.113.77",
    "ipv6": "2001:db8:85a3:0:0:8a2e:370:7334",
    "api_key": "sk-proj4Tq9XvB2mKc8LpZr7Wn3",
    "aws_key": "AKIAIOSFODNN7EXAMPLE",
    "secret_assignment": "hunter2-Sup3rS3cret",  # written as "password=<it>"
}
LUHN_INVALID = "4539 1488 0343 6468"
EVAL_PASSAGE = (
    "the quick migration of arctic terns spans both poles and covers more distance each year "
    "than any other bird known to science according to long running banding studies"
)


@dataclass(frozen=True)
class Planted:
    case: str
    event_id: str
    step: str | None        # None: must be an SFT example
    reason: str | None
    pii: str | None = None  # the planted PII string, when the case is PII


@dataclass
class SyntheticLog:
    turns: list[ConversationTurn] = field(default_factory=list)
    v1_event_ids: set[str] = field(default_factory=set)   # written with ConversationTurn v1
    # Turns not of v1 with a trace id are written with v3, those without (``trace_for``) with v2.
    feedback: list[Feedback] = field(default_factory=list)
    junk_turn_values: list[tuple[str, bytes]] = field(default_factory=list)  # (expected reason, bytes)
    planted: list[Planted] = field(default_factory=list)
    pairs: list[tuple[str, str]] = field(default_factory=list)  # (chosen event_id, rejected event_id)
    eval_lines: list[str] = field(default_factory=list)


class _Words:
    def __init__(self, rng: random.Random, size: int = 6000):
        syll = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "vo", "de", "pa", "qui", "zen", "bar", "tor", "gel"]
        self.rng = rng
        self.vocab = sorted({"".join(rng.choice(syll) for _ in range(rng.randint(2, 4))) for _ in range(size)})

    def text(self, n: int) -> str:
        return " ".join(self.rng.choices(self.vocab, k=n))

    def answer(self) -> str:
        lines = [self.text(self.rng.randint(8, 20)).capitalize() + "." for _ in range(self.rng.randint(2, 5))]
        return "\n".join(lines)


def trace_for(event_id: str) -> str | None:
    """The trace id a generated turn carries: derived from its event id (no draw from the generator's
    random stream, so the rest of a log is what it was before trace ids); one turn in four has none
    (written with ConversationTurn v2, before trace ids)."""
    if zlib.crc32(event_id.encode()) % 4 == 0:
        return None
    return hashlib.sha256(b"trace|" + event_id.encode()).hexdigest()[:32]


def _turn(rng, conv: str, idx: int, prompt: str, answer: str, at: int, v1: bool = False, **kw) -> ConversationTurn:
    tokens_in, tokens_out = len(prompt) // 4 + 1, len(answer) // 4 + 1
    event_id = kw.pop("event_id", f"{rng.getrandbits(128):032x}")
    return ConversationTurn(
        event_id=event_id, conversation_id=conv,
        user_id=kw.pop("user_id", f"user-{zlib.crc32(conv.encode()) % 97}"), tenant="acme",
        request_id=kw.pop("request_id", f"req-{rng.getrandbits(64):016x}"),
        trace_id=None if v1 else kw.pop("trace_id", trace_for(event_id)), turn_index=idx,
        system_prompt=None if v1 else kw.pop("system_prompt", "You are a helpful assistant."),
        prompt=prompt, answer=answer, model=kw.pop("model", rng.choice(MODELS)), worker_id="w0",
        tokens_in=tokens_in, tokens_out=tokens_out, queue_ms=rng.uniform(1, 50),
        ttft_ms=0.0 if v1 else rng.uniform(20, 400), total_ms=rng.uniform(300, 4000),
        finish_reason=kw.pop("finish_reason", FinishReason.STOP), created_at=at, completed_at=at + 1000, **kw,
    )


def generate(n_turns: int = 2000, seed: int = 7, planted: bool = True, v1_share: float = 0.3) -> SyntheticLog:
    rng = random.Random(seed)
    words = _Words(rng)
    log = SyntheticLog()

    def at() -> int:
        return START_MS + rng.randrange(SPAN_MS)

    def add(t: ConversationTurn, v1: bool = False) -> ConversationTurn:
        log.turns.append(t)
        if v1:
            log.v1_event_ids.add(t.event_id)
        return t

    def fb(t: ConversationTurn, kind: FeedbackKind, delay: int = 5000, **kw) -> None:
        log.feedback.append(Feedback(event_id=f"{rng.getrandbits(128):032x}", conversation_id=t.conversation_id,
                                     user_id=t.user_id, tenant=t.tenant, request_id=t.request_id, kind=kind,
                                     created_at=t.completed_at + delay, **kw))

    # Ordinary conversations.
    n_conv = 0
    while len(log.turns) < n_turns:
        conv, n_conv, base = f"conv-{n_conv:07d}", n_conv + 1, at()
        for i in range(rng.randint(1, 5)):
            v1 = rng.random() < v1_share
            t = add(_turn(rng, conv, i, words.text(rng.randint(5, 25)) + "?", words.answer(), base + i * 60_000, v1), v1)
            if rng.random() < 0.05:
                fb(t, FeedbackKind.THUMBS_UP)
    if not planted:
        return log

    def plant(case, t, step, reason, pii=None, v1=False):
        add(t, v1)
        log.planted.append(Planted(case, t.event_id, step, reason, pii))
        return t

    def new_conv(tag: str) -> str:
        return f"planted-{tag}-{rng.getrandbits(32):08x}"

    # Duplicates: an exact copy (case and spacing changed) and a near copy (one word changed).
    orig = plant("dup original", _turn(rng, new_conv("dup"), 0, words.text(12) + "?", words.text(70) + ".",
                                       START_MS + 1000), None, None)
    plant("exact duplicate", _turn(rng, new_conv("dupx"), 0, orig.prompt.upper(), "  " + orig.answer.replace(" ", "  "),
                                   START_MS + 2000), "exact_dedup", "exact_duplicate")
    near_words = orig.answer.split(" ")
    near_words[35] = "zzyzx"
    plant("near duplicate", _turn(rng, new_conv("dupn"), 0, orig.prompt, " ".join(near_words), START_MS + 3000),
          "near_dedup", "near_duplicate")

    # PII of every kind, in prompts and answers; the turns themselves are fine and kept.
    for kind, value in PII.items():
        shown = f"password={value}" if kind == "secret_assignment" else value
        where = rng.choice(["prompt", "answer"])
        p, a = words.text(10) + "?", words.answer()
        if where == "prompt":
            p = f"{words.text(4)} {shown} {p}"
        else:
            a = f"{a}\nReach it at {shown} today."
        plant(f"pii {kind}", _turn(rng, new_conv("pii"), 0, p, a, at()), None, None, pii=value, v1=kind == "email")
    plant("luhn-invalid number", _turn(rng, new_conv("luhn"), 0, words.text(8) + "?",
                                       f"{words.answer()}\nOrder ref {LUHN_INVALID}.", at()), None, None)

    # Eval-set leak: an answer quoting 20 words of an eval passage.
    log.eval_lines = [EVAL_PASSAGE, words.text(30)]
    leak = " ".join(EVAL_PASSAGE.split(" ")[3:23])
    plant("eval leak", _turn(rng, new_conv("leak"), 0, words.text(8) + "?", f"{words.text(6)} {leak} {words.text(6)}.",
                             at()), "decontam", "eval_contamination")

    # Quality.
    q = [("empty answer", "   ", {}, "empty"), ("too short", "ok", {}, "too_short"),
         ("error finish", words.answer(), {"finish_reason": FinishReason.ERROR}, "error_response"),
         ("error text", "Error: upstream model timed out after 30s", {}, "error_response"),
         ("cancelled", words.answer(), {"finish_reason": FinishReason.CANCELLED}, "incomplete"),
         ("mostly non-text", "data: " + "".join(rng.choices("0123456789+/=-_{}[]", k=300)), {}, "mostly_non_text"),
         ("repeated lines", "\n".join(["I can help with that."] * 6 + [words.text(5)]), {}, "repeated_lines"),
         ("too long", words.text(5000), {}, "too_long")]
    for case, answer, kw, reason in q:
        plant(case, _turn(rng, new_conv("q"), 0, words.text(8) + "?", answer, at(), **kw), "quality", reason)

    # Regenerations: the first answer regenerated (or thumbed down), the second thumbed up.
    for kind in (FeedbackKind.REGENERATE, FeedbackKind.THUMBS_DOWN):
        conv, base, prompt = new_conv("regen"), at(), words.text(10) + "?"
        first = plant(f"regenerated ({kind})", _turn(rng, conv, 0, prompt, words.answer(), base), "feedback", "rated_down")
        fb(first, kind)
        second = plant(f"regeneration ({kind})", _turn(rng, conv, 0, prompt, words.answer(), base + 30_000), None, None)
        fb(second, FeedbackKind.THUMBS_UP)
        log.pairs.append((second.event_id, first.event_id))
    edited = plant("edited", _turn(rng, new_conv("edit"), 0, words.text(9) + "?", words.answer(), at()),
                   "feedback", "rated_down")
    fb(edited, FeedbackKind.EDIT, edited_text=f"{words.answer()} Write to {PII['email']}.")
    log.pairs.append((f"{edited.event_id}:edit", edited.event_id))

    # Undecodable values on the turns topic.
    codec = AvroCodec(validate_on_encode=False)
    good = codec.encode(orig)
    log.junk_turn_values = [
        ("not_single_object_encoding", b"plain text, not avro"),
        ("unknown_schema", b"\xc3\x01" + b"\x01" * 8 + good[10:]),
        ("wrong_record_type", codec.encode(log.feedback[0])),
        ("corrupt_body", good[:14]),
    ]
    return log


CURRENT_TURN_VERSION = next(f.default for f in fields(ConversationTurn) if f.name == "schema_version")


def writer_version(t: ConversationTurn, v1: bool) -> int:
    """The ConversationTurn version :func:`encode_turn` writes ``t`` with: 1 when asked, the current one
    (``CURRENT_TURN_VERSION``, 5: trace ids since 3) with a trace id, else 2."""
    return 1 if v1 else CURRENT_TURN_VERSION if t.trace_id is not None else 2


def encode_turn(codec: AvroCodec, t: ConversationTurn, v1: bool) -> bytes:
    version = writer_version(t, v1)
    if version == CURRENT_TURN_VERSION:
        return codec.encode(t)
    since_v4 = ("remembered", "memory_degraded", "cached_tokens", "response_cached")
    left_out = ("trace_id", *since_v4) if version == 2 else ("trace_id", "system_prompt", "ttft_ms", *since_v4)
    d = {k: getattr(t, k) for k in t.__slots__ if k not in left_out}
    d["finish_reason"], d["schema_version"] = str(t.finish_reason), version
    return codec.encode_dict("ConversationTurn", d, version=version)


def to_messages(log: SyntheticLog, turns_topic: str, feedback_topic: str, partitions: int = 3) -> list[ArchivedMessage]:
    """The log as Kafka messages (key = conversation_id, timestamp = created_at), offsets per partition."""
    codec = AvroCodec(validate_on_encode=False)
    offsets: dict[tuple[str, int], int] = {}
    rows = [(t.created_at, turns_topic, t.conversation_id, encode_turn(codec, t, t.event_id in log.v1_event_ids))
            for t in log.turns]
    rows += [(f.created_at, feedback_topic, f.conversation_id, codec.encode(f)) for f in log.feedback]
    rows += [(START_MS + i, turns_topic, f"junk-{i}", v) for i, (_, v) in enumerate(log.junk_turn_values)]
    out = []
    for ts, topic, key, value in sorted(rows, key=lambda r: (r[0], r[1], r[2])):
        part = zlib.crc32(key.encode()) % partitions
        off = offsets.get((topic, part), 0)
        offsets[(topic, part)] = off + 1
        out.append(ArchivedMessage(topic, part, off, ts, key.encode(), value))
    return out
