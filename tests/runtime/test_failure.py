"""Failure records: what a failed child writes and the supervisor reads (runtime/failure.py)."""

from __future__ import annotations

import signal

import pytest

from ringfence.runtime.failure import (
    MESSAGE_CHARS,
    Failure,
    describe_exit,
    failure_path,
    read_failure,
    write_failure,
)


def _refuse() -> None:
    raise ValueError("/ckpt/config.json: architectures: got ['GPT2LMHeadModel']")


def raised() -> ValueError:
    try:
        _refuse()
    except ValueError as e:
        return e
    raise AssertionError("_refuse did not raise")


def test_a_failure_names_its_instance_where_the_error_and_the_innermost_frame():
    failure = Failure.of("worker-0", 1, "on_start", raised())
    assert (failure.error, failure.message) == (
        "ValueError",
        "/ckpt/config.json: architectures: got ['GPT2LMHeadModel']",
    )
    assert failure.at.endswith(" in _refuse") and "test_failure.py:" in failure.at
    assert failure.lines() == [
        "worker-0 failed in on_start: ValueError: "
        "/ckpt/config.json: architectures: got ['GPT2LMHeadModel']",
        f"  at {failure.at}",
    ]


def test_an_error_never_raised_has_no_frame_and_a_long_message_is_cut():
    failure = Failure.of("relay-0", 2, "loop", RuntimeError("x" * (MESSAGE_CHARS + 10)))
    assert failure.at == ""
    assert len(failure.message) == MESSAGE_CHARS
    assert len(failure.lines()) == 1


def test_a_record_reads_back_equal_for_its_incarnation_only(tmp_path):
    failure = Failure.of("worker-0", 3, "on_start", raised())
    write_failure(tmp_path, failure)
    assert read_failure(tmp_path, "worker-0", 3) == failure
    assert read_failure(tmp_path, "worker-0", 2) is None
    assert read_failure(tmp_path, "swap-0", 3) is None


@pytest.mark.parametrize("text", [b"", b"{", b"[]", b'{"instance": "worker-0"}'])
def test_a_malformed_record_reads_as_none(tmp_path, text):
    path = failure_path(tmp_path, "worker-0", 1)
    path.parent.mkdir()
    path.write_bytes(text)
    assert read_failure(tmp_path, "worker-0", 1) is None


def test_an_exit_without_a_record_is_told_by_its_signal_or_status():
    assert describe_exit("relay-0", -signal.SIGKILL) == "relay-0 was killed by SIGKILL"
    assert describe_exit("relay-0", 1) == "relay-0 exited with status 1"
