"""The engine's executors: who they are, how they announce themselves, and their restarts.

Every rank has a Worker (the step lane) and two Transfer lanes (swap and store). An engine
(re)starts by publishing its epoch as every rank's ``issuer_epoch`` (every op an engine
before it issued is stale from then on and is cancelled, never run) and sending every
executor a ``Resync`` (:meth:`Executors.resync`). It begins only once every executor of
every rank has answered (docs/design.md, "Epochs and restarts"; :class:`Roster`): the
answer's watermark covers every op an engine before it sent, so each lane's numbers go on
after the largest of its ranks' answers.

Afterwards an announcement with a new incarnation is a restart:

- a Worker's means a new device tier: the engine adopts its epoch (ops of the old tier are
  stale from here), :meth:`Scheduler.reset_device` sends every running request back to be
  computed again, and the swap lane of its rank is told the new tier before any op of the
  new epoch. Under tensor parallelism the ranks restart together under one incarnation:
  the first rank of a new generation resets, and nothing is issued until every rank of it
  announced itself (:attr:`Executors.regrouping`), so every rank gets every op of its epoch;
- a Transfer lane's means it redoes its op in flight from its ring and resends a completion
  lost with it: nothing to do but tell the swap lane its tier again.

Engine thread only. The Engine actor holds one :class:`Executors` (``engine.executors``)
whose methods its ``WorkerReady`` and ``LaneReady`` handlers name, one line each; it calls
back through :class:`ExecutorSide`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from ringfence.actors.engine.ledger import Ledger
from ringfence.actors.model.info import ModelInfo
from ringfence.actors.protocol.lanes import ISSUER_EPOCH, epoch_counter
from ringfence.actors.protocol.resync import Resync
from ringfence.actors.protocol.transfer import DeviceTier, LaneReady
from ringfence.actors.protocol.worker import WorkerReady
from ringfence.cache.fences import Lane
from ringfence.runtime.log import ActorLog
from ringfence.sched.scheduler import Scheduler
from ringfence.shm.counter import CounterBlock
from ringfence.shm.errors import ProtocolError

# Who the executors are.

EXECUTORS = {"worker": Lane.STEP, "swap": Lane.SWAP, "store": Lane.STORE}


class Announced(NamedTuple):
    """An executor's announcement, as the engine takes it."""

    restarted: bool  # a new incarnation of an executor the engine had already heard from


class Roster:
    """The executors of ``ranks`` ranks, as announced to the engine of ``epoch``: each
    (role, rank)'s incarnation, and its Resync answer."""

    def __init__(self, epoch: int, ranks: int) -> None:
        self.epoch, self.ranks = epoch, ranks
        self.incarnations: dict[tuple[str, int], int] = {}  # the incarnation last announced
        self.synced: dict[tuple[str, int], int] = {}  # its watermark when it answered Resync

    def announce(
        self, role: str, rank: int, incarnation: int, resync: int, done: int, *, began: bool
    ) -> Announced | None:
        """Record an announcement; None if it answers another engine's Resync or comes from
        a rank the run does not have (ValueError is for the caller's protocol error)."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"{role} rank {rank} announced; the run has {self.ranks} ranks")
        if resync >= 0 and resync != self.epoch:
            return None
        if resync >= 0 and not began:
            self.synced[(role, rank)] = done
        known = self.incarnations.setdefault((role, rank), incarnation)
        self.incarnations[(role, rank)] = incarnation
        return Announced(restarted=known != incarnation)

    def all_synced(self) -> bool:
        """Whether every executor of every rank answered this engine's Resync."""
        return len(self.synced) == len(EXECUTORS) * self.ranks

    def first_numbers(self) -> dict[Lane, int]:
        """Each lane's first op number: after the largest watermark its ranks answered."""
        first = {}
        for role, lane in EXECUTORS.items():
            first[lane] = max(self.synced[(role, rank)] for rank in range(self.ranks)) + 1
        return first


# The engine's side of them.


class ExecutorSide(Protocol):
    """What the executors' handlers ask of the engine that holds them (the Engine actor)."""

    @property
    def scheduler(self) -> Scheduler | None:
        """The scheduler, None until the engine began."""
        ...

    def begin(self) -> None:
        """Begin if every executor answered and the model is known (not yet begun)."""
        ...

    def kick(self) -> None:
        """Schedule and send what the scheduler has now, then flush to the clients."""
        ...


class Executors:
    """See the module docstring. Mutates the ledger (a restarted Worker's finished steps)
    and the engine's scheduler (a reset of the device tier); sends ``DeviceTier`` to the
    swap lanes through ``send(instance, tier)``.

    ``epoch`` is the epoch stamped on every op: the engine's own, raised to a restarted
    Worker's. ``model`` is what the Worker loaded (None until the first one announced)."""

    def __init__(
        self,
        engine: ExecutorSide,
        *,
        epoch: int,
        ranks: int,
        ledger: Ledger,
        send: Callable[[str, DeviceTier], object],
        log: ActorLog,
    ) -> None:
        self.engine, self.ledger, self.send, self.log = engine, ledger, send, log
        self.epoch, self.ranks = epoch, ranks
        self.roster = Roster(epoch, ranks)
        self.model: ModelInfo | None = None
        self.tiers: dict[int, DeviceTier] = {}  # rank -> the device tier its swap lane copies
        self.worker_generation: dict[int, int] = {}  # rank -> its Worker's incarnation
        self.reset_generation = 0  # the Worker incarnation the device tier was last reset for

    def resync(self, block: CounterBlock, send_all: Callable[[str, Resync], object]) -> None:
        """Publish this engine's epoch as every rank's issuer epoch (``block``: the lanes'
        counters), then ask each executor where its lane stands. The order matters: an
        executor answers after it saw the new issuer epoch, so it cancels the ops of the
        engines before."""
        for rank in range(self.ranks):
            issuer = epoch_counter(block, rank, ISSUER_EPOCH)
            issuer.claim()
            issuer.advance(self.epoch)
        for role in EXECUTORS:
            send_all(role, Resync(epoch=self.roster.epoch))

    @property
    def ready(self) -> bool:
        """Whether every executor answered this engine's Resync and the model is known."""
        return self.roster.all_synced() and self.model is not None

    @property
    def regrouping(self) -> list[int]:
        """The Worker ranks a restarted group still waits for (docs/design.md,
        "Ranks (tensor parallelism)": the ranks restart together, under one incarnation number):
        nothing is issued until every rank of the new generation announced itself, so every
        rank gets every op of its epoch."""
        return [
            rank
            for rank in range(self.ranks)
            if self.worker_generation.get(rank, 0) < self.reset_generation
        ]

    def tell_tiers(self) -> None:
        """Tell every swap lane its device tier (when the engine begins, before any op)."""
        for rank, tier in sorted(self.tiers.items()):
            self.send(f"swap-{rank}", tier)

    def worker_ready(self, msg: WorkerReady) -> None:
        """A Worker announced itself: its model, its device tier, and whether it restarted."""
        began = self.engine.scheduler is not None
        announced = self._announce("worker", msg.rank, msg.incarnation, msg.resync, msg.step_done)
        if announced is None:
            return
        if began:  # a new Worker does not answer for the steps its predecessor finished
            self.ledger.complete_up_to(Lane.STEP, msg.rank, msg.step_done)
        if self.model is not None and msg.model.model_id != self.model.model_id:
            raise ProtocolError(
                f"the worker restarted with model {msg.model.model_id}, not {self.model.model_id}"
            )
        self.model = msg.model
        self.epoch = max(self.epoch, msg.epoch)  # ops of the old tier are stale from here
        self.tiers[msg.rank] = DeviceTier(epoch=self.epoch, kv=msg.kv)
        self.worker_generation[msg.rank] = msg.incarnation
        if not began:
            self.engine.begin()
        elif announced.restarted:
            self._reset_tier(msg)

    def lane_ready(self, msg: LaneReady) -> None:
        """A Transfer lane announced itself; a restarted one redoes its op in flight from its
        ring and resends a report, so it only needs its tier again."""
        announced = self._announce(msg.lane, msg.rank, msg.incarnation, msg.resync, msg.done)
        if announced is None:
            return
        if self.engine.scheduler is None:
            self.engine.begin()
        elif announced.restarted:
            instance = f"{msg.lane}-{msg.rank}"
            self.log.warning("engine.lane_restart", lane=msg.lane, instance=instance, done=msg.done)
            if msg.lane == "swap" and msg.rank in self.tiers:
                self.send(f"swap-{msg.rank}", self.tiers[msg.rank])

    def _announce(
        self, role: str, rank: int, incarnation: int, resync: int, done: int
    ) -> Announced | None:
        try:
            return self.roster.announce(
                role, rank, incarnation, resync, done, began=self.engine.scheduler is not None
            )
        except ValueError as e:
            raise ProtocolError(str(e)) from None

    def _reset_tier(self, msg: WorkerReady) -> None:
        """A Worker restarted: its device tier is new, every op in flight is lost. Under
        tensor parallelism the first rank of a new generation resets; the others' device
        tiers are told to their swap lanes as they announce."""
        scheduler = self.engine.scheduler
        assert scheduler is not None
        if msg.incarnation <= self.reset_generation:  # a later rank of the same generation
            self.send(f"swap-{msg.rank}", self.tiers[msg.rank])
            self.log.info("engine.rank_rejoined", worker_rank=msg.rank, waiting=self.regrouping)
            self.engine.kick()
            return
        self.reset_generation = msg.incarnation
        if self.log.tracing:
            self.log.trace("sched.reset", tier_epoch=msg.epoch)
        requeued = scheduler.reset_device()
        self.log.warning(
            "engine.tier_reset",
            incarnation=msg.incarnation,
            new_epoch=self.epoch,
            step_done=msg.step_done,
            requeued=[r.request_id for r in requeued],
            worker_rank=msg.rank,
            waiting=self.regrouping,
        )
        self.send(f"swap-{msg.rank}", self.tiers[msg.rank])  # before any op of the new epoch
        self.engine.kick()
