"""The contracts: Avro schemas, typed records, the single-object codec and the topic catalog.

Depends on nothing else of chatpipe's and does no network I/O.
"""

from schemas.codec import AvroCodec, default_codec
from schemas.errors import ChatpipeError, DecodeError, EncodeError, SchemaError, UnknownSchemaError
from schemas.records import *  # the record types are this package's API
from schemas.records import RECORD_TYPES
from schemas.topics import CATALOG, TopicSpec

__all__ = [
    "AvroCodec", "default_codec", "ChatpipeError", "DecodeError", "EncodeError", "SchemaError",
    "UnknownSchemaError", "RECORD_TYPES", "CATALOG", "TopicSpec",
    *RECORD_TYPES, "ChatMessage", "SamplingParams", "Header", "Priority", "FinishReason",
    "FeedbackKind", "DeletionScope", "WorkerState", "ModelState", "BatchStatus", "BatchError", "new_id", "now_ms",
]
