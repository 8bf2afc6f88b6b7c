"""The HTTP API: OpenAI's completions, chat completions and models, health and metrics.

Routes run on the front end's event loop and never block it: a request is checked and
tokenized (:mod:`.prompts`), opened in the :class:`~.gateway.Gateway` (429 past
``server.max_pending``), and its output read from its stream (:mod:`.outputs`), as one
JSON answer or as server-sent events (``data: {json}`` lines, then ``data: [DONE]``).
Any error a request causes is answered with OpenAI's error body and touches no other
request; an error after a stream began is sent as a last ``data: {"error": ...}`` event.
A client that disconnects has its request aborted in the engine at once (streams: the
response's body is cancelled; plain answers: a watcher of the connection).
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ringfence.actors.config import Config
from ringfence.actors.protocol.client import Submit
from ringfence.actors.serve.api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    check_unsupported,
    error_body,
    stop_strings,
)
from ringfence.actors.serve.metrics import Metrics
from ringfence.actors.serve.outputs import Delta, Generation
from ringfence.actors.serve.prompts import Prompt

if TYPE_CHECKING:
    from ringfence.actors.serve.frontend import FrontEnd

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": why}
    for status, why in (
        (400, "the request is malformed or asks for what the model cannot do"),
        (429, "too many requests pending (server.max_pending); see Retry-After"),
        (500, "the engine failed on the request"),
        (503, "the engine is not running (starting, restarting or stopping)"),
        (504, "no output within server.request_timeout_s"),
    )
}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_app(frontend: FrontEnd, config: Config) -> FastAPI:
    """The API of ``frontend`` (its gateway, prompter, liveness and the engine's stats)."""
    app = FastAPI(title="ringfence", version="0.1.0", openapi_url="/openapi.json")
    gateway, prompter = frontend.gateway, frontend.prompter
    metrics = Metrics(
        pending=lambda: gateway.pending,
        stats=lambda: getattr(frontend, "stats", None),
        restarts=frontend.liveness.restarts,
        down=frontend.health,
    )
    app.state.metrics = metrics
    timeout_s = config.server.request_timeout_s
    name = prompter.model_name

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.rejected.labels(status=str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected.labels(status="400").inc()
        return JSONResponse(validation_body(exc), status_code=400)

    @app.get("/health", responses={503: {"description": "an actor of the instance is down"}})
    async def health() -> JSONResponse:
        down = frontend.health()
        if down:
            return JSONResponse({"status": "unavailable", "down": down}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(frontend, name)]}

    @app.post("/v1/completions", responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_request(body, name)
        prompt = prompter.completion(body.prompt, body.max_tokens)
        answer = Answer(frontend, body, prompt, kind="cmpl", metrics=metrics, timeout_s=timeout_s)
        if body.stream:
            return answer.sse(answer.completion_chunks)
        return JSONResponse(await answer.whole(request, answer.completion_body))

    @app.post("/v1/chat/completions", responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_request(body, name)
        if body.response_format is not None and body.response_format.type != "text":
            raise ApiError("response_format: only text", param="response_format")
        limit, field = body.max_completion_tokens, "max_completion_tokens"
        if limit is None:
            limit, field = body.max_tokens, "max_tokens"
        prompt = prompter.chat(body.messages, limit, field)
        answer = Answer(
            frontend, body, prompt, kind="chatcmpl", metrics=metrics, timeout_s=timeout_s
        )
        if body.stream:
            return answer.sse(answer.chat_chunks)
        return JSONResponse(await answer.whole(request, answer.chat_body))

    return app


def check_request(body: CompletionRequest | ChatCompletionRequest, name: str) -> None:
    check_unsupported(body)
    if body.model is not None and body.model != name:
        raise ApiError(
            f"model: {body.model!r} is not served here; this server serves {name!r}",
            param="model",
            code="model_not_found",
        )


def model_card(frontend: FrontEnd, name: str) -> dict[str, Any]:
    from ringfence.actors.kv.layout import block_fingerprint
    from ringfence.actors.model.identity import model_id

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
    """OpenAI's error body for pydantic's errors: the first one, its field dotted."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return error_body(f"the body is not valid JSON: {first.get('msg')}", param=None)
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if first.get("type") == "extra_forbidden":
        message = f"{param}: unknown field"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return error_body(message, param=param)


class Answer:
    """One API request: its Submit, its generation, and its answer's formats."""

    def __init__(
        self,
        frontend: FrontEnd,
        body: CompletionRequest | ChatCompletionRequest,
        prompt: Prompt,
        *,
        kind: str,
        metrics: Metrics,
        timeout_s: float,
    ) -> None:
        self.body = body
        self.prompt = prompt
        self.id = f"{kind}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = frontend.prompter.model_name
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        submit = Submit(
            request_id=self.id,
            prompt_token_ids=prompt.token_ids,
            max_tokens=prompt.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
        )
        stream = frontend.gateway.open(submit)  # 429 / 503 raised here, before any output
        self.generation = Generation(
            stream,
            prompt_tokens=len(prompt.token_ids),
            decode=frontend.prompter.decode,
            stop=stop_strings(body.stop),
            metrics=metrics,
            timeout_s=timeout_s,
        )

    @property
    def include_usage(self) -> bool:
        options = self.body.stream_options
        return bool(options and options.include_usage)

    # Whole answers.

    async def whole(self, request: Request, render: Callable[[str, list[int], str], Any]) -> Any:
        """Wait for the output (aborting it if the client disconnects); ``render`` it."""

        async def collect() -> tuple[str, list[int], str]:
            text: list[str] = []
            ids: list[int] = []
            finish = "length"
            async for delta in self.generation.deltas():
                text.append(delta.text)
                ids.extend(delta.token_ids)
                finish = delta.finish_reason or finish
            return "".join(text), ids, finish

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                raise ApiError("the client disconnected", status=499, kind="client_closed")
            return render(*work.result())
        finally:
            gone.cancel()
            self.generation.close()

    def completion_body(self, text: str, ids: list[int], finish: str) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0, "text": text, "logprobs": None, "finish_reason": finish,
        }  # fmt: skip
        if self.body.return_token_ids:
            choice["token_ids"] = ids
            choice["prompt_token_ids"] = list(self.prompt.token_ids)
        return {
            "id": self.id, "object": "text_completion", "created": self.created,
            "model": self.model, "choices": [choice], "usage": self.generation.usage.body(),
        }  # fmt: skip

    def chat_body(self, text: str, ids: list[int], finish: str) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        out: dict[str, Any] = {
            "id": self.id, "object": "chat.completion", "created": self.created,
            "model": self.model, "choices": [choice], "usage": self.generation.usage.body(),
        }  # fmt: skip
        if self.body.return_token_ids:
            choice["token_ids"] = ids
            out["prompt_token_ids"] = list(self.prompt.token_ids)
        return out

    # Streams.

    def sse(self, chunks: Callable[[], AsyncIterator[dict[str, Any]]]) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks():
                    yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                if self.include_usage:
                    yield b"data: " + orjson.dumps(self._usage_chunk()) + b"\n\n"
            except ApiError as e:
                yield b"data: " + orjson.dumps(e.body()) + b"\n\n"
            finally:
                self.generation.close()  # also on cancellation: the client went away
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    def _chunk(self, obj: str, choice: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id, "object": obj, "created": self.created, "model": self.model,
            "choices": [choice],
        }  # fmt: skip

    def _usage_chunk(self) -> dict[str, Any]:
        obj = "text_completion" if self.id.startswith("cmpl") else "chat.completion.chunk"
        chunk = self._chunk(obj, {})
        chunk["choices"] = []
        chunk["usage"] = self.generation.usage.body()
        return chunk

    async def completion_chunks(self) -> AsyncIterator[dict[str, Any]]:
        first = True
        async for delta in self.generation.deltas():
            choice = self._choice(delta, {"text": delta.text})
            if first and self.body.return_token_ids:
                choice["prompt_token_ids"] = list(self.prompt.token_ids)
            first = False
            yield self._chunk("text_completion", choice)

    async def chat_chunks(self) -> AsyncIterator[dict[str, Any]]:
        opening = {"role": "assistant", "content": ""}
        head = self._chunk("chat.completion.chunk", self._choice(None, {"delta": opening}))
        if self.body.return_token_ids:
            head["prompt_token_ids"] = list(self.prompt.token_ids)
        yield head
        async for delta in self.generation.deltas():
            content = {"content": delta.text} if delta.text else {}
            yield self._chunk("chat.completion.chunk", self._choice(delta, {"delta": content}))

    def _choice(self, delta: Delta | None, fields: dict[str, Any]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, **fields, "logprobs": None}
        choice["finish_reason"] = delta.finish_reason if delta is not None else None
        if self.body.return_token_ids:
            choice["token_ids"] = list(delta.token_ids) if delta is not None else []
        return choice


async def _disconnected(request: Request) -> None:
    """Returns when the client closed the connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
