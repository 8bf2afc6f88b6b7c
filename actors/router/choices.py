"""A request of ``n`` > 1 choices through prefill and decode instances: one claim a choice.

A reservation holds room for one request's decode and is claimed once, so each choice runs
as a request of its own on the decode instances: the client's body with ``n`` 1, and the
choice's index in ``X-Ringfence-Choice`` (the instance samples it with that choice's seed,
as ``ringfence serve`` seeds its own choices, numbers it so in its answer, and counts the
prompt in its metrics for the first choice alone). The first choice reserves and prefills;
then the others reserve (preferring the first's decode instance, which will hold the
prompt's blocks) and claim without a prefill of their own: the prompt's blocks are in the
shared tier by then. Their answers become one, as ``ringfence serve`` answers ``n``
choices (:class:`Merge`): the choices in index order, the usage counting the prompt once
and every choice's output; a stream's events relayed as they come, each under the first
event's id, with one usage chunk at the end (``include_usage``) and one ``[DONE]``.

The router counts the request once (the first choice's run logs and counts it; each run
logs its ``router.answered`` line under ``<request id>-<index>``). On the router's event
loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

import orjson
from starlette.responses import JSONResponse, Response

from ringfence.actors.http.errors import ApiError
from ringfence.actors.http.limits import MAX_N
from ringfence.actors.router.flow import Handover
from ringfence.actors.router.relay import DONE, EventRelay, is_event_stream, read_whole
from ringfence.actors.router.state import Router
from ringfence.actors.router.upstream import Stream, TransportError, describe


def choices_of(request: dict[str, Any]) -> int:
    """The ``n`` a request asks for, where the router splits it (2 to MAX_N); else 1 (a bad
    or too large ``n`` goes to the decode instance as is, which names it in its 400)."""
    n = request.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and 1 < n <= MAX_N:
        return n
    return 1


class Choices:
    """One request's ``n`` runs (as :class:`~.flow.Handover` to the app and the relay:
    :meth:`answer` once, then :meth:`finish` once)."""

    def __init__(
        self, router: Router, kind: str, body: bytes, request: dict[str, Any], request_id: str
    ) -> None:
        n = choices_of(request)
        one = request | {"n": 1}
        if one.get("best_of") == n:  # n candidates for n choices: one for one
            del one["best_of"]
        raw = orjson.dumps(one)
        self.id = request_id
        self.runs = [
            Handover(router, kind, raw, one, f"{request_id}-{i}" if i else request_id, choice=i)
            for i in range(n)
        ]
        self._finished = False

    async def run(self) -> list[Stream]:
        """Every choice's claimed answer (status 200, body unread), in index order; the
        errors of :meth:`.flow.Handover.run` (the first of any choice's)."""
        first, rest = self.runs[0], self.runs[1:]
        reservation = await first.reserve(prefer=await first.cached_decode())
        await first.prefill(reservation)
        later = [r.run(prefill=False, prefer=reservation.instance) for r in rest]
        return await _all([first.claimed(reservation), *later])

    async def answer(self) -> Response:
        """The client's answer: the merged event stream (not begun), or the merged JSON."""
        answers = await self.run()
        if all(is_event_stream(a) for a in answers):
            return MergedRelay(self, answers)
        merge = Merge(len(answers))
        for index, (run, answer) in enumerate(zip(self.runs, answers, strict=True)):
            whole = await read_whole(run, answer)
            if whole.status_code != 200:
                return whole
            merge.body(index, bytes(whole.body))
        return JSONResponse(merge.whole())

    # The relay calls these.

    def first_byte(self) -> None:
        """Each run times its own first byte (:class:`MergedRelay`)."""

    def decode_failed(self, error: str) -> ApiError:
        return self.runs[0].decode_failed(error)

    async def finish(self, outcome: str, status: int) -> None:
        """Finish every run (their answers closed, nothing in flight); counted once."""
        if self._finished:
            return
        self._finished = True
        for index, run in enumerate(self.runs):
            await run.finish(outcome, status, counted=index == 0)


async def _all(calls: Sequence[Awaitable[Stream]]) -> list[Stream]:
    """Every call's result; the first failure cancels the others (their handovers are
    finished by :meth:`Choices.finish`, which closes what they opened)."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Merge:
    """The choices' answers as one (see the module docstring). Pure; one request's."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.id: str | None = None  # the first event's, for every event
        self.usage: dict[int, dict[str, Any]] = {}  # each run's latest usage
        self.last_usage_chunk: dict[str, Any] | None = None  # held for the end
        self.bodies: dict[int, dict[str, Any]] = {}

    def merged_usage(self) -> dict[str, Any]:
        """The prompt once (the first choice's figures), every choice's output."""
        usages = [self.usage[i] for i in sorted(self.usage)]
        if not usages:
            return {}
        completion = sum(int(u.get("completion_tokens") or 0) for u in usages)
        prompt = int(usages[0].get("prompt_tokens") or 0)
        return usages[0] | {"completion_tokens": completion, "total_tokens": prompt + completion}

    def body(self, index: int, content: bytes) -> None:
        """Run ``index``'s whole answer."""
        body = orjson.loads(content)
        self.bodies[index] = body
        if isinstance(body.get("usage"), dict):
            self.usage[index] = body["usage"]

    def whole(self) -> dict[str, Any]:
        """The whole answer: the first's, with every run's choices in index order."""
        first = self.bodies[0]
        choices = [c for i in sorted(self.bodies) for c in self.bodies[i]["choices"]]
        choices.sort(key=lambda c: int(c.get("index", 0)))
        out = first | {"choices": choices}
        if self.usage:
            out["usage"] = self.merged_usage()
        return out

    def event(self, index: int, data: dict[str, Any]) -> dict[str, Any] | None:
        """One event of run ``index`` as the client gets it (None: held to the end)."""
        self.id = self.id or data.get("id")
        if self.id is not None and "id" in data:
            data["id"] = self.id
        usage = data.get("usage")
        if isinstance(usage, dict):
            self.usage[index] = usage
            if not data.get("choices"):  # include_usage's last chunk: one for all, at the end
                self.last_usage_chunk = data
                return None
            data["usage"] = self.merged_usage()  # continuous_usage_stats: the sum so far
        return data

    def end(self) -> dict[str, Any] | None:
        """The last chunk (the usage of every choice), if the runs sent theirs."""
        if self.last_usage_chunk is None:
            return None
        return self.last_usage_chunk | {"usage": self.merged_usage()}


class MergedRelay(EventRelay):
    """The runs' event streams for the client as one (:class:`Merge`), whole events only;
    a run's stream that breaks ends the answer as a broken stream does (``relay.py``)."""

    def __init__(self, choices: Choices, answers: list[Stream]) -> None:
        self.choices, self.answers = choices, answers
        super().__init__(choices, answers[0])

    async def _events(self) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[tuple[int, bytes | str | None]] = asyncio.Queue()

        async def read(index: int, answer: Stream) -> None:
            try:
                async for chunk in answer.chunks():
                    queue.put_nowait((index, chunk))
                queue.put_nowait((index, None))
            except TransportError as e:
                queue.put_nowait((index, describe(e)))

        tasks = [asyncio.ensure_future(read(i, a)) for i, a in enumerate(self.answers)]
        merge, runs = Merge(len(self.answers)), self.choices.runs
        pending = [b""] * len(self.answers)
        done, started = [False] * len(self.answers), [False] * len(self.answers)
        try:
            while not all(done):
                index, got = await queue.get()
                if got is None and done[index]:
                    continue  # its stream's end, after its [DONE]
                if got is None or isinstance(got, str):
                    why = got or "its stream ended before data: [DONE]"
                    self.outcome = "decode_failed"
                    failure = runs[index].decode_failed(why)
                    yield b"data: " + orjson.dumps(failure.body()) + b"\n\n" + DONE
                    return
                if not started[index]:
                    runs[index].first_byte()
                    started[index] = True
                pending[index] += got
                cut = pending[index].rfind(b"\n\n") + 2
                if cut < 2:
                    continue
                events, pending[index] = pending[index][:cut], pending[index][cut:]
                out: list[bytes] = []
                for event in events.split(b"\n\n")[:-1]:
                    data = event.removeprefix(b"data: ")
                    if data == b"[DONE]":
                        done[index] = True
                        continue
                    parsed = orjson.loads(data)
                    if "error" in parsed:  # the instance's own error event: the answer ends
                        self.outcome = "ok"
                        yield b"".join(out) + event + b"\n\n" + DONE
                        return
                    chunk = merge.event(index, parsed)
                    if chunk is not None:
                        out.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
                if out:
                    yield b"".join(out)
            last = merge.end()
            self.outcome = "ok"
            yield (b"" if last is None else b"data: " + orjson.dumps(last) + b"\n\n") + DONE
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
