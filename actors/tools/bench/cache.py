"""``ringfence bench cache``: the cache's bookkeeping per block, and storage against a plain write.

Index part, with ``--blocks`` (1,000,000) cached blocks in a device pool of that
size: keying, prefix matching, acquiring a match, allocating (evicting cached
blocks) and freeing, and fence computation, each in microseconds per block
touched (target < 2), and the Python memory per cached block (target < 300 bytes:
tracemalloc over the pool and index, plus the key objects). Storage part: put and get MB/s of
``--storage-blocks`` blocks of 256 KiB on each backend asked for (``local`` in a
temp dir; ``redis`` against a redis-server it starts on loopback when one is
installed), next to a plain ``open().write()`` of the same bytes into the same
temp dir, as a ratio (target >= 0.7). Presence part: microseconds per engine question
"how many of these 32 keys are stored" (16 are) through the engine's guarded client,
asked on its asker thread with a deadline (``cache.storage.presence_timeout_s``) next
to asked in the caller, as a ratio: the price of never stalling on a hung server. With
``--secret``, each backend also runs as ``<name>+secret`` in the same rounds, its blobs keyed
with a storage secret (HMAC-SHA256 written and checked, ``cache/storage/seal.py``): the
MAC's price, side by side.

Lives in ringfence.cache (stdlib only) and is reached by import path from the CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from hashlib import blake2b
from pathlib import Path
from typing import Any

import orjson

from ringfence.cache.block_hash import Fingerprint, block_keys
from ringfence.cache.block_pool import BlockPool
from ringfence.cache.fences import FenceTracker, Lane
from ringfence.cache.ids import BlockHash, BlockId, Seq
from ringfence.cache.prefix_index import PrefixIndex

BLOCK_TOKENS = 16
CHAIN_BLOCKS = 64  # blocks per cached sequence
OP_BLOCKS = 16  # blocks per allocate/free/fence op
TARGET_US, TARGET_BYTES, TARGET_RATIO = 2.0, 300, 0.7


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument("--quick", action="store_true", help="20,000 blocks, few ops (tests)")
    parser.add_argument("--blocks", type=int, help="cached blocks (1,000,000; quick 20,000)")
    parser.add_argument("--storage-blocks", type=int, help="256 KiB blocks per storage run (64)")
    parser.add_argument("--backends", default="local,redis", help="storage backends: %(default)s")
    parser.add_argument(
        "--secret", action="store_true", help="also each backend with a storage secret (MAC)"
    )


def _per_block_us(run: Callable[[], int]) -> float:
    """Run ``run`` (which returns the blocks it touched) and time it per block."""
    start = time.perf_counter_ns()
    touched = run()
    return (time.perf_counter_ns() - start) / 1000 / max(touched, 1)


def _chains(num_blocks: int, rng: random.Random) -> tuple[list[list[BlockHash]], float]:
    """Key chains of CHAIN_BLOCKS random blocks; and the keying time, microseconds per block."""
    namespace = Fingerprint(
        model_id="bench@1",
        dtype="bfloat16",
        block_size=BLOCK_TOKENS,
        kv_layout="block-major-v1",
        tp_size=1,
        tp_rank=0,
    ).digest()
    length = CHAIN_BLOCKS * BLOCK_TOKENS
    pool = [rng.randrange(32000) for _ in range(length * 8)]
    sequences = [
        pool[i % 8 * length : (i % 8 + 1) * length] for i in range(num_blocks // CHAIN_BLOCKS)
    ]
    for i, tokens in enumerate(sequences):
        tokens[0] = i  # every chain distinct from its first block on
    start = time.perf_counter_ns()
    chains = [block_keys(t, BLOCK_TOKENS, namespace=namespace) for t in sequences]
    elapsed = time.perf_counter_ns() - start
    return chains, elapsed / 1000 / max(1, len(chains) * CHAIN_BLOCKS)


def _fill(chains: list[list[BlockHash]], num_blocks: int) -> tuple[BlockPool, PrefixIndex]:
    """A pool with every chain's blocks cached and free (findable until reused)."""
    pool = BlockPool(num_blocks, name="device")
    for chain in chains:
        blocks = pool.allocate(len(chain)).block_ids
        for block, key in zip(blocks, chain, strict=True):
            pool.set_key(block, key)
        pool.free(reversed(blocks))
    return pool, PrefixIndex(pool)


def bench_index(num_blocks: int, num_ops: int, seed: int = 0) -> dict[str, Any]:
    """Microseconds per block of each index operation, and bytes per cached block."""
    rng = random.Random(seed)
    chains, key_us = _chains(num_blocks, rng)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    pool, index = _fill(chains, len(chains) * CHAIN_BLOCKS)
    cached_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    num_cached = pool.num_cached
    num_ops = max(1, min(num_ops, pool.num_blocks // (2 * OP_BLOCKS)))  # allocations must fit
    key_bytes = sum(sys.getsizeof(key) for chain in chains for key in chain)
    picks = [rng.choice(chains) for _ in range(num_ops)]

    def match() -> int:
        return sum(len(index.match(chain).keys) for chain in picks)

    matches = [index.match(chain) for chain in picks[: max(1, num_ops // 4)]]

    def acquire() -> int:
        for m in matches:
            index.acquire(m)
        return sum(len(m.keys) for m in matches)

    def release() -> int:
        for m in matches:
            pool.free(b for b in m.block_ids if b is not None)
        return sum(len(m.keys) for m in matches)

    allocations: list[tuple[BlockId, ...]] = []

    def allocate() -> int:
        allocations.extend(pool.allocate(OP_BLOCKS).block_ids for _ in range(num_ops))
        return num_ops * OP_BLOCKS

    def free() -> int:
        for blocks in allocations:
            pool.free(blocks)
        return num_ops * OP_BLOCKS

    tracker = FenceTracker(pool.num_blocks, pool.num_blocks)
    ops = [
        tuple(BlockId(rng.randrange(pool.num_blocks)) for _ in range(OP_BLOCKS))
        for _ in range(num_ops)
    ]

    def fence() -> int:
        for n, blocks in enumerate(ops, start=1):
            lane = Lane.STEP if n % 2 else Lane.SWAP
            if lane is Lane.STEP:
                tracker.issue(lane, Seq(n), read_device=blocks, write_device=blocks[-1:])
            else:
                tracker.issue(lane, Seq(n), read_device=blocks, write_host=blocks)
        return num_ops * OP_BLOCKS

    per_block = {
        "key": key_us,
        "match": _per_block_us(match),
        "acquire": _per_block_us(acquire),
        "free_acquired": _per_block_us(release),
        "allocate_evicting": _per_block_us(allocate),
        "free": _per_block_us(free),
        "fence": _per_block_us(fence),
    }
    return {
        "cached_blocks": num_cached,
        "bytes_per_cached_block": (cached_bytes + key_bytes) / max(1, num_cached),
        "bytes_per_cached_block_without_keys": cached_bytes / max(1, num_cached),
        "us_per_block": per_block,
    }


def _print_index(report: dict[str, Any]) -> list[tuple[str, bool, str]]:
    print(f"index with {report['cached_blocks']:,} cached blocks (us per block touched):")
    targets = []
    for name, us in report["us_per_block"].items():
        print(f"  {name:<18} {us:8.3f} us")
        targets.append((f"{name} < {TARGET_US} us/block", us < TARGET_US, f"{us:.3f} us"))
    per_block = report["bytes_per_cached_block"]
    print(f"  memory             {per_block:8.1f} bytes per cached block (its key included)")
    targets.append(
        (f"memory < {TARGET_BYTES} B/block", per_block < TARGET_BYTES, f"{per_block:.0f} B")
    )
    return targets


STORAGE_BLOCK_BYTES = 256 << 10
FINGERPRINT = bytes(range(16))


def _mb_per_s(num_bytes: int, run: Callable[[], object]) -> float:
    start = time.perf_counter_ns()
    run()
    return num_bytes / 1e6 / ((time.perf_counter_ns() - start) / 1e9)


def _plain(workdir: Path, payloads: list[bytes], *, fsync: bool = False) -> tuple[float, float]:
    """MB/s of a plain ``open().write()`` of each block to its own file (then ``fsync`` if
    asked: the local backend's durability), and of reading the files back."""
    total = len(payloads) * STORAGE_BLOCK_BYTES
    paths = [workdir / f"plain{'-fsync' if fsync else ''}-{i}" for i in range(len(payloads))]

    def write() -> None:
        for path, payload in zip(paths, payloads, strict=True):
            with open(path, "wb") as f:
                f.write(payload)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())

    def read() -> None:
        for path in paths:
            with open(path, "rb") as f:
                f.read()

    return _mb_per_s(total, write), _mb_per_s(total, read)


def _backend(
    label: str, workdir: Path, url: str, payloads: list[bytes], round_no: int
) -> tuple[float, float]:
    """MB/s of ``put_many`` then ``get_many`` of fresh keys on backend ``label`` (a name, or
    ``<name>+secret``: its blobs keyed with :data:`BENCH_SECRET`)."""
    from ringfence.cache.storage.registry import open_backend
    from ringfence.cache.storage.seal import Seal

    name, _, keyed = label.partition("+")
    seal = Seal(BENCH_SECRET) if keyed else None

    total = len(payloads) * STORAGE_BLOCK_BYTES
    keys = [
        BlockHash(blake2b(f"{round_no}-{i}".encode(), digest_size=16).digest())
        for i in range(len(payloads))
    ]
    backend = open_backend(
        name, fingerprint=FINGERPRINT, path=str(workdir / label), url=url, max_bytes=0, seal=seal
    )
    try:
        put = _mb_per_s(total, lambda: backend.put_many(zip(keys, payloads, strict=True)))
        got: list[bytes | None] = []
        get = _mb_per_s(total, lambda: got.extend(backend.get_many(keys)))
        if any(value is None for value in got):
            raise RuntimeError(f"{name}: a block just stored read back as a miss")
        backend.delete(keys)
    finally:
        backend.close()
    return put, get


BENCH_SECRET = b"ringfence bench cache"  # the storage secret of the +secret runs
PRESENCE_KEYS = 32  # keys per presence question, the first half of them stored


def _presence(name: str, workdir: Path, url: str, questions: int) -> tuple[float, float]:
    """Microseconds per guarded ``longest_prefix``: asked in the caller, and on the asker
    thread with the engine's default deadline."""
    from ringfence.cache.storage.guarded import GuardedBackend
    from ringfence.cache.storage.registry import open_backend

    keys = [
        BlockHash(blake2b(f"presence-{i}".encode(), digest_size=16).digest())
        for i in range(PRESENCE_KEYS)
    ]
    stored = PRESENCE_KEYS // 2
    timings = []
    for answer_s in (None, 0.05):
        backend = open_backend(
            name, fingerprint=FINGERPRINT, path=str(workdir / name), url=url, max_bytes=0
        )
        backend.put_many((k, bytes(STORAGE_BLOCK_BYTES)) for k in keys[:stored])
        with contextlib.closing(GuardedBackend(backend, answer_s=answer_s)) as guarded:
            for _ in range(20):  # warm: the first questions pay for cold caches and the thread
                guarded.longest_prefix(keys)
            start = time.perf_counter_ns()
            for _ in range(questions):
                if guarded.longest_prefix(keys) != stored:
                    raise RuntimeError(f"{name}: a presence question got a wrong answer")
            timings.append((time.perf_counter_ns() - start) / 1e3 / questions)
            backend.delete(keys)
    return timings[0], timings[1]


def bench_storage(
    backends: Sequence[str], num_blocks: int, rounds: int, *, secret: bool = False
) -> dict[str, Any]:
    """Median put/get MB/s per backend and of the plain write/read, over interleaved rounds."""
    from ringfence.actors.tools.testing.redis_server import REDIS_SERVER, redis_server

    rng = random.Random(1)
    payloads = [rng.randbytes(STORAGE_BLOCK_BYTES) for _ in range(num_blocks)]
    samples: dict[str, list[tuple[float, float]]] = {"plain": [], "plain_fsync": []}
    asks: dict[str, list[tuple[float, float]]] = {}
    questions = 200 if rounds == 1 else 2000
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="ringfence-bench-cache-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        url = ""
        if "redis" in backends:
            if REDIS_SERVER is None:
                skipped["redis"] = "redis-server is not installed"
            else:
                (workdir / "redis").mkdir()
                url = stack.enter_context(redis_server(workdir / "redis"))
        active = [b for b in backends if b not in skipped]
        for r in range(rounds):
            round_dir = workdir / f"round-{r}"
            round_dir.mkdir()
            samples["plain"].append(_plain(round_dir, payloads))
            samples["plain_fsync"].append(_plain(round_dir, payloads, fsync=True))
            for name in active:
                samples.setdefault(name, []).append(_backend(name, round_dir, url, payloads, r))
                if secret:  # right after the plain one: the same state of the machine
                    keyed = f"{name}+secret"
                    samples.setdefault(keyed, []).append(
                        _backend(keyed, round_dir, url, payloads, r)
                    )
                asks.setdefault(name, []).append(_presence(name, round_dir, url, questions))
    median = {
        name: {
            "put_mb_s": statistics.median(s[0] for s in runs),
            "get_mb_s": statistics.median(s[1] for s in runs),
        }
        for name, runs in samples.items()
    }
    plain = median["plain"]
    synced = median["plain_fsync"]
    ratios = {
        name: {
            "put_vs_plain_write": m["put_mb_s"] / plain["put_mb_s"],
            "put_vs_plain_write_fsync": m["put_mb_s"] / synced["put_mb_s"],
            "get_vs_plain_read": m["get_mb_s"] / plain["get_mb_s"],
        }
        for name, m in median.items()
        if not name.startswith("plain")
    }
    presence = {}
    for name, runs in asks.items():
        caller = statistics.median(r[0] for r in runs)
        asker = statistics.median(r[1] for r in runs)
        presence[name] = {"caller_us": caller, "asker_us": asker, "asker_vs_caller": asker / caller}
    return {
        "blocks": num_blocks,
        "rounds": rounds,
        "median": median,
        "ratios": ratios,
        "presence": presence,
        "skipped": skipped,
    }


def _print_storage(report: dict[str, Any]) -> list[tuple[str, bool, str]]:
    print(f"storage, {report['blocks']} blocks of 256 KiB, median of {report['rounds']} round(s):")
    targets = []
    for name, m in report["median"].items():
        line = f"  {name:<14} put {m['put_mb_s']:8.0f} MB/s   get {m['get_mb_s']:8.0f} MB/s"
        ratio = report["ratios"].get(name)
        if ratio is not None:
            put, get = ratio["put_vs_plain_write"], ratio["get_vs_plain_read"]
            synced = ratio["put_vs_plain_write_fsync"]
            line += f"   put {put:.2f}x plain write ({synced:.2f}x with fsync)"
            line += f", get {get:.2f}x plain read"
            targets.append(
                (f"{name} put >= {TARGET_RATIO}x plain write", put >= TARGET_RATIO, f"{put:.2f}x")
            )
        print(line)
    print(f"presence questions of {PRESENCE_KEYS} keys, microseconds each:")
    for name, p in report["presence"].items():
        print(
            f"  {name:<8} asked in the caller {p['caller_us']:8.1f}   on the asker thread "
            f"{p['asker_us']:8.1f}   {p['asker_vs_caller']:.2f}x"
        )
    for name, why in report["skipped"].items():
        print(f"  {name:<8} skipped: {why}")
    return targets


def main(args: argparse.Namespace) -> int:
    num_blocks = args.blocks if args.blocks is not None else 20_000 if args.quick else 1_000_000
    storage_blocks = (
        args.storage_blocks if args.storage_blocks is not None else 8 if args.quick else 64
    )
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if num_blocks < CHAIN_BLOCKS or storage_blocks < 1:
        raise ValueError(f"--blocks must be >= {CHAIN_BLOCKS} and --storage-blocks >= 1")
    unknown = [b for b in backends if b not in ("local", "redis", "memory")]
    if unknown:
        raise ValueError(f"--backends: expected a subset of local,redis,memory, got {unknown}")
    index = bench_index(num_blocks, 200 if args.quick else 20_000)
    targets = _print_index(index)
    storage = bench_storage(backends, storage_blocks, 1 if args.quick else 5, secret=args.secret)
    targets += _print_storage(storage)
    for name, passed, detail in targets:
        print(f"{'PASS' if passed else 'FAIL'} {name}: {detail}")
    print("(targets are informational)")
    if args.json is not None:
        report = {"index": index, "storage": storage, "targets": targets}
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0
