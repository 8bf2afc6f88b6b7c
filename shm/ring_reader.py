"""The consumer end of a ring and the frames it hands out (layout and protocol:
:mod:`ringfence.shm.ring`)."""

from __future__ import annotations

from typing import NamedTuple, NoReturn

from ringfence.shm.barrier import TSO, full_barrier
from ringfence.shm.doorbell import Doorbell
from ringfence.shm.errors import ActorDead, ProtocolError, RingEmpty
from ringfence.shm.ring import (
    _CONS_PID,
    _HEAD,
    _HEADER,
    _PROD_PID,
    _ROOM_WANTED,
    _TAIL,
    _TAIL_SEQ,
    HEADER_BYTES,
    WRAP,
    Ring,
    _claim,
    _peer,
    _release,
    _unpack_frame,
    _unpack_length,
)

_new_frame = tuple.__new__  # builds a Frame without NamedTuple's Python-level __new__


class Frame(NamedTuple):
    """One received frame. ``end`` is the ring position just past it (what commit stores)."""

    kind: int
    seq: int
    payload: bytes
    end: int


class Batch(NamedTuple):
    """Frames read together (:meth:`RingReader.take`): frame ``i`` has kind ``kinds[i]``,
    payload ``payloads[i]``, seq ``first_seq + i`` and ends at ``ends[i]``.

    Columns rather than a :class:`Frame` each: a tuple per frame is most of the cost of
    reading a small frame. ``end`` and ``seq`` are the last frame's, so that ``commit(batch)``
    releases the whole batch; a batch is never empty.
    """

    kinds: list[int]
    payloads: list[bytes]
    ends: list[int]
    first_seq: int

    @property
    def end(self) -> int:
        return self.ends[-1]

    @property
    def seq(self) -> int:
        return self.first_seq + len(self.ends) - 1

    def frames(self) -> list[Frame]:
        """The batch as one :class:`Frame` per frame."""
        seqs = range(self.first_seq, self.first_seq + len(self.ends))
        return list(map(Frame, self.kinds, seqs, self.payloads, self.ends))


class Skipped(NamedTuple):
    """What :meth:`RingReader.skip` moved past."""

    seq: int  # the skipped frame's seq; 0 when it was malformed (its seq cannot be trusted)
    bytes: int  # bytes of the ring skipped


class RingReader:
    """The consumer endpoint.

    ``bell`` is this consumer's own doorbell (it sleeps there while the ring is
    empty); ``space`` is the producer's doorbell, rung after a commit when the
    producer is waiting for room.
    """

    def __init__(self, ring: Ring, *, bell: Doorbell, space: Doorbell) -> None:
        self.ring = ring
        self.bell = bell
        self.space = space
        self._words = ring.words
        self._data = ring.data
        self._cap = ring.capacity
        self._max = ring.max_payload
        self._mapping = ring.segment.mapping  # payloads are sliced from it: one copy each
        _claim(self._words, _CONS_PID, f"consumer end of ring {ring.name}")
        self.rewind()

    def rewind(self) -> None:
        """Move the read cursor back to the committed tail: uncommitted frames come again."""
        words = self._words
        self._pos = int(words[_TAIL])
        committed = int(words[_TAIL_SEQ])
        self._expected = committed + 1
        # A commit after skipping a malformed frame leaves no seq to go on from.
        self._resync = committed == 0 and self._pos > 0
        # After a crash between commit's two stores, the frame at the tail carries
        # tail_seq itself: that frame is redone.
        if committed and words[_HEAD] > self._pos:
            off = self._pos % self._cap
            if self._cap - off < _HEADER or _unpack_length(self._data, off)[0] == WRAP:
                off = 0
            if _unpack_frame(self._data, off)[2] == committed:
                self._expected = committed

    def close(self) -> None:
        """Give up the consumer end so another process may open it. The ring stays."""
        _release(self._words, _CONS_PID)

    def pending(self) -> bool:
        """True if a frame is published beyond the read cursor."""
        return self._words[_HEAD] > self._pos

    def recv(self, timeout: float) -> Frame:
        """The next frame after the read cursor, without committing it.

        Waits up to ``timeout`` seconds. Raises :class:`RingEmpty` at the deadline,
        :class:`ActorDead` if by then the producer is gone, :class:`ProtocolError`
        on a malformed frame or a sequence gap or duplicate (the cursor stays put).
        """
        head = self._words[_HEAD]
        if head > self._pos:
            return self._read_one(head)
        if not self.bell.wait_until(self.pending, timeout):
            producer = _peer(self._words, _PROD_PID)
            if producer is not None and not producer.is_alive():
                raise ActorDead(f"ring {self.ring.name}: producer pid {producer.pid} is gone")
            raise RingEmpty(f"ring {self.ring.name}: no frame within {timeout}s")
        return self._read_one(self._words[_HEAD])

    def poll(self) -> Frame | None:
        """The next frame after the read cursor if one is published, else None; never waits."""
        head = self._words[_HEAD]
        return self._read_one(head) if head > self._pos else None

    def _read_one(self, head: int) -> Frame:
        """The frame at the read cursor (``head`` loaded, past the cursor); moves past it."""
        pos, cap = self._pos, self._cap
        off = pos % cap
        if cap - off >= _HEADER:  # the common frame inline; anything else the careful way
            length, kind, seq = _unpack_frame(self._data, off)
            end = pos + _HEADER + ((length + 7) & ~7)
            ok = length <= self._max and seq == self._expected
            if ok and end <= head and end - pos <= cap - off:
                start = HEADER_BYTES + _HEADER + off
                self._pos, self._expected, self._resync = end, seq + 1, False
                return _new_frame(Frame, (kind, seq, self._mapping[start : start + length], end))
        return self._read_careful(head)

    def take(self, max_frames: int = 1 << 30) -> Batch | None:
        """The frames published now after the read cursor (up to ``max_frames``), without
        committing them; None if there are none. Never waits.

        A refused frame (see :meth:`recv`) raises :class:`ProtocolError` only when it is
        the first: the frames before it are returned, and the next call raises.
        """
        head, pos = int(self._words[_HEAD]), self._pos
        if pos >= head or max_frames <= 0:
            return None
        cap, data, limit, mapping = self._cap, self._data, self._max, self._mapping
        kinds: list[int] = []
        payloads: list[bytes] = []
        ends: list[int] = []
        add_kind, add_payload, add_end = kinds.append, payloads.append, ends.append
        unpack, base, count, expected = _unpack_frame, HEADER_BYTES + _HEADER, 0, self._expected
        # The common frame inline: one header unpack, one slice and three appends. A wrap
        # marker, a resync or a frame to refuse goes the careful way.
        while pos < head and count < max_frames:
            off = pos % cap
            if cap - off >= _HEADER:
                length, kind, seq = unpack(data, off)
                end = pos + _HEADER + ((length + 7) & ~7)
                if length <= limit and seq == expected and end <= head and end - pos <= cap - off:
                    start = base + off
                    add_kind(kind), add_payload(mapping[start : start + length]), add_end(end)
                    pos, expected, count = end, seq + 1, count + 1
                    continue
            self._pos, self._expected = pos, expected
            if count:  # only the first frame of a batch may resync
                self._resync = False
            try:
                frame = self._read_careful(head)
            except ProtocolError:
                if count:  # refused on the next call
                    break
                raise
            add_kind(frame.kind), add_payload(frame.payload), add_end(frame.end)
            pos, expected, count = frame.end, frame.seq + 1, count + 1
        self._pos, self._expected, self._resync = pos, expected, False
        # After the first frame every one had the next seq: the batch's are consecutive.
        return Batch(kinds, payloads, ends, expected - count)

    def _read_careful(self, head: int) -> Frame:
        """The frame at the read cursor, whatever its shape; ProtocolError if refused."""
        off, length, kind, seq, end = self._locate(head)
        if seq != self._expected and not self._resync:
            what = "gap" if seq > self._expected else "duplicate"
            self._corrupt(f"sequence {what}: expected {self._expected}, got {seq}")
        start = HEADER_BYTES + off + _HEADER
        payload = self._mapping[start : start + length]
        self._pos = end
        self._expected = seq + 1
        self._resync = False
        return Frame(kind, seq, payload, end)

    def _locate(self, head: int) -> tuple[int, int, int, int, int]:
        """``(offset, length, kind, seq, end)`` of the well-formed frame at the read cursor;
        ProtocolError if it is malformed."""
        pos, data, cap = self._pos, self._data, self._cap
        off = pos % cap
        if cap - off >= _HEADER:
            length, kind, seq = _unpack_frame(data, off)
        else:  # only a wrap marker's length word fits in the last 8 bytes
            length, kind, seq = _unpack_length(data, off)[0], 0, 0
            if length != WRAP:
                self._corrupt(f"frame at position {pos} overlaps the end of the ring")
        if length == WRAP:
            pos += cap - off
            off = 0
            if pos >= head:
                self._corrupt(f"wrap marker at {pos} with nothing after it")
            length, kind, seq = _unpack_frame(data, 0)
        end = pos + _HEADER + ((length + 7) & ~7)
        if length > self._max or end > head or off + end - pos > cap:
            self._corrupt(
                f"frame at position {pos} claims {length} bytes but {head - pos - _HEADER} "
                f"are published (limit {self._max})"
            )
        return off, length, kind, seq, end

    def skip(self) -> Skipped:
        """Move the read cursor past the frame :meth:`recv` refused (see the module docstring).

        A well-formed frame out of sequence is skipped alone; a malformed one skips
        everything published. Either way the next frame is taken whatever its seq: the
        refused frame's seq may be the wrong one as well as the expectation. Commits
        nothing: ``commit()`` then releases what was skipped with the rest. Does nothing if
        no frame is published.
        """
        head = int(self._words[_HEAD])
        start = self._pos
        if head <= start:
            return Skipped(0, 0)
        self._resync = True
        try:
            _, _, _, seq, end = self._locate(head)
        except ProtocolError:
            self._pos = head
            return Skipped(0, head - start)
        self._pos = end
        return Skipped(seq, end - start)

    def _corrupt(self, what: str) -> NoReturn:
        raise ProtocolError(f"ring {self.ring.name}: {what}")

    def commit(self, frame: Frame | Batch | None = None) -> None:
        """Release every frame up to and including ``frame`` (a batch: its last; default:
        all read so far)."""
        words = self._words
        end, seq = (self._pos, self._expected - 1) if frame is None else (frame.end, frame.seq)
        if frame is None and self._resync:  # past a malformed frame: no seq to go on from
            seq = 0
        if end > self._pos or end < words[_TAIL]:
            raise ValueError(f"ring {self.ring.name}: commit to {end} outside [tail, read cursor]")
        # tail_seq first: a crash between the two stores then redoes the frame, never loses it.
        words[_TAIL_SEQ] = seq
        words[_TAIL] = end
        full_barrier()
        if words[_ROOM_WANTED] or not TSO:
            self.space.ring()

    def get(self, timeout: float) -> Frame:
        """:meth:`recv` and :meth:`commit` in one: for work that need not survive a crash."""
        frame = self.recv(timeout)
        self.commit(frame)
        return frame

    def drain(self, max_frames: int = 1 << 30) -> list[Frame]:
        """Every frame available now (up to ``max_frames``), committed together; never waits.

        A refused frame raises :class:`ProtocolError` as :meth:`recv` does, once the
        frames before it have been taken and committed. :meth:`take` is the fast form.
        """
        batch = self.take(max_frames)
        if batch is None:
            return []
        self.commit(batch)
        return batch.frames()

    def wait_pending(self, timeout: float) -> bool:
        """Wait until a frame is available, without reading it; False at the deadline."""
        return self.pending() or self.bell.wait_until(self.pending, timeout)
