"""The admission path on its own: a prefetch's completion, with the exact host pool it
leaves, and the per-sequence helpers it shares with the scheduler (holds, journal)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from ringfence.cache.block_hash import block_keys
from ringfence.cache.fences import Lane
from ringfence.cache.ids import BlockHash, BlockId
from ringfence.sched.admission import Admission
from ringfence.sched.blocks import BlockManager
from ringfence.sched.config import SchedulerConfig, TierConfig
from ringfence.sched.ops import Piece, StoreOp, SwapOp
from ringfence.sched.pieces import PieceMaker
from ringfence.sched.request import Request, RequestState, SamplingParams
from ringfence.sched.sequence import Counters, Decision, Journal, Sequence, Tail

NAMESPACE = b"\1" * 16


class Stored:
    """Storage presence: a fixed set of keys."""

    def __init__(self, keys: Iterable[BlockHash]) -> None:
        self.keys = set(keys)

    def longest_prefix(self, keys: Iterable[BlockHash]) -> int:
        count = 0
        for key in keys:
            if key not in self.keys:
                break
            count += 1
        return count


def ids(*blocks: int) -> list[BlockId]:
    return [BlockId(b) for b in blocks]


def state(seq: Sequence) -> RequestState:
    """Its request's state (read through a call: mypy does not keep it narrowed)."""
    return seq.request.state


def request(prompt: tuple[int, ...], max_tokens: int = 1) -> Request:
    return Request(
        request_id="a",
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=max_tokens),
        arrival=0.0,
    )


def test_a_prefetch_completion_holds_the_good_blocks_and_hands_back_the_rest_in_order():
    prompt = tuple(range(1, 10))  # 9 tokens, blocks of 2: 4 full blocks before the last token
    k = block_keys(prompt, 2, namespace=NAMESPACE)
    config = SchedulerConfig(
        tiers=TierConfig(
            block_size=2, device_blocks=8, host_blocks=8, host_cache=True, storage=True
        ),
        namespace=NAMESPACE,
    )
    blocks = BlockManager(config.tiers, Stored(k))
    journal = Journal(True)
    admission = Admission(config, blocks, PieceMaker(2, NAMESPACE), Counters(), journal)
    host = blocks.host
    # Key 1 is cached on host: the prefetch fetches keys 0, 2 and 3 only.
    assert blocks.allocate_host(1) == ids(0)
    assert blocks.hold_on_host(ids(0), [k[1]]) == ids(0)
    blocks.release_host(ids(0))
    seq = Sequence(0, request(prompt, 2))
    waiting, running = deque([seq]), list[Sequence]()
    pieces: list[Piece] = []
    assert admission.admit(waiting, running, 100, pieces, set()) == 100
    assert (list(waiting), running, pieces) == ([seq], [], [])
    assert state(seq) is RequestState.WAITING_FOR_PREFETCH
    prefetch = seq.prefetch  # (a local: the completion below changes the field)
    assert prefetch == (1, (1, 2, 3), (0, 2, 3))
    assert admission.prefetches == {1: seq}
    [read] = blocks.issuer.take_ops()
    assert isinstance(read, StoreOp)
    assert (read.direction, read.host_blocks, read.keys) == ("read", (1, 2, 3), (k[0], k[2], k[3]))
    # Meanwhile another sequence's swap-out left key 2 on host, in block 4.
    assert blocks.allocate_host(1) == ids(4)
    blocks.hold_on_host(ids(4), [k[2]])
    blocks.release_host(ids(4))
    assert host.free_order() == ids(5, 6, 7, 0, 4)

    blocks.completed(Lane.STORE, 1, "ok")
    admission.prefetched(1, "ok", {2})  # key 3 did not come
    assert admission.prefetches == {} and seq.prefetch is None
    assert state(seq) is RequestState.WAITING
    assert seq.held == ids(1, 4)  # key 0 in its own block; key 2's existing copy
    assert seq.storage_until == 3 and seq.from_storage == {k[0], k[2]}
    assert [host.ref_count(BlockId(b)) for b in range(8)] == [0, 1, 0, 0, 1, 0, 0, 0]
    assert [host.key_of(BlockId(b)) for b in range(5)] == [k[1], k[0], None, None, k[2]]
    # The duplicate (block 2) is handed back before the block that did not come (3).
    assert host.free_order() == ids(5, 6, 7, 0, 2, 3)

    # Admitted again: every hit is on host now, and key 3 is not fetched again.
    assert admission.admit(waiting, running, 100, pieces, set()) == 97
    [piece] = pieces
    assert (piece.start, piece.token_ids) == (6, prompt[6:])
    [swap_in] = blocks.issuer.take_ops()
    assert isinstance(swap_in, SwapOp)
    assert (swap_in.direction, swap_in.host_blocks, swap_in.device_blocks) == (
        "in",
        (1, 0, 4),
        (0, 1, 2),
    )
    assert [host.ref_count(BlockId(b)) for b in range(8)] == [0] * 8
    assert host.free_order() == ids(5, 6, 7, 2, 3, 0, 1, 4)
    assert seq.held == [] and running == [seq] and not waiting
    assert journal.take() == [
        Decision("prefetch", 0, {"op": 1, "blocks": 3}),
        Decision("admit", 0, {"computed": 6, "device": 0, "host": 2, "storage": 4}),
    ]
    assert journal.take() == []


def test_take_holds_hands_over_the_held_blocks_then_the_tail():
    seq = Sequence(0, request((1, 2)), held=ids(3, 1), tail=Tail(BlockId(7), 2, 1))
    assert seq.take_holds() == ids(3, 1, 7)
    assert (seq.held, seq.tail) == ([], None)
    assert seq.take_holds() == []


def test_a_journal_that_is_off_records_nothing():
    seq = Sequence(4, request((1, 2)))
    off = Journal(False)
    off.record("admit", seq, computed=0)
    assert not off.enabled and off.take() == []
    on = Journal(True)
    on.record("preempt", seq, policy="swap", computed=3)
    assert on.enabled and on.take() == [Decision("preempt", 4, {"policy": "swap", "computed": 3})]
