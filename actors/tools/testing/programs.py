"""Random programs of the fenced protocol, and their sequential interpretation (the oracle).

A program (:func:`generate`) is a list of ops over small device and host pools, so that
blocks are reused all the time: model steps (mixed prefill chunks and decode tokens, with
the freed device blocks to poison), swap-outs, swap-ins, write-backs and prefetches, each
with the fence that :class:`ringfence.cache.FenceTracker` computes in issue order. Decode
tokens are fixed in advance (teacher forcing), so a whole program is known before it runs.
:func:`interpret` runs a program one op at a time, in issue order: by the argument in
docs/design.md, "Sequence numbers, watermarks, fences", any correct execution of the
protocol ends in exactly the same state. Used by the protocol harness (``harness.py``) and
its tests.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ringfence.actors.executors.sampling import Sampler
from ringfence.actors.kv.copies import copy_blocks
from ringfence.actors.model.decoder import Model
from ringfence.actors.model.paged import PagedExecutor
from ringfence.actors.protocol.worker import SampledToken
from ringfence.actors.text.grammars import model_grammars
from ringfence.cache.fences import Fence, FenceTracker, Lane
from ringfence.cache.ids import BlockHash, BlockId, Seq
from ringfence.sched.ops import Op, Opening, Piece, StepOp, StoreOp, SwapOp
from ringfence.sched.sampling import SamplingParams

MAX_PIECES = 4  # sequences per step
MAX_CHUNK = 8  # tokens per prefill chunk


@dataclass
class _Seq:
    seq_id: int
    tokens: list[int]  # the prompt, then the decode tokens fed in order
    prompt: int  # prompt length
    done: int = 0  # tokens whose K/V are written
    where: str = "device"  # device, host or storage
    device: list[int] = field(default_factory=list)
    host: list[int] = field(default_factory=list)
    keys: list[BlockHash] = field(default_factory=list)  # content keys of its stored blocks


class Shape(NamedTuple):
    """The pools and model a program is drawn for."""

    device_blocks: int
    host_blocks: int
    block_size: int
    vocab: int
    poison: bool  # free device blocks are poisoned by the next step


class _Generator:
    """Draws one program; the pools start all free, op numbers at ``starts``."""

    def __init__(self, rng: random.Random, shape: Shape, starts: dict[Lane, int], epoch: int):
        self.rng, self.shape, self.epoch = rng, shape, epoch
        self.next = dict(starts)
        self.tracker = FenceTracker(shape.device_blocks, shape.host_blocks)
        self.device_free = list(range(shape.device_blocks))
        self.host_free = list(range(shape.host_blocks))
        rng.shuffle(self.device_free)
        rng.shuffle(self.host_free)
        self.to_poison: list[int] = []  # freed device blocks, held until a step poisons them
        self.seqs: dict[int, _Seq] = {}
        self.seq_ids = 0
        self.ops: list[Op] = []

    def take(self, free: list[int], count: int) -> list[int] | None:
        if count > len(free):
            return None
        return [free.pop(self.rng.randrange(len(free))) for _ in range(count)]

    def free_device(self, blocks: list[int]) -> None:
        (self.to_poison if self.shape.poison else self.device_free).extend(blocks)

    def issue(self, lane: Lane, **blocks: Sequence[int]) -> tuple[int, Fence]:
        number = self.next[lane]
        self.next[lane] += 1
        ids = {name: [BlockId(b) for b in value] for name, value in blocks.items()}
        return number, self.tracker.issue(lane, Seq(number), **ids)

    def program(self, count: int) -> list[Op]:
        moves = (self.step, self.swap_out, self.swap_in, self.write_back, self.prefetch)
        weights = (5, 2, 2, 1, 1)
        attempts = 0
        while len(self.ops) < count and attempts < 50 * count:
            attempts += 1
            if len(self.seqs) < 3 or self.rng.random() < 0.1:
                self.new_seq()
            self.rng.choices(moves, weights)[0]()
        return self.ops

    def new_seq(self) -> None:
        rng, vocab = self.rng, min(self.shape.vocab, 256)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(2, 20))]
        decode = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        self.seq_ids += 1
        self.seqs[self.seq_ids] = _Seq(self.seq_ids, prompt + decode, len(prompt))

    def step(self) -> None:
        bs, rng = self.shape.block_size, self.rng
        ready = [s for s in self.seqs.values() if s.where == "device" and s.done < len(s.tokens)]
        chosen = rng.sample(ready, min(len(ready), rng.randint(1, MAX_PIECES)))
        pieces, reads, writes = [], [], []
        for seq in chosen:
            left = seq.prompt - seq.done
            size = rng.randint(1, min(left, MAX_CHUNK)) if left > 0 else 1
            end = seq.done + size
            need = -(-end // bs) - len(seq.device)
            if need > 0:
                more = self.take(self.device_free, need)
                if more is None:
                    continue
                seq.device += more
            table = seq.device[: -(-end // bs)]
            temperature = rng.choice((0.0, 0.0, 0.9))  # drawn per piece: the seed's programs
            # stay what they were; the sequence's first piece opens it with its draw.
            params = SamplingParams(
                temperature=temperature, top_p=(1.0, 0.8)[seq.seq_id % 2], seed=seq.seq_id
            )
            opening = Opening(params=params, num_prompt_tokens=seq.prompt)
            pieces.append(
                Piece(
                    seq_id=seq.seq_id,
                    token_ids=tuple(seq.tokens[seq.done : end]),
                    start=seq.done,
                    block_table=tuple(table),
                    sample=end >= seq.prompt,
                    opening=opening if seq.done == 0 else None,
                )
            )
            reads += table
            writes += table[seq.done // bs :]
            seq.done = end
        poison, self.to_poison = self.to_poison, []
        if not pieces and not poison:
            return
        number, fence = self.issue(Lane.STEP, read_device=reads, write_device=writes + poison)
        self.ops.append(
            StepOp(
                step=number,
                epoch=self.epoch,
                fence=fence,
                pieces=tuple(pieces),
                poison=tuple(poison),
            )
        )
        self.device_free += poison
        for seq in chosen:
            if seq.done == len(seq.tokens):  # finished: its blocks are freed
                self.free_device(seq.device)
                del self.seqs[seq.seq_id]

    def swap_out(self) -> None:
        bs = self.shape.block_size
        cands = [s for s in self.seqs.values() if s.where == "device" and s.done > 0]
        if not cands:
            return
        seq = self.rng.choice(cands)
        used = -(-seq.done // bs)
        host = self.take(self.host_free, used)
        if host is None:
            return
        device = seq.device[:used]
        number, fence = self.issue(Lane.SWAP, read_device=device, write_host=host)
        self.ops.append(
            SwapOp(op=number, epoch=self.epoch, fence=fence, direction="out",
                   device_blocks=tuple(device), host_blocks=tuple(host), reason="preempt")
        )  # fmt: skip
        self.free_device(seq.device)
        seq.device, seq.host, seq.where = [], host, "host"

    def swap_in(self) -> None:
        cands = [s for s in self.seqs.values() if s.where == "host"]
        if not cands:
            return
        seq = self.rng.choice(cands)
        device = self.take(self.device_free, len(seq.host))
        if device is None:
            return
        number, fence = self.issue(Lane.SWAP, read_host=seq.host, write_device=device)
        self.ops.append(
            SwapOp(op=number, epoch=self.epoch, fence=fence, direction="in",
                   device_blocks=tuple(device), host_blocks=tuple(seq.host), reason="resume")
        )  # fmt: skip
        self.host_free += seq.host
        seq.device, seq.host, seq.keys, seq.where = device, [], [], "device"

    def write_back(self) -> None:
        cands = [s for s in self.seqs.values() if s.where == "host"]
        if not cands:
            return
        seq = self.rng.choice(cands)
        if not seq.keys:
            seq.keys = [BlockHash(self.rng.randbytes(16)) for _ in seq.host]
            number, fence = self.issue(Lane.STORE, read_host=seq.host)
            self.ops.append(
                StoreOp(op=number, epoch=self.epoch, fence=fence, direction="write",
                        host_blocks=tuple(seq.host), keys=tuple(seq.keys), reason="evict")
            )  # fmt: skip
        if self.rng.random() < 0.6:  # evicted from host: only storage has it now
            self.host_free += seq.host
            seq.host, seq.where = [], "storage"

    def prefetch(self) -> None:
        cands = [s for s in self.seqs.values() if s.where == "storage"]
        if not cands:
            return
        seq = self.rng.choice(cands)
        host = self.take(self.host_free, len(seq.keys))
        if host is None:
            return
        number, fence = self.issue(Lane.STORE, write_host=host)
        self.ops.append(
            StoreOp(op=number, epoch=self.epoch, fence=fence, direction="read",
                    host_blocks=tuple(host), keys=tuple(seq.keys), reason="admit")
        )  # fmt: skip
        seq.host, seq.where = host, "host"


def generate(
    seed: int, count: int, shape: Shape, starts: dict[Lane, int], epoch: int = 0
) -> list[Op]:
    """A random program of about ``count`` ops, numbered from ``starts``; a pure function."""
    return _Generator(random.Random(seed), shape, starts, epoch).program(count)


class Expected(NamedTuple):
    outputs: dict[int, tuple[SampledToken, ...]]  # step -> its sampled tokens
    missing: dict[int, tuple[int, ...]]  # prefetch op -> positions storage lacked
    device: torch.Tensor
    host: torch.Tensor


class Sequential:
    """Runs ops one at a time, in the order given, on these tensors and a dict as storage."""

    def __init__(
        self, model: Model, device: torch.Tensor, host: torch.Tensor, model_path: str = ""
    ) -> None:
        """``model_path``: the checkpoint whose tokenizer compiles grammars (bytes: "")."""
        self.executor = PagedExecutor(model, device)
        vocab_size = model.config.vocab_size
        self.sampler = Sampler(vocab_size, grammars=model_grammars(model_path, vocab_size))
        self.device, self.host = device, host
        self.storage: dict[BlockHash, torch.Tensor] = {}

    def run(self, op: Op) -> tuple[SampledToken, ...] | tuple[int, ...] | None:
        """Run ``op``: a step's sampled tokens, a prefetch's missing positions, else None."""
        device, host = self.device, self.host
        if isinstance(op, StepOp):
            if op.poison:
                device[list(op.poison)] = float("nan")
            self.sampler.advance(op.pieces)
            last = self.executor.step(op.pieces).last_logits if op.pieces else None
            sampled = self.sampler.sample(op.pieces, last) if last is not None else ()
            self.sampler.close(op.closed)
            return sampled
        if isinstance(op, SwapOp):
            if op.direction == "in":
                copy_blocks(host, op.host_blocks, device, op.device_blocks)
            else:
                copy_blocks(device, op.device_blocks, host, op.host_blocks)
            return None
        if op.direction == "write":
            for key, block in zip(op.keys, op.host_blocks, strict=True):
                self.storage[key] = host[block].clone()
            return None
        lacked = []
        for i, (key, block) in enumerate(zip(op.keys, op.host_blocks, strict=True)):
            if key in self.storage:
                host[block] = self.storage[key]
            else:
                lacked.append(i)
        return tuple(lacked)


def interpret(
    ops: Sequence[Op], model: Model, device: torch.Tensor, host: torch.Tensor
) -> Expected:
    """The sequential interpretation: every op alone, in issue order, on these tensors."""
    machine = Sequential(model, device, host)
    outputs: dict[int, tuple[SampledToken, ...]] = {}
    missing: dict[int, tuple[int, ...]] = {}
    for op in ops:
        result = machine.run(op)
        if isinstance(op, StepOp):
            outputs[op.step] = result  # type: ignore[assignment]
        elif isinstance(op, StoreOp) and op.direction == "read":
            missing[op.op] = result  # type: ignore[assignment]
    return Expected(outputs, missing, device, host)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN equals NaN of the same bits)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


def differing_blocks(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    return [i for i in range(a.shape[0]) if not same_bits(a[i], b[i])]
