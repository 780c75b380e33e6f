"""Thin Kafka adapters on confluent-kafka: producer, batch consumer, dead letters, trace headers,
and the admin calls behind ``chatpipe topics``.

They add what every chatpipe component needs around the raw client (idempotent producing with
checked delivery, Avro records, W3C ``traceparent`` on every hop, dead-lettering) and nothing
else; throughput against a raw confluent-kafka loop is measured in ``bench/kafka_io.py``.
"""
