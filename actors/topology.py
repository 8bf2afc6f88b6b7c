"""The topology of the fenced protocol: an engine, and the Worker and both Transfer lanes in
as many ranks as ``parallel.tp_size`` says.

The Engine actor and the protocol harness (a scripted engine) run on the same executors
over the same channels; each names its own engine class, and the Engine adds its client
slots. ``runtime.topology`` names a :class:`FencedTopology`, which the supervisor calls
with the run's config. Each channel from the engine becomes one ring to every rank, and
each channel to it one ring from every rank (``runtime/topology.py``); the ``lanes``
counter block holds every rank's watermarks and epochs (``protocol/lanes.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ringfence.actors.protocol.lanes import LANE_SLOTS, LANES
from ringfence.runtime.config import RunConfig
from ringfence.runtime.topology import ActorSpec, ChannelSpec, CounterSpec, Topology

_W = "ringfence.actors.protocol.worker"
_T = "ringfence.actors.protocol.transfer"
CHECK_MODEL = "ringfence.actors.preflight:check_model"  # by name: imported when a run starts
# The device pool and batch limits a GPU gets unless set, resolved before the preflight.
DEVICE_DEFAULTS = "ringfence.actors.device_defaults:resolve_device_defaults"
_EXECUTORS = {
    "worker": "ringfence.actors.executors.worker:Worker",
    "swap": "ringfence.actors.executors.swap:SwapLane",
    "store": "ringfence.actors.executors.store:StoreLane",
}
# The Worker's ranks share a process group that dies with any of them: they restart as one
# group (runtime/topology.py). A lane's rank restarts alone and redoes its op.
_TOGETHER = frozenset({"worker"})


@dataclass(frozen=True, slots=True, kw_only=True)
class FencedTopology:
    """``engine`` (an import path) as actor "engine", then the Worker and both lanes.

    ``before`` go first in stop order (the supervisor stops actors in topology order):
    the engine stops before the executors, so nothing is sent to a lane that already
    stopped, and it can still wait for the store lane's writes while stopping.
    """

    engine: str
    before: tuple[ActorSpec, ...] = ()
    channels: tuple[ChannelSpec, ...] = ()
    # Preflight checks besides the model's (check_model: the Worker loads it in on_start).
    preflight: tuple[str, ...] = ()

    def __call__(self, config: RunConfig) -> Topology:
        """The topology at the run's ``parallel.tp_size``."""
        parallel = config.section("parallel")
        return self.ranked(getattr(parallel, "tp_size", 1))

    def ranked(self, ranks: int = 1) -> Topology:
        """The topology with ``ranks`` ranks of each executor; the Worker's restart together."""
        return Topology(
            actors=(
                *self.before,
                ActorSpec(name="engine", target=self.engine),
                *(
                    ActorSpec(name=n, target=t, ranks=ranks, restart_together=n in _TOGETHER)
                    for n, t in _EXECUTORS.items()
                ),
            ),
            channels=(
                *self.channels,
                ChannelSpec(src="engine", dst="worker", protocol=f"{_W}:TO_WORKER"),
                ChannelSpec(src="worker", dst="engine", protocol=f"{_W}:FROM_WORKER"),
                ChannelSpec(src="engine", dst="swap", protocol=f"{_T}:TO_SWAP"),
                ChannelSpec(src="swap", dst="engine", protocol=f"{_T}:FROM_TRANSFER"),
                ChannelSpec(src="engine", dst="store", protocol=f"{_T}:TO_STORE"),
                ChannelSpec(src="store", dst="engine", protocol=f"{_T}:FROM_TRANSFER"),
            ),
            counters=(CounterSpec(name=LANES, count=LANE_SLOTS * ranks),),
            preflight=(CHECK_MODEL, *self.preflight),
            defaults=(DEVICE_DEFAULTS,),
        )
