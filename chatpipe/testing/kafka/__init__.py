"""Kafka helpers that only tests and benches need (the services' adapters are in ``transport/``).

    producer.py   RecordProducer: send records or bytes, flush(), every failure raised
    consumer.py   BatchConsumer: poll, decode, dead-letter (DeadLetterWriter), commit all polled
    batches.py    DecodedMessage, what BatchConsumer hands out (its batches: transport/batches.py)
    answers.py    StreamAssembler (each attempt's full text)
"""

from chatpipe.testing.kafka.answers import StreamAssembler
from chatpipe.testing.kafka.batches import DecodedMessage
from chatpipe.testing.kafka.consumer import BatchConsumer, DeadLetterWriter
from chatpipe.testing.kafka.producer import RecordProducer

__all__ = ["BatchConsumer", "DeadLetterWriter", "DecodedMessage", "RecordProducer", "StreamAssembler"]
