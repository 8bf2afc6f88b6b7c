"""ClientHub: request keys per client incarnation, output queues, Stats, and giving up on
clients."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from ringfence.actors.engine.clients import ClientHub, RequestKey, RequestRefused
from ringfence.actors.engine.stats import no_stats
from ringfence.actors.protocol.client import (
    CLIENT_TO_ENGINE,
    ENGINE_TO_CLIENT,
    Hello,
    Rejected,
    Stats,
    Submit,
    Tokens,
)
from ringfence.runtime.log import ActorLog
from ringfence.sched.request import RequestError, SamplingParams
from ringfence.shm.errors import ActorDead, RingFull
from ringfence.shm.liveness import ProcessStamp

ME = ProcessStamp.current()


class Rings:
    """A fake ``send``: records what each peer's ring took; ``room[peer]`` frames fit at most."""

    def __init__(self) -> None:
        self.sent: dict[str, list[object]] = {}
        self.room: dict[str, int] = {}
        self.dead: set[str] = set()
        self.batches: list[int] = []  # the length of each send_many

    def __call__(self, peer: str, msg: object) -> None:
        if peer in self.dead:
            raise ActorDead(f"{peer} is gone")
        taken = self.sent.setdefault(peer, [])
        if len(taken) >= self.room.get(peer, 1 << 30):
            raise RingFull(f"{peer} is full")
        taken.append(msg)

    def many(self, peer: str, msgs: list[object]) -> None:
        """A fake ``send_many``: in order, stopping where the room ends, as a ring does."""
        self.batches.append(len(msgs))
        for i, msg in enumerate(msgs):
            try:
                self(peer, msg)
            except RingFull as e:
                raise RingFull(str(e), sent=i) from None


BATCHED = [False]  # whether make_hub gives the hub send_many (both, by the fixture below)


@pytest.fixture(autouse=True, params=["one by one", "batched"])
def flush_mode(request: pytest.FixtureRequest) -> None:
    """Every test runs with a hub that sends one message at a time and with one that
    sends each client's queue with one send_many: what the client gets is the same."""
    BATCHED[0] = request.param == "batched"


def make_hub(max_queued: int = 16, max_live: int = 256) -> tuple[ClientHub, Rings]:
    rings = Rings()
    log = ActorLog(None, actor="engine", rank=0, epoch=0)
    many = rings.many if BATCHED[0] else None
    hub = ClientHub(rings, log, max_queued=max_queued, max_live=max_live, send_many=many)
    return hub, rings


def hello(incarnation: int = 1, stamp: ProcessStamp = ME, stats: bool = False) -> Hello:
    return Hello(incarnation=incarnation, pid=stamp.pid, start_ticks=stamp.start_ticks, stats=stats)


def stats(steps: int, incarnation: int = 0) -> Stats:
    """A Stats told apart by its ``steps``."""
    return dataclasses.replace(no_stats(), began=True, steps=steps, incarnation=incarnation)


def submit(request_id: str = "a", **fields) -> Submit:
    return Submit(request_id=request_id, prompt_token_ids=(1, 2), **fields)


def tokens(
    request_id: str, token_ids: tuple[int, ...], finish_reason: str = "", **fields
) -> Tokens:
    return Tokens(
        request_id=request_id,
        incarnation=fields.pop("incarnation", 1),
        token_ids=token_ids,
        finish_reason=finish_reason,
        **fields,
    )


def test_a_request_key_names_the_client_its_incarnation_and_its_id():
    hub, _ = make_hub()
    assert hub.hello("client-2", hello(3)) == []
    assert hub.submit("client-2", submit("r")) == "client-2/3/r"
    assert hub.abort("client-2", "r") == "client-2/3/r"
    assert hub.abort("client-2", "unknown") is None
    assert hub.abort("client-1", "r") is None


def test_submits_before_hello_with_a_live_duplicate_id_or_bad_fields_are_refused():
    hub, _ = make_hub()
    with pytest.raises(RequestRefused, match="client-0: Submit before Hello"):
        hub.submit("client-0", submit())
    hub.hello("client-0", hello())
    key = hub.submit("client-0", submit("a"))
    with pytest.raises(RequestRefused, match="request 'a' is already running"):
        hub.submit("client-0", submit("a"))
    with pytest.raises(RequestRefused, match="request 'b': exactly one of prompt_token_ids"):
        hub.submit("client-0", submit("b", prompt="and text"))
    for top_p in (0.0, -1.0, 1.5, float("nan")):  # bad sampling params cannot even be built
        with pytest.raises(RequestError, match=r"top_p must be in \(0, 1\]"):
            SamplingParams(top_p=top_p)
    hub.emit(key, (5,), finish_reason="length")
    assert hub.submit("client-0", submit("a")) == key  # finished ids may be used again


def test_a_client_past_its_live_requests_is_refused_until_one_of_them_ends():
    hub, _ = make_hub(max_live=3)
    hub.hello("client-0", hello())
    hub.hello("client-1", hello())
    keys = [hub.submit("client-0", submit(f"r{i}")) for i in range(3)]
    for flood in range(100):  # a flood costs nothing here: each is refused at once
        with pytest.raises(RequestRefused, match="client-0 has 3 requests unfinished"):
            hub.submit("client-0", submit(f"flood{flood}"))
    assert hub.submit("client-1", submit("other")) == "client-1/1/other"  # others go on
    hub.emit(keys[0], (5,), finish_reason="length")
    assert hub.submit("client-0", submit("r3")) == "client-0/1/r3"


def test_consecutive_tokens_of_a_request_merge_while_queued_and_a_finish_forgets_the_key():
    hub, rings = make_hub()
    hub.hello("client-0", hello())
    a, b = hub.submit("client-0", submit("a")), hub.submit("client-0", submit("b"))
    hub.emit(a, (1,), cached_tokens={"device": 2, "host": 0, "storage": 0}, ttft_s=0.25)
    hub.emit(b, (7,))
    hub.emit(a, (2,))
    hub.emit(a, (3,), finish_reason="length")
    hub.emit(a, (4,))  # after the finish: ignored
    assert hub.pending()
    assert hub.flush() == 2
    assert not hub.pending()
    assert rings.sent["client-0"] == [
        tokens(
            "a",
            (1, 2, 3),
            "length",
            cached_tokens={"device": 2, "host": 0, "storage": 0},
            ttft_s=0.25,
        ),
        tokens("b", (7,)),
    ]
    hub.emit(b, (8,))  # the earlier message went: a new one
    hub.flush()
    assert rings.sent["client-0"][2:] == [tokens("b", (8,))]
    assert hub.abort("client-0", "a") is None


def test_a_full_ring_keeps_the_rest_queued_in_order_for_the_next_flush():
    hub, rings = make_hub()
    hub.hello("client-0", hello())
    hub.hello("client-1", hello())
    keys = [hub.submit("client-0", submit(r)) for r in "abc"]
    other = hub.submit("client-1", submit("z"))
    for n, key in enumerate(keys):
        hub.emit(key, (n,))
    hub.emit(other, (9,), finish_reason="stop")
    rings.room["client-0"] = 1
    assert hub.flush() == 2  # one to client-0, one to client-1
    assert hub.pending()
    hub.emit(keys[0], (10,))
    rings.room["client-0"] = 10
    assert hub.flush() == 3
    assert rings.sent["client-0"] == [
        tokens("a", (0,)),
        tokens("b", (1,)),
        tokens("c", (2,)),
        tokens("a", (10,)),
    ]
    assert rings.sent["client-1"] == [tokens("z", (9,), "stop")]


def test_a_client_whose_queue_overflows_is_stuck_and_its_requests_end_with_abort():
    hub, rings = make_hub(max_queued=2)
    hub.hello("client-0", hello())
    keys = [hub.submit("client-0", submit(r)) for r in "abc"]
    rings.room["client-0"] = 0
    for key in keys:
        hub.emit(key, (1,))
    hub.flush()
    assert hub.stuck_or_dead() == keys
    assert hub.stuck_or_dead() == []
    hub.emit(keys[0], (2,), finish_reason="length")  # forgotten: ignored
    rings.room["client-0"] = 10
    assert hub.flush() == 3
    reason = "its output was not read: more than 2 messages queued"
    assert rings.sent["client-0"] == [tokens(r, (), "abort", error=reason) for r in "abc"]
    # Still served: a new request goes through.
    assert hub.submit("client-0", submit("d")) == "client-0/1/d"


def test_the_requests_of_a_dead_client_process_are_reported_once_and_its_output_dropped():
    hub, rings = make_hub()
    gone = ProcessStamp(pid=ME.pid, start_ticks=ME.start_ticks + 1)  # a recycled pid
    hub.hello("client-0", hello(stamp=gone))
    hub.hello("client-1", hello())
    dead = [hub.submit("client-0", submit(r)) for r in "ab"]
    alive = hub.submit("client-1", submit("a"))
    rings.room["client-0"] = 0
    hub.emit(dead[0], (1,))
    assert hub.stuck_or_dead() == dead
    assert hub.stuck_or_dead() == []
    assert not hub.pending()
    with pytest.raises(RequestRefused, match="client-0: client given up on: its process is gone"):
        hub.submit("client-0", submit("c"))
    assert hub.abort("client-1", "a") == alive


def test_a_reader_gone_from_the_ring_gives_the_client_up():
    hub, rings = make_hub()
    hub.hello("client-0", hello())
    key = hub.submit("client-0", submit())
    hub.emit(key, (1,))
    rings.dead.add("client-0")
    assert hub.flush() == 0
    assert hub.stuck_or_dead() == [key]


def test_a_new_incarnation_returns_the_old_ones_live_requests_and_drops_its_output():
    hub, _ = make_hub()
    hub.hello("client-0", hello(1))
    old = [hub.submit("client-0", submit(r)) for r in "ab"]
    hub.emit(old[0], (1,))
    assert hub.hello("client-0", hello(1)) == []  # the same incarnation again: nothing changes
    assert hub.hello("client-0", hello(2)) == old
    assert not hub.pending()
    hub.emit(old[1], (2,), finish_reason="length")  # ignored
    assert hub.submit("client-0", submit("a")) == "client-0/2/a"
    with pytest.raises(RequestRefused, match="Hello of incarnation 1 after 2"):
        hub.hello("client-0", hello(1))


def test_reject_answers_with_the_client_incarnation_or_zero_before_hello():
    hub, rings = make_hub()
    hub.reject("client-0", "x", "no hello")
    hub.hello("client-1", hello(4))
    hub.reject("client-1", "y", "bad")
    hub.flush()
    assert rings.sent == {
        "client-0": [Rejected(request_id="x", incarnation=0, error="no hello")],
        "client-1": [Rejected(request_id="y", incarnation=4, error="bad")],
    }


def test_an_unknown_finish_reason_is_a_value_error():
    hub, _ = make_hub()
    with pytest.raises(ValueError, match="finish_reason must be one of"):
        hub.emit(RequestKey("client-0/1/a"), (), finish_reason="done")


# Stats.


def test_stats_go_only_to_clients_whose_current_hello_asked_each_with_its_incarnation():
    hub, rings = make_hub()
    hub.hello("client-0", hello(2, stats=True))
    hub.hello("client-1", hello(1))
    assert hub.watching() and hub.watching("client-0") and not hub.watching("client-1")
    hub.post_stats(stats(1))
    assert hub.flush() == 1
    assert rings.sent == {"client-0": [stats(1, incarnation=2)]}
    hub.hello("client-1", hello(1, stats=True))  # the same incarnation, now asking
    hub.hello("client-0", hello(2))  # and no longer
    hub.post_stats(stats(2))
    hub.flush()
    assert rings.sent == {"client-0": [stats(1, incarnation=2)], "client-1": [stats(2, 1)]}
    assert not hub.watching("client-0") and not hub.watching("client-9")


def test_post_stats_to_one_peer_leaves_the_other_watchers_alone():
    hub, rings = make_hub()
    hub.hello("client-0", hello(stats=True))
    hub.hello("client-1", hello(stats=True))
    hub.post_stats(stats(1), "client-1")
    hub.flush()
    assert rings.sent == {"client-1": [stats(1, 1)]}


def test_a_newer_stats_replaces_the_one_held_and_goes_after_the_queued_output():
    hub, rings = make_hub()
    hub.hello("client-0", hello(stats=True))
    key = hub.submit("client-0", submit("a"))
    rings.room["client-0"] = 0
    hub.post_stats(stats(1))
    hub.emit(key, (1,))
    hub.post_stats(stats(2))
    assert hub.flush() == 0 and hub.pending()
    rings.room["client-0"] = 1
    assert hub.flush() == 1
    assert rings.sent["client-0"] == [tokens("a", (1,))]  # the output first
    rings.room["client-0"] = 10
    assert hub.flush() == 1 and not hub.pending()
    assert rings.sent["client-0"] == [tokens("a", (1,)), stats(2, 1)]  # stats(1) never went


def test_a_stats_held_for_a_client_is_not_counted_against_its_max_queued():
    hub, rings = make_hub(max_queued=2)
    hub.hello("client-0", hello(stats=True))
    keys = [hub.submit("client-0", submit(r)) for r in "ab"]
    rings.room["client-0"] = 0
    for key in keys:
        hub.emit(key, (1,))  # two queued: at max_queued, not past it
    for steps in range(10):
        hub.post_stats(stats(steps))
    assert hub.stuck_or_dead() == []
    rings.room["client-0"] = 10
    assert hub.flush() == 3
    assert rings.sent["client-0"] == [tokens("a", (1,)), tokens("b", (1,)), stats(9, 1)]


def test_the_stats_of_a_lost_client_are_dropped_and_none_are_held_for_it_after():
    hub, rings = make_hub()
    gone = ProcessStamp(pid=ME.pid, start_ticks=ME.start_ticks + 1)  # a recycled pid
    hub.hello("client-0", hello(stamp=gone, stats=True))
    hub.hello("client-1", hello(stats=True))
    rings.room["client-0"] = rings.room["client-1"] = 0
    hub.post_stats(stats(1))
    rings.dead.add("client-1")
    hub.stuck_or_dead()  # client-0's process is gone
    assert hub.flush() == 0  # client-1's ring's reader is gone
    assert not hub.pending() and not hub.watching()
    hub.post_stats(stats(2))
    assert not hub.pending()
    rings.room.clear()
    rings.dead.clear()
    assert hub.flush() == 0 and not any(rings.sent.values())


def test_a_new_incarnation_drops_the_stats_held_for_the_old_one():
    hub, rings = make_hub()
    hub.hello("client-0", hello(1, stats=True))
    rings.room["client-0"] = 0
    hub.post_stats(stats(1))
    hub.hello("client-0", hello(2))
    assert not hub.pending()
    rings.room["client-0"] = 10
    hub.post_stats(stats(2))
    assert hub.flush() == 0


def test_a_stats_round_trips_through_the_codec():
    msg = dataclasses.replace(
        stats(7, 3),
        running=2,
        waiting=1,
        preemptions={"recompute": 0, "swap": 4, "save": 0},
        bytes={"swap_out": 1 << 40, "swap_in": 5, "store_write": 0, "store_read": 0},
    )
    kind, payload = ENGINE_TO_CLIENT.encode(msg)
    assert ENGINE_TO_CLIENT.decode(kind, payload) == msg
    # A Hello of a client that does not know the field decodes as not asking.
    kind, payload = CLIENT_TO_ENGINE.encode(hello(stats=True))
    older = orjson.loads(payload)
    del older["stats"]
    assert CLIENT_TO_ENGINE.decode(kind, orjson.dumps(older)) == hello()


def test_a_batched_flush_sends_each_clients_queue_and_stats_with_one_send_many():
    hub, rings = make_hub()
    if not BATCHED[0]:
        pytest.skip("the batched hub only")
    hub.hello("c-0", hello(stats=True))
    keys = [hub.submit("c-0", submit(f"r{i}")) for i in range(3)]
    for key in keys:
        hub.emit(key, (1,))
    hub.post_stats(stats(7))
    assert hub.flush() == 4
    assert rings.batches == [4]
    assert [type(m).__name__ for m in rings.sent["c-0"]] == ["Tokens"] * 3 + ["Stats"]
    assert not hub.pending()
