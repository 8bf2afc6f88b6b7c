"""An actor's timers: due messages in order, a blocked one kept, the Tick skipping missed beats."""

from __future__ import annotations

from ringfence.runtime.mailbox import Delivery
from ringfence.runtime.messages import Tick
from ringfence.runtime.timers import Timers


class Handler:
    """Takes every delivery, or refuses the ones listed (as a handler blocked downstream)."""

    def __init__(self, refuse: tuple[object, ...] = ()) -> None:
        self.deliveries: list[Delivery] = []
        self.refuse = list(refuse)

    @property
    def seen(self) -> list[object]:
        return [delivery.msg for delivery in self.deliveries]

    def __call__(self, delivery: Delivery) -> bool:
        self.deliveries.append(delivery)
        if delivery.msg in self.refuse:
            self.refuse.remove(delivery.msg)
            return False
        return True


def never() -> bool:
    return False


def test_due_timers_fire_in_due_order_and_equal_times_in_the_order_added():
    timers, handler = Timers("a-0", None), Handler()
    timers.add(2.0, "late")
    timers.add(1.0, "first")
    timers.add(1.0, "second")
    timers.add(9.0, "not yet")
    assert timers.fire(5.0, handler, never) == 3
    assert handler.seen == ["first", "second", "late"]
    assert timers.next_due() == 9.0


def test_a_timer_its_handler_refused_ends_the_turn_and_is_queued_again_for_now():
    timers, handler = Timers("a-0", None), Handler(refuse=("blocked",))
    timers.add(1.0, "blocked")
    timers.add(2.0, "after")
    assert timers.fire(5.0, handler, never) == 1
    assert timers.next_due() == 2.0  # "after" first: "blocked" was queued again at 5.0
    assert timers.fire(6.0, handler, never) == 2
    assert handler.seen == ["blocked", "after", "blocked"]


def test_the_tick_rearms_a_period_after_its_due_time_and_skips_the_beats_it_missed():
    timers, handler = Timers("a-0", 1.0), Handler()
    timers.add(1.0, Tick(n=0, late_s=0.0))
    timers.fire(1.25, handler, never)
    assert timers.next_due() == 2.0
    timers.fire(5.5, handler, never)  # 3.0, 4.0 and 5.0 missed: one tick, late
    assert handler.seen == [Tick(n=1, late_s=0.25), Tick(n=2, late_s=3.5)]
    assert timers.next_due() == 6.5


def test_nothing_fires_once_stopped_and_a_delivery_names_the_instance():
    timers, handler = Timers("a-0", None), Handler()
    timers.add(1.0, "x")
    assert timers.fire(2.0, handler, lambda: True) == 0
    timers.fire(2.0, handler, never)
    assert handler.deliveries == [Delivery("a-0", 0, "x", None)]
    assert timers.next_due() is None
