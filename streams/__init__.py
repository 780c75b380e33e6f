"""The streams tier: a Faust worker (``chatpipe streams``) between the prompt and the model.

The agents, each a plain class whose ``handle(messages, outbox)`` decides what a batch becomes
(``ports.py``; no Faust in them, unit tested with plain records):

- ``intake.py``: ``chat.prompts`` -> batches (count, tokens, time) -> refuse (``refusals.py``), embed,
  recall, assemble context (``prompts.py``, ``context.py``, ``batching.py``, ``tokens.py``)
  -> ``chat.inference.requests[.batch]``; waits for record on a follow-up (``recorded.py``).
- ``record.py``: ``chat.responses`` -> conversation state (``state.py``, ``table.py``) -> ``chat.turns``
  and the turn's embedding in Qdrant.
- ``forget.py``: ``chat.deletions`` -> fan-out -> Qdrant points, table state and archive files removed
  -> ``chat.deletions.audit`` (``erasures.py``: the registry of erased users).
- ``archive.py``: ``chat.turns`` + ``chat.feedback`` -> the Avro archive that ``spark_jobs`` reads
  (``archive_erasure.py``: rewriting it without an erased user).
- ``embedding_requests.py``: ``chat.embeddings.requests`` -> vectors to each asker's reply address.

Memory: ``memory.py`` (Qdrant), ``memory_local.py``, ``memory_settings.py``, ``embeddings.py`` (the
model). Shared: ``services.py``, ``settings.py``, ``errors.py``, ``faults.py`` (what is retried, how
the process exits unacked), ``dead_letters.py``, ``metrics.py``. Faust: ``app.py`` wires the agents
into a Faust app; ``faust_runtime/`` holds every workaround of how Faust delivers, acks and commits
(its ``__init__`` lists each with the upstream behaviour and its test). Design notes: docs/streams.md.
"""
