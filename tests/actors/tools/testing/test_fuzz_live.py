"""Fuzzed frames in live runs, whose outputs must not change.

Every actor of the run runs in this process (inproc.py) over the run's real rings, and
some of them are fuzzing peers (fixture_fuzz.py): after each real message to a peer they
put fuzzed frames (fuzzing.py) on the same ring. Then:

- the protocol harness, fuzzing the Worker and both lanes between the ops of its random
  programs, finds every program equal to its sequential interpretation, bit for bit (and
  so it does in a launched run, every actor in a process of its own: the slow soak);
- the engine on a workload, with the engine fuzzing its executors, the executors fuzzing
  the engine, and a client putting garbage on its ring to the engine all the while, gives
  every request exactly the tokens of the plain loop.

Bugs found this way have tests at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from uuid import uuid4

import orjson
import pytest
from fixture_fuzz import EXECUTORS, FUZZED_FILE, TO, FuzzingPeer, fuzzing, write_pools
from fuzzing import Form, Fuzz, decode, frames, run_examples
from hypothesis import strategies as st
from inproc import InprocRun, inproc_run
from launching import launched
from random_workloads import ENGINE, RUN_TIMEOUT_S, TIERS, outputs, reference, write_workload

from ringfence.actors.client.client import ClientActor
from ringfence.actors.engine.actor import Engine
from ringfence.actors.executors.worker import Worker
from ringfence.actors.protocol.client import CLIENT_TO_ENGINE, Submit
from ringfence.actors.protocol.transfer import FROM_TRANSFER
from ringfence.actors.protocol.worker import FROM_WORKER, StepResult
from ringfence.actors.tools.testing.harness import REPORT, Harness
from ringfence.runtime.driver import Driver
from ringfence.runtime.embed import attach
from ringfence.runtime.mailbox import RingOutbox
from ringfence.runtime.messages import Stop
from ringfence.shm.errors import ProtocolError, RingFull

LIVE_PAYLOAD = 1 << 16  # fuzzed frames in live runs stay small: rings keep flowing
VOCAB = 259  # the tiny preset's
# A form's ``batches`` is what each fuzzing peer puts after each real message ("every"),
# ``batch`` the size of each pool of frames it draws from, ``examples`` the runs; then the
# harness's programs, or the workload's requests, per run.
HARNESS_FORMS = [
    pytest.param(Form(examples=1, batches=1, batch=12, frames=50), 2, id="ci"),
    pytest.param(Form(examples=6, batches=4, batch=40, frames=10_000), 20, id="soak",
                 marks=pytest.mark.slow),
]  # fmt: skip
ENGINE_FORMS = [
    pytest.param(Form(examples=1, batches=1, batch=12, frames=50), 6, id="ci"),
    # Seven pools of 12: more is more data than Hypothesis draws for one example.
    pytest.param(Form(examples=24, batches=4, batch=12, frames=60_000), 24, id="soak",
                 marks=pytest.mark.slow),
]  # fmt: skip


def pools(registries: dict[str, Any], size: int = 12) -> st.SearchStrategy[dict[str, list[Fuzz]]]:
    """A pool of fuzzed frames per target actor name."""
    one = {
        name: st.lists(frames(registry, max_payload=LIVE_PAYLOAD), min_size=size, max_size=size)
        for name, registry in registries.items()
    }
    return st.fixed_dictionaries(one)


def fuzzed(run: InprocRun) -> dict[str, int]:
    """Fuzzed frames each peer put, by instance."""
    peers = {i: d.actor for i, d in run.drivers.items() if isinstance(d.actor, FuzzingPeer)}
    return {i: peer.fuzzed for i, peer in peers.items()}


# The protocol harness.

HARNESS = (
    "runtime.topology=ringfence.actors.tools.testing.harness:TOPOLOGY",
    "model.dtype=float64",
    "cache.block_size=4",
    "cache.device_blocks=12",
    "cache.host_blocks=12",
    "cache.poison_freed=true",
    "cache.storage.backend=local",
    "runtime.heartbeat_s=0.1",
)


def run_fuzzed_harness(
    run_dir: Path, pool: dict[str, list[Fuzz]], every: int, programs: int
) -> int:
    """Run ``programs`` as a fuzzing peer of the executors; the frames it put."""
    harness = fuzzing(Harness, pool, every)
    settings = (*HARNESS, f"harness.programs={programs}")
    with inproc_run(run_dir, settings, classes={"engine": harness}) as run:
        assert run.wait_shutdown(RUN_TIMEOUT_S), "the harness did not finish"
        assert not run.failures(), run.failures()
        put = fuzzed(run)["engine-0"]
    report = orjson.loads((run_dir / REPORT).read_bytes())
    assert report["mismatched_programs"] == 0, report["mismatches"]
    assert put >= report["ops"] // 2, (put, report["ops"])
    print(f"harness: {put} fuzzed frames between the {report['ops']} ops of {programs} programs")
    return put


@pytest.mark.parametrize(("form", "programs"), HARNESS_FORMS)
def test_harness_programs_with_fuzzed_frames_between_their_ops_equal_their_interpretation(
    tmp_path, form, programs
):
    run_examples(
        form,
        pools(TO, form.batch),
        lambda p: run_fuzzed_harness(tmp_path / uuid4().hex, p, form.batches, programs),
    )


@pytest.mark.slow
def test_a_launched_harness_fuzzing_executor_processes_equals_its_interpretation(tmp_path):
    """The same, with every actor in a process of its own (``ringfence launch``)."""

    def launch(pool: dict[str, list[Fuzz]]) -> int:
        run_dir = tmp_path / uuid4().hex
        write_pools(run_dir, pool, every=4)
        sets = (*HARNESS, "runtime.topology=fixture_fuzz:HARNESS_TOPOLOGY", "harness.programs=20")
        with launched(tmp_path, *sets, run_dir=run_dir) as run:
            assert run.wait(RUN_TIMEOUT_S * 6) == 0, run.tail()
        report = orjson.loads((run_dir / REPORT).read_bytes())
        assert report["mismatched_programs"] == 0, report["mismatches"]
        put: int = orjson.loads((run_dir / FUZZED_FILE).read_bytes())["fuzzed"]
        print(f"launched harness: {put} fuzzed frames between the {report['ops']} ops")
        return put

    run_examples(Form(examples=2, batches=4, batch=40, frames=4_000), pools(TO, 40), launch)


# The engine on a workload.


@contextmanager
def garbage_client(run_dir: Path) -> Iterator[Driver]:
    """Client slot 0 of the run, attached in this process: its driver, Hello sent."""
    driver = attach(run_dir, "client", 0, actor_cls=ClientActor)
    try:
        driver.start()
        yield driver
    finally:
        driver.close()


def tame_submit(msg: object, k: int) -> object | None:
    """A decodable client message as the garbage client sends it: a real Stop is left out,
    and every other Submit has its token ids put in the vocabulary, so that some of the
    garbage runs beside the workload (the rest is refused, an id outside it included)."""
    if isinstance(msg, Stop):
        return None
    if isinstance(msg, Submit) and k % 2:
        return dataclasses.replace(
            msg, prompt_token_ids=tuple(t % VOCAB for t in msg.prompt_token_ids)
        )
    return msg


def send_garbage(client: Driver, pool: list[Fuzz], k: int) -> bool:
    """Put pool frame ``k`` on the client's ring to the engine; False if left out."""
    fuzz = pool[k % len(pool)]
    outcome = decode(CLIENT_TO_ENGINE, fuzz.kind, fuzz.payload)
    kind, payload = fuzz.kind, fuzz.payload
    if not isinstance(outcome, ProtocolError):
        tame = tame_submit(outcome, k)
        if tame is None:
            return False
        kind, payload = CLIENT_TO_ENGINE.encode(tame)
    outbox = client.mailbox.outboxes["engine-0"]
    assert isinstance(outbox, RingOutbox)
    try:
        outbox.writer.put(kind, payload, 0.0)
    except RingFull:
        return False
    return True


def run_fuzzed_engine(
    run_dir: Path, workload: Path, pool: dict[str, list[Fuzz]], every: int
) -> int:
    """The workload with every fuzzing peer and a garbage client; the frames put in all."""
    classes = {name: fuzzing(cls, {"engine": pool[name]}, every) for name, cls in EXECUTORS.items()}
    classes["engine"] = fuzzing(Engine, {name: pool[f"to_{name}"] for name in EXECUTORS}, every)
    settings = (*ENGINE, *TIERS, f"engine.workload={workload}")
    sent = 0
    with inproc_run(run_dir, settings, classes=classes) as run, garbage_client(run_dir) as client:
        k = 0
        while not run.wait_shutdown(0.02):  # a doorbell wait: garbage goes out between
            for _ in range(4 * every):
                sent += send_garbage(client, pool["client"], k)
                k += 1
            client.poll(0)  # read what the engine answers, so its ring never fills
            assert k < 400_000, "the workload did not finish"
        assert not run.failures(), run.failures()
        peers = fuzzed(run)
    assert all(peers.values()), peers
    assert outputs(run_dir) == reference(workload)
    # The engine answered the client's garbage (all of its pool went out, and a pool of 12
    # holds a frame the codec refuses but for a fluke) with Failed, and logged it.
    outcomes = [decode(CLIENT_TO_ENGINE, f.kind, f.payload) for f in pool["client"]]
    if k >= len(outcomes) and any(isinstance(o, ProtocolError) for o in outcomes):
        assert "client-0" in refused_by(run_dir, "engine-0")
    print(f"engine: fuzzed frames put by each peer {peers}, by the client {sent}")
    return sent + sum(peers.values())


def refused_by(run_dir: Path, instance: str) -> set[str]:
    """The peers whose frames ``instance`` answered with a ProtocolError (msg.failed)."""
    lines = map(orjson.loads, (run_dir / f"{instance}.jsonl").read_bytes().splitlines())
    return {
        x["peer"] for x in lines if x["event"] == "msg.failed" and x["error"] == "ProtocolError"
    }


def engine_pools(size: int) -> st.SearchStrategy[dict[str, list[Fuzz]]]:
    return pools(
        {
            "worker": FROM_WORKER,
            "swap": FROM_TRANSFER,
            "store": FROM_TRANSFER,
            **{f"to_{name}": registry for name, registry in TO.items()},
            "client": CLIENT_TO_ENGINE,
        },
        size,
    )


@pytest.mark.parametrize(("form", "requests"), ENGINE_FORMS)
def test_a_workload_with_every_peer_fuzzing_and_a_garbage_client_gets_the_plain_loops_tokens(
    tmp_path, form, requests
):
    workload = write_workload(tmp_path / "workload.jsonl", seed=0, requests=requests)
    run_examples(
        form,
        engine_pools(form.batch),
        lambda p: run_fuzzed_engine(tmp_path / uuid4().hex, workload, p, form.batches),
    )


# Found by fuzzing (fixed in actors/engine/actor.py).


def test_a_request_with_a_token_outside_the_vocabulary_fails_alone(tmp_path):
    good = write_workload(tmp_path / "good.jsonl", seed=1, requests=3)
    bad = {"id": "bad", "prompt_token_ids": [5, VOCAB + 41], "max_tokens": 4}
    workload = tmp_path / "workload.jsonl"
    workload.write_bytes(good.read_bytes() + orjson.dumps(bad) + b"\n")
    settings = (*ENGINE, "cache.device_blocks=64", f"engine.workload={workload}")
    with inproc_run(tmp_path / "run", settings) as run:
        assert run.wait_shutdown(RUN_TIMEOUT_S)
    got = outputs(tmp_path / "run")
    assert got.pop("bad") == ()
    assert got == reference(good)


def test_a_workload_file_with_a_bad_line_ends_the_run(tmp_path):
    workload = tmp_path / "workload.jsonl"
    workload.write_text('{"id": "a", "prompt_token_ids": [5, 6]}\n{"id": "b", "prompt": 5}\n')
    with inproc_run(tmp_path / "run", (*ENGINE, f"engine.workload={workload}")) as run:
        assert run.wait_shutdown(2.0), "the run goes on after its workload failed to load"


class FutureEpochWorker(Worker):
    """Sends, before each real result, a copy stamped with an epoch the engine never issued."""

    def send(self, to: str, msg: object, *, timeout: float | None = None) -> int:
        if isinstance(msg, StepResult):
            wrong = dataclasses.replace(msg, epoch=msg.epoch + 1, status="failed")
            super().send(to, wrong, timeout=timeout)
        return super().send(to, msg, timeout=timeout)


def test_a_step_result_of_an_epoch_the_engine_never_issued_changes_nothing(tmp_path):
    workload = tmp_path / "workload.jsonl"
    workload.write_text('{"id": "a", "prompt_token_ids": [5, 6, 7], "max_tokens": 4}\n')
    settings = (*ENGINE, "cache.device_blocks=32", f"engine.workload={workload}")
    with inproc_run(tmp_path / "run", settings, classes={"worker": FutureEpochWorker}) as run:
        assert run.wait_shutdown(2.5), "the workload stalled"
    assert outputs(tmp_path / "run") == reference(workload)
