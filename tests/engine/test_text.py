"""Text-edge tests with a fake character-level tokenizer (no model files)."""

from __future__ import annotations

from inference.engine.text import IncrementalDetokenizer, StopStringMatcher


class CharTokenizer:
    """Token id = one character; id 0 is a special token, 1 stands for half of a multi-byte char."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if i == 0 else "\ufffd" if i == 1 else chr(i) for i in ids).replace("\ufffd" + "é", "é")


def test_detokenizer_emits_each_new_piece_once():
    """Guards against repeated or lost text when streaming increments."""
    d = IncrementalDetokenizer(CharTokenizer())
    pieces = [d.push(ord(c)) for c in "hello"] + [d.push(0)]
    assert "".join(pieces) == "hello" and pieces[-1] == ""


def test_detokenizer_holds_back_incomplete_characters():
    """Guards against streaming U+FFFD for a character whose bytes are not all generated yet."""
    d = IncrementalDetokenizer(CharTokenizer())
    assert d.push(ord("a")) == "a"
    assert d.push(1) == ""
    assert d.push(ord("é")) == "é"


def test_stop_string_cuts_text_and_is_never_shown_even_across_pieces():
    """Guards against showing the stop string, or the part of it that arrived first."""
    m = StopStringMatcher(["###"])
    shown = [m.feed(p) for p in ["ab#", "#", "#cd"]]
    assert "".join(shown) == "ab" and m.stopped
    assert m.feed("more") == "" and m.flush() == ""


def test_held_text_that_is_not_a_stop_comes_out():
    """Guards against swallowing text that only looked like the start of a stop string."""
    m = StopStringMatcher(["END"])
    assert m.feed("the E") == "the "
    assert m.feed("nd") == "End"
    assert m.feed("E") == "" and m.flush() == "E" and not m.stopped
