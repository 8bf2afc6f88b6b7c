"""The protocol harness: a scripted engine that proves the fenced protocol against an oracle.

Before the scheduler exists, :class:`Harness` plays the Engine's part against the real
Worker and the real Transfer lanes, each in its own process. It runs ``harness.programs``
random programs one after another. A program (:func:`generate`) is ``harness.ops`` ops
over small device and host pools, so blocks are reused all the time: model steps (mixed
prefill chunks and decode tokens, with the freed blocks to poison), swap-outs, swap-ins,
write-backs and prefetches, each with the fence that ``ringfence.cache.FenceTracker``
computes in issue order. Decode tokens are fixed in advance (teacher forcing), so a
whole program is known before it runs and the issuer never waits for an output.

The programs and their sequential interpretation live in ``programs.py``. The issuer
streams a program with a few ops in flight per lane (credits) and collects
every completion. Then, when ``harness.check`` is on, it interprets the same program
sequentially in its own process (:func:`interpret`: one op at a time, in issue order,
on copies of the tiers as they were before the program) and compares every step's
tokens and logprobs and the final contents of every device and host block. By the argument
in docs/design.md, "Sequence numbers, watermarks, fences", a correct protocol makes the two
equal exactly.

``transfer.mode = "sync"`` is the baseline design: the issuer holds an op until the
completions of every op its fence names have arrived, then sends it with no fence.
``transfer.skip_fences`` (debug only) makes the executors ignore fences: the harness
must then see differences, and reports in how many programs it did.

The run ends by writing ``harness.json`` into the run dir and asking for shutdown.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from pathlib import Path
from typing import Any

import orjson
import torch

from ringfence.actors.executors.config import TransferConfig
from ringfence.actors.kv.space import SharedKV, open_kv
from ringfence.actors.model.config import ModelConfig
from ringfence.actors.model.loader import load_model
from ringfence.actors.protocol.transfer import LOST, DeviceTier, LaneReady, OpDone
from ringfence.actors.protocol.worker import SampledToken, StepResult, WorkerReady
from ringfence.actors.tools.testing.config import HarnessConfig
from ringfence.actors.tools.testing.programs import (
    Shape,
    differing_blocks,
    generate,
    interpret,
)
from ringfence.actors.topology import FencedTopology
from ringfence.cache.config import CacheConfig
from ringfence.cache.fences import NO_WAIT, Lane
from ringfence.runtime.actor import Actor, handles
from ringfence.sched.ops import Op, StepOp

REPORT = "harness.json"
CREDITS = 8  # ops in flight per lane
TARGET = {Lane.STEP: "worker", Lane.SWAP: "swap", Lane.STORE: "store"}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HarnessSettings:
    """The sections the harness reads (its ``config_section``), each filled by name."""

    model: ModelConfig
    cache: CacheConfig
    transfer: TransferConfig
    harness: HarnessConfig


class Harness(Actor):
    """The scripted engine. See the module docstring."""

    config_section = HarnessSettings

    def on_start(self) -> None:
        config = self.ctx.config
        assert isinstance(config, HarnessSettings)
        self.config, self.settings = config, config.harness
        self.sync = config.transfer.mode == "sync"
        self.model = load_model(dataclasses.replace(config.model, device="cpu")).model
        self.device: SharedKV | None = None
        self.host: SharedKV | None = None
        self.ready: set[str] = set()
        self.restarts: dict[str, int] = {}
        self.tier: DeviceTier | None = None
        self.next = {Lane.STEP: 1, Lane.SWAP: 1, Lane.STORE: 1}
        self.completed = dict.fromkeys(Lane, 0)
        self.in_flight = dict.fromkeys(Lane, 0)
        self.queue: deque[Op] = deque()
        self.ops: list[Op] = []
        self.outputs: dict[int, tuple[SampledToken, ...]] = {}
        self.missing: dict[int, tuple[int, ...] | None] = {}
        self.pending: set[tuple[Lane, int]] = set()  # ops sent whose completion is to come
        self.problems: list[str] = []
        self.program = -1
        self.mismatched: list[dict[str, Any]] = []
        self.counts = dict.fromkeys(("step", "swap", "store", "blocks"), 0)
        self.busy_s = 0.0
        self.started = 0.0
        self.before: tuple[torch.Tensor, torch.Tensor] | None = None

    def on_stop(self) -> None:
        for space in (self.device, self.host):
            if space is not None:
                space.close()

    @handles(WorkerReady)
    def on_worker(self, msg: WorkerReady) -> None:
        if self.device is not None:
            raise RuntimeError("the worker restarted: the harness does not recover from that")
        self.device = open_kv(msg.kv)
        self.next[Lane.STEP] = msg.step_done + 1
        self.tier = DeviceTier(epoch=msg.epoch, kv=msg.kv)
        self.send("swap", self.tier)
        self.ready.add("worker")
        self.maybe_begin()

    @handles(LaneReady)
    def on_lane(self, msg: LaneReady) -> None:
        if msg.lane in self.ready:  # restarted: it redoes its op in flight from its ring
            self.restarts[msg.lane] = self.restarts.get(msg.lane, 0) + 1
            if msg.lane == "swap" and self.tier is not None:
                self.send("swap", self.tier)  # the new incarnation has no device tier yet
            return
        if self.host is None:
            self.host = open_kv(msg.host)
        self.next[Lane.SWAP if msg.lane == "swap" else Lane.STORE] = msg.done + 1
        self.ready.add(msg.lane)
        self.maybe_begin()

    def maybe_begin(self) -> None:
        if self.ready == {"worker", "swap", "store"} and self.program < 0:
            self.begin(0)

    def begin(self, index: int) -> None:
        assert self.device is not None and self.host is not None
        self.program = index
        c = self.config
        shape = Shape(
            device_blocks=c.cache.device_blocks,
            host_blocks=self.host.kv.shape[0],
            block_size=c.cache.block_size,
            vocab=self.model.config.vocab_size,
            poison=c.cache.poison_freed,
        )
        self.ops = generate(
            self.settings.seed + index, self.settings.ops, shape, self.next, self.ctx.epoch
        )
        for op in self.ops:
            self.next[op.lane] = op.number + 1
        if self.settings.check:  # quiescent now: the tiers as the program finds them
            self.before = (self.device.kv.clone(), self.host.kv.clone())
        self.outputs, self.missing, self.problems = {}, {}, []
        self.queue = deque(self.ops)
        self.started = time.perf_counter()
        self.pump()

    def pump(self) -> None:
        """Send ops in issue order while their lane has credit (and, in sync mode, while the
        completions their fence names have arrived)."""
        while self.queue:
            op = self.queue[0]
            lane = op.lane
            if self.in_flight[lane] >= CREDITS:
                return
            if self.sync:
                waits = op.fence.waits()
                if any(self.completed[other] < seq for other, seq in waits.items()):
                    return
                op = dataclasses.replace(op, fence=NO_WAIT)
            self.queue.popleft()
            self.in_flight[lane] += 1
            self.pending.add((lane, op.number))
            self.send(TARGET[lane], op)
        if not any(self.in_flight.values()):
            self.end()

    def expected(self, lane: Lane, number: int, status: str) -> bool:
        """Whether a completion is of an op in flight. Any other (an op's completion sent
        again by a restarted lane, an executor's answer to a message that was not one of the
        program's ops) is logged and left alone: it must not settle an op that is still to
        come, nor one twice."""
        if (lane, number) in self.pending:
            return True
        self.log.info("harness.stray", lane=str(lane), op=number, status=status)
        return False

    def settle(self, lane: Lane, number: int, status: str, error: str) -> None:
        self.pending.discard((lane, number))
        # A completion a restarted lane resent counts failed (it cannot know how the op
        # ended); the blocks, compared with the sequential interpretation, tell.
        if status != "ok" and not error.startswith(LOST):
            self.problems.append(f"{lane} op {number}: {status}: {error}")
        self.completed[lane] = max(self.completed[lane], number)
        self.in_flight[lane] -= 1
        self.pump()

    @handles(StepResult)
    def on_step(self, msg: StepResult) -> None:
        if not self.expected(Lane.STEP, msg.step, msg.status):
            return
        self.outputs[msg.step] = msg.sampled.tokens()
        self.settle(Lane.STEP, msg.step, msg.status, msg.error)

    @handles(OpDone)
    def on_op(self, msg: OpDone) -> None:
        lane = Lane.SWAP if msg.lane == "swap" else Lane.STORE
        if not self.expected(lane, msg.op, msg.status):
            return
        if msg.lane == "store":
            # A report resent after a restart cannot know what a prefetch found: skipped.
            self.missing[msg.op] = None if msg.error else msg.missing
        self.settle(lane, msg.op, msg.status, msg.error)

    def end(self) -> None:
        self.busy_s += time.perf_counter() - self.started
        for op in self.ops:
            lane = op.lane
            self.counts[str(lane)] += 1
            if not isinstance(op, StepOp):
                self.counts["blocks"] += len(op.host_blocks)
        differences = list(self.problems)
        if self.settings.check:
            differences += self.compare()
        if differences:
            self.mismatched.append({"program": self.program, "differences": differences[:5]})
            self.log.warning("harness.mismatch", program=self.program, differences=differences[:5])
        if self.program + 1 < self.settings.programs:
            self.begin(self.program + 1)
        else:
            self.finish()

    def compare(self) -> list[str]:
        assert self.before is not None and self.device is not None and self.host is not None
        expected = interpret(self.ops, self.model, *self.before)
        found = []
        for step, outputs in expected.outputs.items():
            got = self.outputs.get(step)
            if got != outputs:
                found.append(f"step {step}: outputs {got} != {outputs}")
        for op, lacked in expected.missing.items():
            if self.missing.get(op, ()) is not None and self.missing.get(op) != lacked:
                found.append(f"prefetch {op}: missing {self.missing.get(op)} != {lacked}")
        for tier, actual, wanted in (
            ("device", self.device.kv, expected.device),
            ("host", self.host.kv, expected.host),
        ):
            blocks = differing_blocks(actual, wanted)
            if blocks:
                found.append(f"{tier} blocks {blocks} differ")
        return found

    def finish(self) -> None:
        c = self.config
        total = sum(self.counts[k] for k in ("step", "swap", "store"))
        report = {
            "mode": c.transfer.mode,
            "skip_fences": c.transfer.skip_fences,
            "chaos_delay_ms": c.transfer.chaos_delay_ms,
            "poison_freed": c.cache.poison_freed,
            "programs": self.settings.programs,
            "ops_per_program": self.settings.ops,
            "checked": self.settings.check,
            "ops": total,
            "counts": self.counts,
            "busy_s": round(self.busy_s, 6),
            "ops_per_s": round(total / self.busy_s, 1) if self.busy_s else None,
            "lane_restarts": self.restarts,
            "mismatched_programs": len(self.mismatched),
            "detection_rate": len(self.mismatched) / self.settings.programs,
            "mismatches": self.mismatched[:20],
        }
        assert self.ctx.run_dir is not None
        (Path(self.ctx.run_dir) / REPORT).write_bytes(
            orjson.dumps(report, option=orjson.OPT_INDENT_2)
        )
        self.log.info(
            "harness.done",
            programs=self.settings.programs,
            ops=total,
            mismatched=len(self.mismatched),
            busy_s=report["busy_s"],
        )
        self.request_shutdown(f"harness: {self.settings.programs} programs done")


TOPOLOGY = FencedTopology(engine=f"{__name__}:Harness")
