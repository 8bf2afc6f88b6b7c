"""Prompts of API requests as token ids, checked against the model before they reach the engine.

The front end tokenizes (and renders chats) itself, so that it can answer a prompt that is
empty, too long for the model or holds ids past its vocabulary with a 400 naming the field,
count the prompt's tokens for ``usage``, and send the engine ids only. The presets have no
chat template of their own; they get :data:`PRESET_TEMPLATE`, a plain one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from ringfence.actors.http.errors import ApiError
from ringfence.actors.model.config import ModelConfig
from ringfence.actors.model.identity import model_shape
from ringfence.actors.serve.api import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    check_unsupported,
)
from ringfence.actors.serve.config import ServerConfig
from ringfence.actors.serve.structured import structured_output
from ringfence.actors.serve.tools import ToolUse, tool_use
from ringfence.actors.text.chat import ChatTemplate, ChatTemplateError, find_template
from ringfence.actors.text.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from ringfence.sched.config import SchedConfig, max_model_len
from ringfence.sched.structured import StructuredOutput

PRESET_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A checked prompt: its ids, and how many tokens the output may have."""

    token_ids: tuple[int, ...]
    max_tokens: int
    tools: ToolUse | None = None  # a chat's tools: how they are forced and read back
    # The request's structured output, compiled once (a forced tool call's grammar included).
    structured: StructuredOutput | None = None


class PromptSections(Protocol):
    """The sections prompts are checked by: ``[model]`` (tokenizer, template, shape),
    ``[sched]`` (``max_model_len``) and ``[server]`` (the model's name); the front end's
    settings, or the run's whole config (the launch check of ``ringfence serve``)."""

    @property
    def model(self) -> ModelConfig: ...
    @property
    def sched(self) -> SchedConfig: ...
    @property
    def server(self) -> ServerConfig: ...


class Prompter:
    """The model's tokenizer, chat template and limits. Immutable; threads may share it."""

    def __init__(self, config: PromptSections) -> None:
        shape = model_shape(config.model)
        self.vocab_size = shape.vocab_size
        self.max_model_len = max_model_len(config.sched, shape.max_position)
        path = config.model.path
        tokenizer: Tokenizer | None = load_tokenizer(path) if path else None
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        # The template's source too, for GET /tokenizer_info.
        self.template_source: str | None = PRESET_TEMPLATE
        if path:
            try:
                self.template: ChatTemplate | None = ChatTemplate.from_checkpoint(path)
                self.template_source = find_template(Path(path))[0]
            except ChatTemplateError:
                self.template, self.template_source = None, None  # chats are refused
        else:
            self.template = ChatTemplate(
                PRESET_TEMPLATE, origin="the presets' built-in chat template", variables={}
            )
        self.model_path = path
        self.model_name = config.server.model_name or (
            Path(path).name if path else f"ringfence-{config.model.preset}"
        )

    def decode(self, token_ids: Iterable[int], *, skip_special: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special=skip_special)

    def completion(self, prompt: object, max_tokens: int | None) -> Prompt:
        """The ids of a completions ``prompt``: a string, ids, or a list of one of them."""
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(
                    f"prompt: one prompt per request is supported, got a list of {len(prompt)}",
                    param="prompt",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self._encode("prompt", prompt)
        else:
            assert isinstance(prompt, list)
            ids = prompt
        return self._checked("prompt", tuple(ids), max_tokens, "max_tokens")

    def chat(
        self,
        messages: Sequence[ChatMessage],
        max_tokens: int | None,
        field: str,
        tools: ToolUse | None = None,
    ) -> Prompt:
        """The ids of a chat, rendered through the chat template with the assistant's turn
        opened and ``tools`` offered. ``field`` names the max-tokens field the client used."""
        offered = tools.tools if tools is not None else None
        ids = self.chat_ids(messages, add_generation_prompt=True, tools=offered)
        return replace(self._checked("messages", tuple(ids), max_tokens, field), tools=tools)

    def chat_ids(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The ids of a chat rendered through the chat template (unchecked against limits)."""
        if self.template is None:
            raise ApiError(
                f"messages: the model at {self.model_path} has no chat template "
                "(use /v1/completions)",
                param="messages",
            )
        chat: list[dict[str, Any]] = []
        for message in messages:
            plain = message.model_dump(exclude_none=True)
            content = message.content
            if isinstance(content, list):
                plain["content"] = "".join(part.text for part in content)
            elif content is None:
                plain["content"] = ""
            chat.append(plain)
        try:
            return self.template.encode(
                self.tokenizer, chat, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except ChatTemplateError as e:
            raise ApiError(f"messages: {e}", param="messages") from None
        except UnicodeEncodeError as e:
            raise ApiError(f"messages: {_not_unicode(e)}", param="messages") from None

    def check_ids(self, field: str, ids: Iterable[int]) -> None:
        """ApiError naming ``field`` if one of ``ids`` is not a token of the model."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(
                f"{field}: token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})",
                param=field,
            )

    def encode(self, field: str, text: str) -> list[int]:
        """The ids of ``text``; ApiError naming ``field`` if it is not Unicode."""
        return self._encode(field, text)

    def _encode(self, field: str, text: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except UnicodeEncodeError as e:
            raise ApiError(f"{field}: {_not_unicode(e)}", param=field) from None

    def _checked(
        self, field: str, ids: tuple[int, ...], max_tokens: int | None, max_field: str
    ) -> Prompt:
        if not ids:
            raise ApiError(f"{field}: the prompt is empty", param=field)
        self.check_ids(field, ids)
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ApiError(
                f"{field}: the prompt has {len(ids)} tokens; this model's maximum context "
                f"length is {self.max_model_len} (sched.max_model_len), prompt and output",
                param=field,
            )
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise ApiError(
                f"{max_field}: {max_tokens} output tokens after a {len(ids)}-token prompt pass "
                f"this model's maximum context length of {self.max_model_len} "
                "(sched.max_model_len)",
                param=max_field,
            )
        return Prompt(ids, max_tokens)


def prompt_of(body: CompletionRequest | ChatCompletionRequest, prompter: Prompter) -> Prompt:
    """The request's checked prompt, its structured output compiled (ApiError naming the
    field the server cannot honour). What may take long (a long prompt's tokens, a large
    schema's grammar) happens here: the server calls it on a thread, not its event loop."""
    check_request(body, prompter)
    if isinstance(body, CompletionRequest):
        prompt = prompter.completion(body.prompt, body.max_tokens)
        return replace(prompt, structured=structured_output(body))
    limit, field = body.max_completion_tokens, "max_completion_tokens"
    if limit is None:
        limit, field = body.max_tokens, "max_tokens"
    tools = tool_use(body, prompter.template_source)
    prompt = prompter.chat(body.messages, limit, field, tools)
    forced = tools.forced if tools is not None else None
    return replace(prompt, structured=structured_output(body, forced))


def check_request(body: CompletionRequest | ChatCompletionRequest, prompter: Prompter) -> None:
    """ApiError naming the first field the server cannot honour as asked (the prompt aside)."""
    check_unsupported(body)
    name = prompter.model_name
    if body.model is not None and body.model != name:
        raise ApiError(
            f"model: {body.model!r} is not served here; this server serves {name!r}",
            param="model",
            code="model_not_found",
        )
    prompter.check_ids("stop_token_ids", body.stop_token_ids or ())


def _not_unicode(error: UnicodeEncodeError) -> str:
    """What is wrong with text JSON could carry but UTF-8 cannot (a lone surrogate escape)."""
    char = error.object[error.start : error.end]
    return f"the text holds {char!r} at {error.start}, which is not a Unicode character"
