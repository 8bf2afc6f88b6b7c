"""Clients of the real engine: requests from other processes get the reference tokens.

The instance serves clients (no workload) until SIGTERM; at stop the engine waits for
the store lane's writes, so the storage tier holds every block it wrote back.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import orjson
import peers
import pytest
from engine_runs import ENGINE, MODEL, TIERS, TRACE, reference, replayed
from launching import QUICK, launched, wait_until

from ringfence.actors.client.client import Client, ClientError
from ringfence.actors.engine.intake import load_workload
from ringfence.shm import names

WAIT_S = 120.0
SETS = (ENGINE, *MODEL, TRACE, *TIERS, "cache.device_blocks=48", "sched.preemption=swap", *QUICK)


def remote_generate(run_dir: str, prompt: list[int], max_tokens: int, seed: int, out: str) -> None:
    """Runs in a spawned process: one request from a client of its own; tokens to ``out``."""
    with Client.connect(run_dir) as client:
        done = client.generate(prompt, max_tokens=max_tokens, seed=seed, timeout=WAIT_S)
    Path(out).write_bytes(orjson.dumps(list(done.token_ids)))


def stream_until_killed(run_dir: str, prompt: list[int], out: str) -> None:
    """Runs in a spawned process: a long request, "<slot> <pid>" to ``out`` at its first
    token, then SIGKILL to itself at once. Not the test's kill: 200 tokens take well under a
    second, and a busy test process noticing the first token late once killed a client whose
    request had finished (no request in flight, nothing for the engine to abort)."""
    with Client.connect(run_dir) as client:
        request_id = client.submit(prompt, request_id="doomed", max_tokens=200)
        for _token in client.stream(request_id, timeout=WAIT_S):
            written = Path(f"{out}.tmp")
            written.write_text(f"{client.instance} {os.getpid()}")
            written.rename(out)  # whole when the test sees it
            os.kill(os.getpid(), signal.SIGKILL)


def test_clients_in_this_and_another_process_get_the_tokens_of_the_plain_loop_and_can_abort(  # noqa: PLR0915 one launch serves every client case (CI time)
    tmp_path,
):
    lines = load_workload("synthetic:pressure", requests=4)
    expected = reference("pressure")
    with launched(tmp_path, *SETS) as run:
        run.wait_for_event("engine.ready", log="engine-0", timeout=WAIT_S)
        with Client.connect(run.run_dir) as client:
            for line in lines[:3]:
                assert line.prompt_token_ids is not None
                client.submit(
                    list(line.prompt_token_ids),
                    request_id=line.id,
                    max_tokens=line.params.max_tokens,
                    seed=line.params.seed,
                )
            other = lines[3]
            assert other.prompt_token_ids is not None
            remote = peers.start(
                remote_generate,
                str(run.run_dir),
                list(other.prompt_token_ids),
                other.params.max_tokens,
                other.params.seed,
                str(tmp_path / "remote.json"),
            )
            streamed = list(client.stream(lines[0].id, timeout=WAIT_S))
            results = {line.id: client.result(line.id, timeout=WAIT_S) for line in lines[1:3]}
            assert peers.finish(remote, timeout=WAIT_S) == 0
            remote_tokens = orjson.loads((tmp_path / "remote.json").read_bytes())
            # An aborted request ends with "abort" early; the engine serves the next one.
            client.submit(list(lines[0].prompt_token_ids or ()), request_id="long", max_tokens=60)
            stream = client.stream("long", timeout=WAIT_S)
            got = [next(stream), next(stream)]
            client.abort("long")
            assert len(got) + len(list(stream)) < 60
            # A client killed mid-stream: the engine aborts its request and serves on.
            marker = tmp_path / "doomed.txt"
            doomed = peers.start(
                stream_until_killed, str(run.run_dir), list(other.prompt_token_ids), str(marker)
            )
            try:
                wait_until("the doomed client's first token", marker.exists, WAIT_S)
                slot = marker.read_text().split()[0]  # it killed itself mid-stream
            finally:
                peers.finish(doomed, WAIT_S)

            # Between two of the engine's checks of its clients, a fast model may finish the
            # doomed request (nothing left to abort, so no client.lost); else the check finds
            # the client gone with it in flight and aborts it.
            def doomed() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
                lost = run.events("client.lost", log="engine-0", peer=slot)
                ended = [
                    e
                    for e in run.events("request.finish", log="engine-0")
                    if e["request"].startswith(f"{slot}/") and e["request"].endswith("/doomed")
                ]
                return lost, ended

            wait_until("the doomed request aborted or finished", lambda: any(doomed()), WAIT_S)
            lost, ended = doomed()
            if lost:
                doomed_key = f"{slot}/{lost[0]['incarnation']}/doomed"
                run.wait_for_event(
                    "request.finish", log="engine-0", request=doomed_key, timeout=WAIT_S
                )
            else:
                assert ended[0]["reason"] in ("length", "stop"), ended
            assert len(client.generate([1, 2, 3], max_tokens=4, timeout=WAIT_S).token_ids) == 4
            # The engine is killed under a request: its client gets a clear error, not a
            # timeout; the supervisor restarts the engine, which serves the client again.
            client.submit(
                list(lines[0].prompt_token_ids or ()), request_id="orphan", max_tokens=200
            )
            orphan = client.stream("orphan", timeout=WAIT_S)
            next(orphan)
            run.kill_actor("engine-0")
            with pytest.raises(ClientError, match="the engine is gone"):
                list(orphan)
            restart = run.wait_for_event("engine.restart", log="engine-0", timeout=WAIT_S)
            run.wait_for_event("engine.ready", log="engine-0", pid=restart["pid"], timeout=WAIT_S)
            again = client.generate(
                list(lines[1].prompt_token_ids or ()),
                max_tokens=lines[1].params.max_tokens,
                seed=lines[1].params.seed,
                timeout=WAIT_S,
            )
        assert again.token_ids == expected[lines[1].id]
        assert tuple(streamed) == expected[lines[0].id]
        for key, done in results.items():
            assert done.token_ids == expected[key] and done.finish_reason == "length"
        assert tuple(remote_tokens) == expected[other.id]
        run.send_signal(signal.SIGTERM)
        assert run.wait() == 143, run.tail()
        assert names.list_names(run.run_id) == []
        # Clients' rings, aborts, a lost client and a killed engine (its request lost) included.
        replayed(run.run_dir, lost=1)
        assert run.events("engine.drain_timeout", log="engine-0") == []
        finished = run.events("request.finish", log="engine-0")
        reasons = {f["request"].rsplit("/", 1)[-1]: f["reason"] for f in finished}
        assert len(finished) == 8 and reasons.pop("long") == "abort"
        # The doomed request was aborted when its client was found gone with it in flight (the
        # lost client's queued output alone logs client.lost with nothing aborted), else it ran out.
        if lost and lost[0]["aborted"]:
            assert reasons.pop("doomed") == "abort"
        else:
            assert reasons.pop("doomed") in ("length", "stop")
        assert set(reasons.values()) == {"length"}
