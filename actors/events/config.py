"""The ``[events]`` section: whether and where an instance publishes its KV events."""

from __future__ import annotations

import dataclasses
from typing import Literal

from ringfence.runtime.config import setting


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EventsConfig:
    """[events]: KV events in vLLM's wire format, published by the engine; off by default."""

    enabled: bool = setting(False, "publish KV events (what each tier gains and loses)")
    endpoint: str = setting(
        "tcp://127.0.0.1:0", "the ZMQ PUB socket's address; port 0 = any free port"
    )
    replay_endpoint: str = setting(
        "tcp://127.0.0.1:0",
        "the ZMQ ROUTER socket that replays past batches; port 0 = any free port; "
        "empty = no replay",
    )
    buffer_steps: int = setting(10_000, "batches kept for replay", ge=1)
    topic: str = setting("", "the topic frame of every batch")
    layout: Literal["map", "array"] = setting(
        "map",
        "map: vLLM's current tagged maps; array: the positional structs of vLLM before",
    )
