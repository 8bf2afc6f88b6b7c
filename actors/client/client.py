"""Clients of a running instance: submit requests from any process, stream their tokens.

::

    with Client.connect(run_dir) as client:
        rid = client.submit([1, 2, 3], max_tokens=8)
        for token in client.stream(rid, timeout=30):
            ...
        print(client.generate("hello", max_tokens=4).token_ids)
        print(client.chat([{"role": "user", "content": "hello"}]).token_ids)

A client attaches, in its own process, to a free slot of the run's optional actor
``client`` (:data:`CLIENT_ACTOR`, ``CLIENT_SLOTS`` ranks): the slot's rings to and
from the engine carry :mod:`~ringfence.actors.protocol.client` messages. Nothing runs in
the background: the :class:`ClientActor` handles the engine's output only while a
caller of :meth:`Client.stream` or :meth:`Client.result` waits, by driving the
driver from the caller's thread, and every wait has a deadline. The engine is "gone"
when the process that served a request (the writer of the engine instance's
``ready`` watermark when it was submitted) has died or been replaced; its waiters
then get :class:`ClientError` within a heartbeat, not at their deadline. One thread
uses a Client at a time.

A client connected with ``stats=True`` asks the engine for its :class:`Stats` in every
Hello; the engine sends them each tick, and :meth:`Client.stats` returns the newest.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ringfence.actors.client.slot import (
    CLIENT,
    CLIENT_ACTOR,
    CLIENT_CHANNELS,
    CLIENT_SLOTS,
    ENGINE,
    ClientActor,
    ClientError,
    Completion,
    _Request,
)
from ringfence.actors.protocol.client import (
    Abort,
    Reservation,
    Reserve,
    Stats,
    Submit,
    check_submit,
)
from ringfence.runtime.control import InstanceControl
from ringfence.runtime.driver import Driver
from ringfence.runtime.embed import attach
from ringfence.runtime.manifest import read_manifest
from ringfence.sched.sampling import SAMPLING_KEYS, SamplingParams
from ringfence.shm.counter import CounterBlock, Watermark
from ringfence.shm.errors import ActorDead, EndpointTaken
from ringfence.shm.liveness import ProcessStamp

__all__ = [
    "CLIENT_ACTOR",
    "CLIENT_CHANNELS",
    "CLIENT_SLOTS",
    "Client",
    "ClientActor",
    "ClientError",
    "Completion",
    "_Request",
]

DRAIN_ROUNDS = 64  # Client.stats handles at most this many batches of what has arrived


class Client:
    """A connection to a run's engine through one client slot. See the module docstring."""

    def __init__(self, driver: Driver, engine_ready: Watermark, block: CounterBlock) -> None:
        self._driver = driver
        self._engine_ready = engine_ready  # its writer is the engine's process
        self._block = block
        self._engine: ProcessStamp | None = engine_ready.writer()
        actor = driver.actor
        assert isinstance(actor, ClientActor)
        self._actor = actor
        self.closed = False

    @classmethod
    def connect(
        cls, run_dir: str | os.PathLike[str], *, timeout: float = 10.0, stats: bool = False
    ) -> Client:
        """Attach to the first free client slot of the run in ``run_dir`` and say Hello
        (asking for the engine's Stats if ``stats``; see :meth:`stats`).

        ``timeout`` bounds the wait for room for the Hello. ClientError if every slot is
        held by a live process; ValueError if ``run_dir`` is no run or has no slots.
        """
        manifest = read_manifest(run_dir)
        slots = sorted(e.rank for e in manifest.instances if e.name == CLIENT)
        if not slots:
            raise ValueError(f"run {manifest.run_id} has no {CLIENT!r} slots to connect to")
        engine = manifest.instance(ENGINE, 0)
        for rank in slots:
            try:
                driver = attach(run_dir, CLIENT, rank, actor_cls=ClientActor)
            except EndpointTaken:
                continue  # a live process holds this slot
            block = CounterBlock.attach(manifest.control)
            try:
                actor = driver.actor
                assert isinstance(actor, ClientActor)
                actor.hello_timeout_s = timeout
                actor.wants_stats = stats
                driver.start()  # on_start: the Hello
            except BaseException:
                driver.close()
                block.close()
                raise
            return cls(driver, InstanceControl.of(block, engine.index).ready, block)
        raise ClientError(
            f"all {len(slots)} client slots of run {manifest.run_id} are taken by live processes"
        )

    # Requests.

    def submit(
        self,
        prompt: str | Sequence[int],
        *,
        request_id: str | None = None,
        params: SamplingParams | None = None,
        reservation_id: str = "",
        cache_salt: str = "",
        **sampling: Any,
    ) -> str:
        """Send a request (text, or prompt token ids); return its id. Does not wait for output.

        ``params``, and any :class:`SamplingParams` field as a keyword (``max_tokens=8``,
        over ``params``'), say how to sample. ``reservation_id``: on a decode instance, the
        :meth:`reserve` answer it claims. ``cache_salt``: vLLM's; requests with another
        salt share none of this one's cached blocks.
        ValueError for bad parameters or an id still in use; RingFull if the engine does
        not take the request within the send timeout; ClientError if the client is closed
        or the engine is gone.
        """
        text, token_ids = (prompt, ()) if isinstance(prompt, str) else ("", tuple(prompt))
        return self._send(
            _submit(request_id, params, sampling)(
                prompt=text,
                prompt_token_ids=token_ids,
                reservation_id=reservation_id,
                cache_salt=cache_salt,
            )
        )

    def reserve(
        self, prompt_token_ids: Sequence[int], *, max_tokens: int = 16, timeout: float = 10.0
    ) -> Reservation:
        """Ask a decode instance for room for a request; its answer, granted or not
        (docs/design.md, "Instances (prefill/decode disaggregation)"). TimeoutError without
        one in ``timeout`` s; ClientError as submit."""
        self._check_open()
        name, ids = f"rsv-{uuid.uuid4().hex}", tuple(prompt_token_ids)
        try:
            self._hello_if_restarted()
            self._actor.send(ENGINE, Reserve(reservation_id=name, prompt_token_ids=ids,
                                             max_tokens=max_tokens))  # fmt: skip
        except ActorDead as e:
            raise ClientError(f"the engine is gone: {e}") from e
        deadline = time.monotonic() + timeout
        while name not in self._actor.reservations:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"reservation {name!r}: no answer within {timeout}s")
            self._driver.poll(remaining)
            self._check_open()
        return self._actor.reservations.pop(name)

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        request_id: str | None = None,
        params: SamplingParams | None = None,
        timeout: float = 60.0,
        **sampling: Any,
    ) -> Completion:
        """The model's answer to a chat (``{"role": ..., "content": ...}`` objects), which
        the engine renders through the model's chat template; raises as :meth:`generate`
        does, and ClientError when the model has no chat template or it refuses the chat.
        """
        request_id = self._send(
            _submit(request_id, params, sampling)(messages=tuple(dict(m) for m in messages))
        )
        return self.result(request_id, timeout=timeout)

    def _send(self, msg: Submit) -> str:
        self._check_open()
        check_submit(msg)
        request_id = msg.request_id
        if request_id in self._actor.requests:
            raise ValueError(f"request id {request_id!r} is in use by an unread request")
        try:
            engine = self._hello_if_restarted()
            seq = self._actor.send(ENGINE, msg)
        except ActorDead as e:
            raise ClientError(f"the engine is gone: {e}") from e
        self._actor.requests[request_id] = _Request(engine=engine, seq=seq)
        return request_id

    def _hello_if_restarted(self) -> ProcessStamp | None:
        """Say Hello again if the engine process changed since the last; the engine now."""
        engine = self._engine_ready.writer()
        if engine != self._engine:  # a (re)started engine has not heard our Hello
            self._actor.hello()
            self._engine = engine
        return engine

    def stats(self, *, timeout: float = 0.0, fresh: bool = False) -> Stats | None:
        """The newest :class:`Stats` the engine sent this client; None if none came yet.

        Handles what has arrived first (other output is filed for its request, as
        :meth:`stream` would), and if no Stats came yet waits up to ``timeout`` seconds
        for one (the engine sends one right after the Hello, then every tick). With
        ``fresh``, only a Stats handled by this call will do: it waits for the next one,
        and returns None if none came within ``timeout``. Says Hello again to an engine
        that restarted, so it goes on sending. ClientError if the client was connected
        without ``stats=True``, is closed, or the engine is gone.
        """
        self._check_open()
        if not self._actor.wants_stats:
            raise ClientError(f"client {self.instance} did not ask for stats (connect(stats=True))")
        try:
            self._hello_if_restarted()
        except ActorDead as e:
            raise ClientError(f"the engine is gone: {e}") from e
        seen = self._actor.stats if fresh else None
        deadline = time.monotonic() + timeout
        for _ in range(DRAIN_ROUNDS):
            if not self._driver.poll(0):
                break
        while self._actor.stats is seen and (remaining := deadline - time.monotonic()) > 0:
            self._driver.poll(remaining)
            self._check_open()
        return self._actor.stats if self._actor.stats is not seen else None

    def abort(self, request_id: str) -> None:
        """Ask the engine to stop a request; it then ends with "abort". No-op once it ended."""
        self._check_open()
        request = self._actor.requests.get(request_id)
        if request is not None and not request.done:
            self._actor.send(ENGINE, Abort(request_id=request_id))

    def stream(self, request_id: str, *, timeout: float = 60.0) -> Iterator[int]:
        """Yield the request's tokens as they arrive, until it finishes.

        ClientError with the engine's error if it was rejected or failed, or the engine
        is gone; TimeoutError if it has not finished ``timeout`` seconds after the call.
        """
        request = self._request(request_id)
        deadline = time.monotonic() + timeout
        while True:
            while request.unread:
                yield request.unread.popleft()
            if request.done:
                self._finish(request_id, request)
                return
            self._turn(request_id, request, deadline, timeout)

    def result(self, request_id: str, *, timeout: float = 60.0) -> Completion:
        """Wait for the request to finish; its output. Raises as :meth:`stream` does."""
        request = self._request(request_id)
        deadline = time.monotonic() + timeout
        while not request.done:
            self._turn(request_id, request, deadline, timeout)
        self._finish(request_id, request)
        return Completion(
            request_id=request_id,
            token_ids=tuple(request.token_ids),
            finish_reason=request.finish_reason,
            cached_tokens=request.cached_tokens,
            ttft_s=request.ttft_s,
            stored_blocks=request.stored_blocks,
            logprobs=tuple(request.logprobs),
            prompt_logprobs=request.prompt_logprobs,
        )

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        request_id: str | None = None,
        params: SamplingParams | None = None,
        timeout: float = 60.0,
        **sampling: Any,
    ) -> Completion:
        """:meth:`submit` then :meth:`result`."""
        request_id = self.submit(prompt, request_id=request_id, params=params, **sampling)
        return self.result(request_id, timeout=timeout)

    # Lifecycle.

    def close(self) -> None:
        """Detach from the slot (another process may take it). Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self._driver.close()
        finally:
            self._block.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def instance(self) -> str:
        """The slot this client holds, e.g. "client-1"."""
        return self._driver.ctx.instance

    # Internals.

    def _check_open(self) -> None:
        if self.closed:
            raise ClientError(f"client {self.instance} is closed")
        if self._driver.stop_reason is not None:
            raise ClientError(f"client {self.instance} stopped: {self._driver.stop_reason}")

    def _request(self, request_id: str) -> _Request:
        self._check_open()
        request = self._actor.requests.get(request_id)
        if request is None:
            raise KeyError(f"no unread request {request_id!r} on {self.instance}")
        return request

    def _finish(self, request_id: str, request: _Request) -> None:
        """Forget a request that ended; raise its error if it has one."""
        self._actor.requests.pop(request_id, None)
        if request.error:
            raise ClientError(f"request {request_id!r}: {request.error}")

    def _turn(self, request_id: str, request: _Request, deadline: float, timeout: float) -> None:
        """Drive the actor once (up to a heartbeat); raise if waiting longer is pointless."""
        self._check_open()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"request {request_id!r} did not finish within {timeout}s")
        produced = len(request.token_ids)
        self._driver.poll(remaining)  # wakes on output, and at the driver's next heartbeat
        # New output: the caller goes on. (Not "unread is not empty": result() never reads
        # it, and would never see the engine gone under a request that had tokens.)
        if request.done or len(request.token_ids) > produced:
            return
        self._check_open()
        engine = request.engine
        if engine is not None and (engine != self._engine_ready.writer() or not engine.is_alive()):
            self._actor.requests.pop(request_id, None)
            raise ClientError(f"request {request_id!r}: the engine is gone (pid {engine.pid})")


def _submit(
    request_id: str | None, params: SamplingParams | None, sampling: Mapping[str, Any]
) -> functools.partial[Submit]:
    """A Submit sampled by ``params`` with ``sampling``'s fields over them, waiting for its
    prompt (text, ids or a chat). RequestError (a ValueError) naming a bad field."""
    unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {', '.join(unknown)}")
    base = params if params is not None else SamplingParams()
    return functools.partial(
        Submit,
        request_id=uuid.uuid4().hex if request_id is None else request_id,
        params=dataclasses.replace(base, **sampling) if sampling else base,
    )
