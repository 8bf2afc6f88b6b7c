"""Shared-memory transport: named segments, SPSC rings, watermarks, doorbells.

Imports nothing but the standard library and ``posix_ipc``. Import from the
modules (``ringfence.shm.ring``, ``ringfence.shm.doorbell``, ...); this package
file stays empty so that ``ringfence.shm.errors`` can be imported by layers that
must not load ``posix_ipc``.
"""
