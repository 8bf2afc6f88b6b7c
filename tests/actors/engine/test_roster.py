"""The engine's roster: every executor of every rank must answer its Resync before it
begins; each lane's numbers go on after the largest watermark its ranks answered."""

from __future__ import annotations

import pytest

from ringfence.actors.engine.executors import EXECUTORS, Roster
from ringfence.cache.fences import Lane


def test_the_engine_begins_only_once_every_rank_of_every_executor_answered():
    roster = Roster(epoch=4, ranks=2)
    answers = [(role, rank) for role in EXECUTORS for rank in range(2)]
    for role, rank in answers[:-1]:
        assert roster.announce(role, rank, 1, resync=4, done=rank, began=False) is not None
        assert not roster.all_synced()
    roster.announce(*answers[-1], 1, resync=4, done=7, began=False)
    assert roster.all_synced()
    assert roster.first_numbers() == {Lane.STEP: 2, Lane.SWAP: 2, Lane.STORE: 8}


def test_an_answer_to_another_engines_resync_is_ignored():
    roster = Roster(epoch=4, ranks=1)
    assert roster.announce("worker", 0, 1, resync=3, done=5, began=False) is None
    assert not roster.synced


def test_a_new_incarnation_of_a_known_executor_is_a_restart_of_that_rank_only():
    roster = Roster(epoch=0, ranks=2)
    for rank in range(2):
        announced = roster.announce("swap", rank, 1, resync=-1, done=0, began=False)
        assert announced is not None and not announced.restarted
    again = roster.announce("swap", 1, 2, resync=-1, done=0, began=True)
    assert again is not None and again.restarted
    same = roster.announce("swap", 0, 1, resync=-1, done=0, began=True)
    assert same is not None and not same.restarted


def test_a_rank_the_run_does_not_have_is_refused():
    with pytest.raises(ValueError, match="worker rank 2 announced; the run has 2 ranks"):
        Roster(epoch=0, ranks=2).announce("worker", 2, 1, resync=-1, done=0, began=False)
