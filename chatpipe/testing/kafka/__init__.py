"""Kafka helpers that only tests and benches need (the services' adapters are in ``transport/``).

    producer.py   RecordProducer: send records or bytes, flush(), every failure raised
    answers.py    StreamAssembler (each attempt's full text)
"""

from chatpipe.testing.kafka.answers import StreamAssembler
from chatpipe.testing.kafka.producer import RecordProducer

__all__ = ["RecordProducer", "StreamAssembler"]
