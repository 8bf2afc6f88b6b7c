"""An API request's :class:`~ringfence.sched.sampling.SamplingParams`, built in one place.

The request's schema (:mod:`.api`) types and bounds each field; ``SamplingParams`` checks
them again, with what depends on several fields (``min_tokens`` <= the max tokens) and on
the model (``logit_bias`` keys inside its vocabulary). A new sampling knob is a field of
``SamplingParams``, its use in the Worker's sampler, its field in the schema and its line
here.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any, cast

from ringfence.actors.http.errors import ApiError
from ringfence.actors.serve.api import ChatCompletionRequest, CompletionRequest
from ringfence.actors.serve.prompts import Prompt
from ringfence.sched.checks import RequestError
from ringfence.sched.sampling import SamplingParams


def choice_seed(seed: int | None, index: int) -> int:
    """The seed of choice ``index``: ``seed`` itself for the first (n = 1 answers as before),
    a hash of (seed, index) for the others, so that seeded choices differ and repeat; a
    fresh one without ``seed``."""
    if seed is None:
        return secrets.randbits(63)
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def output_logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many alternatives each output token's log probabilities list (None: none)."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    return (body.top_logprobs or 0) if body.logprobs else None


def asked_prompt_logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Alternatives per prompt token the answer shows: vLLM's ``prompt_logprobs``, and
    ``logprobs`` with ``echo`` (the larger; None: none)."""
    asked = [body.prompt_logprobs]
    if isinstance(body, CompletionRequest) and body.echo:
        asked.append(body.logprobs)
    values = [k for k in asked if k is not None]
    return max(values) if values else None


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest, prompt: Prompt, vocab_size: int,
    index: int = 0,
) -> SamplingParams:  # fmt: skip
    """Choice ``index``'s sampling parameters; ApiError 400 naming the field at fault.

    vLLM's conventions become ours: ``top_k`` -1 is off (0), no ``seed`` is a fresh one.
    The prompt's log probabilities are asked of the first choice only (they are the same
    for all). ``max_tokens`` 0 (echo) runs one token, which the answer drops. Each choice
    carries the prompt's structured output (checked with it), so each keeps its own matcher.
    """
    try:
        params = SamplingParams(
            max_tokens=max(prompt.max_tokens, 1),
            min_tokens=body.min_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            seed=choice_seed(body.seed, index),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            # JSON's string keys: SamplingParams parses them (and names a bad one).
            logit_bias=cast(Any, body.logit_bias or {}),
            logprobs=output_logprobs(body),
            prompt_logprobs=asked_prompt_logprobs(body) if index == 0 else None,
            structured=prompt.structured,
        )
        params.check_vocab(vocab_size)
    except RequestError as e:
        said, field = str(e), e.field or ""
        said = said[len(field) :].lstrip() if field and said.startswith(field) else said
        raise ApiError(f"{field}: {said}" if field else said, param=e.field) from None
    return params
