"""The life of one request replayed from hand-built run dirs (actors/replay/request.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from ringfence.actors.replay.log import read_run
from ringfence.actors.replay.request import TRACE_NOTE, request_life

T0 = 1000.0


class _Run:
    """Log lines for a run dir, every one a millisecond after the last."""

    def __init__(self) -> None:
        self.files: dict[str, list[dict[str, Any]]] = {}
        self.ts = T0

    def log(self, source: str, event: str, **fields: Any) -> None:
        actor, rank = source.rsplit("-", 1)
        line = {"ts": self.ts, "level": "trace", "actor": actor, "rank": int(rank)}
        self.files.setdefault(source, []).append(
            {**line, "pid": 1, "epoch": 0, **fields, "event": event}
        )
        self.ts += 0.001

    def engine(self, event: str, **fields: Any) -> None:
        self.log("engine-0", event, **fields)

    def step(
        self, number: int, pieces: list[list[Any]], outputs: list[list[int]], status: str = "ok"
    ) -> None:
        self.engine("op.issue", lane="step", op=number, fence={}, pieces=pieces, poison=[])
        self.log(
            "worker-0",
            "step.done",
            step=number,
            status=status,
            error=None if status == "ok" else "malformed",
        )
        self.engine("sched.step", step=number, msg_epoch=0, status=status, outputs=outputs)

    def transfer(
        self,
        lane: str,
        number: int,
        direction: str,
        reason: str,
        device: list[int],
        host: list[int],
        missing: list[int] | None = None,
    ) -> None:
        self.engine(
            "op.issue",
            lane=lane,
            op=number,
            fence={},
            direction=direction,
            reason=reason,
            device_blocks=device,
            host_blocks=host,
        )
        self.ts += 0.004  # the copy
        self.log(
            f"{lane}-0",
            "lane.done",
            lane=lane,
            op=number,
            status="ok",
            direction=direction,
            missing=missing or [],
        )
        self.engine(
            "sched.transfer", lane=lane, op=number, msg_epoch=0, status="ok", missing=missing or []
        )

    def write(self, root: Path) -> Path:
        for source, lines in self.files.items():
            (root / f"{source}.jsonl").write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
        return root


def _arrive(run: _Run, request: str, seq_id: int, prompt: int, max_tokens: int) -> None:
    run.engine("sched.add", request=request, prompt=[1] * prompt, params={"max_tokens": max_tokens})
    run.engine(
        "request.arrive",
        level="info",
        request=request,
        seq_id=seq_id,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        arrival_s=0.0,
    )


def _traced_run(root: Path) -> Path:
    run = _Run()
    _arrive(run, "r-0", 0, 40, 8)
    _arrive(run, "r-1", 1, 32, 4)
    admit = {"computed": 0, "device": 0, "host": 32, "storage": 0}
    run.engine("sched.schedule", ops=[["swap", 1], ["step", 1]], decisions=[["admit", 0, admit]])
    run.transfer("swap", 1, "in", "admit", [5, 6], [2, 3])
    run.step(1, [[0, 32, 4, False, [5, 6, 7]]], [])
    run.engine("sched.schedule", ops=[["step", 2]], decisions=[])
    run.step(2, [[0, 36, 4, True, [5, 6, 7]]], [[0, 11]])
    for number, position, token in ((3, 40, 12), (4, 41, 13)):
        run.engine("sched.schedule", ops=[["step", number]], decisions=[])
        run.step(number, [[0, position, 1, True, [5, 6, 7]]], [[0, token]])
    prefetch = [
        ["admit", 1, {"computed": 0, "device": 0, "host": 0, "storage": 32}],
        ["prefetch", 1, {"op": 2, "blocks": 2}],
    ]
    preempt = [["preempt", 0, {"policy": "swap", "computed": 42}]]
    run.engine(
        "sched.schedule",
        ops=[["swap", 2], ["swap", 3], ["store", 1], ["store", 2]],
        decisions=preempt + prefetch,
    )
    run.transfer("swap", 2, "out", "preempt", [5, 6, 7], [8, 9, 10])
    run.transfer("swap", 3, "out", "evict", [20], [11])  # not its blocks
    run.transfer("store", 1, "write", "evict", [], [8, 11])  # half of it is its swap-out's
    run.transfer("store", 2, "read", "prefetch", [], [12, 13], missing=[16, 17])
    resume = [["resume", 0, {"computed": 42, "device": 0, "host": 42, "storage": 0}]]
    run.engine("sched.schedule", ops=[["swap", 4], ["step", 5]], decisions=resume)
    run.transfer("swap", 4, "in", "resume", [12, 13, 14], [8, 9, 10])
    run.step(5, [[0, 42, 1, True, [12, 13, 14]]], [[0, 14]])
    run.engine("sched.schedule", ops=[["step", 6]], decisions=[])
    run.step(6, [[0, 43, 1, True, [12, 13, 14]]], [], status="rejected")
    cached = {"device": 0, "host": 32, "storage": 0}
    run.engine(
        "request.finish",
        level="info",
        request="r-0",
        reason="error",
        output_tokens=4,
        cached_tokens=cached,
        error="step 6 rejected",
    )
    return run.write(root)


def _text(lines: list[str]) -> list[str]:
    """The lines without their time prefix."""
    return [line.split(" ", 1)[1] for line in lines]


def test_the_life_of_a_preempted_request(tmp_path: Path) -> None:
    lines = request_life(read_run(_traced_run(tmp_path)), "r-0")
    assert lines[0] == "+0.000s request r-0 (seq 0) arrived: 40 prompt tokens, max_tokens 8"
    assert all(line.startswith("+") and line.split(" ", 1)[0].endswith("s") for line in lines)
    assert _text(lines)[1:] == [
        "admitted: cached device 0 / host 32 / storage 0 tokens, 0 computed",
        "swap-in (admit) swap op 1: 2 blocks, ok after 5.0 ms",
        "step 1: prefill positions 32-35, 3 blocks",
        "step 2: prefill positions 36-39, 3 blocks, first token 11",
        "steps 3-4: 2 decodes, tokens [12, 13]",
        "preempted (swap): 42 computed tokens",
        "swap-out (preempt) swap op 2: 3 blocks, ok after 5.0 ms",
        "write-back (evict) store op 1: 1 of 2 blocks, ok after 5.0 ms",
        "resumed: cached device 0 / host 42 / storage 0 tokens, 42 computed",
        "swap-in (resume) swap op 4: 3 blocks, ok after 5.0 ms",
        "step 5: 1 decode, tokens [14]",
        "step 6: decode position 43: rejected (malformed)",
        "finished: error, 4 output tokens, cached device 0 / host 32 / storage 0, "
        "error: step 6 rejected",
    ]


def test_a_prefetching_request_still_in_flight(tmp_path: Path) -> None:
    lines = _text(request_life(read_run(_traced_run(tmp_path)), "r-1"))
    assert lines[1:] == [
        "admitted: cached device 0 / host 0 / storage 32 tokens, 0 computed",
        "prefetch: store op 2, 2 blocks",
        "prefetch store op 2 done after 5.0 ms: ok, 2 positions missing [16, 17]",
        "still in flight at the end of the log",
    ]


def test_an_unknown_request_names_known_ones(tmp_path: Path) -> None:
    log = read_run(_traced_run(tmp_path))
    with pytest.raises(KeyError, match=r"'nope' never arrived.*2 did: r-0, r-1"):
        request_life(log, "nope")


def test_an_info_level_log_gives_arrival_and_finish(tmp_path: Path) -> None:
    run = _Run()
    run.engine(
        "request.arrive",
        level="info",
        request="r-0",
        seq_id=0,
        prompt_tokens=40,
        max_tokens=8,
        arrival_s=0.0,
    )
    run.log("worker-0", "step.done", step=1, status="ok")
    cached = {"device": 16, "host": 0, "storage": 0}
    run.engine(
        "request.finish",
        level="info",
        request="r-0",
        reason="length",
        output_tokens=8,
        cached_tokens=cached,
        error="",
    )
    log = read_run(run.write(tmp_path))
    assert not log.traced
    assert request_life(log, "r-0") == [
        "+0.000s request r-0 (seq 0) arrived: 40 prompt tokens, max_tokens 8",
        f"+0.000s {TRACE_NOTE}",
        "+0.002s finished: length, 8 output tokens, cached device 16 / host 0 / storage 0",
    ]


def test_with_two_ranks_a_prefetch_is_done_once_the_engine_applied_every_ranks(
    tmp_path: Path,
) -> None:
    run = _Run()
    _arrive(run, "r-1", 1, 32, 4)
    admit = ["admit", 1, {"computed": 0, "device": 0, "host": 0, "storage": 32}]
    prefetch = ["prefetch", 1, {"op": 1, "blocks": 2}]
    run.engine("sched.schedule", ops=[["store", 1]], decisions=[admit, prefetch])
    run.engine(
        "op.issue", lane="store", op=1, fence={}, direction="read", reason="prefetch",
        device_blocks=[], host_blocks=[12, 13],
    )  # fmt: skip
    for rank, missing in ((0, [16]), (1, [17])):  # each rank's shard lacks another position
        run.log(
            f"store-{rank}", "lane.done", lane="store", op=1, status="ok", direction="read",
            missing=missing,
        )  # fmt: skip
    run.engine("sched.transfer", lane="store", op=1, msg_epoch=0, status="ok", missing=[16, 17])
    lines = _text(request_life(read_run(run.write(tmp_path)), "r-1"))
    assert lines[1:] == [
        "admitted: cached device 0 / host 0 / storage 32 tokens, 0 computed",
        "prefetch: store op 1, 2 blocks",
        "prefetch store op 1 done after 1.0 ms: ok, 2 positions missing [16, 17]",
        "still in flight at the end of the log",
    ]
