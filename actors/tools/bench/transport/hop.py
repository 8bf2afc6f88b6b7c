"""``ringfence bench hop``: messages per second through a supervised actor hop vs the bare ring.

Each round measures, side by side in one run:

- ``ring``: the bare ring of ``bench ring``: this process streams frames of the
  demo item's encoded size to a spawned peer that drains them in batches;
- ``hop info`` and ``hop trace``: ``ringfence launch`` of the one-hop demo topology
  (``ringfence.actors.tools.testing.demo:HOP``: source -> sink, both spawned by the supervisor,
  shared-memory mailboxes) at log level ``info`` and ``trace``. The rate is the
  sink's own (``demo.done``: first to last item), so process start-up is excluded.
  It includes what an actor pays per message: encode, decode and validate, dispatch,
  the demo's checksum and watermark, and a commit per message (durable consumption).

Then it times the log calls themselves in this process. Medians over the rounds
are reported with the ratios ``hop / ring`` and ``trace / info``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson

from ringfence.actors.tools.bench.transport.link import Link, Session
from ringfence.actors.tools.bench.transport.ring import stream
from ringfence.actors.tools.testing.demo import DEMO, make_item
from ringfence.runtime.config import load_config
from ringfence.runtime.log import ActorLog
from ringfence.runtime.supervisor import Supervisor
from ringfence.shm import names

LOG_CALLS = 20_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument("--quick", action="store_true", help="few messages, one round (tests)")
    parser.add_argument("--messages", type=int, help="items per measurement (200000; quick 5000)")
    parser.add_argument("--rounds", type=int, help="rounds, medians reported (3; quick 1)")
    parser.add_argument("--payload-bytes", type=int, default=64, help="item data: %(default)s")


def _bare_ring(run_id: str, size: int, count: int) -> float:
    """Messages per second of ``count`` frames of ``size`` bytes through a bare ring."""
    session = Session(
        ctx=multiprocessing.get_context("spawn"),
        run_id=run_id,
        tag=f"hop.ring.{time.monotonic_ns()}",
        spin_us=50.0,
        peer_timeout_s=120.0,
        session_limit_s=300.0,
        cpus=tuple(sorted(os.sched_getaffinity(0))),
    )
    with ExitStack() as stack:
        link = Link(session, stack, "ringfence", None)
        stream(link, size, 10.0, min(count, 2000))  # warm-up
        sent, seconds = stream(link, size, 3600.0, count)
        link.quit()
    return sent / seconds


def _hop(workdir: Path, level: str, count: int, payload: int, round_no: int) -> float:
    """Messages per second the sink of a launched one-hop demo run reports."""
    config = load_config(
        overrides=[
            "runtime.topology=ringfence.actors.tools.testing.demo:HOP",
            f"demo.messages={count}",
            f"demo.payload_bytes={payload}",
            f"runtime.log_level={level}",
        ]
    )
    run_dir = workdir / f"hop-{level}-{round_no}"
    status = Supervisor(config, run_dir).run()
    if status != 0:
        raise RuntimeError(f"hop run at {level} exited with status {status}; see {run_dir}")
    for line in (run_dir / "sink-0.jsonl").read_bytes().splitlines():
        event = orjson.loads(line)
        if event["event"] == "demo.done":
            return float(event["received"]) / float(event["elapsed_s"])
    raise RuntimeError(f"{run_dir}: the sink logged no demo.done")


def _per_call_ns(fn: Any, calls: int) -> float:
    start = time.perf_counter_ns()
    for i in range(calls):
        fn(i)
    return (time.perf_counter_ns() - start) / calls


def _log_costs(workdir: Path) -> dict[str, float]:
    """Nanoseconds per log call: a trace event with tracing off (guarded and not), and written."""
    costs: dict[str, float] = {}
    for level in ("info", "trace"):
        log = ActorLog(workdir / f"log-{level}.jsonl", actor="bench", rank=0, epoch=0, level=level)
        try:

            def guarded(i: int, log: ActorLog = log) -> None:
                if log.tracing:
                    log.trace("msg.recv", peer="source-0", seq=i, type="Item")

            def unguarded(i: int, log: ActorLog = log) -> None:
                log.trace("msg.recv", peer="source-0", seq=i, type="Item")

            costs[f"trace_guarded_{level}_ns"] = _per_call_ns(guarded, LOG_CALLS)
            costs[f"trace_unguarded_{level}_ns"] = _per_call_ns(unguarded, LOG_CALLS)
        finally:
            log.close()
    return costs


def main(args: argparse.Namespace) -> int:
    count = args.messages if args.messages is not None else 5000 if args.quick else 200_000
    rounds = args.rounds if args.rounds is not None else 1 if args.quick else 3
    if count < 1 or rounds < 1 or not 0 <= args.payload_bytes <= 65536:
        raise ValueError("--messages and --rounds must be >= 1, --payload-bytes 0..65536")
    size = len(DEMO.encode(make_item(count, args.payload_bytes))[1])
    run_id = names.new_run_id()
    print(f"ringfence bench hop: {count} items of {size} encoded bytes, {rounds} round(s)")
    samples: dict[str, list[float]] = {"ring": [], "hop_info": [], "hop_trace": []}
    names.write_lease(run_id)
    try:
        with tempfile.TemporaryDirectory(prefix="ringfence-bench-hop-") as tmp:
            workdir = Path(tmp)
            for r in range(rounds):
                samples["ring"].append(_bare_ring(run_id, size, count))
                samples["hop_info"].append(_hop(workdir, "info", count, args.payload_bytes, r))
                samples["hop_trace"].append(_hop(workdir, "trace", count, args.payload_bytes, r))
                print(
                    f"round {r + 1}: "
                    + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in samples.items())
                )
            log_costs = _log_costs(workdir)
    finally:
        names.remove_lease(run_id)
    median = {k: statistics.median(v) for k, v in samples.items()}
    ratios = {
        "hop_info_over_ring": median["hop_info"] / median["ring"],
        "hop_trace_over_hop_info": median["hop_trace"] / median["hop_info"],
    }
    print(f"bare ring           {median['ring']:>12,.0f} msg/s")
    print(
        f"actor hop, info     {median['hop_info']:>12,.0f} msg/s  "
        f"{ratios['hop_info_over_ring']:.3f}x the bare ring"
    )
    print(
        f"actor hop, trace    {median['hop_trace']:>12,.0f} msg/s  "
        f"{ratios['hop_trace_over_hop_info']:.3f}x the info rate"
    )
    for key, ns in log_costs.items():
        print(f"log: {key:<28} {ns:>9,.0f} ns/call")
    if args.json is not None:
        report = {"messages": count, "encoded_bytes": size, "rounds": rounds, "samples": samples}
        report |= {"median_msgs_per_s": median, "ratios": ratios, "log_ns": log_costs}
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0
