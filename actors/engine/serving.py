"""What the Engine actor and the in-process runner share: the scheduler's config from the
run config, the storage client, and workload lines as requests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ringfence.actors.config import Config
from ringfence.actors.kv.layout import STAGING_BLOCKS, block_fingerprint
from ringfence.actors.model.tokenizer import ByteTokenizer
from ringfence.actors.protocol.worker import ModelInfo
from ringfence.cache.storage import StorageBackend, StorageLog, open_backend
from ringfence.cache.storage.guarded import GuardedBackend
from ringfence.sched.config import SchedulerConfig, TierConfig
from ringfence.sched.ops import Op, StepOp, SwapOp
from ringfence.sched.request import Request
from ringfence.sched.workload import WorkloadRequest, parse_workload, synthetic

Encode = Callable[[str], Sequence[int]]


def sched_config(
    config: Config, model_id: str, max_position: int, vocab_size: int = 1 << 31
) -> SchedulerConfig:
    """The scheduler's settings: ``[sched]``, ``[cache]`` and the model's identity and limits
    (the model's ``ModelInfo.model_id``, ``max_position`` and ``vocab_size``)."""
    cache = config.cache
    storage = cache.storage.backend != "none"
    tiers = TierConfig(
        block_size=cache.block_size,
        device_blocks=cache.device_blocks,
        host_blocks=cache.host_blocks or STAGING_BLOCKS,
        host_cache=cache.host_blocks > 0,
        storage=storage,
        device_eviction=cache.device_eviction,
        host_eviction=cache.host_eviction,
        poison_freed=cache.poison_freed,
    )
    return SchedulerConfig(
        sched=config.sched,
        tiers=tiers,
        namespace=block_fingerprint(config, model_id).digest(),
        max_model_len=max_position,
        vocab_size=vocab_size,
    )


def open_storage(
    config: Config, model: ModelInfo, run_dir: str, *, log: StorageLog | None = None
) -> StorageBackend | None:
    """The storage tier's client (the engine asks it what is stored), or None.

    Guarded (:class:`GuardedBackend`): while the tier is unreachable its presence answer
    is "nothing stored" and ``storage.unavailable`` goes to ``log`` (default: the stdlib
    logger ``ringfence.cache.storage``) once per outage. A server that is down when it
    opens is such an outage from the start (``storage.unreachable``), not an error.
    """
    settings = config.cache.storage
    if settings.backend == "none":
        return None
    path = settings.path or (f"{run_dir}/storage" if settings.backend == "local" else "")
    backend = open_backend(
        settings.backend,
        fingerprint=block_fingerprint(config, model.model_id).digest(),
        path=path,
        url=settings.url,
        max_bytes=settings.max_bytes,
        timeout_s=settings.timeout_s,
        log=log,
        require_server=False,  # down at launch: misses until it is up, like an outage
    )
    return GuardedBackend(backend, log=log, answer_s=settings.presence_timeout_s)


def check_workload(config: Config) -> None:
    """ValueError naming the file and line when ``engine.workload`` cannot be read (what
    ``ringfence launch`` checks before a run exists)."""
    settings = config.engine
    if not settings.workload:
        return
    try:
        load_workload(settings.workload, seed=settings.seed)
    except OSError as e:
        raise ValueError(f"workload {settings.workload}: {e}") from None


def load_workload(
    source: str, *, seed: int = 0, requests: int | None = None
) -> list[WorkloadRequest]:
    """``synthetic:NAME`` or a JSON-lines file, sorted by arrival."""
    if source.startswith("synthetic:"):
        return synthetic(source.removeprefix("synthetic:"), seed=seed, requests=requests)
    with open(source, encoding="utf-8") as f:
        lines = f.readlines()
    parsed = parse_workload(lines, source=source)
    return sorted(parsed[:requests] if requests else parsed, key=lambda r: r.arrival_s)


def make_request(line: WorkloadRequest, encode: Encode | None = None) -> Request:
    """The scheduler's request of a workload line; a text prompt goes through ``encode``."""
    if line.prompt_token_ids is not None:
        tokens = tuple(line.prompt_token_ids)
    else:
        assert line.prompt is not None
        tokens = tuple((encode or ByteTokenizer().encode)(line.prompt))
    return Request(
        request_id=line.id, prompt_token_ids=tokens, params=line.params, arrival=line.arrival_s
    )


def issue_fields(op: Op) -> dict[str, Any]:
    """What ``op.issue`` logs of an op, as JSON values: the scheduler's fence and every block
    it touches (a step's pieces as [seq_id, start, tokens, sample, block_table])."""
    fence = {str(lane): n for lane, n in op.fence.waits().items()}
    if isinstance(op, StepOp):
        pieces = [
            [p.seq_id, p.start, len(p.token_ids), p.sample, list(p.block_table)] for p in op.pieces
        ]
        return {"fence": fence, "pieces": pieces, "poison": list(op.poison)}
    return {
        "fence": fence,
        "direction": op.direction,
        "reason": op.reason,
        "device_blocks": list(op.device_blocks) if isinstance(op, SwapOp) else [],
        "host_blocks": list(op.host_blocks),
    }
