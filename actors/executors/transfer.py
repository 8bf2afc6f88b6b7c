"""The Transfer actor's two lanes: ``swap`` (device <-> host) and ``store`` (host <-> storage).

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
on a GPU, where swaps run on the lane's own CUDA stream and complete on an event).
The swap lane learns the device tensor from the engine's :class:`DeviceTier` message
(after each WorkerReady); a swap op of an older epoch than the device tier's names
blocks of a reset tier and is cancelled, never copied.

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
from pathlib import Path
from typing import Any, ClassVar, Literal

import orjson
import torch

from ringfence.actors.executors.lanes import Cancelled, LaneExecutor
from ringfence.actors.kv.copies import block_buffer, copy_blocks
from ringfence.actors.kv.layout import block_fingerprint, kv_layout
from ringfence.actors.kv.space import SharedKV, create_kv, open_kv
from ringfence.actors.protocol.resync import Resync
from ringfence.actors.protocol.transfer import (
    TO_SWAP,
    DeviceTier,
    LaneReady,
    OpDone,
    OpStatus,
)
from ringfence.cache.block_hash import DIGEST_SIZE
from ringfence.cache.fences import Lane, Tier
from ringfence.cache.ids import BlockHash
from ringfence.cache.storage import StorageBackend, open_backend
from ringfence.runtime.actor import handles
from ringfence.runtime.manifest import write_atomic
from ringfence.sched.ops import StoreOp, SwapOp
from ringfence.shm.errors import ProtocolError
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
        """The completion of a done op whose report was lost in a restart. A copy either
        happened whole or the watermark would not say it is done."""
        return self.report(msg.op, msg.epoch, "ok", error="completion resent after a restart")

    def chaos(self) -> None:
        """transfer.chaos_delay_ms: hold the op a random while (debug: shakes the ordering)."""
        if self.chaos_s:
            time.sleep(self.rng.uniform(0, self.chaos_s))

    def report(self, op: int, epoch: int, status: OpStatus, **fields: Any) -> OpDone:
        return OpDone(lane=self.lane_name, op=op, epoch=epoch, status=status, **fields)

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
        try:
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


class SwapLane(TransferLane):
    """Swap-ins (host -> device) and swap-outs (device -> host), in order."""

    lane = Lane.SWAP
    lane_name = "swap"

    def on_start(self) -> None:
        super().on_start()
        self.device: SharedKV | None = None
        self.device_epoch = -1
        self.stream: Any = None  # a CUDA stream once the device tier is on a GPU
        self.registered = False
        run_dir = self.ctx.run_dir
        self._tier_file = None if run_dir is None else Path(run_dir) / f"swap-{self.ctx.rank}.tier"
        self._resume_tier()

    def on_stop(self) -> None:
        if self.device is not None:
            self.device.close()
            self.device = None
        if self.registered and self.host is not None:
            _cudart().cudaHostUnregister(self.host_kv.data_ptr())
            self.registered = False
        super().on_stop()

    @handles(DeviceTier)
    def on_device_tier(self, msg: DeviceTier) -> None:
        now = self.current_epoch()
        if msg.epoch > now:  # an engine stamps a tier with an epoch that has begun, never later
            raise ProtocolError(f"a device tier of epoch {msg.epoch}, ahead of the run's {now}")
        self._open_tier(msg)
        if self._tier_file is not None:  # kept for a restarted incarnation (see on_start)
            kind, payload = TO_SWAP.encode(msg)
            write_atomic(self._tier_file, orjson.dumps({"kind": kind, "payload": payload.decode()}))

    def _resume_tier(self) -> None:
        """Reopen the device tier the previous incarnation was given. Ops redelivered by the
        ring after a restart come before any new DeviceTier, so the lane must know it."""
        if self._tier_file is None or not self._tier_file.exists():
            return
        saved = orjson.loads(self._tier_file.read_bytes())
        msg = TO_SWAP.decode(saved["kind"], saved["payload"].encode())
        assert isinstance(msg, DeviceTier)
        try:
            self._open_tier(msg)
        except Exception as e:  # the worker that exported it is gone: wait for a new one
            self.log.warning("swap.tier_lost", tier_epoch=msg.epoch, error=repr(e))

    def _open_tier(self, msg: DeviceTier) -> None:
        device = open_kv(msg.kv)
        host = self.host_kv
        if device.kv.shape[1:] != host.shape[1:] or device.kv.dtype != host.dtype:
            device.close()
            raise ValueError(
                f"device blocks {tuple(msg.kv.layout.shape[1:])} {msg.kv.layout.dtype} differ "
                f"from host blocks {tuple(host.shape[1:])} {host.dtype}"
            )
        if self.device is not None:
            self.device.close()
        self.device, self.device_epoch = device, msg.epoch
        if device.kv.is_cuda:
            self._use_cuda(device.kv.device)
        self.log.info(
            "swap.tier",
            tier_epoch=msg.epoch,
            device=msg.kv.device,
            kv_shm=msg.kv.shm,
            num_blocks=msg.kv.layout.num_blocks,
        )

    def _use_cuda(self, device: torch.device) -> None:
        """Pin the host tier (page-locked, registered with CUDA) and make the lane's stream."""
        if not self.registered:
            host = self.host_kv
            nbytes = host.numel() * host.element_size()
            code = _cudart().cudaHostRegister(host.data_ptr(), nbytes, 0)
            if int(code) != 0:
                raise RuntimeError(f"cudaHostRegister of the host KV tier failed: {code}")
            self.registered = True
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    @handles(SwapOp)
    def on_swap(self, msg: SwapOp) -> None:
        if not self.admit(msg):
            return
        problem = self._problem(msg)
        if not problem and msg.epoch < self.device_epoch:
            error = (
                f"op of epoch {msg.epoch} names blocks of the device tier reset at epoch "
                f"{self.device_epoch}"
            )
            self.finish(msg, "cancelled", error=error)
            return
        self.run(
            msg,
            problem,
            lambda: {"blocks": len(msg.device_blocks), "bytes": self._copy(msg)},
            spoil=lambda: self._spoil(msg),
        )

    def _spoil(self, msg: SwapOp) -> int:
        """A swap that failed part way: its destination blocks hold NaN, not half a copy."""
        assert self.device is not None and self.host is not None
        if msg.direction == "in":
            self.device.poison(msg.device_blocks)
        else:
            self.host.poison(msg.host_blocks)
        return len(msg.host_blocks)

    def _problem(self, msg: SwapOp) -> str:
        if self.fence_problem(msg.fence):
            return self.fence_problem(msg.fence)
        if self.device is None:
            return "no device tier yet: DeviceTier must come before the first swap op"
        if len(msg.device_blocks) != len(msg.host_blocks):
            return f"{len(msg.device_blocks)} device blocks but {len(msg.host_blocks)} host blocks"
        for tier, ids, count in (
            ("device", msg.device_blocks, self.device.kv.shape[0]),
            ("host", msg.host_blocks, self.host_kv.shape[0]),
        ):
            bad = [b for b in ids if not 0 <= b < count]
            if bad:
                return f"{tier} block id {bad[0]} is outside the pool's {count} blocks"
        written = msg.device_blocks if msg.direction == "in" else msg.host_blocks
        if len(set(written)) != len(written):
            return "a destination block is written twice"
        return ""

    def _copy(self, msg: SwapOp) -> int:
        assert self.device is not None
        device, host = self.device.kv, self.host_kv
        if msg.direction == "in":
            src, src_ids, dst, dst_ids = host, msg.host_blocks, device, msg.device_blocks
        else:
            src, src_ids, dst, dst_ids = device, msg.device_blocks, host, msg.host_blocks
        if self.stream is None:
            return copy_blocks(src, src_ids, dst, dst_ids)
        with torch.cuda.stream(self.stream):
            copied = copy_blocks(src, src_ids, dst, dst_ids, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self.stream)
        done.synchronize()  # the copies have landed before swap_done says so
        return copied


class StoreLane(TransferLane):
    """Write-backs (host -> storage) and prefetches (storage -> host), in order."""

    lane = Lane.STORE
    lane_name = "store"

    def on_start(self) -> None:
        super().on_start()
        settings = self.config.cache.storage
        path = settings.path
        if settings.backend == "local" and not path and self.ctx.run_dir is not None:
            path = str(Path(self.ctx.run_dir) / "storage")
        self.backend: StorageBackend | None = open_backend(
            settings.backend,
            fingerprint=block_fingerprint(self.config).digest(),
            path=path,
            url=settings.url,
            max_bytes=settings.max_bytes,
            timeout_s=settings.timeout_s,
            log=self.log,
            require_server=False,  # down at launch: its ops fail (misses) until it is up
        )

    def on_stop(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        super().on_stop()

    def lost_completion(self, msg: SwapOp | StoreOp) -> OpDone:
        """Which blocks a prefetch found is lost with its report: all count as missing (the
        engine recomputes them). A write-back is whole once the watermark says done."""
        if not isinstance(msg, StoreOp) or msg.direction == "write":
            return super().lost_completion(msg)
        return self.report(
            msg.op, msg.epoch, "ok", missing=tuple(range(len(msg.host_blocks))),
            error="completion lost in a restart: every block counts as missing",
        )  # fmt: skip

    @handles(StoreOp)
    def on_store(self, msg: StoreOp) -> None:
        if not self.admit(msg):
            return
        keys, problem = self._keys(msg)
        self.run(
            msg,
            problem,
            lambda: self._store(msg, keys),
            failed_missing=len(keys),
            spoil=lambda: self._spoil(msg),
        )

    def _spoil(self, msg: StoreOp) -> int:
        """A prefetch that failed part way: its host blocks hold NaN (the engine counts them
        all missing). A write-back that failed wrote no key: nothing to spoil."""
        if msg.direction == "write":
            return 0
        assert self.host is not None
        self.host.poison(msg.host_blocks)
        return len(msg.host_blocks)

    def _store(self, msg: StoreOp, keys: list[BlockHash]) -> dict[str, Any]:
        assert self.backend is not None
        host = self.host_kv
        items = [(key, block_buffer(host, b)) for key, b in zip(keys, msg.host_blocks, strict=True)]
        missing: tuple[int, ...] = ()
        if msg.direction == "write":
            refuse_spoiled(host, msg.host_blocks)
            self.backend.put_many(items)
        else:
            hits = self.backend.get_into(items)
            missing = tuple(i for i, hit in enumerate(hits) if not hit)
            if missing and self.config.cache.poison_freed:  # what failed holds nothing usable
                host[[msg.host_blocks[i] for i in missing]] = float("nan")
        nbytes = len(keys) * host[0].numel() * host.element_size()
        return {"missing": missing, "blocks": len(keys), "bytes": nbytes}

    def _keys(self, msg: StoreOp) -> tuple[list[BlockHash], str]:
        if self.fence_problem(msg.fence):
            return [], self.fence_problem(msg.fence)
        if len(msg.keys) != len(msg.host_blocks):
            return [], f"{len(msg.host_blocks)} host blocks but {len(msg.keys)} keys"
        count = self.host_kv.shape[0]
        bad = [b for b in msg.host_blocks if not 0 <= b < count]
        if bad:
            return [], f"host block id {bad[0]} is outside the pool's {count} blocks"
        if msg.direction == "read" and len(set(msg.host_blocks)) != len(msg.host_blocks):
            return [], "a destination block is written twice"
        for key in msg.keys:
            if len(key) != DIGEST_SIZE:
                return [], f"key {key.hex()!r} is not {DIGEST_SIZE} bytes"
        return list(msg.keys), ""


class SpoiledBlock(ValueError):
    """A write-back found a block that is all NaN: a failed op upstream spoiled it (or,
    under ``cache.poison_freed``, the block was freed before it was read)."""


def refuse_spoiled(kv: torch.Tensor, blocks: tuple[int, ...]) -> None:
    """Raise :class:`SpoiledBlock` naming the first of ``blocks`` that is all NaN."""
    if not blocks:
        return
    spoiled = torch.isnan(kv[list(blocks)].flatten(1)).all(dim=1)
    if bool(spoiled.any()):
        bad = blocks[int(spoiled.nonzero()[0])]
        raise SpoiledBlock(
            f"host block {bad} is all NaN: the op that filled it failed, so it is not stored"
        )


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]
