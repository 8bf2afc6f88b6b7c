"""The front end's Prometheus metrics (``GET /metrics``), prefixed ``ringfence_``, and the
few that schedulers built for vLLM scrape, under vLLM's names.

Three sources: what the front end measures itself per request (latencies and token
counts, from the engine's output as it arrives); the engine's own state, from the latest
``Stats`` message it sent (requests running and waiting, preemptions, lanes, blocks); and
the run's control block (which actors are up, how often each restarted). The engine's
counters are its own since it started: a restarted engine starts them again at 0, which
Prometheus' ``rate`` reads as a counter reset.

The Gateway API Inference Extension's model-server protocol (what llm-d's and the
inference gateway's endpoint pickers scrape) asks for three gauges: requests queued,
requests running, and the KV cache's utilization in [0, 1]. They are given under vLLM's
names, with vLLM's ``model_name`` label, from the same Stats as ringfence's own:
``vllm:num_requests_waiting`` (= ``ringfence_requests_waiting``: waiting for admission,
preempted ones included), ``vllm:num_requests_running`` (= ``ringfence_requests_running``),
and ``vllm:kv_cache_usage_perc`` (= ``ringfence_kv_cache_usage``: device blocks in use over
all device blocks; free blocks that still hold cached KV count as free, as in vLLM), also
as ``vllm:gpu_cache_usage_perc``, vLLM's older name. So a ringfence instance can be
scheduled by them like a vLLM pod.

Every metric lives in the registry of one :class:`Metrics` (not the process-wide
default), so several servers in one test process do not collide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ringfence.sched.request import TIERS

PREFIX = "ringfence"
# Seconds: from 1 ms (a decode step on a small model) to a minute (a queued long prompt).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Metrics:
    """The registry and the front end's own metrics. Any thread may observe."""

    def __init__(
        self,
        *,
        pending: Callable[[], int],
        stats: Callable[[], Any],
        restarts: Callable[[], Mapping[str, int]],
        down: Callable[[], list[str]],
        model_name: str = "",
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        Gauge(
            f"{PREFIX}_requests_pending",
            "Requests the front end has in the engine (server.max_pending bounds it)",
            registry=r,
        ).set_function(pending)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Seconds from a request's arrival at the front end to its first output token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Seconds between consecutive output tokens of a request",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Seconds from a request's arrival to its last output token",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Output tokens produced", registry=r
        )
        self.cached_tokens = Counter(
            f"{PREFIX}_cached_tokens",
            "Prompt tokens served from a cache tier instead of computed",
            ["tier"],
            registry=r,
        )
        for tier in TIERS:
            self.cached_tokens.labels(tier=tier)
        self.finished = Counter(
            f"{PREFIX}_requests_finished",
            "Requests that ended, by how (stop, length, abort, error)",
            ["reason"],
            registry=r,
        )
        self.rejected = Counter(
            f"{PREFIX}_requests_rejected",
            "HTTP requests answered with an error status, by status",
            ["status"],
            registry=r,
        )
        r.register(_InstanceCollector(stats, restarts, down, model_name))


class _InstanceCollector(Collector):
    """The engine's latest Stats and the control block, read at scrape time."""

    def __init__(
        self,
        stats: Callable[[], Any],
        restarts: Callable[[], Mapping[str, int]],
        down: Callable[[], list[str]],
        model_name: str,
    ) -> None:
        self._stats = stats
        self._restarts = restarts
        self._down = down
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        restarts = self._restarts()
        down = set(self._down())
        up = GaugeMetricFamily(f"{PREFIX}_actor_up", "1 while the actor is live", labels=["actor"])
        again = CounterMetricFamily(
            f"{PREFIX}_restarts", "Times the supervisor restarted the actor", labels=["actor"]
        )
        for name, count in restarts.items():
            up.add_metric([name], 0.0 if name in down else 1.0)
            again.add_metric([name], count)
        yield up
        yield again
        stats = self._stats()
        if stats is None:
            return
        yield _gauge("requests_running", "Requests the scheduler runs now", stats.running)
        yield _gauge(
            "requests_waiting", "Requests waiting for admission, preempted ones included",
            stats.waiting,
        )  # fmt: skip
        yield _counter("steps", "Model steps the engine completed", stats.steps)
        yield _labelled(
            CounterMetricFamily, "preemptions", "Requests preempted, by policy", "policy",
            stats.preemptions,
        )  # fmt: skip
        yield _labelled(
            CounterMetricFamily, "lane_ops", "Ops completed per lane", "lane", stats.ops
        )
        yield _labelled(
            CounterMetricFamily, "lane_bytes", "KV bytes moved per lane and direction",
            "direction", stats.bytes,
        )  # fmt: skip
        yield _labelled(
            GaugeMetricFamily, "lane_ops_in_flight", "Ops issued and not yet done, per lane",
            "lane", stats.in_flight,
        )  # fmt: skip
        yield _labelled(
            GaugeMetricFamily, "kv_blocks_used", "KV cache blocks in use, per tier", "tier",
            stats.blocks_used,
        )  # fmt: skip
        yield _labelled(
            GaugeMetricFamily, "kv_blocks_total", "KV cache blocks, per tier", "tier",
            stats.blocks_total,
        )  # fmt: skip
        yield _labelled(
            CounterMetricFamily, "engine_hit_tokens",
            "Prompt tokens the engine served from each tier since it started", "tier",
            stats.hit_tokens,
        )  # fmt: skip
        total = stats.blocks_total.get("device", 0)
        usage = stats.blocks_used.get("device", 0) / total if total else 0.0
        yield _gauge("kv_cache_usage", "Device KV blocks in use over all of them, in [0, 1]", usage)
        yield from self._vllm_names(stats.waiting, stats.running, usage)

    def _vllm_names(self, waiting: int, running: int, usage: float) -> Iterator[Metric]:
        """The model-server protocol's gauges under vLLM's names (see the module docstring)."""
        for name, doc, value in (
            ("num_requests_waiting", "Requests waiting to be processed", waiting),
            ("num_requests_running", "Requests running on the model", running),
            ("kv_cache_usage_perc", "KV cache usage, 1 = full", usage),
            ("gpu_cache_usage_perc", "KV cache usage, 1 = full (vLLM's older name)", usage),
        ):
            family = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            family.add_metric([self._model], value)
            yield family


def _gauge(name: str, doc: str, value: float) -> Metric:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _counter(name: str, doc: str, value: float) -> Metric:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _labelled(
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
    name: str,
    doc: str,
    label: str,
    values: Mapping[str, int],
) -> Metric:
    family = kind(f"{PREFIX}_{name}", doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family
