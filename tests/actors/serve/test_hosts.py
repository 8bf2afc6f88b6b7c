"""Two ``ringfence serve`` instances on different hosts share one redis server.

The hosts are network namespaces the test makes (``tests/netns.py``): redis in "redis",
one instance in "inst-a" and one in "inst-b" (both on port 8000 of their own address),
the test's HTTP requests from "client", and "outside" with no link at all. inst-a writes
every full block of a prompt through to redis (no host tier, device write-through); inst-b
then serves the same prompt from redis, with the same tokens.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import Any

import orjson
import pytest
from launching import wait_until
from netns import Hosts
from serving import Server, served, started

from ringfence.cache.storage.redis_server import REDIS_SERVER, redis_server

MODEL = "ringfence-tiny"
PORT = 8000  # every instance's: ports are per namespace
REDIS_PORT = 6379
BLOCK_SIZE = 16
PROMPT = [(7 * i) % 200 + 20 for i in range(5 * BLOCK_SIZE + 3)]  # five full blocks
FULL_BLOCKS = len(PROMPT) // BLOCK_SIZE
STORE_TIMEOUT_S = 30.0


def instance_sets(redis_url: str) -> tuple[str, ...]:
    return (
        "model.preset=tiny",
        "sched.max_model_len=256",
        "cache.host_blocks=0",  # nothing kept on host: what is reused comes from storage
        "cache.device_eviction=write_through",  # every full block goes to redis at once
        "cache.storage.backend=redis",
        f"cache.storage.url={redis_url}",
    )


def instance(hosts: Hosts, name: str, redis_url: str, tmp_path: Path) -> ContextManager[Server]:
    """``ringfence serve`` in host ``name``, on its address, port PORT."""
    sets = instance_sets(redis_url)
    return served(
        tmp_path / name, *sets, host=hosts.address(name), port=PORT, prefix=hosts.command(name)
    )


def complete(hosts: Hosts, name: str) -> dict[str, Any]:
    """A greedy completion of PROMPT by instance ``name``, asked from host "client"."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    url = f"http://{hosts.address(name)}:{PORT}/v1/completions"
    answer = hosts.request("client", url, orjson.dumps({**body, "return_token_ids": True}))
    assert answer.status == 200, answer.body
    result: dict[str, Any] = orjson.loads(answer.body)
    return result


def blocks_written(server: Server) -> int:
    """How many blocks the instance's store lane has written to the tier so far."""
    events = server.launch.events("lane.done", log="store-0", direction="write", status="ok")
    return sum(int(e["blocks"]) for e in events)


def test_a_prompt_one_host_wrote_to_redis_is_served_from_it_by_another_host(tmp_path: Path):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not on PATH (scripts/test installs it as root)")
    with contextlib.ExitStack() as stack:
        hosts = stack.enter_context(
            Hosts("redis", "inst-a", "inst-b", "client", unlinked=("outside",))
        )
        for name in ("redis", "inst-a", "inst-b"):
            (tmp_path / name).mkdir()
        url = stack.enter_context(
            redis_server(
                tmp_path / "redis",
                port=REDIS_PORT,
                bind=hosts.address("redis"),
                prefix=hosts.command("redis"),
            )
        )
        assert url == f"redis://{hosts.address('redis')}:{REDIS_PORT}/0"
        names = ("inst-a", "inst-b")
        servers = dict(
            zip(
                names,
                started(stack, [instance(hosts, name, url, tmp_path) for name in names]),
                strict=True,
            )
        )
        assert servers["inst-a"].url == f"http://{hosts.address('inst-a')}:{PORT}"

        first = complete(hosts, "inst-a")
        assert first["usage"]["ringfence"]["cached_tokens"] == {
            "device": 0,
            "host": 0,
            "storage": 0,
        }
        wait_until(
            f"inst-a to write {FULL_BLOCKS} blocks to redis",
            lambda: blocks_written(servers["inst-a"]) >= FULL_BLOCKS,
            STORE_TIMEOUT_S,
        )
        second = complete(hosts, "inst-b")
        assert second["usage"]["ringfence"]["cached_tokens"] == {
            "device": 0,
            "host": 0,
            "storage": FULL_BLOCKS * BLOCK_SIZE,
        }
        assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]

        # Isolation is real: redis answers the linked hosts only.
        assert hosts.connect("client", hosts.address("redis"), REDIS_PORT) == "connected"
        assert hosts.connect("outside", hosts.address("redis"), REDIS_PORT) == "ENETUNREACH"
