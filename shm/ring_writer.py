"""The producer end of a ring (layout and protocol: :mod:`ringfence.shm.ring`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from ringfence.shm.barrier import full_barrier
from ringfence.shm.doorbell import Doorbell
from ringfence.shm.errors import ActorDead, ProtocolError, RingFull
from ringfence.shm.ring import (
    _CONS_PID,
    _HEAD,
    _HEADER,
    _PROD_PID,
    _ROOM_WANTED,
    _TAIL,
    _TAIL_SEQ,
    WRAP,
    Ring,
    _claim,
    _pack_frame,
    _pack_length,
    _peer,
    _release,
    _unpack_frame,
    _unpack_length,
    framed_size,
)


class RingWriter:
    """The producer endpoint.

    ``wake`` is the consumer's doorbell (rung after each publish); ``space`` is this
    producer's own doorbell, which the consumer rings after it frees room, and on
    which :meth:`put` sleeps while the ring is full.
    """

    def __init__(self, ring: Ring, *, wake: Doorbell, space: Doorbell) -> None:
        self.ring = ring
        self.wake = wake
        self.space = space
        words = ring.words
        self._words = words
        self._data = ring.data
        self._cap = ring.capacity
        self._max = ring.max_payload
        self._head = int(words[_HEAD])
        self._limit = int(words[_TAIL]) + self._cap  # see put()
        # Framed bytes of one put_many: those of the largest frame (half the capacity), so
        # any one frame is a batch, and a batch with one wrap marker fits an empty ring.
        self.max_batch = framed_size(self._max)
        self._next_seq = self._last_published_seq() + 1
        self.full_waits = 0  # how often put() found the ring full and had to wait for room
        _claim(words, _PROD_PID, f"producer end of ring {ring.name}")

    def _last_published_seq(self) -> int:
        """The seq of the newest published frame: scan what the consumer has not committed."""
        words = self._words
        pos = int(words[_TAIL])
        last = int(words[_TAIL_SEQ])
        while pos < self._head:
            off = pos % self._cap
            if self._cap - off < _HEADER or _unpack_length(self._data, off)[0] == WRAP:
                pos += self._cap - off
                continue
            length, _kind, seq = _unpack_frame(self._data, off)
            if length > self._max:
                raise ProtocolError(f"ring {self.ring.name}: corrupt frame at position {pos}")
            last = seq
            pos += _HEADER + ((length + 7) & ~7)
        return last

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def _refuse(self, n: int, kind: int) -> NoReturn:
        if n > self._max:
            raise ValueError(
                f"ring {self.ring.name}: a {n}-byte message exceeds its {self._max}-byte limit"
            )
        raise ValueError(f"ring {self.ring.name}: frame kind {kind} outside u32")

    def free_bytes(self) -> int:
        return self._cap - (self._head - int(self._words[_TAIL]))

    def close(self) -> None:
        """Give up the producer end so another process may open it. The ring stays."""
        _release(self._words, _PROD_PID)

    def _wait_for_room(self, need: int, timeout: float) -> bool:
        self.full_waits += 1
        words = self._words
        words[_ROOM_WANTED] = 1
        full_barrier()
        try:
            return self.space.wait_until(lambda: self.free_bytes() >= need, timeout)
        finally:
            words[_ROOM_WANTED] = 0

    def put(self, kind: int, payload: bytes | bytearray | memoryview, timeout: float) -> int:
        """Publish one frame; returns its seq. Waits up to ``timeout`` seconds for room.

        Raises ``ValueError`` if the payload can never fit, :class:`RingFull` if the
        deadline passes (nothing was written), :class:`ActorDead` if by then the
        consumer's process is gone.
        """
        n = len(payload)
        if n > self._max or not 0 <= kind < WRAP:
            self._refuse(n, kind)
        # The hot path is inlined: at 64 B, Python call overhead is most of a put's cost.
        # ``_limit`` is the committed tail plus the capacity as last read: the shared tail
        # is read again only when a frame would pass it.
        cap, head = self._cap, self._head
        size = _HEADER + ((n + 7) & ~7)
        off = head % cap
        rem = cap - off
        end = head + size if size <= rem else head + rem + size
        if end > self._limit:
            self._room(end, timeout)
        data = self._data
        if size > rem:
            _pack_length(data, off, WRAP)
            off = 0
        seq = self._next_seq
        data[off + _HEADER : off + _HEADER + n] = payload
        _pack_frame(data, off, n, kind, seq)
        self._head = end
        self._next_seq = seq + 1
        self._words[_HEAD] = end  # publish: the frame's stores precede this one
        self.wake.ring()
        return seq

    def put_many(
        self, frames: Sequence[tuple[int, bytes | bytearray | memoryview]], timeout: float
    ) -> int:
        """Publish ``(kind, payload)`` frames in order, with one head store and one doorbell
        ring for all of them; returns the seq of the last (that of the next put, less one,
        when ``frames`` is empty).

        All or nothing: waits up to ``timeout`` seconds for room for the whole batch, and
        raises :class:`RingFull` (nothing written) or :class:`ActorDead` as :meth:`put`
        does. A batch of more than ``max_batch`` framed bytes (the largest frame's: about
        half the capacity, so that it always fits an empty ring) is a ``ValueError`` up
        front: split it.
        """
        if not frames:
            return self._next_seq - 1
        cap, head, limit = self._cap, self._head, self._max
        total = 0
        for kind, payload in frames:
            n = len(payload)
            if n > limit or not 0 <= kind < WRAP:
                self._refuse(n, kind)
            total += _HEADER + ((n + 7) & ~7)
        if total > self.max_batch:
            raise ValueError(
                f"ring {self.ring.name}: a batch of {len(frames)} frames ({total} bytes framed) "
                f"exceeds its {self.max_batch}-byte batch limit; split it"
            )
        # Where the batch ends, counting a wrap marker if a frame would cross the end.
        end, wraps = head, False
        for _kind, payload in frames:
            size = _HEADER + ((len(payload) + 7) & ~7)
            rem = cap - end % cap
            if size > rem:
                end += rem
                wraps = True
            end += size
        if end > self._limit:
            self._room(end, timeout)
        data, seq, pos = self._data, self._next_seq, head
        for kind, payload in frames:
            n = len(payload)
            size = _HEADER + ((n + 7) & ~7)
            off = pos % cap
            if wraps and size > cap - off:
                _pack_length(data, off, WRAP)
                pos += cap - off
                off = 0
            data[off + _HEADER : off + _HEADER + n] = payload
            _pack_frame(data, off, n, kind, seq)
            pos += size
            seq += 1
        self._head = end
        self._next_seq = seq
        self._words[_HEAD] = end  # one publish for the batch: every frame's stores precede it
        self.wake.ring()
        return seq - 1

    def _room(self, end: int, timeout: float) -> None:
        """Make sure the ring has room up to position ``end``: read the tail again, then wait
        for the consumer to commit; RingFull or ActorDead at the deadline."""
        cap = self._cap
        self._limit = int(self._words[_TAIL]) + cap
        if end <= self._limit:
            return
        need = end - self._head
        if self._wait_for_room(need, timeout):
            self._limit = int(self._words[_TAIL]) + cap
            return
        consumer = _peer(self._words, _CONS_PID)
        if consumer is not None and not consumer.is_alive():
            raise ActorDead(f"ring {self.ring.name}: consumer pid {consumer.pid} is gone")
        raise RingFull(f"ring {self.ring.name}: no room for {need} bytes within {timeout}s")
