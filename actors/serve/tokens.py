"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

They use the front end's own tokenizer and chat template (:class:`~.prompts.Prompter`), so
``/tokenize`` gives exactly the ids ``/v1/completions`` and ``/v1/chat/completions`` feed
the model for the same text or chat (no bos added unless ``add_special_tokens``). They
touch no engine; the tokenizer runs on a thread, not the event loop (a long text's tokens
would hold every stream up).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from ringfence.actors.http.errors import ApiError, ErrorResponse
from ringfence.actors.serve.api import STRICT, ChatMessage, TokenIds
from ringfence.actors.serve.prompts import Prompter


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a ``prompt`` or the ``messages`` of a chat, not both."""

    model_config = STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # chats: open the assistant's turn, as chats do
    add_special_tokens: bool = False  # prepend the tokenizer's bos (if it has one)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = STRICT

    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """What a remote tokenizer (vLLM's ``/tokenizer_info``) reads of the served one."""

    tokenizer_class: str
    vocab_size: int
    model_max_length: int
    bos_token: str | None  # as text; null where the tokenizer names none (the presets)
    eos_token: str | None
    pad_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None  # the template chats are rendered with; null: chats refused


def tokenize(body: TokenizeRequest, prompter: Prompter) -> dict[str, Any]:
    """The ids of the body's prompt or chat; ApiError naming the field at fault."""
    if (body.prompt is None) == (body.messages is None):
        raise ApiError("prompt: give a prompt or messages, one of them", param="prompt")
    if body.prompt is not None:
        ids = prompter.encode("prompt", body.prompt)
    else:
        if prompter.template is None:
            raise ApiError("messages: the model has no chat template", param="messages")
        assert body.messages is not None
        ids = prompter.chat_ids(body.messages, add_generation_prompt=body.add_generation_prompt)
    bos = prompter.tokenizer.bos
    if body.add_special_tokens and bos is not None:
        ids = [bos, *ids]
    return {"count": len(ids), "max_model_len": prompter.max_model_len, "tokens": ids}


def tokenizer_info(prompter: Prompter) -> dict[str, Any]:
    tokenizer = prompter.tokenizer
    variables = prompter.template.variables if prompter.template is not None else {}
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "vocab_size": prompter.vocab_size,
        "model_max_length": prompter.max_model_len,
        "bos_token": variables.get("bos_token"),
        "eos_token": variables.get("eos_token"),
        "pad_token": variables.get("pad_token"),
        "bos_token_id": tokenizer.bos,
        "eos_token_id": tokenizer.eos,
        "chat_template": prompter.template_source,
    }


REFUSED: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "the request is malformed"}
}


def install_token_api(app: FastAPI, prompter: Prompter) -> None:
    """Add the tokenizer routes to ``app``."""
    info = tokenizer_info(prompter)  # fixed: once

    def check_model(model: str | None) -> None:
        if model is not None and model != prompter.model_name:
            raise ApiError(
                f"model: {model!r} is not served here; this server serves {prompter.model_name!r}",
                param="model",
                code="model_not_found",
            )

    @app.post("/tokenize", response_model=TokenizeResponse, responses=REFUSED)
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        return await asyncio.to_thread(tokenize, body, prompter)  # off the event loop

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=REFUSED)
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        prompter.check_ids("tokens", body.tokens)
        text = await asyncio.to_thread(prompter.decode, body.tokens, skip_special=False)
        return {"prompt": text}

    @app.get("/tokenizer_info", response_model=TokenizerInfo)
    async def tokenizer_info_route() -> dict[str, Any]:
        return info
