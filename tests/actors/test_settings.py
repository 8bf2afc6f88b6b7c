"""Each actor of ``ringfence launch`` and ``ringfence serve`` receives only the sections it reads.

Every actor of the two topologies declares its sections (``config_section``: a settings
dataclass, or none at all), and the run's schema has each of them: what ``attach`` hands
the instance is exactly those sections of the run's config, and no other.
"""

from __future__ import annotations

import dataclasses

import pytest

from ringfence.actors.config import Config
from ringfence.actors.engine.config import EngineSettings
from ringfence.actors.executors.config import LaneSettings
from ringfence.actors.serve.config import FrontEndSettings
from ringfence.runtime.actor import Actor, config_of
from ringfence.runtime.imports import import_target
from ringfence.runtime.run import load_topology

LANE_SECTIONS = ("model", "cache", "transfer", "parallel")
SECTIONS = {
    "engine": ("model", "cache", "sched", "transfer", "engine", "parallel", "events"),
    "worker": LANE_SECTIONS,
    "swap": LANE_SECTIONS,
    "store": LANE_SECTIONS,
    "frontend": ("model", "cache", "sched", "engine", "parallel", "server"),
    "client": None,  # the client slots read no section
}
TOPOLOGIES = {
    "launch": "ringfence.actors.engine:TOPOLOGY",
    "serve": "ringfence.actors.serve.topology:TOPOLOGY",
}


def actor_classes(topology: str) -> dict[str, type[Actor]]:
    config = Config.load(None, [f"runtime.topology={topology}"])
    found = {}
    for spec in load_topology(config).actors:
        cls = import_target(spec.target)
        assert isinstance(cls, type) and issubclass(cls, Actor), spec.target
        found[spec.name] = cls
    return found


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_each_actor_receives_exactly_the_sections_it_declares(topology):
    config = Config.load(None, ["parallel.tp_size=2", "server.port=0"])
    for name, cls in actor_classes(TOPOLOGIES[topology]).items():
        got = config_of(cls, config)
        sections = SECTIONS[name]
        if sections is None:
            assert got is None, name
            continue
        assert dataclasses.is_dataclass(got), name
        assert tuple(f.name for f in dataclasses.fields(got)) == sections, name
        for section in sections:
            assert getattr(got, section) is getattr(config, section), (name, section)
        for other in ("model", "cache", "sched", "transfer", "engine", "parallel", "server"):
            if other not in sections:
                with pytest.raises(AttributeError):
                    getattr(got, other)


def test_the_engine_the_lanes_and_the_front_end_each_have_their_settings():
    classes = actor_classes(TOPOLOGIES["serve"])
    assert classes["engine"].config_section is EngineSettings
    assert {classes[n].config_section for n in ("worker", "swap", "store")} == {LaneSettings}
    assert classes["frontend"].config_section is FrontEndSettings
