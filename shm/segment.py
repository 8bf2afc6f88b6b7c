"""Named POSIX shared-memory segments with explicit creator and attacher roles.

The creator of a segment owns its name and unlinks it; attachers only close their
mapping. ``close()`` and ``unlink()`` are idempotent and safe on a half-built
object (a constructor that failed part way), so cleanup code never needs to know
how far construction got.
"""

from __future__ import annotations

import contextlib
import mmap
from types import TracebackType

import posix_ipc

from ringfence.shm.errors import NameExists, NameMissing


class Segment:
    """One mapped shared-memory segment.

    Owner: the process that created or attached it; not shared between threads
    for close(). Views handed out by :meth:`view` and :meth:`u64` are released by
    :meth:`close`; callers must not keep derived views of them past close.
    """

    # Initialised first so close()/unlink() work on an object whose __init__ failed.
    _mmap: mmap.mmap | None = None
    _views: list[memoryview]
    _unlinked: bool = True

    def __init__(self, name: str, *, size: int | None = None, create: bool = False) -> None:
        self._views = []
        self.name = name
        self.is_creator = create
        if create:
            if size is None or size <= 0:
                raise ValueError(f"segment {name}: size must be a positive byte count, got {size}")
            try:
                shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
            except posix_ipc.ExistentialError as e:
                raise NameExists(f"shared-memory segment {name} already exists") from e
            self._unlinked = False
        else:
            try:
                shm = posix_ipc.SharedMemory(name)
            except posix_ipc.ExistentialError as e:
                raise NameMissing(f"shared-memory segment {name} does not exist") from e
        try:
            self.size = shm.size
            if self.size == 0:
                raise NameMissing(f"shared-memory segment {name} has no size yet (creator died?)")
            self._mmap = mmap.mmap(shm.fd, self.size)
        except BaseException:
            if create:
                self.unlink()
            raise
        finally:
            shm.close_fd()
        self.buf = self.view(0, self.size)

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """Create ``name`` (which must not exist) with ``size`` bytes, zero-filled."""
        return cls(name, size=size, create=True)

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map the existing segment ``name``; this process will never unlink it."""
        return cls(name)

    def view(self, offset: int, length: int) -> memoryview:
        """A byte view of ``[offset, offset + length)``, released by :meth:`close`."""
        if self._mmap is None:
            raise ValueError(f"segment {self.name} is closed")
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(
                f"segment {self.name}: view [{offset}, +{length}) outside {self.size} bytes"
            )
        mv = memoryview(self._mmap)[offset : offset + length]
        self._views.append(mv)
        return mv

    def u64(self, offset: int, count: int) -> memoryview:
        """``count`` unsigned 64-bit words at an 8-aligned ``offset``.

        Each element assignment is one aligned 8-byte store, so a concurrent
        reader never sees a torn value (unlike ``struct.pack_into``).
        """
        if offset % 8:
            raise ValueError(f"segment {self.name}: u64 view at unaligned offset {offset}")
        mv = self.view(offset, 8 * count).cast("Q")
        self._views.append(mv)
        return mv

    @property
    def mapping(self) -> mmap.mmap:
        """The whole mapping: slicing it copies bytes out with no view object in between
        (the ring's read path). Closed with the segment."""
        if self._mmap is None:
            raise ValueError(f"segment {self.name} is closed")
        return self._mmap

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close(self) -> None:
        """Release this process's mapping. Idempotent; the name stays (see :meth:`unlink`)."""
        views, self._views = self._views, []
        for mv in reversed(views):
            mv.release()
        mm, self._mmap = self._mmap, None
        if mm is not None:
            # A caller may still hold a derived view; the mapping then goes away with it.
            with contextlib.suppress(BufferError):
                mm.close()

    def unlink(self) -> None:
        """Remove the name (creator only). Idempotent; mappings stay valid until closed."""
        if self._unlinked:
            return
        self._unlinked = True
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.name)

    def __enter__(self) -> Segment:
        return self

    def __exit__(
        self, tp: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
        if self.is_creator:
            self.unlink()

    def __repr__(self) -> str:
        role = "creator" if self.is_creator else "attacher"
        state = "closed" if self.closed else f"{self.size} bytes"
        return f"<Segment {self.name} {role} {state}>"
