"""The client faults of ``ringfence bench faults``: a client that floods the engine, and a
client killed while its tokens stream (:mod:`ringfence.actors.tools.bench.faults.runner`
runs them)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

from ringfence.actors.tools.bench.faults.runner import (
    Launch,
    Outcome,
    Scenario,
    reference,
    workload_of,
)


def flood(launch: Launch, scenario: Scenario, outcome: Outcome) -> None:
    """One client floods the engine with short requests and reads nothing until it is
    done; another is served the workload meanwhile. The flood must cost the engine a
    bounded number of live requests (``engine.max_requests_per_client``), each flood
    request must be served (the reference's first tokens) or refused at once, and a
    full ring must make the flooder's submit fail at its deadline, never block it."""
    from ringfence.actors.client.client import Client, ClientError
    from ringfence.shm.errors import RingFull

    lines = workload_of(scenario)
    expected = reference(scenario.workload, scenario.requests)
    first = lines[0]
    prompt = list(first.prompt_token_ids or ())
    floods = FLOODS[scenario.requests <= QUICK_REQUESTS]
    sent: list[str] = []
    with Client.connect(launch.run_dir) as flooder, Client.connect(launch.run_dir) as good:
        for i in range(floods):
            # Backpressure: RingFull when the ring stayed full past the send deadline.
            with contextlib.suppress(RingFull):
                sent.append(flooder.submit(prompt, request_id=f"flood-{i}", max_tokens=2))
        outcome.injected = floods
        _serve(good, lines, expected, launch, outcome)
        served = refused = 0
        for request_id in sent:
            try:
                done = flooder.result(request_id, timeout=max(launch.remaining(), 1.0))
            except ClientError as e:
                refused += 1
                if "unfinished" not in str(e):
                    outcome.notes.append(f"{request_id}: {e}")
                continue
            served += 1
            outcome.wrong_tokens += list(done.token_ids) != expected[first.id][:2]
        peer = flooder.instance
    live = _most_live(launch, peer)
    cap = next(int(x.split("=")[1]) for x in scenario.sets if "max_requests_per_client" in x)
    if live > cap:
        outcome.notes.append(f"the engine held {live} live requests of the flooder, cap {cap}")
    outcome.info.append(
        f"flood of {floods}: {served} served, {refused} refused at once, "
        f"{floods - len(sent)} timed out on a full ring; at most {live} live in the engine"
    )


def killed_client(launch: Launch, scenario: Scenario, outcome: Outcome) -> None:
    """A client process is SIGKILLed while it streams a long request: the engine must abort
    the request (``client.lost``) and serve another client the workload exactly."""
    import multiprocess

    from ringfence.actors.client.client import Client

    lines = workload_of(scenario)
    marker = launch.run_dir.parent / "streaming.txt"
    prompt = list(lines[0].prompt_token_ids or ())[:32]  # with 300 tokens to come: 21 blocks
    context = multiprocess.get_context("spawn")
    doomed = context.Process(target=_stream, args=(str(launch.run_dir), prompt, str(marker)))
    doomed.start()
    try:
        launch.wait_for("the doomed client's first token", marker.exists)
        slot = marker.read_text().split()[0]
        os.kill(doomed.pid, signal.SIGKILL)  # our own child, by pid
        outcome.injected = 1
    finally:
        doomed.join(10.0)
    launch.wait_for(
        f"client.lost of {slot}",
        lambda: any(e.get("peer") == slot for e in launch.events("engine-0", "client.lost")),
    )
    expected = reference(scenario.workload, scenario.requests)
    with Client.connect(launch.run_dir) as good:
        _serve(good, lines, expected, launch, outcome)


def _stream(run_dir: str, prompt: list[int], marker: str) -> None:
    """In a spawned process: stream a long request, "<slot>" to ``marker`` at its first token."""
    from ringfence.actors.client.client import Client

    with Client.connect(run_dir) as client:
        request_id = client.submit(prompt, request_id="doomed", max_tokens=300)
        for n, _token in enumerate(client.stream(request_id, timeout=300.0)):
            if n == 0:
                Path(marker).write_text(client.instance)


def _serve(
    client: Any, lines: list[Any], expected: dict[str, list[int]], launch: Launch, outcome: Outcome
) -> None:
    """The workload's requests through ``client``, one at a time, judged against the reference."""
    for line in lines:
        done = client.generate(
            list(line.prompt_token_ids or ()),
            max_tokens=line.params.max_tokens,
            seed=line.params.seed,
            timeout=max(launch.remaining(), 1.0),
        )
        outcome.completed += 1
        outcome.wrong_tokens += list(done.token_ids) != expected[line.id]


def _most_live(launch: Launch, peer: str) -> int:
    """The most requests of client ``peer`` live in the engine at once, from its log."""
    live = most = 0
    entries = [
        e
        for e in launch.lines("engine-0")
        if e.get("event") in ("request.arrive", "request.finish")
        and str(e.get("request", "")).startswith(f"{peer}/")
    ]
    for entry in entries:
        live += 1 if entry["event"] == "request.arrive" else -1
        most = max(most, live)
    return most


FLOODS = {False: 2000, True: 400}  # flood requests (full, quick)
QUICK_REQUESTS = 4
