"""PII redaction: emails, phone numbers, card numbers (Luhn-checked), IP addresses, API keys
and secrets, replaced by ``[EMAIL]``, ``[PHONE]``, ``[CARD]``, ``[IP]``, ``[SECRET]``.

One list of patterns, written in the subset of regex syntax that Java (Spark's
``regexp_replace``) and Python's ``re`` read the same way (``[0-9]`` rather than ``\\d``, no
possessive quantifiers), drives both the Spark column expression (:func:`redact_column`, no
Python UDF: the Luhn check is SQL higher-order functions over the candidate matches) and the
plain-Python function (:func:`redact_text`) used by the single-process baseline and tests.

Order matters and is fixed: secrets first (keys contain digit runs that look like phones or
cards), then emails, cards, IPs (dotted digits) and phones last. A digit run that fails the
Luhn check is not a card; it may still be redacted as a phone number if it looks like one.
Redaction never drops a record; counts per kind go to the dataset card.

Not detected: names, postal addresses, national ids (need NER, out of scope here).
"""

from __future__ import annotations

import re

KINDS = ("SECRET", "EMAIL", "CARD", "IP", "PHONE")

_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_HEX = r"[0-9A-Fa-f]{1,4}"

SECRET_TOKEN = "|".join([
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----",
    r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{16,}",       # OpenAI / Stripe style
    r"\bAKIA[0-9A-Z]{16}\b",                      # AWS access key id
    r"\bgh[pousr]_[A-Za-z0-9]{30,}",              # GitHub tokens
    r"\bxox[abprs]-[A-Za-z0-9-]{10,}",            # Slack tokens
    r"\bAIza[0-9A-Za-z_-]{35}",                   # Google API key
    r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",  # JWT
])
#: ``api_key = value`` and friends: the name stays, the value goes. Groups: 1 name, 2 separator.
SECRET_ASSIGNMENT = (
    r"(?i)\b(api[_-]?key|secret(?:[_-]?key)?|access[_-]?token|auth[_-]?token|token|password|passwd|pwd)"
    r"(\s*[:=]\s*)[\"']?[^\s\"']{6,}[\"']?"
)
EMAIL = r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"
CARD_CANDIDATE = r"\b(?:[0-9][ -]?){12,18}[0-9]\b"
IP = (
    rf"\b(?:{_OCTET}\.){{3}}{_OCTET}\b"
    rf"|\b(?:{_HEX}:){{7}}{_HEX}\b"
    rf"|\b(?:{_HEX}:){{1,6}}:(?:{_HEX}:){{0,5}}{_HEX}\b"
)
PHONE = (
    r"(?<![A-Za-z0-9_+])(?:\+[0-9]{1,3}[ .-]?)?(?:\([0-9]{2,4}\)[ .-]?|[0-9]{2,4}[ .-])"
    r"[0-9]{3,4}[ .-]?[0-9]{3,4}(?![A-Za-z0-9_])"
    r"|\+[0-9]{10,14}\b"
)


# --- plain Python ------------------------------------------------------------------------

def luhn_ok(candidate: str) -> bool:
    digits = [int(c) for c in candidate if c.isdigit()][::-1]
    total = 0
    for i, d in enumerate(digits):
        if i % 2 == 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


_SECRET_TOKEN_RE = re.compile(SECRET_TOKEN)
_SECRET_ASSIGNMENT_RE = re.compile(SECRET_ASSIGNMENT)
_EMAIL_RE = re.compile(EMAIL)
_CARD_RE = re.compile(CARD_CANDIDATE)
_IP_RE = re.compile(IP)
_PHONE_RE = re.compile(PHONE)


def redact_text(text: str | None) -> str | None:
    """``text`` with every PII match replaced by its ``[KIND]`` placeholder."""
    if text is None:
        return None
    text = _SECRET_TOKEN_RE.sub("[SECRET]", text)
    text = _SECRET_ASSIGNMENT_RE.sub(r"\1\2[SECRET]", text)
    text = _EMAIL_RE.sub("[EMAIL]", text)
    for cand in [c for c in _CARD_RE.findall(text) if luhn_ok(c)]:
        text = text.replace(cand, "[CARD]")
    text = _IP_RE.sub("[IP]", text)
    return _PHONE_RE.sub("[PHONE]", text)


# --- Spark --------------------------------------------------------------------------------

def _luhn_column(candidate):
    from pyspark.sql import functions as F

    digits = F.reverse(F.transform(
        F.filter(F.split(F.regexp_replace(candidate, "[^0-9]", ""), ""), lambda s: s != ""),
        lambda s: s.cast("int"),
    ))
    doubled = lambda i: F.when(digits[i] * 2 > 9, digits[i] * 2 - 9).otherwise(digits[i] * 2)  # noqa: E731
    total = F.aggregate(
        F.sequence(F.lit(0), F.size(digits) - 1), F.lit(0),
        lambda acc, i: acc + F.when(i % 2 == 1, doubled(i)).otherwise(digits[i]),
    )
    return total % 10 == 0


def redact_column(col):
    """A Column: ``col`` redacted like :func:`redact_text` (JVM only, no Python UDF)."""
    from pyspark.sql import functions as F

    col = F.regexp_replace(col, SECRET_TOKEN, "[SECRET]")
    col = F.regexp_replace(col, SECRET_ASSIGNMENT, "$1$2[SECRET]")
    col = F.regexp_replace(col, EMAIL, "[EMAIL]")
    cards = F.filter(F.regexp_extract_all(col, F.lit(CARD_CANDIDATE), 0), _luhn_column)
    col = F.aggregate(cards, col, lambda acc, c: F.replace(acc, c, F.lit("[CARD]")))
    col = F.regexp_replace(col, IP, "[IP]")
    return F.regexp_replace(col, PHONE, "[PHONE]")


def placeholder_count(col, kind: str):
    """How many ``[KIND]`` placeholders a redacted column holds."""
    from pyspark.sql import functions as F

    return F.coalesce(F.regexp_count(col, F.lit(rf"\[{kind}\]")), F.lit(0))
