"""Kafka helpers that only tests and benches need (the services' adapters are in ``transport/``).

    producer.py   RecordProducer: send records or bytes, flush(), every failure raised
    consumer.py   BatchConsumer: poll, decode, dead-letter (DeadLetterWriter), commit all polled
    batches.py    how BatchConsumer builds batches without a GC per poll (pause_gc, wrap_batch)
    answers.py    FirstSeen (first Response wins), StreamAssembler (each attempt's full text)
"""

from chatpipe.testing.kafka.answers import FirstSeen, StreamAssembler
from chatpipe.testing.kafka.batches import DecodedMessage, pause_gc, resume_gc, wrap_batch
from chatpipe.testing.kafka.consumer import BatchConsumer, DeadLetterWriter
from chatpipe.testing.kafka.producer import RecordProducer

__all__ = ["BatchConsumer", "DeadLetterWriter", "DecodedMessage", "FirstSeen", "RecordProducer", "StreamAssembler",
           "pause_gc", "resume_gc", "wrap_batch"]
