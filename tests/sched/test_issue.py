"""The Issuer's swap-outs issued back to back for one reason: one op, fenced as its parts.

A reference issuer seals every swap-out at once (one op per call, as before gathering);
the same random calls through both must give the same ops but for the gathered swap-outs,
each of which does its parts in order with the largest of their fences.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from ringfence.cache.fences import Fence, FenceTracker, Lane
from ringfence.cache.ids import BlockHash, BlockId, Seq
from ringfence.sched.issue import Issuer
from ringfence.sched.ops import Op, Piece, Reason, StepOp, StoreOp, SwapOp

DEVICE, HOST = 12, 12


def ids(*blocks: int) -> list[BlockId]:
    return [BlockId(b) for b in blocks]


def issuer() -> Issuer:
    return Issuer(4, FenceTracker(DEVICE, HOST))


class Ungathered(Issuer):
    """Every swap-out its own op, issued at its call."""

    def swap(self, direction, device, host, reason):  # type: ignore[no-untyped-def]
        super().swap(direction, device, host, reason)
        self.seal()


def swap_ops(ops: list[Op]) -> list[SwapOp]:
    assert all(isinstance(op, SwapOp) for op in ops)
    return [op for op in ops if isinstance(op, SwapOp)]


def piece(blocks: Sequence[int]) -> Piece:
    tokens = (1,) * (4 * len(blocks))
    return Piece(seq_id=1, start=0, token_ids=tokens, block_table=tuple(blocks), sample=False)


def test_swap_outs_of_one_reason_back_to_back_are_one_op_with_their_blocks_in_order():
    iss = issuer()
    iss.swap("out", ids(3), ids(7), "evict")
    iss.swap("out", ids(1, 2), ids(0, 5), "evict")
    assert iss.has_ops
    (op,) = iss.take_ops()
    assert isinstance(op, SwapOp)
    assert (op.op, op.direction, op.reason) == (1, "out", "evict")
    assert (op.device_blocks, op.host_blocks) == ((3, 1, 2), (7, 0, 5))
    assert (iss.moved.ops["swap_out"], iss.moved.blocks["swap_out"]) == (1, 3)
    assert iss.inflight == {(Lane.SWAP, 1): op}


def test_anything_issued_between_two_swap_outs_keeps_them_apart_in_call_order():
    iss = issuer()
    iss.swap("out", ids(0), ids(0), "evict")
    iss.swap("in", ids(5), ids(9), "resume")
    iss.swap("out", ids(1), ids(1), "evict")
    iss.store("write", ids(0), [BlockHash(b"k" * 16)], "evict")
    iss.swap("out", ids(2), ids(2), "evict")
    iss.step([piece([3])], (), ())
    iss.swap("out", ids(4), ids(4), "evict")
    ops = iss.take_ops()
    assert [(type(o).__name__, o.number) for o in ops] == [
        ("SwapOp", 1),
        ("SwapOp", 2),
        ("SwapOp", 3),
        ("StoreOp", 1),
        ("SwapOp", 4),
        ("StepOp", 1),
        ("SwapOp", 5),
    ]
    # The write-back reads host block 0 after the first swap-out wrote it.
    assert ops[3].fence == Fence(swap=Seq(1))


def test_another_reason_or_a_block_named_again_starts_a_new_op():
    iss = issuer()
    iss.swap("out", ids(0), ids(0), "evict")
    iss.swap("out", ids(1), ids(1), "through")
    iss.swap("out", ids(2), ids(2), "through")
    iss.swap("out", ids(3), ids(2), "through")  # host block 2 written again: after the first
    ops = swap_ops(iss.take_ops())
    assert [(o.device_blocks, o.host_blocks, o.reason) for o in ops] == [
        ((0,), (0,), "evict"),
        ((1, 2), (1, 2), "through"),
        ((3,), (2,), "through"),
    ]


def test_a_question_about_what_was_issued_issues_the_gathered_swap_outs_first():
    iss = issuer()
    iss.swap("out", ids(0), ids(0), "evict")
    assert iss.last_number(Lane.SWAP) == 1
    iss.swap("out", ids(1), ids(1), "evict")
    assert list(iss.inflight) == [(Lane.SWAP, 1), (Lane.SWAP, 2)]
    assert [o.device_blocks for o in swap_ops(iss.take_ops())] == [(0,), (1,)]


@dataclass
class Calls:
    """A random program of issue calls, replayable on any issuer."""

    seed: int

    def run(self, iss: Issuer) -> list[Op]:
        rng = random.Random(self.seed)
        ops: list[Op] = []
        for _ in range(60):
            kind = rng.choice(["out", "out", "out", "in", "write", "read", "step", "take"])
            dev = ids(*rng.sample(range(DEVICE), rng.randint(1, 3)))
            host = ids(*rng.sample(range(HOST), len(dev)))
            reason: Reason = rng.choice(["evict", "through"])
            if kind in ("out", "in"):
                iss.swap(kind, dev, host, reason if kind == "out" else "resume")
            elif kind in ("write", "read"):
                keys = [BlockHash(bytes([b]) * 16) for b in host]
                iss.store(kind, host, keys, "evict" if kind == "write" else "admit")
            elif kind == "step":
                iss.step([piece(dev)], (), ())
            else:
                ops += iss.take_ops()
        return ops + iss.take_ops()


def test_gathered_swap_outs_are_fenced_as_their_parts_and_every_other_op_as_before():
    gathering = 0
    for seed in range(40):
        print(f"seed {seed}")
        plain = Calls(seed).run(Ungathered(4, FenceTracker(DEVICE, HOST)))
        gathered = Calls(seed).run(issuer())
        same_but_gathered(plain, gathered)
        gathering += len(gathered) < len(plain)
    assert gathering >= 30, gathering  # the programs gathered swap-outs


def same_but_gathered(plain: list[Op], gathered: list[Op]) -> None:
    """``gathered`` is ``plain`` with runs of swap-outs done as one op each."""
    swap_number = {0: 0}  # an ungathered swap op's number -> the gathered op that does it
    i = 0
    for op in gathered:
        if isinstance(op, SwapOp) and op.direction == "out":
            parts: list[SwapOp] = []
            while sum(len(p.device_blocks) for p in parts) < len(op.device_blocks):
                part = plain[i]
                assert isinstance(part, SwapOp) and part.direction == "out", (op, part)
                parts.append(part)
                i += 1
            assert sum((p.device_blocks for p in parts), ()) == op.device_blocks
            assert sum((p.host_blocks for p in parts), ()) == op.host_blocks
            assert {p.reason for p in parts} == {op.reason}
            # An op writes each block once (the swap lane refuses one that does not).
            assert len(set(op.host_blocks)) == len(op.host_blocks)
            assert op.fence.step == max(p.fence.step for p in parts)
            assert op.fence.store == max(p.fence.store for p in parts)
            assert op.fence.swap == 0
            swap_number.update((p.op, op.op) for p in parts)
            continue
        part = plain[i]
        i += 1
        assert type(part) is type(op)
        if isinstance(op, SwapOp):
            assert isinstance(part, SwapOp)
            swap_number[part.op] = op.op
            assert (part.device_blocks, part.host_blocks) == (op.device_blocks, op.host_blocks)
        elif isinstance(op, StoreOp):
            assert isinstance(part, StoreOp)
            assert (part.op, part.host_blocks, part.keys) == (op.op, op.host_blocks, op.keys)
        else:
            assert isinstance(op, StepOp) and isinstance(part, StepOp)
            assert (part.step, part.pieces) == (op.step, op.pieces)
        assert op.fence.step == part.fence.step and op.fence.store == part.fence.store
        assert op.fence.swap == swap_number[part.fence.swap]
    assert i == len(plain)
