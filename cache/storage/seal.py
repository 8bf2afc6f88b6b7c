"""The storage secret: the key that seals each stored block, and its public identifier.

A shared tier is not trusted (docs/design.md, "Trust"): anyone who can write to the Redis server
or the directory can store a blob under a real key with a correct CRC-32. With
``cache.storage.secret`` set, every blob carries an HMAC-SHA256 tag under a key derived from
the secret (blob.py's keyed layout), and a reader holding the secret takes no blob whose tag
does not verify. Instances that share a tier share the secret.

Where the secret comes from, all of them taken, and more than one distinct value refused (a
tier has one secret): ``cache.storage.secret`` (a secret setting: the run dir's config.toml
holds it empty and the supervisor hands it to the actors in :data:`SECRET_ENV`), the
variable :data:`SECRET_ENV` itself, and ``cache.storage.secret_file`` (its first line that is
neither blank nor a ``#`` comment), for a secret that must sit in neither a config nor an
environment.

Two keys are derived from the secret, each a keyed BLAKE2b of it under its own label, so
neither tells anything of the other nor of the secret: the MAC key, and :attr:`Seal.id`, a
16-byte identifier that instances publish (``/ringfence/instance``) so the router can check
that they hold the same secret without any of them revealing it.

The identifier also names the blobs' key space in a shared tier (:func:`namespace`): instances
with different secrets never read, and so never delete, each other's blobs. A reader cannot
tell a forgery from a good block sealed by another secret; it must not destroy either, and
with a key space of its own it never meets one. Within its own key space, a blob that does not
verify is a forgery or damage, and is removed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from ringfence.shm.errors import ConfigError

SECRET_ENV: Final = "RINGFENCE_STORAGE_SECRET"
NAMESPACE_PREFIX: Final = "s"  # a sealed key space's name: s<the secret's identifier>
TAG_BYTES: Final = 32  # HMAC-SHA256's digest, whole
_MAC_LABEL: Final = b"ringfence block mac"
_ID_LABEL: Final = b"ringfence storage secret id"


class Seal:
    """The MAC of one storage secret. Immutable; safe to share between threads (each tag
    is computed on a copy of the keyed state)."""

    __slots__ = ("_keyed", "id")

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("a storage secret is not empty")
        mac_key = hashlib.blake2b(_MAC_LABEL, key=_derive(secret), digest_size=32).digest()
        self._keyed = hmac.new(mac_key, digestmod=hashlib.sha256)  # keyed once, copied per tag
        # Published: tells whether two instances hold the same secret, and nothing else.
        self.id: str = hashlib.blake2b(_ID_LABEL, key=_derive(secret), digest_size=16).hexdigest()

    def __repr__(self) -> str:  # never the secret, nor the key
        return f"Seal(id={self.id})"

    def tag(self, payload: bytes | bytearray | memoryview, fields: bytes) -> bytes:
        """The :data:`TAG_BYTES` tag of ``payload`` then ``fields`` (the trailer's bytes)."""
        mac = self._keyed.copy()
        mac.update(payload)  # OpenSSL's, without the GIL for a block's size
        mac.update(fields)
        return mac.digest()

    def verifies(self, payload: bytes | bytearray | memoryview, fields: bytes, tag: bytes) -> bool:
        """Whether ``tag`` is the tag of ``payload`` and ``fields`` (compared in constant time)."""
        return hmac.compare_digest(self.tag(payload, fields), tag)


def namespace(seal: Seal | None) -> str:
    """The key space of the blobs sealed by ``seal`` in a shared tier: ``s<id>`` (the
    secret's public identifier, so nothing of the secret); ``""`` without a secret, the key
    space of plain blobs, laid out as before namespaces existed."""
    return "" if seal is None else f"{NAMESPACE_PREFIX}{seal.id}"


def _derive(secret: bytes) -> bytes:
    """A 64-byte BLAKE2b key from a secret of any length (BLAKE2b takes keys of at most 64)."""
    return hashlib.blake2b(secret, digest_size=64, person=b"rf-storage").digest()


def load_seal(
    inline: str, secret_file: str = "", environ: Mapping[str, str] | None = None
) -> Seal | None:
    """The seal of the storage secret (module docstring), or None where none is set.

    ``inline`` is ``cache.storage.secret`` as the caller holds it (empty in an actor,
    whose copy comes by :data:`SECRET_ENV`). :class:`ConfigError` (a ``ValueError``)
    naming the setting for an unreadable or empty file, or for two different secrets.
    """
    held = (os.environ if environ is None else environ).get(SECRET_ENV, "")
    # The supervisor joins an inline secret to the variable's value with a comma.
    values = [v.strip() for v in f"{inline},{held}".split(",") if v.strip()]
    if secret_file:
        values.append(read_secret_file(secret_file))
    distinct = set(values)
    if len(distinct) > 1:
        raise ConfigError(
            f"cache.storage.secret: {len(distinct)} different secrets are set (the setting, "
            f"{SECRET_ENV}, cache.storage.secret_file); a tier has one",
            key="cache.storage.secret",
        )
    return Seal(distinct.pop().encode()) if distinct else None


def read_secret_file(path: str) -> str:
    """A secret file's first line that is neither blank nor a comment; :class:`ConfigError`
    naming the file (never its content) if it cannot be read or holds none."""
    key = "cache.storage.secret_file"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key} {path}: {getattr(e, 'strerror', None) or e}", key=key) from None
    for line in text.splitlines():
        if line.strip() and not line.strip().startswith("#"):
            return line.strip()
    raise ConfigError(f"{key} {path}: no secret in it", key=key)
