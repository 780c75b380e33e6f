"""How chatpipe runs Faust: every Faust-specific workaround of the streams tier, and nothing else.

The agents' logic (``streams/intake.py``, ``record.py``, ``forget.py``, ``archive.py``,
``embedding_requests.py``) imports nothing from here and nothing of Faust (``streams/ports.py``; a test
keeps it so: tests/streams/test_agent_logic.py ``test_an_agents_logic_imports_no_faust``). To change
what an agent does, read its module; read this package to change how Faust delivers, acks or commits.
faust-streaming 0.15.3 on aiokafka; the private APIs used are named in each module.

Each module, the upstream behaviour it works around, and the test that proves the workaround:

- ``agents.py``: the one adapter (``faust_agent``): batches to ``agent.handle``, the outbox delivered,
  then the batch acked; an exception ends the process unacked. Upstream: ``take_events``/``events()``
  ack in a ``finally`` even when the agent raised, and the supervisor restarts it on the next batch.
  Test: tests/streams/test_agent_logic.py ``test_the_adapter_acks_a_batch_only_after_its_records_are_delivered``,
  ``test_an_agent_that_fails_ends_the_process_unacked``; tests/streams/test_no_ack_on_failure.py.
- ``acks.py``: ``Batches``, acked only by the agent; a repeat acked without handling; both copies in one
  batch handled once; events past a gap withheld, ``DeliveryGapError`` after ``GAP_GRACE_S``. Upstream:
  Faust commits over an unacked event at exactly the committed position (``Consumer._new_offset``
  checks ``min(acked) - committed > 1``); its recovery resumes fetching before the seek back, so events
  come twice or past a gap (faust-streaming#216). Tests: tests/streams/test_failure_policy.py
  ``test_faust_commits_past_an_unacked_event_at_the_committed_position``,
  ``test_events_faust_delivers_again_in_the_same_process_are_acked_not_handled_again``,
  ``test_both_copies_of_an_event_in_one_batch_are_handled_once_and_the_copy_acked_after_it``;
  tests/streams/test_delivery_gaps.py (every test).
- ``take.py``: ``take_while_arriving``, a batch closed when nothing more arrives. Upstream:
  ``noack_take``'s timer fires every ``within`` whatever is buffered (a lone prompt waited 0-50 ms).
  Test: tests/streams/test_adaptive_batching.py ``test_a_lone_event_is_handed_out_at_once_not_after_the_window``.
- ``offsets.py``: the monkeypatch (``install``) of ``AIOKafkaConsumerThread.seek_to_committed``: a
  partition nobody committed is sought to its beginning. Upstream: aiokafka's ``seek_to_committed``
  seeks only ``if offset and offset > 0``, so what Faust dropped before its seek back never came.
  Tests: tests/streams/test_faust_offsets.py ``test_a_partition_nobody_committed_is_read_again_from_its_start``,
  ``test_the_seek_is_patched_into_fausts_consumer_thread_once``.
- ``fetch_wait.py``: the monkeypatch (``install``) of ``AIOKafkaConsumerThread._create_worker_consumer``: the
  consumer fetches with ``StreamsSettings.fetch_max_wait_ms`` (100 ms). Upstream: Faust fixes 1500 ms, and
  a record on a partition the fetch in flight left out waited for it (prompts taken 1.6 s late). Test:
  tests/streams/test_faust_offsets.py ``test_fausts_consumer_fetches_with_the_configured_wait``.
- ``watchdog.py``: ``ProgressWatchdog`` and ``LoopHeartbeat``: records waiting that reach no agent, or
  an event loop that stopped turning, end the process (75). Upstream: after a restart Faust's fetcher
  can stop handing out a partition's records (cause not found; cf. faust-streaming#216). Tests:
  tests/streams/test_watchdog.py ``test_waiting_records_that_reach_no_agent_are_a_stall_after_stall_s``,
  ``test_an_event_loop_that_stops_turning_ends_the_process_with_its_stacks``.
- ``outbox.py``: ``Outbox``, a batch's records all acknowledged by the broker before its ack. Upstream:
  awaiting Faust's ``topic.send`` only hands the record to aiokafka's buffer; its delivery is a future
  that may wait up to the producer's 20-minute request timeout. Tests: tests/streams/test_failure_policy.py
  ``test_a_record_whose_delivery_failed_is_sent_again_before_the_batch_counts_as_durable``,
  ``test_a_broker_away_past_the_budget_leaves_the_batch_undelivered``.
- ``table.py``: ``conversation_table``, keys written to their conversation's partition, keys of lost
  partitions dropped after a recovery. Upstream: Faust writes a key to the current event's partition
  (or the whole key's hash), and its memory store forgets only restored keys on revocation. Tests:
  tests/streams/test_conversation_table.py (every test).

Not here, on purpose: ``streams/recorded.py`` (read-your-writes between record and intake: a property of
the pipeline, needed with any two independent consumers; it only reads Faust's committed position,
through ``offsets.committed_position``) and ``streams/faults.py`` (the tier's failure policy; its hard
exit is also what keeps Faust from committing, ``agents.py``).
"""
