"""The runs ``ringfence bench e2e`` compares: each pair's two sides, as config overrides.

Every pair runs one synthetic workload under two configurations that differ in one
thing (see ``e2e.py`` for what is measured and how): ``transfer.mode`` (fence, sync, or
the legacy lock) on swap-heavy, storage-heavy (local and redis) and long-chat runs;
``runtime.wait`` (block or poll); the host and storage tiers on or off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DTYPE = "float32"
BLOCK_SIZE = 16
HOST_BLOCKS = 512  # cache.host_blocks where the host tier is on
SMALL_POOL_BLOCKS = 64  # cache.device_blocks of the multiturn and unique pairs
# Multiturn runs 3x --requests (6 chats by default): with a few chats at once the small
# pool has reused a chat's prefix blocks by its next turn, 2 s later, so the host tier
# serves some of them (a handful of chats all fit on the device, and the tiers idle).
MULTITURN_FACTOR = 3
PRESSURE_BLOCKS_PER_REQUEST = 11  # about half of what a pressure request needs (21 blocks)
SWAP_HEAVY_BLOCKS_PER_REQUEST = 5  # about a quarter: the pairs of this bench
PRESSURE_MIN_BLOCKS = 48  # the longest pressure request (500 + 64 tokens) fits
# The long multi-round chat (synthetic:chat): 2x --requests turns (4 a user), on a device
# pool a few histories outgrow (a fourth turn is up to 2,016 tokens: 126 blocks), so a
# returning turn finds its prefix on host or in storage with the tiers on.
CHAT_FACTOR = 2
CHAT_POOL_BLOCKS = 256
TARGETS: dict[str, float | None] = {
    "fence/sync": 1.0,
    "fence/lock": 1.2,
    "storage fence/sync": 1.0,
    "storage fence/lock": 1.2,
    "block/poll": 1.05,
    "block/poll cpu per token": 1.0,
    "tiers multiturn": None,
    "tiers multiturn ttft p50": None,
    "tiers multiturn ttft p99": None,
    "tiers unique": 0.97,
    "tiers chat": None,
    "tiers chat returning ttft p50": 5.0,
    "tiers chat returning ttft p99": None,
    "redis fence/sync": 1.0,
    "redis fence/lock": 1.2,
    "chat fence/sync": 1.0,
    "chat fence/sync returning ttft p50": None,
    "chat fence/sync returning ttft p99": None,
    "chat fence/lock": 1.2,
    "chat fence/lock returning ttft p50": None,
    "chat fence/lock returning ttft p99": None,
    "actor/local": 0.95,
}


@dataclass(frozen=True, slots=True)
class Run:
    """What to run: a workload, its size and the config overrides."""

    workload: str  # a synthetic workload's name
    requests: int
    settings: tuple[str, ...]  # --set KEY=VALUE overrides


def common_settings(preset: str, requests: int) -> list[str]:
    return [
        f"engine.requests={requests}",
        "engine.arrivals=false",
        "engine.progress=false",
        "transfer.chaos_delay_ms=0",
        f"model.preset={preset}",
        f"model.dtype={DTYPE}",
        f"cache.block_size={BLOCK_SIZE}",
    ]


TIERS_ON = ("cache.storage.backend=local", f"cache.host_blocks={HOST_BLOCKS}")
TIERS_OFF = ("cache.storage.backend=none", "cache.host_blocks=0")


def storage_heavy(preset: str, requests: int) -> list[str]:
    """``pressure``'s storage-heavy settings: every full block written through, preempted
    sequences saved and prefetched back (the host tier is the store lane's staging area),
    on the local tier (a later ``cache.storage.*`` setting replaces it)."""
    blocks = max(PRESSURE_MIN_BLOCKS, requests * SWAP_HEAVY_BLOCKS_PER_REQUEST)
    storage = [*common_settings(preset, requests), f"cache.device_blocks={blocks}"]
    storage += ["sched.preemption=save", "cache.storage.backend=local"]
    storage += [f"cache.host_blocks={HOST_BLOCKS}", "cache.device_eviction=write_through"]
    return storage


def long_chat(preset: str, requests: int) -> Run:
    """The long multi-round chat with its arrivals and the tiers on (a later
    ``cache.storage.*`` setting replaces the local tier)."""
    turns = CHAT_FACTOR * requests
    chat = [*common_settings(preset, requests), f"cache.device_blocks={CHAT_POOL_BLOCKS}"]
    chat += ["engine.arrivals=true", f"engine.requests={turns}", *TIERS_ON]
    return Run("chat", turns, tuple(chat))


def pairs(preset: str, requests: int, redis_url: str | None = None) -> dict[str, tuple[Run, Run]]:
    """The launched pairs, by name: (side A, side B); the redis pairs only with a
    ``redis_url`` (each launch of them starts on an empty database)."""
    common = common_settings(preset, requests)
    blocks = max(PRESSURE_MIN_BLOCKS, requests * SWAP_HEAVY_BLOCKS_PER_REQUEST)
    pressure = [*common, f"cache.device_blocks={blocks}", "sched.preemption=swap"]
    pressure += ["cache.storage.backend=none", f"cache.host_blocks={HOST_BLOCKS}"]
    storage = storage_heavy(preset, requests)
    small = [*common, f"cache.device_blocks={SMALL_POOL_BLOCKS}"]
    # engine.requests comes last, so it wins over the common one.
    arrivals = ("engine.arrivals=true", f"engine.requests={MULTITURN_FACTOR * requests}")

    def run(workload: str, settings: Sequence[str]) -> Run:
        return Run(workload, requests, tuple(settings))

    chat = long_chat(preset, requests)

    def against_fence(prefix: str, settings: Sequence[str]) -> dict[str, tuple[Run, Run]]:
        """``<prefix>fence/sync`` and ``<prefix>fence/lock`` on ``pressure``."""
        return {
            f"{prefix}fence/{mode}": (
                run("pressure", [*settings, "transfer.mode=fence"]),
                run("pressure", [*settings, f"transfer.mode={mode}"]),
            )
            for mode in ("sync", "lock")
        }

    def against_fence_on_chat() -> dict[str, tuple[Run, Run]]:
        """``chat fence/sync`` and ``chat fence/lock``: the long chat, tiers on."""
        sides = {m: Run("chat", chat.requests, (*chat.settings, f"transfer.mode={m}"))
                 for m in ("fence", "sync", "lock")}  # fmt: skip
        return {f"chat fence/{m}": (sides["fence"], sides[m]) for m in ("sync", "lock")}

    redis: dict[str, tuple[Run, Run]] = {}
    if redis_url is not None:
        on_redis = [*storage, "cache.storage.backend=redis", f"cache.storage.url={redis_url}"]
        redis = against_fence("redis ", on_redis)
    return {
        **against_fence("", pressure),
        **against_fence("storage ", storage),
        "block/poll": (
            run("pressure", [*pressure, "runtime.wait=block"]),
            run("pressure", [*pressure, "runtime.wait=poll"]),
        ),
        # Multiturn keeps its arrivals: a chat's next turn comes 2 s after the last, by
        # when the device pool has often reused the blocks of its prefix; that is where a
        # host or storage copy saves the prefill. Throughput is then arrival-bound (about
        # 1x); TTFT is the figure that shows the tiers.
        "tiers multiturn": (
            Run("multiturn", MULTITURN_FACTOR * requests, (*small, *TIERS_ON, *arrivals)),
            Run("multiturn", MULTITURN_FACTOR * requests, (*small, *TIERS_OFF, *arrivals)),
        ),
        "tiers unique": (run("unique", [*small, *TIERS_ON]), run("unique", [*small, *TIERS_OFF])),
        "tiers chat": (chat, Run("chat", chat.requests, (*chat.settings, *TIERS_OFF))),
        **against_fence_on_chat(),
        **redis,
    }
