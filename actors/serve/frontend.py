"""The front-end actor: an HTTP server (uvicorn, its own thread) in front of the engine.

The actor is one client of the engine, on its own pair of rings (channels ``frontend ->
engine`` and back, the client protocol), so HTTP concurrency is bounded by
``server.max_pending``, not by client slots. Its thread alone writes the ring to the
engine: the HTTP side posts ``Submit`` and ``Abort`` to the actor's local inbox
(:mod:`.gateway`), and the handlers below forward them. The engine's output comes back on
the ring and is handed to the event loop, one request's stream each.

The engine is watched like the shm client watches it: the process that wrote its
``ready`` watermark when a request was sent must still be the writer and alive. When it
is not (the engine died or was replaced), every request in the engine is lost: each of
their streams ends with an error, and the next engine hears a new Hello. A Worker that
restarts loses nothing here: the engine recomputes its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from dataclasses import dataclass

from ringfence.actors.http.load import Load, LoadWatch
from ringfence.actors.protocol.client import (
    CLIENT_TO_ENGINE,
    Abort,
    Hello,
    Rejected,
    Reservation,
    Reserve,
    Stats,
    Submit,
    Tokens,
)
from ringfence.actors.serve.config import FrontEndSettings
from ringfence.actors.serve.gateway import Gateway, Handoff, Lost
from ringfence.actors.serve.health import Liveness
from ringfence.actors.serve.prompts import Prompter
from ringfence.runtime.actor import Actor, handles
from ringfence.runtime.control import InstanceControl
from ringfence.runtime.manifest import read_manifest
from ringfence.runtime.messages import Failed, Tick
from ringfence.shm.counter import CounterBlock
from ringfence.shm.errors import ActorDead
from ringfence.shm.liveness import ProcessStamp

ENGINE = "engine"
HTTP = "http"  # the peer name of the local inbox the event loop posts to
STOP_TIMEOUT_S = 5.0  # how long on_stop waits for the HTTP thread to end
LISTENING = "ringfence serve: listening on {scheme}://{host}:{port} (front end pid {pid})"
READY = "ringfence serve: ready"
STARTING = f"{ENGINE}-0 (starting)"  # /health's word for an engine up but not serving yet


@dataclass(slots=True)
class _Sent:
    """A request the front end sent the engine, as the actor follows it."""

    seq: int  # the transport seq of its Submit (a Failed reply names it)
    tokens: int = 0  # output tokens received so far


class FrontEnd(Actor):
    """See the module docstring. Handlers run in the actor's thread."""

    config_section = FrontEndSettings  # only the sections it reads
    tick_s = 0.2  # how soon a dead engine's requests are reported lost

    def on_start(self) -> None:
        config = self.ctx.config
        assert isinstance(config, FrontEndSettings) and self.ctx.run_dir is not None
        self.config = config
        manifest = read_manifest(self.ctx.run_dir)
        self.block = CounterBlock.attach(manifest.control)
        required = [
            e for e in manifest.instances if e.attach == "required" and e.id != self.ctx.instance
        ]
        self.liveness = Liveness(self.block, required)
        self.engine_ready = InstanceControl.of(self.block, manifest.instance(ENGINE, 0).index).ready
        self.engine: ProcessStamp | None = None  # the engine our requests are in
        self.in_engine: dict[str, _Sent] = {}  # by request id, until it finished
        self.reserving: dict[str, int] = {}  # reservation id -> its Reserve's seq, until answered
        self.announced_ready = False
        # What is down, as of the last tick ([] = healthy): read by the event loop's /health
        # and by every request's admission, so neither reads /proc nor races the tick.
        self.down: tuple[str, ...] = (STARTING,)
        self.engine_live = False  # the engine's process serves (as of the last tick)
        self.stats: Stats | None = None  # the engine's latest (Hello.stats asks for them)
        self.started_at = time.time()
        self.prompter = Prompter(config)
        self.inbox = self.local_inbox(HTTP, CLIENT_TO_ENGINE)
        settings = config.server
        from ringfence.actors.http import auth
        from ringfence.actors.http.tls import SERVE_NAMES, scheme, serve_tls

        keys = auth.server_keys(settings)  # a bad key file fails here
        tls = serve_tls(settings)  # and so does a bad certificate
        sock = bind(settings.host, settings.port)  # an address in use fails the start here
        self.loop = asyncio.new_event_loop()
        self.gateway = Gateway(
            self.inbox.post,
            max_pending=settings.max_pending,
            retry_after_s=settings.retry_after_s,
            engine_up=self.engine_down_reason,
        )
        self.handoff = Handoff(self.loop, self.gateway.deliver)
        self.load = LoadWatch()  # GET /ringfence/load: the Stats each tick, as the router weighs
        self.load_handoff = Handoff(self.loop, self._note_load)
        # Imported here: the HTTP stack is for this actor only.
        from ringfence.actors.serve.app import build_app
        from ringfence.actors.serve.server import HttpThread

        app = build_app(self, config, keys)
        self.http = HttpThread(app, sock, self.loop, tls, settings.header_timeout_s)
        self.http.start()
        host, port = sock.getsockname()[:2]
        self.address = (host, port)
        print(LISTENING.format(scheme=scheme(tls), host=host, port=port, pid=_pid()), flush=True)
        if auth.exposed_without_key(settings.host, keys):
            print(auth.exposed_warning("serve", host, port), file=sys.stderr, flush=True)
        if auth.keys_in_clear(settings.host, keys, tls is not None):
            flags = f"{SERVE_NAMES.certfile} and {SERVE_NAMES.keyfile}"
            warning = auth.clear_keys_warning("serve", host, port, flags)
            print(warning, file=sys.stderr, flush=True)
        self.log.info(
            "server.listening", host=host, port=port, tls=tls is not None,
            client_certificates=tls is not None and tls.client_certificates,
        )  # fmt: skip
        self.hello()

    def on_stop(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop already closed
            self.loop.call_soon_threadsafe(self.gateway.lose_all, "the server is stopping")
        self.http.stop(STOP_TIMEOUT_S)
        self.block.close()

    # The engine.

    def hello(self) -> None:
        self.engine = self.engine_ready.writer()
        self.stats = None  # until this engine sends its own
        hello = Hello(
            incarnation=self.ctx.incarnation, pid=_pid(), start_ticks=_ticks(), stats=True
        )
        self.send(ENGINE, hello)

    def engine_down_reason(self) -> str:
        """ "" when the engine takes requests; else why not (any thread; as of the last
        tick: a request sent to an engine that died since is lost in on_submit)."""
        if not self.engine_live:
            return "the engine is not running (starting or restarting)"
        if self.stats is None or not self.stats.began:
            return "the engine is starting: its executors have not all answered yet"
        return ""

    def health(self) -> list[str]:
        """What is down ([] = healthy) as of the last tick: instances, and "engine-0
        (starting)" while the engine is up but not serving yet. Any thread."""
        return list(self.down)

    def _engine_changed(self) -> bool:
        writer = self.engine_ready.writer()
        return writer != self.engine or writer is None or not writer.is_alive()

    # Requests from the event loop (local inbox) and output from the engine (ring).

    @handles(Submit)
    def on_submit(self, msg: Submit) -> None:
        if self._engine_changed():
            self._lose_all("the engine restarted; the request was not run")
            if not self.liveness.live(f"{ENGINE}-0"):  # the actor's thread: no race
                self.handoff.put(Lost(request_id=msg.request_id, error="the engine is down"))
                return
            self.hello()
        try:
            seq = self.send(ENGINE, msg, timeout=0)
        except ActorDead:
            self.handoff.put(Lost(request_id=msg.request_id, error="the engine is down"))
            return
        except (ValueError, TypeError, OverflowError) as e:  # the codec refused to encode it
            self.log.warning("server.unsendable", request=msg.request_id, error=str(e))
            self.handoff.put(Lost(request_id=msg.request_id, error=str(e), status=400))
            return
        self.in_engine[msg.request_id] = _Sent(seq)

    @handles(Reserve)
    def on_reserve(self, msg: Reserve) -> None:
        if self._engine_changed():
            self._lose_all("the engine restarted")
            if not self.liveness.live(f"{ENGINE}-0"):
                self.handoff.put(Lost(request_id=msg.reservation_id, error="the engine is down"))
                return
            self.hello()
        try:
            self.reserving[msg.reservation_id] = self.send(ENGINE, msg, timeout=0)
        except (ActorDead, ValueError, TypeError, OverflowError) as e:
            self.handoff.put(Lost(request_id=msg.reservation_id, error=f"not sent: {e}"))

    @handles(Reservation)
    def on_reservation(self, msg: Reservation) -> None:
        if msg.incarnation in (0, self.ctx.incarnation):
            self.reserving.pop(msg.reservation_id, None)
            self.handoff.put(msg)

    @handles(Abort)
    def on_abort(self, msg: Abort) -> None:
        sent = self.in_engine.get(msg.request_id)
        if sent is not None:
            self.send(ENGINE, msg, timeout=0)
            # With the engine's request.finish of the same request: how far it ran past this.
            self.log.info("server.abort", request=msg.request_id, output_tokens=sent.tokens)

    @handles(Tokens)
    def on_tokens(self, msg: Tokens) -> None:
        if msg.incarnation not in (0, self.ctx.incarnation):
            return  # meant for this front end's previous process
        if msg.finish_reason:
            self.in_engine.pop(msg.request_id, None)
        elif msg.request_id in self.in_engine:
            self.in_engine[msg.request_id].tokens += len(msg.token_ids)
        self.handoff.put(msg)

    @handles(Rejected)
    def on_rejected(self, msg: Rejected) -> None:
        if msg.incarnation not in (0, self.ctx.incarnation):
            return
        self.in_engine.pop(msg.request_id, None)
        self.handoff.put(msg)

    @handles(Stats)
    def on_stats(self, msg: Stats) -> None:
        if msg.incarnation in (0, self.ctx.incarnation):
            self.stats = msg  # read by /metrics and the engine's readiness, any thread
            self.load_handoff.put(msg)

    def _note_load(self, stats: object) -> None:  # event-loop thread
        assert isinstance(stats, Stats)
        self.load.note(Load.of(stats, self.gateway.pending))

    def handle_failed(self, msg: Failed) -> None:
        super().handle_failed(msg)  # logged
        failed = [r for r, sent in self.in_engine.items() if sent.seq == msg.seq]
        failed += [r for r, seq in self.reserving.items() if seq == msg.seq]
        for request_id in failed:  # the Submit or Reserve the engine's handler raised on
            self.in_engine.pop(request_id, None)
            self.reserving.pop(request_id, None)
            error = f"the engine failed on it: {msg.error}: {msg.message}"
            self.handoff.put(Lost(request_id=request_id, error=error))

    @handles(Tick)
    def on_tick(self, msg: Tick) -> None:
        if (self.in_engine or self.reserving) and self._engine_changed():
            self._lose_all("the engine died or restarted while running it")
        instances = self.liveness.down()
        self.engine_live = f"{ENGINE}-0" not in instances
        if not instances and self.engine != self.engine_ready.writer():
            self.hello()  # a new engine serves: announce ourselves before any request
        began = self.stats is not None and self.stats.began
        self.down = tuple(instances) if instances or began else (STARTING,)
        if not self.down and not self.announced_ready:
            self.announced_ready = True
            print(READY, flush=True)
            self.log.info("server.ready")

    def _lose_all(self, error: str) -> None:
        lost, self.in_engine = self.in_engine, {}
        reserving, self.reserving = self.reserving, {}
        for request_id in sorted([*lost, *reserving]):
            self.handoff.put(Lost(request_id=request_id, error=error))
        if lost:
            self.log.warning("server.requests_lost", requests=len(lost), error=error)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket; OSError naming the address if it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # No Nagle delay: uvicorn writes an answer's head and body apart, and the body would
        # wait 40 ms for the client's delayed ACK on a kept-alive connection (a router's).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(
            e.errno, f"server.host/server.port: cannot listen on {host}:{port}: {e.strerror}"
        ) from None
    sock.set_inheritable(False)
    return sock


def _pid() -> int:
    return ProcessStamp.current().pid


def _ticks() -> int:
    return ProcessStamp.current().start_ticks
