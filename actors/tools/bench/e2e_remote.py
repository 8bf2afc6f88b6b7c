"""``bench e2e --remote MS,...``: fence, lock and sync where the storage tier is remote.

On one machine, storage is a local directory or a redis on loopback, both fast next to a
step, so the legacy design's lock around storage writes costs little there. The seeds'
storage lock was taken around writes to a remote store. So this family puts a
:class:`~ringfence.actors.tools.bench.delay_proxy.DelayProxy` between the instance and a
redis-server the bench starts, once per one-way delay (``--remote``: milliseconds; 0 is
redis on loopback with no proxy), optionally at a bandwidth (``--remote-mbps``). On each
delay it runs, with ``transfer.mode`` fence, lock and sync:

- storage-heavy ``pressure`` (save preemption, write-through), whose store lane writes
  every full block and prefetches every preempted sequence back;
- the long multi-round chat with the tiers on, whose returning turns read their prefixes
  back from storage.

The three modes take turns (their order rotates each round); each launch starts on an
empty database. Reported per delay and workload: each mode's median output tokens/s,
fence/lock and fence/sync, and for the chat the returning turns' TTFT p50 per mode.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ringfence.actors.tools.bench.delay_proxy import DelayProxy
from ringfence.actors.tools.bench.e2e_pairs import Run, long_chat, storage_heavy
from ringfence.actors.tools.bench.e2e_runs import (
    Side,
    flush_redis,
    median,
    percentile_of,
    ratio_of,
    returning_ttfts,
    run_launch,
)

MODES = ("fence", "lock", "sync")
WORKLOADS = ("storage", "chat")


def parse_delays(text: str) -> tuple[float, ...]:
    """``--remote``'s milliseconds ("0,0.5,2,5"); ValueError naming the option otherwise."""
    try:
        delays = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--remote: {text!r} is not a list of milliseconds") from None
    if not delays or any(d < 0 for d in delays):
        raise ValueError(f"--remote: {text!r}: each delay must be >= 0 ms")
    return delays


def remote_run(workload: str, preset: str, requests: int, url: str, mode: str) -> Run:
    """The workload's run on the redis at ``url`` in ``transfer.mode=mode``."""
    on_redis = ("cache.storage.backend=redis", f"cache.storage.url={url}", f"transfer.mode={mode}")
    if workload == "storage":
        return Run("pressure", requests, (*storage_heavy(preset, requests), *on_redis))
    chat = long_chat(preset, requests)
    return Run("chat", chat.requests, (*chat.settings, *on_redis))


@contextlib.contextmanager
def reached(url: str, delay_ms: float, bandwidth: float | None) -> Iterator[str]:
    """The URL an instance uses to reach the redis at ``url`` ``delay_ms`` away: ``url``
    itself at 0 ms with no bandwidth limit, else a proxy's."""
    if not delay_ms and bandwidth is None:
        yield url
        return
    parts = urlsplit(url)
    upstream = (parts.hostname or "127.0.0.1", parts.port or 6379)
    with DelayProxy(upstream, one_way_s=delay_ms / 1000, bandwidth=bandwidth) as proxy:
        yield urlunsplit(parts._replace(netloc=f"127.0.0.1:{proxy.port}"))


def bench_remote(
    preset: str,
    requests: int,
    rounds: int,
    *,
    threads: int,
    timeout: float,
    delays_ms: Sequence[float],
    mbps: float | None = None,
) -> dict[str, Any]:
    """Every delay's rows (see the module's docstring); RunError if a launch fails."""
    from ringfence.actors.tools.testing.redis_server import REDIS_SERVER, redis_server

    if REDIS_SERVER is None:
        return {"rows": [], "skipped": "redis-server is not on PATH"}
    bandwidth = None if mbps is None else mbps * 1e6 / 8
    rows = []
    with tempfile.TemporaryDirectory(prefix="rf-bench-remote-") as tmp:
        folder = Path(tmp)
        (folder / "redis").mkdir()
        with redis_server(folder / "redis") as url:
            for delay in delays_ms:
                with reached(url, delay, bandwidth) as via:
                    sides: dict[str, dict[str, list[Side]]] = {
                        w: {m: [] for m in MODES} for w in WORKLOADS
                    }
                    for round_no in range(rounds):
                        order = MODES[round_no % 3 :] + MODES[: round_no % 3]
                        for workload in WORKLOADS:
                            for mode in order:
                                flush_redis(url)
                                run = remote_run(workload, preset, requests, via, mode)
                                sides[workload][mode].append(
                                    run_launch(run, threads=threads, timeout=timeout, folder=folder)
                                )
                    rows += [_row(delay, mbps, w, sides[w]) for w in WORKLOADS]
    return {"rows": rows, "skipped": None}


def _row(
    delay: float, mbps: float | None, workload: str, sides: dict[str, list[Side]]
) -> dict[str, Any]:
    tps = {m: median([s.output_tokens_per_s for s in runs]) for m, runs in sides.items()}
    row: dict[str, Any] = {
        "delay_ms": delay,
        "mbps": mbps,
        "workload": workload,
        "output_tokens_per_s": tps,
        "fence_over_lock": ratio_of(tps["fence"], tps["lock"]),
        "fence_over_sync": ratio_of(tps["fence"], tps["sync"]),
        "runs": {m: [s.output_tokens_per_s for s in runs] for m, runs in sides.items()},
        "blocks_moved": {
            m: [s.engine.get("blocks", {}) for s in runs] for m, runs in sides.items()
        },
    }
    if workload == "chat":
        row["returning_ttft_p50_s"] = {
            m: median([percentile_of(returning_ttfts(s), 50) for s in runs])
            for m, runs in sides.items()
        }
    return row


def print_remote(remote: dict[str, Any]) -> None:
    """The family's table: a line per delay and workload."""
    if remote.get("skipped"):
        print(f"remote store: skipped ({remote['skipped']})")
        return
    print("remote store (redis through a delay proxy), output tok/s by transfer.mode:")
    head = f"  {'one-way':>8} {'workload':<8}{'fence':>9}{'lock':>9}{'sync':>9}"
    print(f"{head}{'fence/lock':>12}{'fence/sync':>12}  returning TTFT p50 (fence/lock/sync)")
    for row in remote["rows"]:
        t = row["output_tokens_per_s"]
        ttft = row.get("returning_ttft_p50_s")
        shown = "" if ttft is None else "/".join(_fmt(ttft[m], ".3f") for m in MODES) + " s"
        print(
            f"  {row['delay_ms']:>6g}ms {row['workload']:<8}"
            + "".join(f"{_fmt(t[m], '9.1f'):>9}" for m in MODES)
            + f"{_fmt(row['fence_over_lock'], '11.2f')}x{_fmt(row['fence_over_sync'], '11.2f')}x"
            + f"  {shown}"
        )


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
