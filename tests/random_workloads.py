"""Random workloads for engine runs in one process, and the plain loop's tokens for them.

Shared by the live fuzz tests, the sync-mode tests and the failed-op tests.
"""

from __future__ import annotations

import random
from pathlib import Path

import orjson

from ringfence.actors.config import Config
from ringfence.actors.engine.intake import load_workload
from ringfence.actors.tools.testing.local import LocalRunner

RUN_TIMEOUT_S = 20.0
ENGINE = (
    "runtime.topology=ringfence.actors.engine:TOPOLOGY",
    "model.dtype=float64",
    "cache.block_size=4",
    "engine.progress=false",
    "engine.arrivals=false",
    "engine.drain_timeout_s=5",
    "runtime.heartbeat_s=0.1",
)
TIERS = (
    "cache.device_blocks=16",  # six requests of up to 40 + 8 tokens need up to 72 blocks
    "cache.host_blocks=24",
    "cache.storage.backend=local",
    "cache.poison_freed=true",
    "sched.preemption=swap",
)


def write_workload(path: Path, seed: int, requests: int = 6) -> Path:
    """Random prompts (20 to 40 tokens), 8 tokens each, greedy and sampled by turns."""
    rng = random.Random(seed)
    lines = [
        {
            "id": f"r{i}",
            "prompt_token_ids": [rng.randrange(256) for _ in range(rng.randint(20, 40))],
            "max_tokens": 8,
            "temperature": 0.8 * (i % 2),
            "seed": i,
        }
        for i in range(requests)
    ]
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return path


def reference(workload: Path) -> dict[str, tuple[int, ...]]:
    """The plain loop's tokens: no tiers, a pool that never runs out."""
    config = Config.load(None, [*ENGINE, "cache.host_blocks=0", "cache.storage.backend=none",
                                "cache.device_blocks=1024"])  # fmt: skip
    lines = load_workload(str(workload))
    return {r.id: r.token_ids for r in LocalRunner(config).run(lines, arrivals=False)}


def outputs(run_dir: Path) -> dict[str, tuple[int, ...]]:
    lines = (run_dir / "outputs.jsonl").read_bytes().splitlines()
    return {o["id"]: tuple(o["token_ids"]) for o in map(orjson.loads, lines)}
