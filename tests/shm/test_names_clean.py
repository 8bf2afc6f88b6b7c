"""Run names, leases and `ringfence clean`: a dead run's names go, a live run's stay."""

from __future__ import annotations

import multiprocess
import orjson
import peers
import pytest

from ringfence.actors.tools.testing.shm import shm_names
from ringfence.runtime.cli import main
from ringfence.shm import names
from ringfence.shm.doorbell import Doorbell
from ringfence.shm.segment import Segment

SPAWN = multiprocess.get_context("spawn")


def dead_run() -> str:
    """A run id whose creator made a lease and a segment, then exited without cleaning."""
    run_id = names.new_run_id()
    proc = SPAWN.Process(target=peers.lease_and_exit, args=(run_id,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    return run_id


def test_names_carry_the_run_id_and_reject_bad_parts(run_id):
    assert names.posix_name(run_id, "engine.worker") == f"/rf-{run_id}-engine.worker"
    with pytest.raises(ValueError, match="run id 'Bad Id'"):
        names.posix_name("Bad Id", "x")
    with pytest.raises(ValueError, match="object name 'a/b'"):
        names.posix_name(run_id, "a/b")


def test_list_names_finds_segments_and_semaphores_of_a_run(run_id):
    seg = Segment.create(names.posix_name(run_id, "seg"), 64)
    bell = Doorbell.create(names.posix_name(run_id, "bell"))
    try:
        found = {(e.name, e.is_semaphore) for e in names.list_names(run_id)}
        assert found == {
            (f"/rf-{run_id}-seg", False),
            (f"/rf-{run_id}-bell", False),
            (f"/rf-{run_id}-bell", True),
        }
    finally:
        for obj in (seg, bell):
            obj.close()
            obj.unlink()
    assert names.list_names(run_id) == []


@pytest.mark.serial
def test_clean_all_removes_a_dead_runs_names_and_keeps_a_live_ones(run_id, capsys):
    dead = dead_run()
    names.write_lease(run_id)  # this test process is alive: its run must survive
    try:
        assert main(["clean", "--all"]) == 0
        out = capsys.readouterr().out
        assert f"removed /rf-{dead}-orphan" in out
        assert f"removed /rf-{dead}-lease" in out
        assert f"kept run {run_id}: its creator is alive" in out
        assert names.list_names(dead) == []
        assert [e.name for e in names.list_names(run_id)] == [f"/rf-{run_id}-lease"]
    finally:
        names.clean_run(run_id)


def test_clean_by_run_dir_reads_the_names_manifest(tmp_path, capsys):
    dead = dead_run()
    (tmp_path / "names.json").write_bytes(orjson.dumps({"run_id": dead, "names": []}))
    assert main(["clean", str(tmp_path)]) == 0
    assert "2 names removed" in capsys.readouterr().out
    assert not any(dead in n for n in shm_names())


def test_clean_refuses_a_live_run_unless_forced(run_id, capsys):
    names.write_lease(run_id)
    try:
        assert main(["clean", run_id]) == 1
        assert "is live" in capsys.readouterr().err
        assert names.list_names(run_id)
        assert main(["clean", run_id, "--force"]) == 0
        assert names.list_names(run_id) == []
    finally:
        names.clean_run(run_id)


def test_clean_with_a_malformed_manifest_names_the_file(tmp_path, capsys):
    (tmp_path / "names.json").write_text("{not json")
    assert main(["clean", str(tmp_path)]) == 2
    assert "names.json: not a ringfence names manifest" in capsys.readouterr().err


def test_a_process_stamp_outlives_its_process_only_as_dead():
    from ringfence.shm.liveness import ProcessStamp

    me = ProcessStamp.current()
    assert me.is_alive()
    assert ProcessStamp.decode(me.encode()) == me
    assert not ProcessStamp(pid=me.pid, start_ticks=me.start_ticks + 1).is_alive()  # a recycled pid
    proc = SPAWN.Process(target=int)
    proc.start()
    stamp = ProcessStamp.of(proc.pid)
    proc.join(30)
    assert stamp is not None and not stamp.is_alive()
