"""The store lane: write-backs (host -> storage) and prefetches (storage -> host), in order.

A write-back refuses a host block that is all NaN (:class:`SpoiledBlock`): a failed op
upstream spoiled it, and no stored key may name garbage. A prefetch reports which of its
blocks storage did not have whole and valid (``missing``). See ``transfer.py`` for what
both lanes share.
"""

from __future__ import annotations

from typing import Any

import torch

from ringfence.actors.executors.transfer import TransferLane
from ringfence.actors.kv.copies import block_buffer
from ringfence.actors.kv.layout import block_fingerprint
from ringfence.actors.protocol.transfer import LOST, OpDone
from ringfence.cache.block_hash import DIGEST_SIZE
from ringfence.cache.fences import Lane
from ringfence.cache.ids import BlockHash
from ringfence.cache.storage import StorageBackend
from ringfence.cache.storage.registry import open_storage
from ringfence.runtime.actor import handles
from ringfence.sched.ops import StoreOp, SwapOp


class StoreLane(TransferLane):
    """Write-backs (host -> storage) and prefetches (storage -> host), in order."""

    lane = Lane.STORE
    lane_name = "store"

    def on_start(self) -> None:
        super().on_start()
        self.backend: StorageBackend | None = open_storage(
            self.config.cache.storage,
            fingerprint=block_fingerprint(self.config, rank=self.ctx.rank).digest(),
            run_dir=self.ctx.run_dir,
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
        engine recomputes them). A write-back's is reported failed (its keys are dropped)."""
        if not isinstance(msg, StoreOp) or msg.direction == "write":
            return super().lost_completion(msg)
        return self.report(
            msg.op, msg.epoch, "ok", missing=tuple(range(len(msg.host_blocks))),
            error=f"{LOST}: every block counts as missing",
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
        if self.touches is not None:
            self.touches.write("host", msg.host_blocks)
        return len(msg.host_blocks)

    def _store(self, msg: StoreOp, keys: list[BlockHash]) -> dict[str, Any]:
        assert self.backend is not None
        host = self.host_kv
        items = [(key, block_buffer(host, b)) for key, b in zip(keys, msg.host_blocks, strict=True)]
        missing: tuple[int, ...] = ()
        if msg.direction == "write":
            if self.touches is not None:
                self.touches.read("host", msg.host_blocks)
            refuse_spoiled(host, msg.host_blocks)
            self.backend.put_many(items)
        else:
            if self.touches is not None:
                self.touches.write("host", msg.host_blocks)
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
