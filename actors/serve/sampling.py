"""An API request's :class:`~ringfence.sched.sampling.SamplingParams`, built in one place.

The request's schema (:mod:`.api`) types and bounds each field; ``SamplingParams`` checks
them again, with what depends on several fields (``min_tokens`` <= the max tokens) and on
the model (``logit_bias`` keys inside its vocabulary). A new sampling knob is a field of
``SamplingParams``, its use in the Worker's sampler, its field in the schema and its line
here.
"""

from __future__ import annotations

import secrets
from typing import Any, cast

from ringfence.actors.serve.api import ApiError, ChatCompletionRequest, CompletionRequest
from ringfence.actors.serve.prompts import Prompt
from ringfence.sched.checks import RequestError
from ringfence.sched.sampling import SamplingParams


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest, prompt: Prompt, vocab_size: int
) -> SamplingParams:
    """The request's sampling parameters; ApiError 400 naming the field at fault.

    vLLM's conventions become ours: ``top_k`` -1 is off (0), no ``seed`` is a fresh one.
    """
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    try:
        params = SamplingParams(
            max_tokens=prompt.max_tokens,
            min_tokens=body.min_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            seed=seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            # JSON's string keys: SamplingParams parses them (and names a bad one).
            logit_bias=cast(Any, body.logit_bias or {}),
        )
        params.check_vocab(vocab_size)
    except RequestError as e:
        said, field = str(e), e.field or ""
        said = said[len(field) :].lstrip() if field and said.startswith(field) else said
        raise ApiError(f"{field}: {said}" if field else said, param=e.field) from None
    return params
