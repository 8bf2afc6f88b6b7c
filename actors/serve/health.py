"""Which actors of the instance are live, read from the run's control block (``/health``).

An instance is live when the process that wrote its ``ready`` watermark is alive, it has
not exited cleanly since, and it is the same process that was the writer when ``ready``
last moved. The last condition matters during a restart: the new process claims the
counters (becoming their writer) as soon as it attaches, but it serves only once its
``on_start`` returned and ``ready`` moved to its incarnation. Restarts are the incarnations
past the first.

Reads shared memory only. ``live`` and ``down`` remember who wrote each ``ready``, so one
thread calls them (the front end's actor, each tick); ``restarts`` any thread.
"""

from __future__ import annotations

from collections.abc import Iterable

from ringfence.runtime.control import InstanceControl
from ringfence.runtime.manifest import InstanceEntry
from ringfence.shm.counter import CounterBlock
from ringfence.shm.liveness import ProcessStamp


class Liveness:
    """The live/down state of some instances of a run."""

    def __init__(self, block: CounterBlock, entries: Iterable[InstanceEntry]) -> None:
        self._controls = {e.id: InstanceControl.of(block, e.index) for e in entries}
        # instance -> (ready value, its writer then): who made the latest ready
        self._seen: dict[str, tuple[int, ProcessStamp | None]] = {}

    def down(self) -> list[str]:
        """The instances that are not live now, in topology order."""
        return [name for name in self._controls if not self.live(name)]

    def live(self, instance: str) -> bool:
        control = self._controls[instance]
        ready, writer = control.ready.value(), control.ready.writer()
        seen = self._seen.get(instance)
        if seen is None or seen[0] != ready:
            seen = self._seen[instance] = (ready, writer)
        return (
            ready > 0
            and writer is not None
            and writer == seen[1]
            and control.exited.value() < ready
            and writer.is_alive()
        )

    def restarts(self) -> dict[str, int]:
        """Restarts of each instance so far: incarnations that became ready, past the first."""
        return {name: max(0, c.ready.value() - 1) for name, c in self._controls.items()}
