"""The runtime's own messages, understood by every actor on every channel.

Their tags sit in a reserved range (``RESERVED_TAG`` and up) that no channel
protocol may use, so a frame of any inbox whose tag is in that range is decoded
with :data:`RUNTIME` instead of the channel's registry. The supervisor sends
:class:`Stop` on its control ring; an actor answers a message it failed on with
:class:`Failed`; :class:`Tick` never travels, the run loop makes one each period.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringfence.runtime.codec import Registry, message

RESERVED_TAG = 0xFF00  # tags RESERVED_TAG..0xFFFF belong to the runtime

RUNTIME = Registry("runtime")


@message(RUNTIME, tag=0xFF01)
@dataclass(frozen=True, slots=True, kw_only=True)
class Stop:
    """Finish the message in hand, run ``on_stop``, close the mailbox and return."""

    reason: str  # why, for the log ("signal SIGTERM", "shutdown requested by sink-0")


@message(RUNTIME, tag=0xFF02)
@dataclass(frozen=True, slots=True, kw_only=True)
class Failed:
    """The answer to a message its receiver could not decode or handle."""

    seq: int  # transport seq of the failed frame on the channel it came in on
    type: str  # the failed message's class name, or "tag N" if it could not be decoded
    error: str  # the exception's class name (ProtocolError, OutOfBlocks, ...)
    message: str  # the exception's text: names what was wrong


@message(RUNTIME, tag=0xFF03)
@dataclass(frozen=True, slots=True, kw_only=True)
class Tick:
    """Periodic work: the run loop hands one to the actor every ``tick_s`` seconds."""

    n: int  # 1, 2, ... since the instance started
    late_s: float  # how far past its due time the tick is delivered
