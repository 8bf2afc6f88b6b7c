"""Requests out: where each request's tokens go, and what the run keeps of it.

A client's request streams its tokens to the client (through the :class:`ClientHub`) and
ends with its finish reason; a workload's request becomes a :class:`RequestRecord` of the
run report (``outputs.jsonl``), with the workload's progress on the terminal. Times are
seconds on the engine's clock (the one the caller gives).

Log probabilities travel with the tokens: the Worker reports each sampled token's with the
token, and a prompt's piece by piece (``StepResult.prompt_logprobs``); the engine files the
prompt's on the request, by position (a recomputed prompt reports them again: the first
stays), and sends them all with the request's first token (:func:`file_prompt_logprobs`,
:func:`emitted_logprobs`).

Owned by the Engine actor; writes only the run report, when asked.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringfence.actors.engine.clients import ClientHub, RequestKey
from ringfence.actors.engine.summary import Progress, RequestRecord, summarize, write_run_report
from ringfence.actors.protocol.worker import PromptLogprobs, Sampled
from ringfence.runtime.log import ActorLog
from ringfence.sched.request import Request
from ringfence.sched.sampling import TokenLogprobs
from ringfence.sched.sequence import Emitted


@dataclass(slots=True)
class _Times:
    request: Request
    key: RequestKey | None  # the client's key, None for a workload request
    arrival: float  # seconds since the engine's clock started
    first: float | None = None
    finish: float | None = None


class Outputs:
    """See the module docstring."""

    def __init__(self, clients: ClientHub, log: ActorLog, clock: Callable[[], float]) -> None:
        self.clients, self.log, self.now = clients, log, clock
        self.times: dict[str, _Times] = {}  # live requests
        self.records: list[RequestRecord] = []  # the workload's finished requests
        self.output_tokens = 0
        self.progress: Progress | None = None
        self.returning: frozenset[str] = frozenset()  # the workload's returning turns

    def arrived(self, request: Request, key: RequestKey | None, arrival: float) -> None:
        self.times[request.request_id] = _Times(request, key, arrival)

    def emitted(
        self,
        e: Emitted,
        *,
        hold: bool = False,
        logprobs: Sequence[TokenLogprobs] = (),
        prompt_logprobs: Sequence[TokenLogprobs] = (),
    ) -> None:
        """New tokens of a request (and its end, when it finished, unless ``hold``: the
        caller ends it later, with :meth:`finished`)."""
        rid, now = e.request.request_id, self.now()
        times = self.times[rid]
        first = times.first is None
        if first:
            times.first = now
        self.output_tokens += len(e.token_ids)
        if times.key is not None:
            self.clients.emit(
                times.key,
                e.token_ids,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                cached_tokens=dict(e.request.cached_tokens) if first else None,
                ttft_s=now - times.arrival if first else -1.0,
            )
        if e.finished and not hold:
            self.finished(rid, "")

    def finished(self, request_id: str, error: str, *, stored_blocks: int = -1) -> None:
        """A request ended: stopped, at its length, aborted, or failed with ``error``
        (``stored_blocks``: a prefill instance's hand-over, see ``Tokens``)."""
        times = self.times.pop(request_id)
        times.finish = self.now()
        request = times.request
        reason = str(request.finish_reason or "abort")
        self.log.info(
            "request.finish",
            request=request_id,
            reason=reason,
            output_tokens=request.num_output_tokens,
            cached_tokens=dict(request.cached_tokens),
            error=error,
            stored_blocks=stored_blocks,
        )
        if times.key is not None:
            self.clients.emit(
                times.key, finish_reason=reason, error=error, stored_blocks=stored_blocks
            )
            return
        self._record(request, tuple(request.output_token_ids), reason, error, times)
        self.show_progress()

    def refused(self, request: Request, arrival: float, error: str) -> None:
        """A workload request the scheduler refused: it ends at once, aborted with ``error``."""
        self.log.warning("request.refused", request=request.request_id, error=error)
        self._record(request, (), "abort", error, _Times(request, None, arrival, None, self.now()))

    def _record(
        self, request: Request, tokens: tuple[int, ...], reason: str, error: str, times: _Times
    ) -> None:
        self.records.append(
            RequestRecord(
                id=request.request_id,
                prompt_tokens=request.num_prompt_tokens,
                token_ids=tokens,
                finish_reason=reason,
                error=error,
                arrival_s=times.arrival,
                first_token_s=times.first,
                finish_s=times.finish,
                cached_tokens=dict(request.cached_tokens),
                returning=request.request_id in self.returning,
            )
        )

    def start_progress(self, total: int) -> None:
        self.progress = Progress(total, stream=sys.stderr)

    def show_progress(self) -> None:
        if self.progress is not None:
            self.progress.update(len(self.records), self.now(), tokens=self.output_tokens)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    def write_report(
        self, run_dir: Path, order: Mapping[str, int], engine: dict[str, Any]
    ) -> dict[str, Any]:
        """Write ``outputs.jsonl`` (records in workload ``order``) and ``summary.json``; the
        summary."""
        summary = summarize(self.records, duration_s=self.now(), engine=engine)
        records = sorted(self.records, key=lambda r: order[r.id])
        write_run_report(run_dir, records, summary)
        self.close()
        return summary


def file_prompt_logprobs(
    found: Iterable[PromptLogprobs],
    emitted: Sequence[Emitted],
    request_of: Callable[[int], Request | None],
) -> None:
    """File a step's prompt log probabilities on the requests that asked for them (call
    before the step's tokens are sent: the first Tokens carries them)."""
    # A request that finished on its first token has left the scheduler already.
    ended = {e.seq_id: e.request for e in emitted}
    for piece in found:
        request = ended.get(piece.seq_id) or request_of(piece.seq_id)
        if request is not None and request.prompt_logprobs is not None:
            for offset, entry in enumerate(piece.entries):
                request.prompt_logprobs.setdefault(piece.start + offset, entry)


def emitted_logprobs(
    e: Emitted, sampled: Sampled, rows: Mapping[int, int]
) -> tuple[tuple[TokenLogprobs, ...], tuple[TokenLogprobs, ...]]:
    """The token's log probabilities (row ``rows[seq_id]`` of the step's ``sampled``), and on
    the request's first token its prompt's, each only when the request asked (then the
    prompt's are sent and forgotten)."""
    token: tuple[TokenLogprobs, ...] = ()
    if e.request.params.logprobs is not None:
        row = rows[e.seq_id]
        token = (
            TokenLogprobs(
                token_id=sampled.token_ids[row],
                logprob=sampled.logprobs[row],
                rank=sampled.ranks[row],
                top=sampled.tops[row],
            ),
        )
    prompt: tuple[TokenLogprobs, ...] = ()
    if e.request.prompt_logprobs is not None:  # its first token: the prompt is done
        prompt = tuple(v for _, v in sorted(e.request.prompt_logprobs.items()))
        e.request.prompt_logprobs = None
    return token, prompt
