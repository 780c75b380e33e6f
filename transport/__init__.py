"""Thin Kafka adapters on confluent-kafka, the ones the services use.

    acked_writer.py   AckedWriter: idempotent, a future per acknowledged record, bounded delivery
                      timeout, never blocks an event loop (gateway, worker, streams' reply chunks)
    group_reader.py   GroupReader: consumer group, rebalance hooks, pause/resume, explicit offsets
    share_reader.py   ShareGroupReader: KIP-932 share group, per-record acknowledgement
    tail_reader.py    TailReader: every partition from the end, no group (chat.cancels)
    message.py        ConsumedMessage: the view of a consumed message every consumer hands out
    dead_letters.py   the one DeadLetter builder (dead_letter_for) and send_dead_letter
    dedupe.py         the chatpipe-attempt header and AnswerText (a reader's view of retried answers)
    tracing.py        W3C traceparent in Kafka headers
    admin.py          topics: create, describe, apply the catalog (``chatpipe topics``)
    archive.py        the turn archive's file layout and writer
    settings.py       KafkaSettings (CHATPIPE_*)

They add what every chatpipe component needs around the raw client (checked delivery, Avro
records, ``traceparent`` on every hop, dead letters) and nothing else; throughput against a raw
confluent-kafka loop is measured in ``bench/kafka_io.py``. Helpers only tests and benches need
(a synchronous producer, a batch consumer) are in ``chatpipe/testing/kafka/``.
"""
