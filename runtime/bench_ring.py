"""``ringfence bench ring``: ringfence rings against stdlib IPC, side by side, two processes.

Transports: ``ringfence`` (two rings, one doorbell per process), ``queue``
(multiprocessing.Queue), ``pipe`` (multiprocessing.Pipe) and ``manager`` (a
BaseManager-served queue.Queue that the consumer polls with ``get_nowait`` in a tight
loop, as the legacy cache task queue does). Placements: ``cross`` (two CPUs),
``same`` (one CPU), ``loaded`` (unpinned, beside a process that burns a CPU).

A spawned peer speaks a tiny protocol over the transport under test: ``E`` starts an
echo phase, ``S`` a sink phase (it answers with the count), ``Q`` quits, an empty
message ends a phase; payloads are never empty. A stream's clock stops when the
peer's count comes back. A Queue ``put`` never blocks (a feeder thread buffers), so a
measured stream is capped at twice what the warm-up rate delivers in its time box.
Every wait has a deadline; a Pipe send into a full socket, the one call without a
timeout, ends when a watchdog kills a peer that outlives its session.

Why about 650 lines, not under 300: both ends of four transports, the peer protocol,
three placements with a CPU burner, the idle probe, the target checks and the report
are asked of this one module. The natural split (the transports' ends and openers in
a module of their own) is left for when another benchmark needs them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import multiprocessing
import os
import platform
import queue
import select
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext, SpawnProcess
from multiprocessing.managers import SyncManager
from multiprocessing.queues import Queue as MPQueue
from multiprocessing.synchronize import Event
from typing import Any, NamedTuple, TypeVar

import orjson

from ringfence.shm import names
from ringfence.shm.doorbell import DEFAULT_SPIN_US, Doorbell
from ringfence.shm.errors import RingfenceError
from ringfence.shm.ring import FRAME, Ring, RingReader, RingWriter

PLACEMENTS = ("cross", "same", "loaded")
TRANSPORTS = ("ringfence", "queue", "pipe", "manager")
RING_BYTES = 1 << 20  # data bytes per ring: room to stream 64 KiB frames
ECHO, SINK, QUIT, READY, STOP = b"E", b"S", b"Q", b"R", b""
START_TIMEOUT = 60.0  # for a spawned child to report in (spawning is slow under load)
REPLY_TIMEOUT = 10.0  # for any one reply, in the parent
SEND_TIMEOUT = 10.0  # for room in a ring
LIVENESS_STEP = 1.0  # a waiting parent re-checks this often that its peer lives
JOIN_TIMEOUT = 5.0
STOP_GRACE = 0.5  # for a child still running when its session unwinds
SETTLE_S = 0.2  # before the idle window, on top of the spin window
WARM_MSGS, WARM_BYTES, MIN_STREAM_MSGS = 2000, 32 << 20, 100


class BenchError(RingfenceError, RuntimeError):
    """A measurement failed: its peer died, timed out, or answered wrongly."""


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


class _End(NamedTuple):
    """One side of a transport, for one thread of one process.

    ``recv(timeout)`` raises ``queue.Empty`` at its deadline and OSError/EOFError once
    the peer is gone. ``sink(timeout)``, where given, receives until STOP and returns
    the count; otherwise the peer counts with ``recv``.
    """

    send: Callable[[bytes], object]
    recv: Callable[[float], bytes]
    sink: Callable[[float], int] | None = None


def _ring_end(out: Ring, inbox: Ring, own: Doorbell, peer: Doorbell) -> _End:
    """Writer and reader share this side's doorbell; the stream sink drains in batches."""
    writer = RingWriter(out, wake=peer, space=own)
    reader = RingReader(inbox, bell=own, space=peer)

    def sink(timeout: float) -> int:
        count = 0
        while reader.wait_pending(timeout):
            for frame in reader.drain():
                if not frame.payload:
                    return count
                count += 1
        raise queue.Empty(f"no frame within {timeout} s")

    return _End(lambda b: writer.put(0, b, SEND_TIMEOUT), lambda t: reader.get(t).payload, sink)


_Shm = TypeVar("_Shm", Ring, Doorbell)


def _held(stack: ExitStack, obj: _Shm, *, owner: bool = False) -> _Shm:
    """Close ``obj`` when ``stack`` unwinds; unlink it too if this process created it."""
    if owner:
        stack.callback(obj.unlink)
    stack.callback(obj.close)
    return obj


def _attach_ring(stack: ExitStack, shm: tuple[str, ...], spin_us: float) -> _End:
    """The peer's side of the names ``_open_ring`` made: it writes pong and reads ping."""
    ping, pong, parent_bell, peer_bell = shm
    bell, wake = (
        _held(stack, Doorbell.attach(n, spin_us=spin_us)) for n in (peer_bell, parent_bell)
    )
    return _ring_end(_held(stack, Ring.attach(pong)), _held(stack, Ring.attach(ping)), bell, wake)


def _queue_end(stack: ExitStack, inbox: MPQueue[bytes], outbox: MPQueue[bytes]) -> _End:
    for q in (inbox, outbox):  # by unwind every message was acknowledged: never wait on a flush
        stack.callback(q.close)
        stack.callback(q.cancel_join_thread)
    return _End(outbox.put, lambda t: inbox.get(timeout=t))


def _pipe_end(stack: ExitStack, conn: Connection) -> _End:
    """send_bytes/recv_bytes; one poll(2) before each receive gives it a deadline."""
    stack.callback(conn.close)
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)

    def recv(timeout: float) -> bytes:
        if not poller.poll(timeout * 1000):
            raise queue.Empty(f"no message within {timeout} s")
        return conn.recv_bytes()

    return _End(conn.send_bytes, recv)


def _manager_end(stack: ExitStack, inbox: Any, outbox: Any) -> _End:
    """Manager proxies; the consumer polls ``get_nowait`` with no sleep, its best case."""
    get, put = inbox.get_nowait, outbox.put

    def recv(timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return get()  # type: ignore[no-any-return]
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise

    return _End(put, recv)


PEER_ENDS: dict[str, Callable[..., _End]] = {
    "ringfence": _attach_ring,
    "queue": _queue_end,
    "pipe": _pipe_end,
    "manager": _manager_end,
}


def _peer(transport: str, cpu: int | None, handles: tuple[Any, ...], timeout: float) -> None:
    """Child: pin to ``cpu`` (None: unpinned), build its end from ``handles``, serve until QUIT."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    with ExitStack() as stack:
        end = PEER_ENDS[transport](stack, *handles)
        end.send(READY)
        while (command := end.recv(timeout)) != QUIT:
            if command == ECHO:
                while message := end.recv(timeout):
                    end.send(message)
            elif command == SINK:
                counted = iter(functools.partial(end.recv, timeout), STOP)
                count = end.sink(timeout) if end.sink else sum(1 for _ in counted)
                end.send(count.to_bytes(8, "little"))
            else:
                raise ValueError(f"bench peer: unknown command {command[:8]!r}")


def _burn(stop: Event, started: Event, max_seconds: float) -> None:
    """Load: burn a CPU until ``stop`` is set, or ``max_seconds`` pass if the bench died."""
    started.set()
    end = time.monotonic() + max_seconds
    while not stop.is_set() and time.monotonic() < end:
        for _ in range(10_000):
            pass


def _stop(proc: SpawnProcess) -> None:
    """Join ``proc``; terminate, then kill it if it does not exit. Always joins.

    A peer that finished normally was joined already; one still running here is stuck
    or waiting for a parent that gave up, so it gets only a short grace.
    """
    proc.join(STOP_GRACE)
    for end_it in (proc.terminate, proc.kill):
        if proc.is_alive():
            end_it()
            proc.join(JOIN_TIMEOUT)


@dataclass(frozen=True, slots=True)
class _Env:
    """What a session needs."""

    ctx: SpawnContext
    run_id: str
    tag: str  # prefix of this session's shared-memory names: "<placement>.<transport>"
    opts: BenchOptions
    cpus: tuple[int, ...]  # the parent's affinity when the run began


_Opener = Callable[[_Env, ExitStack], tuple[_End, tuple[Any, ...]]]


def _open_ring(env: _Env, stack: ExitStack) -> tuple[_End, tuple[Any, ...]]:
    """Create both rings and both doorbells (this process unlinks them)."""
    shm = tuple(
        names.posix_name(env.run_id, f"{env.tag}.{o}") for o in ("ping", "pong", "pb", "cb")
    )
    ping, pong = (_held(stack, Ring.create(n, RING_BYTES), owner=True) for n in shm[:2])
    spin = env.opts.spin_us
    bell, wake = (_held(stack, Doorbell.create(n, spin_us=spin), owner=True) for n in shm[2:])
    return _ring_end(ping, pong, bell, wake), (shm, spin)


def _open_queue(env: _Env, stack: ExitStack) -> tuple[_End, tuple[Any, ...]]:
    ping: MPQueue[bytes] = env.ctx.Queue()
    pong: MPQueue[bytes] = env.ctx.Queue()
    return _queue_end(stack, pong, ping), (ping, pong)


def _open_pipe(env: _Env, stack: ExitStack) -> tuple[_End, tuple[Any, ...]]:
    mine, theirs = env.ctx.Pipe()
    return _pipe_end(stack, mine), (theirs,)


def _open_manager(env: _Env, stack: ExitStack) -> tuple[_End, tuple[Any, ...]]:
    """SyncManager: the stdlib BaseManager subclass that serves queue.Queue as ``Queue``."""
    manager = SyncManager(ctx=env.ctx)
    manager.start(os.sched_setaffinity, (0, env.cpus))  # its server: unpinned in every placement
    stack.enter_context(manager)  # holds it: dropping the last reference shuts it down
    ping, pong = manager.Queue(), manager.Queue()
    return _manager_end(stack, pong, ping), (ping, pong)


OPENERS: dict[str, _Opener] = {
    "ringfence": _open_ring,
    "queue": _open_queue,
    "pipe": _open_pipe,
    "manager": _open_manager,
}


class _Link:
    """The parent's side of one session; a transport failure becomes a BenchError."""

    def __init__(self, env: _Env, stack: ExitStack, transport: str, cpu: int | None) -> None:
        """Open ``transport``, spawn its peer pinned to ``cpu``, wait for READY.

        On unwind of ``stack`` the watchdog is cancelled, the peer joined (killed if it
        must be), and everything the opener made is closed and unlinked.
        """
        self.name = transport
        self.end, handles = OPENERS[transport](env, stack)
        args = (transport, cpu, handles, env.opts.peer_timeout_s)
        self.proc = env.ctx.Process(target=_peer, args=args, name=f"bench-{env.tag}", daemon=True)
        self.proc.start()
        stack.callback(_stop, self.proc)
        watchdog = threading.Timer(env.opts.session_limit_s, self.proc.kill)
        watchdog.daemon = True
        watchdog.start()
        stack.callback(watchdog.cancel)
        for handle in handles:  # the child has its own copy; without ours its exit reads as EOF
            if isinstance(handle, Connection):
                handle.close()
        if self.recv(START_TIMEOUT) != READY:
            raise self.failure("it did not start with READY")

    def send(self, data: bytes) -> None:
        try:
            self.end.send(data)
        except (OSError, EOFError, queue.Full) as e:
            raise self.failure(f"send failed: {e!r}") from e

    def recv(self, timeout: float = REPLY_TIMEOUT) -> bytes:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.end.recv(LIVENESS_STEP)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise self.failure("it exited without replying") from None
                if time.monotonic() >= deadline:
                    raise self.failure(f"no reply within {timeout:g} s") from None
            except (OSError, EOFError) as e:
                raise self.failure(f"receive failed: {e!r}") from e

    def quit(self) -> None:
        self.send(QUIT)
        self.proc.join(JOIN_TIMEOUT)
        if self.proc.exitcode != 0:
            raise self.failure("it did not exit cleanly after QUIT")

    def failure(self, what: str) -> BenchError:
        code = self.proc.exitcode
        state = "is running" if code is None else f"exited with code {code}"
        return BenchError(f"{self.name} peer (pid {self.proc.pid}) {state}: {what}")


def _round_trips(link: _Link, size: int, seconds: float) -> list[int]:
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


def _stream(link: _Link, size: int, seconds: float, cap: int) -> tuple[int, float]:
    """Send up to ``cap`` messages for at most ``seconds``, then STOP.

    Returns (messages, seconds from the first send until the peer's count came back).
    """
    message, clock, count = b"\x5a" * size, time.perf_counter, 0
    link.send(SINK)
    start = clock()
    while count < cap:
        link.send(message)
        count += 1
        if clock() - start >= seconds:
            break
    link.send(STOP)
    received = int.from_bytes(link.recv(), "little")
    elapsed = clock() - start
    if received != count:
        raise link.failure(f"it counted {received} of {count} messages")
    return count, elapsed


def _measure_size(link: _Link, size: int, opts: BenchOptions) -> Figures:
    _round_trips(link, size, opts.warmup_s)
    rtts = sorted(_round_trips(link, size, opts.box_s))
    warm_cap = max(MIN_STREAM_MSGS, min(WARM_MSGS, WARM_BYTES // size))
    warm_count, warm_s = _stream(link, size, opts.warmup_s, warm_cap)
    cap = max(MIN_STREAM_MSGS, int(2 * opts.box_s * warm_count / warm_s))
    count, seconds = _stream(link, size, opts.box_s, cap)
    return Figures(
        rtt_p50_us=rtts[len(rtts) // 2] / 1e3,
        rtt_p99_us=rtts[min(len(rtts) - 1, len(rtts) * 99 // 100)] / 1e3,
        num_round_trips=len(rtts),
        msgs_per_s=count / seconds,
        mb_per_s=count * size / seconds / 1e6,
        num_streamed=count,
    )


def _measure_transport(env: _Env, transport: str, cpu: int | None) -> dict[int, Figures]:
    """Spawn one peer and measure every size; all it made is gone on return or raise."""
    with ExitStack() as stack:
        link = _Link(env, stack, transport, cpu)
        figures = {size: _measure_size(link, size, env.opts) for size in env.opts.sizes}
        link.quit()
        return figures


def _add_ratios(result: PlacementResult) -> None:
    """Give each peer's figures their ratios to ringfence's at the same size."""
    ours = result.figures.get("ringfence", {})
    for transport, by_size in result.figures.items():
        for size, f in by_size.items():
            if transport != "ringfence" and (rf := ours.get(size)) is not None:
                r = Ratios(
                    rtt_p50=f.rtt_p50_us / rf.rtt_p50_us, throughput=rf.msgs_per_s / f.msgs_per_s
                )
                by_size[size] = dataclasses.replace(f, vs_ringfence=r)


def _start_burner(ctx: SpawnContext, stack: ExitStack, max_seconds: float) -> None:
    stop, started = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_burn, args=(stop, started, max_seconds), daemon=True)
    proc.start()
    stack.callback(_stop, proc)
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
                session = dataclasses.replace(env, tag=f"{name}.{t}")
                try:
                    result.figures[t] = _measure_transport(session, t, pins[1])
                except (BenchError, OSError, EOFError) as e:
                    result.errors[t] = str(e) or repr(e)
        except BenchError as e:
            result.errors["placement"] = str(e)
    _add_ratios(result)
    return result


def _cpu_seconds(link: _Link) -> float:
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
            link = _Link(env, stack, "ringfence", None)  # after READY it waits in recv
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


_ROW = "{:>8}  {:<10}{:>10}{:>10}{:>12}{:>9}{:>8}{:>8}"


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
        pairs = [(t, s) for t, by_size in res.figures.items() for s in by_size]
        rtt = {f"{t} {_size_label(s)}": r.rtt_p50 for t, s in pairs if (r := res.ratios(t, s))}
        if rtt:
            behind = ", ".join(f"{key} {x:.2f}x" for key, x in rtt.items() if x <= 1)
            name = f"{placement}: ringfence rtt p50 ahead of every peer at every size"
            out.append(Target(name, not behind, behind or f"lowest {min(rtt.values()):.1f}x"))
        for size in (64, 65536):
            if (r := res.ratios("queue", size)) is not None:
                name = f"{placement}: {_size_label(size)} stream >= 5x multiprocessing.Queue"
                out.append(Target(name, r.throughput >= 5, f"{r.throughput:.1f}x"))
    if "percent_of_core" in idle:
        pct = idle["percent_of_core"]
        out.append(Target("idle consumer < 1% of a core", pct < 1, f"{pct:.2f}%"))
    return out


def main(args: argparse.Namespace) -> int:
    """Run the benchmark, print tables and target checks; 1 if a measurement failed."""
    opts, began = _options(args), time.monotonic()
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    env = _Env(multiprocessing.get_context("spawn"), names.new_run_id(), "", opts, cpus)
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
        idle = _measure_idle(dataclasses.replace(env, tag="idle"))
        if "error" in idle:
            print(f"\nidle ringfence consumer FAILED: {idle['error']}")
        else:
            pct, secs = idle["percent_of_core"], idle["seconds"]
            print(f"\nidle ringfence consumer: {pct:.2f}% of a core over {secs:.1f} s", end="")
            print(f" (resolution {idle['resolution_percent']:.2f}%)")
    finally:
        lease = names.posix_name(env.run_id, names.LEASE_OBJECT)
        names.unlink_name(names.ShmEntry(name=lease, run_id=env.run_id, is_semaphore=False))
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
