"""The matrix of ``ringfence bench faults``: every scenario, each named once."""

from __future__ import annotations

from ringfence.actors.tools.bench.faults.clients import flood, killed_client
from ringfence.actors.tools.bench.faults.runner import (
    NEVER,
    PRESSURE,
    SAVE,
    SUPERVISOR,
    Scenario,
    kills,
)
from ringfence.actors.tools.bench.faults.storage import (
    STORAGE,
    RedisLate,
    RedisOutage,
    corrupt_seen,
    damaged_storage,
    full_tmpfs,
    writes_into_a_full_tier,
)

TP2 = (*PRESSURE, "parallel.tp_size=2")
# The swap lane on a thread of the Worker's process (runtime/hosting.py): killing it kills
# that process, so the Worker restarts as often as the lane is killed (a lane that fails
# restarts alone: tests/actors/engine/test_hosted_lane_runs.py).
HOSTED = ("actors.swap.placement=hosted", "actors.swap.host=worker", "actors.worker.max_restarts=4")


def matrix(quick: bool) -> list[Scenario]:
    """Every scenario of ``ringfence bench faults`` (quick: fewer requests and kills)."""
    n = 4 if quick else 8
    steps = (12, 30, 60) if quick else (12, 40, 90, 150)
    outage, late = RedisOutage(), RedisLate()
    return [
        Scenario("none", "pressure", n, PRESSURE),
        Scenario("kill swap lane", "pressure", n, PRESSURE, kills("swap-0", *steps)),
        Scenario("kill store lane", "pressure", n, SAVE, kills("store-0", *steps)),
        Scenario("kill worker", "pressure", n, PRESSURE, kills("worker-0", *steps[:2])),
        Scenario("kill engine", "pressure", n, PRESSURE, kills("engine-0", steps[0])),
        # Tensor parallelism: a rank's lane restarts alone, a Worker rank takes its group down.
        Scenario("tp2 kill swap lane of rank 1", "pressure", n, TP2, kills("swap-1", *steps)),
        Scenario("tp2 kill worker rank 1", "pressure", n, TP2, kills("worker-1", *steps[:2])),
        # The swap lane hosted by the Worker: a kill takes both down, and both come back.
        Scenario(
            "hosted swap lane: kill it",
            "pressure",
            n,
            (*PRESSURE, *HOSTED),
            kills("swap-0", *steps),
        ),
        Scenario(
            "hosted tp2: kill rank 1's swap lane",
            "pressure",
            n,
            (*TP2, *HOSTED),
            kills("swap-1", *steps[:2]),
        ),
        Scenario(
            "kill engine (restart never)",
            "pressure",
            n,
            (*PRESSURE, NEVER),
            kills("engine-0", steps[0]),
            expect_exit=1,
        ),
        Scenario(
            "kill supervisor", "pressure", n, PRESSURE, kills(SUPERVISOR, steps[0]), expect_exit=-9
        ),
        Scenario(
            "client flood",
            "pressure",
            n,
            (*PRESSURE, "engine.max_requests_per_client=16"),
            drive=flood,
            serve=True,
            expect_exit=143,
        ),
        Scenario(
            "storage blocks damaged",
            "multiturn",
            4,
            STORAGE,
            prepare=damaged_storage,
            drive=corrupt_seen,
        ),
        Scenario(
            "storage max_bytes tiny",
            "multiturn",
            4,
            (*STORAGE, "cache.storage.backend=local", "cache.storage.max_bytes=1"),
            drive=writes_into_a_full_tier,
        ),
        Scenario(
            "storage disk full (tmpfs)",
            "multiturn",
            4,
            STORAGE,
            prepare=full_tmpfs,
            drive=writes_into_a_full_tier,
        ),
        Scenario(
            "redis stopped, restarted",
            "multiturn",
            4,
            (*STORAGE, "engine.arrivals=true"),
            prepare=outage.prepare,
            drive=outage.drive,
        ),
        Scenario(
            "redis down at launch, started",
            "multiturn",
            4,
            (*STORAGE, "engine.arrivals=true"),
            prepare=late.prepare,
            drive=late.drive,
        ),
        Scenario(
            "client killed mid-stream",
            "pressure",
            n,
            PRESSURE,
            drive=killed_client,
            serve=True,
            expect_exit=143,
        ),
    ]
