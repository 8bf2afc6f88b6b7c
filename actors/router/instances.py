"""The router's instances: who each one is (read once at start), and which one gets the next.

At start the router reads ``GET /ringfence/instance`` of every instance it was given,
waiting until each one answers (an instance starts in minutes), and refuses a pool it
cannot run: an instance of the wrong role, or two instances whose fingerprints differ
(they could not share KV through the tier), or whose storage secrets differ (each would
take the other's blocks for forgeries; compared by a keyed hash of the secret that
reveals nothing of it). The load it picks prefill and decode
instances by is its own count of requests in flight on each (:attr:`Instance.in_flight`),
exact for the requests it routes and free to read; for aggregated instances it also
follows each one's own word (``GET /ringfence/load``, :attr:`Instance.load`), which counts
every client's requests and the KV blocks free (``state.py``, ``policy.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ringfence.actors.http.env import INSTANCE_KEY_ENV
from ringfence.actors.http.load import Load
from ringfence.actors.router.upstream import (
    CallTimeout,
    TlsRefused,
    TransportError,
    Upstream,
    describe,
)
from ringfence.shm.errors import RingfenceError

ROLES = ("prefill", "decode", "both")  # both: an aggregated instance (--instance)
IDENTIFY_CALL_S = 5.0  # one GET /ringfence/instance
FIRST_WAIT_S = 0.05  # the first wait between two tries at start; it doubles up to MAX_WAIT_S
MAX_WAIT_S = 1.0


class PoolRefused(RingfenceError, ValueError):
    """The instances cannot work together (roles, fingerprints, storage secrets), or will not
    work with the router (its key refused, a certificate that does not verify); the message
    names them."""


class StartTimeout(RingfenceError, TimeoutError):
    """An instance did not answer ``/ringfence/instance`` before the start deadline."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Identity:
    """What ``GET /ringfence/instance`` says of an instance (the fields the router uses)."""

    role: str  # "both", "prefill" or "decode"
    model: str  # the served model's name
    fingerprints: tuple[str, ...]  # the storage namespaces, one per tp rank
    namespace: str = ""  # the block keys' namespace (hex): how to hash a prompt as it does
    secret_id: str = ""  # its storage secret's identifier (cache.storage.secret); "" for none
    block_size: int = 0
    events: tuple[str, str] | None = None  # where it publishes KV events, and replays them
    serving: bool = True  # False while its engine is down (restarting, or not begun)
    salt_by_key: bool = False  # it salts requests by their key: the router's, behind a router

    @classmethod
    def of(cls, url: str, body: Any) -> Identity:
        """The identity in ``body``; ValueError naming ``url`` and the field if malformed."""
        try:
            prints = body["fingerprints"]
            if not (isinstance(prints, list) and all(isinstance(p, str) for p in prints)):
                raise TypeError(f"fingerprints is {prints!r}, not a list of strings")
            events = body.get("events")
            return cls(
                role=str(body["role"]),
                model=str(body["model"]),
                fingerprints=tuple(prints),
                namespace=str(body.get("namespace") or ""),
                secret_id=str(body.get("storage_secret_id") or ""),
                block_size=int(body.get("block_size") or 0),
                events=(str(events["endpoint"]), str(events["replay_endpoint"]))
                if isinstance(events, dict)
                else None,
                serving=bool(body.get("serving", True)),
                salt_by_key=bool(body.get("salt_by_key", False)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PoolRefused(f"{url}/ringfence/instance: not an instance's answer ({e!r})") from e


class Instance:
    """One instance as the router knows it. Owned by the server's event loop."""

    def __init__(self, url: str, role: str, identity: Identity) -> None:
        self.url = url.rstrip("/")
        self.role = role  # the role the router was told (--prefill or --decode)
        self.identity = identity
        self.in_flight = 0  # requests of this router on it: reserved/prefilling to answered
        self.load: Load | None = None  # its own word (GET /ringfence/load), when followed
        self.in_flight_at_load = 0  # in_flight when that word came
        # This router's requests sent here and not begun (no first byte yet): how many, and
        # the prefill they need here in blocks (what they missed), the queue ahead of the next.
        self.unstarted = 0
        self.ahead_blocks = 0.0
        self.unstarted_at_load = 0  # unstarted when that word came

    def __repr__(self) -> str:
        return f"Instance({self.role} {self.url}, in_flight={self.in_flight})"

    def count_in_flight(self) -> int:
        return self.in_flight

    def describe(self) -> str:
        """``http://h:p (decode, fingerprints [ab12..])``: for messages naming the instance."""
        prints = ", ".join(self.identity.fingerprints)
        return f"{self.url} ({self.identity.role}, fingerprints [{prints}])"


class Pool:
    """The instances by role, and the pick: fewest in flight, ties round robin."""

    def __init__(self, instances: list[Instance]) -> None:
        self.instances = instances
        self._by_role = {role: [i for i in instances if i.role == role] for role in ROLES}
        self._cursor = dict.fromkeys(ROLES, 0)  # where the next tie-break starts, per role

    def of_role(self, role: str) -> list[Instance]:
        return list(self._by_role[role])

    def pick(
        self,
        role: str,
        *,
        exclude: frozenset[Instance] = frozenset(),
        prefer: Instance | None = None,
    ) -> Instance | None:
        """The instance of ``role`` to use next (``prefer`` if it may be used), or None.

        Among those with the fewest requests in flight, the first from the cursor on: equal
        loads take turns, so idle instances share a trickle of requests evenly.
        """
        if prefer is not None and prefer.role == role and prefer not in exclude:
            return prefer
        ring = self._by_role[role]
        start = self._cursor[role]
        order = [ring[(start + k) % len(ring)] for k in range(len(ring))]
        order = [i for i in order if i not in exclude]
        if not order:
            return None
        chosen = min(order, key=lambda i: i.in_flight)  # min keeps the first of equals
        self._cursor[role] = (ring.index(chosen) + 1) % len(ring)
        return chosen

    @staticmethod
    def acquire(instance: Instance) -> None:
        """Count one more request in flight on ``instance`` (release() it once)."""
        instance.in_flight += 1

    @staticmethod
    def release(instance: Instance) -> None:
        if instance.in_flight <= 0:
            raise AssertionError(f"{instance!r} released more often than acquired")
        instance.in_flight -= 1

    @contextmanager
    def busy(self, instance: Instance) -> Iterator[Instance]:
        """Count one request in flight on ``instance`` while the block runs."""
        self.acquire(instance)
        try:
            yield instance
        finally:
            self.release(instance)


def check_pool(instances: list[Instance]) -> None:
    """PoolRefused naming the first instance of the wrong role, or the first two whose
    fingerprints or storage secrets differ (both named, with their roles and fingerprints)."""
    for instance in instances:
        if instance.identity.salt_by_key:
            raise PoolRefused(
                f"{instance.url}: the instance salts requests by API key (server.salt_by_key), "
                "so every request through the router would be the router key's tenant; salt by "
                "key at the router instead (--salt-by-key)"
            )
        if instance.identity.role != instance.role:
            flag = "--instance" if instance.role == "both" else f"--{instance.role}"
            raise PoolRefused(
                f"{flag} {instance.url}: the instance's role is "
                f"{instance.identity.role!r}, not {instance.role!r} (engine.role={instance.role})"
            )
    first = instances[0]
    for other in instances[1:]:
        if other.identity.fingerprints != first.identity.fingerprints:
            raise PoolRefused(
                f"{first.describe()} and {other.describe()} cannot share KV: their "
                "fingerprints differ (another model, dtype, block size or tp size)"
            )
        if other.identity.secret_id != first.identity.secret_id:
            raise PoolRefused(
                f"{first.describe()} and {other.describe()} cannot share KV: their storage "
                f"secrets differ ({secret_name(first.identity)} and "
                f"{secret_name(other.identity)}; cache.storage.secret)"
            )


def secret_name(identity: Identity) -> str:
    """How a message names an instance's storage secret: its identifier, never the secret."""
    return f"secret {identity.secret_id}" if identity.secret_id else "no secret"


async def identify(client: Upstream, url: str, deadline: float) -> Identity:
    """The identity of the instance at ``url``, asking again (waits doubling up to a second)
    until it answers 200 or ``deadline`` (time.monotonic()) passes: StartTimeout then,
    naming the last try's failure. A try the deadline cut short names only that it ran out
    of time, so an earlier try's failure (a refused connection, an HTTP error) is kept over it.
    """
    wait = FIRST_WAIT_S
    last = ""
    while True:
        left = deadline - time.monotonic()
        try:
            answer = await client.get(
                f"{url}/ringfence/instance", timeout=max(min(IDENTIFY_CALL_S, left), 0.01)
            )
            if answer.status == 200:
                return Identity.of(url, answer.json())
            if answer.status in (401, 403):  # asking again will not change the key
                raise PoolRefused(
                    f"{url} refused the router's API key (HTTP {answer.status}): give the "
                    f"router the instances' key ({INSTANCE_KEY_ENV}, or "
                    "--instance-api-key-file)"
                )
            last = f"HTTP {answer.status}: {answer.text[:200]}"
        except TlsRefused as e:  # asking again will not change the certificate
            raise PoolRefused(
                f"{url}: {e} (the router verifies instances against --instance-ca-certs, "
                "else the system's trust store)"
            ) from e
        except TransportError as e:
            if not (isinstance(e, CallTimeout) and left < IDENTIFY_CALL_S and last):
                last = describe(e)
            if await client.closed_after_handshake(
                url, timeout=max(min(IDENTIFY_CALL_S, left), 0.01)
            ):
                raise PoolRefused(
                    f"{url}: the instance closes the TLS connection before answering: it asks "
                    "for a client certificate the router does not present, or does not take "
                    "the one it does (--instance-ssl-certfile and --instance-ssl-keyfile)"
                ) from e
        except ValueError as e:  # not JSON
            raise PoolRefused(f"{url}/ringfence/instance: not an instance's answer ({e})") from e
        left = deadline - time.monotonic()
        if left <= 0:
            raise StartTimeout(f"{url} did not answer /ringfence/instance in time (last: {last})")
        await asyncio.sleep(min(wait, left))
        wait = min(wait * 2, MAX_WAIT_S)


async def open_pool(
    client: Upstream,
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
    timeout_s: float,
    both: tuple[str, ...] = (),
) -> Pool:
    """The checked pool of these instances, once every one answered (all asked at once):
    prefill and decode instances, or aggregated ones (``both``: ``--instance``)."""
    deadline = time.monotonic() + timeout_s
    named = [(url.rstrip("/"), "prefill") for url in prefill]
    named += [(url.rstrip("/"), "decode") for url in decode]
    named += [(url.rstrip("/"), "both") for url in both]
    tasks = [asyncio.ensure_future(identify(client, url, deadline)) for url, _ in named]
    try:
        identities = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # the first failure ends the others' waits
            task.cancel()
    instances = [
        Instance(url, role, ident) for (url, role), ident in zip(named, identities, strict=True)
    ]
    check_pool(instances)
    return Pool(instances)
