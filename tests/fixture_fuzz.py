"""Fuzzing peers for live runs: actors that put fuzzed frames on their rings between the
real messages they send.

:class:`FuzzingPeer` is a mixin for any actor class: after each message it sends to one
of its ``targets``, it puts ``every`` frames from that target's pool (drawn by the test
with fuzzing.py) on the same ring, each through the ring writer itself, so frames no
codec would write get there too. A frame that decodes is first made safe for the run to
survive unchanged, by :meth:`FuzzingPeer.tame`: an op is renumbered to a number its lane
has done (a repeat), 0, a negative one, or one far past anything issued (a hole), and a
completion likewise; a peer's announcement (``WorkerReady``, ``LaneReady``) and a request
for one are left out, since they legitimately mean "I restarted". What a real op or
completion would do with a number in flight is no fuzz: nothing can tell it from the real
one.

The subclasses here are made per test with :func:`fuzzing`, which gives them their pools;
in a launched run (actors in processes of their own) :class:`LaunchedFuzzingHarness` reads
its pools from the run dir, where :func:`write_pools` put them before the launch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import orjson
from fuzzing import Fuzz, decode

from ringfence.actors.engine.actor import Engine
from ringfence.actors.engine.ledger import Ledger
from ringfence.actors.executors.store import StoreLane
from ringfence.actors.executors.swap import SwapLane
from ringfence.actors.executors.worker import Worker
from ringfence.actors.protocol.transfer import (
    FROM_TRANSFER,
    TO_STORE,
    TO_SWAP,
    DeviceTier,
    LaneReady,
    OpDone,
)
from ringfence.actors.protocol.worker import FROM_WORKER, TO_WORKER, StepResult, WorkerReady
from ringfence.actors.tools.testing.harness import Harness
from ringfence.actors.topology import FencedTopology
from ringfence.cache.fences import Lane
from ringfence.runtime.actor import Actor
from ringfence.runtime.codec import Registry
from ringfence.runtime.driver import Driver
from ringfence.runtime.mailbox import RingOutbox
from ringfence.runtime.messages import Stop
from ringfence.sched.ops import StepOp, StoreOp, SwapOp
from ringfence.shm.errors import ProtocolError, RingFull

FAR = 2**40  # an op number no run comes near: a hole for every lane
ROLES = ("repeat", "zero", "negative", "far")
LANE_OF = {"worker": Lane.STEP, "swap": Lane.SWAP, "store": Lane.STORE}
TO = {"worker": TO_WORKER, "swap": TO_SWAP, "store": TO_STORE}


class FuzzingPeer(Actor):
    """The mixin; see the module docstring. ``pools`` maps a target actor name to frames."""

    pools: ClassVar[dict[str, list[Fuzz]]] = {}
    every: ClassVar[int] = 1  # fuzzed frames after each real message to a target
    drawn = 0  # frames taken from the pools so far, in turn (instance attributes once set)
    fuzzed = 0  # of those, frames put on a ring
    skipped = 0  # of those, frames left out because the ring had no room right then

    def send(self, to: str, msg: object, *, timeout: float | None = None) -> int:
        seq = super().send(to, msg, timeout=timeout)
        name = to.rsplit("-", 1)[0]
        if self.pool(name):
            for _ in range(self.every_time()):
                self._put_one(name)
        return seq

    def send_all(self, role: str, msg: object, *, timeout: float | None = None) -> list[int]:
        seqs = super().send_all(role, msg, timeout=timeout)
        if self.pool(role):
            for _ in range(self.every_time()):
                self._put_one(role)
        return seqs

    def send_many(
        self, to: str, msgs: Sequence[object], *, timeout: float | None = None
    ) -> list[int]:
        seqs = super().send_many(to, msgs, timeout=timeout)
        name = to.rsplit("-", 1)[0]
        if self.pool(name):  # as many fuzzed frames as one by one, after the batch
            for _ in range(self.every_time() * len(msgs)):
                self._put_one(name)
        return seqs

    def send_all_many(
        self, role: str, msgs: Sequence[object], *, timeout: float | None = None
    ) -> list[list[int]]:
        seqs = super().send_all_many(role, msgs, timeout=timeout)
        if self.pool(role):
            for _ in range(self.every_time() * len(msgs)):
                self._put_one(role)
        return seqs

    def pool(self, name: str) -> list[Fuzz]:
        """The frames to put on the ring to actor ``name`` (none: that ring is left alone)."""
        return self.pools.get(name, [])

    def every_time(self) -> int:
        return self.every

    def _put_one(self, name: str) -> None:
        pool = self.pool(name)
        k = self.drawn
        self.drawn = k + 1
        fuzz = pool[k % len(pool)]
        registry = self.registry_to(name)
        outcome = decode(registry, fuzz.kind, fuzz.payload)
        if isinstance(outcome, ProtocolError):
            kind, payload = fuzz.kind, fuzz.payload
        else:
            tame = None if isinstance(outcome, Stop) else self.tame(name, outcome, k)
            if tame is None:
                return
            kind, payload = registry.encode(tame)
        driver = self.ctx.services
        assert isinstance(driver, Driver)
        outbox = driver.mailbox.outboxes[f"{name}-{self.ctx.rank}"]
        assert isinstance(outbox, RingOutbox)
        try:  # never waits: a real message must not be held up, let alone deferred, by fuzz
            outbox.writer.put(kind, payload, 0.0)
        except RingFull:
            self.skipped += 1
        else:
            self.fuzzed += 1

    def registry_to(self, name: str) -> Registry:
        raise NotImplementedError

    def tame(self, name: str, msg: object, k: int) -> object | None:
        """``msg`` made safe to send to ``name`` (see the module docstring), or None."""
        raise NotImplementedError


def lane_number(role: str, done: int, k: int) -> int:
    """A number of ``role`` for a lane done up to ``done`` (a repeat needs done >= 1)."""
    if role == "repeat" and done >= 1:
        return 1 + k % done
    return {"repeat": 0, "zero": 0, "negative": -1 - k, "far": FAR + k}[role]


def renumbered(msg: Any, number: int, **fields: Any) -> Any:
    field = "step" if isinstance(msg, StepOp | StepResult) else "op"
    return dataclasses.replace(msg, **{field: number}, **fields)


class IssuerFuzz(FuzzingPeer):
    """An engine (or the harness) that fuzzes the executors it issues ops to."""

    def registry_to(self, name: str) -> Registry:
        return TO[name]

    def done_by(self, name: str) -> int:
        """Ops of ``name``'s lane whose completion the issuer has had: every one of them a
        repeat for the executor, and none its last but the highest (see tame)."""
        completed: dict[Lane, int] = self.completed  # type: ignore[attr-defined]
        return completed[LANE_OF[name]]

    def tame(self, name: str, msg: object, k: int) -> object | None:
        if isinstance(msg, DeviceTier):
            return msg  # it names a tier that cannot be opened: refused
        if not isinstance(msg, StepOp | SwapOp | StoreOp):
            return None  # a request to announce itself again, say: not garbage
        # Below the highest completed: never the executor's last op, whose repeat would be
        # answered with its real completion again (an engine must take that as a repeat).
        role = ROLES[k % len(ROLES)]
        number = lane_number(role, self.done_by(name) - 1, k)
        return renumbered(msg, number, epoch=self.fuzz_epoch(k))

    def fuzz_epoch(self, k: int) -> int:
        """The epoch fuzzed ops carry: any, their numbers make them harmless."""
        return 7 + k


class EngineFuzz(IssuerFuzz):
    def done_by(self, name: str) -> int:
        ledger: Ledger = self.ledger  # type: ignore[attr-defined]
        return ledger.completed(LANE_OF[name])

    def fuzz_epoch(self, k: int) -> int:
        # Not the engine's: what an executor answers a fuzzed op with is then stale as well.
        epoch: int = self.executors.epoch  # type: ignore[attr-defined]
        return epoch + 1 + k


class ExecutorFuzz(FuzzingPeer):
    """A Worker or Transfer lane that fuzzes the engine it answers."""

    def registry_to(self, name: str) -> Registry:
        return FROM_WORKER if isinstance(self, Worker) else FROM_TRANSFER

    def tame(self, name: str, msg: object, k: int) -> object | None:
        if isinstance(msg, WorkerReady | LaneReady):
            return None  # an announcement means a restart: not garbage
        if isinstance(msg, StepResult | OpDone):
            role = ("zero", "negative", "far")[k % 3]
            return renumbered(msg, lane_number(role, 0, k), epoch=1_000 + k)
        return msg


def fuzzing(base: type[Actor], pools: dict[str, list[Fuzz]], every: int = 1) -> type[Actor]:
    """``base`` as a fuzzing peer putting frames from ``pools`` (by target actor name)."""
    mixin = {Engine: EngineFuzz, Harness: IssuerFuzz}.get(base, ExecutorFuzz)  # type: ignore[arg-type]
    attrs = {"pools": pools, "every": every}
    return type(f"Fuzzing{base.__name__}", (mixin, base), attrs)


EXECUTORS: dict[str, type[Actor]] = {"worker": Worker, "swap": SwapLane, "store": StoreLane}


# A launched run: the harness as a fuzzing peer in a process of its own.

POOLS_FILE = "fuzz-pools.json"  # in the run dir: the pools, written before the launch
FUZZED_FILE = "fuzzed.json"  # in the run dir: how many frames the harness put, at its stop


def write_pools(run_dir: Path, pools: dict[str, list[Fuzz]], every: int) -> None:
    frames = {
        name: [[f.kind, f.payload.hex(), f.how] for f in pool] for name, pool in pools.items()
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / POOLS_FILE).write_bytes(orjson.dumps({"pools": frames, "every": every}))


class LaunchedFuzzingHarness(IssuerFuzz, Harness):
    """The harness fuzzing its executors, with the pools :func:`write_pools` left."""

    def on_start(self) -> None:
        assert self.ctx.run_dir is not None
        data = orjson.loads((Path(self.ctx.run_dir) / POOLS_FILE).read_bytes())
        self.loaded = {
            name: [Fuzz(kind, bytes.fromhex(payload), how, "") for kind, payload, how in pool]
            for name, pool in data["pools"].items()
        }
        self.loaded_every: int = data["every"]
        super().on_start()

    def pool(self, name: str) -> list[Fuzz]:
        return self.loaded.get(name, [])

    def every_time(self) -> int:
        return self.loaded_every

    def on_stop(self) -> None:
        assert self.ctx.run_dir is not None
        (Path(self.ctx.run_dir) / FUZZED_FILE).write_bytes(orjson.dumps({"fuzzed": self.fuzzed}))
        super().on_stop()


HARNESS_TOPOLOGY = FencedTopology(engine=f"{__name__}:LaunchedFuzzingHarness")
