"""The harness half of ``ringfence bench transfer``: the protocol harness launched as a real
run in fence mode and in sync mode on the same programs, and its ops per second (see
:mod:`ringfence.actors.tools.bench.transfer`, part 2)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import orjson

from ringfence.actors.tools.bench import launcher
from ringfence.actors.tools.bench.launcher import RunError

BLOCK_SIZE = 16  # the bench's blocks, in both halves
DTYPE = "float32"
MODES = ("fence", "sync")
HARNESS_POOL_BLOCKS = 64  # cache.device_blocks and cache.host_blocks of the harness run


def _settings(
    mode: str, preset: str, programs: int, ops: int, storage: Path, *, device: str = "cpu"
) -> list[str]:
    return [
        f"model.device={device}",
        "runtime.topology=ringfence.actors.tools.testing.harness:TOPOLOGY",
        f"transfer.mode={mode}",
        "transfer.chaos_delay_ms=0",
        "harness.check=false",
        f"harness.programs={programs}",
        f"harness.ops={ops}",
        f"model.preset={preset}",
        f"model.dtype={DTYPE}",
        f"cache.block_size={BLOCK_SIZE}",
        f"cache.device_blocks={HARNESS_POOL_BLOCKS}",
        f"cache.host_blocks={HARNESS_POOL_BLOCKS}",
        "cache.storage.backend=local",
        f"cache.storage.path={storage}",
    ]


def run_harness(
    mode: str,
    *,
    preset: str,
    programs: int,
    ops: int,
    threads: int,
    timeout: float,
    folder: Path,
    device: str = "cpu",
) -> dict[str, Any]:
    """Launch the harness once in ``mode``; its ``harness.json`` and the launch's wall time.

    :class:`RunError` if the launch fails (see :func:`launcher.run`), writes no report or
    has programs with failed ops."""
    run_dir, storage = folder / f"run-{mode}", folder / f"storage-{mode}"
    done = launcher.run(
        run_dir,
        _settings(mode, preset, programs, ops, storage, device=device),
        what=f"{mode} run",
        timeout=timeout,
        env={"OMP_NUM_THREADS": str(threads)},
    )
    report_path = run_dir / "harness.json"
    if not report_path.is_file():
        raise RunError(f"{mode} run wrote no {report_path.name}:\n{done.tail}")
    report: dict[str, Any] = orjson.loads(report_path.read_bytes())
    if report.get("mismatched_programs") or not report.get("ops_per_s"):
        problems = report.get("mismatches", [])[:1]
        raise RunError(f"{mode} run: programs with failed ops or no throughput: {problems}")
    report["launch_wall_s"] = round(done.wall_s, 3)
    return report


def bench_harness(
    preset: str, programs: int, ops: int, threads: int, timeout: float, *, device: str = "cpu"
) -> dict[str, Any]:
    """Both modes' harness reports, their ops/s and the ratio fence / sync (the Worker's
    model and device tier on ``device``)."""
    reports = {}
    with tempfile.TemporaryDirectory(prefix="rf-bench-transfer-") as folder:
        for mode in MODES:
            reports[mode] = run_harness(
                mode,
                preset=preset,
                programs=programs,
                ops=ops,
                threads=threads,
                timeout=timeout,
                folder=Path(folder),
                device=device,
            )
    ops_per_s = {mode: float(r["ops_per_s"]) for mode, r in reports.items()}
    return {
        "preset": preset,
        "dtype": DTYPE,
        "block_size": BLOCK_SIZE,
        "device": device,
        "device_blocks": HARNESS_POOL_BLOCKS,
        "host_blocks": HARNESS_POOL_BLOCKS,
        "programs": programs,
        "ops_per_program": ops,
        "threads": threads,
        "ops_per_s": ops_per_s,
        "ratio": ops_per_s["fence"] / ops_per_s["sync"],
        "reports": {
            mode: {
                k: r[k]
                for k in ("ops", "counts", "busy_s", "ops_per_s", "lane_restarts", "launch_wall_s")
            }
            for mode, r in reports.items()
        },
    }
