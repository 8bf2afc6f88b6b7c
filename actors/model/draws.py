"""The one uniform a seeded draw uses: u(seed, position) in [0, 1), the same on every device.

A draw at temperature > 0 is inverse-CDF sampling in vocabulary-id order with ONE uniform
per row (``reference_sampling.sample`` defines it; ``sampler.py`` batches it). The uniform
comes from a counter-based integer hash, so it needs no generator state and no host work
per row:

    mix64(z)   = splitmix64's finaliser over 64-bit words (wrapping arithmetic):
                 z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB;
                 z ^= z >> 31
    u(s, p)    = (mix64(mix64(s) + (p + 1) * 0x9E3779B97F4A7C15) >> 11) * 2**-53

with s and p taken modulo 2**64 (u is splitmix64's output number p + 1 from the state
mix64(s)). Integer ops are exact, so :func:`uniforms` (int64 tensor ops, on any device)
equals :func:`uniform` (Python ints) bit for bit, and the 53 bits give a float64 exactly.
Two details of the tensor form: torch's ``>>`` on int64 is arithmetic, so every shift is
masked to act as a logical one; products and sums wrap modulo 2**64 as the definition
wants (int64 is stored as two's complement, so only the reading as signed differs).

Why not ``torch.multinomial`` with a seeded ``torch.Generator`` (what the sampler drew
with before): its one-sample draw races vocab-many exponentials from a CPU Mersenne
Twister per row, which a GPU cannot reproduce, and generating them on the host costs more
than the whole step's sampling is allowed to.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: 2**64 / the golden ratio, odd
MIX1 = 0xBF58476D1CE4E5B9  # Stafford's "mix13" multipliers, splitmix64's finaliser
MIX2 = 0x94D049BB133111EB
UNIT = 2.0**-53  # 53 random bits times this: a float64 in [0, 1), exactly


def mix64(z: int) -> int:
    """splitmix64's finaliser of a 64-bit word (Python ints, taken modulo 2**64)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """u(seed, position) in [0, 1): the uniform of the draw at ``position`` of a request
    seeded ``seed`` (any non-negative ints; both taken modulo 2**64)."""
    z = mix64((mix64(seed) + ((position + 1) & MASK64) * GOLDEN) & MASK64)
    return (z >> 11) * UNIT


def as_int64(value: int) -> int:
    """``value`` modulo 2**64 read as a signed 64-bit int: what an int64 tensor holds of it."""
    value &= MASK64
    return value - (1 << 64) if value >> 63 else value


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """A logical right shift of int64 words: torch's ``>>`` is arithmetic, so the sign
    bits it copies in are masked off."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * as_int64(MIX1)
    z = (z ^ _shr(z, 27)) * as_int64(MIX2)
    return z ^ _shr(z, 31)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """u of each (seed, position) pair, float64 on their device: int64 tensors of the same
    shape holding each value modulo 2**64 as :func:`as_int64` writes it."""
    if seeds.dtype != torch.int64 or positions.dtype != torch.int64:
        raise TypeError(f"seeds and positions must be int64, got {seeds.dtype}, {positions.dtype}")
    z = _mix(_mix(seeds) + (positions + 1) * as_int64(GOLDEN))
    return _shr(z, 11).to(torch.float64) * UNIT
