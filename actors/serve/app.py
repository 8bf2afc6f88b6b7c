"""The HTTP API: OpenAI's completions, chat completions and models, health and metrics.

Routes run on the front end's event loop and never block it: a request is checked and
tokenized (:mod:`.prompts`), its choices opened in the :class:`~.gateway.Gateway` (429 past
``server.max_pending``), and their output read (:mod:`.answer`), as one JSON answer or
as server-sent events (``data: {json}`` lines, then ``data: [DONE]``).
Any error a request causes is answered with OpenAI's error body and touches no other
request; an error after a stream began is sent as a last ``data: {"error": ...}`` event.
A client that disconnects has its request aborted in the engine at once (streams: the
response's body is cancelled; plain answers: a watcher of the connection).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from ringfence.actors.http.auth import TENANT_SCOPE, Keys, RequireKey, open_paths, tenant_salt
from ringfence.actors.http.errors import ApiError, ErrorResponse, error_body
from ringfence.actors.http.limits import MAX_N, LimitBody
from ringfence.actors.kv.layout import block_fingerprint
from ringfence.actors.model.identity import model_id
from ringfence.actors.serve.answer import Answer
from ringfence.actors.serve.api import (
    IGNORED_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    ignored_fields,
)
from ringfence.actors.serve.config import FrontEndSettings
from ringfence.actors.serve.metrics import Metrics
from ringfence.actors.serve.openapi import install
from ringfence.actors.serve.prompts import prompt_of
from ringfence.actors.serve.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    Health,
    ModelList,
    events_card,
    stream_of,
)
from ringfence.actors.serve.router_api import install_router_api
from ringfence.actors.serve.tokens import install_token_api
from ringfence.actors.serve.view import FrontEndView

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": why}
    for status, why in (
        (400, "the request is malformed or asks for what the model cannot do"),
        (409, "a reservation claimed where the instance's role takes none, or expired"),
        (429, "too many requests pending (server.max_pending); see Retry-After"),
        (500, "the engine failed on the request"),
        (503, "the engine is not running (starting, restarting or stopping)"),
        (504, "no output within server.request_timeout_s"),
    )
}


def answers(model: type[ChatCompletionResponse | CompletionResponse], chunk: type[Any]) -> Any:
    """A route's documented answers: 200 as JSON or as an event stream, and the errors."""
    streamed = {"text/event-stream": stream_of(chunk)}
    ok = {"model": model, "description": "the output (an event stream with stream)"}
    return {200: {**ok, "content": streamed}, **ERRORS}


def build_app(
    frontend: FrontEndView, config: FrontEndSettings, keys: Keys | None = None
) -> FastAPI:
    """The API of ``frontend`` (its gateway, prompter, liveness and the engine's stats);
    with ``keys``, every route but the open ones asks for one (:mod:`.auth`)."""
    app = FastAPI(title="ringfence", version="0.1.0", openapi_url="/openapi.json")
    install(app)
    server = config.server
    app.add_middleware(LimitBody, max_bytes=server.max_body_bytes, timeout_s=server.body_timeout_s)
    if keys:  # added last: the outermost, so a call without a key is refused before its body
        app.add_middleware(
            RequireKey,
            keys=keys,
            open_paths=open_paths(server.protect_metrics),
            max_per_key=server.max_requests_per_key,
            retry_after_s=server.retry_after_s,
        )
    gateway, prompter = frontend.gateway, frontend.prompter
    metrics = Metrics(
        pending=lambda: gateway.pending,
        stats=lambda: frontend.stats,
        restarts=frontend.liveness.restarts,
        down=frontend.health,
        model_name=prompter.model_name,
    )
    app.state.metrics = metrics
    timeout_s = config.server.request_timeout_s
    name = prompter.model_name
    salt_by_key = config.server.salt_by_key

    def salt_of(request: Request, cache_salt: str | None) -> str:
        """The request's cache salt: the client's, under its key's tenant when salting by key."""
        return tenant_salt(request.scope.get(TENANT_SCOPE), cache_salt, salt_by_key)

    handle_errors(app, metrics)

    @app.get(
        "/health",
        responses={
            200: {"model": Health, "description": "every actor of the instance is live"},
            503: {"model": Health, "description": "an actor of the instance is down"},
        },
    )
    async def health() -> JSONResponse:
        down = frontend.health()
        if down:
            return JSONResponse({"status": "unavailable", "down": down}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    card = model_card(frontend, name)  # fixed: once; the events' endpoints once known

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        events = events_card(frontend.stats, config.server.host)
        if events is None:
            return {"object": "list", "data": [card]}
        return {"object": "list", "data": [card | {"ringfence": card["ringfence"] | events}]}

    role = config.engine.role

    @app.post(
        "/v1/completions",
        responses=answers(CompletionResponse, CompletionResponse),
        openapi_extra=CLAIM_HEADER,
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        async def run() -> Response:
            prompt = await asyncio.to_thread(prompt_of, body, prompter)  # off the loop
            reservation = claimed(request, role)
            answer = Answer(frontend, body, prompt, kind="cmpl", metrics=metrics,
                            timeout_s=timeout_s, reservation=reservation,
                            cache_salt=salt_of(request, body.cache_salt),
                            choice=claimed_choice(request, reservation, body.n))  # fmt: skip
            if body.stream:
                return answer.sse(answer.completion_chunks)
            return JSONResponse(await answer.whole(request, answer.completion_body))

        return await ignoring(frontend, body, request, run)

    @app.post(
        "/v1/chat/completions",
        responses=answers(ChatCompletionResponse, ChatCompletionChunk),
        openapi_extra=CLAIM_HEADER,
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        async def run() -> Response:
            prompt = await asyncio.to_thread(prompt_of, body, prompter)  # off the loop
            reservation = claimed(request, role)
            answer = Answer(frontend, body, prompt, kind="chatcmpl", metrics=metrics,
                            timeout_s=timeout_s, reservation=reservation,
                            cache_salt=salt_of(request, body.cache_salt),
                            choice=claimed_choice(request, reservation, body.n))  # fmt: skip
            if body.stream:
                return answer.sse(answer.chat_chunks)
            return JSONResponse(await answer.whole(request, answer.chat_body))

        return await ignoring(frontend, body, request, run)

    install_token_api(app, prompter)
    # The routes of docs/design.md, "Instances (prefill/decode disaggregation)".
    install_router_api(app, frontend, config)
    return app


async def ignoring(
    frontend: FrontEndView,
    body: CompletionRequest | ChatCompletionRequest,
    request: Request,
    run: Callable[[], Awaitable[Response]],
) -> Response:
    """``run``'s answer to ``body``; the fields it ignores (unknown to the server) logged in
    one line and named in the answer's IGNORED_HEADER, an error's included."""
    ignored = ignored_fields(body)
    if not ignored:
        return await run()
    names = ", ".join(ignored).strip()  # a header value neither starts nor ends in a space
    frontend.log.warning("server.fields_ignored", path=request.url.path, fields=ignored)
    try:
        response = await run()
    except ApiError as e:
        e.headers[IGNORED_HEADER] = names
        raise
    response.headers[IGNORED_HEADER] = names
    return response


RESERVATION_HEADER = "X-Ringfence-Reservation"
CHOICE_HEADER = "X-Ringfence-Choice"  # with a claim: the choice of an n > 1 request it is
CLAIM_HEADER: dict[str, Any] = {
    "parameters": [
        {
            "name": RESERVATION_HEADER,
            "in": "header",
            "required": False,
            "schema": {"type": "string"},
            "description": "a decode instance's reservation this request claims (the router's)",
        },
        {
            "name": CHOICE_HEADER,
            "in": "header",
            "required": False,
            "schema": {"type": "integer", "minimum": 0, "maximum": MAX_N - 1},
            "description": "with a claim: the index of the choice of an n > 1 request that "
            "it runs (the router claims each choice alone, with n = 1)",
        },
    ]
}


def claimed(request: Request, role: str) -> str:
    """The reservation a request claims ("" for none); ApiError 409 where the instance's
    role does not take it: a decode instance only claims, the others none."""
    reservation = request.headers.get(RESERVATION_HEADER, "")
    if role == "decode" and not reservation:
        raise ApiError(
            "this is a decode instance (engine.role): it answers only requests that claim a "
            f"reservation ({RESERVATION_HEADER}); send requests through 'ringfence router'",
            status=409,
            code="reservation_required",
        )
    if reservation and role != "decode":
        raise ApiError(
            f"{RESERVATION_HEADER}: engine.role is {role!r}; only a decode instance takes "
            "reservations",
            status=409,
            code="wrong_role",
        )
    return reservation


def claimed_choice(request: Request, reservation: str, n: int) -> int:
    """The choice index a claim runs (0 without ``CHOICE_HEADER``); ApiError 400 naming
    the header where it is not an index below MAX_N, comes without a reservation, or with
    ``n`` > 1 (a claimed choice is one)."""
    said = request.headers.get(CHOICE_HEADER)
    if said is None:
        return 0
    if not reservation:
        raise ApiError(f"{CHOICE_HEADER}: only a claim ({RESERVATION_HEADER}) names a choice")
    if not said.isdigit() or int(said) >= MAX_N:
        raise ApiError(f"{CHOICE_HEADER}: {said!r} is not a choice index below {MAX_N}")
    if n != 1:
        raise ApiError(f"{CHOICE_HEADER}: a claimed choice takes n = 1, got {n}", param="n")
    return int(said)


def handle_errors(app: FastAPI, metrics: Metrics) -> None:
    """Answer every error with OpenAI's error body, counted by status in the metrics."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.rejected.labels(status=str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own errors (an unreadable body, no such route) in OpenAI's body."""
        status = exc.status_code
        metrics.rejected.labels(status=str(status)).inc()
        kind = "invalid_request_error" if status < 500 else "server_error"
        body = error_body(str(exc.detail), kind=kind)
        return JSONResponse(body, status_code=status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected.labels(status="400").inc()
        return JSONResponse(validation_body(exc), status_code=400)


def model_card(frontend: FrontEndView, name: str) -> dict[str, Any]:
    """The served model as /v1/models lists it (its id hashes a checkpoint's headers)."""
    config = frontend.config
    ident = model_id(config.model)
    return {
        "id": name,
        "object": "model",
        "created": int(frontend.started_at),
        "owned_by": "ringfence",
        "max_model_len": frontend.prompter.max_model_len,
        "ringfence": {
            "model_id": ident,
            "fingerprint": block_fingerprint(config, ident).digest().hex(),
            "block_size": config.cache.block_size,
            "tp_size": config.parallel.tp_size,
        },
    }


def validation_body(exc: RequestValidationError) -> dict[str, Any]:
    """OpenAI's error body for pydantic's errors: the first field at fault, dotted as the
    client wrote it (``messages.0.role``), and what was wrong with it.

    pydantic reports a value that fits no member of a union (``prompt``) once per member;
    the error that reached deepest into the value is the one that says most.
    """
    errors, body = exc.errors(), exc.body
    if not errors:
        return error_body("invalid request")
    first = errors[0]
    kind, loc = first.get("type"), tuple(first.get("loc", ()))
    if kind == "json_invalid":
        return error_body(f"the body is not valid JSON: {first.get('msg')}", param=None)
    if loc in ((), ("body",)):
        return error_body(f"the body must be a JSON object, got {_json_kind(body)}", param=None)
    same = [e for e in errors if tuple(e.get("loc", ()))[:2] == loc[:2]]  # one field's errors
    found = [(_as_written(e, body), e) for e in same]
    depth = max(len(path) for path, _ in found)
    deepest = [(path, e) for path, e in found if len(path) == depth]
    path, chosen = deepest[0]
    param = ".".join(path) or None
    said = list(dict.fromkeys(str(e.get("msg")) for _, e in deepest))
    message = f"{param}: {'; or '.join(said)}"
    if chosen.get("type") == "extra_forbidden":
        message = f"{param}: unknown field"
    if len(errors) > len(same):
        message += f" (and {len(errors) - len(same)} more problems)"
    return error_body(message, param=param)


def _as_written(error: Any, body: Any) -> list[str]:
    """The path of ``error`` in ``body``, without the names pydantic gives union members."""
    parts = list(error.get("loc", ()))[1:]  # after "body"
    path: list[str] = []
    value = body
    for i, part in enumerate(parts):
        keyed = isinstance(value, dict) and isinstance(part, str) and part in value
        indexed = isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value)
        if keyed or indexed:
            value = value[part]
        elif not (i == len(parts) - 1 and error.get("type") == "missing"):
            continue  # a union member's name ("list[str]"): not in the body
        path.append(str(part))
    return path


def _json_kind(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number"}
    names[float] = "a number"
    return "null" if value is None else names.get(type(value), type(value).__name__)
