"""Prefill and decode instances on different hosts share one redis server, behind a router.

The hosts are network namespaces the test makes (``tests/netns.py``): redis in "redis",
the prefill instance in "prefill", the decode instance in "decode", ``ringfence router``
in "router" (each on port 8000 of its own address), the test's HTTP requests from
"client", and "outside" with no link at all. A prompt sent to the router is prefilled on
one host, handed over through redis and decoded on another, with the tokens the prefill
instance gives when asked directly; a redis restart costs misses, never tokens.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any

import orjson
import pytest
from launching import RINGFENCE, launch_env, wait_until
from netns import Hosts
from serving import served, started

from ringfence.actors.tools.testing.redis_server import REDIS_SERVER, redis_server

PORT = 8000  # every server's: ports are per namespace
REDIS_PORT = 6379
BLOCK_SIZE = 16
ROUTER_START_S = 60.0


def instance_sets(redis_url: str, role: str) -> tuple[str, ...]:
    return (
        "model.preset=tiny",
        "model.dtype=float64",
        f"cache.block_size={BLOCK_SIZE}",
        "sched.max_model_len=512",
        f"engine.role={role}",
        *(("sched.preemption=save",) if role == "decode" else ()),
        "cache.storage.backend=redis",
        f"cache.storage.url={redis_url}",
    )


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(5 * BLOCK_SIZE + 3)]  # five full blocks


def complete(hosts: Hosts, url: str, tokens: list[int]) -> dict[str, Any]:
    """A greedy completion of ``tokens`` from ``url``, asked from host "client"."""
    body = {"prompt": tokens, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    answer = hosts.request("client", f"{url}/v1/completions", orjson.dumps(body))
    assert answer.status == 200, answer.body
    result: dict[str, Any] = orjson.loads(answer.body)
    return result


def stored(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["ringfence"]["cached_tokens"]["storage"])


def router(hosts: Hosts, tmp_path: Path, prefill: str, decode: str) -> str:
    """``ringfence router`` in host "router" over the two instances; its URL once ready."""
    out = tmp_path / "router.out"
    with out.open("wb") as sink:
        argv = [str(RINGFENCE), "router", "--prefill", prefill, "--decode", decode,
                "--host", hosts.address("router"), "--port", str(PORT),
                "--prefill-timeout-s", "30"]  # fmt: skip
        proc = hosts.run("router", argv, stdout=sink, stderr=sink, env=launch_env())

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"ringfence router exited: {out.read_text()}")
        return "ringfence router: ready" in out.read_text()

    wait_until("the router's ready line", ready, ROUTER_START_S)
    return f"http://{hosts.address('router')}:{PORT}"


def test_prefill_and_decode_on_two_hosts_hand_over_through_redis_behind_a_router(
    tmp_path: Path,
):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not on PATH (scripts/test installs it as root)")
    with contextlib.ExitStack() as stack:
        hosts = stack.enter_context(
            Hosts("redis", "prefill", "decode", "router", "client", unlinked=("outside",))
        )
        for name in ("redis", "prefill", "decode"):
            (tmp_path / name).mkdir()

        def redis() -> contextlib.AbstractContextManager[str]:
            return redis_server(
                tmp_path / "redis",
                port=REDIS_PORT,
                bind=hosts.address("redis"),
                prefix=hosts.command("redis"),
            )

        first_redis = redis()
        url = first_redis.__enter__()
        try:
            servers = started(
                stack,
                [
                    served(
                        tmp_path / role,
                        *instance_sets(url, role),
                        host=hosts.address(role),
                        port=PORT,
                        prefix=hosts.command(role),
                    )
                    for role in ("prefill", "decode")
                ],
            )
            routed = router(hosts, tmp_path, servers[0].url, servers[1].url)

            # Handed over through redis: the decode host reads every full block but the last.
            tokens = prompt(1)
            answer = complete(hosts, routed, tokens)
            assert stored(answer) == (len(tokens) - 1) // BLOCK_SIZE * BLOCK_SIZE
            direct = complete(hosts, servers[0].url, tokens)
            assert answer["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
        finally:
            first_redis.__exit__(None, None, None)

        # redis down: misses, computed on the decode host, the same tokens.
        tokens = prompt(2)
        answer = complete(hosts, routed, tokens)
        assert stored(answer) == 0
        assert (
            answer["choices"][0]["token_ids"]
            == complete(hosts, servers[0].url, tokens)["choices"][0]["token_ids"]
        )

        # redis back (the same address): the tier serves again once both sides reconnect.
        assert stack.enter_context(redis()) == url
        fresh = iter(range(3, 1000))

        def handed_over() -> bool:
            return stored(complete(hosts, routed, prompt(next(fresh)))) > 0

        wait_until("a hand-over through the restarted redis", handed_over, 60.0)

        # Isolation is real: redis answers the linked hosts only.
        assert hosts.connect("client", hosts.address("redis"), REDIS_PORT) == "connected"
        assert hosts.connect("outside", hosts.address("redis"), REDIS_PORT) == "ENETUNREACH"
