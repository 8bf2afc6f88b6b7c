"""Test helpers for ``ringfence.cache.storage``: a recording log and raw access to stored blobs.

The raw access bypasses the blob checks, so a test can corrupt, truncate or swap a
stored blob in any backend and see that the backend turns it into a miss.
"""

from __future__ import annotations

import os

from ringfence.cache.ids import BlockHash
from ringfence.cache.storage import StorageBackend
from ringfence.cache.storage.local import LocalBackend
from ringfence.cache.storage.memory import MemoryBackend
from ringfence.cache.storage.redis_backend import RedisBackend


class RecordingLog:
    """A :class:`~ringfence.cache.storage.StorageLog` that keeps every line it is given."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, object]]] = []  # (level, event, fields)
        self.errors: list[tuple[str, dict[str, object]]] = []  # (event, fields) of errors

    def error(self, event: str, **fields: object) -> None:
        self.lines.append(("error", event, fields))
        self.errors.append((event, fields))

    def warning(self, event: str, **fields: object) -> None:
        self.lines.append(("warning", event, fields))

    def info(self, event: str, **fields: object) -> None:
        self.lines.append(("info", event, fields))

    def events(self, event: str) -> list[dict[str, object]]:
        """The fields of every line named ``event``, in order, whatever its level."""
        return [fields for _, name, fields in self.lines if name == event]


def read_blob(backend: StorageBackend, key: BlockHash) -> bytes | None:
    """The stored blob of ``key``, header included, unchecked; None if absent."""
    if isinstance(backend, MemoryBackend):
        return backend.blobs.get(key)
    if isinstance(backend, LocalBackend):
        try:
            with open(backend.path_for(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
    if isinstance(backend, RedisBackend):
        blob = backend.client.get(backend.redis_key(key))
        assert blob is None or isinstance(blob, bytes)
        return blob
    raise TypeError(f"no raw access to a {type(backend).__name__}")


def write_blob(backend: StorageBackend, key: BlockHash, blob: bytes) -> None:
    """Store ``blob`` as it is under ``key``, replacing what is there, unchecked."""
    if isinstance(backend, MemoryBackend):
        backend.replace_blob(key, blob)
    elif isinstance(backend, LocalBackend):
        path = backend.path_for(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(blob)
    elif isinstance(backend, RedisBackend):
        backend.client.set(backend.redis_key(key), blob)
    else:
        raise TypeError(f"no raw access to a {type(backend).__name__}")
