"""The scheduler's queues: arrival order kept in waiting, the newest running spared or not."""

from __future__ import annotations

from ringfence.sched.queues import Queues
from ringfence.sched.request import Request
from ringfence.sched.sampling import SamplingParams


def make_queues(*request_ids: str) -> Queues:
    queues = Queues()
    for request_id in request_ids:
        params = SamplingParams(max_tokens=4)
        queues.add(Request(request_id=request_id, prompt_token_ids=(1, 2), params=params))
    return queues


def admit(queues: Queues, *seq_ids: int) -> None:
    """Move these waiting sequences to running, in this order (as admission does)."""
    for seq_id in seq_ids:
        seq = queues.seqs[seq_id]
        queues.waiting.remove(seq)
        queues.running.append(seq)


def test_requests_wait_in_arrival_order_under_increasing_seq_ids():
    queues = make_queues("a", "b", "c")
    assert [(s.seq_id, s.request.request_id) for s in queues.waiting] == [
        (0, "a"),
        (1, "b"),
        (2, "c"),
    ]
    assert queues.by_id["b"] is queues.seqs[1]


def test_a_sequence_sent_back_waits_before_every_later_arrival():
    queues = make_queues("a", "b", "c", "d")
    admit(queues, 0, 1)
    queues.back_to_waiting(queues.seqs[1])
    assert [s.seq_id for s in queues.waiting] == [1, 2, 3]
    queues.back_to_waiting(queues.seqs[0])
    assert [s.seq_id for s in queues.waiting] == [0, 1, 2, 3]
    assert queues.running == []


def test_the_newest_running_is_chosen_unless_spared():
    queues = make_queues("a", "b", "c")
    admit(queues, 2, 0, 1)  # admission order, not seq id order
    assert queues.newest_running(sparing=()) is queues.seqs[1]
    assert queues.newest_running(sparing={1}) is queues.seqs[0]
    assert queues.newest_running(sparing={0, 1, 2}) is None


def test_a_sequence_that_ended_leaves_its_queue_and_no_id_finds_it():
    queues = make_queues("a", "b")
    admit(queues, 0)
    for seq in (queues.seqs[0], queues.seqs[1]):
        queues.leave(seq)
        queues.forget(seq)
        queues.forget(seq)  # idempotent
    assert (queues.seqs, queues.by_id, list(queues.waiting), queues.running) == ({}, {}, [], [])
