"""Executor lanes that fail as a test asks, and the engine topology that runs them.

``runtime.topology=fixture_lanes:BREAKING_SWAP`` is the engine's default topology with the
swap lane replaced by :class:`BreakingSwapLane`.
"""

from __future__ import annotations

from dataclasses import replace

from ringfence.actors.engine.launch import TOPOLOGY
from ringfence.actors.executors.swap import SwapLane
from ringfence.runtime.actor import handles
from ringfence.runtime.config import RunConfig
from ringfence.runtime.mailbox import Delivery
from ringfence.runtime.topology import Topology
from ringfence.sched.ops import SwapOp

BREAK_AT = 3  # the swap op at which the first incarnation fails


class LaneBroke(RuntimeError):
    """Raised by BreakingSwapLane's handler, and re-raised by its on_failure: the lane ends."""


class BreakingSwapLane(SwapLane):
    """The swap lane, except that its first incarnation fails (its handler raises before the
    op runs, and the instance ends) on the BREAK_AT-th swap op it is handed; later ones run
    as the swap lane does, and redo that op."""

    def on_start(self) -> None:
        super().on_start()
        self.handed = 0

    @handles(SwapOp)
    def on_swap(self, msg: SwapOp) -> None:
        self.handed += 1
        if self.ctx.incarnation == 1 and self.handed == BREAK_AT:
            raise LaneBroke(f"fixture swap lane breaks at its op {msg.op}")
        super().on_swap(msg)

    def on_failure(self, error: Exception, delivery: Delivery) -> None:
        if isinstance(error, LaneBroke):
            raise error
        super().on_failure(error, delivery)


def BREAKING_SWAP(config: RunConfig) -> Topology:
    """The engine's topology at the run's ranks, its swap lane a BreakingSwapLane."""
    topology = TOPOLOGY(config)
    actors = tuple(
        replace(a, target=f"{__name__}:BreakingSwapLane") if a.name == "swap" else a
        for a in topology.actors
    )
    return replace(topology, actors=actors)
