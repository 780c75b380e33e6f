"""PII redaction: secrets, emails, card numbers (Luhn-checked), IP addresses and phone numbers,
each whole match replaced by ``[SECRET]``, ``[EMAIL]``, ``[CARD]``, ``[IP]`` or ``[PHONE]``.

One list of patterns, written in the subset of regex syntax that Java (Spark's
``regexp_replace``) and Python's ``re`` read the same way, drives both the Spark column
expression (:func:`redact_column`, no Python UDF: the Luhn check is SQL higher-order functions
over the candidate matches) and the plain-Python twin (``redact_text`` in
``bench/finetune_reference.py``) used by the single-process baseline and the tests. The subset:
ASCII classes (``[0-9]`` not ``\\d``, no ``\\s``/``\\w``/``\\b``, whose Unicode meaning differs),
``[`` escaped inside classes (Java reads it as a nested class), no ``&&`` in a class (Java:
intersection), no possessive quantifiers, each lookbehind of fixed width (Python's rule),
``(?i:...)`` scoped flags only, and replacement group references that are the same in both (an
unmatched group inserts nothing in both).

Why the patterns look the way they do (rules in docs/spark_jobs.md, "Redaction rules"):

- A match covers the whole PII span: an address's full local part (RFC 5322 atext, dots, quoted
  ``"john doe"@``), a phone number with its ``+44``/``0044`` country code and ``(0)`` trunk
  prefix, a key block with its body. Boundaries are explicit lookarounds, so a match never
  starts or ends inside a longer token (no half of an order number redacted as a phone).
- Look-alikes are told apart by shape, not by luck: phones are three families (international
  ``+``/``00``, North-American 3-3-4, national trunk ``0...``) and a date shape is refused;
  dotted quads need octets <= 255 and no version context (``version``, ``build``, ``v``,
  ``Chrome/`` ...); cards need a 2-6 leading digit (card networks; ISBNs start 978/979) and
  the Luhn check; IPv6 needs a ``::`` or eight groups and a digit (not ``std::vector``).
- Every quantifier is bounded or its repeats cannot overlap (a class followed by a delimiter
  outside it), so no input makes Java's backtracking blow up (tested on long pathological input).
- Order is fixed: secrets first (keys contain digit runs and ``@``), emails (IP-literal domains),
  cards (before phones take their digit groups), IPs (before phones take dotted digits), phones.

Not detected: names, postal addresses, national ids (need NER, out of scope here).
"""

from __future__ import annotations

KINDS = ("SECRET", "EMAIL", "CARD", "IP", "PHONE")

# --- secrets -----------------------------------------------------------------------------

_KEY_END = r"-----END [A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----"
#: A key block: the BEGIN line, whitespace-separated base64/header tokens, the END line; or, when
#: the END line is missing (a truncated paste), the BEGIN line and the base64 lines that follow
#: (tokens of 16+ characters, so the prose after it stays). Both loops are bounded (Java recurses
#: per group iteration) and their tokens cannot overlap (whitespace between), so they stay linear.
_KEY_BLOCK = (
    r"-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----"
    rf"(?:(?:[ \t\r\n]+(?!-----END)[A-Za-z0-9+/=:,-]+){{0,400}}[ \t\r\n]+{_KEY_END}"
    r"|(?:[ \t\r\n]+[A-Za-z0-9+/=:,-]{16,}){0,400})"
)
_TOKENS = "|".join([
    r"(?:sk|pk|rk)-(?=[A-Za-z_-]*[0-9])[A-Za-z0-9_-]{20,}",  # OpenAI sk-/sk-proj-, Anthropic sk-ant-
    r"(?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{10,}",          # Stripe
    r"whsec_[A-Za-z0-9]{20,}",                               # Stripe webhook secret
    r"(?:AKIA|ASIA|AGPA|AIDA|AIPA|ANPA|ANVA|AROA|APKA|ABIA|ACCA)[0-9A-Z]{16}",  # AWS key ids
    r"gh[pousr]_[A-Za-z0-9]{30,}",                           # GitHub classic tokens
    r"github_pat_[A-Za-z0-9_]{30,}",                         # GitHub fine-grained tokens
    r"xox[abposre]-[A-Za-z0-9-]{10,}",                       # Slack tokens
    r"xapp-[0-9]-[A-Za-z0-9-]{10,}",                         # Slack app tokens
    r"hooks\.slack\.com/services/[A-Za-z0-9/]{20,}",          # Slack webhook URL path
    r"AIza[0-9A-Za-z_-]{35}",                                # Google API keys
    r"eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}(?:\.[A-Za-z0-9_-]+)?",  # JWT
])
# (?=[Aeghprswx]): every token starts with one of these; the cheap look first keeps Java fast
SECRET_TOKEN = rf"{_KEY_BLOCK}|(?<![A-Za-z0-9_-])(?=[Aeghprswx])(?:{_TOKENS})(?![A-Za-z0-9_-])"

_SECRET_NAMES = (
    r"(?i:pass(?:word|wd|phrase)|pwd|secret[ _-]?key|client[_-]?secret|secret|token|api[ _-]?key|apikey"
    r"|access[ _-]?key|private[ _-]?key|credentials?)"
)
#: ``api_key = value``, ``"password": "value"``, ``Bearer value``: the name and quotes stay, the
#: value goes. Groups: 1 name and separator, 2/3 the opening quote of a quoted value.
#: The name's match starts at the keyword, wherever it is (``db_password``, ``PGPASSWORD``,
#: ``accessToken``: the prefix stays), which also keeps the pattern cheap: no prefix scanning.
SECRET_ASSIGNMENT = (
    rf"((?=[AaCcPpSsTt]){_SECRET_NAMES}(?:[\"']?[ \t]*(?::=|=>|[:=])[ \t]*"
    # "my password is hunter2": only a value with a digit or symbol ("password is required" stays)
    r"|[ \t]+(?:is|was)[ \t]+(?=[^ \t\r\n]*[0-9!@#$%^&*]))"
    r"|(?<![A-Za-z0-9_])(?=[Bb])(?i:bearer|basic)[ \t]+(?=[A-Za-z._~+/-]*[0-9=])(?=[A-Za-z0-9._~+/=-]{12}))"
    r"(?!\[SECRET\])(?:(\")[^\"\r\n]{1,200}\"|(')[^'\r\n]{1,200}'|[^ \t\r\n\"'<>,;]{5,}[^ \t\r\n\"'<>,;.:)\]}])"
)
_ASSIGNMENT_JAVA = "$1$2$3[SECRET]$2$3"
_ASSIGNMENT_PY = r"\1\2\3[SECRET]\2\3"

# --- emails ------------------------------------------------------------------------------

_LATIN = r"\u00C0-\u024F"                      # accented Latin letters (RFC 6531 addresses)
_ATEXT = rf"A-Za-z0-9{_LATIN}!#$%&'*+/=?^_`{{|}}~-"     # RFC 5322 atext
_ATEXT_FIRST = rf"A-Za-z0-9{_LATIN}!#$%+/=^_{{|}}~-"   # not ' ` * (prose quotes, markdown), ? & (query strings)
#: Groups: 1 a ``name=`` before the address (kept: ``email=a@b.c`` -> ``email=[EMAIL]``).
EMAIL = (
    r"([A-Za-z_][A-Za-z0-9_.-]{0,30}=)?"
    rf"(?:[{_ATEXT_FIRST}][.{_ATEXT}]{{0,63}}|\"[^\"\\\r\n]{{1,64}}\")"
    rf"@(?:(?![0-9]x\.)(?:[A-Za-z0-9{_LATIN}](?:[A-Za-z0-9{_LATIN}-]{{0,61}}[A-Za-z0-9{_LATIN}])?\.){{1,8}}"
    r"[A-Za-z]{2,24}(?![A-Za-z0-9-])"
    r"|\[(?:[0-9]{1,3}(?:\.[0-9]{1,3}){3}|IPv6:[0-9A-Fa-f:.]{2,45})\])"
)

# --- cards -------------------------------------------------------------------------------

CARD_CANDIDATE = (
    r"(?<![A-Za-z0-9_.])(?<![0-9]-)"
    r"(?:[2-6][0-9]{12,18}"                          # unbroken 13-19 digits
    r"|[2-6][0-9]{3}(?:[ -][0-9]{4}){2}[ -][0-9]{1,7}"  # 4-4-4-(1..7)
    r"|3[0-9]{3}[ -][0-9]{6}[ -][0-9]{4,5})"         # Amex 4-6-5, Diners 4-6-4
    r"(?![A-Za-z0-9_]|[.-][0-9])"
)

# --- IP addresses ------------------------------------------------------------------------

_OCTET = r"(?:25[0-5]|2[0-4][0-9]|[01]?[0-9]{1,2})"  # 0-255, leading zeros allowed (192.168.001.001)
_IPV4 = rf"{_OCTET}(?:\.{_OCTET}){{3}}"
_H = r"[0-9A-Fa-f]{1,4}"
#: A dotted quad right after one of these is a version, not an address.
_VERSION_WORDS = ("version", "Version", "VERSION", "ver", "Ver", "build", "Build", "release", "Release",
                  "rev", "Rev", "firmware", "Firmware", "kernel", "Kernel", "patch", "Patch",
                  "update", "Update", "section", "Section", "chapter", "Chapter", "\u00a7",
                  "Chrome", "Chromium", "Edge", "Firefox", "Safari", "Opera", "Windows", "Android",
                  "iOS", "macOS", "Node", "Python", "Java", "Excel", "Office")
_VERSION_CONTEXT = "".join(rf"(?<!{w}{sep})" for w in _VERSION_WORDS for sep in (" ", ": ", "="))
IP = (
    r"(?<![A-Za-z0-9_.])(?:"
    # IPv6 (needs a digit: not C++ ``ab::cd``; a leading ``::`` needs two groups or is ``::1``:
    # not Python's ``s[::2]``); embedded IPv4 forms first, zone id kept with it
    r"(?=[A-Fa-f:]{0,40}[0-9])"
    rf"(?:::(?:(?i:ffff)(?::0{{1,4}})?:)?{_IPV4}|(?:{_H}:){{1,4}}:{_IPV4}"
    rf"|(?:{_H}:){{7}}{_H}|(?:{_H}:){{1,6}}:(?:{_H}(?::{_H}){{0,5}})?|::{_H}(?::{_H}){{1,6}}|::1)"
    r"(?:%[0-9A-Za-z._~-]{1,32})?(?![0-9A-Za-z_]|\.[0-9]|:[0-9A-Fa-f])"
    # IPv4: not inside a longer dotted number, not a version (context word, Product/1.2.3.4, -beta);
    # the cheap lookahead first so that the context lookbehinds run only before a dotted number
    rf"|(?=[0-9]{{1,3}}\.[0-9]{{1,3}}\.)(?<![A-Za-z0-9_]/){_VERSION_CONTEXT}"
    rf"{_IPV4}(?![A-Za-z0-9_]|\.[0-9]|[-+][A-Za-z])"
    r")"
)

# --- phones ------------------------------------------------------------------------------

PHONE = (
    r"(?=[+(0-9])(?<![A-Za-z0-9_#$/.,+-])(?<![$\u20ac\u00a3] )"
    # a date (05.01.2024, 12-31-99) is not a phone, whatever family it would fit
    r"(?![0-9]{1,4}[./-][0-9]{1,2}[./-][0-9]{1,4}(?![0-9]|[./-][0-9]))"
    r"(?:"
    # international: +CC, 00CC or (+CC), optional (0) trunk and (area), groups; at least 8 digits
    # (00CC not right after another digit group: 3704 0044 0532 is an account number)
    r"(?:\(?\+|(?<![0-9] )\(?00)(?=(?:[ ./()-]{0,3}[0-9]){8})[1-9][0-9]{0,2}\)?(?:[ .-]?\(0\))?"
    r"(?:[ .-]?\([0-9]{1,5}\))?[ .-]?[0-9]{1,12}(?:(?:[ .-]|[ ]?/[ ]?)[0-9]{1,12}){0,6}"
    # North American 3-3-4, optional leading 1
    r"|(?:1[ .-]?)?(?:\([0-9]{3}\)[ .-]?|[0-9]{3}[ .-])[0-9]{3}[ .-][0-9]{4}"
    # national with trunk 0: (020) 7946 0958, 020 7946 0958, 030 123456, 030/123456, 06 12 34 56 78
    # (not right after another digit group: 8 045 311 447 is a count)
    r"|(?<![0-9] )(?:\(0[1-9][0-9]{0,3}\)[ .-]?[0-9]{3,4}[ .-]?[0-9]{3,4}"
    r"|0[1-9][0-9]{1,3}(?:[ /-][0-9]{6,8}|(?:[ -][0-9]{3,4}){2,3})"
    r"|0[1-9](?:[ .-][0-9]{2}){4})"
    r")(?![A-Za-z0-9_]|[./:-][0-9])"
)

#: (kind, pattern, Java replacement, Python replacement, a substring every match contains or None).
#: The guard lets both paths skip a pattern on text that cannot match it (same output, less time).
#: Python replacements: the plain-Python twin's (``bench/finetune_reference.py``).
PASSES = (
    ("SECRET", SECRET_TOKEN, "[SECRET]", "[SECRET]", None),
    ("SECRET", SECRET_ASSIGNMENT, _ASSIGNMENT_JAVA, _ASSIGNMENT_PY, None),
    ("EMAIL", EMAIL, "$1[EMAIL]", r"\1[EMAIL]", "@"),
)
AFTER_CARDS = (
    ("IP", IP, "[IP]", "[IP]", None),
    ("PHONE", PHONE, "[PHONE]", "[PHONE]", None),
)


# --- Spark --------------------------------------------------------------------------------

def _luhn_column(candidate):
    from pyspark.sql import functions as F

    digits = F.reverse(F.transform(
        F.filter(F.split(F.regexp_replace(candidate, "[^0-9]", ""), ""), lambda s: s != ""),
        lambda s: s.cast("int"),
    ))
    doubled = lambda i: F.when(digits[i] * 2 > 9, digits[i] * 2 - 9).otherwise(digits[i] * 2)
    total = F.aggregate(
        F.sequence(F.lit(0), F.size(digits) - 1), F.lit(0),
        lambda acc, i: acc + F.when(i % 2 == 1, doubled(i)).otherwise(digits[i]),
    )
    return total % 10 == 0


def _let(value, body):
    """``body(v)`` with ``v`` bound once to ``value`` (a one-element ``transform``): a guard and its
    two branches then refer to a lambda variable instead of each re-evaluating the long expression
    ``value`` (higher-order functions evaluate their arguments outside codegen's subexpression
    elimination)."""
    from pyspark.sql import functions as F

    return F.transform(F.array(value), body)[0]


def _guarded_pass(pattern: str, repl: str, guard: str):
    from pyspark.sql import functions as F

    return lambda v: F.when(F.instr(v, guard) > 0, F.regexp_replace(v, pattern, repl)).otherwise(v)


def _number_passes(v):
    """Cards (Luhn-checked candidates), then IPs, then phones; only on text holding a digit."""
    from pyspark.sql import functions as F

    cards = F.filter(F.regexp_extract_all(v, F.lit(CARD_CANDIDATE), 0), _luhn_column)
    out = F.aggregate(cards, v, lambda acc, c: F.replace(acc, c, F.lit("[CARD]")))
    for _, pattern, repl, _, _ in AFTER_CARDS:
        out = F.regexp_replace(out, pattern, repl)
    return F.when(v.rlike("[0-9]"), out).otherwise(v)


def redact_column(col):
    """A Column: ``col`` with every PII match replaced by its ``[KIND]`` placeholder (JVM only, no Python UDF)."""
    from pyspark.sql import functions as F

    for _, pattern, repl, _, guard in PASSES:
        col = F.regexp_replace(col, pattern, repl) if guard is None else _let(col, _guarded_pass(pattern, repl, guard))
    return _let(col, _number_passes)


def placeholder_count(col, kind: str):
    """How many ``[KIND]`` placeholders a redacted column holds."""
    from pyspark.sql import functions as F

    return F.coalesce(F.regexp_count(col, F.lit(rf"\[{kind}\]")), F.lit(0))
