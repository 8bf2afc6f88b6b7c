"""The two ends of each transport that `ringfence bench ring` compares, and the link to a peer.

Transports: ``ringfence`` (two rings, one doorbell per process), ``ringfence-batch``
(the same, with the stream sent ``BATCH`` frames a ``put_many``), ``zmq`` (a pyzmq PAIR
socket pair over ``ipc://``, the transport vLLM and SGLang run between their processes),
``queue`` (multiprocessing.Queue), ``pipe`` (multiprocessing.Pipe) and ``manager`` (a
BaseManager-served queue.Queue that the consumer polls with ``get_nowait`` in a tight
loop, as the legacy cache task queue does). Every stream sink reads in batches where
its transport can: ringfence takes whatever is published, zmq drains with NOBLOCK
before it polls.

A spawned peer speaks a tiny protocol over the transport under test: ``E`` starts an
echo phase, ``S`` a sink phase (it answers with the count), ``Q`` quits, an empty
message ends a phase; payloads are never empty. Every wait has a deadline; a Pipe send
into a full socket, the one call without a timeout, ends when a watchdog kills a peer
that outlives its session.
"""

from __future__ import annotations

import functools
import os
import queue
import select
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext, SpawnProcess
from multiprocessing.managers import SyncManager
from multiprocessing.queues import Queue as MPQueue
from typing import Any, NamedTuple, TypeVar

from ringfence.shm import names
from ringfence.shm.doorbell import Doorbell
from ringfence.shm.errors import RingfenceError
from ringfence.shm.ring import Ring
from ringfence.shm.ring_reader import RingReader
from ringfence.shm.ring_writer import RingWriter

RING_BYTES = 1 << 20  # data bytes per ring: room to stream 64 KiB frames
BATCH = 32  # frames a put_many in the ringfence-batch stream (fewer where they would not fit)
ECHO, SINK, QUIT, READY, STOP = b"E", b"S", b"Q", b"R", b""
START_TIMEOUT = 60.0  # for a spawned child to report in (spawning is slow under load)
REPLY_TIMEOUT = 10.0  # for any one reply, in the parent
SEND_TIMEOUT = 10.0  # for room in a ring
LIVENESS_STEP = 1.0  # a waiting parent re-checks this often that its peer lives
JOIN_TIMEOUT = 5.0
STOP_GRACE = 0.5  # for a child still running when its session unwinds


class BenchError(RingfenceError, RuntimeError):
    """A measurement failed: its peer died, timed out, or answered wrongly."""


class _End(NamedTuple):
    """One side of a transport, for one thread of one process.

    ``recv(timeout)`` raises ``queue.Empty`` at its deadline and OSError/EOFError once
    the peer is gone. ``sink(timeout)``, where given, receives until STOP and returns
    the count; otherwise the peer counts with ``recv``.
    """

    send: Callable[[bytes], object]
    recv: Callable[[float], bytes]
    sink: Callable[[float], int] | None = None
    send_many: Callable[[list[bytes]], object] | None = None  # where the transport batches


def _ring_end(out: Ring, inbox: Ring, own: Doorbell, peer: Doorbell) -> _End:
    """Writer and reader share this side's doorbell; the stream sink takes in batches."""
    writer = RingWriter(out, wake=peer, space=own)
    reader = RingReader(inbox, bell=own, space=peer)

    def sink(timeout: float) -> int:
        count = 0
        while reader.wait_pending(timeout):
            batch = reader.take()
            if batch is None:
                continue
            reader.commit(batch)
            payloads = batch.payloads
            if not payloads[-1]:
                return count + len(payloads) - 1
            count += len(payloads)
        raise queue.Empty(f"no frame within {timeout} s")

    def send_many(payloads: list[bytes]) -> None:
        writer.put_many([(0, b) for b in payloads], SEND_TIMEOUT)

    def send(payload: bytes) -> None:
        writer.put(0, payload, SEND_TIMEOUT)

    return _End(send, lambda t: reader.get(t).payload, sink, send_many)


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


def _zmq_end(stack: ExitStack, address: str, bind: bool = False) -> _End:
    """A PAIR socket on ``address``; a poll before each receive gives it a deadline."""
    import zmq

    context = zmq.Context()
    stack.callback(context.term)
    sock = context.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)  # by unwind every message was acknowledged
    stack.callback(sock.close)
    (sock.bind if bind else sock.connect)(address)
    recv_now, again = functools.partial(sock.recv, zmq.NOBLOCK), zmq.Again

    def recv(timeout: float) -> bytes:
        if not sock.poll(int(timeout * 1000)):
            raise queue.Empty(f"no message within {timeout} s")
        return sock.recv()

    def sink(timeout: float) -> int:
        count = 0
        while True:
            try:
                message = recv_now()
            except again:
                if not sock.poll(int(timeout * 1000)):
                    raise queue.Empty(f"no message within {timeout} s") from None
                continue
            if not message:
                return count
            count += 1

    return _End(sock.send, recv, sink)


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
    "ringfence-batch": _attach_ring,
    "zmq": _zmq_end,
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


def stop_process(proc: SpawnProcess) -> None:
    """Join ``proc``; terminate, then kill it if it does not exit. Always joins.

    A peer that finished normally was joined already; one still running here is stuck
    or waiting for a parent that gave up, so it gets only a short grace.
    """
    proc.join(STOP_GRACE)
    for end_it in (proc.terminate, proc.kill):
        if proc.is_alive():
            end_it()
            proc.join(JOIN_TIMEOUT)


@dataclass(frozen=True, slots=True, kw_only=True)
class Session:
    """What one link between the parent and a peer needs."""

    ctx: SpawnContext
    run_id: str
    tag: str  # prefix of this session's shared-memory names: "<placement>.<transport>"
    spin_us: float  # doorbell spin window (runtime.spin_us)
    peer_timeout_s: float  # a peer gives up after waiting this long for a message
    session_limit_s: float  # the watchdog kills a peer that lives longer
    cpus: tuple[int, ...]  # the parent's affinity when the run began


_Opener = Callable[[Session, ExitStack], tuple[_End, tuple[Any, ...]]]


def _open_ring(env: Session, stack: ExitStack) -> tuple[_End, tuple[Any, ...]]:
    """Create both rings and both doorbells (this process unlinks them)."""
    shm = tuple(
        names.posix_name(env.run_id, f"{env.tag.replace('-', '_')}.{o}")
        for o in ("ping", "pong", "pb", "cb")
    )
    ping, pong = (_held(stack, Ring.create(n, RING_BYTES), owner=True) for n in shm[:2])
    spin = env.spin_us
    bell, wake = (_held(stack, Doorbell.create(n, spin_us=spin), owner=True) for n in shm[2:])
    return _ring_end(ping, pong, bell, wake), (shm, spin)


def _open_zmq(env: Session, stack: ExitStack) -> tuple[_End, tuple[Any, ...]]:
    """Bind a PAIR socket in a private directory (removed on unwind); the peer connects."""
    folder = tempfile.mkdtemp(prefix="rf-bench-zmq-")
    stack.callback(shutil.rmtree, folder, ignore_errors=True)
    address = f"ipc://{folder}/{env.tag}.sock"
    return _zmq_end(stack, address, bind=True), (address,)


def _open_queue(env: Session, stack: ExitStack) -> tuple[_End, tuple[Any, ...]]:
    ping: MPQueue[bytes] = env.ctx.Queue()
    pong: MPQueue[bytes] = env.ctx.Queue()
    return _queue_end(stack, pong, ping), (ping, pong)


def _open_pipe(env: Session, stack: ExitStack) -> tuple[_End, tuple[Any, ...]]:
    mine, theirs = env.ctx.Pipe()
    return _pipe_end(stack, mine), (theirs,)


def _open_manager(env: Session, stack: ExitStack) -> tuple[_End, tuple[Any, ...]]:
    """SyncManager: the stdlib BaseManager subclass that serves queue.Queue as ``Queue``."""
    manager = SyncManager(ctx=env.ctx)
    manager.start(os.sched_setaffinity, (0, env.cpus))  # its server: unpinned in every placement
    stack.enter_context(manager)  # holds it: dropping the last reference shuts it down
    ping, pong = manager.Queue(), manager.Queue()
    return _manager_end(stack, pong, ping), (ping, pong)


OPENERS: dict[str, _Opener] = {
    "ringfence": _open_ring,
    "ringfence-batch": _open_ring,
    "zmq": _open_zmq,
    "queue": _open_queue,
    "pipe": _open_pipe,
    "manager": _open_manager,
}


class Link:
    """The parent's side of one session; a transport failure becomes a BenchError."""

    def __init__(self, env: Session, stack: ExitStack, transport: str, cpu: int | None) -> None:
        """Open ``transport``, spawn its peer pinned to ``cpu``, wait for READY.

        On unwind of ``stack`` the watchdog is cancelled, the peer joined (killed if it
        must be), and everything the opener made is closed and unlinked.
        """
        self.name = transport
        self.end, handles = OPENERS[transport](env, stack)
        self.batch = BATCH if transport == "ringfence-batch" else 1  # frames a stream send
        args = (transport, cpu, handles, env.peer_timeout_s)
        self.proc = env.ctx.Process(target=_peer, args=args, name=f"bench-{env.tag}", daemon=True)
        self.proc.start()
        stack.callback(stop_process, self.proc)
        watchdog = threading.Timer(env.session_limit_s, self.proc.kill)
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

    def send_many(self, data: list[bytes]) -> None:
        """Send ``data`` in one batch where the transport has one, else one by one."""
        if self.end.send_many is None:
            for message in data:
                self.send(message)
            return
        try:
            self.end.send_many(data)
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
