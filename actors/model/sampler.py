"""The batched sampler: every knob of a step's rows as tensor ops on the logits' device.

One step's sampled rows are a ``[rows, vocab]`` float64 tensor and per-row parameter
tensors (:class:`Knobs`, built on the host once per step and moved in one copy by
``actors/executors/knobs.py``); no Python loop runs over the rows here. The definition
every op follows is the one-row reference, ``reference_sampling.sample`` (temperature, min_p, top_k,
top_p, then an inverse-CDF draw in id order with one uniform per row from ``draws.py``),
and ``actors/executors/sampling.py``'s ``processed`` (logit_bias, the min_tokens mask, the
penalties, in vLLM's order): on the CPU this module equals them bit for bit (the per-row
softmax, cumsum and log_softmax of a batch are those of one row); on a GPU a draw can
differ only where u lands within rounding of a CDF boundary (~1e-16).

Why float64, and one uniform per row: so that a CPU and a GPU draw the same token from
the same logits (``draws.py`` says why not ``torch.multinomial``). Why no renormalising
between min_p, top_k and top_p (vLLM renormalises): each knob only zeroes probabilities,
so one stable sort of the softmax ranks them for top_k and top_p alike, and the kept
tokens are a prefix of that ranking.

The fast paths, as vLLM has them: an all-greedy step is one argmax (no softmax, no draw);
a step where no row has top_k or top_p sorts nothing; a step without penalties gathers no
counts; top logprobs are ranked only for the rows asking for them, and a token's rank only
for the rows whose logprobs the knobs can change or who asked.

Stateless functions; every tensor they return is new (the inputs are not changed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ringfence.actors.model.draws import uniforms


@dataclass(frozen=True, slots=True, kw_only=True)
class Knobs:
    """One step's per-row parameters, on the logits' device, and what the host knows of
    them to skip work. Rows are those of the step's sampled logits, in order."""

    temperature: Tensor  # [rows] float64; 0: greedy
    top_p: Tensor  # [rows] float64; 1: no nucleus
    min_p: Tensor  # [rows] float64; 0: none
    top_k: Tensor  # [rows] int64; the vocabulary size where a row keeps every token
    seed: Tensor  # [rows] int64: each row's seed and position, modulo 2**64 (draws.py)
    position: Tensor  # [rows] int64
    repetition: Tensor  # [rows] float64; 1: none
    frequency: Tensor  # [rows] float64
    presence: Tensor  # [rows] float64
    slot: Tensor  # [rows] int64: the row of the device counts (0: the empty slot)
    bias_rows: Tensor  # [entries] int64: logit_bias, as (row, token, value) columns
    bias_tokens: Tensor  # [entries] int64
    bias_values: Tensor  # [entries] float64
    ban_rows: Tensor  # [entries] int64: stop tokens held off by min_tokens, (row, token)
    ban_tokens: Tensor  # [entries] int64
    mask_rows: Tensor  # [c] int64: the rows a grammar constrains
    mask_words: Tensor  # [c] int64: each one's row of the step's grammar bitmask
    rank_rows: Tensor  # [n] int64: rows whose token's rank is computed (asked, or processed)
    asked: Tensor  # [n] bool: of rank_rows, those that asked for logprobs
    top_rows: Tensor  # [m] int64: rows that asked for k > 0 top logprobs
    top_k_logprobs: int  # the most any of top_rows asked for (0: none did)
    any_random: bool  # a row has temperature > 0
    any_min_p: bool
    any_sort: bool  # a random row has top_k or top_p
    top_k_bound: int  # every such row has a top_k, this the largest (0: some has none)
    any_penalty: bool  # a row has a penalty: the counts are read
    any_processed: bool  # a row has any knob touching the logits


def masked_rows(logits: Tensor, rows: Tensor, bits: Tensor) -> Tensor:
    """``logits`` [rows, vocab] with -inf at every token the bitmask ``bits`` [len(rows),
    words] (int32, bit j of word w allows token 32 w + j) forbids in row ``rows[i]``, and
    past the mask's end. The bits are unpacked with shifts (``& 1`` undoes the arithmetic
    shift's copied sign bit)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:  # the model has rows past the tokenizer's tokens
        allowed = torch.cat([allowed, allowed.new_zeros(len(rows), vocab - allowed.shape[1])], 1)
    chosen = logits.index_select(0, rows)
    return logits.index_copy(0, rows, torch.where(allowed[:, :vocab], chosen, -torch.inf))


def processed_rows(
    raw: Tensor,
    knobs: Knobs,
    counts: Tensor | None,
    seen: Tensor | None,
    *,
    dense: bool | None = None,
) -> Tensor:
    """The logits each row draws from: logit_bias, the min_tokens mask, the repetition
    penalty over ``seen`` [rows, vocab] (bool: prompt or output) and the frequency and
    presence penalties over ``counts`` [rows, vocab] (the output's), in that order.
    ``dense``: the penalties over whole rows (by default on CUDA), else over the seen
    tokens only; the two agree bit for bit."""
    x = raw.clone()
    if knobs.bias_rows.numel():
        at = (knobs.bias_rows, knobs.bias_tokens)
        x.index_put_(at, x[at] + knobs.bias_values)
    if knobs.ban_rows.numel():
        x.index_put_((knobs.ban_rows, knobs.ban_tokens), x.new_full((), -torch.inf))  # no copy
    if knobs.any_penalty and counts is not None and seen is not None:
        rp, fp, pp = knobs.repetition, knobs.frequency, knobs.presence
        if x.is_cuda if dense is None else dense:  # on CUDA a few passes cost less than a sync
            x = _penalised(x, seen, counts, rp=rp[:, None], fp=fp[:, None], pp=pp[:, None])
        else:  # only the seen tokens (every output token is one): a few hundred a row
            rows, tokens = torch.nonzero(seen, as_tuple=True)
            at = (rows, tokens)
            found = _penalised(x[at], seen[at], counts[at], rp=rp[rows], fp=fp[rows], pp=pp[rows])
            x.index_put_(at, found)
    return x


def _penalised(
    x: Tensor, seen: Tensor, counts: Tensor, *, rp: Tensor, fp: Tensor, pp: Tensor
) -> Tensor:
    """``x`` with the repetition penalty where ``seen`` and the frequency and presence
    penalties where ``counts`` > 0: the same arithmetic, element for element, however the
    elements were gathered (so the sparse and the dense forms agree bit for bit)."""
    x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    return torch.where(counts > 0, x - (fp * counts.to(torch.float64) + pp), x)


def choose(logits: Tensor, knobs: Knobs) -> Tensor:
    """The token [rows] int64 of each row of ``logits`` [rows, vocab] float64: the first
    maximum at temperature 0, else ``reference_sampling.sample``'s draw."""
    greedy = torch.argmax(logits, dim=-1)
    if not knobs.any_random:
        return greedy
    hot = knobs.temperature > 0
    scale = torch.where(hot, knobs.temperature, 1.0).unsqueeze(1)
    probs = torch.softmax(logits / scale, dim=-1)
    if knobs.any_min_p:  # min_p 0 keeps every row as it is: probabilities are >= 0
        floor = knobs.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = torch.where(probs >= floor, probs, 0.0)
    if knobs.any_sort:
        probs = _top_k_top_p(probs, knobs)
    running = torch.cumsum(probs, dim=-1)
    total = running[:, -1:]
    u = uniforms(knobs.seed, knobs.position).unsqueeze(1)  # only where a row draws
    threshold = torch.minimum(u * total, torch.nextafter(total, total * 0))
    drawn = torch.searchsorted(running, threshold, right=True).squeeze(1)
    # A NaN row (reported as non-finite by the caller) must still index inside the row.
    drawn = drawn.clamp_(max=logits.shape[1] - 1)
    return torch.where(hot, drawn, greedy)


def _top_k_top_p(probs: Tensor, knobs: Knobs) -> Tensor:
    """``probs`` with what top_k and top_p drop zeroed: a stable ranking of the row (ties
    by the lower id), of which top_k keeps a prefix and the nucleus a prefix of that, where
    the mass ranked above a token is below top_p times the whole (``reference_sampling.nucleus``).

    Where every ranked row has a top_k, only the first ``top_k_bound`` of the ranking are
    needed (:func:`stable_top`, no sort of the row); else one stable sort ranks it all. The
    kept values, their order and so their sums are the same either way.
    """
    bound = knobs.top_k_bound
    if bound:
        order, ordered = stable_top(probs, min(bound, probs.shape[1]))
    else:
        ordered, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    ranks = torch.arange(ordered.shape[1], device=probs.device)
    ordered = torch.where(ranks < knobs.top_k.unsqueeze(1), ordered, 0.0)
    running = torch.cumsum(ordered, dim=-1)
    before = torch.cat([running.new_zeros(len(running), 1), running[:, :-1]], dim=1)
    top_p = knobs.top_p.unsqueeze(1)
    inside = (before < top_p * running[:, -1:]) | (top_p >= 1.0)
    kept = torch.zeros_like(probs).scatter_(1, order, torch.where(inside, ordered, 0.0))
    if not bound:
        return kept  # a row that ranks nothing got its own values back
    ranking = (knobs.top_k < probs.shape[1]) | (knobs.top_p < 1.0)
    return torch.where(ranking.unsqueeze(1), kept, probs)


@dataclass(frozen=True, slots=True, kw_only=True)
class Logprobs:
    """The log probabilities a step's rows report, on the device."""

    chosen: Tensor  # [rows] float64: the token's log probability
    rank: Tensor  # [rows] int64: 1 + how many tokens were more probable (1 where not asked)
    top_ids: Tensor  # [len(top_rows), k] int64: the k most probable, ties by the lower id
    top_values: Tensor  # [len(top_rows), k] float64


def logprobs_of(source: Tensor, tokens: Tensor, knobs: Knobs, keep_rank: Tensor) -> Logprobs:
    """log_softmax(``source``) at each row's token, the token's rank for ``rank_rows`` where
    ``keep_rank`` (bool [len(rank_rows)]) holds (else 1), and the top logprobs of
    ``top_rows`` (``knobs.top_k_logprobs`` of them: a row asking fewer takes a prefix)."""
    lsm = torch.log_softmax(source, dim=-1)
    chosen = lsm.gather(1, tokens.unsqueeze(1))
    rank = torch.ones_like(tokens)
    if knobs.rank_rows.numel():
        rows = lsm.index_select(0, knobs.rank_rows)
        above = (rows > chosen.index_select(0, knobs.rank_rows)).sum(dim=-1)
        rank = rank.index_copy(0, knobs.rank_rows, torch.where(keep_rank, 1 + above, 1))
    k = min(knobs.top_k_logprobs, source.shape[1])
    if not k or not knobs.top_rows.numel():
        empty = tokens.new_zeros(0, 0)
        values = empty.to(torch.float64)
        return Logprobs(chosen=chosen.squeeze(1), rank=rank, top_ids=empty, top_values=values)
    ids, values = stable_top(lsm.index_select(0, knobs.top_rows), k)
    return Logprobs(chosen=chosen.squeeze(1), rank=rank, top_ids=ids, top_values=values)


def stable_top(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ids and values [rows, k] of the k largest of each row of ``x``, in descending
    order with ties by the lower id: the first k of a stable descending sort, without
    sorting the row. Every value above the k-th largest is in; of those equal to it, the
    lowest ids fill the rest; the k chosen, taken in id order, are then sorted stably."""
    kth = torch.topk(x, k, dim=-1).values[:, -1:]
    above = x > kth
    ties = x == kth
    room = k - above.sum(dim=-1, keepdim=True)
    picked = above | (ties & (torch.cumsum(ties, dim=-1) <= room))
    ids = torch.arange(x.shape[1], device=x.device).expand_as(x)
    key = torch.where(picked, ids, ids + x.shape[1])  # the picked first, each in id order
    in_id_order = torch.topk(key, k, dim=-1, largest=False, sorted=True).indices
    values = x.gather(1, in_id_order)
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return in_id_order.gather(1, order), values


def sample_rows(
    x: Tensor,
    knobs: Knobs,
    *,
    bits: Tensor | None,
    counts: Tensor | None,
    seen: Tensor | None,
    raw_logprobs: bool,
) -> tuple[Tensor, int]:
    """A step's sampling, as one float64 tensor on the device to copy back once, and the
    top logprobs' width k: tokens, logprobs, ranks and non-finite flags ([rows] each), then
    each of ``top_rows``' k (id, logprob) pairs. ``x`` [rows, vocab] float64; ``bits`` the
    step's grammar bitmask (None: no row constrained); ``counts`` and ``seen`` the rows'
    counts (None: no penalty); ``raw_logprobs``: logprobs of the raw logits, else of those
    drawn from."""
    # A row's sum is finite exactly when each of its values is (a model's float32 or
    # bfloat16 logits cannot overflow a float64 sum), and costs a tenth of isfinite.
    bad = ~torch.isfinite(x.sum(dim=-1))
    raw = x if bits is None else masked_rows(x, knobs.mask_rows, bits[knobs.mask_words])
    logits, fallback = raw, None
    if knobs.any_processed:
        logits = processed_rows(raw, knobs, counts, seen)
        if bits is not None:
            # The knobs forbade every token the grammar allows (min_tokens holding off
            # the end it allows alone): the grammar wins, so the output stays valid.
            constrained = torch.zeros_like(bad).index_fill_(0, knobs.mask_rows, True)
            fallback = constrained & ~torch.isfinite(logits).any(dim=-1)
            logits = torch.where(fallback.unsqueeze(1), raw, logits)
    tokens = choose(logits, knobs)
    # A row whose knobs its grammar overruled reports as a row without knobs: rank 1
    # unless it asked for logprobs.
    keep = torch.ones_like(knobs.asked)
    if fallback is not None:
        keep = knobs.asked | ~fallback.index_select(0, knobs.rank_rows)
    lp = logprobs_of(raw if raw_logprobs else logits, tokens, knobs, keep)
    parts = [tokens.to(torch.float64), lp.chosen, lp.rank.to(torch.float64), bad.to(torch.float64)]
    k = lp.top_ids.shape[1]
    if lp.top_ids.numel():
        parts.append(torch.stack([lp.top_ids.to(torch.float64), lp.top_values], 1).flatten())
    return torch.cat(parts), k
