"""Mailboxes: an actor's inboxes and outboxes behind one interface, shared-memory or in-process.

A :class:`Mailbox` holds the inboxes an actor reads, the outboxes it writes, and
one *waiter* it sleeps on until any inbox has something. Two kinds of inbox
exist and may be mixed in one mailbox:

- :class:`RingInbox` / :class:`RingOutbox`: a shared-memory ring from or to another
  process. The waiter is then the actor's :class:`~ringfence.shm.doorbell.Doorbell`.
- :class:`LocalInbox` / :class:`LocalOutbox`: a deque in this process, posted to by
  other threads (tests, or a host process driving an embedded actor). Posting
  rings the mailbox's waiter, so a local post wakes an actor asleep on its
  doorbell exactly like a ring frame does.

Consumption is durable where the inbox is: ``read`` hands out the next message,
``commit`` releases everything read so far, and ``redeliver`` hands the last one read
out again (the driver's answer to a handler blocked by a full ring downstream). The
run loop commits after the handler returned, so a ring frame whose handler was
interrupted by a crash is read again by the restarted actor. Local inboxes hold
nothing across a crash of their process.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol

from ringfence.runtime.codec import Registry
from ringfence.runtime.messages import RESERVED_TAG, RUNTIME
from ringfence.shm.errors import ProtocolError, RingFull
from ringfence.shm.ring import framed_size
from ringfence.shm.ring_reader import Frame, RingReader
from ringfence.shm.ring_writer import RingWriter


class Delivery(NamedTuple):
    """One message handed to the run loop."""

    peer: str  # the sending instance, e.g. "source-0", "supervisor-0", or a local name
    seq: int  # its transport seq on this inbox (1, 2, ...)
    msg: object | None  # the decoded message, or None if it could not be decoded
    error: ProtocolError | None  # why it could not be decoded


class Waiter(Protocol):
    """What a mailbox sleeps on. A Doorbell is one; :class:`ConditionWaiter` is the other."""

    def wait_until(self, ready: Callable[[], bool], timeout: float) -> bool: ...
    def ring(self) -> None: ...


class Inbox(Protocol):
    peer: str

    def pending(self) -> bool: ...
    def read(self) -> Delivery | None: ...
    def peek(self) -> Delivery | None: ...
    def commit(self) -> None: ...
    def redeliver(self, delivery: Delivery) -> None: ...
    def close(self) -> None: ...


class Outbox(Protocol):
    peer: str

    def send(self, msg: object, timeout: float) -> int: ...
    def send_many(self, msgs: Sequence[object], timeout: float) -> list[int]: ...
    def close(self) -> None: ...


def _encode(registry: Registry, msg: object) -> tuple[int, bytes]:
    return (RUNTIME if type(msg) in RUNTIME else registry).encode(msg)


class RingInbox:
    """Frames from a shared-memory ring, decoded with the channel's registry.

    :meth:`peek` reads the next frame ahead, while the last one read is still being
    handled, and holds it: the next :meth:`read` hands it out. :meth:`commit` releases
    only up to the frame :meth:`read` handed out last, so a frame read ahead is never
    released before its handler ran (a crash in between redelivers it).
    """

    def __init__(self, peer: str, reader: RingReader, registry: Registry) -> None:
        self.peer = peer
        self.reader = reader
        self.registry = registry
        self._held: tuple[Delivery, Frame] | None = None  # read ahead by peek
        self._last: Frame | None = None  # the frame of the delivery read() handed out last
        self._refused = False  # read() skipped a refused frame, not yet committed

    def pending(self) -> bool:
        return self._held is not None or self.reader.pending()

    def read(self) -> Delivery | None:
        """The next frame decoded, or None.

        A frame the ring refuses (malformed, or out of sequence) is skipped
        (``RingReader.skip``) and handed out undecoded, with the error: the producer's
        mistake costs the frame, never the reader.
        """
        if self._held is not None:
            (delivery, self._last), self._held = self._held, None
            return delivery
        read, self._last = self._read_frame()
        self._refused = read is not None and self._last is None
        return read

    def peek(self) -> Delivery | None:
        """The delivery the next :meth:`read` hands out, read ahead now (None if no frame is
        published, or the next one is refused: :meth:`read` skips that one as usual; nor
        past a refused frame not yet committed, which has no frame to commit up to)."""
        if self._held is None and not self._refused:
            try:
                frame = self.reader.poll()
            except ProtocolError:
                return None  # the cursor stays put: read() refuses and skips it
            if frame is None:
                return None
            self._held = (self._decoded(frame), frame)
        return None if self._held is None else self._held[0]

    def _read_frame(self) -> tuple[Delivery | None, Frame | None]:
        try:
            frame = self.reader.poll()
        except ProtocolError as e:
            skipped = self.reader.skip()
            error = ProtocolError(f"{e}; skipped {skipped.bytes} bytes")
            return Delivery(self.peer, skipped.seq, None, error), None
        if frame is None:
            return None, None
        return self._decoded(frame), frame

    def _decoded(self, frame: Frame) -> Delivery:
        registry = RUNTIME if frame.kind >> 16 >= RESERVED_TAG else self.registry
        try:
            msg = registry.decode(frame.kind, frame.payload)
        except ProtocolError as e:
            return Delivery(self.peer, frame.seq, None, e)
        return Delivery(self.peer, frame.seq, msg, None)

    def commit(self) -> None:
        """Release every frame up to the one :meth:`read` handed out last (one skipped as
        refused: everything read so far, as nothing is read ahead past a refused one)."""
        if self._held is not None and self._last is not None:
            self.reader.commit(self._last)
        else:
            self.reader.commit()
        self._refused = False

    def redeliver(self, delivery: Delivery) -> None:
        """Read ``delivery`` (the last one read, not committed) again next time."""
        self._held, self._refused = None, False  # read again from the committed tail
        self.reader.rewind()

    def close(self) -> None:
        self.reader.close()


class RingOutbox:
    """Messages encoded onto a shared-memory ring to ``peer``."""

    def __init__(self, peer: str, writer: RingWriter, registry: Registry) -> None:
        self.peer = peer
        self.writer = writer
        self.registry = registry

    def send(self, msg: object, timeout: float) -> int:
        """Encode and publish; returns the transport seq. RingFull/ActorDead at the deadline."""
        kind, payload = self.encode(msg)
        return self.writer.put(kind, payload, timeout)

    def send_many(self, msgs: Sequence[object], timeout: float) -> list[int]:
        """Encode and publish ``msgs`` in order, as few ``put_many`` batches as the ring's
        batch limit allows (one doorbell ring each); their transport seqs.

        A batch that finds no room by the deadline raises RingFull with ``sent``, the
        messages published before it; the rest are not. ActorDead as :meth:`send`.
        """
        return self.put_many([self.encode(msg) for msg in msgs], timeout)

    def put_many(self, frames: Sequence[tuple[int, bytes]], timeout: float) -> list[int]:
        """Publish frames already encoded for this ring (see :meth:`send_many`)."""
        limit, first = self.writer.max_batch, self.writer.next_seq
        start, framed = 0, 0
        for i, (_, payload) in enumerate(frames):
            size = framed_size(len(payload))
            if framed + size > limit and i > start:
                self._put_batch(frames, start, i, timeout)
                start, framed = i, 0
            framed += size
        if start < len(frames):
            self._put_batch(frames, start, len(frames), timeout)
        return list(range(first, first + len(frames)))

    def _put_batch(
        self, frames: Sequence[tuple[int, bytes]], start: int, stop: int, timeout: float
    ) -> None:
        try:
            self.writer.put_many(frames[start:stop], timeout)
        except RingFull as e:
            raise RingFull(str(e), sent=start) from None

    def encode(self, msg: object) -> tuple[int, bytes]:
        """The frame kind and payload of ``msg`` on this ring."""
        return _encode(self.registry, msg)

    def put(self, kind: int, payload: bytes, timeout: float) -> int:
        """Publish a frame already encoded for this ring's registry (see :meth:`encode`)."""
        return self.writer.put(kind, payload, timeout)

    def close(self) -> None:
        self.writer.close()


class ConditionWaiter:
    """A waiter for mailboxes with only local inboxes: a condition variable, no shared memory."""

    def __init__(self) -> None:
        self._cond = threading.Condition()

    def wait_until(self, ready: Callable[[], bool], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(ready, timeout)

    def ring(self) -> None:
        with self._cond:
            self._cond.notify_all()


class PollWaiter:
    """``runtime.wait = poll``: the legacy design's pollers, kept as a baseline to measure.
    Every wait looks, sleeps ``period_s``, and looks again until ready or its deadline;
    rings pass to ``inner`` (a local post still wakes a waiter blocked there, never this
    one)."""

    def __init__(self, inner: Waiter, period_s: float = 0.001) -> None:
        self.inner = inner
        self.period_s = period_s

    def wait_until(self, ready: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(self.period_s, left))  # the baseline's poll: measured, not used
        return True

    def ring(self) -> None:
        self.inner.ring()


class LocalInbox:
    """An unbounded in-process inbox. ``post`` may be called from any thread.

    Messages are not encoded, but each must be a class of the inbox's registry (or
    a runtime message), so a test on local inboxes catches what the codec would.
    """

    def __init__(self, peer: str, registry: Registry, waiter: Waiter) -> None:
        self.peer = peer
        self.registry = registry
        self._waiter = waiter
        self._queue: collections.deque[tuple[int, object]] = collections.deque()
        self._seqs = itertools.count(1)
        self._lock = threading.Lock()  # orders seq assignment with appends across posters

    def post(self, msg: object) -> int:
        """Append ``msg`` and wake the mailbox; returns its seq. ProtocolError if unregistered."""
        if type(msg) not in self.registry and type(msg) not in RUNTIME:
            raise ProtocolError(f"{self.registry.name}: {type(msg).__name__} is not a message here")
        with self._lock:
            seq = next(self._seqs)
            self._queue.append((seq, msg))
        self._waiter.ring()
        return seq

    def pending(self) -> bool:
        return bool(self._queue)

    def read(self) -> Delivery | None:
        try:
            seq, msg = self._queue.popleft()
        except IndexError:
            return None
        return Delivery(self.peer, seq, msg, None)

    def peek(self) -> Delivery | None:
        """The delivery the next :meth:`read` hands out, or None; it stays queued."""
        try:
            seq, msg = self._queue[0]
        except IndexError:
            return None
        return Delivery(self.peer, seq, msg, None)

    def commit(self) -> None:
        """Nothing to release: a local message is gone once read."""

    def redeliver(self, delivery: Delivery) -> None:
        """Put ``delivery`` back at the head of the queue."""
        self._queue.appendleft((delivery.seq, delivery.msg))

    def close(self) -> None:
        self._queue.clear()


class LocalOutbox:
    """Sends into a :class:`LocalInbox` (of another in-process actor, or one a host reads)."""

    def __init__(self, peer: str, target: LocalInbox) -> None:
        self.peer = peer
        self.target = target

    def send(self, msg: object, timeout: float) -> int:
        return self.target.post(msg)

    def send_many(self, msgs: Sequence[object], timeout: float) -> list[int]:
        return [self.target.post(msg) for msg in msgs]

    def close(self) -> None:
        """Nothing to release."""


class Mailbox:
    """The inboxes an actor reads, the outboxes it writes (by peer), and its waiter.

    Owned by the thread that runs the actor; only ``wake`` and local posts may come
    from other threads. ``close`` closes every endpoint and then every extra
    resource handed in (attached rings and doorbells), in reverse order.
    """

    def __init__(
        self,
        waiter: Waiter,
        inboxes: Iterable[Inbox] = (),
        outboxes: Iterable[Outbox] = (),
        resources: Iterable[object] = (),
    ) -> None:
        self.waiter = waiter
        self.inboxes: list[Inbox] = list(inboxes)
        self.outboxes: dict[str, Outbox] = {o.peer: o for o in outboxes}
        self._resources = list(resources)
        self._woken = False
        self._closed = False

    def add_local_inbox(self, peer: str, registry: Registry) -> LocalInbox:
        """A new in-process inbox from ``peer`` that wakes this mailbox."""
        inbox = LocalInbox(peer, registry, self.waiter)
        self.inboxes.append(inbox)
        return inbox

    def _ready(self) -> bool:
        return self._woken or any(inbox.pending() for inbox in self.inboxes)

    def wait(self, timeout: float) -> bool:
        """Sleep until an inbox has something or :meth:`wake` is called; False at the deadline."""
        ready = self.waiter.wait_until(self._ready, timeout)
        self._woken = False
        return ready

    def wake(self) -> None:
        """Make the current or next :meth:`wait` return (any thread). Does nothing once the
        mailbox is closed: its waiter may be closed too."""
        if self._closed:
            return
        self._woken = True
        self.waiter.ring()

    def ring(self) -> None:
        """:meth:`wake`: a mailbox is the waker of its actor (``Actor.own_bell``), which a
        ``wait_until`` in progress answers by looking at its condition again."""
        self.wake()

    def close(self) -> None:
        """Close every endpoint and resource. Idempotent."""
        self._closed = True
        endpoints: list[Inbox | Outbox] = [*self.inboxes, *self.outboxes.values()]
        self.inboxes, self.outboxes = [], {}
        for endpoint in endpoints:
            endpoint.close()
        resources, self._resources = self._resources, []
        for resource in reversed(resources):
            close = getattr(resource, "close", None)
            if close is not None:
                close()
