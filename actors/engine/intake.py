"""Requests in: a workload's lines at their arrival times, and clients' Submits.

Each becomes the scheduler's :class:`Request`; a text prompt goes through the checkpoint's
tokenizer (bytes for the presets). Workload files are read here, not in the scheduler
(which does no I/O); ``ringfence launch`` checks one before a run exists
(:func:`check_workload`, a preflight check the engine's topology names).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from ringfence.actors.config import Config
from ringfence.actors.model.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from ringfence.actors.protocol.client import Submit
from ringfence.sched.request import Request, SamplingParams
from ringfence.sched.workload import WorkloadRequest, parse_workload, synthetic

Encode = Callable[[str], Sequence[int]]


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


def check_workload(config: Config) -> None:
    """ValueError naming the file and line when ``engine.workload`` cannot be read."""
    settings = config.engine
    if not settings.workload:
        return
    try:
        load_workload(settings.workload, seed=settings.seed)
    except OSError as e:
        raise ValueError(f"workload {settings.workload}: {e}") from None


def make_request(line: WorkloadRequest, encode: Encode | None = None) -> Request:
    """The scheduler's request of a workload line; a text prompt goes through ``encode``."""
    if line.prompt_token_ids is not None:
        tokens = tuple(line.prompt_token_ids)
    else:
        assert line.prompt is not None
        tokens = tuple((encode or ByteTokenizer().encode)(line.prompt))
    return Request(
        request_id=line.id, prompt_token_ids=tokens, params=line.params, arrival=line.arrival_s
    )


class Intake:
    """The engine's source of requests. Not thread-safe; owned by the Engine actor."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.workload: list[WorkloadRequest] = []  # sorted by arrival
        self.next = 0  # the workload's next line to arrive
        self._tokenizer: Tokenizer | None = None

    def load(self) -> None:
        """Read ``engine.workload`` (ValueError or OSError if it cannot be read)."""
        settings = self.config.engine
        requests = settings.requests or None
        self.workload = load_workload(settings.workload, seed=settings.seed, requests=requests)
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
        return make_request(line, self.encode)

    def submitted(self, msg: Submit, request_id: str, arrival: float) -> Request:
        """The request of a client's Submit, keyed ``request_id`` (RequestError if bad)."""
        params = SamplingParams(
            max_tokens=msg.max_tokens,
            temperature=msg.temperature,
            seed=msg.seed,
            stop_token_ids=msg.stop_token_ids,
        )
        tokens = msg.prompt_token_ids or tuple(self.encode(msg.prompt))
        return Request(
            request_id=request_id, prompt_token_ids=tokens, params=params, arrival=arrival
        )

    def encode(self, text: str) -> list[int]:
        """A text prompt's ids: the checkpoint's tokenizer, or bytes for the presets."""
        tokenizer = self._tokenizer
        if tokenizer is None:
            path = self.config.model.path
            tokenizer = (load_tokenizer(path) if path else None) or ByteTokenizer()
            self._tokenizer = tokenizer
        return tokenizer.encode(text)
