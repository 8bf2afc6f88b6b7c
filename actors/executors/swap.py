"""The swap lane: swap-ins (host -> device) and swap-outs (device -> host), in order.

The lane learns the device tensor from the engine's :class:`DeviceTier` message (after
each WorkerReady); a swap op of an older epoch than the device tier's names blocks of a
reset tier and is cancelled, never copied. When the device tier is on a GPU, the host tier
is pinned (page-locked, registered with CUDA) and swaps run on the lane's own CUDA stream,
complete on an event before the watermark moves. See ``transfer.py`` for what both lanes
share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import torch

from ringfence.actors.executors.touches import Tier
from ringfence.actors.executors.transfer import TransferLane
from ringfence.actors.kv.copies import HOST_MAPPED, copy_blocks, resolve_copy
from ringfence.actors.kv.space import SharedKV, open_kv
from ringfence.actors.protocol.transfer import TO_SWAP, DeviceTier
from ringfence.cache.fences import Lane
from ringfence.runtime.actor import handles
from ringfence.runtime.manifest import write_atomic
from ringfence.sched.ops import SwapOp
from ringfence.shm.errors import ProtocolError


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
            _PINNED.discard(self.host_kv.data_ptr())
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
        """Pin the host tier (page-locked, registered with CUDA; for the block kernel also
        mapped into the device's address space), compile the kernel, make the lane's stream."""
        kernel = resolve_copy(self.config.transfer.copy, device) == "kernel"
        host = self.host_kv
        if not self.registered and host.data_ptr() not in _PINNED:
            nbytes, flags = host.numel() * host.element_size(), HOST_MAPPED if kernel else 0
            with torch.cuda.device(device):  # the mapping's device: the one the kernel runs on
                code = _cudart().cudaHostRegister(host.data_ptr(), nbytes, flags)
            if int(code) != 0:
                raise RuntimeError(f"cudaHostRegister of the host KV tier failed: {code}")
            _PINNED.add(host.data_ptr())
        self.registered = True
        if kernel:
            from ringfence.actors.kv.block_kernel import compile_for  # imports Triton

            compile_for(host, device)
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
        if self.touches is not None:
            self.touches.write(*self._ends(msg)[1])
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

    @staticmethod
    def _ends(msg: SwapOp) -> tuple[tuple[Tier, tuple[int, ...]], tuple[Tier, tuple[int, ...]]]:
        """(tier, blocks) of the op's source and of its destination."""
        device: tuple[Tier, tuple[int, ...]] = ("device", msg.device_blocks)
        host: tuple[Tier, tuple[int, ...]] = ("host", msg.host_blocks)
        return (host, device) if msg.direction == "in" else (device, host)

    def _copy(self, msg: SwapOp) -> int:
        assert self.device is not None
        tensors = {"device": self.device.kv, "host": self.host_kv}
        (src_tier, src_ids), (dst_tier, dst_ids) = self._ends(msg)
        src, dst = tensors[src_tier], tensors[dst_tier]
        if self.touches is not None:
            self.touches.read(src_tier, src_ids)
            self.touches.write(dst_tier, dst_ids)
        method = resolve_copy(self.config.transfer.copy, self.device.kv.device)
        if self.stream is None:
            return copy_blocks(src, src_ids, dst, dst_ids, method=method)
        with torch.cuda.stream(self.stream):
            copied = copy_blocks(src, src_ids, dst, dst_ids, non_blocking=True, method=method)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self.stream)
        done.synchronize()  # the copies have landed before swap_done says so
        return copied


# The host tiers this process registered with CUDA, by address. A registration belongs to
# the process: a hosted lane (runtime/hosting.py) that failed never ran on_stop, and its next
# incarnation, on a thread of the same process, finds its mapping of the same segment there.
_PINNED: set[int] = set()


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]
