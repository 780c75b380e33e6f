"""The fine-tuning steps in one Python process, no Spark: the baseline of bench/finetune.py.

Same inputs (Kafka-shaped messages), same rules and parameters as the Spark job: decode with
``schemas.codec``, redact with ``redact_text`` and filter with ``quality_reason_py`` (plain-Python
twins of the job's Spark Columns, below; the tests check them against each other), 13-gram
decontamination, latest-feedback ratings, exact dedup on normalised text, MinHash LSH near-dup
(``near_dup_hash_tables`` one-hash tables, exact Jaccard check of candidates, like pyspark.ml),
history within the token budget and up to a missing turn, split by conversation hash, chat
JSONL. Its MinHash hash functions are the Spark job's
(``spark_jobs.dedup.minhash_coefficients``: CRC-32 of a shingle, ``(a*h+b) mod 2**31-1``), so
both drop the same near-duplicates; everything else matches rule for rule. Not a product
path: it exists to be measured against.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
import zlib
from pathlib import Path

from schemas.codec import AvroCodec
from schemas.errors import DecodeError
from spark_jobs.decontam import eval_texts
from spark_jobs.dedup import minhash_coefficients
from spark_jobs.filters import ERROR_FINISH, ERROR_TEXT, LONG_RUN, PROSE_PUNCT, WHITESPACE
from spark_jobs.pii import AFTER_CARDS, CARD_CANDIDATE, PASSES
from spark_jobs.settings import FinetuneSettings
from spark_jobs.split import BUCKETS

_NON_WORD = re.compile(r"[\W_]+")
_P = (1 << 31) - 1


# -- plain-Python twins of the job's rules (the tests check each against its Spark Column) ---------

def luhn_ok(candidate: str) -> bool:
    digits = [int(c) for c in candidate if "0" <= c <= "9"][::-1]
    # every second digit from the right doubled, minus 9 when that makes two digits
    return sum(d if i % 2 == 0 else 2 * d - 9 * (d > 4) for i, d in enumerate(digits)) % 10 == 0


_PY_PASSES = [(re.compile(p), repl, guard) for _, p, _, repl, guard in PASSES]
_PY_AFTER = [(re.compile(p), repl, guard) for _, p, _, repl, guard in AFTER_CARDS]
_CARD_RE = re.compile(CARD_CANDIDATE)
_DIGIT_RE = re.compile(r"[0-9]")


def redact_text(text: str | None) -> str | None:
    """``text`` with every PII match replaced by its ``[KIND]`` placeholder (``pii.redact_column``'s twin)."""
    if text is None:
        return None
    for rx, repl, guard in _PY_PASSES:
        if guard is None or guard in text:
            text = rx.sub(repl, text)
    if not _DIGIT_RE.search(text):   # cards, IPs and phones all hold a digit
        return text
    for cand in [c for c in _CARD_RE.findall(text) if luhn_ok(c)]:
        text = text.replace(cand, "[CARD]")
    for rx, repl, guard in _PY_AFTER:
        text = rx.sub(repl, text)
    return text


_ERROR_TEXT_RE = re.compile(ERROR_TEXT)
_LONG_RUN_RE = re.compile(LONG_RUN)
_TEXT_CHARS = frozenset("0123456789" + WHITESPACE + PROSE_PUNCT)


def text_ratio(answer: str) -> float:
    """Share of ``answer``'s characters that are text (``spark_jobs/filters.py``); 1.0 when empty."""
    if not answer:
        return 1.0
    rest = _LONG_RUN_RE.sub("", answer)
    return sum(1 for c in rest if c.isalpha() or c in _TEXT_CHARS) / len(answer)


def quality_reason_py(turn: dict, s: FinetuneSettings) -> str | None:
    """The first quality rule that holds for ``turn`` (``filters.tag_quality``'s twin), else None."""
    prompt, answer = turn["prompt"] or "", turn["answer"] or ""
    if turn["finish_reason"] in ERROR_FINISH or _ERROR_TEXT_RE.search(answer):
        return "error_response"
    if turn["finish_reason"] == "CANCELLED":
        return "incomplete"
    p, a = prompt.strip(WHITESPACE), answer.strip(WHITESPACE)
    if not p or not a:
        return "empty"
    if len(a) < s.min_answer_chars or len(p) < s.min_prompt_chars:
        return "too_short"
    if len(turn.get("system_prompt") or "") + len(prompt) + len(answer) > s.max_chars:
        return "too_long"
    if text_ratio(answer) < s.min_text_ratio:
        return "mostly_non_text"
    lines = [line.strip(" \t\r") for line in answer.split("\n")]
    lines = [line for line in lines if line]
    if len(lines) >= 2 and 1 - len(set(lines)) / len(lines) > s.max_dup_line_ratio:
        return "repeated_lines"
    return None


def ngrams_py(text: str, n: int) -> set[str]:
    """The normalised word n-grams of ``text`` (``decontam``'s rule)."""
    words = _NON_WORD.sub(" ", text.lower()).strip().split(" ")
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


def split_of(key: str, validation_fraction: float) -> str:
    """The split of the conversation with this key (``split.split_column``'s twin)."""
    bucket = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % BUCKETS
    return "validation" if bucket < validation_fraction * BUCKETS else "train"


def _norm(t: dict) -> str:
    return _NON_WORD.sub(" ", f"{t['prompt']} {t['answer']}".lower()).strip()


def _tok(s: str | None) -> int:
    return 0 if s is None else math.ceil(len(s) / 4) + 4


def run(messages, s: FinetuneSettings, out: Path) -> tuple[dict, dict[str, float]]:
    secs: dict[str, float] = {}
    t0 = time.perf_counter()
    codec = AvroCodec(validate_on_encode=False)
    turns, feedback, drops = [], [], {}

    def drop(step, reason):
        drops.setdefault(step, {}).setdefault(reason, 0)
        drops[step][reason] += 1

    for m in messages:
        try:
            name, rec = codec.decode_dict(m.value)
        except DecodeError:
            drop("decode", "undecodable")
            continue
        if m.topic == s.turns_topic and name == "ConversationTurn":
            rec["created_at"] = int(rec["created_at"].timestamp() * 1000)
            for k in ("system_prompt", "prompt", "answer"):
                rec[k] = redact_text(rec[k])
            turns.append(rec)
        elif m.topic == s.feedback_topic and name == "Feedback":
            rec["created_at"] = int(rec["created_at"].timestamp() * 1000)
            rec["edited_text"] = redact_text(rec["edited_text"])
            feedback.append(rec)
        else:
            drop("decode", "wrong_record_type")
    secs["read+decode+redact"] = time.perf_counter() - t0

    t = time.perf_counter()
    good = []
    for rec in turns:
        reason = quality_reason_py(rec, s)
        if reason:
            drop("quality", reason)
        else:
            good.append(rec)
    secs["quality"] = time.perf_counter() - t

    t = time.perf_counter()
    grams = set()
    for f in s.eval_files:
        for text in eval_texts(f):
            grams |= ngrams_py(text, s.decontam_ngram)
    clean = [r for r in good if not (ngrams_py(_norm(r), s.decontam_ngram) & grams)]
    for _ in range(len(good) - len(clean)):
        drop("decontam", "eval_contamination")
    secs["decontam"] = time.perf_counter() - t

    t = time.perf_counter()
    latest = {}
    for f in sorted(feedback, key=lambda f: (f["created_at"], f["event_id"])):
        latest[f["request_id"]] = f
    for r in clean:
        f = latest.get(r["request_id"])
        r["rating"] = None if f is None else ("up" if f["kind"] == "THUMBS_UP" else "down")
    sft = [r for r in clean if r["rating"] != "down"]
    for _ in range(len(clean) - len(sft)):
        drop("feedback", "rated_down")
    sft.sort(key=lambda r: (r["created_at"], r["event_id"]))
    secs["feedback"] = time.perf_counter() - t

    t = time.perf_counter()
    seen, kept = set(), []
    for r in sft:
        key = _norm(r)
        if key in seen:
            drop("exact_dedup", "exact_duplicate")
        else:
            seen.add(key)
            kept.append(r)
    secs["exact_dedup"] = time.perf_counter() - t

    t = time.perf_counter()
    coeffs = minhash_coefficients(s.seed, s.near_dup_hash_tables)  # the Spark job's hash functions
    tables = [dict() for _ in coeffs]
    shingle_sets, final = [], []
    for r in kept:
        words = _norm(r).split(" ")
        n = s.near_dup_ngram
        sh = {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)} or {" ".join(words)}
        hashes = [zlib.crc32(x.encode()) for x in sh]
        sigs = [min((a * h + b) % _P for h in hashes) for a, b in coeffs]
        cands = {j for table, sig in zip(tables, sigs) for j in table.get(sig, ())}
        dup = any(len(sh & shingle_sets[j]) / len(sh | shingle_sets[j]) >= s.near_dup_threshold for j in cands)
        idx = len(shingle_sets)
        shingle_sets.append(sh)
        for table, sig in zip(tables, sigs):
            table.setdefault(sig, []).append(idx)
        if dup:
            drop("near_dedup", "near_duplicate")
        else:
            final.append(r)
    secs["near_dedup"] = time.perf_counter() - t

    t = time.perf_counter()
    pool: dict[str, dict[int, dict]] = {}
    for r in sorted(clean, key=lambda r: (r["created_at"], r["event_id"])):
        if r["rating"] != "down":
            pool.setdefault(r["conversation_id"], {})[r["turn_index"]] = r
    out.mkdir(parents=True, exist_ok=True)
    files = {sp: open(out / f"{sp}.jsonl", "w", encoding="utf-8") for sp in ("train", "validation")}
    for r in sorted(final, key=lambda r: (r["conversation_id"], r["turn_index"], r["created_at"], r["event_id"])):
        budget = s.max_context_tokens - _tok(r["system_prompt"]) - _tok(r["prompt"]) - _tok(r["answer"])
        history = []
        for n, idx in enumerate(sorted((i for i in pool.get(r["conversation_id"], {}) if i < r["turn_index"]),
                                       reverse=True), start=1):
            if idx != r["turn_index"] - n:
                break  # a missing turn: history stops at the gap (spark_jobs/chat_format.py)
            h = pool[r["conversation_id"]][idx]
            budget -= _tok(h["prompt"]) + _tok(h["answer"])
            if budget < 0:
                break
            history.insert(0, h)
        msgs = [{"role": "system", "content": r["system_prompt"]}] if r["system_prompt"] else []
        for h in history:
            msgs += [{"role": "user", "content": h["prompt"]}, {"role": "assistant", "content": h["answer"]}]
        msgs += [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["answer"]}]
        files[split_of(r["conversation_id"], s.validation_fraction)].write(
            json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
    for fh in files.values():
        fh.close()
    secs["format+write"] = time.perf_counter() - t
    return {"turns": len(turns), "sft": len(final), "drops": drops}, secs
