"""Answers and feedback per model version, and the rollout rule that promotes or rolls back a canary.

``VersionLedger`` joins ``chat.turns`` (each turn names the exact model that answered it) with
``chat.feedback`` (which names the turn's request id) into one ``VersionStats`` per model: turns,
errors, ratings (a turn's latest thumbs up or down counts, once), regenerations, edits, TTFT and
tokens/s. Feedback read before its turn waits for it (topics are read side by side; bounded).

``decide`` is the rule a canary declares when it starts (``ModelVersion.rule_*``): once the canary
and what it is compared with (the LIVE version of its name, else its base model: what the other
conversations get) each have ``rule_min_rated`` rated turns, with ``p`` the thumbs-up rates and
``z`` the one-sided normal quantile of ``rule_confidence``:

* promote when ``p_canary - p_live - z * se > -rule_max_drop`` (not worse by more than the margin,
  at that confidence: a non-inferiority test);
* roll back when ``p_canary - p_live + z * se < 0`` (worse, at that confidence);
* else wait for more ratings.

``se`` is the unpooled standard error of the difference of two proportions (the Wald interval);
with a few dozen ratings per side it is what such rollouts use, and it needs nothing beyond the
standard library (``statistics.NormalDist``). Pure: no I/O (``version_agent.py`` feeds it).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from statistics import NormalDist

from schemas.records import (ConversationTurn, Feedback, FeedbackKind, FinishReason, ModelState, ModelVersion,
                             VersionStats)
from schemas.models import model_key

FAILED_ANSWERS = (FinishReason.ERROR, FinishReason.TIMEOUT, FinishReason.OVERLOADED)
RATINGS = (FeedbackKind.THUMBS_UP, FeedbackKind.THUMBS_DOWN)


@dataclass
class _TurnMark:
    model: str
    rating: FeedbackKind | None = None
    regenerated: bool = False
    edited: bool = False


@dataclass
class VersionLedger:
    since: int  # epoch ms the counts start from
    max_turns: int = 200_000  # turns remembered for the join (oldest forgotten first)
    stats: dict[str, VersionStats] = field(default_factory=dict)
    changed: set[str] = field(default_factory=set)  # models whose stats changed since the last take_changed
    _turns: "collections.OrderedDict[str, _TurnMark]" = field(default_factory=collections.OrderedDict)
    _early: "collections.OrderedDict[str, list[Feedback]]" = field(default_factory=collections.OrderedDict)

    def of(self, model: str) -> VersionStats:
        if model not in self.stats:
            self.stats[model] = VersionStats(model=model, since=self.since)
        return self.stats[model]

    def add_turn(self, turn: ConversationTurn) -> None:
        if turn.request_id in self._turns:
            return  # the same turn read again
        s = self.of(turn.model)
        s.turns += 1
        s.errors += turn.finish_reason in FAILED_ANSWERS
        s.ttft_ms_sum += turn.ttft_ms
        s.tokens_out += turn.tokens_out
        s.decode_ms_sum += max(0.0, turn.total_ms - turn.ttft_ms)
        self._turns[turn.request_id] = _TurnMark(turn.model)
        if len(self._turns) > self.max_turns:
            self._turns.popitem(last=False)
        self.changed.add(turn.model)
        for feedback in self._early.pop(turn.request_id, []):
            self.add_feedback(feedback)

    def add_feedback(self, feedback: Feedback) -> None:
        mark = self._turns.get(feedback.request_id)
        if mark is None:  # its turn is not read yet (or older than the ledger): keep it a while
            self._early.setdefault(feedback.request_id, []).append(feedback)
            if len(self._early) > self.max_turns:
                self._early.popitem(last=False)
            return
        s = self.of(mark.model)
        kind = feedback.kind
        if kind in RATINGS:
            if mark.rating is None:
                s.rated += 1
            elif mark.rating is FeedbackKind.THUMBS_UP:
                s.thumbs_up -= 1
            else:
                s.thumbs_down -= 1
            mark.rating = kind
            if kind is FeedbackKind.THUMBS_UP:
                s.thumbs_up += 1
            else:
                s.thumbs_down += 1
        elif kind is FeedbackKind.REGENERATE and not mark.regenerated:
            mark.regenerated = True
            s.regenerations += 1
        elif kind is FeedbackKind.EDIT and not mark.edited:
            mark.edited = True
            s.edits += 1
        self.changed.add(mark.model)

    def take_changed(self) -> list[VersionStats]:
        changed, self.changed = self.changed, set()
        return [self.stats[m] for m in sorted(changed)]


def thumbs_up_rate(s: VersionStats) -> float:
    return s.thumbs_up / s.rated if s.rated else 0.0


@dataclass(frozen=True)
class Decision:
    action: str | None  # "promote", "rollback", or None: not yet
    reason: str


def compared_with(canary: ModelVersion, versions: list[ModelVersion]) -> str:
    """What a canary's conversations would otherwise get: the LIVE version of its name (for its tenant),
    else its base model."""
    live = [v for v in versions if v.name == canary.name and v.tenant == canary.tenant
            and v.state is ModelState.LIVE]
    return model_key(live[-1].name, live[-1].version) if live else canary.base_model


def decide(canary: ModelVersion, canary_stats: VersionStats, baseline: VersionStats) -> Decision:
    """The rule ``canary`` declared, on the stats so far (module docstring)."""
    ref = model_key(canary.name, canary.version)
    n_c, n_b = canary_stats.rated, baseline.rated
    if canary.rule_min_rated <= 0:
        return Decision(None, f"{ref} has no rollout rule")
    if min(n_c, n_b) < canary.rule_min_rated:
        return Decision(None, f"{ref}: {n_c} and {n_b} rated turns, the rule waits for {canary.rule_min_rated} each")
    p_c, p_b = thumbs_up_rate(canary_stats), thumbs_up_rate(baseline)
    se = math.sqrt(p_c * (1 - p_c) / n_c + p_b * (1 - p_b) / n_b)
    z = NormalDist().inv_cdf(canary.rule_confidence)
    diff = p_c - p_b
    facts = (f"thumbs up {p_c:.1%} of {n_c} vs {p_b:.1%} of {n_b} for {baseline.model} "
             f"(difference {diff:+.1%}, {canary.rule_confidence:.0%} bounds {diff - z * se:+.1%} .. {diff + z * se:+.1%})")
    if diff + z * se < 0:
        return Decision("rollback", f"rule: worse than {baseline.model}: {facts}")
    if diff - z * se > -canary.rule_max_drop:
        return Decision("promote", f"rule: not worse than {baseline.model} by more than "
                                   f"{canary.rule_max_drop:.1%}: {facts}")
    return Decision(None, f"{ref}: undecided: {facts}")
