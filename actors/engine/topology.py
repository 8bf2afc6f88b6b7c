"""The default topology of a run (``runtime.topology``): the Engine, the Worker, both
Transfer lanes and the client slots."""

from __future__ import annotations

from ringfence.actors.client.client import CLIENT_ACTOR, CLIENT_CHANNELS
from ringfence.actors.topology import FencedTopology

# Clients stop first (not waited for), then the engine, then the executors.
# The engine reads engine.workload and sched.max_model_len: a line it could not read, or a
# limit past the model's positions, is refused before the run.
TOPOLOGY = FencedTopology(
    engine="ringfence.actors.engine.actor:Engine",
    before=(CLIENT_ACTOR,),
    channels=CLIENT_CHANNELS,
    preflight=(
        "ringfence.actors.engine.intake:check_workload",
        "ringfence.actors.engine.checks:check_limits",
        "ringfence.actors.engine.checks:check_role",
        "ringfence.actors.engine.checks:check_storage",
    ),
)
