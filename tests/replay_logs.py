"""Synthetic run dirs for the replay tests: the logs of an engine, a worker and two lanes
per rank.

:class:`Logs` writes lines as ringfence's actors do (the common fields of log.py, the
events and fields of runtime/events/), at trace level, with every ring message logged
at both ends with consecutive sequence numbers. :meth:`Logs.op` runs one op start to
end (schedule, issue, plan message to every rank, each rank's completion and result
message, application) before the next, so every executor sees every earlier op done at
its rank unless a test says otherwise. ``Logs(ranks=2)`` runs two ranks of each
executor (``worker-0``, ``worker-1``, ``swap-0``, ...; docs/design.md,
"Ranks (tensor parallelism)"). Tests then edit ``Logs.files`` (drop, repeat or change
lines) before :meth:`Logs.write`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

T0 = 1_700_000_000.0
ENGINE = "engine-0"
CONFIG = "[cache]\nblock_size = 4\n\n[parallel]\ntp_size = {ranks}\n"
ACTORS = {"step": "worker", "swap": "swap", "store": "store"}  # each lane's executor
Line = dict[str, Any]


def executor(lane: str, rank: int = 0) -> str:
    """``worker-0``, ``swap-1``: the log of ``lane``'s executor at ``rank``."""
    return f"{ACTORS[lane]}-{rank}"


class Logs:
    """The lines of each log of one run dir, built in time order (see the module docstring)."""

    def __init__(self, ranks: int = 1) -> None:
        self.ranks = range(ranks)
        executors = [executor(lane, rank) for rank in self.ranks for lane in ACTORS]
        self.sources = ("supervisor-0", ENGINE, *executors)
        self.files: dict[str, list[Line]] = {source: [] for source in self.sources}
        self.clock = 0
        self.pid: dict[str, int] = {}
        self.epoch = 0
        self.launches = 0
        self.launch()

    def launch(self) -> None:
        """A (new) launch on this run dir: run.start, fresh processes, rings and lanes."""
        self.launches += 1
        self.pid = {source: 100 * self.launches + i for i, source in enumerate(self.sources)}
        self.seq: Counter[tuple[str, str]] = Counter()  # (sender, receiver) -> last seq
        self.watermark: Counter[tuple[str, int]] = Counter()  # (lane, rank) -> last op done
        self.log("supervisor-0", "run.start", run_id=f"run{self.launches}", instances=[])

    def log(self, source: str, event: str, *, level: str = "info", **fields: Any) -> Line:
        self.clock += 1
        line = {
            "ts": T0 + self.clock / 1e3,
            "mono_ns": self.clock * 1_000_000,
            "level": level,
            "actor": source.rsplit("-", 1)[0],
            "rank": int(source.rsplit("-", 1)[1]),
            "pid": self.pid[source],
            "epoch": self.epoch,
        }
        line.update(fields, event=event)
        self.files[source].append(line)
        return line

    def message(self, sender: str, receiver: str, kind: str) -> None:
        """One ring message, logged by its sender and then its receiver."""
        self.seq[(sender, receiver)] += 1
        seq = self.seq[(sender, receiver)]
        self.log(sender, "msg.send", level="trace", peer=receiver, seq=seq, type=kind)
        self.log(receiver, "msg.recv", level="trace", peer=sender, seq=seq, type=kind)

    def arrive(self, request: str) -> None:
        self.log(
            ENGINE, "request.arrive", request=request, seq_id=0, prompt_tokens=4, max_tokens=2,
            arrival_s=0.0,
        )  # fmt: skip

    def finish(self, request: str) -> None:
        self.log(
            ENGINE, "request.finish", request=request, reason="length", output_tokens=2,
            cached_tokens={"device": 0, "host": 0, "storage": 0}, error="",
        )  # fmt: skip

    def op(
        self,
        lane: str,
        number: int,
        *,
        fence: dict[str, int] | None = None,
        seen: dict[str, int] | None = None,
        seen_at: Mapping[int, dict[str, int]] | None = None,
        done: bool = True,
        done_at: Sequence[int] | None = None,
        applied: bool | None = None,
        status: str = "ok",
        direction: str | None = None,
        device: Sequence[int] = (),
        host: Sequence[int] = (),
        pieces: Sequence[Sequence[Any]] = (),
        poison: Sequence[int] = (),
    ) -> None:
        """Op ``number`` of ``lane``, start to end, at every rank. ``seen``: the watermarks
        its executors saw (default: every earlier op done at their rank), ``seen_at``: those
        of one rank; ``done=False``: killed before any rank completed it, ``done_at``: the
        ranks that completed it (default: all); ``applied``: whether the engine applied it
        (default: once every rank completed it)."""
        fence = dict(fence or {})
        kind = "StepPlan" if lane == "step" else "TransferOp"
        self.log(ENGINE, "sched.schedule", level="trace", ops=[[lane, number]], decisions=[])
        for rank in self.ranks:
            self.message(ENGINE, executor(lane, rank), kind)
        if lane == "step":
            touched: dict[str, Any] = {"pieces": [list(p) for p in pieces], "poison": list(poison)}
        else:
            touched = {
                "direction": direction,
                "reason": "test",
                "device_blocks": list(device),
                "host_blocks": list(host),
            }
        self.log(
            ENGINE, "op.issue", level="trace", lane=lane, op=number, fence=fence, sync=False,
            **touched,
        )  # fmt: skip
        ranks = list(self.ranks if done_at is None else done_at) if done else []
        for rank in ranks:
            watermarks = {lane: n for (lane, r), n in self.watermark.items() if r == rank}
            saw = watermarks | (seen or {}) | dict((seen_at or {}).get(rank, {}))
            self._done(lane, number, rank, fence, saw, status, direction, host, pieces, poison)
        if applied if applied is not None else len(ranks) == len(self.ranks):
            self._apply(lane, number, status, pieces)

    def _done(
        self,
        lane: str,
        number: int,
        rank: int,
        fence: dict[str, int],
        seen: dict[str, int],
        status: str,
        direction: str | None,
        host: Sequence[int],
        pieces: Sequence[Sequence[Any]],
        poison: Sequence[int],
    ) -> None:
        """Rank ``rank``'s executor completes the op and reports it to the engine."""
        source = executor(lane, rank)
        waits: dict[str, Any] = {f"fence_{other}": fence.get(other, 0) for other in ACTORS}
        watermarks: dict[str, Any] = {f"seen_{other}": seen.get(other, 0) for other in ACTORS}
        if lane == "step":
            self.log(
                source, "step.done", step=number, plan_epoch=self.epoch, status=status,
                fence_swap=waits["fence_swap"], fence_store=waits["fence_store"],
                seen_swap=watermarks["seen_swap"], seen_store=watermarks["seen_store"],
                pieces=len(pieces), tokens=sum(int(p[2]) for p in pieces), poison=len(poison),
                wait_ns=0, exec_ns=1000, error=None,
            )  # fmt: skip
            self.message(source, ENGINE, "StepResult")
        else:
            watermarks[f"seen_{lane}"] = None  # a lane does not wait for itself
            self.log(
                source, "lane.done", lane=lane, op=number, op_epoch=self.epoch, status=status,
                direction=direction, **waits, **watermarks, error=None, missing=None,
                blocks=len(host), wait_ns=0, copy_ns=1000,
            )  # fmt: skip
            self.message(source, ENGINE, "TransferDone")
        self.watermark[lane, rank] = number

    def _apply(self, lane: str, number: int, status: str, pieces: Sequence[Sequence[Any]]) -> None:
        """The engine applies the op's outcome (every rank's, normally)."""
        if lane == "step":
            self.log(
                ENGINE, "sched.step", level="trace", step=number, msg_epoch=self.epoch,
                status=status, outputs=[[p[0], 7] for p in pieces if p[3]],
            )  # fmt: skip
        else:
            self.log(
                ENGINE, "sched.transfer", level="trace", lane=lane, op=number,
                msg_epoch=self.epoch, status=status, missing=[],
            )  # fmt: skip

    def find(self, source: str, event: str, **match: Any) -> int:
        """The index in ``files[source]`` of the first ``event`` line with these fields."""
        for i, line in enumerate(self.files[source]):
            if line["event"] == event and all(line.get(k) == v for k, v in match.items()):
                return i
        raise LookupError(f"no {event} {match} in {source}")

    def write(self, run_dir: Path) -> Path:
        """Every log (one JSON object a line) and a config.toml with block_size 4 and the
        ranks as ``parallel.tp_size``."""
        run_dir.mkdir(parents=True, exist_ok=True)
        for source, lines in self.files.items():
            data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
            (run_dir / f"{source}.jsonl").write_bytes(data)
        (run_dir / "config.toml").write_text(CONFIG.format(ranks=len(self.ranks)))
        return run_dir
