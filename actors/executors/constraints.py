"""The grammar masks of a step's constrained rows, computed beside the forward (issue 38).

The Worker calls :meth:`Constraints.start` once the plan's tokens are counted (every
matcher then stands where its next token is sampled) and before the forward; llguidance
fills the rows' bitmasks on this module's thread, the GIL dropped, while torch runs the
model. :meth:`MaskJob.bits_on` waits for it and moves the bitmask to the sampling device in
one copy, where the batched sampler sets every forbidden token's logit to -inf
(``model/sampler.py`` ``masked_rows``; :meth:`MaskJob.apply` is its one-row reference).
A step without a constrained row starts nothing and costs nothing.

Measured here (2026-11-27, the loaded 2-core VM, SmolLM2's 49,152-token vocabulary, eight
rows in the middle of a nested JSON schema, the median of 100 steps, twice): filling the
eight masks took 0.22-0.25 ms, beside the forward; sampling the step took 12.1-12.7 ms
with the masks applied against 11.0-11.2 ms for eight plain rows (0.15-0.2 ms a row,
most of it unpacking the bits; the draw itself, about 1.2 ms a row, is unchanged). Those
figures are of the one-row sampler the batched one replaced.

Owned by the Worker actor's thread; the fill thread only writes the job's own bitmask.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import llguidance
import torch

from ringfence.actors.model.host import to_device
from ringfence.actors.text.grammars import Grammars

MASK_TIMEOUT_S = 30.0  # a mask not filled by then is a hung backend: the step fails

_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass(slots=True)
class MaskJob:
    """The bitmasks of one step's constrained rows, being filled."""

    rows: dict[int, int]  # row of the step's logits -> row of ``bits``
    bits: torch.Tensor  # [rows, words] int32: bit j of word w allows token 32 w + j
    done: Future[None]

    def wait(self) -> None:
        """Return once the fill is over, however it ended (a step that failed before it
        sampled still waits: the fill reads matchers the next plan moves)."""
        wait([self.done], timeout=MASK_TIMEOUT_S)

    def bits_on(self, device: torch.device) -> torch.Tensor:
        """The filled bitmask on ``device``, in one copy (waits for the fill). The batched
        sampler unpacks it there with shifts and one ``where`` (``model/sampler.py``
        ``masked_rows``)."""
        self.done.result(timeout=MASK_TIMEOUT_S)
        return to_device(self.bits, device)

    def apply(self, row: int, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (one row, any float dtype, on the CPU) with the row's forbidden tokens
        at -inf; the same tensor when the row is not constrained. A new tensor otherwise.
        The one-row reference of the batched masking."""
        at = self.rows.get(row)
        if at is None:
            return logits
        self.done.result(timeout=MASK_TIMEOUT_S)
        return masked(logits, self.bits[at])


def masked(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """``logits`` with -inf wherever the bitmask ``words`` has a 0 bit, and past its end.

    One shift, one ``where``: about 0.06-0.09 ms for a 49k row here, where scattering into
    a row of -inf took 0.65-0.93 ms (applying the masks is on the sampling path).
    """
    allowed = ((words.unsqueeze(-1) >> _SHIFTS) & 1).flatten().bool()
    n = logits.numel()
    if allowed.numel() < n:  # the model has rows past the tokenizer's tokens
        allowed = torch.cat([allowed, allowed.new_zeros(n - allowed.numel())])
    return torch.where(allowed[:n], logits, -torch.inf)


class Constraints:
    """The fill thread and the backend's executor of one Worker."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self._pool: ThreadPoolExecutor | None = None  # started on the first constrained step
        self._executor: llguidance.LLExecutor | None = None

    def start(self, matchers: Sequence[tuple[int, llguidance.LLMatcher]]) -> MaskJob | None:
        """Start filling the masks of ``matchers`` ((row, matcher) pairs); None for none."""
        if not matchers:
            return None
        if self._pool is None or self._executor is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
            self._executor = llguidance.LLExecutor()
        bits = torch.zeros((len(matchers), self.grammars.mask_words), dtype=torch.int32)
        batch = [(matcher, i) for i, (_, matcher) in enumerate(matchers)]
        executor = self._executor

        def fill() -> None:
            executor.unsafe_compute_mask_ptr(
                batch, bits.data_ptr(), bits.shape[1] * 4, bits.shape[0]
            )

        rows = {row: i for i, (row, _) in enumerate(matchers)}
        return MaskJob(rows=rows, bits=bits, done=self._pool.submit(fill))

    def close(self) -> None:
        """Stop the fill thread (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
