"""The crash counts' bookkeeping and their commit-metadata format (``inference/worker/crash_counts.py``)."""

from __future__ import annotations

from inference.worker.crash_counts import MAX_ENTRIES, MAX_REASON, Crash, CrashCounts, decode, encode

TP = ("chat.inference.requests", 3)


def test_counts_add_up_and_survive_the_metadata_round_trip():
    counts = CrashCounts()
    counts.load(TP, "")
    counts.add(TP, 17, "RuntimeError: one")
    assert counts.add(TP, 17, "RuntimeError: two") == Crash(2, "RuntimeError: two")
    restarted = CrashCounts()  # the next owner, after the crash
    restarted.load(TP, counts.metadata(TP, position=15))
    assert restarted.get(TP, 17) == Crash(2, "RuntimeError: two")
    assert restarted.get(TP, 18) is None


def test_a_finished_record_leaves_the_metadata():
    counts = CrashCounts()
    counts.load(TP, encode({17: Crash(3, "boom"), 20: Crash(1, "bang")}))
    assert decode(counts.metadata(TP, position=18)) == {20: Crash(1, "bang")}  # 17 dead-lettered: past it
    assert counts.metadata(TP, position=21) == ""  # nothing left: what any other commit stores


def test_only_a_synchronous_save_marks_a_partition_saved():
    counts = CrashCounts()
    counts.add(TP, 5, "boom")
    assert counts.unsaved() == {TP}
    counts.saved(TP)
    assert counts.unsaved() == set()


def test_metadata_stays_small_however_many_records_crashed():
    crashes = {offset: Crash(1, "x" * 5000) for offset in range(100)}
    metadata = encode(crashes)
    assert len(metadata.encode()) < 4096  # the broker's offset.metadata.max.bytes by default
    kept = decode(metadata)
    assert sorted(kept) == list(range(100 - MAX_ENTRIES, 100))  # the newest
    assert all(len(c.reason) == MAX_REASON for c in kept.values())


def test_metadata_that_is_not_ours_reads_as_no_crashes():
    for foreign in ("", None, "some tool's note", '{"crashes": 5}', '{"other": {}}'):
        assert decode(foreign) == {}


def test_a_revoked_partition_is_read_again_from_the_broker():
    counts = CrashCounts()
    counts.load(TP, "")
    counts.add(TP, 1, "boom")
    counts.forget([TP])
    assert not counts.known(TP) and counts.unsaved() == set()
