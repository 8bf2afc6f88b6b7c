"""The run's control block: the run epoch, and six watermarks per actor instance.

One counter block (``/rf-<run>-control``) that the supervisor creates::

    counter 0              epoch       written by the supervisor: +1 on every restart
    counter 1 + 6 i + 0    heartbeat   written by instance i every runtime.heartbeat_s
    counter 1 + 6 i + 1    ready       instance i's incarnation once on_start returned
    counter 1 + 6 i + 2    exited      instance i's incarnation once it closed cleanly
    counter 1 + 6 i + 3    shutdown    +1 each time instance i asks to end the run
    counter 1 + 6 i + 4    failed      a hosted instance's incarnation once it failed
                                       (written by its host's process, hosting.py)
    counter 1 + 6 i + 5    wanted      the incarnation of a hosted instance the
                                       supervisor awaits next (written by the supervisor)

Each counter has one writer (the instance's process, or the supervisor for the epoch and
``wanted``), so it needs no lock; ``ready``, ``exited``, ``shutdown`` and ``failed`` ring
the supervisor's doorbell when they move, ``wanted`` rings the instance's own (its host
waits on it while the instance is detached), the heartbeat rings none (the supervisor reads
it on its own timer). Incarnations only grow, so a restarted instance's marks are told
apart from its predecessor's by value.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from ringfence.shm.counter import CounterBlock, Watermark
from ringfence.shm.doorbell import Doorbell

EPOCH = 0
SLOTS = 6


def control_count(num_instances: int) -> int:
    """How many counters the control block of a run with ``num_instances`` holds."""
    return 1 + SLOTS * num_instances


class InstanceControl(NamedTuple):
    """The control watermarks of one instance (and the run epoch, read-only to it)."""

    epoch: Watermark
    heartbeat: Watermark
    ready: Watermark
    exited: Watermark
    shutdown: Watermark
    failed: Watermark
    wanted: Watermark

    @classmethod
    def of(cls, block: CounterBlock, index: int) -> InstanceControl:
        base = 1 + SLOTS * index
        return cls(block[EPOCH], *(block[base + k] for k in range(SLOTS)))

    def claim(self, supervisor_bell: Iterable[Doorbell]) -> None:
        """Become the writer of this instance's counters (in the process that runs it)."""
        bells = tuple(supervisor_bell)
        self.heartbeat.claim()
        self.ready.claim(notify=bells)
        self.exited.claim(notify=bells)
        self.shutdown.claim(notify=bells)

    def next_incarnation(self) -> int:
        """The incarnation after every one that reported ready or failed (an instance that
        failed before it was ready never advanced ``ready``)."""
        return max(self.ready.value(), self.failed.value()) + 1
