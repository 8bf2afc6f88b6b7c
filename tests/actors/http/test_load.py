"""``GET /ringfence/load``'s watch (``actors/http/load.py``): readings numbered by change,
and the long poll that answers on the next change or at its deadline."""

from __future__ import annotations

import asyncio
import time

from ringfence.actors.http.load import Load, LoadWatch


def test_readings_are_numbered_only_when_they_change():
    watch = LoadWatch()
    watch.note(Load())
    assert watch.seq == 1  # the first reading counts even when all zeros
    watch.note(Load())
    assert watch.seq == 1
    watch.note(Load(running=2, free_blocks=10, total_blocks=16))
    assert watch.seq == 2 and watch.load.running == 2
    assert watch.answer(watch.seq, watch.load) == {
        "seq": 2, "pending": 0, "running": 2, "waiting": 0, "reservations": 0,
        "free_blocks": 10, "total_blocks": 16,
    }  # fmt: skip


def test_the_long_poll_answers_on_the_next_change_or_at_its_deadline():
    async def run() -> None:
        watch = LoadWatch()
        watch.note(Load(running=1))
        assert await watch.after(0, 5.0) == (1, Load(running=1))  # past 0: at once

        waiter = asyncio.ensure_future(watch.after(1, 5.0))
        await asyncio.sleep(0)
        assert not waiter.done()
        watch.note(Load(running=1))  # no change: no answer
        await asyncio.sleep(0)
        assert not waiter.done()
        watch.note(Load(running=2, waiting=3))
        assert await asyncio.wait_for(waiter, 1.0) == (2, Load(running=2, waiting=3))

        start = time.monotonic()
        assert await watch.after(2, 0.05) == (2, Load(running=2, waiting=3))  # the deadline
        assert time.monotonic() - start >= 0.04

    asyncio.run(run())
