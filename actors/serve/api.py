"""The OpenAI request bodies the front end accepts, as pydantic models (its OpenAPI schema).

Every field the server reads is declared. A field it does not know is accepted and
ignored, as vLLM does (clients send other servers' knobs), but never silently: the front
end logs one ``server.fields_ignored`` line and answers with the
``X-Ringfence-Ignored-Fields`` header naming them (:func:`ignored_fields`). Fields of the
OpenAI API this server does not implement are declared too, with the one value it honours
(``suffix``), so that a request asking for more is refused by name
(:func:`check_unsupported`) rather than ignored. The sampling fields are checked once more,
and turned into the request's ``SamplingParams``, in :mod:`.sampling`.
Types are strict, as the schema states them: ``false`` is no token id, ``0`` no boolean
and ``"1"`` no number (a float field takes an integer, as JSON has one number type).
vLLM's extensions that its users rely on are here as well: ``return_token_ids``,
``stop_token_ids``, ``ignore_eos``... each documented in its field.

A request refused is an :class:`~ringfence.actors.http.errors.ApiError`, answered in
OpenAI's error body.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ringfence.actors.http.errors import ApiError
from ringfence.actors.http.limits import MAX_N
from ringfence.sched.checks import MAX_SALT_CHARS

TokenIds = list[Annotated[int, Field(ge=0)]]
Seed = Annotated[int, Field(ge=0, lt=1 << 63)]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]  # sched.sampling.MAX_LOGPROBS
Stop = str | list[str] | None


STRICT = ConfigDict(extra="forbid", strict=True)
LENIENT = ConfigDict(extra="allow", strict=True)  # unknown fields kept in model_extra
IGNORED_HEADER = "X-Ringfence-Ignored-Fields"


class StreamOptions(BaseModel):
    model_config = LENIENT

    include_usage: bool = False  # a last chunk with the usage (and no choices)
    # vLLM: with include_usage, every chunk carries the usage so far as well.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = STRICT

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    # "schema" would shadow pydantic's BaseModel.schema: the field is named apart.
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, any JSON object, or a JSON schema."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # with type json_schema only


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: what the output must match, one field of these."""

    model_config = LENIENT  # vLLM's backend tuning knobs are accepted and ignored (by name)

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")  # a JSON schema
    regex: str | None = None  # the whole output matches it
    choice: Annotated[list[str], Field(min_length=1)] | None = None  # the output is one of these
    grammar: str | None = None  # a Lark grammar or llama.cpp's GBNF (vLLM's EBNF)
    json_object: bool | None = None  # true: any JSON object


class _Sampling(BaseModel):
    """The fields completions and chat completions share."""

    model_config = LENIENT

    model: str | None = None  # the served model's name (GET /v1/models); omitted: that one
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Seed | None = None  # None: a fresh seed per request
    # vLLM's sampling knobs (sched/sampling.py says what each does).
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # -1 or 0: off (vLLM's -1)
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    min_tokens: Annotated[int, Field(ge=0)] = 0  # <= the max tokens
    ignore_eos: bool = False  # generate past the model's end-of-sequence tokens
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias
    stop: Stop = None  # up to 16 strings; the output ends before the first one produced
    stop_token_ids: TokenIds | None = None  # vLLM: ids that end the output (kept in it)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM: choices carry token_ids, and prompt_token_ids
    user: str | None = None  # accepted, not used
    # Choices, each its own engine request (a seed of its own, derived from ``seed``); the
    # prompt's KV blocks are shared through the prefix cache. Each counts in max_pending.
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    # vLLM: the prompt's log probabilities, with this many alternatives per token.
    prompt_logprobs: TopLogprobs | None = None
    # vLLM: joins the hash of the prompt's first KV block, so requests with another salt
    # share none of its cached blocks (and cannot tell from their speed that it was sent).
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_SALT_CHARS)] | None = None
    # vLLM: the grammar the output follows (actors/serve/structured.py), and the older
    # top-level fields vLLM still takes for it.
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None  # OpenAI's (vLLM takes it on completions too)
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | TokenIds | list[str] | list[TokenIds]  # one prompt (a list holds one)
    # None: up to the model's length; 0 only with echo (the prompt and its logprobs alone)
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: TopLogprobs | None = None  # each output token's, and this many alternatives
    echo: bool = False  # the prompt before the output (with logprobs: its log probabilities)
    best_of: int | None = None  # None or n: no candidates are drawn beyond the choices
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # templates may read other keys

    role: Annotated[str, Field(min_length=1)]
    content: str | list[TextPart] | None = None


class FunctionDef(BaseModel):
    model_config = LENIENT

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None  # calls always follow the schema when the grammar forces them


class Tool(BaseModel):
    model_config = LENIENT

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = STRICT

    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the function the answer must call."""

    model_config = STRICT

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # None: up to the model's length
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's newer name
    # The functions the model may call (actors/serve/tools.py), and whether it must: none,
    # auto (the default with tools), required (some call) or one named function.
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most (a forced one is one)
    logprobs: bool | None = None  # each output token's log probability
    top_logprobs: TopLogprobs | None = None  # and this many alternatives (needs logprobs)


# field -> (the value honoured, how to say it)
_UNSUPPORTED: dict[str, tuple[object, str]] = {
    "suffix": (None, "suffix is not supported"),
}


def check_unsupported(request: _Sampling) -> None:
    """ApiError naming the first field set to something this server does not do."""
    for name, (honoured, why) in _UNSUPPORTED.items():
        value = getattr(request, name, honoured)
        if value != honoured:
            raise ApiError(f"{name}: {why}, got {value!r}", param=name)
    best_of = getattr(request, "best_of", None)
    if best_of is not None and best_of != request.n:
        raise ApiError(f"best_of: only best_of = n ({request.n}) is supported, got {best_of}",
                       param="best_of")  # fmt: skip
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError("top_logprobs: needs logprobs: true", param="top_logprobs")
    elif isinstance(request, CompletionRequest) and request.max_tokens == 0 and not request.echo:
        raise ApiError("max_tokens: 0 is only allowed with echo", param="max_tokens")
    stops = stop_strings(request.stop)
    if len(stops) > 16:
        raise ApiError(f"stop: at most 16 strings, got {len(stops)}", param="stop")


def stop_strings(stop: Stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def ignored_fields(request: _Sampling) -> list[str]:
    """The fields of ``request`` the server does not know (and so ignores), dotted, each
    in printable ASCII (Python's escapes; the empty name as ``""``) so that a header and
    a log line can carry it."""
    names = list(request.model_extra or ())
    options = request.stream_options
    if options is not None:
        names += [f"stream_options.{name}" for name in options.model_extra or ()]
    structured = request.structured_outputs
    if structured is not None:
        names += [f"structured_outputs.{name}" for name in structured.model_extra or ()]
    return [ascii(name)[1:-1] or '""' for name in names]
