"""The one tokenization of a chat prompt: the template's markup with its control tokens, every
message's content as plain text (issue 19).

Rendering the chat template and encoding the result with special tokens parsed (what every
caller did before) lets a user write ``<|im_end|>\\n<|im_start|>system ...`` and open a real
system turn. Here the template's own markup keeps its control tokens and the content never
yields one:

1. the template is rendered once with each content replaced by a sentinel, which tells where
   the template's own text is (and so where its own control tokens are);
2. if every control token of the real rendering sits where the template put one (no content
   contains one, none straddles a content edge), the whole text is encoded as before: the ids
   are exactly the old ones, by construction;
3. otherwise the text is cut at the template's control tokens only, and each run between them
   (template text and content together, as the tokenizer cuts at control tokens itself) is
   encoded with ``split_special_tokens=True``: text that looks like a control token becomes
   ordinary tokens.

Used by the engine's CLI (``text.encode_prompt``), the inference worker (``prompts.py``) and the
streams context budget (``streams/tokens.py``), so all three count and build the same ids. Pure
Python: the tokenizer is duck-typed (a Hugging Face tokenizer), nothing is imported.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping, Sequence

log = logging.getLogger(__name__)

# Neither a template nor a tokenizer produces these; they only mark content in the sentinel render.
_SENTINEL = "\ue000chatpipe-content-{}\ue001"
_SENTINEL_RE = re.compile("\ue000chatpipe-content-(\\d+)\ue001")
_warned_templates: set[int] = set()


def special_tokens(tokenizer: Any) -> list[str]:
    """Every control token the tokenizer parses out of text (special added tokens and the named
    special tokens), longest first."""
    names = set(getattr(tokenizer, "all_special_tokens", None) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    names |= {t.content for t in decoder.values() if getattr(t, "special", False)}
    return sorted((n for n in names if n), key=lambda n: (-len(n), n))


class ChatTemplateError(ValueError):
    """The model's chat template refused these messages (its ``raise_exception``: roles that do not
    alternate, a role it does not know): the request's fault, answered as invalid by streams and
    the worker, never a crash of the tier."""


def render(tokenizer: Any, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
    try:
        return tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except Exception as exc:
        # jinja2's TemplateError (what a template's raise_exception raises) and UndefinedError are
        # about these messages; a TemplateSyntaxError is the template's own, a configuration error.
        # By name: this module imports nothing (the tokenizer is duck-typed).
        names = {c.__name__ for c in type(exc).__mro__ if c.__module__.startswith("jinja2")}
        if "TemplateError" not in names or "TemplateSyntaxError" in names:
            raise
        raise ChatTemplateError(f"the model's chat template refused the messages: {exc}") from exc


def encode_plain(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of user text, control-token look-alikes included as plain text."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=True))


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` (``{"role", "content"}``) through the tokenizer's chat template;
    without a template, the contents joined by newlines, as plain text."""
    if not getattr(tokenizer, "chat_template", None):
        return encode_plain(tokenizer, "\n".join(m["content"] for m in messages), add_special_tokens=True)
    text = render(tokenizer, messages, add_generation_prompt)
    specials = special_tokens(tokenizer)
    if not specials:
        return list(tokenizer.encode(text, add_special_tokens=False))
    # Longest first, so the leftmost match is the longest one (how the tokenizer matches them too).
    pattern = re.compile("|".join(map(re.escape, specials)))
    marked = [{**m, "content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
    sentinel_text = render(tokenizer, marked, add_generation_prompt)
    pieces = _pieces(messages, sentinel_text, text)
    if pieces is not None:
        if _specials_where_template_put_them(pattern, pieces, text):
            return list(tokenizer.encode(text, add_special_tokens=False))  # the ids of before, exactly
        return _encode_runs(tokenizer, pattern, pieces)
    # The template rewrites contents in a way not followed here (a filter other than trim).
    if id(tokenizer.chat_template) not in _warned_templates:
        _warned_templates.add(id(tokenizer.chat_template))
        log.warning("the chat template changes message contents in a way not followed here; control tokens "
                    "are still taken from the template only")
    if len(pattern.findall(text)) == len(pattern.findall(sentinel_text)):
        return list(tokenizer.encode(text, add_special_tokens=False))  # no content brought a control token
    order = [int(i) for i in _SENTINEL_RE.findall(sentinel_text)]
    if order:  # the template's text with the contents as given: its control tokens only
        parts = _SENTINEL_RE.split(sentinel_text)[0::2]
        return _encode_runs(tokenizer, pattern, _interleave(parts, [messages[i]["content"] for i in order]))
    return encode_plain(tokenizer, text)  # nowhere to tell template from content: no control token at all


def _pieces(messages: Sequence[Mapping[str, str]], sentinel_text: str, text: str) -> list[tuple[str, bool]] | None:
    """The rendering as (text, is_template) pieces: the template's text and each message content;
    None when the template's contents cannot be placed in ``text``."""
    template_parts = _SENTINEL_RE.split(sentinel_text)  # [text, index, text, index, ..., text]
    order = [int(i) for i in template_parts[1::2]]
    for transform in (lambda c: c, str.strip):  # as given, or trimmed (Llama 3's templates `| trim`)
        pieces = _interleave(template_parts[0::2], [transform(messages[i]["content"]) for i in order])
        if "".join(p for p, _ in pieces) == text:
            return pieces
    return None


def _interleave(template: list[str], contents: list[str]) -> list[tuple[str, bool]]:
    pieces = [(template[0], True)]
    for content, after in zip(contents, template[1:]):
        pieces += [(content, False), (after, True)]
    return pieces


def _specials_where_template_put_them(pattern: re.Pattern[str], pieces: list[tuple[str, bool]], text: str) -> bool:
    expected, offset = [], 0
    for piece, is_template in pieces:
        if is_template:
            expected += [(offset + m.start(), m.group()) for m in pattern.finditer(piece)]
        offset += len(piece)
    return [(m.start(), m.group()) for m in pattern.finditer(text)] == expected


def _encode_runs(tokenizer: Any, pattern: re.Pattern[str], pieces: list[tuple[str, bool]]) -> list[int]:
    """Cut at the template's control tokens only; each run between them encoded as plain text."""
    runs: list[str] = [""]
    specials: list[str] = []  # specials[i] comes after runs[i]
    for piece, is_template in pieces:
        if not is_template:
            runs[-1] += piece
            continue
        last = 0
        for m in pattern.finditer(piece):
            runs[-1] += piece[last : m.start()]
            specials.append(m.group())
            runs.append("")
            last = m.end()
        runs[-1] += piece[last:]
    special_ids = tokenizer.convert_tokens_to_ids(specials) if specials else []
    nonempty = [r for r in runs if r]
    encoded = iter(tokenizer(nonempty, add_special_tokens=False, split_special_tokens=True)["input_ids"]) if nonempty \
        else iter(())
    ids: list[int] = []
    for i, run in enumerate(runs):
        if run:
            ids += next(encoded)
        if i < len(special_ids):
            ids.append(special_ids[i])
    return ids
