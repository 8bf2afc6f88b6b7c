"""The topology of ``ringfence serve``: the engine's (``actors/engine/launch.py``) plus the
``frontend`` actor, the HTTP server, on its own pair of rings to the engine.

The front end stops first (the supervisor stops actors in topology order): it answers the
requests it holds before the engine that runs them goes away.
"""

from __future__ import annotations

from typing import Protocol

from ringfence.actors.client.client import CLIENT_ACTOR, CLIENT_CHANNELS
from ringfence.actors.engine.config import EngineConfig
from ringfence.actors.model.config import ModelConfig
from ringfence.actors.serve.config import ServerConfig
from ringfence.actors.topology import FencedTopology
from ringfence.runtime.topology import ActorSpec, ChannelSpec
from ringfence.sched.config import SchedConfig

FRONTEND = "frontend"
_PROTO = "ringfence.actors.protocol.client"
FRONTEND_ACTOR = ActorSpec(name=FRONTEND, target="ringfence.actors.serve.frontend:FrontEnd")
FRONTEND_CHANNELS = (
    ChannelSpec(src=FRONTEND, dst="engine", protocol=f"{_PROTO}:CLIENT_TO_ENGINE"),
    ChannelSpec(src="engine", dst=FRONTEND, protocol=f"{_PROTO}:ENGINE_TO_CLIENT"),
)

TOPOLOGY = FencedTopology(
    engine="ringfence.actors.engine.actor:Engine",
    before=(FRONTEND_ACTOR, CLIENT_ACTOR),
    channels=(*FRONTEND_CHANNELS, *CLIENT_CHANNELS),
    preflight=(
        "ringfence.actors.engine.launch:check_limits",
        "ringfence.actors.engine.launch:check_role",
        "ringfence.actors.engine.launch:check_storage",
        f"{__name__}:check_server",
    ),
)


class ServeSections(Protocol):
    """The sections ``ringfence serve``'s check reads: ``[engine]`` and ``[server]``, and
    the prompts' (``PromptSections``: its tokenizer must load); the run's whole config, as
    the runtime gives it."""

    @property
    def engine(self) -> EngineConfig: ...
    @property
    def server(self) -> ServerConfig: ...
    @property
    def model(self) -> ModelConfig: ...
    @property
    def sched(self) -> SchedConfig: ...


def check_server(config: ServeSections) -> None:
    """``ringfence serve``'s checks before a run exists (ValueError naming the keys): the
    engine must accept every request the front end may hold, and it runs no workload."""
    if config.engine.workload:
        raise ValueError(
            f"engine.workload is {config.engine.workload!r}: ringfence serve takes requests over "
            "HTTP; run a workload with ringfence launch --workload"
        )
    if config.server.max_pending > config.engine.max_requests_per_client:
        raise ValueError(
            f"server.max_pending ({config.server.max_pending}) is more than "
            f"engine.max_requests_per_client ({config.engine.max_requests_per_client}), the "
            "requests the engine takes from one client: raise the second or lower the first"
        )
    # The front end tokenizes prompts and renders chats itself: its tokenizer must load.
    # Imported here: the supervisor imports this topology, and needs no tokenizer.
    from ringfence.actors.serve.prompts import Prompter

    Prompter(config)
