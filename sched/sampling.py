"""How one request's output is sampled: :class:`SamplingParams`, validated once, here.

One type across the client seam: the HTTP front end and ``Client`` build it, a workload
line is parsed into it, it travels inside the client's ``Submit`` and, once per
sequence, inside the step plan's first piece of it (``ringfence.sched.ops.Opening``), so
the Worker keeps it (with the sequence's token counts) instead of being sent it every
step. A new sampling knob is a field here, its use in the Worker's sampler, and its name
in the HTTP schema.

Pure: no tensors, no I/O. Every check raises :class:`RequestError` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ringfence.sched.checks import RequestError, check_number, check_token_ids, is_int
from ringfence.sched.structured import StructuredOutput

MAX_LOGPROBS = 20  # most alternatives a token's logprobs may list (OpenAI's limit)
LOGIT_BIAS_LIMIT = 100.0  # biases are clamped to +-this, as OpenAI and vLLM do
LOGPROB_FLOOR = -9999.0  # a -inf log probability as sent (JSON has no infinity): vLLM's value


def _check_int(field: str, value: object, *, minimum: int, maximum: int | None = None) -> int:
    if not is_int(value):
        raise RequestError(f"{field} must be an int, got {value!r}", field=field)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise RequestError(f"{field} must be {bound}, got {value}", field=field)
    return value


def _check_range(
    field: str, value: object, low: float, high: float, *, open_low: bool = False
) -> float:
    """``value`` as a float in [low, high] ((low, high] with ``open_low``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{field} must be a number, got {value!r}", field=field)
    inside = (low < value if open_low else low <= value) and value <= high  # NaN: False
    if not inside:
        left = "(" if open_low else "["
        raise RequestError(
            f"{field} must be in {left}{low:g}, {high:g}], got {value!r}", field=field
        )
    return float(value)


def _check_logprobs(field: str, value: object) -> int | None:
    if value is None:
        return None
    return _check_int(field, value, minimum=0, maximum=MAX_LOGPROBS)


def _check_bias(value: object) -> tuple[tuple[int, float], ...]:
    """Token id -> bias (a mapping, or pairs) as sorted pairs, each bias clamped to
    +-LOGIT_BIAS_LIMIT; keys may be ints or decimal strings (JSON object keys)."""
    items: Any = value.items() if isinstance(value, Mapping) else value
    if not isinstance(items, list | tuple) and not isinstance(value, Mapping):
        raise RequestError(
            f"logit_bias must map token ids to numbers, got {value!r}", field="logit_bias"
        )
    out: dict[int, float] = {}
    for pair in items:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise RequestError(f"logit_bias entry {pair!r} is not a pair", field="logit_bias")
        key, bias = pair
        token = int(key) if isinstance(key, str) and key.isdecimal() else key
        if not is_int(token) or token < 0:
            raise RequestError(
                f"logit_bias key {key!r} is not a non-negative token id", field="logit_bias"
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            raise RequestError(
                f"logit_bias[{token}] must be a finite number, got {bias!r}", field="logit_bias"
            )
        out[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(bias)))
    return tuple(sorted(out.items()))


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to sample one request's output. Immutable, so requests may share one instance.

    The order the Worker applies them in is vLLM's: the structured output's grammar mask
    (``structured``: tokens its grammar forbids get -inf), then logit_bias and the min_tokens mask,
    then the penalties, on the raw logits; then temperature, min_p, top_k and top_p; then
    a draw seeded by (seed, position). Log probabilities are of the raw logits by default
    (vLLM's ``raw_logprobs``); ``model.logprobs_mode = "processed_logprobs"`` gives those of
    the distribution the token was drawn from instead.
    """

    max_tokens: int = 16  # output tokens at most; reaching it finishes with "length"
    min_tokens: int = 0  # stop tokens cannot be sampled before this many output tokens
    temperature: float = 0.0  # 0: greedy; > 0: seeded random sampling
    top_p: float = 1.0  # in (0, 1]: sample from the nucleus of this much probability
    top_k: int = 0  # > 0: sample among the k most probable tokens only; 0: all
    min_p: float = 0.0  # drop tokens less probable than min_p times the most probable
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from each output token seen
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # in (0, 2]: divides (multiplies if < 0) seen tokens' logits
    seed: int = 0  # sampling is seeded per request and position, so replays agree
    stop_token_ids: tuple[int, ...] = ()  # sampling one of these finishes with "stop"
    ignore_eos: bool = False  # do not stop at the model's end-of-sequence tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    logprobs: int | None = None  # None: none; k: the sampled token's and k alternatives'
    prompt_logprobs: int | None = None  # the same for each prompt token (the first: none)
    structured: StructuredOutput | None = None  # the grammar the output follows (issue 38)

    def __post_init__(self) -> None:
        # frozen, so normalise through object.__setattr__: an int temperature to a float,
        # a caller's list to the tuple the field promises.
        put = object.__setattr__
        put(self, "max_tokens", _check_int("max_tokens", self.max_tokens, minimum=1))
        put(self, "min_tokens", _check_int("min_tokens", self.min_tokens, minimum=0))
        if self.min_tokens > self.max_tokens:
            raise RequestError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
                field="min_tokens",
            )
        put(self, "temperature", check_number("temperature", self.temperature))
        put(self, "top_p", _check_range("top_p", self.top_p, 0.0, 1.0, open_low=True))
        put(self, "top_k", _check_int("top_k", self.top_k, minimum=0))
        put(self, "min_p", _check_range("min_p", self.min_p, 0.0, 1.0))
        for name in ("presence_penalty", "frequency_penalty"):
            put(self, name, _check_range(name, getattr(self, name), -2.0, 2.0))
        put(self, "repetition_penalty", _check_range(
            "repetition_penalty", self.repetition_penalty, 0.0, 2.0, open_low=True))  # fmt: skip
        put(self, "seed", _check_int("seed", self.seed, minimum=0))
        put(self, "stop_token_ids", check_token_ids("stop_token_ids", self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(
                f"ignore_eos must be true or false, got {self.ignore_eos!r}", field="ignore_eos"
            )
        put(self, "logit_bias", _check_bias(self.logit_bias))
        put(self, "logprobs", _check_logprobs("logprobs", self.logprobs))
        put(self, "prompt_logprobs", _check_logprobs("prompt_logprobs", self.prompt_logprobs))
        put(self, "structured", StructuredOutput.of(self.structured))

    @property
    def needs_counts(self) -> bool:
        """A penalty reads how often each token occurred: the Worker keeps counts for it."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def needs_history(self) -> bool:
        """The Worker must see every token before a sequence's first piece (its Opening's
        ``history``): a penalty counts them, a grammar's matcher replays the output's."""
        return self.needs_counts or self.structured is not None

    @property
    def processes_logits(self) -> bool:
        """Anything beyond temperature and top_p touches the logits before the draw."""
        return bool(
            self.needs_counts or self.logit_bias or self.min_tokens or self.top_k or self.min_p
        )

    def check_vocab(self, vocab_size: int) -> None:
        """RequestError naming the field if a token id it names lies outside the vocabulary."""
        for token, _ in self.logit_bias:
            if token >= vocab_size:
                raise RequestError(
                    f"logit_bias key {token} is outside the vocabulary (size {vocab_size})",
                    field="logit_bias",
                )
        for token in self.stop_token_ids:
            if token >= vocab_size:
                raise RequestError(
                    f"stop_token_ids holds {token}, outside the vocabulary (size {vocab_size})",
                    field="stop_token_ids",
                )


SAMPLING_KEYS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))
"""Every field of SamplingParams: the keys a workload line or a Client call may give."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLogprobs:
    """One token's log probability and the most probable alternatives at its position,
    in descending order (ties by the lower id). Infinitely unlikely is LOGPROB_FLOOR."""

    token_id: int
    logprob: float
    rank: int = 1  # 1 + how many tokens were more probable
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), at most the k asked for
