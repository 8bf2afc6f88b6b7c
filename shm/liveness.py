"""Process stamps: a pid plus its start time, so a recycled pid is not mistaken for a peer."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

# Byte layout of an encoded stamp: pid (u64) then start time in clock ticks since
# boot (u64, field 22 of /proc/<pid>/stat; 0 where /proc is unavailable).
_STAMP = struct.Struct("<QQ")


def _read_stat(pid: int) -> tuple[bytes, int] | None:
    """State letter and start time (ticks since boot) of ``pid``; None if there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        # No /proc to read: fall back to asking the kernel whether the pid exists.
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return b"R", 0
    # The command name (field 2) is parenthesised and may hold spaces or ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[0], int(fields[19])


@dataclass(frozen=True, slots=True)
class ProcessStamp:
    """Identity of a process that survives pid reuse: pid and start time."""

    pid: int
    start_ticks: int

    SIZE = _STAMP.size

    @classmethod
    def current(cls) -> ProcessStamp:
        stat = _read_stat(os.getpid())
        return cls(pid=os.getpid(), start_ticks=stat[1] if stat else 0)

    @classmethod
    def of(cls, pid: int) -> ProcessStamp | None:
        """The stamp of a running process, or None if it does not exist."""
        stat = _read_stat(pid)
        return None if stat is None else cls(pid=pid, start_ticks=stat[1])

    def encode(self) -> bytes:
        return _STAMP.pack(self.pid, self.start_ticks)

    @classmethod
    def decode(cls, data: bytes) -> ProcessStamp:
        if len(data) != _STAMP.size:
            raise ValueError(f"a process stamp is {_STAMP.size} bytes, got {len(data)}")
        pid, ticks = _STAMP.unpack(data)
        return cls(pid=pid, start_ticks=ticks)

    def is_alive(self) -> bool:
        """True if this very process (same pid, same start) still exists and is not a zombie."""
        if self.pid <= 0:
            return False
        stat = _read_stat(self.pid)
        if stat is None or stat[0] in (b"Z", b"X"):
            return False
        return not (self.start_ticks and stat[1] and stat[1] != self.start_ticks)
