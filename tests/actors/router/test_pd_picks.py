"""The prefill and decode pickers under the cache policy (``actors/router/flow.py``) over
instances answered in the test's loop: a prompt in flight counts as held where it went,
until its prefill or its request ends however it ends, and never skips a prefill."""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass, field
from typing import Any, cast

import orjson
import pytest

from ringfence.actors.router.flow import Handover, Reservation
from ringfence.actors.router.instances import Identity, Instance, Pool
from ringfence.actors.router.keys import keys_of
from ringfence.actors.router.log import RouterLog
from ringfence.actors.router.metrics import Metrics
from ringfence.actors.router.options import RouterOptions
from ringfence.actors.router.policy import Picker
from ringfence.actors.router.state import Router
from ringfence.actors.router.upstream import JSON, Answer, ConnectError, Upstream
from ringfence.cache.ids import BlockHash
from ringfence.cache.kv_events import BlockStored
from ringfence.cache.kv_index import KVIndex

BLOCK = 16
EVENTS = ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")  # never followed: the test feeds the index
WAIT_S = 5.0  # the longest a test waits for a call to reach an instance


def prompt(seed: int, blocks: int = 4) -> list[int]:
    """Token ids of ``blocks`` full blocks, a prefix of its own for each ``seed``."""
    return [seed * 1000 + k for k in range(blocks * BLOCK)]


def identity(role: str) -> Identity:
    return Identity(
        role=role, model="m", fingerprints=("ab",), namespace="00" * 16, block_size=BLOCK,
        events=EVENTS,
    )  # fmt: skip


@dataclass
class Calls:
    """The router's calls to its instances, answered in the test's loop: a reserve is
    granted with the prompt's ids (once ``reserve_gate``, if any, opens), a prefill answered
    once its request's gate (if any) opens; an instance in ``failing`` answers that status,
    or 0: ConnectError."""

    calls: list[tuple[str, str]] = field(default_factory=list)  # (instance, route)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)  # prefills, by request id
    reserve_gate: asyncio.Event | None = None
    failing: dict[str, int] = field(default_factory=dict)  # by instance URL
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    granted: int = 0

    async def post(self, url: str, body: bytes, *, timeout: float, headers: Any = JSON) -> Answer:
        base, route = url.split("/ringfence/")
        self.calls.append((base, route))
        self.arrived.set()
        request = orjson.loads(body)
        if route == "prefill" and request["request_id"] in self.gates:
            await self.gates[request["request_id"]].wait()
        if route == "reserve" and self.reserve_gate is not None:
            await self.reserve_gate.wait()
        status = self.failing.get(base, 200)
        if status == 0:
            raise ConnectError(f"{base}: connection refused")
        if status != 200:
            return Answer(url, status, {}, b'{"error": {"code": "no_room"}}')
        if route == "reserve":
            self.granted += 1
            ids = request["body"]["prompt"]
            grant = {"reservation_id": f"rsv-{self.granted}", "ttl_s": 10.0,
                     "prompt_token_ids": ids}  # fmt: skip
            return Answer(url, 200, {}, orjson.dumps(grant))
        n = len(request["prompt_token_ids"])
        return Answer(url, 200, {}, orjson.dumps({"stored_blocks": n // BLOCK}))

    async def reached(self, route: str, n: int) -> None:
        """Until ``n`` calls of ``route`` have come (AssertionError after WAIT_S)."""
        async with asyncio.timeout(WAIT_S):
            while sum(r == route for _, r in self.calls) < n:
                self.arrived.clear()
                await self.arrived.wait()


@dataclass
class Rig:
    """A router over ``p0...`` and ``d0...`` under the cache policy, as open_router makes
    it where the instances publish events, with :class:`Calls` for its client."""

    router: Router
    calls: Calls
    prefill: list[Instance]
    decode: list[Instance]
    index: KVIndex

    def picker(self, role: str) -> Picker:
        return self.router.pd[role]

    def handover(self, request_id: str, ids: list[int]) -> Handover:
        body = {"prompt": ids, "max_tokens": 3}
        return Handover(self.router, "completions", orjson.dumps(body), body, request_id)

    def reservation(self, ids: list[int]) -> Reservation:
        """A reservation of ``ids`` on d0, as if granted (for a prefill alone)."""
        return Reservation(instance=self.decode[0], id="rsv", ttl_s=10.0, prompt_token_ids=ids)


def pd_rig(prefill: int = 2, decode: int = 1, **options: Any) -> Rig:
    ps = [Instance(f"http://p{k}", "prefill", identity("prefill")) for k in range(prefill)]
    ds = [Instance(f"http://d{k}", "decode", identity("decode")) for k in range(decode)]
    index, calls = KVIndex(), Calls()
    router = Router(
        client=cast(Upstream, calls),
        pool=Pool([*ps, *ds]),
        options=RouterOptions(
            prefill=tuple(i.url for i in ps), decode=tuple(i.url for i in ds), **options
        ),
        metrics=Metrics(),
        log=RouterLog(io.StringIO()),
        index=index,
        pd={"prefill": Picker("cache", ps, index), "decode": Picker("cache", ds, index)},
    )
    return Rig(router, calls, ps, ds, index)


def keys(ids: list[int]) -> list[BlockHash]:
    return keys_of(identity("decode"), ids)


def test_two_requests_of_one_new_prefix_in_a_burst_prefill_on_the_same_instance():
    async def burst() -> None:
        rig = pd_rig(prefill=2)
        first, again = rig.handover("r1", prompt(1)), rig.handover("r2", prompt(1))
        other = rig.handover("r3", prompt(2))
        for request in ("r1", "r2", "r3"):
            rig.calls.gates[request] = asyncio.Event()
        p0, p1 = rig.prefill
        tasks = [asyncio.ensure_future(first.prefill(rig.reservation(prompt(1))))]
        await rig.calls.reached("prefill", 1)
        assert rig.picker("prefill").flying(p0, keys(prompt(1))) == 4
        # No event says where its blocks are: the first one's prefill holds them on p0.
        tasks.append(asyncio.ensure_future(again.prefill(rig.reservation(prompt(1)))))
        await rig.calls.reached("prefill", 2)
        # Another prefix in the same burst goes where no prefill runs.
        tasks.append(asyncio.ensure_future(other.prefill(rig.reservation(prompt(2)))))
        await rig.calls.reached("prefill", 3)
        assert rig.calls.calls == [(p0.url, "prefill"), (p0.url, "prefill"),
                                       (p1.url, "prefill")]  # fmt: skip
        assert (first.trace["prefill_cached"], again.trace["prefill_cached"]) == (0.0, 4.0)
        for gate in rig.calls.gates.values():
            gate.set()
        await asyncio.gather(*tasks)

    asyncio.run(burst())


def test_a_prompt_no_longer_counts_on_its_prefill_instance_once_its_prefill_ended():
    async def two_turns() -> None:
        rig = pd_rig(prefill=2)
        p0, p1 = rig.prefill
        first = rig.handover("r1", prompt(1))
        rig.calls.gates["r1"] = asyncio.Event()
        task = asyncio.ensure_future(first.prefill(rig.reservation(prompt(1))))
        await rig.calls.reached("prefill", 1)
        assert rig.picker("prefill").flying(p0, keys(prompt(1))) == 4
        rig.calls.gates["r1"].set()
        await task
        assert first.trace["stored_blocks"] == 4
        assert rig.picker("prefill").flying(p0, keys(prompt(1))) == 0
        assert p0.in_flight == 0
        # Held nowhere now (no event came): the next one of the prefix goes in turn, to p1.
        await rig.handover("r2", prompt(1)).prefill(rig.reservation(prompt(1)))
        assert rig.calls.calls == [(p0.url, "prefill"), (p1.url, "prefill")]

    asyncio.run(two_turns())


@pytest.mark.parametrize("how", ["http_error", "refused", "timeout", "cancelled"])
def test_a_prefill_that_fails_or_is_cancelled_stops_counting_its_prompt(how: str):
    async def failed() -> None:
        rig = pd_rig(prefill=2, prefill_timeout_s=0.05)
        p0 = rig.prefill[0]
        request = rig.handover("r1", prompt(1))
        gate = rig.calls.gates["r1"] = asyncio.Event()
        task = asyncio.ensure_future(request.prefill(rig.reservation(prompt(1))))
        await rig.calls.reached("prefill", 1)
        assert rig.picker("prefill").flying(p0, keys(prompt(1))) == 4
        if how == "cancelled":  # the client left: the app cancels the run
            task.cancel()
        elif how != "timeout":  # (the gate is never opened: the deadline passes)
            rig.calls.failing[p0.url] = 503 if how == "http_error" else 0
            gate.set()
        await asyncio.gather(task, return_exceptions=True)
        assert request.trace.get("fallback") == (None if how == "cancelled" else how)
        assert rig.picker("prefill").flying(p0, keys(prompt(1))) == 0
        assert p0.in_flight == 0

    asyncio.run(failed())


def test_a_request_reserved_on_a_decode_instance_draws_the_next_of_its_prefix_until_it_ends():
    async def burst() -> None:
        rig = pd_rig(prefill=1, decode=2)
        d0, d1 = rig.decode
        first = rig.handover("r1", prompt(1))
        reservation = await first.reserve(prefer=await first.cached_decode())
        assert reservation.instance is d0
        assert rig.picker("decode").flying(d0, keys(prompt(1))) == 4
        # d0 has a request in flight and d1 none; the prompt's blocks are coming to d0.
        assert await rig.handover("r2", prompt(1)).cached_decode() is d0
        assert await rig.handover("r3", prompt(2)).cached_decode() is d1
        await first.finish("ok", 200)
        assert rig.picker("decode").flying(d0, keys(prompt(1))) == 0
        assert d0.in_flight == 0

    asyncio.run(burst())


@pytest.mark.parametrize("status", [503, 0])
def test_a_reserve_refused_or_unreached_stops_counting_the_prompt_there(status: int):
    async def refused() -> None:
        rig = pd_rig(prefill=1, decode=2)
        d0, d1 = rig.decode
        rig.calls.failing[d0.url] = status
        request = rig.handover("r1", prompt(1))
        reservation = await request.reserve(prefer=await request.cached_decode())
        assert reservation.instance is d1
        decode = rig.picker("decode")
        assert (decode.flying(d0, keys(prompt(1))), decode.flying(d1, keys(prompt(1)))) == (0, 4)
        assert (d0.in_flight, d1.in_flight) == (0, 1)
        await request.finish("ok", 200)
        assert decode.flying(d1, keys(prompt(1))) == 0

    asyncio.run(refused())


def test_a_request_whose_client_left_during_its_reserve_stops_counting_once_finished():
    async def left() -> None:
        rig = pd_rig(prefill=1, decode=1)
        (d0,) = rig.decode
        request = rig.handover("r1", prompt(1))
        rig.calls.reserve_gate = asyncio.Event()  # never opened
        task = asyncio.ensure_future(request.run())
        await rig.calls.reached("reserve", 1)
        assert rig.picker("decode").flying(d0, keys(prompt(1))) == 4
        task.cancel()  # as the app does when the client goes, then it finishes the request
        await asyncio.gather(task, return_exceptions=True)
        await request.finish("client_closed", 499)
        assert rig.picker("decode").flying(d0, keys(prompt(1))) == 0
        assert d0.in_flight == 0

    asyncio.run(left())


def test_a_prompt_in_flight_on_the_decode_instance_never_skips_a_prefill():
    async def burst() -> None:
        rig = pd_rig(prefill=1, decode=1)
        (d0,), (p0,) = rig.decode, rig.prefill
        first = rig.handover("r1", prompt(1))
        await first.reserve(prefer=await first.cached_decode())
        assert rig.picker("decode").flying(d0, keys(prompt(1))) == 4
        # The first one's blocks are not stored yet: the second is prefilled all the same.
        again = rig.handover("r2", prompt(1))
        reservation = await again.reserve(prefer=await again.cached_decode())
        assert again.trace["decode_cached"] == 4.0
        await again.prefill(reservation)
        assert "prefill_skipped" not in again.trace
        assert rig.calls.calls[-1] == (p0.url, "prefill")
        # Once d0's events say it holds every full block, the next one is not.
        held = tuple(keys(prompt(1)))
        rig.index.apply(d0.url, BlockStored(keys=held, parent=None, token_ids=(),
                                            block_size=BLOCK, medium="GPU"))  # fmt: skip
        last = rig.handover("r3", prompt(1))
        await last.prefill(await last.reserve(prefer=await last.cached_decode()))
        assert last.trace["prefill_skipped"] is True
        assert rig.calls.calls[-1] == (d0.url, "reserve")

    asyncio.run(burst())
