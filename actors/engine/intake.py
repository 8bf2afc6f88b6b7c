"""Requests in: a workload's lines at their arrival times, and clients' Submits.

Each becomes the scheduler's :class:`Request`; a text prompt goes through the checkpoint's
tokenizer (bytes for the presets), a chat (``messages``) through the checkpoint's chat
template and then its tokenizer (the presets have no chat template: a chat is an error
naming the preset). A checkpoint's requests also stop at its end-of-sequence ids
(``stop_ids`` of its configs) besides their own stop tokens; a preset's stop only where
they ask. Workload files are read here, not in the scheduler (which does no I/O);
``ringfence launch`` checks one, chats rendered, before a run exists
(:func:`check_workload`, a preflight check the engine's topology names).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from ringfence.actors.engine.config import EngineConfig
from ringfence.actors.model.config import ModelConfig
from ringfence.actors.protocol.client import Submit
from ringfence.actors.text.tokenizer import ByteTokenizer, Tokenizer, model_tokenizer
from ringfence.sched.request import Request, RequestError, SamplingParams
from ringfence.sched.synthetic import synthetic
from ringfence.sched.workload import WorkloadRequest, parse_workload

if TYPE_CHECKING:
    from ringfence.actors.text.chat import ChatTemplate

Encode = Callable[[str], Sequence[int]]


class IntakeSections(Protocol):
    """The sections requests come in by: ``[engine]`` (the workload) and ``[model]`` (its
    tokenizer and chat template); the Engine's settings, or the run's whole config."""

    @property
    def engine(self) -> EngineConfig: ...
    @property
    def model(self) -> ModelConfig: ...


def load_workload(
    source: str, *, seed: int = 0, requests: int | None = None
) -> list[WorkloadRequest]:
    """``synthetic:NAME`` or a JSON-lines file, sorted by arrival."""
    if source.startswith("synthetic:"):
        return synthetic(source.removeprefix("synthetic:"), seed=seed, requests=requests)
    with open(source, encoding="utf-8") as f:
        lines = f.readlines()
    parsed = parse_workload(lines, source=source)
    return sorted(parsed[:requests] if requests else parsed, key=lambda r: r.arrival_s)


def check_workload(config: IntakeSections) -> None:
    """ValueError naming the file and line (or request) when ``engine.workload`` cannot be
    read, or a chat of it cannot be rendered."""
    if not config.engine.workload:
        return
    try:
        Intake(config).load()
    except OSError as e:
        raise ValueError(f"workload {config.engine.workload}: {e}") from None


def with_stops(
    params: SamplingParams, stop_ids: Sequence[int], eos: int | None = None
) -> SamplingParams:
    """``params`` that also stop at ``stop_ids``, the model's end-of-sequence tokens (after
    the request's own, no repeats), unless they ask to ignore them. A structured output
    stops at ``eos`` when the model names no stop ids (the presets): its grammar allows
    only that token once it is complete (``actors/text/grammars.py``)."""
    if not stop_ids and params.structured is not None and eos is not None:
        stop_ids = (eos,)
    if not stop_ids or params.ignore_eos:
        return params
    stops = tuple(dict.fromkeys([*params.stop_token_ids, *stop_ids]))
    return params if stops == params.stop_token_ids else replace(params, stop_token_ids=stops)


def make_request(
    line: WorkloadRequest,
    encode: Encode | None = None,
    stop_ids: Sequence[int] = (),
    eos: int | None = ByteTokenizer.eos,
) -> Request:
    """The scheduler's request of a workload line; a text prompt goes through ``encode``
    (bytes by default, so ``eos`` is the byte tokenizer's); it also stops at ``stop_ids``
    (:func:`with_stops`). A chat must have been rendered to token ids before."""
    if line.prompt_token_ids is not None:
        tokens = tuple(line.prompt_token_ids)
    elif line.prompt is not None:
        tokens = tuple((encode or ByteTokenizer().encode)(line.prompt))
    else:
        raise ValueError(f"request {line.id!r}: its messages were not rendered to token ids")
    return Request(
        request_id=line.id,
        prompt_token_ids=tokens,
        params=with_stops(line.params, stop_ids, eos),
        arrival=line.arrival_s,
    )


def check_structured(params: SamplingParams) -> None:
    """RequestError naming ``structured`` with the grammar backend's complaint when the
    request's structured output does not compile (so a bad one never reaches the Worker)."""
    if params.structured is None:
        return
    from ringfence.actors.text.grammars import problem  # the backend, for these alone

    if said := problem(params.structured):
        raise RequestError(f"structured: {said}", field="structured")


class Intake:
    """The engine's source of requests. Not thread-safe; owned by the Engine actor."""

    def __init__(self, config: IntakeSections) -> None:
        self.config = config
        self.workload: list[WorkloadRequest] = []  # sorted by arrival
        self.next = 0  # the workload's next line to arrive
        self._tokenizer: Tokenizer | None = None
        self._template: ChatTemplate | None = None

    def load(self) -> None:
        """Read ``engine.workload`` and render its chats to token ids (ValueError naming the
        file and line or request, or OSError, if it cannot be read or a chat rendered)."""
        settings = self.config.engine
        requests = settings.requests or None
        workload = load_workload(settings.workload, seed=settings.seed, requests=requests)
        self.workload = [self._rendered(line, settings.workload) for line in workload]
        if not settings.arrivals:
            self.workload = [replace(w, arrival_s=0.0) for w in self.workload]
        self.next = 0

    def due(self, now: float) -> tuple[list[WorkloadRequest], float | None]:
        """The lines whose arrival time has come by ``now`` (each once), and the seconds
        until the next one arrives (None when none is left)."""
        lines: list[WorkloadRequest] = []
        while self.next < len(self.workload):
            line = self.workload[self.next]
            if line.arrival_s > now:
                return lines, line.arrival_s - now
            lines.append(line)
            self.next += 1
        return lines, None

    def request(self, line: WorkloadRequest) -> Request:
        tokenizer = self.tokenizer()
        return make_request(line, self.encode, tokenizer.stop_ids, tokenizer.eos)

    def submitted(self, msg: Submit, request_id: str, arrival: float) -> Request:
        """The request of a client's Submit, keyed ``request_id`` (RequestError if bad)."""
        tokenizer = self.tokenizer()
        msg.params.check_vocab(tokenizer.vocab_size)
        check_structured(msg.params)
        params = with_stops(msg.params, tokenizer.stop_ids, tokenizer.eos)
        if msg.messages:
            try:
                tokens = tuple(self.encode_chat(msg.messages))
            except ValueError as e:  # no template, or it refused: the request ends here
                raise RequestError(f"messages: {e}", field="messages") from None
        else:
            tokens = msg.prompt_token_ids or tuple(self.encode(msg.prompt))
        return Request(
            request_id=request_id,
            prompt_token_ids=tokens,
            params=params,
            arrival=arrival,
            cache_salt=msg.cache_salt,
        )

    def encode(self, text: str) -> list[int]:
        """A text prompt's ids: the checkpoint's tokenizer, or bytes for the presets."""
        return self.tokenizer().encode(text)

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """A chat's ids: rendered by the checkpoint's chat template with the assistant's turn
        opened, then encoded (ChatTemplateError if there is no template or it refuses)."""
        # Imported here: jinja2 is for chats only, and the engine starts faster without it.
        from ringfence.actors.text.chat import ChatTemplate, ChatTemplateError

        template = self._template
        if template is None:
            path = self.config.model.path
            if not path:
                raise ChatTemplateError(
                    f"model.preset {self.config.model.preset!r} has no chat template: give "
                    "prompt or prompt_token_ids, or a model.path checkpoint with a template"
                )
            template = self._template = ChatTemplate.from_checkpoint(path)
        return template.encode(self.tokenizer(), messages, add_generation_prompt=True)

    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer (bytes for the presets), loaded on first use."""
        tokenizer = self._tokenizer
        if tokenizer is None:
            tokenizer = self._tokenizer = model_tokenizer(self.config.model.path)
        return tokenizer

    def _rendered(self, line: WorkloadRequest, source: str) -> WorkloadRequest:
        try:
            check_structured(line.params)
        except RequestError as e:
            raise ValueError(f"{source}: request {line.id!r}: {e}") from None
        if line.messages is None:
            return line
        try:
            ids = self.encode_chat(line.messages)
        except ValueError as e:  # no template, or it refused
            raise ValueError(f"{source}: request {line.id!r}: messages: {e}") from None
        if not ids:
            raise ValueError(
                f"{source}: request {line.id!r}: messages: the chat template rendered nothing"
            )
        return replace(line, messages=None, prompt_token_ids=tuple(ids))
