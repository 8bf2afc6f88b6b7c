"""The Transfer actor's two lanes: swap (device <-> host) and store (host <-> storage).

Each lane runs in a thread of the test process on a real driver, with shared-memory
watermarks and a real shared-memory host tier; the test plays the Engine (posting
ops, reading completions), the Worker (owning the device tier, advancing step_done)
and, for the store lane, the swap lane (filling host blocks, then advancing
swap_done), ringing the lane like the real writers do. Every copy is checked
bitwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
import pytest
import torch
from lane_rig import WAIT_S, Executor, start_executor

from ringfence.actors.config import Config
from ringfence.actors.executors import swap as swap_module
from ringfence.actors.executors.legacy import lock_path
from ringfence.actors.executors.store import StoreLane
from ringfence.actors.executors.swap import SwapLane
from ringfence.actors.executors.transfer import TransferLane
from ringfence.actors.kv.layout import block_fingerprint, kv_layout
from ringfence.actors.kv.space import SharedKV, create_kv, open_kv
from ringfence.actors.model.kernels import triton_available
from ringfence.actors.protocol.lanes import ISSUER_EPOCH, TIER_EPOCH, epoch_counter, lane_counter
from ringfence.actors.protocol.transfer import (
    FROM_TRANSFER,
    LOST,
    TO_STORE,
    TO_SWAP,
    DeviceTier,
    LaneReady,
    OpDone,
)
from ringfence.actors.tools.testing.redis_server import free_port
from ringfence.cache.fences import NO_WAIT, Fence, Lane, Tier
from ringfence.cache.ids import BlockHash, Seq
from ringfence.runtime.driver import Driver
from ringfence.runtime.mailbox import ConditionWaiter, LocalInbox, Mailbox
from ringfence.sched.ops import StoreOp, SwapOp
from ringfence.shm import names
from ringfence.shm.counter import CounterBlock, Watermark

BLOCKS = 16  # blocks in the device pool and in the host pool
SETTINGS = (
    "model.preset=tiny",
    "model.dtype=float64",
    "cache.block_size=4",
    f"cache.device_blocks={BLOCKS}",
    f"cache.host_blocks={BLOCKS}",
    "runtime.heartbeat_s=0.05",
    "runtime.heartbeat_timeout_s=0.6",  # a fence wait gives up (and is retried) after 0.3 s
)


@dataclass
class Rig:
    """A running swap-0 or store-0 lane and the test's ends of its protocol."""

    driver: Driver
    ops: LocalInbox  # engine -> lane
    replies: LocalInbox  # lane -> engine
    replies_box: Mailbox
    waiter: ConditionWaiter  # the lane's own waiter: what a watermark it waits on rings
    lanes: CounterBlock
    control: CounterBlock
    log_path: Path
    ready: LaneReady
    host: SharedKV
    storage: Path | None = None
    device: SharedKV | None = None
    seen: list[object] = field(default_factory=list)
    rank: int = 0
    config: Config | None = None  # the lane's

    @property
    def lane(self) -> TransferLane:
        actor = self.driver.actor
        assert isinstance(actor, TransferLane)
        return actor

    @property
    def host_kv(self) -> torch.Tensor:
        return self.host.kv

    @property
    def device_kv(self) -> torch.Tensor:
        assert self.device is not None
        return self.device.kv

    def mark(self, lane: Lane, rank: int | None = None) -> Watermark:
        return lane_counter(self.lanes, self.rank if rank is None else rank, lane)

    def issuer_epoch(self) -> Watermark:
        """Play a restarted engine: the writer of ``issuer_epoch``."""
        mark = epoch_counter(self.lanes, 0, ISSUER_EPOCH)
        mark.claim()
        return mark

    def play(self, lane: Lane, rank: int | None = None) -> Watermark:
        """Become the writer of ``lane``'s watermark (of the lane's rank, or ``rank``'s),
        ringing the lane under test on advance."""
        mark = self.mark(lane, rank)
        mark.claim(notify=[self.waiter])
        return mark

    def post(self, msg: object) -> None:
        self.ops.post(msg)

    def next_message(self, timeout: float = WAIT_S) -> object:
        assert self.replies_box.waiter.wait_until(self.replies.pending, timeout), "no reply"
        delivery = self.replies.read()
        assert delivery is not None
        self.seen.append(delivery.msg)
        return delivery.msg

    def done(self, op: int, timeout: float = WAIT_S) -> OpDone:
        msg = self.next_message(timeout)
        assert isinstance(msg, OpDone), msg
        assert msg.op == op, msg
        return msg

    def run(self, msg: SwapOp | StoreOp) -> OpDone:
        self.post(msg)
        return self.done(msg.op)

    def give_device_tier(self, epoch: int = 0) -> None:
        """Play the Worker: make the device tier and tell the swap lane of it."""
        run_id = self.driver.ctx.run_id
        if self.device is None:
            layout = kv_layout(self.lane.config, Tier.DEVICE)
            name = names.posix_name(run_id, f"kv.device.{self.rank}")
            self.device = create_kv(layout, "cpu", shm_name=name)
        self.post(DeviceTier(epoch=epoch, kv=self.device.handle))

    def events(self, name: str) -> list[dict[str, Any]]:
        self.driver.log.flush()
        lines = [orjson.loads(line) for line in self.log_path.read_bytes().splitlines()]
        return [line for line in lines if line["event"] == name]


@pytest.fixture
def make_lane(tmp_path: Path, run_id: str) -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []
    made: list[Executor] = []

    def make(
        lane_cls: type[TransferLane],
        *overrides: str,
        device: bool = True,
        rank: int = 0,
        run_dir: Path | None = None,
    ) -> Rig:
        name = lane_cls.lane_name
        storage = tmp_path / "storage" if lane_cls is StoreLane else None
        extra = ("cache.storage.backend=local", f"cache.storage.path={storage}") if storage else ()
        ranks = (f"parallel.tp_size={rank + 1}",) if rank else ()
        config: Config = Config.load(None, [*SETTINGS, *extra, *ranks, *overrides])
        registry = TO_SWAP if lane_cls is SwapLane else TO_STORE
        ex = start_executor(
            lane_cls, name, config=config, run_id=run_id, log_dir=tmp_path,
            inbox=registry, replies=FROM_TRANSFER, rank=rank, run_dir=run_dir,
        )  # fmt: skip
        made.append(ex)
        ready = ex.next_reply()
        assert isinstance(ready, LaneReady), ready
        assert (ready.lane, ready.rank, ready.done) == (name, rank, 0)
        assert ready.host.shm == names.posix_name(run_id, f"kv.host.{rank}")
        rig = Rig(
            ex.driver, ex.inbox, ex.replies, ex.replies_box, ex.waiter, ex.lanes, ex.control,
            ex.log_path, ready, host=open_kv(ready.host), storage=storage, rank=rank,
            config=config,
        )  # fmt: skip
        rigs.append(rig)
        if lane_cls is SwapLane and device:
            rig.give_device_tier()
        return rig

    yield make
    for ex in made:
        ex.stop()
    for rig in rigs:
        rig.host.close()
        if rig.device is not None:
            rig.device.close()
    names.clean_run(run_id)


def bits(kv: torch.Tensor) -> torch.Tensor:
    return kv.view(torch.int64).clone()  # NaN-safe bitwise equality


def pattern(kv: torch.Tensor, seed: int) -> torch.Tensor:
    """Distinct contents for one block: no two seeds give equal elements."""
    one = kv[0]
    return (torch.arange(one.numel(), dtype=kv.dtype) + seed * 1e6 + 0.5).view(one.shape)


def fill(kv: torch.Tensor, blocks: tuple[int, ...], seed: int) -> None:
    for i, b in enumerate(blocks):
        kv[b] = pattern(kv, seed + i)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(bits(a), bits(b))


def key(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(16, "big"))


def stored_files(root: Path | None) -> list[str]:
    assert root is not None
    return sorted(p.name for p in root.rglob("*") if p.is_file())


def swap(
    op: int,
    direction: Literal["in", "out"],
    device: tuple[int, ...],
    host: tuple[int, ...],
    *,
    epoch: int = 0,
    fence: Fence = NO_WAIT,
) -> SwapOp:
    return SwapOp(
        op=op, epoch=epoch, fence=fence, direction=direction, device_blocks=device,
        host_blocks=host, reason="admit",
    )  # fmt: skip


def store(
    op: int,
    direction: Literal["write", "read"],
    host: tuple[int, ...],
    keys: tuple[BlockHash, ...],
    *,
    epoch: int = 0,
    fence: Fence = NO_WAIT,
) -> StoreOp:
    return StoreOp(
        op=op, epoch=epoch, fence=fence, direction=direction, host_blocks=host, keys=keys,
        reason="admit",
    )  # fmt: skip


BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 8  # tiny: layers, k/v, block_size, kv_heads, head_dim, f64


# 1. Swaps copy bitwise.


def test_a_swap_out_then_a_swap_in_copy_scattered_and_consecutive_blocks_bitwise(
    make_lane,
) -> None:
    rig = make_lane(SwapLane)
    dev, host = rig.device_kv, rig.host_kv
    out_dev, out_host = (3, 4, 5, 9), (7, 8, 2, 11)
    fill(dev, tuple(range(BLOCKS)), seed=1)
    saved = dev[list(out_dev)].clone()
    host_before = bits(host)

    done = rig.run(swap(1, "out", out_dev, out_host))
    assert (done.lane, done.op, done.epoch, done.status, done.error) == ("swap", 1, 0, "ok", "")
    assert (done.blocks, done.bytes) == (4, 4 * BLOCK_BYTES)
    assert rig.mark(Lane.SWAP).value() == 1
    assert same(host[list(out_host)], saved)
    untouched = [b for b in range(BLOCKS) if b not in out_host]
    assert torch.equal(bits(host)[untouched], host_before[untouched])

    dev[list(out_dev)] = float("nan")  # the blocks are freed (poisoned) and reused
    dev[list(out_dev)] += 1.0
    in_dev = (12, 13, 0, 15)
    dev_before = bits(dev)
    done = rig.run(swap(2, "in", in_dev, out_host))
    assert (done.lane, done.op, done.status) == ("swap", 2, "ok")
    assert (done.blocks, done.bytes) == (4, 4 * BLOCK_BYTES)
    assert rig.mark(Lane.SWAP).value() == 2
    assert same(dev[list(in_dev)], saved)
    untouched = [b for b in range(BLOCKS) if b not in in_dev]
    assert torch.equal(bits(dev)[untouched], dev_before[untouched])
    assert [e["op"] for e in rig.events("lane.done")] == [1, 2]


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed (the test extra)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton is compiled here, not interpreted")
def test_with_the_block_kernel_a_swap_out_then_a_swap_in_copy_scattered_blocks_bitwise(
    make_lane,
) -> None:
    """transfer.copy=kernel on the CPU: one launch in Triton's interpreter per swap."""
    rig = make_lane(SwapLane, "transfer.copy=kernel")
    dev, host = rig.device_kv, rig.host_kv
    fill(dev, tuple(range(BLOCKS)), seed=1)
    saved = dev[[3, 4, 5, 9]].clone()
    host_before = bits(host)
    done = rig.run(swap(1, "out", (3, 4, 5, 9), (7, 8, 2, 11)))
    assert (done.status, done.blocks, done.bytes) == ("ok", 4, 4 * BLOCK_BYTES), done
    assert same(host[[7, 8, 2, 11]], saved)
    untouched = [b for b in range(BLOCKS) if b not in (7, 8, 2, 11)]
    assert torch.equal(bits(host)[untouched], host_before[untouched])
    done = rig.run(swap(2, "in", (12, 13, 0, 15), (7, 8, 2, 11)))
    assert (done.status, done.blocks, done.bytes) == ("ok", 4, 4 * BLOCK_BYTES), done
    assert same(dev[[12, 13, 0, 15]], saved)


def test_the_block_kernel_where_it_cannot_run_fails_the_swap_naming_the_setting(
    make_lane, monkeypatch
) -> None:
    """The launch's preflight refuses it first (actors/preflight.py); a lane that meets it
    anyway fails each swap, spoiled, with the setting in the error."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rig = make_lane(SwapLane, "transfer.copy=kernel")
    done = rig.run(swap(1, "out", (3,), (7,)))
    assert done.status == "failed" and "transfer.copy is 'kernel'" in done.error, done
    assert bool(torch.isnan(rig.host_kv[7]).all())


# 2. I2: a swap-out reads a device block only after the step that wrote it.


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "unfenced"])
def test_a_swap_out_reads_device_blocks_only_after_the_step_watermark_reaches_its_fence(
    make_lane, fenced: bool
) -> None:
    rig = make_lane(SwapLane, f"transfer.skip_fences={str(not fenced).lower()}")
    step = rig.play(Lane.STEP)
    step.advance(1)
    dev, host = rig.device_kv, rig.host_kv
    blocks, to = (2, 3, 4, 10), (5, 6, 7, 1)
    fill(dev, blocks, seed=10)  # what step 1 left
    old = dev[list(blocks)].clone()
    fill(dev, blocks, seed=20)
    final = dev[list(blocks)].clone()
    dev[list(blocks)] = old

    def step_2() -> None:  # play the Worker: step 2 writes the blocks, then is done
        dev[list(blocks)] = final
        step.advance(2)

    worker = threading.Timer(0.2, step_2)
    worker.start()
    try:
        done = rig.run(swap(1, "out", blocks, to, fence=Fence(step=Seq(2))))
    finally:
        worker.join(WAIT_S)
    assert done.status == "ok", done
    if fenced:
        assert same(host[list(to)], final)
        assert done.wait_ns > 0
        [line] = rig.events("lane.done")
        assert line["fence_step"] == 2 and line["seen_step"] >= 2
    else:  # it copied what the step had not yet written
        assert same(host[list(to)], old)


def test_a_lane_of_rank_1_waits_on_rank_1s_step_watermark_not_on_rank_0s(make_lane) -> None:
    """docs/design.md, "Ranks (tensor parallelism)": rank r's executors wait only on rank
    r's watermarks. Rank 0's step 2 is done at once; rank 1's only later, after it wrote the
    blocks: a lane that read rank 0's watermark would copy what rank 1's step 2 had not yet
    written."""
    rig = make_lane(SwapLane, rank=1)
    mine, other = rig.play(Lane.STEP), rig.play(Lane.STEP, rank=0)
    mine.advance(1)
    other.advance(2)
    dev, host = rig.device_kv, rig.host_kv
    blocks, to = (2, 3), (5, 6)
    fill(dev, blocks, seed=10)
    final = pattern(dev, 99)

    def step_2() -> None:  # play rank 1's Worker: step 2 writes the blocks, then is done
        dev[list(blocks)] = final
        mine.advance(2)

    worker = threading.Timer(0.3, step_2)
    worker.start()
    try:
        done = rig.run(swap(1, "out", blocks, to, fence=Fence(step=Seq(2))))
    finally:
        worker.join(WAIT_S)
    assert done.status == "ok" and done.rank == 1, done
    assert same(host[list(to)], final.expand(len(to), *final.shape))
    [line] = rig.events("lane.done")
    assert line["rank"] == 1 and line["seen_step"] == 2


# 3. I4: a write-back reads a host block only after the swap-out that fills it.


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "unfenced"])
def test_a_write_back_waits_for_the_swap_out_that_fills_its_blocks_and_a_prefetch_reads_them(
    make_lane, fenced: bool
) -> None:
    rig = make_lane(StoreLane, f"transfer.skip_fences={str(not fenced).lower()}")
    swapped = rig.play(Lane.SWAP)
    host = rig.host_kv
    blocks, keys = (2, 3, 9), (key(0xA1), key(0xA2), key(0xA3))
    fill(host, blocks, seed=30)
    old = host[list(blocks)].clone()
    fill(host, blocks, seed=40)
    final = host[list(blocks)].clone()
    host[list(blocks)] = old

    def swap_out() -> None:  # play the swap lane: copy into the host blocks, then publish
        host[list(blocks)] = final
        swapped.advance(4)

    swapper = threading.Timer(0.2, swap_out)
    swapper.start()
    try:
        done = rig.run(store(1, "write", blocks, keys, fence=Fence(swap=Seq(4))))
    finally:
        swapper.join(WAIT_S)
    assert (done.lane, done.op, done.status, done.missing) == ("store", 1, "ok", ())
    assert (done.blocks, done.bytes) == (3, 3 * BLOCK_BYTES)
    assert rig.mark(Lane.STORE).value() == 1
    assert len(stored_files(rig.storage)) == 3

    into = (12, 13, 14)
    host[list(into)] = float("nan")
    done = rig.run(store(2, "read", into, keys))
    assert (done.op, done.status, done.missing) == (2, "ok", ())
    assert rig.mark(Lane.STORE).value() == 2
    if fenced:
        assert same(host[list(into)], final)
        line = next(e for e in rig.events("lane.done") if e["op"] == 1)
        assert line["fence_swap"] == 4 and line["seen_swap"] >= 4
    else:  # it wrote back what the swap-out had not yet copied
        assert same(host[list(into)], old)


# 4. Prefetch misses.


@pytest.mark.parametrize("poison", [True, False], ids=["poison", "no-poison"])
def test_a_prefetch_of_keys_never_written_lists_their_positions_as_missing(
    make_lane, poison: bool
) -> None:
    rig = make_lane(StoreLane, f"cache.poison_freed={str(poison).lower()}")
    host = rig.host_kv
    fill(host, (0, 1), seed=50)
    written = host[[0, 1]].clone()
    assert rig.run(store(1, "write", (0, 1), (key(1), key(2)))).status == "ok"

    into = (4, 5, 6, 7)
    fill(host, into, seed=60)
    before = host[list(into)].clone()
    done = rig.run(store(2, "read", into, (key(1), key(0xDEAD), key(2), key(0xBEEF))))
    assert (done.status, done.missing, done.blocks) == ("ok", (1, 3), 4)
    assert same(host[[4, 6]], written)
    if poison:
        assert bool(torch.isnan(host[[5, 7]]).all())
    else:
        assert same(host[[5, 7]], before[[1, 3]])
    [line] = [e for e in rig.events("lane.done") if e["op"] == 2]
    assert line["missing"] == [1, 3]


def test_a_corrupt_stored_blob_reads_as_missing_and_is_poisoned(make_lane) -> None:
    rig = make_lane(StoreLane, "cache.poison_freed=true")
    host = rig.host_kv
    fill(host, (0, 1), seed=70)
    good = host[1].clone()
    assert rig.run(store(1, "write", (0, 1), (key(0x51), key(0x52)))).status == "ok"
    assert rig.storage is not None and rig.config is not None
    rank_dir = rig.storage / block_fingerprint(rig.config, rank=0).digest().hex()
    path = rank_dir / key(0x51).hex()[:2] / key(0x51).hex()
    assert path.is_file(), stored_files(rig.storage)
    with open(path, "r+b") as f:  # flip one payload byte
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x40]))

    done = rig.run(store(2, "read", (8, 9), (key(0x51), key(0x52))))
    assert (done.status, done.missing) == ("ok", (0,))
    assert bool(torch.isnan(host[8]).all()), "a corrupt blob's bytes reached the host tier"
    assert same(host[9], good)
    assert not path.exists(), "the corrupt blob was kept"


# 4b. Failed ops spoil what they were writing (NaN), and no write-back stores a spoiled block.

GARBAGE = 31337.5  # finite: what a copy that broke part way could leave behind


@pytest.mark.parametrize("direction", ["in", "out"])
def test_a_swap_copy_that_raises_fills_its_destination_with_nan_and_reports_failed(
    make_lane, monkeypatch, direction: Literal["in", "out"]
) -> None:
    rig = make_lane(SwapLane)
    dev, host = rig.device_kv, rig.host_kv
    fill(dev, tuple(range(BLOCKS)), seed=1)
    fill(host, tuple(range(BLOCKS)), seed=100)

    def broken(src, src_ids, dst, dst_ids, **_: Any) -> int:
        dst[list(dst_ids)] = GARBAGE  # part of it landed, as garbage
        raise OSError("the copy broke part way")

    monkeypatch.setattr(swap_module, "copy_blocks", broken)
    written, kv = ((3, 4), dev) if direction == "in" else ((7, 8), host)
    before = bits(kv)
    done = rig.run(swap(1, direction, (3, 4), (7, 8)))
    assert (done.status, done.op) == ("failed", 1) and "the copy broke" in done.error, done
    assert rig.mark(Lane.SWAP).value() == 1  # the lane moved on
    assert bool(torch.isnan(kv[list(written)]).all()), "a failed swap left garbage that reads valid"
    others = [b for b in range(BLOCKS) if b not in written]
    assert torch.equal(bits(kv)[others], before[others])
    (failed,) = rig.events("lane.failed")
    assert (failed["op"], failed["spoiled"]) == (1, 2)


def test_a_write_back_of_a_spoiled_block_fails_naming_it_and_stores_nothing(make_lane) -> None:
    rig = make_lane(StoreLane)
    host = rig.host_kv
    fill(host, (2, 3), seed=50)
    host[3] = float("nan")  # what a failed swap-out leaves: the whole block
    done = rig.run(store(1, "write", (2, 3), (key(0x61), key(0x62))))
    assert done.status == "failed" and "host block 3 is all NaN" in done.error, done
    assert stored_files(rig.storage) == [], "a spoiled block was stored under a valid key"
    fill(host, (3,), seed=51)
    host[3].view(-1)[17:40] = float("nan")  # data: a partial block's unused slots, poisoned
    done = rig.run(store(2, "write", (2, 3), (key(0x61), key(0x62))))
    assert done.status == "ok" and len(stored_files(rig.storage)) == 2, done


def test_a_prefetch_whose_read_raises_fills_its_host_blocks_with_nan(
    make_lane, monkeypatch
) -> None:
    rig = make_lane(StoreLane)
    host = rig.host_kv
    fill(host, (1, 5, 6), seed=60)
    assert rig.run(store(1, "write", (1,), (key(0x71),))).status == "ok"
    backend = rig.lane.backend
    assert backend is not None

    def broken(items) -> list[bool]:
        for _, buffer in items:
            memoryview(buffer).cast("B")[:8] = b"\x01" * 8  # half a read
        raise OSError("the storage server went away mid-read")

    monkeypatch.setattr(backend, "get_into", broken)
    kept = host[1].clone()
    done = rig.run(store(2, "read", (5, 6), (key(0x71), key(0x72))))
    assert done.status == "failed" and done.missing == (0, 1), done
    assert bool(torch.isnan(host[[5, 6]]).all())
    assert same(host[1], kept)


def test_a_store_lane_whose_redis_is_down_at_launch_starts_and_fails_its_ops_as_misses(
    make_lane,
) -> None:
    pytest.importorskip("redis")
    url = f"redis://127.0.0.1:{free_port()}/0"
    rig = make_lane(StoreLane, "cache.storage.backend=redis", f"cache.storage.url={url}")
    fill(rig.host_kv, (1,), seed=80)
    done = rig.run(store(1, "write", (1,), (key(0x81),)))
    assert done.status == "failed" and "StorageUnavailable" in done.error, done
    done = rig.run(store(2, "read", (4, 5), (key(0x81), key(0x82))))
    assert (done.status, done.missing) == ("failed", (0, 1)), done
    assert bool(torch.isnan(rig.host_kv[[4, 5]]).all())
    (down,) = rig.events("storage.unreachable")
    assert down["where"] == f"127.0.0.1:{url.rpartition(':')[2].partition('/')[0]}"


# 5. Malformed ops.

SWAP_MALFORMED = [
    pytest.param(swap(1, "out", (1, 2), (3,)), "2 device blocks but 1 host blocks", id="lengths"),
    pytest.param(swap(1, "out", (BLOCKS,), (3,)), f"device block id {BLOCKS}", id="device-id"),
    pytest.param(swap(1, "in", (-1,), (3,)), "device block id -1", id="negative-device-id"),
    pytest.param(swap(1, "out", (1,), (BLOCKS + 4,)), f"host block id {BLOCKS + 4}", id="host-id"),
    pytest.param(swap(1, "out", (1, 2), (5, 5)), "written twice", id="host-written-twice"),
    pytest.param(swap(1, "in", (5, 5), (1, 2)), "written twice", id="device-written-twice"),
    pytest.param(
        swap(1, "out", (1,), (2,), fence=Fence(swap=Seq(1))), "own lane", id="own-lane-fence",
    ),
]  # fmt: skip

STORE_MALFORMED = [
    pytest.param(store(1, "write", (1, 2), (key(1),)), "2 host blocks but 1 keys", id="lengths"),
    pytest.param(store(1, "read", (BLOCKS,), (key(1),)), f"host block id {BLOCKS}", id="host-id"),
    pytest.param(store(1, "write", (-2,), (key(1),)), "host block id -2", id="negative-host-id"),
    pytest.param(store(1, "read", (4, 4), (key(1), key(2))), "written twice", id="written-twice"),
    # A key that is not hex never reaches the lane: the codec refuses the frame (test_codec).
    pytest.param(store(1, "write", (1,), (BlockHash(b"\xab" * 8),)), "not 16 bytes",
                 id="key-short"),
    pytest.param(store(1, "read", (1,), (BlockHash(b"\xab" * 17),)), "not 16 bytes",
                 id="key-long"),
    pytest.param(
        store(1, "write", (1,), (key(1),), fence=Fence(store=Seq(1))), "own lane",
        id="own-lane-fence",
    ),
]  # fmt: skip

REJECT_S = 2.0  # a rejection is immediate; a lane that sends none fails the test quickly


@pytest.mark.parametrize(("op", "message"), SWAP_MALFORMED)
def test_a_malformed_swap_op_is_rejected_naming_the_problem_and_touches_no_block(
    make_lane, op: SwapOp, message: str
) -> None:
    rig = make_lane(SwapLane)
    fill(rig.device_kv, tuple(range(BLOCKS)), seed=80)
    fill(rig.host_kv, tuple(range(BLOCKS)), seed=90)
    dev_before, host_before = bits(rig.device_kv), bits(rig.host_kv)
    rig.post(op)
    done = rig.done(1, REJECT_S)
    assert done.status == "rejected" and message in done.error, done.error
    assert torch.equal(bits(rig.device_kv), dev_before)
    assert torch.equal(bits(rig.host_kv), host_before)
    # Rejected is done: the lane moves on to op 2.
    assert rig.mark(Lane.SWAP).value() == 1
    assert rig.run(swap(2, "out", (1,), (2,))).status == "ok"
    assert same(rig.host_kv[2], rig.device_kv[1])


@pytest.mark.parametrize(("op", "message"), STORE_MALFORMED)
def test_a_malformed_store_op_is_rejected_naming_the_problem_and_touches_nothing(
    make_lane, op: StoreOp, message: str
) -> None:
    rig = make_lane(StoreLane)
    fill(rig.host_kv, tuple(range(BLOCKS)), seed=100)
    host_before = bits(rig.host_kv)
    rig.post(op)
    done = rig.done(1, REJECT_S)
    assert done.status == "rejected" and message in done.error, done.error
    assert torch.equal(bits(rig.host_kv), host_before)
    assert stored_files(rig.storage) == []
    assert rig.mark(Lane.STORE).value() == 1
    assert rig.run(store(2, "write", (1,), (key(1),))).status == "ok"
    assert stored_files(rig.storage) == [key(1).hex()]


def test_a_swap_op_before_any_device_tier_is_rejected(make_lane) -> None:
    rig = make_lane(SwapLane, device=False)
    host_before = bits(rig.host_kv)
    done = rig.run(swap(1, "in", (1,), (2,)))
    assert done.status == "rejected" and "no device tier yet" in done.error, done.error
    assert torch.equal(bits(rig.host_kv), host_before)
    assert rig.mark(Lane.SWAP).value() == 1
    rig.give_device_tier()
    fill(rig.device_kv, (1,), seed=110)
    assert rig.run(swap(2, "out", (1,), (2,))).status == "ok"
    assert same(rig.host_kv[2], rig.device_kv[1])


# 6. Lane order: holes, repeats, completions lost in a restart.


def test_a_swap_op_past_the_next_is_refused_and_the_watermark_stays(make_lane) -> None:
    rig = make_lane(SwapLane)
    host_before = bits(rig.host_kv)
    done = rig.run(swap(3, "out", (1,), (2,)))
    assert done.status == "rejected" and "op 3 arrived when 1 is next" in done.error, done
    assert rig.mark(Lane.SWAP).value() == 0
    assert torch.equal(bits(rig.host_kv), host_before)
    [line] = rig.events("lane.refused")
    assert line["op"] == 3
    assert rig.run(swap(1, "out", (1,), (2,))).status == "ok"


def test_a_repeated_swap_op_gets_the_kept_completion_and_is_not_copied_again(make_lane) -> None:
    rig = make_lane(SwapLane)
    dev, host = rig.device_kv, rig.host_kv
    fill(dev, (6,), seed=120)
    copied = dev[6].clone()
    op = swap(1, "out", (6,), (3,))
    first = rig.run(op)
    assert first.status == "ok"
    fill(dev, (6,), seed=130)  # a later step rewrote the block: a redo would copy this
    rig.post(op)
    assert rig.done(1) == first
    assert same(host[3], copied)
    assert rig.mark(Lane.SWAP).value() == 1 and rig.lane.ops == 1
    # Its completion went with the incarnation that did it: a report, no redo. How the op
    # ended went with it too, so the report says failed (the engine recomputes).
    rig.lane.last = None
    rig.post(op)
    lost = rig.done(1)
    assert lost.status == "failed" and lost.error.startswith(LOST), lost
    assert same(host[3], copied)
    assert rig.lane.ops == 1
    assert [e["resent"] for e in rig.events("lane.repeat")] == [True, False]


def test_a_repeated_prefetch_without_its_kept_completion_reports_every_block_missing(
    make_lane,
) -> None:
    rig = make_lane(StoreLane)
    host = rig.host_kv
    fill(host, (0, 1), seed=140)
    assert rig.run(store(1, "write", (0, 1), (key(7), key(8)))).status == "ok"
    prefetch = store(2, "read", (4, 5, 6), (key(7), key(8), key(9)))
    first = rig.run(prefetch)
    assert (first.status, first.missing) == ("ok", (2,))
    rig.post(prefetch)
    assert rig.done(2) == first
    rig.lane.last = None
    rig.post(prefetch)
    lost = rig.done(2)
    assert (lost.status, lost.missing) == ("ok", (0, 1, 2)), lost
    assert "restart" in lost.error
    assert rig.mark(Lane.STORE).value() == 2 and rig.lane.ops == 2
    # A repeated write-back may have failed before the restart: resent as failed (its keys
    # are dropped by the engine, which never counts on a block it may not have stored).
    rig.post(store(1, "write", (0, 1), (key(7), key(8))))
    resent = rig.done(1)
    assert (resent.status, resent.missing) == ("failed", ()), resent
    assert resent.error.startswith(LOST)


# 7. Epochs of the device tier.


def test_a_swap_op_older_than_the_device_tier_is_cancelled_without_copying(make_lane) -> None:
    rig = make_lane(SwapLane, device=False)
    run_epoch = rig.control[0]  # two restarts later (a tier is never ahead of the run)
    run_epoch.claim()
    run_epoch.advance(2)
    rig.give_device_tier(epoch=2)
    dev, host = rig.device_kv, rig.host_kv
    fill(dev, tuple(range(BLOCKS)), seed=150)
    fill(host, tuple(range(BLOCKS)), seed=160)
    dev_before, host_before = bits(dev), bits(host)
    done = rig.run(swap(1, "out", (1, 2), (3, 4), epoch=1))
    assert done.status == "cancelled" and "epoch 1" in done.error and "2" in done.error, done
    done = rig.run(swap(2, "in", (5,), (6,), epoch=1))
    assert done.status == "cancelled"
    assert torch.equal(bits(dev), dev_before) and torch.equal(bits(host), host_before)
    assert rig.mark(Lane.SWAP).value() == 2
    done = rig.run(swap(3, "out", (1,), (3,), epoch=2))
    assert done.status == "ok"
    assert same(host[3], dev[1])


def test_a_cancelled_swap_out_whose_completion_was_lost_is_resent_failed_never_ok(
    make_lane,
) -> None:
    """The model checker's counterexample (tests/modelcheck, MUT_LOST_AS_OK): a swap-out
    cancelled as stale by a Worker restart, its lane crashed before reporting it, and the
    resent report said ok; an engine that had not heard of the restart yet took the host
    block for a copy of the device block, and a later write-back stored what it held."""
    rig = make_lane(SwapLane, device=False)
    run_epoch = rig.control[0]
    run_epoch.claim()
    run_epoch.advance(2)
    rig.give_device_tier(epoch=2)
    fill(rig.host_kv, (3,), seed=170)
    host_before = bits(rig.host_kv)
    op = swap(1, "out", (1,), (3,), epoch=1)
    assert rig.run(op).status == "cancelled"
    rig.lane.last = None  # the incarnation that cancelled it died before its report
    rig.post(op)
    resent = rig.done(1)
    assert resent.status == "failed" and resent.error.startswith(LOST), resent
    assert torch.equal(bits(rig.host_kv), host_before)  # nothing was copied, then or now


def test_a_device_tier_of_an_epoch_the_run_has_not_reached_is_refused(make_lane) -> None:
    rig = make_lane(SwapLane)  # its tier: epoch 0, the run's
    rig.give_device_tier(epoch=5)
    done = rig.run(swap(1, "out", (1,), (2,)))
    assert done.status == "ok", done  # still the tier of epoch 0
    [failed] = rig.events("msg.failed")
    assert failed["type"] == "DeviceTier" and "epoch 5, ahead of the run's 0" in failed["message"]


def test_a_swap_out_that_waited_for_a_step_a_restarted_worker_cancelled_is_cancelled_too(
    make_lane,
) -> None:
    # The step it waits for never ran: a new Worker published its epoch, then cancelled the
    # step (advancing step_done). The swap-out sees both and copies nothing: it would copy
    # blocks the step never wrote, and a write-back would store them under a valid key.
    rig = make_lane(SwapLane)
    step = rig.play(Lane.STEP)
    tier = epoch_counter(rig.lanes, 0, TIER_EPOCH)
    tier.claim()
    host_before = bits(rig.host_kv)

    def restarted_worker() -> None:
        tier.advance(1)
        step.advance(3)

    worker = threading.Timer(0.1, restarted_worker)
    worker.start()
    try:
        done = rig.run(swap(1, "out", (1,), (2,), fence=Fence(step=Seq(3))))
    finally:
        worker.join(WAIT_S)
    assert done.status == "cancelled" and "device tier reset at epoch 1" in done.error, done
    assert torch.equal(bits(rig.host_kv), host_before)
    assert rig.mark(Lane.SWAP).value() == 1


# 8. Fences that are not reached in time.


def test_a_swap_op_whose_fence_is_not_reached_is_cancelled_once_its_engine_has_restarted(
    make_lane,
) -> None:
    rig = make_lane(SwapLane)
    rig.play(Lane.STEP)
    host_before = bits(rig.host_kv)
    epoch = rig.issuer_epoch()
    bump = threading.Timer(0.1, epoch.advance, args=(1,))  # an engine of epoch 1 started
    bump.start()
    started = time.monotonic()
    try:
        done = rig.run(swap(1, "out", (1,), (2,), fence=Fence(step=Seq(5))))
    finally:
        bump.join(WAIT_S)
    assert done.status == "cancelled" and "epoch 0" in done.error, done
    assert "engine restarted" in done.error, done
    assert time.monotonic() - started >= 0.25  # it waited out the deadline first
    assert torch.equal(bits(rig.host_kv), host_before)
    assert rig.mark(Lane.SWAP).value() == 1
    assert rig.run(swap(2, "out", (1,), (2,), epoch=1)).status == "ok"


def test_a_store_op_whose_fence_is_not_reached_is_cancelled_once_its_engine_has_restarted(
    make_lane,
) -> None:
    rig = make_lane(StoreLane)
    rig.play(Lane.SWAP)
    epoch = rig.issuer_epoch()
    bump = threading.Timer(0.1, epoch.advance, args=(1,))
    bump.start()
    try:
        done = rig.run(store(1, "write", (1,), (key(3),), fence=Fence(swap=Seq(2))))
    finally:
        bump.join(WAIT_S)
    assert done.status == "cancelled" and "epoch 0" in done.error, done
    assert stored_files(rig.storage) == []
    assert rig.mark(Lane.STORE).value() == 1


def test_a_fence_wait_past_its_deadline_defers_the_op_and_runs_it_when_the_step_is_done(
    make_lane,
) -> None:
    rig = make_lane(SwapLane)
    step = rig.play(Lane.STEP)
    # Another actor restarted (the run epoch moved on): that alone makes no op stale.
    run_epoch = rig.control[0]
    run_epoch.claim()
    run_epoch.advance(1)
    dev, host = rig.device_kv, rig.host_kv
    fill(dev, (4, 5), seed=170)
    old = dev[[4, 5]].clone()
    fill(dev, (4, 5), seed=180)
    final = dev[[4, 5]].clone()
    dev[[4, 5]] = old

    def step_3() -> None:
        dev[[4, 5]] = final
        step.advance(3)

    # The step lane is slower than the lane's wait slice (0.3 s): deferred, then run.
    worker = threading.Timer(0.8, step_3)
    worker.start()
    try:
        done = rig.run(swap(1, "out", (4, 5), (0, 1), fence=Fence(step=Seq(3))))
    finally:
        worker.join(WAIT_S)
    assert done.status == "ok" and done.wait_ns > 0, done
    assert same(host[[0, 1]], final)
    deferred = rig.events("msg.deferred")
    assert deferred and all(e["error"] == "WaitTimeout" for e in deferred)
    assert all(e["type"] == "SwapOp" for e in deferred)
    assert rig.mark(Lane.SWAP).value() == 1


# 9. Chaos delays.


# 8. The legacy lock (transfer.mode = lock): a baseline, still exact.


@contextlib.contextmanager
def holding_legacy_lock(run_dir: Path, rank: int = 0) -> Iterator[None]:
    """Play another executor of the rank inside its step or copy: hold its lock file."""
    fd = os.open(lock_path(run_dir, rank), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def test_in_lock_mode_a_swap_copies_only_once_no_other_executor_holds_the_lock(
    make_lane, tmp_path: Path
) -> None:
    rig = make_lane(SwapLane, "transfer.mode=lock", run_dir=tmp_path)
    dev, host = rig.device_kv, rig.host_kv
    fill(dev, (1, 2), seed=5)
    with holding_legacy_lock(tmp_path):
        rig.post(swap(1, "out", (1, 2), (3, 4)))
        held = rig.replies_box.waiter.wait_until(rig.replies.pending, 0.3)
        assert not held, "the lane copied while another executor held the lock"
        assert not same(host[[3, 4]], dev[[1, 2]])
    done = rig.done(1)
    assert done.status == "ok", done
    assert same(host[[3, 4]], dev[[1, 2]])
    assert rig.lane.legacy is not None and rig.lane.legacy.waits == 1


def test_in_lock_mode_a_lock_held_past_its_deadline_fails_the_op_naming_the_lock(
    make_lane, tmp_path: Path
) -> None:
    rig = make_lane(
        StoreLane, "transfer.mode=lock", "transfer.lock_timeout_s=0.2", run_dir=tmp_path
    )
    fill(rig.host_kv, (1,), seed=6)
    with holding_legacy_lock(tmp_path):
        failed = rig.run(store(1, "write", (1,), (key(1),)))
    assert failed.status == "failed" and "legacy lock" in (failed.error or ""), failed
    assert stored_files(rig.storage) == []
    done = rig.run(store(2, "write", (1,), (key(1),)))  # the lock is free: the lane goes on
    assert done.status == "ok", done
    assert len(stored_files(rig.storage)) == 1


def test_chaos_delays_hold_each_op_and_the_copies_stay_exact(make_lane) -> None:
    rig = make_lane(SwapLane, "transfer.chaos_delay_ms=50")
    dev, host = rig.device_kv, rig.host_kv
    fill(dev, tuple(range(BLOCKS)), seed=190)
    expected = dev.clone()
    ops = 8  # each sleeps uniform(0, 50 ms): the sum is below 50 ms with chance 1/8!
    started = time.monotonic()
    dones = []
    for op in range(1, ops + 1):
        src = (2 * (op - 1), 2 * (op - 1) + 1)
        dst = (BLOCKS - 1 - src[0], BLOCKS - 1 - src[1])
        dones.append(rig.run(swap(op, "out", src, dst)))
    elapsed = time.monotonic() - started
    assert all(d.status == "ok" for d in dones)
    assert elapsed > 0.05, elapsed
    assert sum(d.wait_ns + d.copy_ns for d in dones) > 50_000_000
    assert same(host, expected.flip(0))
    assert rig.mark(Lane.SWAP).value() == ops


def test_chaos_delays_hold_store_ops_and_what_is_read_back_is_exact(make_lane) -> None:
    rig = make_lane(StoreLane, "transfer.chaos_delay_ms=50")
    host = rig.host_kv
    blocks = tuple(range(8))
    fill(host, blocks, seed=200)
    expected = host[list(blocks)].clone()
    keys = tuple(key(0x100 + b) for b in blocks)
    started = time.monotonic()
    dones = [rig.run(store(op + 1, "write", (b,), (keys[b],))) for op, b in enumerate(blocks)]
    dones.append(rig.run(store(9, "read", tuple(range(8, 16)), keys)))
    elapsed = time.monotonic() - started
    assert all(d.status == "ok" and d.missing == () for d in dones)
    assert elapsed > 0.05, elapsed
    assert same(host[8:16], expected)
