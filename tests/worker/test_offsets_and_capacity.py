"""Pure logic of the worker: commit positions with out-of-order finishes, the intake plan."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from inference.worker.capacity import Capacity, plan_intake
from inference.worker.offsets import OffsetTracker
from schemas.records import Priority

P = ("t", 0)


def uncommitted(tracker: OffsetTracker) -> dict[tuple[str, int], int]:
    """Positions not confirmed committed (in flight or not)."""
    return {p: pos for p, state in tracker._parts.items()
            if (pos := tracker.position(p)) is not None and pos != state.committed}


def test_commit_position_is_the_lowest_unfinished_offset():
    """Guards against committing past a request still running (a crash would lose it)."""
    tracker = OffsetTracker()
    for offset in (5, 6, 7):
        tracker.taken(P, offset)
    tracker.finished(P, 7)
    assert tracker.committable() == {P: 5}  # nothing before 5 is pending: 5 is the next to read
    tracker.finished(P, 5)
    assert tracker.committable() == {P: 6}
    tracker.finished(P, 6)
    assert tracker.committable() == {P: 8}  # all done: one past the last taken
    assert tracker.committable() == {}  # unchanged positions are not committed again


def test_partitions_are_tracked_independently():
    tracker = OffsetTracker()
    tracker.taken(("t", 0), 10)
    tracker.taken(("t", 1), 3)
    tracker.finished(("t", 1), 3)
    assert tracker.committable() == {("t", 0): 10, ("t", 1): 4}


def test_a_revoked_partition_is_forgotten_and_late_finishes_ignored():
    """Guards against committing, after a revoke, offsets of a partition another worker now owns."""
    tracker = OffsetTracker()
    tracker.taken(P, 1)
    tracker.forget([P])
    assert tracker.finished(P, 1) is False
    assert tracker.committable() == {}


@given(st.permutations(list(range(30))), st.integers(0, 30))
def test_never_commits_past_an_unfinished_offset(order, n_done):
    tracker = OffsetTracker()
    for offset in range(30):
        tracker.taken(P, 100 + offset)
    done = set(order[:n_done])
    for offset in order[:n_done]:
        tracker.finished(P, 100 + offset)
    expected = 100 + min(set(range(30)) - done, default=30)
    assert tracker.position(P) == expected


def test_batch_waits_while_an_interactive_request_waits():
    """Guards against interactive requests queueing behind a deep batch backlog."""
    plan = plan_intake(interactive_in_flight=1, interactive_waiting=1, batch_in_flight=2, max_in_flight=8, batch_limit=6)
    assert plan.batch == 0 and plan.interactive == 5


def test_batch_never_takes_the_interactive_reserve():
    plan = plan_intake(interactive_in_flight=0, interactive_waiting=0, batch_in_flight=6, max_in_flight=8, batch_limit=6)
    assert plan.batch == 0 and plan.interactive == 2


def test_full_worker_takes_nothing():
    plan = plan_intake(interactive_in_flight=5, interactive_waiting=0, batch_in_flight=3, max_in_flight=8, batch_limit=6)
    assert plan.interactive == 0 and plan.batch == 0


def test_try_take_is_bounded_by_capacity():
    """Guards against several share members together taking more than max_in_flight."""
    capacity = Capacity(max_in_flight=3, batch_limit=2)
    taken = [capacity.try_take(Priority.BATCH) for _ in range(5)]
    assert taken == [True, True, False, False, False]
    assert capacity.try_take(Priority.INTERACTIVE) is True
    assert capacity.try_take(Priority.INTERACTIVE) is False
    capacity.release(Priority.BATCH, started=True)
    assert capacity.in_flight == 2


def test_a_failed_commit_is_offered_again():
    """Guards against a commit that failed being taken for done: ``committable`` used to mark a
    position committed when it handed it out, so after a failed (async) commit the position was
    never committed unless a later finish moved it; a restart then served those requests again."""
    tracker = OffsetTracker()
    tracker.taken(P, 5)
    tracker.finished(P, 5)
    assert tracker.committable() == {P: 6}
    assert tracker.committable() == {}  # in flight: not sent twice
    tracker.commit_failed(P, 6)
    assert tracker.committable() == {P: 6}  # sent again
    tracker.commit_succeeded(P, 6)
    assert tracker.committable() == {} and uncommitted(tracker) == {}


def test_a_position_is_committed_only_once_the_broker_confirms_it():
    tracker = OffsetTracker()
    for offset in (1, 2):
        tracker.taken(P, offset)
    tracker.finished(P, 1)
    assert tracker.committable() == {P: 2}
    assert uncommitted(tracker) == {P: 2}  # handed out, not confirmed
    tracker.finished(P, 2)
    assert tracker.committable() == {P: 3}  # a newer position goes out while the older is in flight
    tracker.commit_succeeded(P, 2)  # the older confirmation arrives late
    assert uncommitted(tracker) == {P: 3}
    tracker.commit_succeeded(P, 3)
    assert uncommitted(tracker) == {}
    tracker.commit_succeeded(P, 2)  # a late duplicate does not move the mark back
    assert tracker.committable() == {}
