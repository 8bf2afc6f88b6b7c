"""The one-row sampler: the definition the batched sampler (``actors/model/sampler.py``) must
equal, token for token, and its parts (the nucleus, the inverse-CDF draw).

It samples one row of logits in float64 on the CPU, knob by knob, as the reference the
tests hold every device's batched draw to; no path of a run calls it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ringfence.actors.model.draws import uniform

__all__ = ["Sampled", "draw", "nucleus", "sample"]


class Sampled(NamedTuple):
    token_id: int  # the chosen token
    logprob: float  # log_softmax of the raw (unscaled) logits at token_id


def sample(
    logits: Tensor,
    *,
    temperature: float,
    seed: int,
    position: int,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
) -> Sampled:
    """Pick a token from logits [vocab]: the one-row reference the batched sampler
    (``actors/model/sampler.py``) must equal, token for token.

    Greedy (the first maximum) at temperature 0, whatever ``top_p``. Otherwise, in float64:
    the probabilities softmax(logits / temperature); ``min_p`` (> 0) zeroes those below
    min_p times the most probable; ``top_k`` (> 0) keeps the k most probable (ties by the
    lower id); below 1, ``top_p`` keeps the nucleus of what is left (:func:`nucleus`). Every
    knob only zeroes probabilities, never rescales them (vLLM renormalises between them:
    the same distribution, up to rounding), so the ranking is that of the softmax. The
    draw is :func:`draw` with u(seed, position) (``draws.py``): the same on every device,
    and a replayed step picks the same token. The reported logprob is always under the raw
    logits (temperature 1), so it does not depend on the sampling settings. ValueError
    naming the setting for a temperature below 0 or a top_p outside (0, 1].
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    wide = logits.detach().to(device="cpu", dtype=torch.float64)
    if temperature == 0:
        token = int(torch.argmax(wide))
    else:
        probs = torch.softmax(wide / temperature, dim=-1)
        if min_p > 0.0:
            probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
        if 0 < top_k < len(probs):
            _, order = torch.sort(probs, descending=True, stable=True)
            kept = torch.zeros_like(probs)
            kept[order[:top_k]] = probs[order[:top_k]]
            probs = kept
        if top_p < 1.0:  # at 1 the distribution is left as it is
            probs = nucleus(probs, top_p)
        token = draw(probs, uniform(seed, position))
    return Sampled(token, float(torch.log_softmax(wide, dim=-1)[token]))


def nucleus(probs: Tensor, top_p: float) -> Tensor:
    """``probs`` [vocab] (not necessarily summing to 1) with every token outside the
    nucleus zeroed; the others keep their values.

    The tokens are ranked by probability, ties by the lower id (a stable sort), and summed
    in that order; a token is in the nucleus when the sum of those ranked above it is below
    ``top_p`` times the whole sum (the last of those running sums), so the most probable
    token always is, and the nucleus is the smallest set holding top_p of the mass.
    """
    ordered, order = torch.sort(probs, descending=True, stable=True)
    running = torch.cumsum(ordered, dim=-1)
    before = torch.cat((running.new_zeros(1), running[:-1]))  # 0 for the first, exactly
    inside = order[before < top_p * running[-1]]
    kept = torch.zeros_like(probs)
    kept[inside] = probs[inside]
    return kept


def draw(weights: Tensor, u: float) -> int:
    """Inverse-CDF in id order: the first id whose running sum of ``weights`` [vocab]
    (non-negative, not all 0) exceeds u times the whole sum (the last running sum), or the
    largest float64 below it where that product rounds up to the whole. A token of weight
    0 is never drawn: the running sum does not rise at it."""
    running = torch.cumsum(weights, dim=-1)
    total = float(running[-1])
    threshold = min(u * total, math.nextafter(total, 0.0))
    return int(
        torch.searchsorted(running, torch.tensor([threshold], dtype=running.dtype), right=True)
    )
