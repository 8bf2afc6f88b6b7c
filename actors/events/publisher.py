"""The KV event publisher: a ZMQ PUB socket, and a ROUTER socket that replays the past.

As vLLM's ``ZmqEventPublisher``, so that a subscriber written for vLLM reads ringfence's
events unchanged:

- every batch goes out on the PUB socket as three frames ``[topic, seq, payload]``: the
  topic (``events.topic``, empty by default), the batch's sequence number as 8 bytes
  big-endian (0, 1, 2, ... from the publisher's start: a restarted instance starts at 0
  again, and its first batch clears every tier), and the msgpack payload (``wire.py``);
- the last ``events.buffer_steps`` batches are kept; a subscriber that missed some (a
  gap in the numbers) sends the first number it wants, 8 bytes big-endian, to the replay
  socket (a REQ socket: ``[b"", seq]`` arrives as ``[identity, b"", seq]``) and gets
  ``[b"", seq, payload]`` for every kept batch from there on, then ``[b"", -1 as 8 signed
  bytes, b""]``. A request of another shape gets the end marker alone and is counted.

A port 0 in either endpoint binds any free port; :attr:`EventPublisher.endpoints` says
which (a wildcard host as ZMQ reports it, ``0.0.0.0``: whoever advertises the endpoint
puts the instance's address there).

Threads: the sockets live in the publisher's own thread (ZMQ sockets are not thread
safe); the owner (the engine) hands it encoded batches through an inproc PAIR socket, a
send that never blocks (a full pipe drops the batch and counts it: subscribers see a gap
and replay). The thread waits on both sockets with a deadline, never sleeping in a loop.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from dataclasses import dataclass
from itertools import count
from typing import Final

import zmq

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
_STOP: Final = b""  # through the pipe: the thread ends (a batch is never empty)
_WAIT_MS: Final = 1000  # the thread's wait on its sockets, then it checks again
START_TIMEOUT_S: Final = 10.0


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where to subscribe (``publish``) and where to ask for a replay (``replay``, "" for
    none)."""

    publish: str
    replay: str


class PublisherError(RuntimeError):
    """The publisher could not bind its sockets; names the endpoint and ZMQ's reason."""


@dataclass(slots=True)
class Counts:
    """What the publisher did; read by the owner (plain ints: a torn read is harmless)."""

    published: int = 0  # batches sent on the PUB socket
    dropped: int = 0  # batches the pipe to the thread had no room for
    replays: int = 0  # replay requests answered
    bad_replays: int = 0  # replay requests of another shape (answered with the end marker)


class EventPublisher:
    """See the module docstring. ``publish`` from one thread (the owner's) only."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        *,
        buffer_steps: int,
        topic: str = "",
        hwm: int = 100_000,
    ) -> None:
        self._ctx = zmq.Context()
        self._pipe_name = f"inproc://ringfence-events-{id(self):x}"
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._topic = topic.encode()
        self._hwm = hwm
        self.counts = Counts()
        self._ready = threading.Event()
        self._failure: list[BaseException] = []  # the thread's, if it could not bind
        self._bound = Endpoints("", "")
        self._thread = threading.Thread(
            target=self._run,
            args=(endpoint, replay_endpoint),
            name="kv-events",
            daemon=True,
        )
        # The thread binds its end of the pipe first: an inproc connect needs a bind.
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise PublisherError(f"the event publisher did not start in {START_TIMEOUT_S} s")
        if self._failure:
            self._ctx.term()
            raise PublisherError(str(self._failure[0])) from self._failure[0]
        self._pipe = self._ctx.socket(zmq.PAIR)
        self._pipe.set_hwm(hwm)
        self._pipe.connect(self._pipe_name)

    @property
    def endpoints(self) -> Endpoints:
        return self._bound

    def publish(self, payload: bytes) -> None:
        """Hand one encoded batch to the thread (never blocks; see the module docstring)."""
        if not payload:
            raise ValueError("an empty payload: a batch is never empty")
        try:
            self._pipe.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            self.counts.dropped += 1

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (the batches handed to it are sent first) and close every socket."""
        if self._thread.is_alive():
            self._pipe.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
            # A pipe that stays full means a stuck thread: it is left (a daemon).
            with contextlib.suppress(zmq.Again):
                self._pipe.send(_STOP)
            self._thread.join(timeout)
        self._pipe.close(linger=0)
        if not self._thread.is_alive():  # term() would wait for the thread's sockets
            self._ctx.term()

    # The thread.

    def _run(self, endpoint: str, replay_endpoint: str) -> None:
        pipe = self._ctx.socket(zmq.PAIR)
        pub = self._ctx.socket(zmq.PUB)
        replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        try:
            pipe.set_hwm(self._hwm)
            pipe.bind(self._pipe_name)
            pub.set_hwm(self._hwm)
            self._bound = Endpoints(
                _bind(pub, endpoint), _bind(replay, replay_endpoint) if replay else ""
            )
        except (zmq.ZMQError, ValueError) as e:
            for sock in (pipe, pub, replay):  # closed, or the context's term() would wait
                if sock is not None:
                    sock.close(linger=0)
            self._failure.append(e)
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(pipe, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        seqs = count()
        try:
            while True:
                ready = dict(poller.poll(_WAIT_MS))
                # Every batch handed over so far goes out before a replay is answered, so
                # that the replay holds them too.
                while ready.get(pipe):
                    try:
                        payload = pipe.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if payload == _STOP:
                        return
                    seq = next(seqs)
                    pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    self._buffer.append((seq, payload))
                    self.counts.published += 1
                if replay is not None and ready.get(replay):
                    self._answer(replay)
        finally:
            for sock in (pipe, pub, replay):
                if sock is not None:
                    sock.close(linger=0)

    def _answer(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        if len(frames) == 3 and frames[1] == b"" and len(frames[2]) == 8:
            start = int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    replay.send_multipart((frames[0], b"", seq.to_bytes(8, "big"), payload))
            self.counts.replays += 1
        else:
            self.counts.bad_replays += 1
            if len(frames) < 2:
                return  # nobody to answer
        replay.send_multipart((frames[0], b"", END_SEQ, b""))


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind ``sock`` (port 0: any free one); the endpoint bound."""
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"an events endpoint is tcp://HOST:PORT or ipc://PATH: got {endpoint!r}")
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        port = sock.bind_to_random_port(endpoint[: -len(":0")])
        bound = f"{endpoint[: -len(':0')]}:{port}"
    else:
        sock.bind(endpoint)
        bound = str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    return bound.replace("tcp://*:", "tcp://0.0.0.0:", 1)
