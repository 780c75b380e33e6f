"""What the agents share besides Kafka: memory (Qdrant), the embedder, the token counter.

Qdrant's local-mode client is not meant for concurrent use, so every memory call runs on one
dedicated thread (off the event loop, one at a time). ``state_lock`` serialises the
read-modify-write of conversation state across agents: a ``forget`` can never land between
``record`` reading a conversation and writing it back (which would resurrect it). No network call
is made under it (intake's recall, forget's Qdrant delete and the memory writer run outside it), so
a slow Qdrant holds up no agent's state.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from schemas.codec import AvroCodec, default_codec
from streams.tokens import TokenCounter, load_chat_tokenizer
from transport.spans import Tracer

R = TypeVar("R")


@dataclass
class StreamsServices:
    memory: Any  # streams.memory.ConversationMemory
    embedder: Any  # streams.embeddings.Embedder
    counter: TokenCounter
    codec: AvroCodec = field(default_factory=default_codec)
    tracer: Tracer = field(default_factory=lambda: Tracer("streams"))  # the agents' spans (transport/spans.py)
    _executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="memory"))
    _lock: asyncio.Lock | None = None

    @classmethod
    def open(cls, memory_settings: Any, tokenizer_folder: Path) -> "StreamsServices":
        """Load the embedding model and the chat tokenizer, open memory (creates the collection)."""
        from streams.embeddings import Embedder
        from streams.memory import ConversationMemory

        counter = TokenCounter.for_tokenizer(load_chat_tokenizer(tokenizer_folder))
        embedder = Embedder(memory_settings)
        # retry_calls=False: the agents' Retrier (retry_budget_s) is the one budget around memory calls
        memory = ConversationMemory(memory_settings, embedder.dim, retry_calls=False)
        return cls(memory=memory, embedder=embedder, counter=counter)

    @property
    def state_lock(self) -> asyncio.Lock:
        if self._lock is None:  # created lazily, inside the worker's event loop
            self._lock = asyncio.Lock()
        return self._lock

    async def in_memory_thread(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def in_memory_thread_blocking(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """``fn`` on the memory thread, waited for in the calling thread (the memory writer's)."""
        return self._executor.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.memory.close()
