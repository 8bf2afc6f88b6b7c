"""The bodies the API answers with, as pydantic models: what its OpenAPI document promises.

The routes build these bodies as plain dicts (:mod:`.app`, :mod:`.outputs`); the models
here describe them for clients and for the schema tests, which check every answer of a
live server against them. A field marked "only with return_token_ids" is absent otherwise;
``usage`` is absent from stream chunks but the last one when the client asked for it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

Finish = Literal["stop", "length"] | None  # None until the last chunk of a stream
TokenIds = list[int]


class CachedTokens(BaseModel):
    cached_tokens: int  # prompt tokens not computed: found in a cache tier


class TierUsage(BaseModel):
    cached_tokens: dict[str, int]  # per tier: device, host, storage


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokens
    ringfence: TierUsage


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: Finish
    token_ids: TokenIds = []  # only with return_token_ids
    prompt_token_ids: TokenIds = []  # only with return_token_ids (a stream's first chunk)


class CompletionResponse(BaseModel):
    """``POST /v1/completions``: the whole answer, or (``stream``) one event's data."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]  # one; none in a stream's usage chunk
    usage: Usage | None = None  # absent from stream chunks but the usage chunk


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: Finish
    token_ids: TokenIds = []  # only with return_token_ids


class ChatCompletionResponse(BaseModel):
    """``POST /v1/chat/completions`` without ``stream``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: TokenIds = []  # only with return_token_ids


class ChatDelta(BaseModel):
    role: Literal["assistant"] = "assistant"  # only in the first chunk
    content: str = ""  # absent from a chunk that adds no text


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None
    finish_reason: Finish
    token_ids: TokenIds = []  # only with return_token_ids


class ChatCompletionChunk(BaseModel):
    """One event's data of ``POST /v1/chat/completions`` with ``stream``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]  # one; none in the usage chunk
    usage: Usage | None = None  # only in the usage chunk
    prompt_token_ids: TokenIds = []  # only with return_token_ids, in the first chunk


class RingfenceModel(BaseModel):
    model_id: str
    fingerprint: str  # of the KV block layout: equal fingerprints can share cached blocks
    block_size: int
    tp_size: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    ringfence: RingfenceModel


class ModelList(BaseModel):
    """``GET /v1/models``: the one model served."""

    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    """``GET /health``."""

    status: Literal["ok", "unavailable"]
    down: list[str] = Field(default=[], description="the actors down (with 503)")


def stream_of(chunk: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI entry of a ``text/event-stream`` answer whose events carry ``chunk`` s as
    JSON, an error body if the request failed after the stream began, then ``[DONE]``
    (OpenAPI 3.1: the schema describes each event)."""
    ref = f"#/components/schemas/{chunk.__name__}"
    as_json = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [{"$ref": ref}, {"$ref": "#/components/schemas/ErrorResponse"}]},
    }
    data = {"oneOf": [{"const": "[DONE]"}, {"allOf": [{"not": {"const": "[DONE]"}}, as_json]}]}
    return {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {"event": {"const": "message"}, "data": data},
        }
    }
