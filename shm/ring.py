"""Single-producer single-consumer rings of variable-length frames in shared memory.

Byte layout of a ring segment (all words u64, little-endian)::

    offset   0  line 0  magic "RFRING01", layout version, data capacity, max payload
    offset  64  line 1  head, producer pid, start ticks, room_wanted (written by the producer only)
    offset 128  line 2  tail, tail_seq (written by the consumer only), consumer pid, start ticks
    offset 256          data: ``capacity`` bytes, a multiple of 8

``head`` and ``tail`` are byte positions that only grow; a position's place in the
data area is ``position % capacity``. ``head - tail`` bytes are published and not
yet consumed. Each side writes its own counters with one aligned 8-byte store.

A frame is 8-byte aligned and never wraps::

    u32 length   payload bytes (not counting header or padding); 0xFFFFFFFF = wrap marker
    u32 kind     opaque to the ring (the codec puts the message tag and version here)
    u64 seq      transport sequence number: 1, 2, 3, ... per ring, no gaps
    payload, then zero padding to a multiple of 8

When a frame does not fit between its position and the end of the data area, the
producer writes a wrap marker there and the frame starts at offset 0; the bytes
after the marker are skipped. Because of that, a frame of more than half the
capacity could be unplaceable even in an empty ring, so ``max_payload`` is
``capacity // 2 - 16`` and a larger message is a ``ValueError`` up front.

Ordering: the producer writes the payload, then the frame header, then ``head``;
the consumer loads ``head``, then the frame. On x86-64 (TSO) stores are not
reordered with stores nor loads with loads, so this is enough; see ``barrier.py``.

Room wake-ups: a process has one doorbell for everything it waits on, so the
consumer must not ring the producer's bell on every commit (the producer, asleep
waiting for a reply, would wake for nothing). The producer sets ``room_wanted``
before it waits for room, then a full barrier; the consumer stores ``tail``, a full
barrier, then rings only if it sees ``room_wanted``: the same Dekker pattern as the
doorbell's own flag, so a wake-up for room is never lost.

Durable consumption: the consumer reads frames at a private cursor and advances the
shared ``tail`` only when it :meth:`RingReader.commit`\\s, after the work is done. A
consumer that dies before committing leaves the frame in the ring, and its
successor resumes at the committed tail. The commit writes ``tail_seq`` before
``tail``, so after a crash between the two stores the frame at ``tail`` carries
either ``tail_seq + 1`` or ``tail_seq`` (then it is redone: the op in flight).

Corruption: a frame the reader refuses (a length past the limit or past what is
published, a wrap marker with nothing after it, a sequence gap or duplicate) raises
``ProtocolError`` and leaves the cursor where it was; :meth:`RingReader.skip` then moves
past it, so that a producer's bad frame costs its consumer that frame, not its life. A
malformed frame hides where the next one starts, so everything published is skipped.
Either way the next frame is taken whatever its seq; a commit before it records
``tail_seq = 0`` with a ``tail`` past 0, which tells a successor to do the same.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple, NoReturn

from ringfence.shm.barrier import TSO, full_barrier
from ringfence.shm.doorbell import Doorbell
from ringfence.shm.errors import (
    ActorDead,
    EndpointTaken,
    ProtocolError,
    RingEmpty,
    RingFull,
    SegmentLayoutError,
)
from ringfence.shm.liveness import ProcessStamp
from ringfence.shm.segment import Segment

MAGIC = int.from_bytes(b"RFRING01", "little")
LAYOUT_VERSION = 1
HEADER_BYTES = 256
FRAME = struct.Struct("<IIQ")  # length, kind, seq
LENGTH = struct.Struct("<I")  # a wrap marker may sit in the last 8 bytes: only its length word
WRAP = 0xFFFFFFFF
_HEADER = FRAME.size
_pack_frame, _unpack_frame = FRAME.pack_into, FRAME.unpack_from
_pack_length, _unpack_length = LENGTH.pack_into, LENGTH.unpack_from
MIN_CAPACITY = 256
_new_frame = tuple.__new__  # builds a Frame without NamedTuple's Python-level __new__

# Word indexes into the header (u64 words).
_MAGIC, _VERSION, _CAPACITY, _MAX_PAYLOAD = 0, 1, 2, 3
_HEAD, _PROD_PID, _PROD_TICKS, _ROOM_WANTED = 8, 9, 10, 11
_TAIL, _TAIL_SEQ, _CONS_PID, _CONS_TICKS = 16, 17, 18, 19


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


class Ring:
    """The shared segment of one ring. The creator unlinks it; each side opens an endpoint.

    ``RingWriter(ring, ...)`` and ``RingReader(ring, ...)`` are the two endpoints;
    each must be used by one thread of one process at a time.
    """

    def __init__(self, segment: Segment, capacity: int | None = None) -> None:
        self.segment = segment
        self.name = segment.name
        words = segment.u64(0, HEADER_BYTES // 8)
        if capacity is not None:
            words[_CAPACITY] = capacity
            words[_MAX_PAYLOAD] = capacity // 2 - FRAME.size
            words[_VERSION] = LAYOUT_VERSION
            words[_MAGIC] = MAGIC
        elif words[_MAGIC] != MAGIC or words[_VERSION] != LAYOUT_VERSION:
            raise SegmentLayoutError(
                f"{self.name} is not a ringfence ring (layout v{LAYOUT_VERSION})"
            )
        self.capacity = int(words[_CAPACITY])
        self.max_payload = int(words[_MAX_PAYLOAD])
        if self.capacity % 8 or HEADER_BYTES + self.capacity > segment.size:
            raise SegmentLayoutError(
                f"{self.name}: capacity {self.capacity} does not fit its segment"
            )
        self.words = words
        self.data = segment.view(HEADER_BYTES, self.capacity)

    @classmethod
    def create(cls, name: str, capacity: int) -> Ring:
        """Create ring ``name`` with ``capacity`` data bytes (a multiple of 8, >= 256)."""
        if capacity < MIN_CAPACITY or capacity % 8:
            raise ValueError(
                f"ring {name}: capacity must be a multiple of 8 and >= {MIN_CAPACITY}, "
                f"got {capacity}"
            )
        seg = Segment.create(name, HEADER_BYTES + capacity)
        try:
            return cls(seg, capacity)
        except BaseException:
            seg.close()
            seg.unlink()
            raise

    @classmethod
    def attach(cls, name: str) -> Ring:
        seg = Segment.attach(name)
        try:
            return cls(seg)
        except BaseException:
            seg.close()
            raise

    def used_bytes(self) -> int:
        return int(self.words[_HEAD] - self.words[_TAIL])

    def close(self) -> None:
        self.segment.close()

    def unlink(self) -> None:
        self.segment.unlink()

    def __repr__(self) -> str:
        return f"<Ring {self.name} capacity={self.capacity}>"


def _peer(words: memoryview, pid_word: int) -> ProcessStamp | None:
    pid = words[pid_word]
    return ProcessStamp(pid=pid, start_ticks=words[pid_word + 1]) if pid else None


def _release(words: memoryview, pid_word: int) -> None:
    """Give up ownership of an endpoint, if this process holds it."""
    if words[pid_word] == ProcessStamp.current().pid:
        words[pid_word] = 0


def _claim(words: memoryview, pid_word: int, what: str) -> None:
    """Record this process as the endpoint's owner; refuse while a live process owns it.

    This process included: an endpoint open twice in one process would have two read
    cursors (or two heads), and closing either would release the other's claim.
    """
    stamp = ProcessStamp.current()
    owner = _peer(words, pid_word)
    if owner is not None and owner.is_alive():
        whose = "this process" if owner.pid == stamp.pid else f"live process {owner.pid}"
        raise EndpointTaken(f"{what} is already open in {whose}")
    words[pid_word + 1] = stamp.start_ticks
    words[pid_word] = stamp.pid


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
        self.max_batch = self._cap // 2  # framed bytes of one put_many
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
        does. A batch of more than ``max_batch`` framed bytes (half the capacity, so that
        it always fits an empty ring) is a ``ValueError`` up front: split it.
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
