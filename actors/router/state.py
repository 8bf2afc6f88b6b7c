"""The parts of a router process every request shares: its one HTTP client (a pool of
connections to the instances, ``upstream.py``), the checked pool of instances, its options,
metrics and log; for aggregated instances the policy that picks one, and the followers of
their KV events that keep its index.

An aggregated instance found dead (a request could not reach it) is routed around and its
index entries dropped; a task then asks its ``/ringfence/instance`` again (waits doubling
up to a second, each call with a deadline) until it answers as the same model, serving.
Then it is followed afresh (a restarted instance may publish on other ports; its new
engine's first batch clears what it held) and routed to again (``router.instance_up``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from ringfence.actors.events.subscriber import EventFollower
from ringfence.actors.http.load import Load
from ringfence.actors.router.instances import (
    FIRST_WAIT_S,
    IDENTIFY_CALL_S,
    MAX_WAIT_S,
    Identity,
    Instance,
    Pool,
    PoolRefused,
    identify,
    open_pool,
    secret_name,
)
from ringfence.actors.router.log import RouterLog
from ringfence.actors.router.metrics import Metrics
from ringfence.actors.router.options import RouterOptions
from ringfence.actors.router.policy import Picker, Weights
from ringfence.actors.router.upstream import TransportError, Upstream
from ringfence.cache.kv_events import KVEvent
from ringfence.cache.kv_index import KVIndex

LOAD_WAIT_S = 5.0  # how long an instance may hold a GET /ringfence/load with no change
LOAD_FIELDS = ("pending", "running", "waiting", "reservations", "free_blocks", "total_blocks")
REVIVE_S = 24 * 3600.0  # how long an instance found dead is asked for (then again)
REFUSED_WAIT_S = 5.0  # before asking again an instance that came back as another one


@dataclass(frozen=True, slots=True, kw_only=True)
class Router:
    """One router. Created on, and used only from, the event loop its server runs on."""

    client: Upstream
    pool: Pool
    options: RouterOptions
    metrics: Metrics
    log: RouterLog
    picker: Picker | None = None  # aggregated instances: the policy
    index: KVIndex | None = None  # the cache policy's, kept by the followers
    followers: dict[str, EventFollower] = field(default_factory=dict)  # by instance URL
    revivals: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # instances down
    loads: list[asyncio.Task[None]] = field(default_factory=list)  # following each one's load
    pd: dict[str, Picker] = field(default_factory=dict)  # prefill, decode: the cache policy's

    @property
    def aggregated(self) -> bool:
        return self.picker is not None

    def lost(self, instance: Instance, request: str, error: str) -> None:
        """``instance`` could not be reached by ``request``: route around it, forget what it
        held, and ask it again until it is back (see the module docstring)."""
        assert self.picker is not None
        self.picker.mark_down(instance)
        self.log.warning(
            "router.instance_down", request=request, instance=instance.url, error=error
        )
        if instance.url not in self.revivals:
            task = asyncio.ensure_future(self._revive(instance))
            self.revivals[instance.url] = task

    async def _revive(self, instance: Instance) -> None:
        assert self.picker is not None
        try:
            while True:
                try:
                    ident = await identify(self.client, instance.url, time.monotonic() + REVIVE_S)
                    why = _differs(instance.identity, ident)
                except PoolRefused as e:  # it answers, but not as an instance
                    why = str(e)
                if why is None:
                    break
                self.log.warning("router.instance_refused", instance=instance.url, why=why)
                await asyncio.sleep(REFUSED_WAIT_S)
            instance.identity = ident
            old = self.followers.pop(instance.url, None)
            if old is not None:
                await asyncio.to_thread(old.close)
            if self.index is not None:
                self.index.clear(instance.url)  # what the old follower handed on late
                follower = follow(instance, self.index, asyncio.get_running_loop(), self.log)
                if follower is not None:
                    self.followers[instance.url] = follower
            self.picker.mark_up(instance)
            self.log.info("router.instance_up", instance=instance.url)
        finally:
            self.revivals.pop(instance.url, None)

    async def follow_load(self, instance: Instance) -> None:
        """Keep ``instance.load`` to its own word: ``GET /ringfence/load`` as a long poll
        (an answer as soon as its load changed, else every ``LOAD_WAIT_S``). Unreachable, it
        has no word (None) and is asked again after a wait doubling up to a second; an
        instance without the route is weighed by the router's own count alone."""
        seq, wait = 0, FIRST_WAIT_S
        while True:
            try:
                answer = await self.client.get(
                    f"{instance.url}/ringfence/load?after={seq}&wait_s={LOAD_WAIT_S}",
                    timeout=LOAD_WAIT_S + IDENTIFY_CALL_S,
                )
                if answer.status == 404:
                    self.log.warning("router.no_load", instance=instance.url)
                    return
                if answer.status == 200:
                    body = answer.json()
                    seq = int(body["seq"])
                    instance.load = Load(**{k: int(body.get(k, 0)) for k in LOAD_FIELDS})
                    instance.in_flight_at_load = instance.in_flight
                    instance.unstarted_at_load = instance.unstarted
                    wait = FIRST_WAIT_S
                    continue
                instance.load = None  # not serving now (an error answer)
            except (TransportError, TypeError, KeyError, ValueError):
                instance.load = None  # gone, or an answer not of an instance: no word now
            await asyncio.sleep(wait)
            wait = min(wait * 2, MAX_WAIT_S)

    async def aclose(self) -> None:
        for task in [*self.revivals.values(), *self.loads]:
            task.cancel()
        await asyncio.gather(*self.revivals.values(), *self.loads, return_exceptions=True)
        await asyncio.gather(*(asyncio.to_thread(f.close) for f in self.followers.values()))
        await self.client.aclose()


async def open_router(options: RouterOptions, log: RouterLog | None = None) -> Router:
    """A router on the running loop, once every instance answered and the pool was checked
    (PoolRefused, StartTimeout: the client is closed again)."""
    client = Upstream(options.instance_key, options.instance_tls())
    try:
        pool = await open_pool(
            client, options.prefill, options.decode, options.start_timeout_s, options.instances
        )
    except BaseException:
        await client.aclose()
        raise
    metrics = Metrics()
    for instance in pool.instances:
        metrics.watch(f"{instance.role} {instance.url}", instance.count_in_flight)
    log = log or RouterLog()
    index = KVIndex() if options.policy == "cache" else None
    followers = {}
    if index is not None:
        loop = asyncio.get_running_loop()
        for instance in pool.instances:
            follower = follow(instance, index, loop, log)
            if follower is not None:
                followers[instance.url] = follower
    weights = Weights(overlap=options.overlap_weight)
    if not options.instances:
        # Prefill and decode: by their cached prefixes where any publishes events, else
        # (and under the other policies) by the router's count in flight (Pool.pick).
        pd = {}
        if index is not None and followers:
            pd = {role: Picker("cache", pool.of_role(role), index, weights)
                  for role in ("prefill", "decode")}  # fmt: skip
        return Router(
            client=client, pool=pool, options=options, metrics=metrics, log=log,
            index=index, followers=followers, pd=pd,
        )  # fmt: skip
    picker = Picker(options.policy, pool.of_role("both"), index, weights)
    router = Router(
        client=client, pool=pool, options=options, metrics=metrics, log=log, picker=picker,
        index=index, followers=followers,
    )  # fmt: skip
    if options.policy != "round_robin":
        for instance in pool.of_role("both"):
            router.loads.append(asyncio.ensure_future(router.follow_load(instance)))
    return router


def follow(
    instance: Instance, index: KVIndex, loop: asyncio.AbstractEventLoop, log: RouterLog
) -> EventFollower | None:
    """A follower of ``instance``'s KV events into ``index`` (its batches applied on the
    router's loop), or None when the instance publishes none (logged: it is scored as
    holding nothing)."""
    ends = instance.identity.events
    if ends is None:
        log.warning("router.no_events", instance=instance.url)
        return None
    name = instance.url

    def on_batch(events: list[KVEvent]) -> None:
        loop.call_soon_threadsafe(index.apply_all, name, events)

    def on_reset() -> None:
        loop.call_soon_threadsafe(index.clear, name)

    return EventFollower(ends[0], ends[1], on_batch=on_batch, on_reset=on_reset).start()


def _differs(was: Identity, now: Identity) -> str | None:
    """Why an instance that answers again is not the one the pool was checked with (another
    role or model, or fingerprints, or storage secret), or not serving yet; None when it may
    take requests."""
    if now.role != was.role:
        return f"its role is {now.role!r}, not {was.role!r}"
    if now.salt_by_key:
        return "it salts requests by API key (server.salt_by_key): salt by key at the router"
    if now.fingerprints != was.fingerprints:
        return (f"its fingerprints [{', '.join(now.fingerprints)}] are not the pool's "
                f"[{', '.join(was.fingerprints)}]")  # fmt: skip
    if now.secret_id != was.secret_id:
        return f"its storage secret ({secret_name(now)}) is not the pool's ({secret_name(was)})"
    if not now.serving:
        return "it is not serving yet"
    return None
