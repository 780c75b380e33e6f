"""Lineage (issue 20): the trace id and request id of each turn reach the dataset rows built from it.

The planted log (``tests/spark/conftest.py``) holds turns of every ConversationTurn version:
v3 turns carry a trace id, v1 and v2 turns (written before trace ids) none. Every dataset row
must name the turns it was built from: SFT and dropped rows their own turn's ``request_id`` and
``trace_id``, SFT and preference rows ``request_ids`` / ``trace_ids`` of every turn they hold,
in turn order (history first), null where the turn had no trace id.
"""

from __future__ import annotations

import pandas as pd
import pytest

from chatpipe.testing.synthetic_log import writer_version
from schemas.records import ConversationTurn

pytestmark = pytest.mark.spark


def _expected_trace(log, t: ConversationTurn) -> str | None:
    """What the job can know of ``t``'s trace: its id when written with v3, else nothing."""
    return t.trace_id if writer_version(t, t.event_id in log.v1_event_ids) >= 3 else None


def _none(value):
    return None if value is None or (isinstance(value, float) and pd.isna(value)) else value


def _table(out, name: str) -> pd.DataFrame:
    return pd.read_parquet(out / "parquet" / name)


def test_sft_rows_carry_the_trace_and_request_ids_of_their_turns(planted_run, planted_log):
    """Catches an SFT row that cannot be led back to the request (and trace) of its answer or of
    the history turns it holds, ids out of turn order, or an older turn given someone's trace id."""
    by_event = {t.event_id: t for t in planted_log.turns}
    by_request = {t.request_id: t for t in planted_log.turns}
    sft = _table(planted_run[1].out, "sft")
    assert len(sft)
    with_trace = without_trace = mixed = 0
    for row in sft.itertuples():
        turn = by_event[row.event_id]
        assert row.request_id == turn.request_id
        assert _none(row.trace_id) == _expected_trace(planted_log, turn)
        request_ids, trace_ids = list(row.request_ids), [_none(t) for t in row.trace_ids]
        assert len(request_ids) == len(trace_ids) == row.history_turns + 1
        assert request_ids[-1] == row.request_id and trace_ids[-1] == _none(row.trace_id)
        turns = [by_request[r] for r in request_ids]
        assert [t.turn_index for t in turns] == list(range(row.turn_index - row.history_turns, row.turn_index + 1))
        assert {t.conversation_id for t in turns} == {row.conversation_id}
        assert trace_ids == [_expected_trace(planted_log, t) for t in turns]
        with_trace += _none(row.trace_id) is not None
        without_trace += _none(row.trace_id) is None
        mixed += len({t is None for t in trace_ids}) == 2
    assert with_trace and without_trace and mixed, (with_trace, without_trace, mixed)


def test_a_trace_leads_forward_to_every_row_it_produced(planted_run, planted_log):
    """From a trace id to the dataset: the turn's own example and every later example of its
    conversation whose history holds it; no row of another conversation."""
    sft = _table(planted_run[1].out, "sft")
    by_event = {t.event_id: t for t in planted_log.turns}
    # an example whose history holds a traced turn
    held = next(r for r in sft.itertuples() if any(_none(t) is not None for t in list(r.trace_ids)[:-1]))
    trace = next(t for t in list(held.trace_ids)[:-1] if _none(t) is not None)
    rows = sft[sft["trace_ids"].map(lambda ids: trace in list(ids))]
    source = next(t for t in planted_log.turns if t.trace_id == trace)
    assert source.event_id in set(rows["event_id"]) and held.event_id in set(rows["event_id"])
    assert set(rows["conversation_id"]) == {source.conversation_id}
    assert all(by_event[e].turn_index >= source.turn_index for e in rows["event_id"])
    assert list(sft[sft["trace_id"] == trace]["event_id"]) == [source.event_id]


def test_preference_rows_name_both_sides(planted_run, planted_log):
    """Catches a pair row that does not say which requests (and traces) its chosen and rejected
    answers came from; an edit's two sides are one turn, listed once."""
    by_event = {t.event_id: t for t in planted_log.turns}
    prefs = _table(planted_run[1].out, "preference")
    assert len(prefs) == len(planted_log.pairs)
    for row in prefs.itertuples():
        chosen = by_event[row.chosen_event_id.removesuffix(":edit")]
        rejected = by_event[row.rejected_event_id]
        assert (row.chosen_request_id, row.rejected_request_id) == (chosen.request_id, rejected.request_id)
        assert _none(row.chosen_trace_id) == _expected_trace(planted_log, chosen)
        assert _none(row.rejected_trace_id) == _expected_trace(planted_log, rejected)
        sides = [chosen] if row.pair_source == "edit" else [chosen, rejected]
        assert list(row.request_ids)[-len(sides):] == [t.request_id for t in sides]
        assert [_none(t) for t in row.trace_ids][-len(sides):] == [_expected_trace(planted_log, t) for t in sides]
        assert len(row.request_ids) == len(row.trace_ids)


def test_dropped_rows_carry_the_trace_id_of_their_turn(planted_run, planted_log):
    """Catches a dropped turn that cannot be led back to its trace; feedback and undecodable
    records have none (null)."""
    by_event = {t.event_id: t for t in planted_log.turns}
    dropped = _table(planted_run[1].out, "dropped")
    turns = dropped[(dropped["record"] == "ConversationTurn") & (dropped["step"] != "decode")]
    assert len(turns)
    for row in turns.itertuples():
        turn = by_event[row.event_id]
        assert row.request_id == turn.request_id and _none(row.trace_id) == _expected_trace(planted_log, turn)
    others = dropped[(dropped["record"] == "Feedback") | (dropped["step"] == "decode")]
    assert len(others) and others["trace_id"].isna().all()
