"""The embeddings agent's pure parts (streams/embedding_requests.py): runs of texts per model call,
the served model name."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from streams.embedding_requests import DEFAULT_MODEL_NAME, _Request, _runs, served_model_name


def _request(n: int) -> _Request:
    return _Request(message=None, request=SimpleNamespace(inputs=["t"] * n), tokens=[])


def test_runs_keep_order_and_bound_texts_per_call():
    sizes = [3, 4, 2, 10, 1, 1]
    runs = _runs([_request(n) for n in sizes], max_texts=8)
    assert [[len(r.request.inputs) for r in run] for run in runs] == [[3, 4], [2], [10], [1, 1]]
    assert _runs([], 8) == []


def test_served_model_name(tmp_path):
    from streams.embeddings import default_model_path

    assert served_model_name(SimpleNamespace(path=default_model_path())) == DEFAULT_MODEL_NAME
    assert served_model_name(SimpleNamespace(path=tmp_path / "bge-small-en")) == "bge-small-en"
    assert served_model_name(SimpleNamespace(path=None)) == DEFAULT_MODEL_NAME
    assert served_model_name(SimpleNamespace(path=Path("/x/e5"))) == "e5"
