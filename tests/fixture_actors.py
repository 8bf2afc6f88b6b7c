"""Test-only actors and topologies, launched with ``runtime.topology=fixture_actors:NAME``.

Spawned children import this module by name, so a launch that uses it needs the
tests folder on ``PYTHONPATH`` (``launching.launch_env`` puts it there). Each
topology is the demo pipeline with one actor swapped for a misbehaving subclass;
the channels, protocol and counter block stay the demo's.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from ringfence.runtime.demo import TOPOLOGY, Item, Relay, Sink
from ringfence.runtime.topology import Topology

HANG_AT = 100  # the item whose handler HangingSink blocks in, in its first incarnation
HANG_S = 60.0  # far longer than any heartbeat timeout a test sets


class StartRefused(RuntimeError):
    """Raised by FailingStartRelay.on_start."""


class HangingSink(Sink):
    """The demo sink, except that its first incarnation blocks in the handler of item HANG_AT.

    Blocking inside a handler stops the driver's loop, so the heartbeat goes stale; the
    item is not committed, so the restarted sink is handed it again.
    """

    def on_item(self, msg: Item) -> None:
        if self.ctx.incarnation == 1 and msg.n == HANG_AT:
            threading.Event().wait(HANG_S)
        super().on_item(msg)


class FailingStartRelay(Relay):
    """A relay whose ``on_start`` always raises: the instance never reports ready."""

    def on_start(self) -> None:
        raise StartRefused("fixture relay refuses to start")


def _swap(name: str, target: str) -> Topology:
    """The demo topology with actor ``name`` running class ``target`` instead."""
    actors = tuple(
        replace(spec, target=target) if spec.name == name else spec for spec in TOPOLOGY.actors
    )
    return replace(TOPOLOGY, actors=actors)


HUNG_SINK = _swap("sink", f"{__name__}:HangingSink")
FAILING_START = _swap("relay", f"{__name__}:FailingStartRelay")
