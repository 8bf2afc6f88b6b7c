"""Tests of the structured JSON-lines log: line layout, levels, buffering, files and cost."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog

from ringfence.runtime.log import TRACE_BUFFER_BYTES, ActorLog, log_path

COMMON7 = ["ts", "mono_ns", "level", "actor", "rank", "pid", "epoch"]


def make_log(
    tmp_path: Path, *, level: str = "info", epoch: int = 2, name: str = "sink-1"
) -> ActorLog:
    return ActorLog(tmp_path / f"{name}.jsonl", actor="sink", rank=1, epoch=epoch, level=level)


def file_of(log: ActorLog) -> Path:
    assert log.path is not None
    return log.path


def read_lines(log: ActorLog) -> list[dict[str, Any]]:
    """Every line of the log's file, parsed; the file must end with a whole line."""
    data = file_of(log).read_bytes()
    assert data == b"" or data.endswith(b"\n")
    return [orjson.loads(line) for line in data.splitlines()]


class CountsRenders:
    """A field value that counts how often the log renders it."""

    def __init__(self) -> None:
        self.renders = 0

    def __structlog__(self) -> str:
        self.renders += 1
        return "rendered"


def test_a_line_holds_the_common_fields_first_then_the_event_fields_then_the_event(tmp_path):
    log = make_log(tmp_path)
    wall, mono = time.time(), time.monotonic_ns()
    log.info("actor.stop", reason="done", handled=3, failures=0, error=None)
    wall_after, mono_after = time.time(), time.monotonic_ns()
    log.close()
    [line] = read_lines(log)
    assert list(line)[:7] == COMMON7
    assert list(line)[7:] == ["reason", "handled", "failures", "error", "event"]
    assert {k: line[k] for k in COMMON7[2:]} == {
        "level": "info",
        "actor": "sink",
        "rank": 1,
        "pid": os.getpid(),
        "epoch": 2,
    }
    assert line["event"] == "actor.stop"
    assert (line["reason"], line["handled"], line["failures"], line["error"]) == (
        "done",
        3,
        0,
        None,
    )
    assert wall <= line["ts"] <= wall_after
    assert mono <= line["mono_ns"] <= mono_after


def test_each_method_writes_its_own_level_in_call_order(tmp_path):
    log = make_log(tmp_path, level="trace")
    log.info("a.info")
    log.trace("b.trace")
    log.warning("c.warning")
    log.error("d.error")
    log.close()
    lines = read_lines(log)
    assert [(x["event"], x["level"]) for x in lines] == [
        ("a.info", "info"),
        ("b.trace", "trace"),
        ("c.warning", "warning"),
        ("d.error", "error"),
    ]
    assert all(list(x)[:7] == COMMON7 for x in lines)


def test_at_level_info_trace_writes_nothing_and_tracing_is_off(tmp_path):
    log = make_log(tmp_path)
    assert (log.level, log.tracing) == ("info", False)
    log.trace("msg.recv", peer="source-0", seq=1, type="Item")
    log.info("actor.start")
    log.close()
    assert [x["event"] for x in read_lines(log)] == ["actor.start"]


def test_at_level_trace_tracing_is_on(tmp_path):
    log = make_log(tmp_path, level="trace")
    assert (log.level, log.tracing) == ("trace", True)
    log.close()


def test_trace_at_level_info_is_a_no_op_that_never_renders_its_fields(tmp_path):
    log, peer = make_log(tmp_path), CountsRenders()
    log.trace("msg.recv", peer=peer)
    log.flush()
    log.close()
    assert (peer.renders, file_of(log).stat().st_size) == (0, 0)
    tracing = make_log(tmp_path, level="trace", name="tracing")
    tracing.trace("msg.recv", peer=peer)  # the same call at level trace runs the renderer
    tracing.close()
    assert peer.renders == 1
    assert [x["peer"] for x in read_lines(tracing)] == ["rendered"]


def test_a_trace_line_waits_for_a_flush_and_an_info_line_does_not(tmp_path):
    log = make_log(tmp_path, level="trace")
    log.trace("msg.recv", seq=1)
    assert read_lines(log) == []
    log.flush()
    assert [x["seq"] for x in read_lines(log)] == [1]
    log.trace("msg.recv", seq=2)
    log.info("actor.stop")  # writes the buffered trace line first, keeping the call order
    assert [x["event"] for x in read_lines(log)] == ["msg.recv", "msg.recv", "actor.stop"]
    log.trace("msg.recv", seq=3)
    log.close()  # close flushes too
    assert [x.get("seq") for x in read_lines(log)] == [1, 2, None, 3]


def test_trace_lines_are_written_once_the_buffer_passes_its_limit(tmp_path):
    log = make_log(tmp_path, level="trace")
    filler = "x" * 1000
    for i in range(2 * TRACE_BUFFER_BYTES // len(filler)):
        log.trace("msg.recv", seq=i, filler=filler)
        size = file_of(log).stat().st_size
        if size:
            break
    lines = read_lines(log)
    assert [x["seq"] for x in lines] == list(range(i + 1))
    last = len(file_of(log).read_bytes().splitlines(keepends=True)[-1])
    assert size - last < TRACE_BUFFER_BYTES <= size
    log.close()


@pytest.mark.parametrize("level", ["debug", "warning", "INFO", ""])
def test_an_unknown_level_is_a_value_error_naming_the_config_key(tmp_path, level):
    with pytest.raises(ValueError, match=r"^runtime\.log_level must be one of \['info', 'trace'\]"):
        make_log(tmp_path, level=level)
    assert list(tmp_path.iterdir()) == []


def test_close_is_idempotent_and_lines_after_it_are_dropped(tmp_path):
    log = make_log(tmp_path, level="trace")
    log.info("a.open")
    log.close()
    log.close()
    log.info("b.closed")
    log.trace("c.closed")
    log.error("d.closed")
    log.flush()
    log.close()
    assert [x["event"] for x in read_lines(log)] == ["a.open"]


def test_a_restarted_instance_appends_to_the_file_of_the_first(tmp_path):
    first = make_log(tmp_path, epoch=0)
    first.info("actor.start")
    first.close()
    second = make_log(tmp_path, epoch=1)
    second.info("actor.start")
    second.close()
    assert [x["epoch"] for x in read_lines(first)] == [0, 1]


def test_two_logs_writing_one_file_at_once_leave_only_whole_lines(tmp_path):
    logs = [make_log(tmp_path, epoch=epoch) for epoch in (0, 1)]
    lines_each, filler = 300, "y" * 5000  # lines longer than PIPE_BUF (4096 bytes)
    barrier = threading.Barrier(len(logs))

    def write(log: ActorLog) -> None:
        barrier.wait()
        for i in range(lines_each):
            log.info("demo.line", i=i, filler=filler)

    threads = [threading.Thread(target=write, args=(log,)) for log in logs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for log in logs:
        log.close()
    lines = read_lines(logs[0])
    for epoch in (0, 1):
        mine = [x for x in lines if x["epoch"] == epoch]
        assert [x["i"] for x in mine] == list(range(lines_each))
        assert all(x["filler"] == filler for x in mine)
    assert len(lines) == 2 * lines_each


def test_without_a_path_nothing_is_written_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    log = ActorLog(None, actor="host", rank=0, epoch=0, level="trace")
    assert log.path is None
    log.info("a.info")
    log.trace("b.trace")
    log.flush()
    log.close()
    log.close()
    assert list(tmp_path.iterdir()) == []


def test_a_field_json_cannot_hold_is_rendered_as_its_repr(tmp_path):
    log = make_log(tmp_path)
    where = tmp_path / "run"
    log.info("run.start", run_dir=where, instances=("a-0", "b-0"))
    log.close()
    [line] = read_lines(log)
    assert line["run_dir"] == repr(where)
    assert line["instances"] == ["a-0", "b-0"]


def test_exc_info_adds_the_formatted_traceback_as_the_exception_field(tmp_path):
    log = make_log(tmp_path)
    try:
        raise ValueError("boom")
    except ValueError as e:
        error = e
    log.error("actor.failed", where="loop", error=repr(error), exc_info=error)
    log.error("msg.failed", seq=1, exc_info=None)
    log.close()
    failed, undecoded = read_lines(log)
    assert list(failed)[7:] == ["where", "error", "event", "exception"]
    assert failed["exception"].startswith("Traceback (most recent call last):\n")
    assert failed["exception"].endswith("ValueError: boom")
    assert list(undecoded)[7:] == ["seq", "event"]


def test_an_actor_log_leaves_the_global_structlog_configuration_alone(tmp_path):
    before = structlog.get_config()
    configured = structlog.is_configured()
    log = make_log(tmp_path, level="trace")
    log.info("a.info")
    log.trace("b.trace")
    log.close()
    assert structlog.get_config() == before
    assert structlog.is_configured() == configured


def test_log_path_is_the_instance_file_in_the_run_dir(tmp_path):
    assert log_path(tmp_path, "sink", 1) == tmp_path / "sink-1.jsonl"
    assert log_path(str(tmp_path), "supervisor", 0) == tmp_path / "supervisor-0.jsonl"


def test_the_fast_trace_path_renders_what_the_structlog_chain_renders(tmp_path):
    log = make_log(tmp_path, level="trace")
    fields = {"peer": "source-0", "seq": 7, "path": Path("/x"), "ids": (1, 2)}
    log.trace("msg.recv", **fields)  # the per-message path
    log._logger.debug("msg.recv", **fields)  # the structlog processor chain, same level
    log.close()
    fast, chain = read_lines(log)
    for line in (fast, chain):
        del line["ts"], line["mono_ns"]
    assert list(fast.items()) == list(chain.items())


def test_no_line_holds_a_secret_value_of_the_variables_the_supervisor_named(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGFENCE_SECRET_VARS", "RINGFENCE_API_KEY,RINGFENCE_STORAGE_SECRET")
    monkeypatch.setenv("RINGFENCE_API_KEY", 'sk-one,sk-"quoted",abc')
    monkeypatch.setenv("RINGFENCE_STORAGE_SECRET", "tier-secret-1")
    monkeypatch.setenv("OTHER_VAR", "not-a-secret")
    log = make_log(tmp_path, level="trace")
    log.info("demo.start", url="redis://x?key=sk-one", nested={"k": ['sk-"quoted"']})
    log.trace("sched.add", prompt=[1], params={"secret": "tier-secret-1"}, cache_salt="abc")
    log.warning("demo.stop", why="not-a-secret sk-on")
    log.close()
    data = file_of(log).read_bytes()
    for value in (b"sk-one", b'sk-\\"quoted\\"', b"tier-secret-1"):
        assert value not in data, value
    first, second, third = read_lines(log)
    assert first["url"] == "redis://x?key=[redacted]"
    assert first["nested"] == {"k": ["[redacted]"]}
    assert second["params"] == {"secret": "[redacted]"}
    assert second["cache_salt"] == "abc"  # shorter than a secret is looked for
    assert third["why"] == "not-a-secret sk-on"  # what is not a secret stays
