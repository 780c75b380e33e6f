"""Per-version stats from turns and feedback, and the rollout rule (streams/version_stats.py): pure units."""

from __future__ import annotations

from schemas.records import (ConversationTurn, Feedback, FeedbackKind, FinishReason, ModelState, ModelVersion,
                             VersionStats)
from streams.version_stats import VersionLedger, compared_with, decide

BASE = "smollm2-135m-instruct"


def turn(request_id: str, model: str, finish=FinishReason.STOP, ttft_ms=100.0, total_ms=1100.0, tokens_out=20):
    return ConversationTurn(conversation_id="c", user_id="u", tenant="acme", request_id=request_id, turn_index=0,
                            prompt="p", answer="a", model=model, worker_id="w", tokens_in=5, tokens_out=tokens_out,
                            queue_ms=0.0, ttft_ms=ttft_ms, total_ms=total_ms, finish_reason=finish, created_at=1,
                            completed_at=2)


def feedback(request_id: str, kind: FeedbackKind) -> Feedback:
    return Feedback(conversation_id="c", user_id="u", tenant="acme", request_id=request_id, kind=kind)


def canary(min_rated=10, max_drop=0.05, confidence=0.95) -> ModelVersion:
    return ModelVersion(name="acme-lora", version=2, base_model=BASE, base_model_sha256="0", adapter_uri="/a",
                        adapter_sha256="0", card_uri="/c", lineage_uri="/l", dataset_uri="/d", dataset_manifest_id="0",
                        tenant="acme", training_rows=1, state=ModelState.CANARY, canary_share=0.5,
                        rule_min_rated=min_rated, rule_max_drop=max_drop, rule_confidence=confidence)


def test_turns_and_feedback_join_per_version_whatever_order_they_are_read_in():
    ledger = VersionLedger(since=0)
    ledger.add_feedback(feedback("r1", FeedbackKind.THUMBS_UP))  # before its turn: waits for it
    ledger.add_turn(turn("r1", "acme-lora@2"))
    ledger.add_turn(turn("r2", "acme-lora@2", finish=FinishReason.ERROR, ttft_ms=300.0, total_ms=300.0, tokens_out=0))
    ledger.add_turn(turn("r3", BASE))
    ledger.add_turn(turn("r1", "acme-lora@2"))  # the same turn read again: counted once
    for kind in (FeedbackKind.THUMBS_UP, FeedbackKind.THUMBS_DOWN, FeedbackKind.REGENERATE, FeedbackKind.REGENERATE,
                 FeedbackKind.EDIT):
        ledger.add_feedback(feedback("r2", kind))  # the latest rating counts; a regenerate once
    ledger.add_feedback(feedback("r3", FeedbackKind.THUMBS_DOWN))
    v2, base = ledger.stats["acme-lora@2"], ledger.stats[BASE]
    assert (v2.turns, v2.errors, v2.rated, v2.thumbs_up, v2.thumbs_down, v2.regenerations, v2.edits) == (2, 1, 2, 1, 1, 1, 1)
    assert (v2.ttft_ms_sum, v2.tokens_out, v2.decode_ms_sum) == (400.0, 20, 1000.0)
    assert (base.rated, base.thumbs_down) == (1, 1)
    assert [s.model for s in ledger.take_changed()] == ["acme-lora@2", BASE] and ledger.take_changed() == []


def rated(model: str, up: int, down: int) -> VersionStats:
    return VersionStats(model=model, rated=up + down, thumbs_up=up, thumbs_down=down)


def test_the_rule_waits_for_enough_ratings_then_promotes_a_canary_not_worse_and_rolls_back_a_worse_one():
    rule = canary(min_rated=20, max_drop=0.1)
    assert decide(rule, rated("acme-lora@2", 15, 2), rated(BASE, 10, 10)).action is None  # 17 < 20
    better = decide(rule, rated("acme-lora@2", 27, 3), rated(BASE, 12, 18))
    assert better.action == "promote" and better.reason.startswith("rule: not worse than smollm2")
    worse = decide(rule, rated("acme-lora@2", 6, 24), rated(BASE, 24, 6))
    assert worse.action == "rollback" and "worse than" in worse.reason
    close = decide(rule, rated("acme-lora@2", 14, 16), rated(BASE, 16, 14))  # -6.7%: neither bound decides
    assert close.action is None and "undecided" in close.reason
    assert decide(canary(min_rated=0), rated("acme-lora@2", 30, 0), rated(BASE, 0, 30)).action is None


def test_a_canary_is_compared_with_the_live_version_of_its_name_else_its_base_model():
    from dataclasses import replace

    c = canary()
    live = replace(c, version=1, state=ModelState.LIVE)
    other_tenant = replace(c, version=3, state=ModelState.LIVE, tenant="globex")
    assert compared_with(c, [c, live, other_tenant]) == "acme-lora@1"
    assert compared_with(c, [c, other_tenant]) == BASE
