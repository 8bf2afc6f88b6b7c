"""The runs ``ringfence bench e2e`` (and ``tp``, ``pd``) are made of: one launch or one
in-process run of a workload and its figures (:class:`Side`), and the helpers that compare
sides (medians, ratios, matching tokens, returning turns' TTFTs)."""

from __future__ import annotations

import contextlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringfence.actors.tools.bench import launcher
from ringfence.actors.tools.bench.e2e_pairs import Run
from ringfence.actors.tools.bench.launcher import RunError


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
