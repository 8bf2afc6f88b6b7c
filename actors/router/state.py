"""The parts of a router process every request shares: its one HTTP client (a pool of
connections to the instances), the checked pool of instances, its options, metrics and log;
for aggregated instances the policy that picks one, and the followers of their KV events
that keep its index."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx

from ringfence.actors.events.subscriber import EventFollower
from ringfence.actors.router.instances import Instance, Pool, open_pool
from ringfence.actors.router.log import RouterLog
from ringfence.actors.router.metrics import Metrics
from ringfence.actors.router.options import RouterOptions
from ringfence.actors.router.policy import Picker, Weights
from ringfence.cache.kv_events import KVEvent
from ringfence.cache.kv_index import KVIndex

# Streams are long-lived: one connection per request in flight, and many kept for reuse.
LIMITS = httpx.Limits(max_connections=4096, max_keepalive_connections=256, keepalive_expiry=30)
TIMEOUT = httpx.Timeout(30.0, connect=5.0)  # each call of the router sets its own read timeout


@dataclass(frozen=True, slots=True, kw_only=True)
class Router:
    """One router. Created on, and used only from, the event loop its server runs on."""

    client: httpx.AsyncClient
    pool: Pool
    options: RouterOptions
    metrics: Metrics
    log: RouterLog
    picker: Picker | None = None  # aggregated instances: the policy
    followers: list[EventFollower] = field(default_factory=list)

    @property
    def aggregated(self) -> bool:
        return self.picker is not None

    async def aclose(self) -> None:
        for follower in self.followers:
            await asyncio.to_thread(follower.close)
        await self.client.aclose()


async def open_router(options: RouterOptions, log: RouterLog | None = None) -> Router:
    """A router on the running loop, once every instance answered and the pool was checked
    (PoolRefused, StartTimeout: the client is closed again)."""
    # trust_env=False: instances are reached directly, never through an HTTP(S)_PROXY.
    client = httpx.AsyncClient(limits=LIMITS, timeout=TIMEOUT, trust_env=False)
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
    if not options.instances:
        return Router(client=client, pool=pool, options=options, metrics=metrics, log=log)
    index = KVIndex() if options.policy == "cache" else None
    picker = Picker(
        options.policy, pool.of_role("both"), index, Weights(overlap=options.overlap_weight)
    )
    followers = []
    if index is not None:
        loop = asyncio.get_running_loop()
        for instance in pool.of_role("both"):
            follower = follow(instance, index, loop, log)
            if follower is not None:
                followers.append(follower)
    return Router(
        client=client, pool=pool, options=options, metrics=metrics, log=log, picker=picker,
        followers=followers,
    )  # fmt: skip


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
