"""Run ids and the names a run creates in /dev/shm, their lease, and cleanup.

Every POSIX name the project creates is ``/rf-<run id>-<object>``. Shared memory
segments appear on Linux as ``/dev/shm/rf-...`` and semaphores as
``/dev/shm/sem.rf-...``, so a run's names can be found and removed by prefix even
after every process of the run was killed.

A run also creates a lease segment, ``rf-<run id>-lease``, holding the process
stamp (pid and start time) of the process that created the run. ``clean_all``
skips runs whose lease holder is alive, so cleaning never pulls the names out from
under a live run; names of a run with no lease or a dead holder are removed.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import posix_ipc

from ringfence.shm.liveness import ProcessStamp

PREFIX = "rf-"
SHM_DIR = Path("/dev/shm")
_SEM_FILE_PREFIX = "sem."
RUN_ID_RE = re.compile(r"^[a-z0-9]{4,32}$")
OBJECT_RE = re.compile(r"^[A-Za-z0-9_.]{1,100}$")
LEASE_OBJECT = "lease"


# Run ids issued by this process, so leak checks judge only this process's runs and
# never another live run's names on the same machine.
ISSUED_RUN_IDS: set[str] = set()


def new_run_id() -> str:
    """A fresh run id: 12 lowercase hex digits, unique with overwhelming probability."""
    run_id = secrets.token_hex(6)
    ISSUED_RUN_IDS.add(run_id)
    return run_id


def check_run_id(run_id: str) -> str:
    if not RUN_ID_RE.match(run_id):
        raise ValueError(f"run id {run_id!r} must be 4-32 characters of [a-z0-9]")
    return run_id


def posix_name(run_id: str, obj: str) -> str:
    """The POSIX name (with its leading slash) of object ``obj`` of run ``run_id``."""
    check_run_id(run_id)
    if not OBJECT_RE.match(obj):
        raise ValueError(
            f"shared-memory object name {obj!r} must be 1-100 characters of [A-Za-z0-9_.]"
        )
    return f"/{PREFIX}{run_id}-{obj}"


@dataclass(frozen=True, slots=True)
class ShmEntry:
    """One name found in /dev/shm: its POSIX name, run id, and whether it is a semaphore."""

    name: str  # the POSIX name, with its leading slash
    run_id: str
    is_semaphore: bool

    @property
    def file(self) -> str:
        """Its file name in /dev/shm (semaphores carry a ``sem.`` prefix there)."""
        return (_SEM_FILE_PREFIX if self.is_semaphore else "") + self.name[1:]


def list_names(run_id: str | None = None) -> list[ShmEntry]:
    """Every ringfence name in /dev/shm, or only those of ``run_id``. Reads, changes nothing."""
    return sorted(_iter_names(run_id), key=lambda e: (e.run_id, e.name))


def _iter_names(run_id: str | None) -> Iterator[ShmEntry]:
    try:
        files = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return
    for file in files:
        is_sem = file.startswith(_SEM_FILE_PREFIX + PREFIX)
        base = file[len(_SEM_FILE_PREFIX) :] if is_sem else file
        if not base.startswith(PREFIX):
            continue
        rid = base[len(PREFIX) :].split("-", 1)[0]
        if run_id is None or rid == run_id:
            yield ShmEntry(name="/" + base, run_id=rid, is_semaphore=is_sem)


def unlink_name(entry: ShmEntry) -> bool:
    """Unlink one name; True if this call removed it, False if it was already gone."""
    try:
        if entry.is_semaphore:
            posix_ipc.unlink_semaphore(entry.name)
        else:
            posix_ipc.unlink_shared_memory(entry.name)
    except posix_ipc.ExistentialError:
        return False
    return True


def write_lease(run_id: str) -> None:
    """Create the run's lease holding this process's stamp. The creator unlinks it."""
    stamp = ProcessStamp.current().encode()
    shm = posix_ipc.SharedMemory(
        posix_name(run_id, LEASE_OBJECT), posix_ipc.O_CREX, mode=0o600, size=len(stamp)
    )
    try:
        os.pwrite(shm.fd, stamp, 0)
    finally:
        shm.close_fd()


def remove_lease(run_id: str) -> None:
    """Unlink the run's lease (its creator does this last). Idempotent."""
    unlink_name(ShmEntry(name=posix_name(run_id, LEASE_OBJECT), run_id=run_id, is_semaphore=False))


def read_lease(run_id: str) -> ProcessStamp | None:
    """The stamp in the run's lease, or None if it has none (or an unreadable one)."""
    try:
        shm = posix_ipc.SharedMemory(posix_name(run_id, LEASE_OBJECT))
    except posix_ipc.ExistentialError:
        return None
    try:
        return ProcessStamp.decode(os.pread(shm.fd, ProcessStamp.SIZE, 0))
    except ValueError:
        return None
    finally:
        shm.close_fd()


def run_is_live(run_id: str) -> bool:
    """True while the process that created the run is alive."""
    stamp = read_lease(run_id)
    return stamp is not None and stamp.is_alive()


def clean_run(run_id: str) -> list[str]:
    """Unlink every name of ``run_id``, live or not. Returns the names removed."""
    return [e.name for e in list_names(check_run_id(run_id)) if unlink_name(e)]


@dataclass(frozen=True, slots=True)
class CleanReport:
    """What ``clean_all`` did: names removed, and run ids skipped because they are live."""

    removed: tuple[str, ...]
    live_runs: tuple[str, ...]


def clean_all(*, force: bool = False) -> CleanReport:
    """Unlink the names of every run whose creator is dead (every run with ``force``)."""
    runs = sorted({e.run_id for e in list_names()})
    live = tuple(r for r in runs if not force and run_is_live(r))
    removed: list[str] = []
    for run_id in runs:
        if run_id not in live:
            removed.extend(e.name for e in list_names(run_id) if unlink_name(e))
    return CleanReport(removed=tuple(removed), live_runs=live)
