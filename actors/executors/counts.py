"""The penalties' token counts of the open sequences, kept on the device the Worker samples on.

A sequence whose ``SamplingParams`` has a penalty (``needs_counts``) holds a slot: a row of
``counts`` ([slots, vocab] int32, how often each token occurred in its output) and of
``seen`` ([slots, vocab] bool, each token of its prompt or output). Every piece's tokens are
added by one scatter per plan (their ids copied to the device once); a step gathers the
rows of the sequences it samples. A decode launched before the step that sampled its input
was read back counts that token where it lies, on the device (:meth:`add_on_device`). Slot
0 is never handed out and stays empty: a row without penalties gathers it, so the batched
penalty reads no count there.

Why on the device and not a Counter per sequence (as before): the penalties are tensor
ops over the whole row, and building each step's rows on the host would cost a copy of
[rows, vocab] per step; here only the new tokens' ids cross, once.

A slot is taken when a sequence that needs counts is opened (zeroed then), released when it
closes or is opened again; a restart builds a new :class:`DeviceCounts` (the engine opens
every sequence again). When every slot is held the tensors double. Owned by the Worker
actor's thread; not thread-safe. Device ops are queued on the current stream in the order
of the calls, so a zeroed slot is zeroed before the counts added after it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ringfence.actors.model.host import to_device

FIRST_SLOTS = 16  # slots of a new table (slot 0 included); doubled when full


class DeviceCounts:
    """The count rows of one Worker's open sequences, by slot."""

    def __init__(self, vocab_size: int, device: torch.device, slots: int = FIRST_SLOTS) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros((slots, vocab_size), dtype=torch.int32, device=device)
        self.seen = torch.zeros((slots, vocab_size), dtype=torch.bool, device=device)
        self.free = list(range(slots - 1, 0, -1))  # popped from the end: lowest first
        # Added since the last flush: (slot, token) of every token, and of the output's.
        self._seen: list[tuple[int, int]] = []
        self._output: list[tuple[int, int]] = []
        # And (slot, index) of output tokens still on the device, at ``_ids[index]``.
        self._on_device: list[tuple[int, int]] = []
        self._ids: torch.Tensor | None = None

    @property
    def num_slots(self) -> int:
        return len(self.counts)

    def take(self) -> int:
        """A free slot, zeroed (the tensors double if none is free)."""
        self.flush()  # what was added to a slot before it is zeroed lands first
        if not self.free:
            self._grow()
        slot = self.free.pop()
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        """Give the slot back (it is zeroed when taken again)."""
        if not 0 < slot < self.num_slots or slot in self.free:
            raise ValueError(f"slot {slot} is not held (of {self.num_slots})")
        self.free.append(slot)

    def add(self, slot: int, tokens: Sequence[int], first_output: int) -> None:
        """Count ``tokens`` in the slot: every one as seen, those from index
        ``first_output`` on as output. Queued until :meth:`flush`."""
        self._seen.extend((slot, t) for t in tokens)
        self._output.extend((slot, t) for t in tokens[first_output:])

    def add_on_device(self, slot: int, ids: torch.Tensor, index: int) -> None:
        """Count the output token ``ids[index]`` (on the device, not read back) in the slot.
        Queued until :meth:`flush`; every such token of one flush is of the same ``ids``."""
        if self._ids is not None and self._ids is not ids:
            raise ValueError("tokens on the device from two tensors in one flush")
        self._ids = ids
        self._on_device.append((slot, index))

    def flush(self) -> None:
        """Apply what :meth:`add` and :meth:`add_on_device` queued: one copy of the ids, one
        scatter per tensor (and one of each for the tokens on the device)."""
        if self._on_device and self._ids is not None:  # (the one is set with the other)
            host = torch.tensor(self._on_device, dtype=torch.int64).t().contiguous()
            at = to_device(host, self.device)
            slots, tokens = at[0], self._ids.index_select(0, at[1])
            true = torch.ones((), dtype=torch.bool, device=self.device)
            self.seen.index_put_((slots, tokens), true)
            ones = torch.ones(len(self._on_device), dtype=torch.int32, device=self.device)
            self.counts.index_put_((slots, tokens), ones, accumulate=True)
            self._on_device, self._ids = [], None
        if not self._seen:
            return
        pairs = self._seen + self._output
        ids = to_device(torch.tensor(pairs, dtype=torch.int64).t().contiguous(), self.device)
        n = len(self._seen)
        true = torch.ones((), dtype=torch.bool, device=self.device)  # a fill, not a copy
        self.seen.index_put_((ids[0, :n], ids[1, :n]), true)
        if len(pairs) > n:
            ones = torch.ones(len(pairs) - n, dtype=torch.int32, device=self.device)
            self.counts.index_put_((ids[0, n:], ids[1, n:]), ones, accumulate=True)
        self._seen, self._output = [], []

    def of(self, slot: int) -> tuple[dict[int, int], set[int]]:
        """The slot's output counts and seen tokens, read back (tests and debugging)."""
        self.flush()
        row = self.counts[slot].cpu()
        ids = torch.nonzero(row).flatten().tolist()
        seen = torch.nonzero(self.seen[slot].cpu()).flatten().tolist()
        return {i: int(row[i]) for i in ids}, set(seen)

    def _grow(self) -> None:
        old = self.num_slots
        counts = torch.zeros((2 * old, self.vocab_size), dtype=torch.int32, device=self.device)
        seen = torch.zeros((2 * old, self.vocab_size), dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        seen[:old] = self.seen
        self.counts, self.seen = counts, seen
        self.free.extend(range(2 * old - 1, old - 1, -1))
