"""The bodies the API answers with, as pydantic models: what its OpenAPI document promises.

The routes build these bodies as plain dicts (:mod:`.app`, :mod:`.outputs`); the models
here describe them for clients and for the schema tests, which check every answer of a
live server against them. A field marked "only with return_token_ids" is absent otherwise;
``usage`` is absent from stream chunks but the last one when the client asked for it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from ringfence.actors.protocol.client import Stats

# None until the last chunk of a stream; tool_calls: a chat answer that called its tools.
Finish = Literal["stop", "length", "tool_calls"] | None
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


class CompletionLogprobs(BaseModel):
    """The legacy ``logprobs`` of a completion choice: per token (prompt tokens first with
    echo), its text (``bytes:\\xNN`` for part of a character), its log probability (None
    for the prompt's first token), the sampled token's and the best ``logprobs``
    alternatives' keyed by text, and its offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int  # 1 + how many tokens were more probable
    decoded_token: str


# vLLM's prompt_logprobs: None for the first prompt token, then token id -> its entry.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int  # 0 .. n - 1
    text: str  # after the prompt's text with echo
    logprobs: CompletionLogprobs | None  # only with logprobs
    finish_reason: Finish
    prompt_logprobs: PromptLogprobs | None = None  # only with prompt_logprobs
    token_ids: TokenIds = []  # only with return_token_ids
    prompt_token_ids: TokenIds = []  # only with return_token_ids (a stream's first chunk)


class CompletionResponse(BaseModel):
    """``POST /v1/completions``: the whole answer, or (``stream``) one event's data."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]  # n; a stream's chunk one; its usage chunk none
    usage: Usage | None = None  # absent from stream chunks but the usage chunk


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None: the answer is tool calls alone
    tool_calls: list[ToolCall] = []  # only when it called its tools


class FunctionDelta(BaseModel):
    name: str | None = None  # only in the call's first delta
    arguments: str  # the next piece of the arguments' JSON text ("" in the first delta)


class ToolCallDelta(BaseModel):
    index: int  # the call's place among the answer's calls
    id: str | None = None  # only in the call's first delta
    type: Literal["function"] | None = None  # only in the call's first delta
    function: FunctionDelta


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]  # the token's UTF-8 bytes (a part of a character: those bytes)


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the top_logprobs most probable tokens


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None  # only with logprobs: true
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
    prompt_logprobs: PromptLogprobs | None = None  # only with prompt_logprobs
    prompt_token_ids: TokenIds = []  # only with return_token_ids


class ChatDelta(BaseModel):
    role: Literal["assistant"] = "assistant"  # only in the first chunk
    content: str = ""  # absent from a chunk that adds no text
    tool_calls: list[ToolCallDelta] = []  # only in chunks that start a call or add to one


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None  # only with logprobs: true
    finish_reason: Finish
    token_ids: TokenIds = []  # only with return_token_ids


class ChatCompletionChunk(BaseModel):
    """One event's data of ``POST /v1/chat/completions`` with ``stream``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]  # one (its index says which); none in the usage chunk
    usage: Usage | None = None  # only in the usage chunk
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs: the first content
    prompt_token_ids: TokenIds = []  # only with return_token_ids, in the first chunk


class EventEndpoints(BaseModel):
    """Where the instance publishes its KV events (``[events]``): vLLM's wire format."""

    endpoint: str = Field(description="the ZMQ PUB socket: subscribe here")
    replay_endpoint: str = Field(description="the ZMQ ROUTER socket that replays ('' for none)")


class RingfenceModel(BaseModel):
    model_id: str
    fingerprint: str  # of the KV block layout: equal fingerprints can share cached blocks
    block_size: int
    tp_size: int
    events: EventEndpoints | None = Field(
        default=None, description="present once the engine publishes KV events"
    )


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


def events_card(stats: Stats | None, host: str) -> dict[str, Any] | None:
    """The ``events`` of the model card: where the engine publishes its KV events (None
    while it does not, or has not said). A wildcard host (``0.0.0.0``) is given as the
    host the front end listens on, or 127.0.0.1 when that is a wildcard too."""
    if stats is None or not stats.events_endpoint:
        return None
    here = "127.0.0.1" if host in ("", "0.0.0.0", "::", "*") else host
    here = f"[{here}]" if ":" in here else here

    def reachable(endpoint: str) -> str:
        return endpoint.replace("tcp://0.0.0.0:", f"tcp://{here}:", 1)

    return {
        "events": {
            "endpoint": reachable(stats.events_endpoint),
            "replay_endpoint": reachable(stats.events_replay_endpoint),
        }
    }
