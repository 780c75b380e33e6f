"""The finetune job on a generated log with planted cases: each case ends where it should."""

from __future__ import annotations

import json
from collections import Counter

import pandas as pd
import pytest

from chatpipe.testing.synthetic_log import CURRENT_TURN_VERSION, LUHN_INVALID, PII, writer_version

pytestmark = pytest.mark.spark


def _sft_event_ids(out) -> set[str]:
    return set(pd.read_parquet(out / "parquet" / "sft")["event_id"])


def _dropped(out) -> pd.DataFrame:
    return pd.read_parquet(out / "parquet" / "dropped")


def test_each_planted_case_ends_where_expected(planted_run, planted_log):
    """Catches a step that drops the wrong record, the right record for the wrong reason, or lets a
    planted case through (duplicates, quality cases, eval leak, regenerated answers)."""
    settings, result = planted_run
    kept = _sft_event_ids(result.out)
    dropped = _dropped(result.out).set_index("event_id")
    for case in planted_log.planted:
        if case.step is None:
            assert case.event_id in kept, f"{case.case}: should be an SFT example"
            assert case.event_id not in dropped.index, f"{case.case}: also dropped"
        else:
            assert case.event_id not in kept, f"{case.case}: should not be an SFT example"
            row = dropped.loc[case.event_id]
            assert (row["step"], row["reason"]) == (case.step, case.reason), case.case


def test_duplicates_name_the_record_they_duplicate(planted_run, planted_log):
    """Catches dedup keeping the later copy or pointing at the wrong original."""
    original = next(p for p in planted_log.planted if p.case == "dup original").event_id
    dropped = _dropped(planted_run[1].out).set_index("event_id")
    for case in ("exact duplicate", "near duplicate"):
        eid = next(p for p in planted_log.planted if p.case == case).event_id
        assert original in dropped.loc[eid, "detail"], case


def test_undecodable_values_are_dropped_with_their_reason(planted_run, planted_log):
    """Catches junk on the topic crashing the job or vanishing without a trace."""
    dropped = _dropped(planted_run[1].out)
    reasons = sorted(dropped[dropped["step"] == "decode"]["reason"])
    assert reasons == sorted(r for r, _ in planted_log.junk_turn_values)


def test_all_schema_versions_are_decoded(planted_run, planted_log):
    """Catches a reader that silently skips records written with an older schema version."""
    card = planted_run[1].card
    versions = Counter(writer_version(t, t.event_id in planted_log.v1_event_ids) for t in planted_log.turns)
    assert set(versions) == {1, 2, CURRENT_TURN_VERSION}
    for v, n in versions.items():
        assert card["input"][f"ConversationTurn v{v}"] == n, v


def test_no_planted_pii_anywhere_in_the_output(planted_run):
    """Catches a PII kind that survives redaction in any output file (JSONL, Parquet, dropped, card)."""
    out = planted_run[1].out
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.suffix == ".parquet" for p in files) and any(p.suffix == ".jsonl" for p in files)
    blobs = []
    for p in files:
        if p.suffix == ".parquet":
            blobs.append(pd.read_parquet(p).to_json(force_ascii=False))  # decompressed text
        else:
            blobs.append(p.read_text(encoding="utf-8"))
    text = "\n".join(blobs)
    for kind, value in PII.items():
        assert value not in text, f"{kind} leaked"
    assert "[CARD]" in text and "[EMAIL]" in text and "[SECRET]" in text and "[IP]" in text and "[PHONE]" in text


def test_luhn_invalid_numbers_are_not_cards(planted_run, planted_log):
    """Catches card redaction without the Luhn check (any long digit run called a card), or the
    number redacted in part as a phone (its first three groups used to become ``[PHONE]``)."""
    eid = next(p for p in planted_log.planted if p.case == "luhn-invalid number").event_id
    sft = pd.read_parquet(planted_run[1].out / "parquet" / "sft").set_index("event_id")
    answer = sft.loc[eid, "messages"][-1]["content"]
    assert "[CARD]" not in answer and "[PHONE]" not in answer and LUHN_INVALID in answer


def test_preference_pairs_from_regenerations_and_edits(planted_run, planted_log):
    """Catches pairs with chosen and rejected swapped, or regenerations rated up/down giving no pair."""
    prefs = pd.read_parquet(planted_run[1].out / "parquet" / "preference")
    got = set(zip(prefs["chosen_event_id"], prefs["rejected_event_id"]))
    assert set(planted_log.pairs) <= got
    assert len(got) == len(planted_log.pairs)


def test_jsonl_is_openai_chat_format_with_history(planted_run, planted_log):
    """Catches malformed chat lines and examples that lose the earlier turns of their conversation."""
    out = planted_run[1].out
    lines = [json.loads(line) for split in ("train", "validation")
             for line in (out / "sft" / f"{split}.jsonl").read_text().splitlines()]
    assert lines
    for line in lines:
        roles = [m["role"] for m in line["messages"]]
        assert roles[-2:] == ["user", "assistant"] and set(roles) <= {"system", "user", "assistant"}
    by_conv = {}
    for t in planted_log.turns:
        by_conv.setdefault(t.conversation_id, []).append(t)
    multi = max(by_conv.values(), key=len)
    assert len(multi) >= 3
    last = max(multi, key=lambda t: t.turn_index)
    sft = pd.read_parquet(out / "parquet" / "sft").set_index("event_id")
    assert sft.loc[last.event_id, "history_turns"] == last.turn_index


def test_split_is_by_conversation(planted_run):
    """Catches a conversation whose turns straddle train and validation (leaks between splits)."""
    sft = pd.read_parquet(planted_run[1].out / "parquet" / "sft")
    assert set(sft["split"]) == {"train", "validation"}
    assert (sft.groupby("conversation_id")["split"].nunique() == 1).all()


def test_card_counts_match_outputs(planted_run):
    """Catches a card whose step counts do not add up or disagree with the files written."""
    out, card = planted_run[1].out, planted_run[1].card
    for step in card["steps"]:
        assert step["input"] == step["kept"] + step["dropped"]
    for name, n in card["outputs"].items():
        assert len((out / name).read_text().splitlines()) == n
    dropped = _dropped(out)
    assert sum(sum(r.values()) for r in card["drops"].values()) == len(dropped)
    assert (out / "dataset_card.md").read_text().count("|") > 20


def test_rerun_gives_identical_output(spark, planted_run, tmp_path):
    """Catches nondeterminism (unstable dedup choice, split or ordering) between runs on the same input."""
    from spark_jobs.finetune_dataset import run
    from transport.settings import KafkaSettings

    settings, first = planted_run
    again = run(spark, settings.model_copy(update={"out": tmp_path / "again"}), KafkaSettings())
    for name in ("sft/train.jsonl", "sft/validation.jsonl", "preference/train.jsonl", "dataset_card.json"):
        assert (first.out / name).read_bytes() == (again.out / name).read_bytes(), name
    assert pd.read_parquet(first.out / "parquet" / "dropped").equals(pd.read_parquet(again.out / "parquet" / "dropped"))


def test_rows_name_the_exact_model_version_that_answered(planted_run, planted_log):
    """Catches a dataset row that loses which model (base or name@version) gave its answer: the rollout of
    a fine-tuned version is judged, and later versions trained, on rows that say it (issue 42)."""
    sft = pd.read_parquet(planted_run[1].out / "parquet" / "sft")
    answered_by = {t.event_id: t.model for t in planted_log.turns}
    assert {(e, m) for e, m in zip(sft["event_id"], sft["model"])} <= set(answered_by.items())
    assert {"smollm2-135m", "acme-support@2"} <= set(sft["model"])
