"""``ringfence bench ring``: every figure is reported, failures stay local, no name is left.

No timing thresholds: the machine is shared and the figures are noisy. The tests check
the harness: what is reported, that a dead peer fails only its own measurement, and
that every ring, doorbell and process the bench made is gone afterwards.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson
import pytest

from ringfence.actors.tools.bench.transport import link as bench_link
from ringfence.actors.tools.testing.shm import shm_names
from ringfence.runtime import cli

PEERS = ("zmq", "queue", "pipe", "manager")
FIGURES = ("rtt_p50_us", "rtt_p99_us", "num_round_trips", "msgs_per_s", "mb_per_s", "num_streamed")


def run_bench(tmp_path: Path, *options: str) -> tuple[int, dict[str, Any]]:
    """Run the quick benchmark with ``options``; its exit status and its JSON report."""
    path = tmp_path / "r.json"
    status = cli.main(["bench", "ring", "--quick", "--json", str(path), *options])
    return status, orjson.loads(path.read_bytes())


def failed_run_in_same(tmp_path: Path, transports: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A quick run of ``transports`` at 64 B in the same placement that must exit 1; its
    report and that placement's result."""
    options = ("--placements", "same", "--transports", transports, "--sizes", "64")
    status, report = run_bench(tmp_path, *options)
    assert status == 1
    return report, report["placements"]["same"]


def names_of(report: dict[str, Any]) -> list[str]:
    return sorted(n for n in shm_names() if report["run_id"] in n)


def test_a_quick_run_reports_every_placement_transport_and_size_with_a_ratio_per_peer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, report = run_bench(tmp_path, "--sizes", "64,4096")
    assert status == 0
    assert list(report["placements"]) == ["cross", "same", "loaded"]
    for result in report["placements"].values():
        assert result["errors"] == {}
        if result["skipped"]:  # cross, where this process may use only one CPU
            assert len(os.sched_getaffinity(0)) < 2
            continue
        assert list(result["figures"]) == ["ringfence", "ringfence-batch", *PEERS]
        for transport, by_size in result["figures"].items():
            assert list(by_size) == ["64", "4096"]
            for figures in by_size.values():
                assert all(figures[key] > 0 for key in FIGURES), figures
                ratios = figures["vs_ringfence"]
                if transport == "ringfence":
                    assert ratios is None
                else:
                    assert ratios["rtt_p50"] > 0 and ratios["throughput"] > 0
    assert report["idle_consumer"]["percent_of_core"] >= 0
    assert report["options"]["idle_seconds"] == 0.5
    assert names_of(report) == []
    out = capsys.readouterr().out
    for line in (
        "== cross:",
        "== same:",
        "== loaded:",
        "idle ringfence consumer:",
        "64 B ringfence stream >= 5x mp.Queue",
        "4 KiB ringfence-batch stream ahead of pyzmq PAIR",
    ):
        assert line in out
    assert not list(Path(tempfile.gettempdir()).glob("rf-bench-zmq-*"))  # its socket folders


def test_a_peer_that_dies_fails_only_its_own_measurement_and_leaves_no_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open_ring = bench_link.OPENERS["ringfence"]

    def open_ring_with_a_wrong_name(env: Any, stack: ExitStack) -> tuple[Any, tuple[Any, ...]]:
        end, (shm, spin_us) = real_open_ring(env, stack)
        return end, ((shm[0] + "x", *shm[1:]), spin_us)  # the peer cannot attach: it dies

    monkeypatch.setitem(bench_link.OPENERS, "ringfence", open_ring_with_a_wrong_name)
    report, result = failed_run_in_same(tmp_path, "ringfence,pipe")
    assert list(result["errors"]) == ["ringfence"]
    assert "exited with code 1" in result["errors"]["ringfence"]
    assert list(result["figures"]) == ["pipe"]
    assert result["figures"]["pipe"]["64"]["vs_ringfence"] is None
    assert "error" in report["idle_consumer"]
    assert names_of(report) == []


def test_a_pinned_placement_gives_the_parent_its_cpu_affinity_back(tmp_path: Path) -> None:
    before = os.sched_getaffinity(0)
    status, _ = run_bench(tmp_path, "--placements", "same", "--transports", "pipe", "--sizes", "64")
    assert status == 0
    assert os.sched_getaffinity(0) == before


def test_an_unknown_transport_is_refused_with_status_2_naming_the_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "ring", "--transports", "ringfence,carrier-pigeon"]) == 2
    assert "--transports" in capsys.readouterr().err
