"""One API request's answer: its ``n`` choices, each one engine request, and their formats.

A choice is one Submit with a seed of its own (:func:`.sampling.choice_seed`); the
prompt's KV blocks are computed once and shared through the engine's prefix cache, and
its log probabilities, when asked, come with the first choice alone. Every choice counts
against ``server.max_pending``: a request whose choices do not all fit is refused whole.

A whole answer waits for every choice; a stream interleaves the choices' chunks as their
tokens come, each chunk naming its choice's ``index``. ``usage`` counts the prompt once
and the output tokens of every choice; the metrics count the prompt once too.

Through prefill and decode instances each choice is a claim of its own (a reservation holds
one request's room), which ``ringfence router`` sends with ``n`` 1 and the choice's index
(``choice``, from ``X-Ringfence-Choice``): that answer's one choice is sampled with the
seed of that index, numbered so, asks the prompt's log probabilities as a first choice does
(the router's merged answer shows them with every choice, as here), and counts no prompt
tokens in the metrics unless it is the first. Event-loop thread only.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import StreamingResponse

from ringfence.actors.http.errors import ApiError
from ringfence.actors.protocol.client import Submit
from ringfence.actors.serve.api import ChatCompletionRequest, CompletionRequest, stop_strings
from ringfence.actors.serve.logprobs import (
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from ringfence.actors.serve.metrics import Metrics
from ringfence.actors.serve.outputs import Delta, Generation, Usage
from ringfence.actors.serve.prompts import Prompt
from ringfence.actors.serve.sampling import (
    asked_prompt_logprobs,
    choice_seed,
    output_logprobs,
    sampling_params,
)
from ringfence.actors.serve.tools import ToolStream, answer_decoder, message_fields
from ringfence.actors.serve.view import FrontEndView
from ringfence.sched.sampling import TokenLogprobs

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(slots=True)
class Output:
    """One choice's whole output."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish: str = "length"


class Answer:
    """One API request: its Submits, their generations, and its answer's formats."""

    def __init__(
        self,
        frontend: FrontEndView,
        body: CompletionRequest | ChatCompletionRequest,
        prompt: Prompt,
        *,
        kind: str,
        metrics: Metrics,
        timeout_s: float,
        reservation: str = "",
        cache_salt: str = "",
        choice: int = 0,
    ) -> None:
        self.body = body
        self.prompt = prompt
        self.id = f"{kind}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        prompter = frontend.prompter
        self.model = prompter.model_name
        self.names = TokenNames(prompter.tokenizer)
        self.k = output_logprobs(body)  # alternatives per output token; None: no logprobs
        self.prompt_k = asked_prompt_logprobs(body)
        self.echo = isinstance(body, CompletionRequest) and body.echo
        self.prompt_text = prompter.decode(prompt.token_ids) if self.echo else ""
        self.offsets = [0] * body.n  # each choice's text offset so far (completions)
        self.first_index = choice  # the index of this answer's first choice in the request
        if reservation and body.n > 1:
            # A reservation holds blocks for one request; it is claimed once.
            raise ApiError("n: a request through a prefill/decode pair takes n = 1 only, got "
                           f"{body.n}", param="n")  # fmt: skip
        self.generations: list[Generation] = []
        decoder = answer_decoder(prompter.tokenizer, prompt.tools)
        try:
            for index in range(body.n):
                params = sampling_params(body, prompt, prompter.vocab_size, index)
                if choice:  # a further choice claimed alone: its seed, the prompt's logprobs
                    params = replace(params, seed=choice_seed(body.seed, choice))
                submit = Submit(
                    request_id=self.id if index == 0 else f"{self.id}-{index}",
                    prompt_token_ids=prompt.token_ids,
                    params=params,
                    reservation_id=reservation,
                    cache_salt=cache_salt,
                )
                stream = frontend.gateway.open(submit)  # 429 / 503 here, before any output
                self.generations.append(Generation(
                    stream, prompt_tokens=len(prompt.token_ids), decode=decoder,
                    stop=stop_strings(body.stop), metrics=metrics, timeout_s=timeout_s,
                    drop_output=prompt.max_tokens == 0, count_prompt=index + choice == 0,
                ))  # fmt: skip
        except ApiError:
            self.close()
            raise

    def close(self) -> None:
        for generation in self.generations:
            generation.close()

    def usage(self) -> dict[str, Any]:
        """The prompt once, the output tokens of every choice."""
        first = self.generations[0].usage
        total = sum(g.usage.completion_tokens for g in self.generations)
        return Usage(first.prompt_tokens, total, dict(first.cached)).body()

    @property
    def include_usage(self) -> bool:
        options = self.body.stream_options
        return bool(options and options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: the usage so far on every chunk (it takes
        ``include_usage`` as well, as in vLLM)."""
        options = self.body.stream_options
        return bool(options and options.include_usage and options.continuous_usage_stats)

    # Log probabilities.

    def _prompt_entries(self) -> list[tuple[int, TokenLogprobs | None]]:
        ids = self.prompt.token_ids
        entries = self.generations[0].prompt_logprobs
        return [(ids[0], None), *((lp.token_id, lp) for lp in entries)]

    def _completion_logprobs(
        self, index: int, logprobs: list[TokenLogprobs] | tuple[TokenLogprobs, ...], first: bool
    ) -> dict[str, Any] | None:
        if self.k is None:
            return None
        entries: list[tuple[int, TokenLogprobs | None]] = []
        if self.echo and first:
            entries = self._prompt_entries()
        entries += [(lp.token_id, lp) for lp in logprobs]
        out = completion_logprobs(entries, self.names, self.k, self.offsets[index])
        self.offsets[index] += sum(len(token) for token in out["tokens"])
        return out

    def _prompt_logprobs(self) -> list[Any] | None:
        k = self.body.prompt_logprobs
        if k is None:
            return None
        return prompt_logprobs(self.generations[0].prompt_logprobs, self.names, k)

    # Whole answers.

    async def whole(self, request: Request, render: Callable[[list[Output]], Any]) -> Any:
        """Wait for every choice (aborting them if the client disconnects); ``render`` them."""

        async def collect(generation: Generation) -> Output:
            out = Output()
            async for delta in generation.deltas():
                out.text += delta.text
                out.token_ids.extend(delta.token_ids)
                out.logprobs.extend(delta.logprobs)
                out.finish = delta.finish_reason or out.finish
            return out

        work = asyncio.gather(*(collect(g) for g in self.generations))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                raise ApiError("the client disconnected", status=499, kind="client_closed")
            return render(work.result())
        finally:
            gone.cancel()
            self.close()

    def completion_body(self, outputs: list[Output]) -> dict[str, Any]:
        choices = []
        for index, out in enumerate(outputs):
            choice: dict[str, Any] = {
                "index": index + self.first_index,
                "text": self.prompt_text + out.text,
                "logprobs": self._completion_logprobs(index, out.logprobs, first=True),
                "finish_reason": out.finish,
            }
            if self.body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs()
            if self.body.return_token_ids:
                choice["token_ids"] = out.token_ids
                choice["prompt_token_ids"] = list(self.prompt.token_ids)
            choices.append(choice)
        return {
            "id": self.id, "object": "text_completion", "created": self.created,
            "model": self.model, "choices": choices, "usage": self.usage(),
        }  # fmt: skip

    def chat_body(self, outputs: list[Output]) -> dict[str, Any]:
        choices = []
        tools = self.prompt.tools
        for index, out in enumerate(outputs):
            message: dict[str, Any] = {"role": "assistant", "content": out.text}
            finish = out.finish
            if tools is not None:  # the answer's calls read out of its text
                parsed = tools.parse(out.text)
                message = {"role": "assistant", **message_fields(parsed)}
                finish = "tool_calls" if parsed.calls and finish == "stop" else finish
            choice: dict[str, Any] = {
                "index": index + self.first_index,
                "message": message,
                "logprobs": self._chat_logprobs(out.logprobs),
                "finish_reason": finish,
            }
            if self.body.return_token_ids:
                choice["token_ids"] = out.token_ids
            choices.append(choice)
        body: dict[str, Any] = {
            "id": self.id, "object": "chat.completion", "created": self.created,
            "model": self.model, "choices": choices, "usage": self.usage(),
        }  # fmt: skip
        if self.body.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs()
        if self.body.return_token_ids:
            body["prompt_token_ids"] = list(self.prompt.token_ids)
        return body

    def _chat_logprobs(
        self, logprobs: list[TokenLogprobs] | tuple[TokenLogprobs, ...]
    ) -> dict[str, Any] | None:
        if self.k is None:
            return None
        return {"content": chat_logprobs(logprobs, self.names, self.k)}

    # Streams.

    def sse(self, chunks: Callable[[], AsyncIterator[dict[str, Any]]]) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks():
                    if self.continuous_usage:
                        chunk["usage"] = self.usage()
                    yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                if self.include_usage:
                    yield b"data: " + orjson.dumps(self._usage_chunk()) + b"\n\n"
            except ApiError as e:
                yield b"data: " + orjson.dumps(e.body()) + b"\n\n"
            finally:
                self.close()  # also on cancellation: the client went away
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
        chunk["usage"] = self.usage()
        return chunk

    async def _deltas(self) -> AsyncIterator[tuple[int, Delta, bool]]:
        """Every choice's deltas as they come: (index, delta, whether it is the choice's
        first). A choice's first delta is held until the first choice's first, which
        brings the prompt's log probabilities that every choice's first chunk may show."""
        queue: asyncio.Queue[tuple[int, Delta | None] | ApiError] = asyncio.Queue()

        async def pump(index: int, generation: Generation) -> None:
            try:
                async for delta in generation.deltas():
                    queue.put_nowait((index, delta))
                queue.put_nowait((index, None))
            except ApiError as e:
                queue.put_nowait(e)

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(self.generations)]
        held: dict[int, list[Delta]] = {}
        started: set[int] = set()
        prompt_ready = self.prompt_k is None
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if isinstance(item, ApiError):
                    raise item
                index, delta = item
                if delta is None:
                    running -= 1
                    continue
                if not prompt_ready and index != 0:
                    held.setdefault(index, []).append(delta)
                    continue
                yield index, delta, index not in started
                started.add(index)
                if not prompt_ready:
                    prompt_ready = True
                    for other, deltas in held.items():
                        for i, waiting in enumerate(deltas):
                            yield other, waiting, i == 0
                        started.add(other)
                    held.clear()
        finally:
            for task in tasks:
                task.cancel()

    async def completion_chunks(self) -> AsyncIterator[dict[str, Any]]:
        async for index, delta, first in self._deltas():
            text = self.prompt_text + delta.text if first else delta.text
            choice = self._choice(index, delta, {"text": text})
            choice["logprobs"] = self._completion_logprobs(index, delta.logprobs, first)
            if first and self.body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs()
            if first and self.body.return_token_ids:
                choice["prompt_token_ids"] = list(self.prompt.token_ids)
            yield self._chunk("text_completion", choice)

    async def chat_chunks(self) -> AsyncIterator[dict[str, Any]]:
        opening = {"role": "assistant", "content": ""}
        for index in range(len(self.generations)):
            head = self._chunk(
                "chat.completion.chunk", self._choice(index, None, {"delta": opening})
            )
            if index + self.first_index == 0 and self.body.return_token_ids:
                head["prompt_token_ids"] = list(self.prompt.token_ids)
            yield head
        tools = self.prompt.tools
        streams = {i: ToolStream(tools) for i in range(len(self.generations))} if tools else {}
        async for index, delta, first in self._deltas():
            stream = streams.get(index)
            if stream is not None:  # calls and their arguments as the model writes them
                pieces = stream.take(delta.text, delta.finish_reason is not None) or [{}]
            else:
                pieces = [{"content": delta.text} if delta.text else {}]
            for i, piece in enumerate(pieces):
                final = i == len(pieces) - 1  # the delta's finish and logprobs go last
                choice = self._choice(index, delta if final else None, {"delta": piece})
                if final:
                    choice["logprobs"] = self._chat_logprobs(delta.logprobs)
                    if stream is not None and stream.called and delta.finish_reason == "stop":
                        choice["finish_reason"] = "tool_calls"
                chunk = self._chunk("chat.completion.chunk", choice)
                if (
                    first
                    and i == 0
                    and index + self.first_index == 0
                    and self.body.prompt_logprobs is not None
                ):
                    chunk["prompt_logprobs"] = self._prompt_logprobs()
                yield chunk

    def _choice(self, index: int, delta: Delta | None, fields: dict[str, Any]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index + self.first_index, **fields, "logprobs": None}
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
