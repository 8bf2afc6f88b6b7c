"""The run's control block: the run epoch, and four watermarks per actor instance.

One counter block (``/rf-<run>-control``) that the supervisor creates::

    counter 0              epoch       written by the supervisor: +1 on every restart
    counter 1 + 4 i + 0    heartbeat   written by instance i every runtime.heartbeat_s
    counter 1 + 4 i + 1    ready       instance i's incarnation once on_start returned
    counter 1 + 4 i + 2    exited      instance i's incarnation once it closed cleanly
    counter 1 + 4 i + 3    shutdown    +1 each time instance i asks to end the run

Each counter has one writer (the instance, or the supervisor for the epoch), so it
needs no lock; ``ready``, ``exited`` and ``shutdown`` ring the supervisor's doorbell
when they move, the heartbeat does not (the supervisor reads it on its own timer).
Incarnations only grow, so a restarted instance's ``ready`` and ``exited`` are told
apart from its predecessor's by value.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from ringfence.shm.counter import CounterBlock, Watermark
from ringfence.shm.doorbell import Doorbell

EPOCH = 0
SLOTS = 4


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
