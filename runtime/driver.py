"""The Driver: runs one actor instance: its message loop, timers, heartbeat and lifecycle.

The loop, in the thread that calls :meth:`Driver.run` (or :meth:`Driver.poll`)::

    on_start; mark ready
    until stopped:
        for each inbox (the supervisor's control inbox first), up to BATCH messages:
            read -> handler -> commit          (commit only after the handler returned)
        fire due timers (Tick, schedule())
        every heartbeat_s: advance the heartbeat, check the supervisor is alive
        nothing to do: sleep on the mailbox until a message, the next timer or beat
    on_stop; mark exited; close the mailbox

A handler that raises is logged, answered when its sender expects a reply, and
reported to ``on_failure``; the actor lives on (dispatch.py holds that one catch-all
``except``). A ring frame that is malformed or out of sequence is answered and logged the
same way and skipped (``RingInbox.read``). What escapes ``on_failure`` or ``on_start`` ends
the instance with an error (the supervisor then applies the restart policy).

Delivery is at least once: a message whose handler was cut short by a crash is
handed to the restarted instance again, so handlers are made idempotent with the
sequence numbers their messages carry.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ringfence.runtime.actor import Actor, ActorContext
from ringfence.runtime.dispatch import Dispatcher
from ringfence.runtime.mailbox import Delivery, Inbox, LocalInbox, Mailbox, PollWaiter
from ringfence.runtime.messages import Tick
from ringfence.runtime.routes import Routes, one_instance
from ringfence.runtime.timers import Timers
from ringfence.shm.doorbell import Doorbell
from ringfence.shm.errors import ProtocolError

if TYPE_CHECKING:
    from ringfence.runtime.codec import Registry
    from ringfence.runtime.config import RuntimeConfig
    from ringfence.runtime.control import InstanceControl
    from ringfence.runtime.log import ActorLog
    from ringfence.shm.counter import CounterBlock
    from ringfence.shm.liveness import ProcessStamp

BATCH = 64  # messages taken from one inbox before looking at the others


class Driver:
    """Runs one actor. Use from one thread: ``run()``, or ``poll()`` from a host loop, or
    ``start_thread()``; ``stop()`` may be called from any thread.

    The driver owns the mailbox and (when ``owns_log``) the log, and closes both when
    the actor stops. It installs no signal handlers and never exits the process.
    """

    def __init__(
        self,
        actor_cls: type[Actor],
        *,
        name: str,
        rank: int,
        mailbox: Mailbox,
        runtime: RuntimeConfig,
        log: ActorLog,
        config: object | None = None,
        run_id: str = "",
        run_dir: Path | None = None,
        placement: str = "local",
        incarnation: int = 1,
        counters: Mapping[str, CounterBlock] | None = None,
        control: InstanceControl | None = None,
        supervisor: ProcessStamp | None = None,
        owns_log: bool = True,
        bells: Mapping[str, str] | None = None,
    ) -> None:
        if runtime.wait == "poll" and not isinstance(mailbox.waiter, PollWaiter):
            mailbox.waiter = PollWaiter(mailbox.waiter)
        self.mailbox = mailbox
        self.runtime = runtime
        self.log = log
        self._control = control
        self._supervisor = supervisor
        self._owns_log = owns_log
        self._incarnation = incarnation
        self._send_timeout = runtime.heartbeat_timeout_s / 2
        self._bell_names = dict(bells or {})  # instance id -> POSIX name of its doorbell
        self._bells: dict[str, Doorbell] = {}
        self._peeked: dict[str, Inbox] = {}  # peek's name -> the inbox it reads ahead
        self.ctx = ActorContext(
            name=name,
            rank=rank,
            run_id=run_id,
            run_dir=run_dir,
            placement=placement,
            incarnation=incarnation,
            epoch=control.epoch.value() if control else 0,
            config=config,
            runtime=runtime,
            log=log,
            counters=counters or {},
            services=self,
        )
        self.routes = Routes(self.ctx.instance, mailbox.outboxes, log)
        self.actor = actor_cls(self.ctx)
        self.dispatcher = Dispatcher(
            instance=self.ctx.instance,
            actor=self.actor,
            table={t: getattr(self.actor, m) for t, m in actor_cls.handlers.items()},
            outboxes=mailbox.outboxes,
            log=log,
        )
        self.timers = Timers(self.ctx.instance, actor_cls.tick_s)
        self._next_beat = 0.0
        self._ready_cpu_s = time.process_time()
        self.started = False
        self.stop_reason: str | None = None
        self.closed = False
        self.error: BaseException | None = None  # what ended the instance, if anything did
        self.failed_in: str | None = None  # where it did: "on_start", "loop" or "on_stop"
        self._thread: threading.Thread | None = None

    @property
    def handled(self) -> int:
        """Messages handed to a handler (failed ones included)."""
        return self.dispatcher.handled

    @property
    def failures(self) -> int:
        """Handlers that raised, and frames that could not be decoded."""
        return self.dispatcher.failures

    @property
    def deferred(self) -> int:
        """Messages handed over again because a send or wait was blocked."""
        return self.dispatcher.deferred

    # Services offered to the actor (see actor.Services).

    @property
    def current(self) -> Delivery | None:
        return self.dispatcher.current

    def peers(self, role: str) -> list[str]:
        return self.routes.peers(role)

    def send(self, to: str, msg: object, timeout: float | None) -> int:
        return self.routes.send(to, msg, self._send_timeout if timeout is None else timeout)

    def send_all(self, role: str, msg: object, timeout: float | None) -> list[int]:
        return self.routes.send_all(role, msg, self._send_timeout if timeout is None else timeout)

    def send_many(self, to: str, msgs: Sequence[object], timeout: float | None) -> list[int]:
        return self.routes.send_many(to, msgs, self._send_timeout if timeout is None else timeout)

    def send_all_many(
        self, role: str, msgs: Sequence[object], timeout: float | None
    ) -> list[list[int]]:
        timeout = self._send_timeout if timeout is None else timeout
        return self.routes.send_all_many(role, msgs, timeout)

    def schedule(self, delay_s: float, msg: object) -> None:
        if not self.dispatcher.handles(type(msg)):
            raise ProtocolError(f"{self.ctx.instance}: no handler for {type(msg).__name__}")
        self.timers.add(time.monotonic() + delay_s, msg)

    def stop(self, reason: str) -> None:
        """Stop after the current message (any thread). The first reason given is kept."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self.mailbox.wake()

    def request_shutdown(self, reason: str) -> None:
        self.log.info("run.shutdown_requested", reason=reason)
        if self._control is None:
            self.stop(reason)
            return
        shutdown = self._control.shutdown
        shutdown.advance(shutdown.value() + 1)

    def wait_until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        return self.mailbox.waiter.wait_until(
            ready, self._send_timeout if timeout is None else timeout
        )

    def current_epoch(self) -> int:
        return self._control.epoch.value() if self._control is not None else self.ctx.epoch

    def peek(self, peer: str) -> object | None:
        inbox = self._peeked.get(peer)  # looked up once: a wait's condition peeks often
        if inbox is None:
            by_peer = {i.peer: i for i in self.mailbox.inboxes}
            name = one_instance(peer, by_peer)  # the rule sends follow (routes.py)
            if name is None:  # no such peer, or an actor of several instances here
                return None
            inbox = self._peeked[peer] = by_peer[name]
        delivery = inbox.peek()
        return None if delivery is None else delivery.msg

    def own_bell(self) -> Mailbox:
        return self.mailbox  # its ring() is wake(): from any thread, nothing once closed

    def bell_of(self, instance: str) -> Doorbell | None:
        bell = self._bells.get(instance)
        if bell is None and instance in self._bell_names:
            bell = Doorbell.attach(self._bell_names[instance], spin_us=self.runtime.spin_us)
            self._bells[instance] = bell
        return bell

    def local_inbox(self, peer: str, registry: Registry) -> LocalInbox:
        return self.mailbox.add_local_inbox(peer, registry)

    # Lifecycle.

    def start(self) -> None:
        """Run ``on_start`` and report ready. Called by run()/poll() if not called before."""
        if self.started:
            return
        self.started = True
        cls = type(self.actor)
        self.log.info(
            "actor.start",
            incarnation=self._incarnation,
            placement=self.ctx.placement,
            target=f"{cls.__module__}:{cls.__qualname__}",
            inboxes=[inbox.peer for inbox in self.mailbox.inboxes],
            outboxes=list(self.mailbox.outboxes),
        )
        try:
            self.actor.on_start()
            if cls.tick_s is not None:
                self.schedule(cls.tick_s, Tick(n=0, late_s=0.0))
            if self._control is not None:
                self._control.ready.advance(self._incarnation)
        except BaseException as e:
            self._fail("on_start", e)
            raise
        self._ready_cpu_s = time.process_time()
        self._next_beat = time.monotonic()

    def run(self) -> str:
        """Start, then handle messages until stopped; close; return the stop reason.

        Raises what ended the instance abnormally (after logging it and closing), an
        ``on_stop`` that raised included.
        """
        try:
            self.start()
            while self.stop_reason is None:
                self.poll(self.runtime.heartbeat_s)
        finally:
            self.close()
        if self.error is not None:
            raise self.error
        assert self.stop_reason is not None
        return self.stop_reason

    def poll(self, timeout: float) -> int:
        """Handle what is there (waiting up to ``timeout`` for something); return how many.

        For a host's own loop. Starts the actor on the first call; once stopped, closes
        it and returns 0 (check :attr:`stop_reason`).
        """
        if self.closed:
            return 0
        try:
            self.start()
            handled = self._turn(timeout)
        except BaseException as e:
            self._fail("loop", e)
            self.close()
            raise
        if self.stop_reason is not None:
            self.close()
        return handled

    def start_thread(self) -> threading.Thread:
        """Run the actor in a daemon thread of this process; ``stop()`` then ``join()`` it."""
        if self._thread is not None:
            raise RuntimeError(f"{self.ctx.instance} already runs in {self._thread.name}")

        def body() -> None:
            try:
                self.run()
            except BaseException:  # already logged and kept in self.error
                return

        self._thread = threading.Thread(target=body, name=f"ringfence-{self.ctx.instance}")
        self._thread.daemon = True
        self._thread.start()
        return self._thread

    def join(self, timeout: float) -> bool:
        """Wait for the thread of start_thread() to end; True if it did."""
        if self._thread is None:
            return self.closed
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        """Run ``on_stop`` (if started), report exited, close the mailbox. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.stop_reason is None:
            self.stop_reason = "closed" if self.error is None else "failed"
        try:
            if self.started and self.error is None:
                self.actor.on_stop()
        except Exception as e:
            self._fail("on_stop", e)
        finally:
            self.log.info(
                "actor.stop",
                reason=self.stop_reason,
                handled=self.handled,
                failures=self.failures,
                deferred=self.deferred,
                error=None if self.error is None else repr(self.error),
                # CPU of the process (every thread) since ready: the whole-instance cost a
                # bench adds up (in a process of several actors, each counts all of it).
                cpu_s=round(time.process_time() - self._ready_cpu_s, 3),
            )
            if self._control is not None and self.error is None:
                self._control.exited.advance(self._incarnation)
            self.mailbox.close()
            bells, self._bells = self._bells, {}
            for bell in bells.values():
                bell.close()
            if self._owns_log:
                self.log.close()

    # The loop.

    def _turn(self, timeout: float) -> int:
        handled = self._drain()
        now = time.monotonic()
        due = self.timers.next_due()
        if due is not None and due <= now:
            handled += self.timers.fire(now, self.dispatcher.dispatch, self._stopping)
            now = time.monotonic()  # a timer's handler may have waited on a full ring
        if now >= self._next_beat:
            self._beat(now)
        if handled or self.stop_reason is not None:
            return handled
        wake_at = min(self._next_beat, now + timeout)
        due = self.timers.next_due()
        if due is not None:
            wake_at = min(wake_at, due)
        if wake_at > now:
            self.log.flush()  # buffered trace lines reach the file before we go idle
            self.mailbox.wait(wake_at - now)
        return 0

    def _drain(self) -> int:
        handled = 0
        for inbox in self.mailbox.inboxes:
            for _ in range(BATCH):
                delivery = inbox.read()
                if delivery is None:
                    break
                handled += 1
                if not self.dispatcher.dispatch(delivery):
                    inbox.redeliver(delivery)  # blocked downstream: this inbox waits its turn
                    break
                inbox.commit()  # after the handler: a crash before here redoes the message
                if self.stop_reason is not None:
                    return handled
                now = time.monotonic()
                if now >= self._next_beat:  # slow handlers in a row must not look hung
                    self._beat(now)
        return handled

    def _stopping(self) -> bool:
        return self.stop_reason is not None

    def _beat(self, now: float) -> None:
        self._next_beat = now + self.runtime.heartbeat_s
        if self._control is not None:
            # From the counter, not a count of our own: it outlives incarnations.
            heartbeat = self._control.heartbeat
            heartbeat.advance(heartbeat.value() + 1)
        if self._supervisor is not None and not self._supervisor.is_alive():
            self.log.warning("supervisor.lost", supervisor_pid=self._supervisor.pid)
            self.stop("supervisor lost")

    def _fail(self, where: str, error: BaseException) -> None:
        if self.error is not None:
            return
        self.error, self.failed_in = error, where
        exc: Any = error if isinstance(error, Exception) else None
        self.log.error("actor.failed", where=where, error=repr(error), exc_info=exc)
