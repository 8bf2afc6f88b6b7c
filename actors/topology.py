"""The topology of the fenced protocol: an engine, the Worker and both Transfer lanes.

The Engine actor and the protocol harness (a scripted engine) run on the same
executors over the same channels; each names its own engine class, and the Engine
adds its client slots.
"""

from __future__ import annotations

from ringfence.actors.executors.lanes import LANE_SLOTS, LANES
from ringfence.runtime.topology import ActorSpec, ChannelSpec, CounterSpec, Topology

_W = "ringfence.actors.protocol.worker"
_T = "ringfence.actors.protocol.transfer"


def fenced_topology(
    engine: str,
    *,
    before: tuple[ActorSpec, ...] = (),
    channels: tuple[ChannelSpec, ...] = (),
) -> Topology:
    """``engine`` (an import path) as actor "engine", then the Worker and both lanes.

    ``before`` go first in stop order (the supervisor stops actors in topology order):
    the engine stops before the executors, so nothing is sent to a lane that already
    stopped, and it can still wait for the store lane's writes while stopping.
    """
    return Topology(
        actors=(
            *before,
            ActorSpec(name="engine", target=engine),
            ActorSpec(name="worker", target="ringfence.actors.executors.worker:Worker"),
            ActorSpec(name="swap", target="ringfence.actors.executors.transfer:SwapLane"),
            ActorSpec(name="store", target="ringfence.actors.executors.transfer:StoreLane"),
        ),
        channels=(
            *channels,
            ChannelSpec(src="engine", dst="worker", protocol=f"{_W}:TO_WORKER"),
            ChannelSpec(src="worker", dst="engine", protocol=f"{_W}:FROM_WORKER"),
            ChannelSpec(src="engine", dst="swap", protocol=f"{_T}:TO_SWAP"),
            ChannelSpec(src="swap", dst="engine", protocol=f"{_T}:FROM_TRANSFER"),
            ChannelSpec(src="engine", dst="store", protocol=f"{_T}:TO_STORE"),
            ChannelSpec(src="store", dst="engine", protocol=f"{_T}:FROM_TRANSFER"),
        ),
        counters=(CounterSpec(name=LANES, count=LANE_SLOTS),),
    )
