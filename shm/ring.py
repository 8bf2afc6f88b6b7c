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

The endpoints live in their own modules: :class:`~ringfence.shm.ring_writer.RingWriter`
and :class:`~ringfence.shm.ring_reader.RingReader` (with the frames it hands out). This
module holds what both share: the layout, its word indexes and frame codecs, the segment,
and the endpoint ownership records.
"""

from __future__ import annotations

import struct

from ringfence.shm.errors import EndpointTaken, SegmentLayoutError
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


def framed_size(payload_bytes: int) -> int:
    """Ring bytes a frame of ``payload_bytes`` takes: its header, the payload padded to 8."""
    return _HEADER + ((payload_bytes + 7) & ~7)


# Word indexes into the header (u64 words).
_MAGIC, _VERSION, _CAPACITY, _MAX_PAYLOAD = 0, 1, 2, 3
_HEAD, _PROD_PID, _PROD_TICKS, _ROOM_WANTED = 8, 9, 10, 11
_TAIL, _TAIL_SEQ, _CONS_PID, _CONS_TICKS = 16, 17, 18, 19


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
