"""Kafka helpers that only tests and benches need (the services' adapters are in ``transport/``).

    writer.py     RecordWriter: send records or bytes, flush(), every failure raised
    answers.py    StreamAssembler (each attempt's full text)
"""

from chatpipe.testing.kafka.answers import StreamAssembler
from chatpipe.testing.kafka.writer import RecordWriter

__all__ = ["RecordWriter", "StreamAssembler"]
