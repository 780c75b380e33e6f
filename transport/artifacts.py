"""The artifact store of model versions, from the reading side and the hash both sides agree on.

A version's files live under a folder or any fsspec URI (``schemas/models.py``: the layout; training
writes them, ``training/publish.py``). ``sha256_files`` is the one hash of ``ModelVersion.adapter_sha256``
(computed by training, checked by the inference worker); ``fetch_files`` copies named files of a
store folder to a local one, whole or not at all (a temporary folder renamed into place), so a reader
never sees half a copy.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from schemas.errors import ChatpipeError


class ArtifactError(ChatpipeError):
    """An artifact that cannot be read from its store, or is not what its record says."""


def sha256_files(paths: list[Path]) -> str:
    """SHA-256 over the files' bytes, in the given order."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def fetch_files(uri: str, names: list[str], dest: Path) -> Path:
    """Copy ``uri/<name>`` for each name into the folder ``dest`` (made, or replaced whole); returns it.
    ``ArtifactError`` for a file the store does not have; the store's other errors (unreachable, refused)
    are raised as they are: they say nothing of the artifact."""
    import fsspec

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        fs, root = fsspec.core.url_to_fs(uri)
        for name in names:
            try:
                fs.get_file(f"{root.rstrip('/')}/{name}", str(staging / name))
            except FileNotFoundError as exc:  # the artifact's fault; any other OSError (store away) is not
                raise ArtifactError(f"{uri}/{name} is not in the store: {exc}") from exc
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest
