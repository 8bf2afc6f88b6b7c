"""Whole runs on a faulty storage tier: misses and recomputation, never wrong tokens, no hang.

Each run launches the engine topology on the first chat of ``synthetic:multiturn`` (four
turns sharing a 256-token system prompt) with no host cache, so every block reused
comes from storage, and write-through, so every full block is written there at once.
Every request's tokens must equal test_engine's ``reference`` (the plain loop with no
tiers). The faults: blocks damaged in a directory an earlier instance filled (CI: the
earlier instance runs in process; slow: launched), a redis server stopped in the
middle of a run and restarted on its port (slow), and a local tier that is full:
``max_bytes`` tiny, or a small tmpfs where writes fail with ENOSPC (slow).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from engine_runs import MODEL, TRACE, reference, replayed, results
from launching import QUICK, Launch, launched, wait_until
from mounts import mounted_tmpfs

from ringfence.actors.config import Config
from ringfence.actors.engine.intake import load_workload
from ringfence.actors.kv.layout import block_fingerprint
from ringfence.actors.tools.bench.faults.storage import damage_prefix
from ringfence.actors.tools.testing.local import LocalRunner
from ringfence.actors.tools.testing.redis_server import REDIS_SERVER, redis_server, url_port
from ringfence.actors.tools.testing.storage import read_blob, write_blob
from ringfence.cache.block_hash import block_keys
from ringfence.cache.ids import BlockHash
from ringfence.cache.storage.blob import decode, encode
from ringfence.cache.storage.local import LocalBackend
from ringfence.cache.storage.redis_backend import RedisBackend
from ringfence.cache.storage.registry import open_backend
from ringfence.cache.storage.seal import Seal

REQUESTS = 4  # the first chat's four turns
BLOCK_SIZE = 16
RUN_TIMEOUT_S = 120.0
EVENT_TIMEOUT_S = 60.0
RUN = (
    *MODEL,
    *QUICK,
    "engine.workload=synthetic:multiturn",
    f"engine.requests={REQUESTS}",
    "engine.arrivals=false",
    "cache.device_blocks=40",
    "cache.host_blocks=0",  # nothing kept on host: what is reused comes from storage
    "cache.device_eviction=write_through",
)
FOREIGN_FP = bytes(16)  # a fingerprint no model has


def expected_tokens() -> dict[str, tuple[int, ...]]:
    expected = reference("multiturn")
    workload = load_workload("synthetic:multiturn", requests=REQUESTS)
    return {line.id: expected[line.id] for line in workload}


def tokens_of(run_dir: Path) -> dict[str, tuple[int, ...]]:
    outputs, summary = results(run_dir)
    assert summary["requests"]["finished"] == REQUESTS, summary["requests"]
    return {o["id"]: tuple(o["token_ids"]) for o in outputs}


def finished(run: Launch, *, replay: bool = False) -> None:
    """The run exited 0; with ``replay`` (a traced run), replay found no violation and the
    re-driven scheduler took every decision again."""
    assert run.wait(RUN_TIMEOUT_S) == 0, run.tail()
    if replay:
        replayed(run.run_dir)


def wait_for(run: Launch, event: str, *, log: str, **fields: Any) -> dict[str, Any]:
    """The first ``event`` line with ``fields`` in ``<log>.jsonl``; fails if the run ends first."""
    found: list[dict[str, Any]] = []

    def seen() -> bool:
        found[:] = run.events(event, log=log, **fields)
        if not found and run.proc.poll() is not None:
            raise AssertionError(f"the run ended before {event} {fields}:\n{run.tail()}")
        return bool(found)

    wait_until(f"{event} {fields} in {log}.jsonl", seen, EVENT_TIMEOUT_S)
    return found[0]


def store_events(run: Launch, event: str, **fields: Any) -> list[dict[str, Any]]:
    return run.events(event, log="store-0", **fields)


# --- corrupt, truncated and foreign blocks --------------------------------------------------


def namespace(config: Config) -> bytes:
    return block_fingerprint(config).digest()


def fill_in_process(config: Config, path: Path) -> None:
    """A first instance, run in this process: the plain loop with the same tiers, whose
    storage (a dict of the blocks it wrote) is then stored in the local directory."""
    runner = LocalRunner(config)
    records = runner.run(load_workload("synthetic:multiturn", requests=REQUESTS), arrivals=False)
    assert {r.id: r.token_ids for r in records} == expected_tokens()
    storage = runner.machine.storage
    blocks = [(k, t.numpy().data) for k, t in storage.items()]
    store = LocalBackend(path, fingerprint=namespace(config), fsync=False)
    try:
        assert store.put_many(blocks) == len(blocks) > 0
    finally:
        store.close()


def fill_launched(tmp_path: Path, sets: tuple[str, ...]) -> None:
    """A first instance, launched like the second."""
    with launched(tmp_path, *sets, run_dir=tmp_path / "first") as run:
        finished(run)
    assert tokens_of(run.run_dir) == expected_tokens()


def damage(config: Config, path: Path) -> dict[str, str]:
    """Damage blocks 1, 2 and 3 of the chain every turn starts with (block 0 stays whole):
    a flipped payload byte, a blob cut in half, a blob of another model. Key hex -> the
    reason a reader must give."""
    first = load_workload("synthetic:multiturn", requests=1)[0]
    assert first.prompt_token_ids is not None
    return damage_prefix(path, config, first.prompt_token_ids)


@pytest.mark.parametrize("first", ["in_process", pytest.param("launched", marks=pytest.mark.slow)])
def test_corrupt_truncated_and_foreign_blocks_are_logged_misses_and_the_tokens_stay_exact(
    tmp_path, first
):
    shared = tmp_path / "shared-storage"
    sets = (*RUN, "cache.storage.backend=local", f"cache.storage.path={shared}")
    config = Config.load(None, sets)
    if first == "in_process":
        fill_in_process(config, shared)
    else:
        fill_launched(tmp_path, sets)
    damaged = damage(config, shared)
    slow = first == "launched"  # the slow soak's runs are traced and replayed as well
    with launched(tmp_path, *sets, *[TRACE] * slow, run_dir=tmp_path / "second") as run:
        finished(run, replay=slow)
    assert tokens_of(run.run_dir) == expected_tokens()
    corrupt = store_events(run, "storage.corrupt")
    assert {e["key"]: e["reason"] for e in corrupt} == damaged
    # The whole block before them still came from storage.
    _, summary = results(run.run_dir)
    assert summary["cached_tokens"]["storage"] >= BLOCK_SIZE, summary["cached_tokens"]
    failed = store_events(run, "lane.done", direction="read", status="failed")
    assert failed == []  # a damaged block is a miss of an op that worked, not a failed op
    # The recomputed blocks were written back in place of the damaged ones.
    store = LocalBackend(shared, fingerprint=namespace(config), fsync=False)
    try:
        for hexkey in damaged:
            key = BlockHash(bytes.fromhex(hexkey))
            decode(namespace(config), key, read_blob(store, key) or b"")
    finally:
        store.close()


# --- redis stopped in the middle of a run -----------------------------------------------------


GAP_S = 1.0  # between the turns' arrivals: the outage falls between two of them


def spaced_workload(path: Path) -> str:
    """The four turns as a workload file, arriving GAP_S apart."""
    lines = []
    for i, line in enumerate(load_workload("synthetic:multiturn", requests=REQUESTS)):
        params = line.params
        lines.append(
            {
                "id": line.id,
                "prompt_token_ids": list(line.prompt_token_ids or ()),
                "max_tokens": params.max_tokens,
                "temperature": params.temperature,
                "seed": params.seed,
                "stop_token_ids": list(params.stop_token_ids),
                "arrival_s": i * GAP_S,
            }
        )
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return str(path)


# Slow: CI stops and restarts a redis server under a store lane in test_storage_faults.py.
@pytest.mark.slow
def test_a_redis_server_stopped_mid_run_and_restarted_on_its_port_costs_misses_only(tmp_path):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not on PATH (scripts/test installs it as root)")
    (tmp_path / "redis").mkdir()
    workload = spaced_workload(tmp_path / "turns.jsonl")
    first = load_workload(workload)[0].id
    with contextlib.ExitStack() as server:
        url = server.enter_context(redis_server(tmp_path / "redis"))
        sets = (
            *RUN,
            f"engine.workload={workload}",
            "engine.arrivals=true",
            "cache.storage.backend=redis",
            f"cache.storage.url={url}",
            "cache.storage.timeout_s=1.0",
        )
        with launched(tmp_path, *sets) as run:
            wait_for(run, "request.finish", log="engine-0", request=first)
            server.close()  # the server stops: SIGTERM, reaped
            failed = wait_for(run, "lane.failed", log="store-0")
            with redis_server(tmp_path / "redis", port=url_port(url)):
                restarted_ns = time.monotonic_ns()
                finished(run)
    assert "StorageUnavailable" in failed["error"], failed
    assert tokens_of(run.run_dir) == expected_tokens()
    # The store lane wrote to the restarted server again: its client reconnected.
    writes = store_events(run, "lane.done", direction="write", status="ok")
    assert [w for w in writes if w["mono_ns"] > restarted_ns], writes


# --- a full local tier ----------------------------------------------------------------------


@pytest.mark.slow
def test_a_local_tier_with_a_tiny_max_bytes_keeps_nothing_and_the_tokens_stay_exact(tmp_path):
    shared = tmp_path / "storage"
    sets = (
        *RUN,
        "cache.storage.backend=local",
        f"cache.storage.path={shared}",
        "cache.storage.max_bytes=1",
        TRACE,
    )
    with launched(tmp_path, *sets) as run:
        finished(run, replay=True)
    assert tokens_of(run.run_dir) == expected_tokens()
    assert store_events(run, "lane.done", direction="write", status="ok")
    _, summary = results(run.run_dir)
    assert summary["cached_tokens"]["storage"] == 0
    assert [p for p in shared.rglob("*") if p.is_file()] == []


@pytest.fixture
def tmpfs_256k(tmp_path) -> Iterator[Path]:
    """A 256 KiB tmpfs (about 12 tiny-preset float64 blocks) under tmp_path; root only."""
    with mounted_tmpfs(tmp_path / "tmpfs", "256k") as point:
        yield point


@pytest.mark.slow
def test_a_local_tier_on_a_full_tmpfs_fails_writes_with_enospc_and_the_tokens_stay_exact(
    tmp_path, tmpfs_256k
):
    sets = (*RUN, "cache.storage.backend=local", f"cache.storage.path={tmpfs_256k}", TRACE)
    with launched(tmp_path, *sets) as run:
        finished(run, replay=True)
    assert tokens_of(run.run_dir) == expected_tokens()
    failed = store_events(run, "lane.done", direction="write", status="failed")
    assert failed and all("No space left on device" in f["error"] for f in failed), failed
    assert len(store_events(run, "storage.write_failed")) == len(failed)
    assert store_events(run, "lane.done", direction="write", status="ok")


# --- an untrusted tier: a storage secret ---------------------------------------------------


SECRET = "tier-secret-9f3c1e"
PASSWORD = "redis-pass-77d0a2"


def test_a_run_with_a_storage_secret_misses_a_forged_block_and_writes_neither_secret(tmp_path):
    """A first instance (in process) fills a redis tier with keyed blobs; one is replaced by
    a plain blob with a correct checksum. A launched run with the secret, logging in as an
    ACL user by a URL with the password, takes it for a forgery (a miss), computes exact
    tokens, and neither the secret nor the password is in any file it wrote."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not on PATH (scripts/test installs it as root)")
    (tmp_path / "redis").mkdir()
    with redis_server(tmp_path / "redis", user=("alice", PASSWORD)) as url:
        host = url.removeprefix("redis://")
        sets = (
            *RUN,
            "cache.storage.backend=redis",
            f"cache.storage.url=redis://alice:{PASSWORD}@{host}",
            f"cache.storage.secret={SECRET}",
        )
        config = Config.load(None, sets)
        seal = Seal(SECRET.encode())
        runner = LocalRunner(config)
        records = runner.run(load_workload("synthetic:multiturn", requests=1), arrivals=False)
        first = load_workload("synthetic:multiturn", requests=1)[0]
        assert first.prompt_token_ids is not None
        keys = block_keys(first.prompt_token_ids, BLOCK_SIZE, namespace=namespace(config))
        blocks = {k: t.numpy().data for k, t in runner.machine.storage.items()}
        assert records and keys[1] in blocks
        store = RedisBackend(f"redis://alice@{host}", fingerprint=namespace(config), seal=seal,
                             password=PASSWORD)  # fmt: skip
        try:
            assert store.put_many(blocks.items()) == len(blocks)
            forged = bytes(len(blocks[keys[1]]))  # zeros, under a real key, its CRC right
            write_blob(store, keys[1], encode(namespace(config), keys[1], forged))
            with launched(tmp_path, *sets) as run:
                finished(run)
            assert tokens_of(run.run_dir) == expected_tokens()
            assert store_events(run, "storage.forged") == [
                {**store_events(run, "storage.forged")[0], "key": keys[1].hex(), "count": 1}
            ]
            assert store_events(run, "storage.corrupt") == []
            # The recomputed block was written back, keyed, in the forged one's place.
            assert store.get_many([keys[1]]) == [bytes(blocks[keys[1]])]
        finally:
            store.close()
    written = [p for p in tmp_path.rglob("*") if p.is_file() and "redis" not in p.parts]
    assert any(p.name == "config.toml" for p in written)
    for path in written:
        data = path.read_bytes()
        assert SECRET.encode() not in data, path
        assert PASSWORD.encode() not in data, path


@contextlib.contextmanager
def shared_tier(kind: str, tmp_path: Path) -> Iterator[tuple[str, ...]]:
    """The settings of one tier that several instances share: a redis server (stopped on
    exit) or a local directory."""
    if kind == "local":
        yield ("cache.storage.backend=local", f"cache.storage.path={tmp_path / 'shared'}")
        return
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not on PATH (scripts/test installs it as root)")
    (tmp_path / "redis").mkdir()
    with redis_server(tmp_path / "redis") as url:
        yield ("cache.storage.backend=redis", f"cache.storage.url={url}")


# Slow: the local directory's form; CI runs the redis one (both: tests/cache, client level).
@pytest.mark.parametrize("kind", ["redis", pytest.param("local", marks=pytest.mark.slow)])
def test_an_instance_with_another_secret_leaves_a_shared_tier_whole_for_the_first_secret(
    tmp_path, kind
):
    """Three instances over one tier (issue 49): A (in process, secret S1) fills it; B,
    launched with another secret, finds none of A's blocks, meets no forgery and deletes
    nothing; C, launched with S1, takes A's blocks from the tier. Tokens exact in both.

    B takes nothing from the tier though it writes through: its four turns arrive at once,
    before any is written. So C's storage hits are A's blocks."""
    with shared_tier(kind, tmp_path) as where:
        tier = (*RUN, *where)
        config = Config.load(None, (*tier, f"cache.storage.secret={SECRET}"))
        runner = LocalRunner(config)
        runner.run(load_workload("synthetic:multiturn", requests=REQUESTS), arrivals=False)
        blocks = {k: bytes(t.numpy().data) for k, t in runner.machine.storage.items()}
        keys = sorted(blocks)
        settings = config.cache.storage
        store = open_backend(
            kind,
            fingerprint=namespace(config),
            path=settings.path,
            url=settings.url,
            seal=Seal(SECRET.encode()),
        )
        try:
            assert store.put_many(blocks.items()) == len(blocks) > 0  # A
            other = (*tier, "cache.storage.secret=another-tier-secret-41d7")
            with launched(tmp_path, *other, run_dir=tmp_path / "b") as b:  # B
                finished(b)
            assert tokens_of(b.run_dir) == expected_tokens()
            assert store_events(b, "storage.forged") == store_events(b, "storage.corrupt") == []
            assert results(b.run_dir)[1]["cached_tokens"]["storage"] == 0
            back = store.get_many(keys)
            print(f"blocks of A's {len(keys)} a client with A's secret reads after B: "
                  f"{sum(p is not None for p in back)}")  # fmt: skip
            assert back == [blocks[k] for k in keys]
            ours = (*tier, f"cache.storage.secret={SECRET}")
            with launched(tmp_path, *ours, run_dir=tmp_path / "c") as c:  # C
                finished(c)
            assert tokens_of(c.run_dir) == expected_tokens()
            cached = results(c.run_dir)[1]["cached_tokens"]["storage"]
            print(f"prompt tokens C took from the tier: {cached}")
            assert cached >= BLOCK_SIZE
            assert store_events(c, "storage.forged") == []
        finally:
            store.close()
