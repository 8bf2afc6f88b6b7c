"""One step's sampling parameters, built on the host and moved to the device in one copy.

A sequence's ``SamplingParams`` become a :class:`SeqKnobs` once, when it is opened; each
step, :func:`build_knobs` lays its sampled rows' knobs (and the sparse logit_bias and
min_tokens entries) out in one int64 buffer (float64 columns stored by their bits), copies
it to the device once (from pinned memory, without waiting, on CUDA) and slices it there
into the :class:`~ringfence.actors.model.sampler.Knobs` the batched sampler reads.

Pure functions of their arguments; owned by the Worker actor's thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ringfence.actors.model.draws import as_int64
from ringfence.actors.model.host import to_device
from ringfence.actors.model.sampler import Knobs
from ringfence.sched.sampling import SamplingParams

NUM_FLOATS = 6  # temperature, top_p, min_p, repetition, frequency, presence
NUM_INTS = 4  # seed, position, top_k, slot


@dataclass(frozen=True, slots=True, kw_only=True)
class SeqKnobs:
    """What one sequence's parameters put in each of its rows: computed once, at opening,
    so that a step reads plain fields (a step's host work is on the sampling path)."""

    floats: tuple[float, ...]  # the NUM_FLOATS float columns
    seed: int  # the seed modulo 2**64, as int64 holds it
    top_k: int  # the ranks kept: the vocabulary size when top_k keeps every token
    bias: tuple[tuple[int, float], ...]  # logit_bias
    stops: tuple[int, ...]  # the stop tokens min_tokens holds off ...
    stops_until: int  # ... at positions below this one (the output too short to stop)
    logprobs: int | None  # top logprobs asked (None: none)
    ranks: bool  # the token's rank is computed: logprobs asked, or the knobs touch the logits
    hot: bool  # temperature > 0: a draw
    min_p: bool  # a draw with min_p
    ranked: bool  # a draw ranks the row: top_k or top_p keeps fewer than every token
    top_k_kept: bool  # top_k keeps fewer than every token
    penalty: bool  # a penalty reads the counts
    processes: bool  # a knob touches the logits before the draw

    @classmethod
    def of(cls, params: SamplingParams, num_prompt_tokens: int, vocab_size: int) -> SeqKnobs:
        p = params
        floats = (p.temperature, p.top_p, p.min_p, p.repetition_penalty,
                  p.frequency_penalty, p.presence_penalty)  # fmt: skip
        top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
        hot = p.temperature > 0
        return cls(
            floats=floats, seed=as_int64(p.seed), top_k=top_k, bias=p.logit_bias,
            stops=p.stop_token_ids if p.min_tokens else (),
            stops_until=num_prompt_tokens + p.min_tokens, logprobs=p.logprobs,
            ranks=p.logprobs is not None or p.processes_logits, hot=hot,
            min_p=hot and p.min_p > 0, ranked=hot and (top_k < vocab_size or p.top_p < 1.0),
            top_k_kept=top_k < vocab_size,
            penalty=p.needs_counts, processes=p.processes_logits,
        )  # fmt: skip


def top_k_bound(knobs: Sequence[SeqKnobs]) -> int:
    """The largest top_k of the rows a draw ranks, where each has one (it bounds the
    ranking the sampler needs); 0 where one ranks by top_p alone, or none ranks."""
    ranked = [k for k in knobs if k.ranked]
    if not ranked or any(not k.top_k_kept for k in ranked):
        return 0
    return max(k.top_k for k in ranked)


def build_knobs(
    knobs: Sequence[SeqKnobs],
    positions: Sequence[int],
    slots: Sequence[int],
    device: torch.device,
    masked: Sequence[tuple[int, int]] = (),
) -> Knobs:
    """The step's :class:`Knobs` on ``device``, from one host-to-device copy: row j draws
    the token at ``positions[j]`` with ``knobs[j]``, its counts in ``slots[j]`` (0: none);
    ``masked``: (row, row of the step's grammar bitmask) of each row a grammar constrains."""
    floats: list[float] = []
    ints: list[int] = []
    bias: list[tuple[int, int]] = []
    bias_values: list[float] = []
    banned: list[tuple[int, int]] = []
    rank_rows: list[int] = []
    asked: list[int] = []
    top_rows: list[int] = []
    top = 0
    for j, k in enumerate(knobs):
        floats.extend(k.floats)
        ints.extend((k.seed, as_int64(positions[j]), k.top_k, slots[j]))
        for token, value in k.bias:
            bias.append((j, token))
            bias_values.append(value)
        if k.stops and positions[j] < k.stops_until:
            banned.extend((j, token) for token in k.stops)
        if k.ranks:
            rank_rows.append(j)
            asked.append(k.logprobs is not None)
        if k.logprobs:
            top_rows.append(j)
            top = max(top, k.logprobs)
    # One buffer: the float columns' bits, then every int column, each run's length known.
    parts = [
        torch.tensor(floats + bias_values, dtype=torch.float64).view(torch.int64),
        torch.tensor(ints, dtype=torch.int64),
        torch.tensor([r for r, _ in bias] + [t for _, t in bias], dtype=torch.int64),
        torch.tensor([r for r, _ in banned] + [t for _, t in banned], dtype=torch.int64),
        torch.tensor(rank_rows + asked + top_rows, dtype=torch.int64),
        torch.tensor([r for r, _ in masked] + [w for _, w in masked], dtype=torch.int64),
    ]
    buf = to_device(torch.cat(parts), device)
    n = len(knobs)
    cuts = [n * NUM_FLOATS, len(bias_values), n * NUM_INTS, 2 * len(bias), 2 * len(banned),
            len(rank_rows), len(asked), len(top_rows), 2 * len(masked)]  # fmt: skip
    f_bits, bv, i_flat, b, s, rr, ask, tr, m = torch.split(buf, cuts)
    f = f_bits.view(torch.float64).view(n, NUM_FLOATS)
    i = i_flat.view(n, NUM_INTS)
    return Knobs(
        temperature=f[:, 0], top_p=f[:, 1], min_p=f[:, 2], repetition=f[:, 3],
        frequency=f[:, 4], presence=f[:, 5], seed=i[:, 0], position=i[:, 1], top_k=i[:, 2],
        slot=i[:, 3], bias_rows=b[: len(bias)], bias_tokens=b[len(bias):],
        bias_values=bv.view(torch.float64), ban_rows=s[: len(banned)],
        ban_tokens=s[len(banned):], mask_rows=m[: len(masked)], mask_words=m[len(masked):],
        rank_rows=rr, asked=ask.bool(), top_rows=tr,
        top_k_logprobs=top, any_random=any(k.hot for k in knobs),
        any_min_p=any(k.min_p for k in knobs), any_sort=any(k.ranked for k in knobs),
        top_k_bound=top_k_bound(knobs),
        any_penalty=any(k.penalty for k in knobs), any_processed=any(k.processes for k in knobs),
    )  # fmt: skip
