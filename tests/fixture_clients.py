"""A fake engine for the client tests: ``runtime.topology=fixture_clients:CLIENTS``.

:class:`EchoEngine` answers each request with its prompt tokens reversed (a text
prompt's tokens are its UTF-8 bytes), cycled, one token per request per tick,
until ``max_tokens`` ("length") or a stop token ("stop"). Prompt token REFUSED is
rejected through the hub; prompt token EXPLODE makes the Submit handler raise. A client
whose Hello asks for Stats gets one then and on every tick: began, ``steps`` the ticks
so far, ``running`` its requests running, every other figure zero. A Reserve is refused
(NO_RESERVATIONS).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ringfence.actors.client.client import CLIENT_ACTOR, CLIENT_CHANNELS, Client
from ringfence.actors.engine.clients import ClientHub, RequestKey, RequestRefused
from ringfence.actors.engine.stats import no_stats
from ringfence.actors.protocol.client import Abort, Hello, Reservation, Reserve, Stats, Submit
from ringfence.runtime.actor import Actor, handles
from ringfence.runtime.messages import Tick
from ringfence.runtime.topology import ActorSpec, Topology

REFUSED = 999  # a prompt holding this token is rejected
EXPLODE = 666  # a prompt holding this token makes the engine's handler raise
TICK_S = 0.02
NO_RESERVATIONS = "the echo engine grants no reservations"


class Exploded(RuntimeError):
    """Raised by EchoEngine for a prompt holding EXPLODE."""


def echo_tokens(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """The output EchoEngine produces for ``prompt`` with no stop tokens."""
    cycle = list(reversed(prompt))
    return [cycle[i % len(cycle)] for i in range(max_tokens)]


class EchoEngine(Actor):
    """A fake engine: a ClientHub and one token per running request per tick."""

    tick_s = TICK_S

    def on_start(self) -> None:
        self.hub = ClientHub(lambda to, m: self.send(to, m, timeout=0), self.log)
        self.running: dict[RequestKey, tuple[Submit, list[int]]] = {}  # key -> request, output
        self.ticks = 0

    def stats(self) -> Stats:
        return dataclasses.replace(
            no_stats(), began=True, steps=self.ticks, running=len(self.running)
        )

    @handles(Hello)
    def on_hello(self, msg: Hello) -> None:
        peer = self._peer()
        for key in self.hub.hello(peer, msg):
            self.running.pop(key, None)
        if msg.stats:
            self.hub.post_stats(self.stats(), peer)
            self.hub.flush()

    @handles(Reserve)
    def on_reserve(self, msg: Reserve) -> None:
        """An echo engine is no decode instance: every reservation is refused for good."""
        # incarnation: the hub sends it with the peer's current one.
        answer = Reservation(reservation_id=msg.reservation_id, incarnation=0, granted=False,
                             error=NO_RESERVATIONS)  # fmt: skip
        self.hub.answer_reservation(self._peer(), answer)
        self.hub.flush()

    @handles(Submit)
    def on_submit(self, msg: Submit) -> None:
        peer = self._peer()
        # A chat echoes its last message's content.
        text = msg.prompt or (msg.messages[-1]["content"] if msg.messages else "")
        prompt = msg.prompt_token_ids or tuple(text.encode())
        if EXPLODE in prompt:
            raise Exploded(f"token {EXPLODE} in the prompt")
        try:
            if REFUSED in prompt:
                raise RequestRefused(f"token {REFUSED} is refused")
            key = self.hub.submit(peer, msg)
        except RequestRefused as e:
            self.hub.reject(peer, msg.request_id, str(e))
            self.hub.flush()
            return
        self.running[key] = (msg, echo_tokens(prompt, msg.params.max_tokens))

    @handles(Abort)
    def on_abort(self, msg: Abort) -> None:
        key = self.hub.abort(self._peer(), msg.request_id)
        if key is not None:
            del self.running[key]
            self.hub.emit(key, finish_reason="abort")
            self.hub.flush()

    @handles(Tick)
    def on_tick(self, msg: Tick) -> None:
        self.ticks += 1
        for key in self.hub.stuck_or_dead():
            self.running.pop(key, None)
        if self.hub.watching():
            self.hub.post_stats(self.stats())
        for key, (submit, output) in list(self.running.items()):
            done = submit.params.max_tokens - len(output)
            token = output.pop(0)
            first = done == 0
            finish = "stop" if token in submit.params.stop_token_ids else "" if output else "length"
            self.hub.emit(
                key,
                (token,),
                finish_reason=finish,
                cached_tokens={"device": 1, "host": 2, "storage": 3} if first else None,
                ttft_s=0.5 if first else -1.0,
            )
            if finish:
                del self.running[key]
        self.hub.flush()

    def _peer(self) -> str:
        delivery = self.ctx.services.current
        assert delivery is not None
        return delivery.peer


CLIENTS = Topology(
    actors=(CLIENT_ACTOR, ActorSpec(name="engine", target=f"{__name__}:EchoEngine")),
    channels=CLIENT_CHANNELS,
)


# Bodies of client processes (spawned by tests/peers.py: module-level, so picklable).


def generate_in_child(run_dir: str, prompt: list[int], max_tokens: int, out: str) -> None:
    """Connect, generate, write "<slot> <token ids>" to ``out``."""
    with Client.connect(run_dir) as client:
        done = client.generate(prompt, max_tokens=max_tokens, timeout=30)
        Path(out).write_text(f"{client.instance} {' '.join(map(str, done.token_ids))}")


def stream_forever_in_child(run_dir: str, out: str) -> None:
    """Connect, submit a long request, write "<slot> <pid>" to ``out`` after its first token,
    then keep streaming until killed."""
    with Client.connect(run_dir) as client:
        request_id = client.submit([1, 2, 3], max_tokens=1_000_000)
        for n, _token in enumerate(client.stream(request_id, timeout=120)):
            if n == 0:
                Path(out).write_text(f"{client.instance} {os.getpid()}")
