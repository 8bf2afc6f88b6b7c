"""A simulated aggregated ``ringfence serve`` instance: what ``ringfence bench route --sim``
puts behind the router, so that a routing policy is measured against engines whose time is
modelled, not against real instances that share the same CPU cores (on which spreading
requests is not spreading work). After llm-d's ``llm-d-inference-sim``, which its inference
scheduler is measured against: a vLLM stand-in with a modelled prefix cache and step times.

The engine (``sim_engine.py``) batches continuously as vLLM does over a pool of
``--blocks`` blocks with a prefix cache keyed as the stub's (``instance_api.NAMESPACE``);
its cost model (:class:`~.sim_engine.CostModel`, one flag a field) gives each step's time.
One asyncio task runs it while there is work: it schedules a step, sleeps the step's
modelled time (the sleep models the device's compute; nothing is polled), and ends it, until
the engine is idle; then it returns, and the next request starts another.

It speaks the routes the router uses (``instance_api.py``, shared with the stub) and:

- ``POST /v1/completions`` and ``/v1/chat/completions``: ``max_tokens`` (default 16)
  tokens, each a function of the prompt and its position alone (every instance, and so
  every policy, gives a prompt the same tokens); streamed (one event a token, sent when the
  step that produced it ends; the ``usage`` chunk with ``stream_options.include_usage``;
  ``token_ids`` with ``return_token_ids``), or whole when done. ``usage`` as a real
  instance gives it (``actors/serve/outputs.py``): ``prompt_tokens_details.cached_tokens``
  and ``ringfence.cached_tokens`` (``{"device": n, "host": 0, "storage": 0}``);
- ``GET /ringfence/load``: the engine's running and waiting requests and free blocks
  (cached ones count as free), numbered by change (a change at most twice a step: when it
  is scheduled and when it ends), as a long poll;
- KV events in vLLM's wire format: ``BlockRemoved`` when an admission evicts cached
  blocks, ``BlockStored`` when a step that computed full blocks ends.

Run as ``python -m ringfence.actors.tools.bench.serving.sim_instance --port 0 [--blocks N
--step-ms MS ...]``: it prints ``ringfence sim: listening on http://HOST:PORT (pid N)``,
then ``ringfence sim: ready``, and exits 0 on SIGINT or SIGTERM. :class:`Sim` starts one so,
in a session of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import fields
from pathlib import Path
from typing import Any, Final

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ringfence.actors.events.publisher import EventPublisher
from ringfence.actors.events.wire import encode_batch
from ringfence.actors.http.load import LoadWatch
from ringfence.actors.tools.bench.serving import instance_api
from ringfence.actors.tools.bench.serving.instance_api import (
    StandIn,
    completion_kind,
    json_response,
    prompt_ids,
)
from ringfence.actors.tools.bench.serving.sim_engine import (
    CostModel,
    PoolExhausted,
    SimEngine,
    SimRequest,
)
from ringfence.cache.kv_events import KVEvent
from ringfence.sched.request import TIERS

MODULE: Final = "ringfence.actors.tools.bench.serving.sim_instance"
NAME: Final = "sim"  # in its listening and ready lines
MODEL: Final = "sim"
FINGERPRINT: Final = "sim"
MAX_TOKENS: Final = 16  # a request's tokens when it names none
REQUEST_TIMEOUT_S: Final = 600.0  # the longest a request waits for its next token
LISTENING: Final = instance_api.listening_line(NAME)
READY: Final = instance_api.ready_line(NAME)


class Runner:
    """Runs a :class:`SimEngine` on the event loop (see the module docstring); hands each
    request's tokens to its queue and each step's KV events to the publisher, and keeps the
    load watch. Owned by the server's event loop; a request that finds no task running
    starts one, which runs until the engine is idle."""

    def __init__(self, engine: SimEngine, publisher: EventPublisher | None) -> None:
        self.engine = engine
        self.publisher = publisher
        self.watch = LoadWatch()
        self.watch.note(engine.load())
        self._tokens: dict[int, asyncio.Queue[int]] = {}  # by request id, until it ends
        self._task: asyncio.Task[None] | None = None

    def submit(self, prompt: list[int], max_tokens: int) -> tuple[SimRequest, asyncio.Queue[int]]:
        """Queue a request; its tokens come on the queue returned (ValueError: refused).
        A broken invariant that ended the engine's last run raises here again."""
        if self._task is not None and self._task.done() and not self._task.cancelled():
            self._task.result()
        request = self.engine.add(prompt, max_tokens)
        queue: asyncio.Queue[int] = asyncio.Queue()
        self._tokens[request.id] = queue
        self.watch.note(self.engine.load())
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        return request, queue

    def end(self, request: SimRequest) -> None:
        """Its reader is done (all tokens read, or gone): abort it if it still runs."""
        self._tokens.pop(request.id, None)
        if not request.done and not request.aborted:
            self.engine.abort(request)
            self.watch.note(self.engine.load())

    async def _run(self) -> None:
        engine = self.engine
        while engine.has_work:
            step = engine.schedule()
            if step.empty:
                raise AssertionError(f"nothing scheduled with work queued: {engine.load()}")
            self._publish(step.removed)
            self.watch.note(engine.load())
            await asyncio.sleep(engine.model.step_s(step.prefill_tokens, len(step.decode)))
            done = engine.finish(step)
            self._publish(step.stored)
            for request in done.tokens:
                queue = self._tokens.get(request.id)
                if queue is not None:
                    queue.put_nowait(request.output[-1])
            self.watch.note(engine.load())

    def _publish(self, events: tuple[KVEvent, ...]) -> None:
        if events and self.publisher is not None:
            self.publisher.publish(encode_batch(time.time(), events, layout="map"))


def usage(request: SimRequest) -> dict[str, Any]:
    """A finished request's ``usage``, as a real instance words it."""
    cached = dict.fromkeys(TIERS, 0) | {"device": request.cached_tokens}
    prompt, out = len(request.prompt), len(request.output)
    return {
        "prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
        "prompt_tokens_details": {"cached_tokens": request.cached_tokens},
        "ringfence": {"cached_tokens": cached},
    }  # fmt: skip


class Answer:
    """How one request's answer is worded (its kind, and what its body asked for)."""

    def __init__(self, kind: str, body: dict[str, Any], request: SimRequest) -> None:
        self.kind, self.request = kind, request
        self.token_ids = bool(body.get("return_token_ids"))
        options = body.get("stream_options")
        self.include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        self.head = {"id": f"cmpl-{MODEL}-{request.id}", "created": 0, "model": MODEL}

    def chunk(self, token: int, last: bool) -> bytes:
        text = f" t{token}"
        choice: dict[str, Any] = {"index": 0, "logprobs": None}
        if self.kind == "chat":
            choice["delta"], obj = {"content": text}, "chat.completion.chunk"
        else:
            choice["text"], obj = text, "text_completion"
        choice["finish_reason"] = "length" if last else None
        if self.token_ids:
            choice["token_ids"] = [token]
        return b"data: " + orjson.dumps({**self.head, "object": obj, "choices": [choice]}) + b"\n\n"

    def usage_chunk(self) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        chunk = {**self.head, "object": obj, "choices": [], "usage": usage(self.request)}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def whole(self) -> bytes:
        tokens = self.request.output
        text = "".join(f" t{token}" for token in tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if self.kind == "chat":
            choice["message"], obj = {"role": "assistant", "content": text}, "chat.completion"
        else:
            choice["text"], obj = text, "text_completion"
        if self.token_ids:
            choice["token_ids"] = list(tokens)
        body = {**self.head, "object": obj, "choices": [choice], "usage": usage(self.request)}
        return orjson.dumps(body)


def build_app(
    model: CostModel,
    publisher: EventPublisher | None = None,
    stopping: asyncio.Event | None = None,
) -> Starlette:
    """A simulated instance's app on ``model``; ``publisher`` the one its KV events go out
    on (None: no events); ``stopping``, once set, answers every held load poll at once."""
    stopping = stopping or asyncio.Event()
    runner = Runner(SimEngine(model), publisher)
    identity = instance_api.identity_card(
        model=MODEL, fingerprint=FINGERPRINT, publisher=publisher, load=runner.engine.load()
    )

    async def complete(request: Request) -> Response:
        kind = completion_kind(request)
        body = orjson.loads(await request.body())
        n = int(body.get("max_tokens") or MAX_TOKENS) if isinstance(body, dict) else 0
        try:
            sim, tokens = runner.submit(prompt_ids(kind, body), n)
        except (PoolExhausted, ValueError) as e:
            error = {"error": {"message": str(e), "type": "invalid_request_error"}}
            return Response(orjson.dumps(error), status_code=400, media_type="application/json")
        answer = Answer(kind, body, sim)
        if not body.get("stream"):
            try:
                for _ in range(n):
                    await asyncio.wait_for(tokens.get(), REQUEST_TIMEOUT_S)
            finally:
                runner.end(sim)
            return json_response(answer.whole())

        async def stream() -> AsyncIterator[bytes]:
            try:
                for position in range(n):
                    token = await asyncio.wait_for(tokens.get(), REQUEST_TIMEOUT_S)
                    yield answer.chunk(token, position == n - 1)
                if answer.include_usage:
                    yield answer.usage_chunk()
                yield b"data: [DONE]\n\n"
            finally:
                runner.end(sim)

        return StreamingResponse(stream(), media_type="text/event-stream")

    routes = instance_api.common_routes(
        model=MODEL, identity=identity, watch=runner.watch, stopping=stopping
    )
    return Starlette(routes=[
        *routes,
        Route("/v1/completions", complete, methods=["POST"]),
        Route("/v1/chat/completions", complete, methods=["POST"]),
    ])  # fmt: skip


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`CostModel` field (``--step-ms``, ``--blocks``, ...)."""
    for spec in fields(CostModel):
        default = spec.default
        parser.add_argument(
            f"--{spec.name.replace('_', '-')}", dest=spec.name, type=type(default),
            default=default, help=f"the cost model's {spec.name} ({default})",
        )  # fmt: skip


def model_options(model: CostModel) -> tuple[str, ...]:
    """The flags that give a simulated instance ``model``."""
    return tuple(
        arg
        for spec in fields(CostModel)
        for arg in (f"--{spec.name.replace('_', '-')}", str(getattr(model, spec.name)))
    )


def main(argv: list[str] | None = None) -> int:
    """Serve one simulated instance until SIGINT or SIGTERM (see the module docstring)."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__)
    instance_api.add_server_arguments(parser)
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    model = CostModel(**{spec.name: getattr(args, spec.name) for spec in fields(CostModel)})
    return instance_api.serve(
        NAME, args, lambda publisher, stopping: build_app(model, publisher, stopping)
    )


class Sim(StandIn):
    """One simulated instance of ``model`` in a process (and session) of its own, on a free
    port of 127.0.0.1 (see :class:`~.server.Started`); its output goes to ``out_path``."""

    __slots__ = ()

    def __init__(
        self, out_path: Path, model: CostModel, *, events: bool = True, start_timeout: float
    ) -> None:
        super().__init__(
            MODULE, NAME, out_path, events=events, start_timeout=start_timeout,
            options=model_options(model),
        )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
