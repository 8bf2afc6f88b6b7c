"""The Actor base class: a handler table checked at class creation, lifecycle hooks, services.

An actor is a class with one method per message type it accepts::

    class Relay(Actor):
        config_section = "demo"          # ctx.config is the [demo] section
        tick_s = 1.0                     # a Tick message every second

        @handles(Item)
        def on_item(self, msg: Item) -> None:
            self.send("sink", msg)

Each actor receives only its own config: ``config_section`` names one section, or is the
actor's settings, a frozen slotted dataclass whose fields are the sections it reads, each
named as its TOML table and typed as its section class::

    @dataclass(frozen=True, slots=True, kw_only=True)
    class LaneSettings:
        model: ModelConfig
        cache: CacheConfig

    class Lane(Actor):
        config_section = LaneSettings    # ctx.config is a LaneSettings: .model, .cache

The runtime fills it from the run's config by field name when the instance starts
(:func:`config_of`); a section the run's config lacks fails the start with a ConfigError
naming the actor and the field, and reading a section the actor did not declare is an
AttributeError. The whole config reaches no actor: it is the composition root's (the
topology and the launch checks).

The table from message type to method name is built when the class is created,
so a method that takes the wrong arguments, a non-message type, or two methods for
one type in the same class are a ``TypeError`` at import, not at the first message.
A subclass overrides a handler by handling the same type again, or by redefining
the method under the same name. A :class:`~ringfence.runtime.driver.Driver` runs
the actor: it calls ``on_start``, hands it one message at a time in its own thread,
and calls ``on_stop`` at the end; ``on_failure`` hears of every handler that
raised (the driver logs it and answers the sender first). An actor that wants a
failure to be fatal re-raises in ``on_failure``: the driver then stops with an
error and the supervisor applies the restart policy.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from ringfence.runtime.messages import Failed, Stop, Tick
from ringfence.shm.errors import ConfigError

if TYPE_CHECKING:
    from ringfence.runtime.codec import Registry
    from ringfence.runtime.config import RunConfig, RuntimeConfig
    from ringfence.runtime.log import ActorLog
    from ringfence.runtime.mailbox import Delivery, LocalInbox
    from ringfence.shm.counter import CounterBlock, Waker

F = TypeVar("F", bound=Callable[..., None])
_MARK = "__ringfence_handles__"


def handles(*types: type) -> Callable[[F], F]:
    """Mark a method as the handler of the given message types."""
    if not types:
        raise TypeError("@handles needs at least one message type")

    def mark(fn: F) -> F:
        setattr(fn, _MARK, getattr(fn, _MARK, ()) + types)
        return fn

    return mark


class Services(Protocol):
    """What the driver offers an actor; reached through :class:`Actor` methods."""

    def send(self, to: str, msg: object, timeout: float | None) -> int: ...
    def send_all(self, role: str, msg: object, timeout: float | None) -> list[int]: ...
    def send_many(self, to: str, msgs: Sequence[object], timeout: float | None) -> list[int]: ...
    def send_all_many(
        self, role: str, msgs: Sequence[object], timeout: float | None
    ) -> list[list[int]]: ...
    def peers(self, role: str) -> list[str]: ...
    def schedule(self, delay_s: float, msg: object) -> None: ...
    def stop(self, reason: str) -> None: ...
    def request_shutdown(self, reason: str) -> None: ...
    def wait_until(self, ready: Callable[[], bool], timeout: float | None) -> bool: ...
    def current_epoch(self) -> int: ...
    def bell_of(self, instance: str) -> Waker | None: ...
    def local_inbox(self, peer: str, registry: Registry) -> LocalInbox: ...
    def peek(self, peer: str) -> object | None: ...
    def own_bell(self) -> Waker: ...
    @property
    def current(self) -> Delivery | None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ActorContext:
    """Everything an actor instance knows about where it runs. Built by the driver."""

    name: str  # role name, e.g. "relay"
    rank: int
    run_id: str  # "" for an actor that runs outside any launched run (local tests)
    run_dir: Path | None
    placement: str  # "spawn", "external" (attached by a user's process), "hosted" or "local"
    incarnation: int  # 1 for the first start of this instance, +1 per restart or re-attach
    epoch: int  # the run epoch when this incarnation started (bumped on every restart)
    config: object | None  # the actor's own config (Actor.config_section: see config_of), or None
    runtime: RuntimeConfig
    log: ActorLog
    counters: Mapping[str, CounterBlock]  # the topology's counter blocks, by name
    services: Services

    @property
    def instance(self) -> str:
        return f"{self.name}-{self.rank}"


def _check_handler(owner: type, attr: str, fn: Callable[..., None], msg_type: type) -> None:
    where = f"{owner.__qualname__}.{attr}"
    if not (isinstance(msg_type, type) and dataclasses.is_dataclass(msg_type)):
        raise TypeError(f"{where}: @handles({msg_type!r}): not a message dataclass")
    params = list(inspect.signature(fn).parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(params) != 2 or any(p.kind not in positional for p in params):
        raise TypeError(f"{where}: a handler takes (self, msg), got {inspect.signature(fn)}")


def _build_table(cls: type) -> dict[type, str]:
    """Message type -> method name, from the bases down; a class may not handle a type twice."""
    table: dict[type, str] = {}
    for klass in reversed(cls.__mro__):
        own: dict[type, str] = {}
        for attr, fn in vars(klass).items():
            for msg_type in getattr(fn, _MARK, ()):
                _check_handler(klass, attr, fn, msg_type)
                if msg_type in own:
                    raise TypeError(
                        f"{klass.__qualname__}: {msg_type.__name__} is handled by both "
                        f"{own[msg_type]} and {attr}"
                    )
                own[msg_type] = attr
        table.update(own)
    return table


def _check_config_section(cls: type[Actor]) -> None:
    """TypeError unless ``cls.config_section`` is None, a section's name, or settings: a
    frozen, slotted dataclass each of whose fields is typed as a section (a dataclass)."""
    declared = cls.config_section
    where = f"{cls.__qualname__}.config_section"
    if declared is None or (isinstance(declared, str) and declared):
        return
    if declared == "":
        raise TypeError(
            f"{where} = '': the whole config reaches no actor; name its section, or a "
            "dataclass of the sections it reads"
        )
    if not (isinstance(declared, type) and dataclasses.is_dataclass(declared)):
        raise TypeError(f"{where}: a section's name or a dataclass of sections, got {declared!r}")
    name = declared.__qualname__
    own = vars(declared)
    if not own["__dataclass_params__"].frozen or "__slots__" not in own:
        raise TypeError(f"{where}: {name} must be a frozen, slotted dataclass")
    hints = typing.get_type_hints(declared)
    for f in dataclasses.fields(declared):
        if not dataclasses.is_dataclass(hints[f.name]):
            raise TypeError(f"{where}: {name}.{f.name} is not a section (a dataclass)")


def config_of(actor_cls: type[Actor], config: RunConfig) -> object | None:
    """What ``actor_cls`` receives as ``ctx.config`` from the run's ``config``: None, the
    section it names, or its settings filled with the sections its fields name
    (:meth:`RunConfig.sections`). ConfigError naming the actor, and the field, where the run's
    config has no such section."""
    declared = actor_cls.config_section
    if declared is None:
        return None
    try:
        if isinstance(declared, str):
            return config.section(declared)
        return config.sections(declared)
    except ConfigError as e:
        who = f"{actor_cls.__module__}:{actor_cls.__qualname__}"
        raise ConfigError(f"actor {who}: {e}", key=e.key) from None


class Actor:
    """Base of every actor. Subclasses add ``@handles`` methods and may override the hooks.

    All methods run in the driver's thread, one at a time; an actor needs no locks.
    """

    # What ctx.config holds: None, the TOML section of this name ("demo", "cache.storage"),
    # or this settings class filled with the sections its fields name (module docstring).
    config_section: ClassVar[str | type | None] = None
    tick_s: ClassVar[float | None] = None  # period of Tick messages; None: no ticks
    handlers: ClassVar[Mapping[type, str]]  # message type -> method name, built per class

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_config_section(cls)
        if cls.tick_s is not None and not cls.tick_s > 0:
            raise TypeError(f"{cls.__qualname__}.tick_s must be > 0 or None")
        cls.handlers = _build_table(cls)
        if cls.tick_s is not None and Tick not in cls.handlers:
            raise TypeError(f"{cls.__qualname__}.tick_s is set but no method handles Tick")

    def __init__(self, ctx: ActorContext) -> None:
        self.ctx = ctx
        self.log = ctx.log

    # Hooks.

    def on_start(self) -> None:
        """Before the first message. Raising here fails the start (exit code 1)."""

    def on_stop(self) -> None:
        """After the last message, before the mailbox closes."""

    def on_failure(self, error: Exception, delivery: Delivery) -> None:
        """A handler raised ``error``; it was logged and answered. Re-raise to die instead."""

    # Services.

    def send(self, to: str, msg: object, *, timeout: float | None = None) -> int:
        """Send to instance ``to`` ("sink-0"), or to actor ``to`` when it has one instance
        here (one with several ranks: name one, or :meth:`send_all`).

        Blocks while the ring is full, up to ``timeout`` (default: half the heartbeat
        timeout). Returns the transport seq. RingFull or ActorDead at the deadline.
        """
        return self.ctx.services.send(to, msg, timeout)

    def send_all(self, role: str, msg: object, *, timeout: float | None = None) -> list[int]:
        """Send ``msg`` to every instance of actor ``role`` (each rank), in rank order, as
        :meth:`send` would (encoded once where every ring shares a registry); the transport
        seqs."""
        return self.ctx.services.send_all(role, msg, timeout)

    def send_many(
        self, to: str, msgs: Sequence[object], *, timeout: float | None = None
    ) -> list[int]:
        """Send ``msgs`` to ``to`` in order as :meth:`send` would, batched on a ring: a
        ``put_many`` (one doorbell ring) per batch, as many as the ring's batch limit needs.
        RingFull at the deadline carries ``sent``: the messages published before it."""
        return self.ctx.services.send_many(to, msgs, timeout)

    def send_all_many(
        self, role: str, msgs: Sequence[object], *, timeout: float | None = None
    ) -> list[list[int]]:
        """:meth:`send_many` to every instance of actor ``role``, in rank order; the transport
        seqs by rank."""
        return self.ctx.services.send_all_many(role, msgs, timeout)

    def schedule(self, delay_s: float, msg: object) -> None:
        """Hand ``msg`` to this actor's own handler after ``delay_s`` (a timer is a message)."""
        self.ctx.services.schedule(delay_s, msg)

    def stop(self, reason: str) -> None:
        """Stop this instance after the current message (the run goes on)."""
        self.ctx.services.stop(reason)

    def request_shutdown(self, reason: str) -> None:
        """Ask the supervisor to stop the whole run in order (e.g. the workload is done)."""
        self.ctx.services.request_shutdown(reason)

    def wait_until(self, ready: Callable[[], bool], *, timeout: float | None = None) -> bool:
        """Sleep on this actor's own doorbell until ``ready()`` is true; False at the deadline.

        For a handler that must wait for a watermark written by another actor (the
        writer rings this actor's bell, see :meth:`bell_of`). The default deadline is
        the send timeout, half the heartbeat timeout, so the heartbeat never lapses;
        a handler that runs out of time raises a ``WaitTimeout`` and the driver hands
        the message over again later (``msg.deferred``).
        """
        return self.ctx.services.wait_until(ready, timeout)

    def current_epoch(self) -> int:
        """The run epoch now (the supervisor bumps it on every restart); ctx.epoch at start."""
        return self.ctx.services.current_epoch()

    def bell_of(self, instance: str) -> Waker | None:
        """The doorbell of instance ``instance`` ("engine-0") of this run, to ring after an
        advance of a watermark it waits on; None when the run has no such instance."""
        return self.ctx.services.bell_of(instance)

    def local_inbox(self, peer: str, registry: Registry) -> LocalInbox:
        """A new in-process inbox from ``peer`` (messages of ``registry``): other threads of
        this process post to it, and each post wakes this actor like a ring frame does. Its
        messages are handled in this actor's thread, in order, by the usual handlers."""
        return self.ctx.services.local_inbox(peer, registry)

    def peek(self, peer: str) -> object | None:
        """The next message from instance ``peer`` ("engine-0", or an actor with one instance
        here: "engine") if it has arrived, read ahead while this handler runs (None if none
        has, or it could not be decoded). It is handed to its handler next from that peer,
        as usual, and released only once that handler ran: for work a handler can do early,
        such as checking the next step while the device runs this one."""
        return self.ctx.services.peek(peer)

    def own_bell(self) -> Waker:
        """This actor's own doorbell, for a thread of this process to wake it: a
        :meth:`wait_until` in progress looks at its condition again."""
        return self.ctx.services.own_bell()

    @handles(Stop)
    def handle_stop(self, msg: Stop) -> None:
        self.stop(msg.reason)

    @handles(Failed)
    def handle_failed(self, msg: Failed) -> None:
        sender = self.ctx.services.current
        self.log.warning(
            "msg.refused",
            peer=sender.peer if sender else None,
            seq=msg.seq,
            type=msg.type,
            error=msg.error,
            message=msg.message,
        )


Actor.handlers = _build_table(Actor)
