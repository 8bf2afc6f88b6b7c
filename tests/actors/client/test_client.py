"""Clients of a launched run: connect by run dir, submit, stream, abort, and survive failures.

Each run launches fixture_clients:CLIENTS (EchoEngine and CLIENT_SLOTS optional client
slots); the clients connect from this process or from spawned ones. The tests that only talk
to the engine through clients share one run (``echo``); those that kill a client or the
engine launch their own.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import peers
import pytest
from fixture_clients import EXPLODE, NO_RESERVATIONS, REFUSED, echo_tokens
from launching import QUICK, Launch, launched, wait_until

from ringfence.actors.client.client import CLIENT_SLOTS, Client, ClientError, Completion
from ringfence.shm import names
from ringfence.shm.liveness import ProcessStamp

TOPOLOGY = "runtime.topology=fixture_clients:CLIENTS"
WAIT_S = 30.0


@contextlib.contextmanager
def echo_run(tmp_path: Path, *sets: str) -> Iterator[Launch]:
    """A launched EchoEngine run, ready; stopped with SIGTERM (exit 143) and checked clean."""
    with launched(tmp_path, TOPOLOGY, *QUICK, *sets) as run:
        run.wait_ready("engine-0")
        yield run
        run.send_signal(signal.SIGTERM)
        assert run.wait() == 143, run.tail()
        assert names.list_names(run.run_id) == []


@pytest.fixture(scope="module")
def echo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launch]:
    """One EchoEngine run for the tests below that only talk to it through clients of this
    process or of a spawned one: each closes its clients (their slots are free again for the
    next) and leaves the engine as it found it. A launch is most of such a test's time; the
    tests that kill a client or the engine launch their own (:func:`echo_run`)."""
    with echo_run(tmp_path_factory.mktemp("echo")) as run:
        yield run


def test_a_client_streams_the_tokens_of_a_request_in_order(echo):
    with Client.connect(echo.run_dir) as client:
        assert client.instance == "client-0"
        request_id = client.submit([5, 6, 7], max_tokens=5, request_id="r1")
        assert request_id == "r1"
        assert list(client.stream("r1", timeout=WAIT_S)) == [7, 6, 5, 7, 6]
        with pytest.raises(KeyError, match="no unread request 'r1'"):
            client.result("r1")


def test_a_reservation_the_engine_refuses_is_answered_with_why_and_the_client_goes_on(echo):
    with Client.connect(echo.run_dir) as client:
        answer = client.reserve([1, 2, 3], max_tokens=4, timeout=WAIT_S)
        assert (answer.granted, answer.retry, answer.error) == (False, False, NO_RESERVATIONS)
        assert answer.incarnation > 0  # the hub answers the current incarnation
        assert list(client.stream(client.submit([4, 5], max_tokens=2), timeout=WAIT_S)) == [5, 4]


def test_generate_returns_the_completion_with_cache_hits_and_ttft(echo):
    with Client.connect(echo.run_dir) as client:
        done = client.generate("ab", max_tokens=3, request_id="t", timeout=WAIT_S)
        assert done == Completion(
            request_id="t",
            token_ids=(ord("b"), ord("a"), ord("b")),
            finish_reason="length",
            cached_tokens={"device": 1, "host": 2, "storage": 3},
            ttft_s=0.5,
        )
        stopped = client.generate([1, 2, 3], max_tokens=10, stop_token_ids=[1], timeout=WAIT_S)
        assert (stopped.token_ids, stopped.finish_reason) == ((3, 2, 1), "stop")


def test_chat_sends_the_messages_for_the_engine_to_render(echo):
    with Client.connect(echo.run_dir) as client:
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"}]
        done = client.chat(chat, max_tokens=3, request_id="c", timeout=WAIT_S)
        assert (done.request_id, done.token_ids) == ("c", (ord("b"), ord("a"), ord("b")))


def test_an_aborted_request_ends_with_abort_after_the_tokens_it_had(echo):
    with Client.connect(echo.run_dir) as client:
        request_id = client.submit([1, 2], max_tokens=1_000_000)
        stream = client.stream(request_id, timeout=WAIT_S)
        first = [next(stream), next(stream), next(stream)]
        client.abort(request_id)
        rest = list(stream)
        assert first + rest == echo_tokens((1, 2), len(first) + len(rest))
        client.abort(request_id)  # after the end: nothing to do


def test_a_rejected_request_and_a_failed_handler_raise_client_error(echo):
    with Client.connect(echo.run_dir) as client:
        refused = client.submit([1, REFUSED])
        with pytest.raises(ClientError, match=f"rejected: token {REFUSED} is refused"):
            client.result(refused, timeout=WAIT_S)
        exploded = client.submit([EXPLODE])
        with pytest.raises(
            ClientError, match=f"the engine failed on it: Exploded: token {EXPLODE}"
        ):
            list(client.stream(exploded, timeout=WAIT_S))
        assert client.generate([4], max_tokens=2, timeout=WAIT_S).token_ids == (4, 4)


def test_bad_parameters_are_refused_before_anything_is_sent(echo):
    with Client.connect(echo.run_dir) as client:
        with pytest.raises(
            ValueError, match="exactly one of prompt_token_ids, prompt and messages"
        ):
            client.submit([])
        with pytest.raises(
            ValueError, match="exactly one of prompt_token_ids, prompt and messages"
        ):
            client.chat([])
        with pytest.raises(ValueError, match=r"messages\[1\]\.content must be a string"):
            client.chat([{"role": "user", "content": "hi"}, {"role": "assistant"}])
        with pytest.raises(ValueError, match="max_tokens must be >= 1"):
            client.submit([1], max_tokens=0)
        for top_p in (0.0, 1.5):
            with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got"):
                client.submit([1], temperature=1.0, top_p=top_p)
            with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got"):
                client.chat([{"role": "user", "content": "hi"}], top_p=top_p)
        client.submit([1], request_id="same", max_tokens=50)
        with pytest.raises(ValueError, match="'same' is in use"):
            client.submit([2], request_id="same")


def test_a_request_not_finished_by_its_deadline_raises_timeout_error(echo):
    with Client.connect(echo.run_dir) as client:
        request_id = client.submit([1], max_tokens=1_000_000)
        with pytest.raises(TimeoutError, match=r"did not finish within 0\.3s"):
            client.result(request_id, timeout=0.3)


def test_two_clients_use_two_slots_and_the_same_request_id_independently(echo):
    with Client.connect(echo.run_dir) as one, Client.connect(echo.run_dir) as two:
        assert (one.instance, two.instance) == ("client-0", "client-1")
        one.submit([1, 2], request_id="x", max_tokens=4)
        two.submit([3, 4], request_id="x", max_tokens=3)
        assert two.result("x", timeout=WAIT_S).token_ids == (4, 3, 4)
        assert one.result("x", timeout=WAIT_S).token_ids == (2, 1, 2, 1)
    # Closed clients free their slots: the next connect takes slot 0 again.
    with Client.connect(echo.run_dir) as again:
        assert again.instance == "client-0"
        assert again.generate([9], max_tokens=1, timeout=WAIT_S).token_ids == (9,)


def test_connecting_when_every_slot_is_taken_is_a_clear_error(echo):
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(Client.connect(echo.run_dir)) for _ in range(CLIENT_SLOTS)]
        assert [c.instance for c in clients] == [f"client-{r}" for r in range(CLIENT_SLOTS)]
        with pytest.raises(ClientError, match=f"all {CLIENT_SLOTS} client slots of run .* taken"):
            Client.connect(echo.run_dir)


def test_a_client_in_another_process_generates(echo, tmp_path):
    out = tmp_path / "out.txt"
    child = peers.start(
        peers_target("generate_in_child"), str(echo.run_dir), [1, 2, 3], 4, str(out)
    )
    assert peers.finish(child, WAIT_S) == 0
    assert out.read_text() == "client-0 3 2 1 3"


def test_a_client_killed_mid_stream_is_seen_by_the_engine_and_its_slot_is_reused(tmp_path):
    out = tmp_path / "out.txt"
    with echo_run(tmp_path) as run:
        child = peers.start(peers_target("stream_forever_in_child"), str(run.run_dir), str(out))
        try:
            wait_until("the child's first token", out.exists, WAIT_S)
            slot, pid = out.read_text().split()
            child.kill()  # SIGKILL
            child.join(WAIT_S)
        finally:
            peers.finish(child, WAIT_S)
        lost = run.wait_for_event("client.lost", log="engine-0", peer=slot)
        assert (lost["reason"], lost["aborted"]) == ("its process is gone", 1)
        assert ProcessStamp.of(int(pid)) is None
        with Client.connect(run.run_dir) as client:
            assert client.instance == slot
            assert client.generate([8, 9], max_tokens=2, timeout=WAIT_S).token_ids == (9, 8)
        hellos = run.events("client.hello", log="engine-0", peer=slot)
        assert [h["incarnation"] for h in hellos] == [1, 2]


def test_a_waiting_client_learns_the_engine_is_gone_and_talks_to_its_successor(tmp_path):
    restart_at_once = "actors.engine.backoff_s=0.0"
    with echo_run(tmp_path, restart_at_once) as run, Client.connect(run.run_dir) as client:
        request_id = client.submit([1], max_tokens=1_000_000)
        stream = client.stream(request_id, timeout=WAIT_S)
        next(stream)
        run.kill_actor("engine-0")
        with pytest.raises(ClientError, match="the engine is gone"):
            list(stream)
        run.wait_for_event("actor.ready", instance="engine-0", incarnation=2)
        assert client.generate([2, 3], max_tokens=2, timeout=WAIT_S).token_ids == (3, 2)


def test_a_client_that_asked_for_stats_gets_the_newest_and_keeps_them_across_an_engine_restart(
    tmp_path,
):
    restart_at_once = "actors.engine.backoff_s=0.0"
    with (
        echo_run(tmp_path, restart_at_once) as run,
        Client.connect(run.run_dir, stats=True) as watcher,
        Client.connect(run.run_dir) as other,
    ):
        first = watcher.stats(timeout=WAIT_S)  # the one sent right after the Hello
        assert first is not None and first.began and first.incarnation == 1
        request_id = watcher.submit([1], max_tokens=1_000_000)
        later = watcher.stats(timeout=WAIT_S, fresh=True)
        for _ in range(2):  # a tick's Stats may have left before the Submit was handled
            if later is None or later.running:
                break
            later = watcher.stats(timeout=WAIT_S, fresh=True)
        assert later is not None and later.steps > first.steps and later.running == 1
        assert watcher.stats() is later  # nothing newer handled: the same one
        with pytest.raises(ClientError, match="client-1 did not ask for stats"):
            other.stats()
        run.kill_actor("engine-0")
        run.wait_for_event("actor.ready", instance="engine-0", incarnation=2)
        with pytest.raises(ClientError, match="the engine is gone"):
            watcher.result(request_id, timeout=WAIT_S)
        watcher.stats()  # handles what the dead engine left, says Hello to the new one
        again = watcher.stats(timeout=WAIT_S, fresh=True)
        assert again is not None and again.running == 0  # the new engine's


def peers_target(name: str):
    import fixture_clients

    return getattr(fixture_clients, name)
