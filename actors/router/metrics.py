"""The router's Prometheus metrics (``GET /metrics``), all prefixed ``ringfence_router_``.

Every metric lives in the registry of one :class:`Metrics` (not the process-wide
default), so several routers in one test process do not collide.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "ringfence_router"
# Seconds: from 1 ms (a reservation granted at once) to two minutes (a long queued prompt).
STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                 40.0, 80.0, 120.0)  # fmt: skip
# ok: relayed to its end; relayed_error: an instance's error answer (a 400...), as is;
# bad_request: not a JSON object; no_room: 503 after reserve_timeout_s; decode_failed: 502,
# or a stream ended by an error event; client_closed: the client left first; error: a bug.
OUTCOMES = ("ok", "relayed_error", "bad_request", "no_room", "decode_failed", "client_closed",
            "error")  # fmt: skip
WHYS = ("no_instance", "refused", "timeout", "http_error", "bad_answer", "transport")
STAGES = ("reserve", "prefill", "claim_to_first_byte")


class Metrics:
    """The registry and the router's metrics. Observed on the server's event loop."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests", "requests answered, by outcome", ["outcome"], registry=r
        )
        self.fallbacks = Counter(
            f"{PREFIX}_prefill_fallbacks",
            "prefills that failed or were not tried: the decode instance computed the prompt",
            ["why"],
            registry=r,
        )
        self.prefills = Counter(
            f"{PREFIX}_prefills", "prefills that completed in the shared tier", registry=r
        )
        self.reserve_retries = Counter(
            f"{PREFIX}_reserve_retries",
            "reserve calls after a request's first one (no room, or an instance unreachable)",
            registry=r,
        )
        self.expired = Counter(
            f"{PREFIX}_reservations_expired",
            "claims answered reservation_expired (the request reserved again)",
            registry=r,
        )
        self.stage_seconds = Histogram(
            f"{PREFIX}_stage_seconds",
            "seconds per stage of a request: reserve, prefill, claim to first byte",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            f"{PREFIX}_in_flight",
            "requests the router has in flight on each instance",
            ["instance"],
            registry=r,
        )
        for outcome in OUTCOMES:  # every series exists from the start, at 0
            self.requests.labels(outcome=outcome)
        for why in WHYS:
            self.fallbacks.labels(why=why)
        for stage in STAGES:
            self.stage_seconds.labels(stage=stage)

    def watch(self, instance: str, count: Callable[[], int]) -> None:
        """Report ``count()`` as the in-flight gauge of ``instance``."""
        self.in_flight.labels(instance=instance).set_function(count)
