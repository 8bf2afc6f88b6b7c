"""Following one instance's KV events: a SUB socket, and the replay socket for what it missed.

What a subscriber written for vLLM does, done once here for ringfence's router:

- at start it asks the replay socket for every kept batch from 0 (a router that starts,
  or restarts, rebuilds what the instance holds from there), then reads the PUB socket;
- a batch whose number skips ahead (a gap: the PUB socket dropped some, or the
  subscriber was slow) is preceded by a replay of the missing numbers, and a quiet
  ``WAIT_MS`` asks the replay for anything past the last batch (a lost tail shows no gap);
- a number already handed on is a repeat (the live copy of what a replay gave), unless it
  is a batch 0 of another time than the one handed on: the instance's engine restarted
  (it numbers from 0 again, its first batch clearing every tier), so what the follower
  held of it is dropped (``on_reset``) and the new stream replayed from 0;
- a batch that cannot be decoded is counted and skipped (what it said is lost: the index
  is a hint, and the next clear or eviction event corrects it).

Batches reach ``on_batch(events)`` in order, each once, from the follower's own thread
(the caller hands them to whatever owns its index). Every wait has a deadline: the
thread wakes at least every ``WAIT_MS`` to see whether it was stopped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import zmq

from ringfence.actors.events.publisher import END_SEQ
from ringfence.actors.events.wire import WireError, decode_batch
from ringfence.cache.kv_events import KVEvent

WAIT_MS: Final = 500  # the longest the thread waits on its sockets before it checks stop
REPLAY_WAIT_MS: Final = 2000  # how long a replay's next answer may take


@dataclass(slots=True)
class FollowCounts:
    """What a follower saw; read by its owner (plain ints: a torn read is harmless)."""

    batches: int = 0  # batches handed on
    replayed: int = 0  # of which came from the replay socket
    gaps: int = 0  # gaps in the numbers seen on the PUB socket
    restarts: int = 0  # times the numbers went back (the engine restarted)
    undecodable: int = 0  # payloads skipped
    lost: int = 0  # numbers neither the PUB socket nor the replay gave
    unanswered: int = 0  # replays not asked: no live connection to the replay socket


class EventFollower:
    """One instance's event stream, followed in a thread (see the module docstring)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        *,
        on_batch: Callable[[list[KVEvent]], None],
        on_reset: Callable[[], None],
        topic: str = "",
    ) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.on_batch, self.on_reset = on_batch, on_reset
        self.topic = topic.encode()
        self.counts = FollowCounts()
        self.last = -1  # the number of the last batch handed on
        self._first_ts: float | None = None  # the time of batch 0 handed on: the engine's
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="kv-follower", daemon=True)

    def start(self) -> EventFollower:
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._ctx.term()

    # The thread.

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        replay = None
        if self.replay_endpoint:
            replay = self._ctx.socket(zmq.DEALER)
            # Requests queue only on a live connection: while the instance is gone they are
            # dropped (_replay), never piled up to be answered all at once when it is back.
            replay.setsockopt(zmq.IMMEDIATE, 1)
            replay.connect(self.replay_endpoint)
        try:
            if replay is not None:
                self._replay(replay, 0)
            while not self._stop.is_set():
                if not sub.poll(WAIT_MS):
                    # Quiet: ask for anything past the last batch, in case the SUB socket
                    # lost the stream's tail (no later batch would show the gap).
                    if replay is not None:
                        self._replay(replay, self.last + 1)
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.counts.undecodable += 1
                    continue
                self._receive(int.from_bytes(frames[1], "big"), frames[2], replay)
        finally:
            sub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _receive(self, seq: int, payload: bytes, replay: zmq.Socket[bytes] | None) -> None:
        if seq <= self.last:
            # Handed on already (the replay gave it first), unless it is the first batch
            # of a new engine: a batch 0 of another time than the one handed on.
            if seq == 0 and self._first_ts is not None and _ts(payload) != self._first_ts:
                self.counts.restarts += 1
                self.last, self._first_ts = -1, None
                self.on_reset()
                if replay is not None:
                    self._replay(replay, 0)
                    if seq <= self.last:
                        return  # the replay gave this one already
                self._hand_on(seq, payload)
            return
        if seq > self.last + 1:
            self.counts.gaps += 1
            if replay is not None:
                self._replay(replay, self.last + 1)
            if seq <= self.last:
                return
            if seq > self.last + 1:
                self.counts.lost += seq - self.last - 1
        self._hand_on(seq, payload)

    def _replay(self, replay: zmq.Socket[bytes], start: int) -> None:
        """Every kept batch from ``start`` on, handed on in order (those not handed yet);
        nothing while the replay socket has no live connection (the instance is gone)."""
        if not replay.poll(REPLAY_WAIT_MS, zmq.POLLOUT):
            self.counts.unanswered += 1  # asked again when the stream is next quiet
            return
        replay.send_multipart([b"", start.to_bytes(8, "big")])
        while replay.poll(REPLAY_WAIT_MS):
            frames = replay.recv_multipart()
            if len(frames) != 3:
                self.counts.undecodable += 1
                continue
            _, seq_bytes, payload = frames
            if seq_bytes == END_SEQ:
                return
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.last:
                if seq > self.last + 1:  # older than the replay's buffer keeps
                    self.counts.lost += seq - self.last - 1
                self.counts.replayed += 1
                self._hand_on(seq, payload)

    def _hand_on(self, seq: int, payload: bytes) -> None:
        self.last = seq
        try:
            batch = decode_batch(payload)
        except WireError:
            self.counts.undecodable += 1
            return
        if seq == 0:
            self._first_ts = batch.ts
        self.counts.batches += 1
        self.on_batch(batch.events)


def _ts(payload: bytes) -> float | None:
    try:
        return decode_batch(payload).ts
    except WireError:
        return None
