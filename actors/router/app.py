"""The router's HTTP API: OpenAI's completions and chat completions, run over the instances
(:mod:`.flow`), the models of a decode instance, the pool's health, and metrics.

The client's body goes to the instances unchanged (but with ``--salt-by-key``, where its
``cache_salt`` is put under the caller's tenant): the router reads only that it is a JSON
object (else its own 400); every other check is the decode instance's (its reserve answers
400 naming the field, relayed as is). Every error the router makes itself is answered with
OpenAI's error body. A client that disconnects before its answer began has its request
dropped (the upstream call cancelled and closed); one that leaves a stream has the
upstream stream closed, so the decode instance aborts the request.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ringfence.actors.http.auth import TENANT_SCOPE, RequireKey, open_paths, tenant_salt
from ringfence.actors.http.errors import ApiError, error_body
from ringfence.actors.http.limits import LimitBody
from ringfence.actors.router.choices import Choices, choices_of
from ringfence.actors.router.flow import Handover, Relayed
from ringfence.actors.router.forward import INSTANCE_HEADER, Forward
from ringfence.actors.router.instances import Instance
from ringfence.actors.router.relay import EventRelay, is_event_stream, read_whole
from ringfence.actors.router.state import Router
from ringfence.actors.router.upstream import TransportError, describe

PROBE_S = 2.0  # one instance's /health or /v1/models, asked by the router's own routes
OUTCOME_OF_STATUS = {502: "decode_failed", 503: "no_room"}  # the router's own errors
SERVING = ("decode", "both")  # the roles whose health makes the router's


def build_app(router: Router) -> Starlette:
    """The API of ``router`` (its instances, client, metrics and log).

    A plain Starlette app, not FastAPI: every route reads its own body, so FastAPI's
    validation and schema have nothing to say, and its layers (its middleware and its
    per-request dependency solving) cost about a tenth of the router's CPU a request."""
    pool = router.pool

    async def health(request: Request) -> JSONResponse:
        """200 while at least one decode instance is healthy; ``down`` names the others."""
        whys = await asyncio.gather(*(probe(router, i) for i in pool.instances))
        said = list(zip(pool.instances, whys, strict=True))
        down = [f"{i.role} {i.url}: {why}" for i, why in said if why]
        up = [i for i, why in said if why is None and i.role in SERVING]
        if not up:
            return JSONResponse({"status": "unavailable", "down": down}, status_code=503)
        return JSONResponse({"status": "ok" if not down else "degraded", "down": down})

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(request: Request) -> Response:
        """A decode instance's /v1/models, as it answered."""
        last = "no decode instance"
        for instance in pool.of_role("both" if router.aggregated else "decode"):
            try:
                answer = await router.client.get(f"{instance.url}/v1/models", timeout=PROBE_S)
            except TransportError as e:
                last = f"{instance.url}: {describe(e)}"
                continue
            if answer.status == 200:
                media_type = answer.headers.get("content-type", "application/json")
                return Response(answer.content, media_type=media_type)
            last = f"{instance.url}: HTTP {answer.status}"
        raise ApiError(
            f"no decode instance answered /v1/models (last: {last})",
            status=503, kind="server_error",
        )  # fmt: skip

    async def completions(request: Request) -> Response:
        return await route(router, "completions", request)

    async def chat_completions(request: Request) -> Response:
        return await route(router, "chat", request)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    handlers = {ApiError: api_error, Relayed: relayed, HTTPException: http_error}
    options = router.options
    # The first is the outermost: a call without a key is refused before its body is read.
    middleware = [Middleware(LimitBody, max_bytes=options.max_body_bytes)]
    if options.client_keys:
        guard = Middleware(
            RequireKey,
            keys=options.client_keys,
            open_paths=open_paths(options.protect_metrics),
            max_per_key=options.max_requests_per_key,
            option="--max-requests-per-key",
        )
        middleware.insert(0, guard)
    return Starlette(
        routes=routes,
        exception_handlers=handlers,  # type: ignore[arg-type]
        middleware=middleware,
    )


# The router's errors in OpenAI's error body, and instances' errors as is.


async def api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def relayed(request: Request, exc: Relayed) -> Response:
    return Response(exc.content, exc.status, headers=exc.headers, media_type=exc.media_type)


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (no such route, a method not allowed) in OpenAI's body."""
    status = exc.status_code
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = error_body(str(exc.detail), kind=kind)
    return JSONResponse(body, status_code=status, headers=exc.headers)


async def route(router: Router, kind: str, request: Request) -> Response:
    """One client request, from its body to the start of its answer."""
    raw = await request.body()
    try:
        body = check_object(raw)
    except ApiError:
        router.metrics.requests.labels(outcome="bad_request").inc()
        raise
    if router.options.salt_by_key:
        raw = salted(body, request.scope.get(TENANT_SCOPE)) or raw
    run: type[Handover | Forward | Choices] = Forward if router.aggregated else Handover
    if not router.aggregated and choices_of(body) > 1:
        run = Choices  # a claim a choice (choices.py)
    handover = run(router, kind, raw, body, f"rtr-{uuid.uuid4().hex}")
    work = asyncio.ensure_future(answer_of(handover))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            await handover.finish("client_closed", 499)
            return Response(status_code=499)
        response = work.result()
    except ApiError as e:
        await handover.finish(OUTCOME_OF_STATUS.get(e.status, "error"), e.status)
        raise
    except Relayed as e:
        await handover.finish("relayed_error", e.status)
        raise
    except BaseException:  # a bug, or the server stopping: the request still ends here
        await handover.finish("error", 500)
        raise
    finally:
        gone.cancel()
        work.cancel()  # a no-op once done; else the server stopping cancelled this route
    if not isinstance(response, EventRelay):  # an event stream finishes when it ends
        await handover.finish("ok", response.status_code)
    if isinstance(handover, Forward) and handover.choice is not None:
        response.headers[INSTANCE_HEADER] = handover.choice.instance.url
    return response


async def answer_of(handover: Handover | Forward | Choices) -> Response:
    """The client's answer: the claim's event stream (not begun), or its whole JSON."""
    if isinstance(handover, Choices):
        return await handover.answer()
    upstream = await handover.run()
    if is_event_stream(upstream):
        return EventRelay(handover, upstream)
    return await read_whole(handover, upstream)


def salted(body: dict[str, Any], tenant: str | None) -> bytes | None:
    """The body with its ``cache_salt`` under the caller's tenant (as an instance salting by
    key makes it), as the instances will read it; None where the salt is not a string (the
    instance answers 400 naming it)."""
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        return None
    body["cache_salt"] = tenant_salt(tenant, salt, salt_by_key=True)
    return orjson.dumps(body)


def check_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or the router's own 400."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(f"the body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise ApiError(f"the body must be a JSON object, got {type(body).__name__}")
    return body


async def probe(router: Router, instance: Instance) -> str | None:
    """None if ``instance`` answers /health 200, else why not."""
    try:
        answer = await router.client.get(f"{instance.url}/health", timeout=PROBE_S)
    except TransportError as e:
        return describe(e)
    if answer.status == 200:
        return None
    return f"HTTP {answer.status}: {answer.text[:200]}"


async def _disconnected(request: Request) -> None:
    """Returns when the client closed the connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
