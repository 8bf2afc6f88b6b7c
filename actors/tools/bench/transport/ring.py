"""``ringfence bench ring``: ringfence rings against stdlib IPC, side by side, two processes.

Placements: ``cross`` (two CPUs), ``same`` (one CPU), ``loaded`` (unpinned, beside a
process that burns a CPU). For every transport of ``link.py`` and every size it
measures echo round trips and a one-way stream whose clock stops when the peer's count
comes back. A Queue ``put`` never blocks (a feeder thread buffers), so a measured
stream is capped at twice what the warm-up rate delivers in its time box. Then it
reads the CPU time of an idle blocked ringfence consumer, checks the DESIGN targets
(for information only) and prints or writes the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from multiprocessing.context import SpawnContext
from multiprocessing.synchronize import Event
from typing import Any

import orjson

from ringfence.actors.tools.bench.transport.link import (
    ECHO,
    RING_BYTES,
    SINK,
    START_TIMEOUT,
    STOP,
    BenchError,
    Link,
    Session,
    stop_process,
)
from ringfence.shm import names
from ringfence.shm.doorbell import DEFAULT_SPIN_US
from ringfence.shm.ring import FRAME

PLACEMENTS = ("cross", "same", "loaded")
TRANSPORTS = ("ringfence", "ringfence-batch", "zmq", "queue", "pipe", "manager")
OURS = ("ringfence", "ringfence-batch")
# The streaming targets: ahead of pyzmq, at least 5x multiprocessing.Queue.
STREAM_PEERS = (("zmq", 1.0, "pyzmq PAIR"), ("queue", 5.0, "mp.Queue"))
SETTLE_S = 0.2  # before the idle window, on top of the spin window
WARM_MSGS, WARM_BYTES, MIN_STREAM_MSGS = 2000, 32 << 20, 100
# A batch is published all or nothing, so one of near half the ring makes the producer
# wait for the consumer to free as much: the two sides stop overlapping (64 KiB frames in
# batches of 7 streamed at a quarter of single puts' rate). Batches stay small.
BATCH_BYTES = 64 << 10


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchOptions:
    """What one run measures, from the command line."""

    placements: tuple[str, ...]
    sizes: tuple[int, ...]  # payload bytes, 1..the ring's max payload
    transports: tuple[str, ...]
    idle_seconds: float  # window over which the idle consumer's CPU time is read
    spin_us: float  # doorbell spin window (runtime.spin_us)
    quick: bool
    warmup_s: float  # each discarded warm-up phase (round trips, then a stream)
    box_s: float  # time box of the measured round trips and of the stream's sender
    peer_timeout_s: float  # a peer gives up after waiting this long for a message
    session_limit_s: float  # the watchdog kills a peer that lives longer


@dataclass(frozen=True, slots=True)
class _Env:
    """What every session of a run shares."""

    ctx: SpawnContext
    run_id: str
    opts: BenchOptions
    cpus: tuple[int, ...]  # the parent's affinity when the run began

    def session(self, tag: str) -> Session:
        o = self.opts
        return Session(
            ctx=self.ctx,
            run_id=self.run_id,
            tag=tag,
            spin_us=o.spin_us,
            peer_timeout_s=o.peer_timeout_s,
            session_limit_s=o.session_limit_s,
            cpus=self.cpus,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Ratios:
    """A peer against ringfence at one size: > 1 means ringfence is faster."""

    rtt_p50: float  # peer rtt p50 / ringfence rtt p50
    throughput: float  # ringfence msg/s / peer msg/s


@dataclass(frozen=True, slots=True, kw_only=True)
class Figures:
    """One transport at one message size in one placement."""

    rtt_p50_us: float
    rtt_p99_us: float
    num_round_trips: int  # samples behind the percentiles
    msgs_per_s: float  # one-way stream, until the consumer has every message
    mb_per_s: float  # payload bytes / 1e6 per second
    num_streamed: int
    vs_ringfence: Ratios | None = None  # peers only, once ringfence has this size too


@dataclass(slots=True)
class PlacementResult:
    """One placement: figures by transport and size; errors by transport."""

    note: str
    skipped: str | None = None
    figures: dict[str, dict[int, Figures]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # key "placement": none ran

    def ratios(self, transport: str, size: int) -> Ratios | None:
        figures = self.figures.get(transport, {}).get(size)
        return None if figures is None else figures.vs_ringfence


@dataclass(frozen=True, slots=True)
class Target:
    """One DESIGN target, checked for information only."""

    name: str
    passed: bool
    detail: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument("--quick", action="store_true", help="tiny time boxes (for tests)")
    parser.add_argument("--placements", default=",".join(PLACEMENTS), help="%(default)s")
    parser.add_argument("--sizes", default="64,4096,65536", help="bytes: %(default)s")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="%(default)s")
    parser.add_argument("--idle-seconds", type=float, help="idle CPU window (5.0; quick 0.5)")
    parser.add_argument("--spin-us", type=float, default=DEFAULT_SPIN_US, help="%(default)s")


def _subset(option: str, text: str, allowed: Sequence[str]) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not items or any(s not in allowed for s in items):
        raise ValueError(f"{option}: expected a subset of {','.join(allowed)}, got {text!r}")
    return items


def _options(args: argparse.Namespace) -> BenchOptions:
    """Validated options; ``ValueError`` naming the option otherwise."""
    limit = RING_BYTES // 2 - FRAME.size
    try:
        sizes = tuple(dict.fromkeys(int(s) for s in args.sizes.split(",")))
    except ValueError:
        raise ValueError(f"--sizes: expected byte counts, got {args.sizes!r}") from None
    if not all(1 <= s <= limit for s in sizes):
        raise ValueError(f"--sizes: each must be 1..{limit} bytes, got {args.sizes!r}")
    idle = args.idle_seconds if args.idle_seconds is not None else 0.5 if args.quick else 5.0
    if idle <= 0 or args.spin_us < 0:
        raise ValueError("--idle-seconds must be > 0 and --spin-us >= 0")
    return BenchOptions(
        placements=_subset("--placements", args.placements, PLACEMENTS),
        sizes=sizes,
        transports=_subset("--transports", args.transports, TRANSPORTS),
        idle_seconds=idle,
        spin_us=args.spin_us,
        quick=args.quick,
        warmup_s=0.01 if args.quick else 0.05,
        box_s=0.03 if args.quick else 0.5,
        peer_timeout_s=60.0 + 2 * idle,
        session_limit_s=30.0 + 20.0 * len(sizes) + 2 * idle,
    )


def _burn(stop: Event, started: Event, max_seconds: float) -> None:
    """Load: burn a CPU until ``stop`` is set, or ``max_seconds`` pass if the bench died."""
    started.set()
    end = time.monotonic() + max_seconds
    while not stop.is_set() and time.monotonic() < end:
        for _ in range(10_000):
            pass


def _round_trips(link: Link, size: int, seconds: float) -> list[int]:
    """Echo round trips of ``size`` bytes for ``seconds`` (at least one); ns each."""
    message, clock, samples = b"\xa5" * size, time.perf_counter_ns, list[int]()
    link.send(ECHO)
    end = clock() + int(seconds * 1e9)
    while True:
        start = clock()
        link.send(message)
        reply = link.recv()
        now = clock()
        samples.append(now - start)
        if len(reply) != size:
            raise link.failure(f"it echoed {len(reply)} bytes for {size}")
        if now >= end:
            link.send(STOP)
            return samples


def stream(link: Link, size: int, seconds: float, cap: int) -> tuple[int, float]:
    """Send up to ``cap`` messages for at most ``seconds``, then STOP; ``link.batch``
    messages a send, as many as fit in ``BATCH_BYTES``.

    Returns (messages, seconds from the first send until the peer's count came back).
    """
    message, clock, count = b"\x5a" * size, time.perf_counter, 0
    batch = max(1, min(link.batch, BATCH_BYTES // (FRAME.size + size + 7)))
    link.send(SINK)
    start = clock()
    messages = [message] * batch
    while count < cap:
        if batch > 1:
            link.send_many(messages)
        else:
            link.send(message)
        count += batch
        if clock() - start >= seconds:
            break
    link.send(STOP)
    received = int.from_bytes(link.recv(), "little")
    elapsed = clock() - start
    if received != count:
        raise link.failure(f"it counted {received} of {count} messages")
    return count, elapsed


def _measure_size(link: Link, size: int, opts: BenchOptions) -> Figures:
    _round_trips(link, size, opts.warmup_s)
    rtts = sorted(_round_trips(link, size, opts.box_s))
    warm_cap = max(MIN_STREAM_MSGS, min(WARM_MSGS, WARM_BYTES // size))
    warm_count, warm_s = stream(link, size, opts.warmup_s, warm_cap)
    cap = max(MIN_STREAM_MSGS, int(2 * opts.box_s * warm_count / warm_s))
    count, seconds = stream(link, size, opts.box_s, cap)
    return Figures(
        rtt_p50_us=rtts[len(rtts) // 2] / 1e3,
        rtt_p99_us=rtts[min(len(rtts) - 1, len(rtts) * 99 // 100)] / 1e3,
        num_round_trips=len(rtts),
        msgs_per_s=count / seconds,
        mb_per_s=count * size / seconds / 1e6,
        num_streamed=count,
    )


def _measure_transport(env: _Env, tag: str, transport: str, cpu: int | None) -> dict[int, Figures]:
    """Spawn one peer and measure every size; all it made is gone on return or raise."""
    with ExitStack() as stack:
        link = Link(env.session(tag), stack, transport, cpu)
        figures = {size: _measure_size(link, size, env.opts) for size in env.opts.sizes}
        link.quit()
        return figures


def _add_ratios(result: PlacementResult) -> None:
    """Give each peer's figures their ratios to ringfence's at the same size."""
    ours = result.figures.get("ringfence", {})
    for transport, by_size in result.figures.items():
        for size, f in by_size.items():
            if transport != "ringfence" and (rf := ours.get(size)) is not None:  # batch: too
                r = Ratios(
                    rtt_p50=f.rtt_p50_us / rf.rtt_p50_us, throughput=rf.msgs_per_s / f.msgs_per_s
                )
                by_size[size] = dataclasses.replace(f, vs_ringfence=r)


def _start_burner(ctx: SpawnContext, stack: ExitStack, max_seconds: float) -> None:
    stop, started = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_burn, args=(stop, started, max_seconds), daemon=True)
    proc.start()
    stack.callback(stop_process, proc)
    stack.callback(stop.set)  # runs first: an ExitStack unwinds last in, first out
    if not started.wait(START_TIMEOUT):
        raise BenchError(f"the CPU burner did not start within {START_TIMEOUT:g} s")


def _run_placement(env: _Env, name: str) -> PlacementResult:
    """Measure every transport in placement ``name``; the parent's affinity is restored."""
    first, other = env.cpus[0], env.cpus[1] if len(env.cpus) > 1 else None
    pins = {"cross": (first, other), "same": (first, first)}.get(name, (None, None))
    result = PlacementResult(note="unpinned, beside a process that burns a CPU")
    if name != "loaded":
        result.note = f"parent on CPU {first}, peer on CPU {pins[1]}"
    if name == "cross" and other is None:
        result.skipped = f"needs two CPUs; this process may use only {list(env.cpus)}"
        return result
    with ExitStack() as stack:
        stack.callback(os.sched_setaffinity, 0, os.sched_getaffinity(0))
        try:
            if name == "loaded":
                opts = env.opts
                _start_burner(env.ctx, stack, opts.session_limit_s * len(opts.transports))
            if pins[0] is not None:
                os.sched_setaffinity(0, {pins[0]})
            for t in env.opts.transports:
                try:
                    result.figures[t] = _measure_transport(env, f"{name}.{t}", t, pins[1])
                except (BenchError, OSError, EOFError) as e:
                    result.errors[t] = str(e) or repr(e)
        except BenchError as e:
            result.errors["placement"] = str(e)
    _add_ratios(result)
    return result


def _cpu_seconds(link: Link) -> float:
    """utime + stime of the peer, from /proc (clock-tick resolution)."""
    if not link.proc.is_alive():
        raise link.failure("it died while idle")
    with open(f"/proc/{link.proc.pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure_idle(env: _Env) -> dict[str, Any]:
    """CPU share of a ringfence peer blocked in recv on its empty ring, after a settle.

    A failure is reported as ``{"error": message}``.
    """
    try:
        with ExitStack() as stack:
            link = Link(env.session("idle"), stack, "ringfence", None)  # then waits in recv
            link.proc.join(SETTLE_S + env.opts.spin_us / 1e6)  # one-off: past its spin window
            cpu0, t0 = _cpu_seconds(link), time.monotonic()
            link.proc.join(env.opts.idle_seconds)  # returns early only if the peer died
            cpu1, t1 = _cpu_seconds(link), time.monotonic()
            link.quit()
    except (BenchError, OSError, EOFError) as e:
        return {"error": str(e)}
    return {
        "percent_of_core": 100 * (cpu1 - cpu0) / (t1 - t0),
        "cpu_seconds": cpu1 - cpu0,
        "seconds": t1 - t0,
        "resolution_percent": 100 / os.sysconf("SC_CLK_TCK") / (t1 - t0),
    }


def _size_label(size: int) -> str:
    return f"{size >> 10} KiB" if size >= 1024 and size % 1024 == 0 else f"{size} B"


_ROW = "{:>8}  {:<16}{:>10}{:>10}{:>12}{:>9}{:>8}{:>8}"


def _print_placement(name: str, result: PlacementResult, opts: BenchOptions) -> None:
    print(f"\n== {name}: {result.note} ==")
    if result.skipped:
        print(f"   skipped: {result.skipped}")
    for what, error in result.errors.items():
        print(f"   {what} FAILED: {error}")
    print(_ROW.format("size", "transport", "p50 us", "p99 us", "msg/s", "MB/s", "rtt x", "thru x"))
    for size in opts.sizes:
        label = _size_label(size)
        for t in opts.transports:
            if (f := result.figures.get(t, {}).get(size)) is None:
                continue
            r = f.vs_ringfence
            ratios = ("-", "-") if r is None else (f"{r.rtt_p50:.1f}x", f"{r.throughput:.1f}x")
            rtt = (f"{f.rtt_p50_us:.1f}", f"{f.rtt_p99_us:.1f}")
            print(_ROW.format(label, t, *rtt, f"{f.msgs_per_s:,.0f}", f"{f.mb_per_s:.1f}", *ratios))
            label = ""


def _targets(results: dict[str, PlacementResult], idle: dict[str, Any]) -> list[Target]:
    """The DESIGN targets whose figures this run has."""
    out: list[Target] = []
    cross = results.get("cross", PlacementResult(note=""))
    if (rf := cross.figures.get("ringfence", {}).get(64)) is not None:
        p50 = rf.rtt_p50_us
        out.append(Target("cross: 64 B ringfence rtt p50 < 10 us", p50 < 10, f"{p50:.1f} us"))
    for peer, need in (("queue", 10), ("manager", 20)):
        if (r := cross.ratios(peer, 64)) is not None:
            name = f"cross: 64 B rtt p50 >= {need}x faster than {peer}"
            out.append(Target(name, r.rtt_p50 >= need, f"{r.rtt_p50:.1f}x"))
    for placement, res in results.items():
        pairs = [(t, s) for t, by_size in res.figures.items() if t not in OURS for s in by_size]
        rtt = {f"{t} {_size_label(s)}": r.rtt_p50 for t, s in pairs if (r := res.ratios(t, s))}
        if rtt:
            behind = ", ".join(f"{key} {x:.2f}x" for key, x in rtt.items() if x <= 1)
            name = f"{placement}: ringfence rtt p50 ahead of every peer at every size"
            out.append(Target(name, not behind, behind or f"lowest {min(rtt.values()):.1f}x"))
        for size in (64, 4096):
            for peer, times, label in STREAM_PEERS:
                theirs = res.figures.get(peer, {}).get(size)
                if theirs is None:
                    continue
                for ours in OURS:
                    if (f := res.figures.get(ours, {}).get(size)) is not None:
                        x = f.msgs_per_s / theirs.msgs_per_s
                        name = f"{placement}: {_size_label(size)} {ours} stream"
                        name += f" >= {times:g}x {label}" if times > 1 else f" ahead of {label}"
                        out.append(Target(name, x >= times if times > 1 else x > 1, f"{x:.2f}x"))
    if "percent_of_core" in idle:
        pct = idle["percent_of_core"]
        out.append(Target("idle consumer < 1% of a core", pct < 1, f"{pct:.2f}%"))
    return out


def main(args: argparse.Namespace) -> int:
    """Run the benchmark, print tables and target checks; 1 if a measurement failed."""
    opts, began = _options(args), time.monotonic()
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    env = _Env(multiprocessing.get_context("spawn"), names.new_run_id(), opts, cpus)
    machine = {"cpu_count": os.cpu_count(), "usable_cpus": cpus, "platform": platform.platform()}
    print(f"ringfence bench ring: run {env.run_id}; {machine}")
    print("rtt: round trip; msg/s, MB/s: one-way stream; x: peer / ringfence, > 1: ringfence ahead")
    results: dict[str, PlacementResult] = {}
    names.write_lease(env.run_id)  # `ringfence clean --all` leaves a live run's names alone
    try:
        for name in opts.placements:
            results[name] = _run_placement(env, name)
            _print_placement(name, results[name], opts)
            sys.stdout.flush()
        idle = _measure_idle(env)
        if "error" in idle:
            print(f"\nidle ringfence consumer FAILED: {idle['error']}")
        else:
            pct, secs = idle["percent_of_core"], idle["seconds"]
            print(f"\nidle ringfence consumer: {pct:.2f}% of a core over {secs:.1f} s", end="")
            print(f" (resolution {idle['resolution_percent']:.2f}%)")
    finally:
        names.remove_lease(env.run_id)
    targets = _targets(results, idle)
    for t in targets:
        print(f"{'PASS' if t.passed else 'FAIL'} {t.name}: {t.detail}")
    wall = time.monotonic() - began
    print(f"(targets are informational; wall time {wall:.1f} s)")
    if args.json is not None:
        report = {"run_id": env.run_id, "machine": machine, "options": opts, "placements": results}
        report |= {"idle_consumer": idle, "targets": targets, "wall_seconds": wall}
        option = orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS
        args.json.write_bytes(orjson.dumps(report, option=option))
    return 1 if "error" in idle or any(r.errors for r in results.values()) else 0
