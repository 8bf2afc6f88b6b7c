"""``ringfence bench e2e``: whole workloads through the actor pipeline, pair by pair.

Each pair runs the same synthetic workload (its first ``--requests`` requests, all at
t=0: ``engine.arrivals=false``, so throughput is not bound by arrival times; multiturn
keeps its own arrivals, see below) under two
configurations that differ in one thing, and reports side A over side B:

1. ``fence/sync``: ``transfer.mode=fence`` vs ``sync`` on ``pressure``, swap-heavy: a
   device pool of about a quarter of what the requests need at once (so sequences are
   preempted) and ``sched.preemption=swap`` (so the swap lane carries blocks while steps
   run). Output-token throughput ratio; target >= 1.
   ``fence/lock``: the same against ``transfer.mode=lock``, the legacy design's lock
   around every step and every copy (actors/executors/legacy.py). Target >= 1.2.
   ``storage fence/sync`` and ``storage fence/lock``: storage-heavy, the same on
   ``pressure`` with ``sched.preemption=save`` and write-through to local storage
   (``cache.device_eviction=write_through``): every full block is stored, and a preempted
   sequence comes back from storage. ``redis fence/sync`` and ``redis fence/lock``: the
   same on a redis-server the bench starts (skipped where there is none; each launch
   starts on an empty database). Targets >= 1 and >= 1.2.
   ``block/poll``: ``runtime.wait=block`` (each idle actor sleeps on its doorbell) vs
   ``poll`` (the legacy design's pollers, a 1 ms sleep between looks) on the swap-heavy
   run. Throughput ratio (target >= 1.05) and the instance's CPU seconds per output
   token (every actor's ``cpu_s`` at stop, from ready), poll over block.
2. ``tiers multiturn``: the host tier and local storage on (``cache.host_blocks`` > 0,
   ``cache.storage.backend=local``) vs off (``host_blocks=0``, ``backend=none``) on
   ``multiturn`` with its arrivals (turns 2 s apart), on the same small device pool
   (evicted prefixes come back from the host tier instead of being recomputed).
   Throughput (arrival-bound) and TTFT p50 ratios (TTFT: B / A, so above 1 is better
   for the tiers); no target.
3. ``tiers unique``: the same on ``unique``, where nothing is reusable: what the tiers
   cost. Throughput ratio; target >= 0.97.
4. ``tiers chat``: the tiers on vs off on the long multi-round chat
   (``synthetic:chat``, 2x ``--requests`` turns with its arrivals, a 256-block device
   pool): throughput, and the TTFT p50 / p99 of the returning turns (turn 2 on), B / A
   (target >= 5 at p50). ``chat fence/sync`` and ``chat fence/lock``: the same chat,
   tiers on, fence against sync and against the legacy lock: throughput (targets >= 1
   and >= 1.2) and the returning turns' TTFTs.
5. ``actor/local``: the actor pipeline with the tiers off (pair 3's side B, the same
   launch) vs :class:`ringfence.actors.tools.testing.local.LocalRunner` in this process on the same
   workload and config: the control plane's cost. Throughput ratio; target >= 0.95.

Throughput is output tokens over the busy period: ``summary.json``'s ``duration_s`` for a
launch (from the workload's start, after the actors are up), the latest ``finish_s`` for
the local runner. Each launch is a real ``ringfence launch`` (supervisor, Engine, Worker,
swap and store lanes, each a process) in its own run dir under a temporary folder,
removed afterwards; every process gets ``OMP_NUM_THREADS=--threads`` (and the local
runner as many torch threads). The sides of each pair alternate, ``--rounds`` times;
figures are medians over the rounds, ratios are ratios of the medians. Each pair's
output tokens are compared request by request (round 1): with the KV bitwise the same,
they should all match; the fraction that does is reported, not asserted.

A failed launch (nonzero exit, timeout, no summary, an aborted request) is an error
(exit status 1); a missed target is printed as FAIL and is not.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ringfence.actors.tools.bench import launcher
from ringfence.actors.tools.bench.e2e_pairs import DTYPE, TARGETS, Run, pairs
from ringfence.actors.tools.bench.e2e_report import LATENCY, print_report, write_plot
from ringfence.actors.tools.bench.launcher import RunError
from ringfence.actors.tools.bench.options import (
    add_counts,
    environment,
    plot_path,
    resolve_counts,
    resolve_preset,
)

# name: (default, quick default, help)
COUNTS: dict[str, tuple[int, int, str]] = {
    "rounds": (1, 1, "rounds of every pair, sides alternating"),
    "requests": (8, 3, "requests of each workload"),
    "timeout": (300, 120, "seconds each launch may take"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument("--quick", action="store_true", help="tiny preset, a few requests (tests)")
    parser.add_argument("--preset", help="model preset (small; quick: tiny)")
    add_counts(parser, COUNTS)
    parser.add_argument(
        "--threads", type=int, help="OMP_NUM_THREADS of every process (CPUs / 4, at least 1)"
    )
    parser.add_argument(
        "--plot", type=Path, metavar="FILE", help="the PNG (next to --json, else bench-e2e.png)"
    )


@dataclass(frozen=True, slots=True)
class Side:
    """One run of a workload: its figures and its output tokens."""

    output_tokens_per_s: float  # output tokens over the busy period
    ttft_p50_s: float | None  # median time to first token
    ttft_p99_s: float | None
    duration_s: float  # the busy period
    tokens: dict[str, list[int]]  # output token ids by request id
    engine: dict[str, Any]  # the engine's counters (empty for the local runner)
    wall_s: float  # the whole run, start-up included
    cpu_s: float | None = None  # every actor's CPU from ready to stop (launches only)
    tpot_p99_s: float | None = None  # time per output token after the first, p99
    ttft_by_id: dict[str, float | None] = field(default_factory=dict)  # per request


@contextlib.contextmanager
def launched_run(
    run: Run, *, threads: int, timeout: float, folder: Path
) -> Iterator[tuple[Side, Path]]:
    """``ringfence launch`` the run in a fresh run dir under ``folder``; yields its figures
    and the run dir (its logs readable inside the block), removed when the block ends.

    :class:`RunError` if the launch fails (see :func:`launcher.run`), aborts a request or
    has no throughput."""
    work = Path(tempfile.mkdtemp(prefix=f"{run.workload}-", dir=folder))
    try:
        done = launcher.run(
            work / "run",
            [*run.settings, f"actors.worker.threads={threads}"],
            what=f"{run.workload} launch",
            timeout=timeout,
            workload=f"synthetic:{run.workload}",
            env={"OMP_NUM_THREADS": str(threads)},
            needs_summary=True,
        )
        summary = done.summary
        if summary["requests"]["aborted"] or not summary["throughput"]["output_tokens_per_s"]:
            raise RunError(f"{run.workload} launch: {summary['requests']}, no throughput")
        cpu_s = instance_cpu_s(work / "run")
        yield (
            Side(
                output_tokens_per_s=float(summary["throughput"]["output_tokens_per_s"]),
                ttft_p50_s=summary["ttft_s"]["p50"],
                ttft_p99_s=summary["ttft_s"]["p99"],
                tpot_p99_s=summary["tpot_s"]["p99"],
                duration_s=float(summary["duration_s"]),
                tokens={line["id"]: list(line["token_ids"]) for line in done.outputs},
                ttft_by_id={line["id"]: line.get("ttft_s") for line in done.outputs},
                engine=dict(summary["engine"]),
                wall_s=done.wall_s,
                cpu_s=cpu_s,
            ),
            work / "run",
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def instance_cpu_s(run_dir: Path) -> float:
    """CPU seconds of every actor of a finished launch, each from ready to its stop (the
    ``cpu_s`` of its ``actor.stop`` lines, every incarnation's); RunError if an actor's log
    has none. The supervisor is not counted: it is the launcher, not the instance."""
    total = 0.0
    for path in sorted(run_dir.glob("*-[0-9]*.jsonl")):
        if path.stem.startswith("supervisor-"):  # not an actor: the launch's own process
            continue
        stops = [
            line["cpu_s"]
            for line in launcher.read_log(run_dir, path.stem)
            if line.get("event") == "actor.stop" and "cpu_s" in line
        ]
        if not stops:
            raise RunError(f"{path}: no actor.stop line with cpu_s")
        total += sum(stops)
    return total


def run_launch(run: Run, *, threads: int, timeout: float, folder: Path) -> Side:
    """The figures of :func:`launched_run`; the run dir is gone when this returns."""
    with launched_run(run, threads=threads, timeout=timeout, folder=folder) as (side, _):
        return side


def run_local(run: Run, *, threads: int) -> Side:
    """The run in this process with :class:`LocalRunner` (torch set to ``threads`` threads)."""
    import torch

    from ringfence.actors.config import Config
    from ringfence.actors.engine.intake import load_workload
    from ringfence.actors.engine.percentiles import percentile
    from ringfence.actors.tools.testing.local import LocalRunner

    config = Config.load(None, run.settings)
    workload = load_workload(f"synthetic:{run.workload}", requests=run.requests)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    start = time.perf_counter()
    try:
        records = LocalRunner(config).run(workload, arrivals=False)
    finally:
        torch.set_num_threads(before)
    wall_s = time.perf_counter() - start
    if any(r.finish_s is None or r.finish_reason == "abort" for r in records):
        raise RunError(f"{run.workload} local run: a request did not finish")
    duration_s = max(r.finish_s or 0.0 for r in records)
    ttfts = [t for r in records if (t := r.ttft_s) is not None]
    tpots = [t for r in records if (t := r.tpot_s) is not None]
    return Side(
        output_tokens_per_s=sum(len(r.token_ids) for r in records) / duration_s,
        ttft_p50_s=percentile(ttfts, 50) if ttfts else None,
        ttft_p99_s=percentile(ttfts, 99) if ttfts else None,
        tpot_p99_s=percentile(tpots, 99) if tpots else None,
        duration_s=duration_s,
        tokens={r.id: list(r.token_ids) for r in records},
        ttft_by_id={r.id: r.ttft_s for r in records},
        engine={},
        wall_s=wall_s,
    )


def cpu_per_token(side: Side) -> float | None:
    """The instance's CPU seconds per output token of a launch; None without its CPU."""
    tokens = sum(len(t) for t in side.tokens.values())
    return side.cpu_s / tokens if side.cpu_s is not None and tokens else None


def tokens_match(a: Side, b: Side) -> float:
    """The fraction of requests (of either side) whose output tokens are the same on both."""
    ids = set(a.tokens) | set(b.tokens)
    return sum(a.tokens.get(i) == b.tokens.get(i) for i in ids) / len(ids) if ids else 1.0


def percentile_of(values: Sequence[float], pct: float) -> float | None:
    """The ``pct`` percentile of ``values`` as the run report computes it; None if empty."""
    from ringfence.actors.engine.percentiles import percentile

    return percentile(values, pct) if values else None


def median(values: Sequence[float | None]) -> float | None:
    """The median of the known values; None if there are none."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def ratio_of(a: float | None, b: float | None) -> float | None:
    """``a / b``; None if either is unknown or ``b`` is 0."""
    return a / b if a is not None and b else None


def returning_ttfts(side: Side) -> list[float]:
    """Time to first token of the returning turns of a chat (``chat-u<user>-t<turn>``,
    turn 1 on): the requests whose prefix a tier may hold."""
    return [
        t
        for rid, t in side.ttft_by_id.items()
        if t is not None and rid.rpartition("-t")[2] not in ("", "0")
    ]


def flush_redis(url: str) -> None:
    """Empty the bench's redis database, so a launch finds none of the last one's blocks."""
    import redis

    with redis.Redis.from_url(url, socket_timeout=10.0) as client:
        client.flushdb()


def bench(preset: str, requests: int, rounds: int, threads: int, timeout: float) -> dict[str, Any]:
    """Every pair's sides, ``rounds`` times alternating, and the ratios of their medians.
    The redis pairs run on a redis-server started here, where one is on PATH."""
    from ringfence.actors.tools.testing.redis_server import REDIS_SERVER, redis_server

    skipped: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="rf-bench-e2e-") as tmp,
        contextlib.ExitStack() as servers,
    ):
        folder = Path(tmp)
        redis_url = None
        if REDIS_SERVER is None:
            skipped.append("redis fence/sync and fence/lock: redis-server is not on PATH")
        else:
            (folder / "redis").mkdir()
            redis_url = servers.enter_context(redis_server(folder / "redis"))
        launched = pairs(preset, requests, redis_url)
        sides: dict[str, tuple[list[Side], list[Side]]] = {
            name: ([], []) for name in [*launched, "actor/local"]
        }

        def launch(run: Run) -> Side:
            if redis_url is not None and f"cache.storage.url={redis_url}" in run.settings:
                flush_redis(redis_url)
            return run_launch(run, threads=threads, timeout=timeout, folder=folder)

        for round_no in range(rounds):
            for name, (a, b) in launched.items():
                order: list[tuple[int, Run]] = [(0, a), (1, b)]
                for index, run in order if round_no % 2 == 0 else order[::-1]:
                    sides[name][index].append(launch(run))
            # The control plane: pair 3's tiers-off launch against the same run in process.
            sides["actor/local"][0].append(sides["tiers unique"][1][-1])
            sides["actor/local"][1].append(run_local(launched["tiers unique"][1], threads=threads))
    rows = []
    for name, (a_runs, b_runs) in sides.items():
        a_tps = median([s.output_tokens_per_s for s in a_runs])
        b_tps = median([s.output_tokens_per_s for s in b_runs])
        rows.append(
            _row(
                name,
                unit="tokens/s",
                a=a_tps,
                b=b_tps,
                ratio=ratio_of(a_tps, b_tps),
                a_runs=a_runs,
                b_runs=b_runs,
            )
        )
        lower_is_better: list[tuple[str, str, Callable[[Side], float | None], float]] = []
        if name == "block/poll":
            lower_is_better.append(("cpu per token", "CPU ms/tok", cpu_per_token, 1e3))
        for q, pct in (("p50", 50), ("p99", 99)):
            if name == "tiers chat" or name.startswith("chat fence/"):

                def returning(s: Side, pct: float = pct) -> float | None:
                    return percentile_of(returning_ttfts(s), pct)

                lower_is_better.append((f"returning ttft {q}", f"TTFT {q} s", returning, 1.0))
            if name == "tiers multiturn":

                def ttft(s: Side, q: str = q) -> float | None:
                    value: float | None = getattr(s, f"ttft_{q}_s")
                    return value

                lower_is_better.append((f"ttft {q}", f"TTFT {q} s", ttft, 1.0))
        for suffix, unit, figure, scale in lower_is_better:  # the ratio is B / A
            a_fig = median([figure(s) for s in a_runs])
            b_fig = median([figure(s) for s in b_runs])
            rows.append(
                _row(
                    f"{name} {suffix}",
                    unit=unit,
                    a=None if a_fig is None else a_fig * scale,
                    b=None if b_fig is None else b_fig * scale,
                    ratio=ratio_of(b_fig, a_fig),
                    a_runs=[],
                    b_runs=[],
                )
            )
    runs = {name: [list(r.settings) for r in pair] for name, pair in launched.items()}
    return {"rows": rows, "runs": runs, "skipped": skipped}


def _row(
    name: str,
    *,
    unit: str,
    a: float | None,
    b: float | None,
    ratio: float | None,
    a_runs: Sequence[Side],
    b_runs: Sequence[Side],
) -> dict[str, Any]:
    target = TARGETS[name]
    row: dict[str, Any] = {
        "name": name,
        "unit": unit,
        "a": a,
        "b": b,
        "ratio": ratio,
        "target": target,
        "meets_target": None if target is None else ratio is not None and ratio >= target,
    }
    if "fence/" in name and a_runs:  # the ordering pairs: what they do to latency
        row["latency"] = {
            key: [median([getattr(s, key) for s in runs]) for runs in (a_runs, b_runs)]
            for key in LATENCY
        }
    if a_runs:
        row["tokens_match"] = tokens_match(a_runs[0], b_runs[0])
        row["sides"] = [
            [
                {
                    "output_tokens_per_s": s.output_tokens_per_s,
                    "ttft_p50_s": s.ttft_p50_s,
                    "ttft_p99_s": s.ttft_p99_s,
                    "tpot_p99_s": s.tpot_p99_s,
                    "duration_s": s.duration_s,
                    "wall_s": round(s.wall_s, 3),
                    "cpu_s": s.cpu_s,
                    "engine": s.engine,
                }
                for s in runs
            ]
            for runs in (a_runs, b_runs)
        ]
    return row


def main(args: argparse.Namespace) -> int:
    counts = resolve_counts(args, COUNTS)
    preset = resolve_preset(args)
    threads = args.threads or max(1, (os.cpu_count() or 1) // 4)
    import torch

    start = time.perf_counter()
    try:
        figures = bench(preset, counts["requests"], counts["rounds"], threads, counts["timeout"])
    except RunError as e:
        print(f"ringfence bench e2e: {e}", file=sys.stderr)
        return 1
    report: dict[str, Any] = {
        "torch": torch.__version__,
        **environment(),
        "threads": threads,
        "preset": preset,
        "dtype": DTYPE,
        "counts": counts,
        **figures,
        "wall_s": round(time.perf_counter() - start, 3),
    }
    print_report(report)
    plot = plot_path(args, "bench-e2e.png")
    write_plot(report, plot)
    report["plot"] = str(plot)
    if args.json is not None:
        Path(args.json).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0
