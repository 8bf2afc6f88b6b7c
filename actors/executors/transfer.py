"""What the Transfer actor's two lanes share: ``swap`` (device <-> host, ``swap.py``) and
``store`` (host <-> storage, ``store.py``).

Each lane is its own actor process with its own ring from the engine, executing its
ops strictly in order (``t = 1, 2, ...`` and ``u = 1, 2, ...``) on the lane machinery
of :mod:`ringfence.actors.executors.lanes`: wait until the watermarks named in the op's fence
are reached, copy, advance the lane's watermark, then report an :class:`OpDone` (and
only then is the ring frame released, so a restarted lane redoes the op in flight;
copies are idempotent, and so are content-keyed writes).

The lanes are separate processes rather than two lanes of one loop because each must
be free to wait for its fence while the other runs: a swap-in waits for the prefetch
that fills its host blocks (the store lane), and a write-back waits for the swap-out
that fills its host blocks (the swap lane). In one loop, an op blocked at the head of
one lane would stall the op of the other lane it waits for. Separate processes also
keep storage I/O from holding up swaps.

Both lanes map the same host KV tensor, a shared-memory segment of the run
(``rf-<run>-kv.host.<rank>``; pinned and registered with CUDA when the device tier is
on a GPU).

A failed op still advances its watermark (a watermark says "finished", not "ok"), so
ops fenced on it go ahead before the engine hears of the failure. What it was writing
is therefore spoiled first: its destination blocks are filled with NaN, and the taint
travels with the data. A later copy carries the NaN along, a step that reads it gets
non-finite logits and fails (``actors/executors/worker.py``), and a write-back refuses a block
that is all NaN, so no stored key ever names garbage. (Spoiling and copies are of whole
blocks, so a spoiled block is all NaN; a block with some NaN is data, such as the unused
slots of a partial block under ``cache.poison_freed``, and is stored as it is.) If
spoiling fails too, the lane dies before its watermark moves, and its restart redoes
the op.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch

from ringfence.actors.executors.lanes import Cancelled, LaneExecutor
from ringfence.actors.executors.profiling import op_range
from ringfence.actors.kv.layout import kv_layout
from ringfence.actors.kv.space import SharedKV, create_kv
from ringfence.actors.protocol.resync import Resync
from ringfence.actors.protocol.transfer import LOST, LaneReady, OpDone, OpStatus
from ringfence.cache.fences import Lane, Tier
from ringfence.runtime.actor import handles
from ringfence.sched.ops import StoreOp, SwapOp
from ringfence.shm.names import posix_name


class TransferLane(LaneExecutor):
    """What both lanes share: the host tier, chaos delays, op order and reporting."""

    lane_name: ClassVar[Literal["swap", "store"]]

    def on_start(self) -> None:
        super().on_start()
        layout = kv_layout(self.config, Tier.HOST)
        run_id, rank = self.ctx.run_id, self.ctx.rank
        name = posix_name(run_id, f"kv.host.{rank}") if run_id else ""
        self.host: SharedKV | None = create_kv(layout, "cpu", shm_name=name)
        self.chaos_s = self.config.transfer.chaos_delay_ms / 1000
        self.rng = random.Random()
        self.ops = 0
        self.log.info(
            "lane.ready",
            lane=str(self.lane),
            done=self.done.value(),
            host_shm=name,
            host_blocks=layout.num_blocks,
            block_bytes=layout.block_bytes,
        )
        self.announce()

    def announce(self, resync: int = -1) -> None:
        """Send LaneReady: on start, and in answer to an engine's Resync."""
        assert self.host is not None
        self.send(
            "engine",
            LaneReady(
                lane=self.lane_name,
                rank=self.ctx.rank,
                epoch=self.ctx.epoch,
                incarnation=self.ctx.incarnation,
                done=self.done.value(),
                host=self.host.handle,
                resync=resync,
            ),
        )

    @handles(Resync)
    def on_resync(self, msg: Resync) -> None:
        self.announce(resync=msg.epoch)

    def on_stop(self) -> None:
        super().on_stop()
        if self.host is not None:
            self.host.close()
            self.host = None

    @property
    def host_kv(self) -> torch.Tensor:
        assert self.host is not None
        return self.host.kv

    def admit(self, msg: SwapOp | StoreOp) -> bool:
        """Whether ``msg`` is the lane's next op; a repeat or a hole is answered here."""
        op, epoch = msg.op, msg.epoch
        order = self.order(op)
        if order == "next":
            return True
        if order == "repeat":
            kept = self.kept(op)
            self.log.warning(
                "lane.repeat", lane=str(self.lane), op=op, op_epoch=epoch, resent=kept is not None
            )
            # Without a kept completion, it went with the incarnation that did the op. Never
            # redo it: later ops of other lanes may already have relied on its watermark.
            self.send("engine", kept if kept is not None else self.lost_completion(msg))
            return False
        error = f"{self.lane} op {op} arrived when {self.done.value() + 1} is next"
        self.log.error("lane.refused", lane=str(self.lane), op=op, op_epoch=epoch, error=error)
        self.send("engine", self.report(op, epoch, "rejected", error=error))
        return False

    def lost_completion(self, msg: SwapOp | StoreOp) -> OpDone:
        """The completion of a done op whose report was lost in a restart. The watermark
        says the op finished, not how: it copied whole, or it failed (its destination
        spoiled), or it was cancelled as stale and copied nothing. Reported failed, so the
        engine relies on no block the op may not have filled: the cost is recomputation.
        (Reported "ok", a swap-out cancelled by a Worker restart that the engine had not
        heard of yet made the engine take an unfilled host block for a copy: found by the
        model checker, tests/modelcheck, mutant MUT_LOST_AS_OK.)"""
        return self.report(msg.op, msg.epoch, "failed", error=f"{LOST}: counted failed")

    def chaos(self) -> None:
        """transfer.chaos_delay_ms: hold the op a random while (debug: shakes the ordering)."""
        if self.chaos_s:
            time.sleep(self.rng.uniform(0, self.chaos_s))

    def report(self, op: int, epoch: int, status: OpStatus, **fields: Any) -> OpDone:
        return OpDone(
            lane=self.lane_name, op=op, epoch=epoch, rank=self.ctx.rank, status=status, **fields
        )

    def run(
        self,
        msg: SwapOp | StoreOp,
        problem: str,
        work: Callable[[], dict[str, Any]],
        *,
        failed_missing: int = 0,
        spoil: Callable[[], int] | None = None,
    ) -> None:
        """One admitted op: refuse it, or wait for its fence (cancel it if that will never
        come), hold it a chaos delay, do ``work``, and finish it with what work returned.
        If work raises, ``spoil`` fills what it was writing with NaN (see the module doc)
        and returns how many blocks that was."""
        if problem:
            self.finish(msg, "rejected", error=problem)
            return
        if stale := self.stale(msg.epoch):  # checked again once the fence is reached
            self.finish(msg, "cancelled", error=stale)
            return
        started = time.perf_counter_ns()
        try:
            seen = self.wait_fence(msg.op, msg.epoch, msg.fence)
        except Cancelled as e:
            self.finish(msg, "cancelled", error=e.reason)
            return
        self.chaos()
        waited = time.perf_counter_ns()
        self.begin_touches()
        try:
            with self.executing(op_range(self.lane_name, msg.op, msg.direction)):
                fields = work()
        except Exception as e:  # storage down, a bad copy: the lane moves on, the engine is told
            spoiled = 0 if spoil is None else spoil()  # raising, the lane dies: see the doc
            self.log.error(
                "lane.failed",
                lane=self.lane_name,
                op=msg.op,
                error=repr(e),
                spoiled=spoiled,
                exc_info=e,
            )
            missing = tuple(range(failed_missing))
            self.finish(msg, "failed", error=f"{type(e).__name__}: {e}", missing=missing)
            return
        done = time.perf_counter_ns()
        self.finish(msg, "ok", seen=seen, wait_ns=waited - started, copy_ns=done - waited, **fields)

    def finish(
        self,
        msg: SwapOp | StoreOp,
        status: OpStatus,
        *,
        seen: dict[Lane, int] | None = None,
        **fields: Any,
    ) -> None:
        """Advance the watermark past ``msg`` and report it (every status moves the lane on)."""
        self.ops += 1
        self.log_touches(msg.op, msg.epoch)
        seen = seen or {}
        fence = msg.fence
        self.log.info(
            "lane.done",
            lane=self.lane_name,
            op=msg.op,
            op_epoch=msg.epoch,
            status=status,
            direction=msg.direction,
            fence_step=fence.step,
            fence_swap=fence.swap,
            fence_store=fence.store,
            seen_step=seen.get(Lane.STEP),
            seen_swap=seen.get(Lane.SWAP),
            seen_store=seen.get(Lane.STORE),
            error=fields.get("error"),
            missing=fields.get("missing"),
            blocks=fields.get("blocks"),
            wait_ns=fields.get("wait_ns"),
            copy_ns=fields.get("copy_ns"),
        )
        self.complete(msg.op, self.report(msg.op, msg.epoch, status, **fields))
