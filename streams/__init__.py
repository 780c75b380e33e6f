"""The streams tier: a Faust worker (``chatpipe streams``) between the prompt and the model.

- ``intake``: ``chat.prompts`` -> batches (count, tokens, time) -> embed, recall, assemble context
  -> ``chat.inference.requests[.batch]``.
- ``record``: ``chat.responses`` -> conversation state (a changelog-backed table) -> ``chat.turns``
  and the turn's embedding in Qdrant.
- ``forget``: ``chat.deletions`` -> Qdrant points and table state removed -> ``chat.deletions.audit``.
- ``archive``: ``chat.turns`` + ``chat.feedback`` -> the Avro archive that ``spark_jobs`` reads.

Pure logic (context assembly, batching bounds, conversation state) has no I/O and is unit
tested on its own; ``app.py`` wires it into Faust. The failure policy: ``faults.py`` (what is
retried, how the process exits unacked), ``acks.py`` (batches acked by the agents),
``outbox.py`` (a batch's records durable before its ack), ``refusals.py`` and
``reply_address.py`` (prompts refused where they enter). Design notes: docs/streams.md.
"""
