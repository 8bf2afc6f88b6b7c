"""The error hierarchy of ringfence.

Every error the project raises derives from :class:`RingfenceError` and also from
the builtin a caller would naturally catch, so ``except queue.Full`` or
``except ValueError`` keep working. This module imports nothing but the standard
library; every ringfence package may import it.
"""

from __future__ import annotations

import queue


class RingfenceError(Exception):
    """Base of every ringfence error."""


class ProtocolError(RingfenceError, ValueError):
    """A frame or message broke the wire protocol (bad framing, sequence gap, bad field).

    ``tag`` and ``field`` name what was wrong when known, so a handler can answer
    the sender precisely.
    """

    def __init__(self, message: str, *, tag: int | None = None, field: str | None = None):
        super().__init__(message)
        self.tag = tag
        self.field = field


class RingFull(RingfenceError, queue.Full):
    """A ring had no room for a frame before the deadline.

    ``sent``: of several messages sent together (``send_many``), how many were published
    before the batch that found no room; the rest were not.
    """

    def __init__(self, message: str, *, sent: int = 0):
        super().__init__(message)
        self.sent = sent


class RingEmpty(RingfenceError, queue.Empty):
    """A ring had no frame before the deadline."""


class ActorDead(RingfenceError, ConnectionError):
    """The process on the other side of a ring or watermark is gone."""


class EndpointTaken(RingfenceError, RuntimeError):
    """A single-owner endpoint (a ring's producer or consumer end) is held by a live process."""


class WaitTimeout(RingfenceError, TimeoutError):
    """A watermark did not reach its target before the deadline."""


class NameExists(RingfenceError, FileExistsError):
    """A shared-memory name that was to be created already exists."""


class NameMissing(RingfenceError, FileNotFoundError):
    """A shared-memory name that was to be attached does not exist."""


class SegmentLayoutError(RingfenceError, ValueError):
    """An attached segment does not hold the layout its opener expected."""


class ConfigError(RingfenceError, ValueError):
    """A configuration key is unknown, mistyped or out of range. ``key`` is its dotted name."""

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message)
        self.key = key


class OutOfBlocks(RingfenceError, MemoryError):
    """A block pool cannot supply the blocks asked for; nothing was allocated."""
