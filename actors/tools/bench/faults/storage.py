"""The storage faults of ``ringfence bench faults``: damaged stored blocks, a tier with no
room (a tiny ``max_bytes``, a full tmpfs), and a redis server stopped mid-run or down at
launch (:mod:`ringfence.actors.tools.bench.faults.runner` runs them)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from ringfence.actors.tools.bench.faults.runner import (
    MODEL,
    FaultError,
    Launch,
    Outcome,
    Scenario,
    run_scenario,
    workload_of,
)

# The storage rows run the first chat of multiturn (four turns sharing a 256-token
# system prompt) with no host cache, so every block reused comes from storage, and
# write-through, so every full block is written there as soon as it is full.
STORAGE = (
    "cache.device_blocks=40",
    "cache.host_blocks=0",
    "cache.device_eviction=write_through",
    "transfer.chaos_delay_ms=0",
)
FOREIGN = bytes(16)  # the fingerprint of no model


@contextmanager
def damaged_storage(work: Path, scenario: Scenario) -> Iterator[tuple[str, ...]]:
    """A local tier that a first instance filled, then blocks 1-3 of the shared prefix
    damaged: a flipped byte, a blob cut in half, a blob of another model."""
    path = work / "storage"
    sets = ("cache.storage.backend=local", f"cache.storage.path={path}")
    first = Scenario("first", scenario.workload, scenario.requests, (*scenario.sets, *sets))
    filled = run_scenario(first, work, trace=False)
    if not filled.ok or filled.completed != scenario.requests:
        raise FaultError(f"the first instance did not fill the storage tier: {filled}")
    from ringfence.actors.config import Config

    config = Config.load(None, [*MODEL, *scenario.sets])
    damage_prefix(path, config, workload_of(scenario)[0].prompt_token_ids)
    yield sets


def damage_prefix(path: Path, config: Any, prompt: Sequence[int]) -> dict[str, str]:
    """Damage blocks 1, 2 and 3 of ``prompt`` in the local tier at ``path`` that an instance
    of ``config`` filled (block 0 stays whole). Key hex -> the reason a reader must give."""
    from ringfence.actors.kv.layout import block_fingerprint
    from ringfence.actors.tools.testing.storage import read_blob, write_blob
    from ringfence.cache.block_hash import block_keys
    from ringfence.cache.storage.blob import decode, encode
    from ringfence.cache.storage.local import LocalBackend

    namespace = block_fingerprint(config).digest()
    keys = block_keys(prompt, config.cache.block_size, namespace=namespace)
    store = LocalBackend(path, fingerprint=namespace, fsync=False)
    try:
        blobs = [read_blob(store, key) for key in keys[:4]]
        if any(blob is None for blob in blobs):
            raise FaultError("the first instance did not store the shared prefix")
        corrupt, cut, foreign = (blob or b"" for blob in blobs[1:])
        write_blob(store, keys[1], corrupt[:100] + bytes([corrupt[100] ^ 0xFF]) + corrupt[101:])
        write_blob(store, keys[2], cut[: len(cut) // 2])
        write_blob(store, keys[3], encode(FOREIGN, keys[3], decode(namespace, keys[3], foreign)))
    finally:
        store.close()
    return {keys[1].hex(): "checksum", keys[2].hex(): "magic", keys[3].hex(): "fingerprint"}


def corrupt_seen(launch: Launch, scenario: Scenario, outcome: Outcome) -> None:
    """Once the run is over: the damaged blocks were read, and logged as corrupt (misses)."""
    launch.wait_for("the run's end", lambda: launch.proc.poll() is not None)
    reasons = sorted({str(e.get("reason")) for e in launch.events("store-0", "storage.corrupt")})
    outcome.injected = 3
    if not reasons:
        outcome.notes.append("no damaged block was logged storage.corrupt")
    outcome.info.append(f"storage.corrupt logged, reasons: {', '.join(reasons)}")


def writes_into_a_full_tier(launch: Launch, scenario: Scenario, outcome: Outcome) -> None:
    """Once the run is over: every write-back went to a tier with no room (the injections)."""
    launch.wait_for("the run's end", lambda: launch.proc.poll() is not None)
    writes = [e for e in launch.events("store-0", "lane.done") if e.get("direction") == "write"]
    outcome.injected = len(writes)
    if not writes:
        outcome.notes.append("nothing was written back: the full tier was never tried")


@contextmanager
def full_tmpfs(work: Path, scenario: Scenario) -> Iterator[tuple[str, ...]]:
    """The local tier on a 256 KiB tmpfs (about 12 blocks): writes fail with ENOSPC."""
    import shutil

    point = work / "tmpfs"
    point.mkdir(parents=True, exist_ok=True)
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if os.geteuid() != 0 or mount is None or umount is None:
        raise FaultError("mounting a tmpfs needs root")
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(point)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        raise FaultError(f"mount -t tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield ("cache.storage.backend=local", f"cache.storage.path={point}")
    finally:
        subprocess.run([umount, "-l", str(point)], capture_output=True, timeout=30, check=False)


def redis_work(work: Path) -> Path:
    """The folder of a scenario's redis server; FaultError if there is no redis-server."""
    from ringfence.actors.tools.testing.redis_server import REDIS_SERVER

    if REDIS_SERVER is None:
        raise FaultError("redis-server is not on PATH")
    folder = work / "redis"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class RedisOutage:
    """A redis tier of the run's own, stopped mid-run and started again on its port."""

    def __init__(self) -> None:
        self.server = ExitStack()
        self.url = ""

    @contextmanager
    def prepare(self, work: Path, scenario: Scenario) -> Iterator[tuple[str, ...]]:
        from ringfence.actors.tools.testing.redis_server import redis_server

        self.work = redis_work(work)
        with self.server:
            self.url = self.server.enter_context(redis_server(self.work))
            yield ("cache.storage.backend=redis", f"cache.storage.url={self.url}")

    def drive(self, launch: Launch, scenario: Scenario, outcome: Outcome) -> None:
        """Stop the server once a request finished; start it again on its port once the
        store lane failed an op; the run must then finish by itself."""
        from ringfence.actors.tools.testing.redis_server import redis_server, url_port

        finished = lambda: bool(launch.events("engine-0", "request.finish"))  # noqa: E731
        launch.wait_for("a finished request", finished)
        self.server.close()
        outcome.injected += 1
        launch.wait_for("a failed store op", lambda: bool(launch.events("store-0", "lane.failed")))
        with redis_server(self.work, port=url_port(self.url)):
            launch.wait_for("the run's end", lambda: launch.proc.poll() is not None)


class RedisLate:
    """A redis tier that is down when the run starts and comes up while it runs."""

    def __init__(self) -> None:
        self.port = 0

    @contextmanager
    def prepare(self, work: Path, scenario: Scenario) -> Iterator[tuple[str, ...]]:
        from ringfence.actors.tools.testing.redis_server import free_port

        self.work = redis_work(work)
        self.port = free_port()
        yield ("cache.storage.backend=redis", f"cache.storage.url=redis://127.0.0.1:{self.port}/0")

    def drive(self, launch: Launch, scenario: Scenario, outcome: Outcome) -> None:
        """Start the server once the store lane failed an op; then a write-back must
        succeed (both clients reconnected by themselves) and the run finish by itself."""
        from ringfence.actors.tools.testing.redis_server import redis_server

        launch.wait_for("a failed store op", lambda: bool(launch.events("store-0", "lane.failed")))
        if not launch.events("store-0", "storage.unreachable"):
            outcome.notes.append("the store lane did not log storage.unreachable at open")
        outcome.injected += 1
        with redis_server(self.work, port=self.port):
            launch.wait_for("the run's end", lambda: launch.proc.poll() is not None)
        written = [
            e
            for e in launch.events("store-0", "lane.done")
            if e.get("direction") == "write" and e.get("status") == "ok"
        ]
        outcome.info.append(f"{len(written)} write-backs succeeded once the server was up")
