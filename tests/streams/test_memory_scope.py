"""Recall limited to one conversation (``RecallQuery.conversation_id``: a request whose user is not
identified, MemoryScope CONVERSATION), against real Qdrant in local and server mode."""

from __future__ import annotations

import pytest

from streams.memory import MemoryInputError, RecallQuery
from tests.streams.test_memory import DAY, QUESTION, T0, conversation, ids, memory, recall, vectors_of  # noqa: F401 - memory, vectors_of: fixtures the tests take as parameters


def test_a_conversation_scoped_recall_sees_only_its_own_conversation(memory, embedder, vectors_of):  # noqa: F811 - the fixtures imported above
    """Guards against the issue-19 mix: one key's default user serves many people, each in their own
    conversation; the fact told in c1 must not reach a prompt of c2 (or of a new conversation)."""
    mem = memory(min_score=-1.0)  # every turn is a candidate: only the filters decide what comes back
    told = conversation("acme", "key-1", "c1", n=10)  # c1 states the fact
    other = conversation("acme", "key-1", "c2", n=10, with_fact=False)
    mem.upsert(told + other, vectors_of(told + other))
    question = embedder.encode([QUESTION])[0]
    whole_user, in_c2, in_new, in_c1 = mem.recall_many([
        RecallQuery("acme", "key-1", question, now_ms=T0 + DAY),
        RecallQuery("acme", "key-1", question, limit=10, now_ms=T0 + DAY, conversation_id="c2"),
        RecallQuery("acme", "key-1", question, now_ms=T0 + DAY, conversation_id="new-conv"),
        RecallQuery("acme", "key-1", question, now_ms=T0 + DAY, conversation_id="c1"),
    ])
    # USER scope finds the fact: the scope, not a weak match, hides it below
    assert "Matilda" in whole_user[0].turn.prompt
    assert in_c2 and {r.turn.conversation_id for r in in_c2} == {"c2"}, ids(in_c2)
    assert not [r for r in in_c2 if "Matilda" in r.turn.prompt]
    assert in_new == []
    assert "Matilda" in in_c1[0].turn.prompt and {r.turn.conversation_id for r in in_c1} == {"c1"}
    # the one-query form takes the conversation too
    single = recall(mem, tenant="acme", user_id="key-1", vector=question, limit=10, now_ms=T0 + DAY,
                        conversation_id="c2")
    assert ids(single) == ids(in_c2)
    # another tenant's conversation of the same id and user name stays out as well
    assert recall(mem, tenant="globex", user_id="key-1", vector=question, conversation_id="c1") == []
    with pytest.raises(MemoryInputError, match="conversation_id is empty"):
        recall(mem, tenant="acme", user_id="key-1", vector=question, conversation_id="")
