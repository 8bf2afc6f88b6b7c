"""Storage at tp_size 2, as the engine sees it: a prefix is stored only as far as both ranks'
shards are; a block corrupt at one rank is prefetched as missing there and recomputed; a
write-back counts as stored only if it worked at every rank.

``parallel.tp_size`` is capped at 1 until the Worker shards the model; the configs here
get 2 through ``dataclasses.replace``, which skips the loader's check.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ringfence.actors.config import Config
from ringfence.actors.engine.begin import sched_config
from ringfence.actors.engine.ledger import Ledger, Outcome
from ringfence.actors.engine.storage import open_all_ranks
from ringfence.actors.kv.layout import block_fingerprint
from ringfence.actors.model.config import ParallelConfig
from ringfence.actors.model.identity import model_id
from ringfence.actors.model.info import ModelInfo
from ringfence.actors.protocol.transfer import OpDone
from ringfence.actors.tools.testing.storage import read_blob, write_blob
from ringfence.cache.block_hash import block_keys
from ringfence.cache.fences import Lane
from ringfence.cache.ids import BlockHash, BlockId
from ringfence.cache.storage.local import LocalBackend
from ringfence.cache.storage.memory import MemoryBackend
from ringfence.cache.storage.ranks import AllRanks
from ringfence.runtime.log import ActorLog
from ringfence.sched.ops import Op, StepOp, StoreOp, SwapOp
from ringfence.sched.request import Request, SamplingParams
from ringfence.sched.scheduler import Scheduler

RANKS = 2
FULL = 4  # full blocks of the prompt


def tp2_config(*sets: str) -> Config:
    config = Config.load(None, ["cache.host_blocks=0", *sets])
    return dataclasses.replace(config, parallel=ParallelConfig(tp_size=RANKS))


def model_of(config: Config) -> ModelInfo:
    return ModelInfo(
        model_id=model_id(config.model), vocab_size=259, max_position=2048, dtype="float32",
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


def prompt_of(config: Config) -> tuple[int, ...]:
    return tuple(range(1, FULL * config.cache.block_size + 3))  # and a partial block


def chain(config: Config) -> list[BlockHash]:
    """The keys of the prompt's full blocks, as the engine's scheduler makes them."""
    namespace = block_fingerprint(config, model_of(config).model_id).digest()
    return block_keys(prompt_of(config), config.cache.block_size, namespace=namespace)


def rank_store(config: Config, rank: int, path: Path) -> LocalBackend:
    """Rank ``rank``'s key space in the local tier, opened as its store lane opens it."""
    return LocalBackend(
        path, fingerprint=block_fingerprint(config, rank=rank).digest(), fsync=False
    )


def payload(rank: int) -> bytes:
    return bytes([rank + 1]) * 64


def new_scheduler(config: Config, storage: AllRanks) -> Scheduler:
    model = model_of(config)
    return Scheduler(sched_config(config, model.model_id, model.max_position), storage)


def request(config: Config) -> Request:
    return Request(
        request_id="r", prompt_token_ids=prompt_of(config), params=SamplingParams(max_tokens=2)
    )


def test_the_engine_finds_a_prefix_only_up_to_the_block_rank_1_lacks(tmp_path):
    path = tmp_path / "storage"
    config = tp2_config("cache.storage.backend=local", f"cache.storage.path={path}")
    keys = chain(config)
    for rank in range(RANKS):
        store = rank_store(config, rank, path)
        store.put_many([(k, payload(rank)) for k in keys])
        store.close()
    storage = open_all_ranks(config, model_of(config), str(tmp_path))
    assert storage is not None and len(storage.ranks) == RANKS
    try:
        assert storage.longest_prefix(keys) == FULL
        store = rank_store(config, 1, path)
        assert store.delete([keys[2]]) == 1  # rank 1's shard of block 2 is gone
        store.close()
        assert storage.longest_prefix(keys) == 2
        scheduler = new_scheduler(config, storage)
        scheduler.add(request(config))
        (prefetch,) = scheduler.schedule()
        assert isinstance(prefetch, StoreOp) and prefetch.direction == "read"
        assert prefetch.keys == tuple(keys[:2])
    finally:
        storage.close()


def prefetched(ledger: Ledger, op: StoreOp, ranks: list[MemoryBackend]) -> Outcome:
    """``op`` sent to every rank's store lane, each reading its own shards; the outcome."""
    ledger.queue([op], epoch=0)
    ledger.pump()
    outcome = None
    for rank, store in enumerate(ranks):
        got = store.get_many(op.keys)
        missing = tuple(i for i, data in enumerate(got) if data is None)
        done = OpDone(lane="store", op=op.op, epoch=0, rank=rank, status="ok", missing=missing)
        outcome = ledger.settle(Lane.STORE, rank, done, epoch_now=0)
        assert (outcome is None) == (rank < RANKS - 1)  # complete once every rank reported
    assert outcome is not None
    return outcome


def make_ledger(tmp_path: Path) -> Ledger:
    log = ActorLog(tmp_path / "engine-0.jsonl", actor="engine", rank=0, epoch=0)
    ledger = Ledger(RANKS, sync=False, send_all=lambda role, messages: None, log=log)
    ledger.begin(dict.fromkeys(Lane, 1))
    return ledger


def test_a_block_corrupt_at_rank_1_is_prefetched_as_missing_and_recomputed(tmp_path):
    config = tp2_config("cache.storage.backend=memory")
    keys = chain(config)
    ranks = [MemoryBackend(fingerprint=block_fingerprint(config, rank=r).digest()) for r in (0, 1)]
    for rank, store in enumerate(ranks):
        store.put_many([(k, payload(rank)) for k in keys])
    blob = read_blob(ranks[1], keys[2])
    assert blob is not None
    write_blob(ranks[1], keys[2], blob[:5] + bytes([blob[5] ^ 0xFF]) + blob[6:])
    storage = AllRanks(ranks)
    scheduler = new_scheduler(config, storage)
    scheduler.add(request(config))
    (prefetch,) = scheduler.schedule()
    assert isinstance(prefetch, StoreOp) and prefetch.keys == tuple(keys)  # corrupt: present
    outcome = prefetched(make_ledger(tmp_path), prefetch, ranks)
    assert (outcome.status, outcome.missing) == ("ok", (2,))
    scheduler.on_transfer(Lane.STORE, outcome.number, outcome.status, outcome.missing)
    ops: list[Op] = scheduler.schedule()
    swap_in = [op for op in ops if isinstance(op, SwapOp)]
    assert [len(op.device_blocks) for op in swap_in] == [2]  # the blocks before it
    (step,) = [op for op in ops if isinstance(op, StepOp)]
    assert step.pieces[0].start == 2 * config.cache.block_size  # computed again from block 2
    assert storage.longest_prefix(keys) == 2  # rank 1 dropped its corrupt blob when read


def written_back(tmp_path: Path, statuses: tuple[str, str]) -> tuple[bool, bool, bool]:
    """A write-back of one key that rank r's lane reports ``statuses[r]``: whether the
    scheduler takes the key as stored at issue, after rank 0's report, after both."""
    config = tp2_config("cache.storage.backend=memory")
    ranks = [MemoryBackend(fingerprint=block_fingerprint(config, rank=r).digest()) for r in (0, 1)]
    blocks = new_scheduler(config, AllRanks(ranks)).blocks
    ledger = make_ledger(tmp_path)
    key = chain(config)[0]
    blocks.write_back([BlockId(0)], [key], "evict")
    (op,) = blocks.issuer.take_ops()
    ledger.queue([op], epoch=0)
    ledger.pump()
    seen = [blocks.stored.has(key)]
    for rank, status in enumerate(statuses):
        if status == "ok":
            ranks[rank].put_many([(key, payload(rank))])
        done = OpDone(lane="store", op=op.number, epoch=0, rank=rank, status=status)  # type: ignore[arg-type]
        outcome = ledger.settle(Lane.STORE, rank, done, epoch_now=0)
        if outcome is not None:
            blocks.completed(Lane.STORE, outcome.number, outcome.status)
        seen.append(blocks.stored.has(key))
    return seen[0], seen[1], seen[2]


def test_a_write_back_that_failed_at_rank_1_is_not_stored_though_rank_0s_worked(tmp_path):
    # Taken as stored at issue: every rank's store lane runs its ops in order, so a
    # prefetch issued after the write-back finds it at every rank where it worked.
    assert written_back(tmp_path, ("ok", "failed")) == (True, True, False)


def test_a_write_back_that_worked_at_every_rank_stays_stored(tmp_path):
    assert written_back(tmp_path, ("ok", "ok")) == (True, True, True)
