"""The configuration of a run: every package's sections composed into one schema.

``runtime.config`` finds this :class:`Config` by import path (``runtime.config.SCHEMA``)
and loads the TOML file and ``--set`` overrides into it. Each section is declared next to
the code that reads it; this module only puts them together, and names the tools'
sections (the demo pipeline's, the protocol harness's) by import path, so that loading a
config imports no tool.

The whole ``Config`` is the composition root's: the topology and the launch checks (which
see the whole run before it exists) and the tools that build configs. An actor declares
the sections it reads (``Actor.config_section``: ``EngineSettings``, ``LaneSettings``,
``FrontEndSettings``) and receives only those; a helper takes the sections it reads, or
any object that has them. ``tests/project/test_imports.py`` names the modules that may
import this one.
"""

from __future__ import annotations

import dataclasses
import types

from ringfence.actors.engine.config import EngineConfig
from ringfence.actors.events.config import EventsConfig
from ringfence.actors.executors.config import TransferConfig
from ringfence.actors.model.config import ModelConfig, ParallelConfig
from ringfence.actors.serve.config import ServerConfig
from ringfence.cache.config import CacheConfig
from ringfence.runtime.config import RunConfig, RuntimeConfig, topology_setting
from ringfence.sched.config import SchedConfig


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunSettings(RuntimeConfig):
    """[runtime]: run dirs, logs, rings and the supervisor's clocks."""

    # A run launches the engine's topology unless told otherwise; the runtime names none.
    topology: str = topology_setting("ringfence.actors.engine:TOPOLOGY")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Config(RunConfig):
    """Every section of a run (see the module docstring); immutable all the way down."""

    TOOLS = types.MappingProxyType(
        {
            "demo": "ringfence.actors.tools.testing.demo:DemoConfig",
            "harness": "ringfence.actors.tools.testing.config:HarnessConfig",
        }
    )

    runtime: RunSettings = dataclasses.field(default_factory=RunSettings)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    sched: SchedConfig = dataclasses.field(default_factory=SchedConfig)
    transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    events: EventsConfig = dataclasses.field(default_factory=EventsConfig)
