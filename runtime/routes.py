"""Where an actor's messages go: its outboxes by instance, and by role across ranks.

An actor names a peer by instance (``worker-1``), or by role when the role has one instance
here (``engine``); a role with several ranks is reached one rank at a time or all together
(:meth:`Routes.send_all`), never by a guess. Sends are traced (``msg.send``) when the log is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ringfence.runtime.log import ActorLog
from ringfence.runtime.mailbox import Outbox, RingOutbox


def instances(role: str, names: Iterable[str]) -> list[str]:
    """The instances of actor ``role`` among ``names`` ("worker-1" is rank 1 of "worker"), in
    rank order."""
    ranks = {}
    for peer in names:
        name, _, rank = peer.rpartition("-")
        if name == role and rank.isdigit():
            ranks[peer] = int(rank)
    return sorted(ranks, key=ranks.__getitem__)


def one_instance(to: str, names: Iterable[str]) -> str | None:
    """Instance ``to`` if it is among ``names``, else the one instance of actor ``to`` there;
    None when there is none, or several (an actor of several ranks is never guessed)."""
    names = list(names)
    if to in names:
        return to
    named = instances(to, names)
    return named[0] if len(named) == 1 else None


class Routes:
    """The outboxes of instance ``instance`` (the mailbox's, as they are when asked)."""

    def __init__(self, instance: str, outboxes: Mapping[str, Outbox], log: ActorLog) -> None:
        self.instance = instance
        self.outboxes = outboxes
        self.log = log
        self._routes: dict[str, Outbox] = {}

    def route(self, to: str) -> Outbox:
        """The outbox to instance ``to``, or to actor ``to`` when it has one instance here.

        A name that fits no single outbox is a KeyError naming what there is.
        """
        outbox = self._routes.get(to)
        if outbox is not None:
            return outbox
        outboxes = self.outboxes
        named = self.peers(to)
        if to in outboxes:
            outbox = outboxes[to]
        elif len(named) == 1:
            outbox = outboxes[named[0]]
        elif named:
            raise KeyError(
                f"{self.instance}: {to!r} has {len(named)} ranks here ({', '.join(named)}): "
                "name one, or send to all of them"
            )
        else:
            raise KeyError(f"{self.instance} has no outbox to {to!r}: {list(outboxes)}")
        self._routes[to] = outbox
        return outbox

    def peers(self, role: str) -> list[str]:
        """The instances of actor ``role`` this one has an outbox to, in rank order."""
        return instances(role, self.outboxes)

    def send(self, to: str, msg: object, timeout: float) -> int:
        """Send ``msg`` to ``to`` (see :meth:`route`); the transport seq."""
        outbox = self.route(to)
        return self._sent(outbox.peer, msg, outbox.send(msg, timeout))

    def send_all(self, role: str, msg: object, timeout: float) -> list[int]:
        """Send ``msg`` to every instance of ``role``, in rank order; over rings of one
        registry it is encoded once and the same bytes go to each (a step plan to every
        Worker rank)."""
        return [seqs[0] for seqs in self.send_all_many(role, [msg], timeout)]

    def send_many(self, to: str, msgs: Sequence[object], timeout: float) -> list[int]:
        """Send ``msgs`` to ``to`` in order, batched on a ring (see ``RingOutbox.send_many``);
        the transport seqs."""
        outbox = self.route(to)
        seqs = outbox.send_many(msgs, timeout)
        return [self._sent(outbox.peer, m, seq) for m, seq in zip(msgs, seqs, strict=True)]

    def send_all_many(self, role: str, msgs: Sequence[object], timeout: float) -> list[list[int]]:
        """Send ``msgs`` to every instance of ``role``, rank by rank, each rank's batched; over
        rings of one registry each message is encoded once (a schedule's ops to every rank).
        The transport seqs, by rank."""
        outboxes = [self.outboxes[peer] for peer in self.peers(role)]
        rings = [o for o in outboxes if isinstance(o, RingOutbox)]
        same = len(rings) == len(outboxes) > 1
        if not same or any(o.registry is not rings[0].registry for o in rings):
            return [self.send_many(outbox.peer, msgs, timeout) for outbox in outboxes]
        frames = [rings[0].encode(msg) for msg in msgs]
        return [
            [
                self._sent(r.peer, m, seq)
                for m, seq in zip(msgs, r.put_many(frames, timeout), strict=True)
            ]
            for r in rings
        ]

    def _sent(self, peer: str, msg: object, seq: int) -> int:
        if self.log.tracing:
            self.log.trace("msg.send", peer=peer, seq=seq, type=type(msg).__name__)
        return seq
