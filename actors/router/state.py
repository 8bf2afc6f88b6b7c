"""The parts of a router process every request shares: its one HTTP client (a pool of
connections to the instances), the checked pool of instances, its options, metrics and log."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from ringfence.actors.router.instances import Pool, open_pool
from ringfence.actors.router.log import RouterLog
from ringfence.actors.router.metrics import Metrics
from ringfence.actors.router.options import RouterOptions

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

    async def aclose(self) -> None:
        await self.client.aclose()


async def open_router(options: RouterOptions, log: RouterLog | None = None) -> Router:
    """A router on the running loop, once every instance answered and the pool was checked
    (PoolRefused, StartTimeout: the client is closed again)."""
    # trust_env=False: instances are reached directly, never through an HTTP(S)_PROXY.
    client = httpx.AsyncClient(limits=LIMITS, timeout=TIMEOUT, trust_env=False)
    try:
        pool = await open_pool(client, options.prefill, options.decode, options.start_timeout_s)
    except BaseException:
        await client.aclose()
        raise
    metrics = Metrics()
    for instance in pool.instances:
        metrics.watch(f"{instance.role} {instance.url}", instance.count_in_flight)
    return Router(
        client=client, pool=pool, options=options, metrics=metrics, log=log or RouterLog()
    )
