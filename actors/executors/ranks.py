"""The Worker ranks of one instance: their process group, and the step gate by which they
enter a step's collectives together.

Under tensor parallelism every rank runs every step plan, and a step's forward pass
holds all-reduces: a rank that enters it waits inside the collective for all the
others. Each rank waits only on its own rank's watermarks for the plan's fence (docs/design.md,
"Ranks (tensor parallelism)": shards of different ranks are disjoint memory), so the ranks reach the
forward at different times; a rank whose swap lane is restarting may be seconds late,
and one that finds the plan stale or malformed never enters it. A rank blocked in a
collective cannot heartbeat, nor see that a peer will never come.

So before the forward, rank r *commits* to step s by advancing its ``step_gate[r]`` to s
(a counter of the ``lanes`` block, one writer: ``actors/protocol/lanes.py``), then
sleeps on its own doorbell, with the driver's deadline, until every peer p has either
committed (``step_gate[p] >= s``) or passed s without running it (``step_done[p] >= s``:
it cancelled or refused s, since no rank can finish s by running it before all have
entered). If every peer committed, all run; if one passed, this rank cancels s too. A
rank decides to pass only before it commits, so every rank sees the same passer and they
all agree. The wait defers like a fence wait (the plan is handed over again after a
heartbeat): nothing blocks a rank in a collective for longer than the ranks' compute
skew.

A gate value left by a dead incarnation is at most its ``step_done + 1``, and that step
is of the old epoch: every new rank cancels it as stale without committing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ringfence.actors.model.parallel import Group, Shard, join_group, rendezvous_file
from ringfence.actors.protocol.lanes import gate_counter, lane_counter
from ringfence.cache.fences import Lane
from ringfence.shm.counter import CounterBlock, Waker
from ringfence.shm.errors import RingfenceError, WaitTimeout

if TYPE_CHECKING:
    from ringfence.runtime.log import ActorLog


class GroupFailed(RingfenceError):
    """A step failed inside (or past) its collectives under tensor parallelism. The peers
    cannot be told, so this rank ends without answering: ``Worker.on_failure`` re-raises
    it, and the driver takes the plan off its ring only after a handler that returned. The
    supervisor restarts the group; the next generation finds the plan still there, and
    cancels it as stale (docs/design.md, "Ranks (tensor parallelism)")."""


def join_ranks(  # noqa: PLR0917
    shard: Shard,
    device: str,
    run_dir: Path | None,
    generation: int,
    timeout_s: float,
    log: ActorLog,
) -> Group:
    """The process group of an instance's Worker ranks (none for one rank): one rendezvous
    file per generation (the ranks restart together, so they share the incarnation)."""
    if shard.size == 1:
        return Group(shard, None)
    if run_dir is None:
        raise RuntimeError(f"parallel.tp_size {shard.size} needs a run dir for the rendezvous")
    began = time.perf_counter()
    group = join_group(shard, device, rendezvous_file(run_dir, generation), timeout_s)
    log.info(
        "worker.group",
        tp_size=shard.size,
        generation=generation,
        backend="nccl" if device.startswith("cuda") else "gloo",
        join_s=round(time.perf_counter() - began, 3),
    )
    return group


class StepGate:
    """Rank ``rank``'s side of the gate among ``size`` ranks (see the module docstring),
    over the ``lanes`` counter block; ``notify``: the peers' doorbells, rung on a commit."""

    def __init__(self, block: CounterBlock, rank: int, size: int, notify: list[Waker]) -> None:
        self.rank, self.size = rank, size
        peers = [p for p in range(size) if p != rank]
        self.own = gate_counter(block, rank)
        self.gates = {p: gate_counter(block, p) for p in peers}
        self.done = {p: lane_counter(block, p, Lane.STEP) for p in peers}
        self.own.claim(notify=notify)

    def commit(self, step: int) -> None:
        """This rank will run ``step`` unless a peer passes it."""
        if self.own.value() < step:
            self.own.advance(step)

    def settled(self, step: int) -> bool:
        """Whether every peer committed to ``step`` or passed it."""
        return all(self._settled_at(p, step) for p in self.gates)

    def passed_by(self, step: int) -> int | None:
        """A peer that passed ``step`` without running it, or None (all committed).

        ``step_done`` is read after ``step_gate`` in :meth:`settled`: a peer that has
        committed and not finished shows ``step_done < step`` here."""
        for p in sorted(self.done):
            if self.done[p].value() >= step:
                return p
        return None

    def enter(self, step: int, wait_until: Callable[[Callable[[], bool]], bool]) -> str:
        """Commit to ``step`` and wait for the peers: "" to run it, else why it is cancelled.

        ``wait_until`` is the actor's deadline wait; False (its deadline passed) raises
        :class:`GateOverdue` so that the caller hands the plan over again later."""
        self.commit(step)
        if not self.settled(step) and not wait_until(lambda: self.settled(step)):
            late = [p for p in sorted(self.gates) if not self._settled_at(p, step)]
            raise GateOverdue(f"step {step}: ranks {late} have neither entered nor passed it")
        peer = self.passed_by(step)
        if peer is None:
            return ""
        return f"rank {peer} passed step {step} without running it"

    def _settled_at(self, peer: int, step: int) -> bool:
        return self.gates[peer].value() >= step or self.done[peer].value() >= step


class GateOverdue(WaitTimeout):
    """The peers did not reach a step's gate within the wait's deadline (the driver hands
    the plan over again after a heartbeat, as for a fence wait)."""
