"""Log probabilities on their way from a step's result to the request's ``Tokens``.

The Worker reports each sampled token's log probabilities with the token, and a prompt's
piece by piece (``StepResult.prompt_logprobs``); the engine files the prompt's on the
request, by position (a recomputed prompt reports them again: the first stays), and sends
them all with the request's first token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from ringfence.actors.protocol.worker import PromptLogprobs, SampledToken
from ringfence.sched.request import Request
from ringfence.sched.sampling import TokenLogprobs
from ringfence.sched.sequence import Emitted


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
    e: Emitted, sampled: Mapping[int, SampledToken]
) -> tuple[tuple[TokenLogprobs, ...], tuple[TokenLogprobs, ...]]:
    """The token's log probabilities, and on the request's first token its prompt's, each
    only when the request asked (then the prompt's are sent and forgotten)."""
    token: tuple[TokenLogprobs, ...] = ()
    if e.request.params.logprobs is not None:
        t = sampled[e.seq_id]
        token = (TokenLogprobs(token_id=t.token_id, logprob=t.logprob, rank=t.rank, top=t.top),)
    prompt: tuple[TokenLogprobs, ...] = ()
    if e.request.prompt_logprobs is not None:  # its first token: the prompt is done
        prompt = tuple(v for _, v in sorted(e.request.prompt_logprobs.items()))
        e.request.prompt_logprobs = None
    return token, prompt
