"""The API an instance offers ``ringfence router``: its routes (docs/design.md,
"Instances (prefill/decode disaggregation)").

- ``GET /ringfence/instance``: what the router pairs instances by (role, model, the
  storage fingerprints of every rank, the storage secret's identifier: a keyed hash that
  tells whether two instances hold the same secret, ``cache/storage/seal.py``), picks them
  by (load), and hashes prompts and
  follows KV events with (the block keys' namespace and size, the events' endpoints);
- ``GET /ringfence/load?after=N&wait_s=S``: the load (``load.py``), numbered by change,
  answered once it is past ``N`` or at ``S`` seconds (a long poll the router follows);
- ``POST /ringfence/reserve`` (a decode instance): the client's OpenAI body, checked and
  tokenized exactly as its claim will be, becomes a :class:`Reserve`; 200 with the
  reservation, 503 with Retry-After when there is no room now (code ``no_room``), 400
  naming the field when the body is bad;
- ``POST /ringfence/prefill`` (a prefill instance): prompt token ids in, answered once
  the engine finished the request and the writes of its full blocks are complete
  (``Tokens.stored_blocks``), so the blocks are durable in the shared tier when the
  router hears of them.

The claim itself is an ordinary ``/v1/*`` request with the ``X-Ringfence-Reservation``
header (``app.claimed``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ringfence.actors.http.auth import TENANT_SCOPE, tenant_salt
from ringfence.actors.http.errors import ApiError
from ringfence.actors.http.load import Load
from ringfence.actors.kv.layout import block_fingerprint
from ringfence.actors.model.identity import model_id
from ringfence.actors.protocol.client import Rejected, Reservation, Reserve, Submit, Tokens
from ringfence.actors.serve.api import ChatCompletionRequest, CompletionRequest
from ringfence.actors.serve.config import FrontEndSettings
from ringfence.actors.serve.gateway import Lost, RequestStream
from ringfence.actors.serve.prompts import prompt_of
from ringfence.actors.serve.responses import events_card
from ringfence.actors.serve.view import FrontEndView
from ringfence.cache.storage.seal import load_seal
from ringfence.sched.checks import MAX_SALT_CHARS
from ringfence.sched.sampling import SamplingParams

ANSWER_TIMEOUT_S = 30.0  # how long a reserve waits for the engine's answer


class ReserveRequest(BaseModel):
    """POST /ringfence/reserve: a client's request as the router received it."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["completions", "chat"]
    body: dict[str, Any]


class PrefillRequest(BaseModel):
    """POST /ringfence/prefill: the prompt to compute and hand over."""

    model_config = ConfigDict(extra="forbid")
    prompt_token_ids: list[int] = Field(min_length=1)
    request_id: str = ""  # the router's id of the request, for the logs
    # The client's cache_salt: the decode side keys the handed-over blocks with it too.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_SALT_CHARS)


def install_router_api(app: FastAPI, frontend: FrontEndView, config: FrontEndSettings) -> None:
    """Add the routes of the module docstring to ``app``."""
    role = config.engine.role
    ident = model_id(config.model)
    fingerprints = [
        block_fingerprint(config, ident, rank).digest().hex()
        for rank in range(config.parallel.tp_size)
    ]
    namespace = block_fingerprint(config, ident).digest().hex()
    storage = config.cache.storage
    seal = load_seal(storage.secret, storage.secret_file)  # its id, never the secret
    prompter = frontend.prompter

    @app.get("/ringfence/instance")
    async def instance() -> dict[str, Any]:
        stats = frontend.stats
        load = Load.of(stats, frontend.gateway.pending).as_dict()
        events = events_card(stats, config.server.host)
        return {
            "role": role,
            "model": prompter.model_name,
            "model_id": ident,
            "fingerprints": fingerprints,
            "namespace": namespace,  # of the block keys (the KV events' hashes)
            "storage_secret_id": None if seal is None else seal.id,
            "events": None if events is None else events["events"],
            "block_size": config.cache.block_size,
            "tp_size": config.parallel.tp_size,
            "max_model_len": prompter.max_model_len,
            "serving": not frontend.engine_down_reason(),
            # Salting by key here salts a router's every request with the router's key.
            "salt_by_key": config.server.salt_by_key,
            "load": load,
        }

    @app.get("/ringfence/load")
    async def load(after: int = 0, wait_s: float = 0.0) -> dict[str, Any]:
        seq, now = await frontend.load.after(after, wait_s)
        return frontend.load.answer(seq, now)

    @app.post("/ringfence/reserve")
    async def reserve(body: ReserveRequest) -> dict[str, Any]:
        if role != "decode":
            raise _wrong_role(role, "decode", "reservations")
        prompt = await asyncio.to_thread(prompt_of, _client_body(body), prompter)
        name = f"rsv-{uuid.uuid4().hex}"
        msg = Reserve(
            reservation_id=name, prompt_token_ids=prompt.token_ids, max_tokens=prompt.max_tokens
        )
        answer = await _answered(frontend.gateway.reserve(msg))
        if isinstance(answer, Lost):
            raise ApiError(f"the engine could not answer: {answer.error}", status=503,
                           kind="service_unavailable")  # fmt: skip
        if not answer.granted:
            raise _refused(answer, frontend.gateway.retry_after_s)
        return {
            "reservation_id": name,
            "ttl_s": answer.ttl_s,
            "blocks": answer.blocks,
            "prompt_tokens": len(prompt.token_ids),
            "prompt_token_ids": list(prompt.token_ids),
        }

    @app.post("/ringfence/prefill")
    async def prefill(body: PrefillRequest, request: Request) -> dict[str, Any]:
        if role != "prefill":
            raise _wrong_role(role, "prefill", "prefills")
        prompter.check_ids("prompt_token_ids", body.prompt_token_ids)
        tenant = request.scope.get(TENANT_SCOPE)
        submit = Submit(
            request_id=f"prefill-{body.request_id or uuid.uuid4().hex}",
            prompt_token_ids=tuple(body.prompt_token_ids),
            params=SamplingParams(max_tokens=1),
            # Salted as the claimed request on the decode side will be (its /v1 route).
            cache_salt=tenant_salt(tenant, body.cache_salt, config.server.salt_by_key),
        )
        stream = frontend.gateway.open(submit)  # 429 / 503 here
        return await _prefilled(stream, config.server.request_timeout_s)


def _client_body(body: ReserveRequest) -> CompletionRequest | ChatCompletionRequest:
    """The client's request as its route would read it; pydantic's errors are answered as
    that route answers them, naming the field as the client wrote it."""
    model = CompletionRequest if body.kind == "completions" else ChatCompletionRequest
    try:
        return model.model_validate(body.body)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        raise RequestValidationError(errors, body=body.body) from None


async def _answered(future: asyncio.Future[Reservation | Lost]) -> Reservation | Lost:
    try:
        result: Reservation | Lost = await asyncio.wait_for(future, ANSWER_TIMEOUT_S)
    except TimeoutError:
        raise ApiError(f"the engine did not answer in {ANSWER_TIMEOUT_S} s", status=504,
                       kind="timeout") from None  # fmt: skip
    return result


def _refused(answer: Reservation, retry_after_s: int) -> ApiError:
    if answer.retry:
        return ApiError(
            f"no room on this decode instance now: {answer.error}",
            status=503,
            kind="service_unavailable",
            code="no_room",
            headers={"Retry-After": str(retry_after_s)},
        )
    return ApiError(f"the request cannot run here: {answer.error}", status=400)


def _wrong_role(role: str, wanted: str, what: str) -> ApiError:
    return ApiError(
        f"engine.role is {role!r}: only a {wanted} instance takes {what}",
        status=409,
        code="wrong_role",
    )


async def _prefilled(stream: RequestStream, timeout_s: float) -> dict[str, Any]:
    """Read a prefill's stream to its end: the answer of POST /ringfence/prefill."""
    first: int | None = None
    first_at = 0.0
    try:
        while True:
            try:
                event = await stream.next(timeout_s)
            except TimeoutError:
                raise ApiError(f"no answer for {timeout_s} s (server.request_timeout_s)",
                               status=504, kind="timeout") from None  # fmt: skip
            if isinstance(event, Rejected | Lost):
                status = 400 if isinstance(event, Rejected) else event.status
                raise ApiError(f"the engine could not run the prefill: {event.error}",
                               status=status)  # fmt: skip
            assert isinstance(event, Tokens)
            if event.error:
                raise ApiError(f"the prefill failed in the engine: {event.error}", status=500,
                               kind="server_error")  # fmt: skip
            if first is None and event.token_ids:
                first, first_at = event.token_ids[0], time.perf_counter()
            if event.finish_reason:
                done = time.perf_counter()
                return {
                    "prompt_tokens": len(stream.submit.prompt_token_ids),
                    "stored_blocks": max(event.stored_blocks, 0),
                    "first_token_id": first,
                    "ttft_s": round((first_at or done) - stream.opened, 6),
                    "elapsed_s": round(done - stream.opened, 6),  # the writes' wait included
                }
    finally:
        if not stream.done:
            stream.abort()  # the router went away or gave up: free the request
