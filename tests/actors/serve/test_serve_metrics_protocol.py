"""The model-server protocol's gauges (actors/serve/metrics.py) under vLLM's names, read
with prometheus_client's own parser while requests stream: each equals ringfence's own
figure in the same scrape, the KV usage lies in [0, 1], and a scrape taken while the
requests run sees them running and the device pool in use."""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

STREAMS = 6


def scrape(server) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            if not sample.labels or set(sample.labels) == {"model_name"}:
                values[sample.name] = sample.value
    return values


def test_vllms_gauges_are_the_instances_state_while_requests_run(tiny_server):
    done = threading.Event()
    errors: list[Any] = []

    def stream_all() -> None:
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True, "stream": True}
        threads = [
            threading.Thread(target=lambda: errors.extend(stream_one(tiny_server, body)))
            for _ in range(STREAMS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        done.set()

    runner = threading.Thread(target=stream_all)
    runner.start()
    busy: dict[str, float] | None = None
    scrapes = 0
    while not done.is_set():
        values = scrape(tiny_server)
        scrapes += 1
        for vllm, ours in (
            ("vllm:num_requests_running", "ringfence_requests_running"),
            ("vllm:num_requests_waiting", "ringfence_requests_waiting"),
            ("vllm:kv_cache_usage_perc", "ringfence_kv_cache_usage"),
            ("vllm:gpu_cache_usage_perc", "ringfence_kv_cache_usage"),
        ):
            assert values[vllm] == values[ours], (vllm, values)
        assert 0.0 <= values["vllm:kv_cache_usage_perc"] <= 1.0
        if values["vllm:num_requests_running"] >= 1 and busy is None:
            busy = values
    runner.join(10)
    assert errors == []
    assert busy is not None, f"no scrape of {scrapes} saw a request running"
    assert busy["vllm:kv_cache_usage_perc"] > 0.0, busy
    assert busy["vllm:num_requests_running"] <= STREAMS


def stream_one(server, body: dict[str, Any]) -> list[str]:
    with server.http() as client, client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return [f"status {r.status_code}"]
        for _ in r.iter_lines():
            pass
    return []
