"""The streamed text equals the final text: ``IncrementalDetokenizer`` on the real SmolLM2 tokenizer
(byte-level BPE, where one character can span several tokens), multi-byte characters included,
and over random token id sequences (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.engine.text import IncrementalDetokenizer

pytestmark = pytest.mark.model

TEXTS = [
    "plain ASCII, with punctuation: a=b; c!",
    "naïve café, façade, Ångström, Zürich, crème brûlée",
    "中文分词很难；日本語のテキスト、한국어 문장",
    "emoji 😀🎉 family 👨‍👩‍👧‍👦 flag 🇫🇷 skin 👍🏽 keycap 1️⃣",
    "combining e\u0301 a\u0308, Arabic مرحبا, Hebrew שלום, Devanagari नमस्ते, math ∀x∈ℝ: x² ≥ 0",
    "mixed 😀中a😀é\n\ttabs  and   spaces\u00a0nbsp",
]


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model[1]


def streamed(tokenizer, ids) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return "".join(pieces), pieces


def full_decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_of_multibyte_text_equals_full_decode_and_never_shows_half_a_character(tokenizer, text):
    """Guards against lost, repeated or garbled (U+FFFD) text when characters span several tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) // 4  # the byte-level tokenizer really splits these characters
    joined, pieces = streamed(tokenizer, ids)
    assert joined == full_decode(tokenizer, ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_output_cut_inside_a_character_still_ends_like_the_full_decode(tokenizer):
    """Guards against dropping the tail of an answer that stopped (max tokens) inside a character:
    the final text shows U+FFFD there, so the stream must too, once, at the end."""
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's last byte never comes
    full = full_decode(tokenizer, cut)
    assert full.endswith("\ufffd")
    joined, pieces = streamed(tokenizer, cut)
    assert joined == full and pieces[-1].endswith("\ufffd")


def test_special_tokens_are_skipped_in_the_stream_like_in_the_full_decode(tokenizer):
    """Guards against chat-control tokens (<|im_end|>...) leaking into, or breaking, the stream."""
    body = tokenizer.encode("Hé 世", add_special_tokens=False)
    ids = [tokenizer.convert_tokens_to_ids("<|im_start|>")] + body + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    joined, _ = streamed(tokenizer, ids)
    assert joined == full_decode(tokenizer, ids) == "Hé 世"


def test_each_token_decodes_a_bounded_window_not_the_whole_output(tokenizer):
    """Guards against re-decoding the whole output for every token (quadratic work on the event loop)."""

    class CountingTokenizer:  # the real tokenizer, recording how many ids each decode call gets
        def __init__(self, inner):
            self.inner, self.sizes = inner, []

        def decode(self, ids, **kw):
            self.sizes.append(len(ids))
            return self.inner.decode(ids, **kw)

    counting = CountingTokenizer(tokenizer)
    ids = tokenizer.encode(" ".join(TEXTS) * 3, add_special_tokens=False)
    assert len(ids) > 300
    joined, _ = streamed(counting, ids)
    assert joined == full_decode(tokenizer, ids)
    assert max(counting.sizes) <= 16 and len(counting.sizes) <= 3 * len(ids)


def test_text_after_a_rewrite_keeps_streaming():
    """Guards against dropping the rest of the answer once re-decoding changes text already shown.
    The real SmolLM2 tokenizer never rewrites earlier text, so a stand-in decoder that does (it fuses
    'a' + 'b' into 'X', like a cleanup step) shows it; what was shown stays, later text still comes."""

    class RewritingTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids).replace("ab", "X")

    detok = IncrementalDetokenizer(RewritingTokenizer())
    pieces = [detok.push(ord(c)) for c in "abcdef"] + [detok.flush()]
    assert "".join(pieces).endswith("cdef")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stream_equals_full_decode_for_any_token_sequence(tokenizer, data):
    """Guards against any token sequence (invalid byte runs, lone continuation bytes, specials,
    characters split anywhere) whose streamed text differs from its final decode."""
    vocab = len(tokenizer)
    # ids that carry parts of characters (single bytes, lead bytes, continuation bytes)
    byte_tokens = tokenizer.encode("é😀中\u0301👨‍👩‍👧", add_special_tokens=False)
    token = st.one_of(st.integers(0, vocab - 1), st.sampled_from(byte_tokens))
    ids = data.draw(st.lists(token, min_size=1, max_size=60))
    joined, _ = streamed(tokenizer, ids)
    assert joined == full_decode(tokenizer, ids)


def test_a_long_run_of_broken_bytes_streams_without_growing_the_window(tokenizer):
    """Guards against a window that grows without bound (and text held forever) while the model
    emits bytes that never form a character, and against losing the character that follows."""
    lead_byte = tokenizer.convert_tokens_to_ids("ð")  # byte 0xF0 alone: the start of a 4-byte character
    ids = [lead_byte] * 20 + tokenizer.encode("😀 ok", add_special_tokens=False) + [lead_byte] * 3
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces[:20])  # shown before the run ends, not held back until the end
    assert "".join(pieces) + detok.flush() == full_decode(tokenizer, ids)
