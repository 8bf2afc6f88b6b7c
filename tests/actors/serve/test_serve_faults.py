"""`ringfence serve` when things go wrong: clients that leave, floods, actors that die.

Each test starts its own server (a real supervisor, engine, Worker and lanes), kills
processes by pid (only this server's), and ends with Ctrl-C, checking that the server
exits 0 and leaves no process and no shared-memory name.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from launching import wait_until
from serving import Server, served

PROMPTS = [[7 + i, 70 + i, 170 - i, 33, 44 + 2 * i, 9] for i in range(16)]
MAX_PENDING = 8


def greedy(server: Server, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    answer = server.post("/v1/completions", body)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["choices"][0]["token_ids"])


async def stream(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion: its status, Retry-After, token ids, chunks and error event."""
    body = {"temperature": 0, "return_token_ids": True, **body, "stream": True}
    out: dict[str, Any] = {"tokens": [], "chunks": 0, "error": None, "done": False}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        out["status"] = response.status_code
        out["retry_after"] = response.headers.get("retry-after")
        if response.status_code != 200:
            out["body"] = orjson.loads(await response.aread())
            return out
        async for line in response.aiter_lines():
            if not line:
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                out["done"] = True
                continue
            event = orjson.loads(data)
            if "error" in event:
                out["error"] = event["error"]
                continue
            out["chunks"] += 1
            out["tokens"] += event["choices"][0]["token_ids"]
    return out


def run_streams(server: Server, bodies: list[dict[str, Any]], during=None) -> list[dict[str, Any]]:
    """Stream every body at once; ``during(results)`` runs in a thread once the first
    token of every accepted stream arrived... or simply alongside, if given."""

    async def main() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=len(bodies) + 4)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            tasks = [asyncio.ensure_future(stream(client, b)) for b in bodies]
            if during is not None:
                await asyncio.to_thread(during)
            return list(await asyncio.gather(*tasks))

    return asyncio.run(main())


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    """One server for the module; each test leaves it serving, nothing pending."""
    tmp = tmp_path_factory.mktemp("serve-faults")
    with served(tmp, "model.preset=tiny", f"server.max_pending={MAX_PENDING}") as server:
        yield server


def test_a_client_that_disconnects_is_aborted_in_the_engine_within_a_step_and_a_flood_gets_429(
    server: Server,
):
    body = {"prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0, "stream": True}
    with server.http() as client, client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = orjson.loads(next(line for line in lines if line).removeprefix("data: "))
        next(line for line in lines if line)  # a second chunk: the request runs
    # The connection is closed: the front end aborts the request in the engine.
    key = f"frontend-0/1/{first['id']}"
    wait_until(
        "the engine to end the request",
        lambda: bool(server.engine_events("request.finish", request=key)),
        30,
    )
    (finish,) = server.engine_events("request.finish", request=key)
    (abort,) = server.frontend_events("server.abort", request=first["id"])
    assert finish["reason"] == "abort" and finish["output_tokens"] < 1500
    # The engine ends the request as the Abort reaches it: after the front end sent it, by
    # the clock every process reads, having made at least the tokens the front end had.
    # How many more it made is what was in flight to the front end when it gave up (the
    # bound of two this test once held failed under load: four tokens were in the ring).
    assert finish["mono_ns"] > abort["mono_ns"], (finish, abort)
    assert finish["output_tokens"] >= abort["output_tokens"], (finish, abort)

    # A flood: 16 long streams at once against max_pending = 8.
    bodies = [{"prompt": PROMPTS[i], "max_tokens": 300} for i in range(16)]
    results = run_streams(server, bodies)
    accepted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    assert len(accepted) + len(refused) == 16 and len(accepted) >= MAX_PENDING and refused
    for no in refused:
        assert no["retry_after"] == "1" and no["body"]["error"]["code"] == "rate_limit_exceeded"
    for yes in accepted:
        assert yes["done"] and yes["error"] is None and len(yes["tokens"]) == 300
    assert "ringfence_requests_pending 0.0" in server.get("/metrics").text
    assert len(greedy(server, PROMPTS[1], 8)) == 8  # served again once the flood passed

    # n choices count n times: past max_pending the request is refused whole, and the
    # choices it had opened are freed.
    many = server.post("/v1/completions", {"prompt": PROMPTS[2], "n": MAX_PENDING + 1})
    assert many.status_code == 429, many.text
    assert "ringfence_requests_pending 0.0" in server.get("/metrics").text
    fits = server.post("/v1/completions", {"prompt": PROMPTS[2], "n": MAX_PENDING, "seed": 1})
    assert fits.status_code == 200 and len(fits.json()["choices"]) == MAX_PENDING


def test_a_worker_then_the_engine_killed_under_load_cost_errors_or_nothing_never_wrong_tokens(
    server: Server,
):
    # Long enough that the kill lands mid-stream; the reference is the same batch run
    # undisturbed (a stream's tokens do not depend on its neighbours: test_serve_api).
    bodies = [{"prompt": p, "max_tokens": 300} for p in PROMPTS[:MAX_PENDING]]
    reference = [r["tokens"] for r in run_streams(server, bodies)]
    assert all(len(tokens) == 300 for tokens in reference)
    health: list[int] = []

    def kill(instance: str, before: float) -> None:
        # Once the streams run (tokens flow), kill the actor by pid, and watch /health
        # go 503 and come back.
        wait_until("tokens to flow", lambda: generated(server) > before + 16, 60)
        server.launch.kill_actor(instance)
        server.wait_health(503, timeout=30)
        health.append(503)
        server.wait_health(200, timeout=120)
        health.append(200)

    for instance in ("worker-0", "engine-0"):
        started = time.monotonic()
        before = generated(server)
        results = run_streams(server, bodies, during=lambda i=instance, b=before: kill(i, b))
        assert health[-2:] == [503, 200]
        for r, want in zip(results, reference, strict=True):
            assert r["status"] == 200 and r["done"], r
            if r["error"] is None:
                assert r["tokens"] == want  # completed: exactly the reference tokens
            else:
                assert r["error"]["message"], r  # ended with a clear error event
                assert r["tokens"] == want[: len(r["tokens"])]
        if instance == "engine-0":  # the requests in the dead engine are lost: said so
            assert any(r["error"] for r in results), time.monotonic() - started
        # Served again, with the right tokens.
        assert greedy(server, PROMPTS[0], 300) == reference[0]
    assert 'ringfence_restarts_total{actor="worker-0"} 1.0' in server.get("/metrics").text


def generated(server: Server) -> float:
    """Output tokens the front end has received so far (its metric)."""
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("ringfence_generation_tokens_total "):
            return float(line.split()[1])
    return 0.0
