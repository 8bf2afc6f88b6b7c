"""The defaults of a run on CUDA: a device pool sized from the device's memory, and a GPU
server's batch limits, for every one of those settings the config left unset.

The fenced topology names :func:`resolve_device_defaults` as its defaults function
(``runtime/topology.py``): the supervisor runs it before the preflight and before any
process exists, writes the config it returns to the run dir's ``config.toml`` and prints
its note. On the CPU it returns the config untouched (today's defaults exactly). On CUDA,
for each key no file or ``--set`` wrote (``RunConfig.explicit``):

* ``sched.max_num_seqs`` 256 and ``sched.max_batched_tokens`` 8192 (vLLM's limits on a GPU),
  and ``sched.steps_in_flight`` 2 (the engine plans a step while the one before runs: with
  one, the device waits for the engine's turn every step; where a run cannot take two, the
  scheduler runs one, ``sched/config.py``);
* ``runtime.start_method`` spawn (:func:`spawn_children`);
* ``cache.device_blocks``: as many blocks as fit in ``cache.gpu_memory_utilization`` of
  the device's total memory (no more than is free now) once the weights, the CUDA
  contexts and the activations of the largest step are set aside (:func:`plan_memory`).

A ``cache.device_blocks`` that is set and does not fit is a ValueError naming it.

The device's memory is read in a short child process (:func:`probe_devices`), never in the
supervisor: a CUDA context there would hold device memory for the whole run, and torch
numbers devices as the Worker will (``CUDA_VISIBLE_DEVICES``), which nvidia-smi does not.
The child's own context counts as used in what it reads, which sets aside about what the
Worker's context will take.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from typing import Any, Final

from ringfence.actors.config import Config
from ringfence.actors.model.dtypes import ITEMSIZE
from ringfence.actors.model.shape import PRESETS, ModelShape, expected_tensors
from ringfence.actors.preflight import check_device, checkpoint_shape
from ringfence.runtime.config import RunConfig
from ringfence.runtime.topology import Resolved

GIB: Final = 1 << 30
GPU_SCHED: Final = {
    "sched.max_num_seqs": 256,
    "sched.max_batched_tokens": 8192,
    "sched.steps_in_flight": 2,
}
POOL_KEY: Final = "cache.device_blocks"
UTILIZATION_KEY: Final = "cache.gpu_memory_utilization"
START_KEY: Final = "runtime.start_method"
# Each process of a rank that touches the device holds a CUDA context on it: the Worker and
# its two lanes (which open the KV tensor by CUDA IPC). About 0.5 GiB each on a recent GPU.
CONTEXT_BYTES: Final = 512 << 20
PROCESSES_PER_RANK: Final = 3
# The Worker's cuBLAS workspaces and what the caching allocator holds but cannot reuse.
WORKSPACE_BYTES: Final = 512 << 20
# The sampler's float32 copies of a step's logits (logits, probabilities, sorted values
# and their int64 indices for top-k/top-p): bytes per logit.
SAMPLER_BYTES_PER_LOGIT: Final = 20
# A pool sized from memory never gets more blocks than this: each block costs the Engine's
# bookkeeping about 32 bytes of Python arrays, and a toy model's blocks are so small that
# a GPU would hold tens of millions. A 1.1B Llama's block is 512 KiB: 2^20 of them is
# 512 GiB, beyond any one device, so a real model never meets the cap.
MAX_AUTO_BLOCKS: Final = 1 << 20
PROBE_TIMEOUT_S: Final = 120.0

# Run by the probe's child process: torch numbers the devices as the Worker will.
_PROBE = """
import json, sys, torch
first = torch.device(sys.argv[1]).index or 0
print(json.dumps([
    {"device": f"cuda:{i}", "name": torch.cuda.get_device_name(i),
     "free_bytes": torch.cuda.mem_get_info(i)[0], "total_bytes": torch.cuda.mem_get_info(i)[1]}
    for i in range(first, first + int(sys.argv[2]))
]))
"""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DeviceMemory:
    """What one CUDA device holds, as the probe read it."""

    device: str  # "cuda:N", torch's numbering
    name: str  # the device's product name
    total_bytes: int
    free_bytes: int  # free when probed: other processes' use (and the probe's context) is not


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPlan:
    """How one rank's device memory is shared out; every figure in bytes.

    The KV pool and the decode path's gather share ``room``: the gather copies one layer's
    K and V of the batch's contexts into a contiguous buffer, so it is at most ``gather``
    and at most one layer's share of the pool, and a pool ``p`` fits when
    ``p + min(gather, p / layers) <= room``.
    """

    device: DeviceMemory  # the rank with the least room
    budget: int  # gpu_memory_utilization of the total, or what is free if that is less
    weights: int  # this rank's share of the weights
    reserved: int  # the CUDA contexts of the rank's processes and the Worker's workspace
    activations: int  # the largest step's activations and its sampler's copies of the logits
    gather: int  # the batch's longest contexts, one layer's K and V (max_num_seqs rows)
    layers: int
    block_bytes: int  # one KV block of this rank

    @property
    def room(self) -> int:
        """The budget less the weights, the contexts and the activations."""
        return self.budget - self.weights - self.reserved - self.activations

    @property
    def pool_bytes(self) -> int:
        """The largest pool that fits beside its gather (0 when none does)."""
        room, layers = self.room, self.layers
        return max(room * layers // (layers + 1), room - self.gather, 0)

    @property
    def blocks(self) -> int:
        """The blocks of :attr:`pool_bytes`."""
        return self.pool_bytes // self.block_bytes

    def fits(self, blocks: int) -> bool:
        """Whether a pool of ``blocks`` fits beside its gather."""
        pool = blocks * self.block_bytes
        return pool + min(self.gather, pool // self.layers) <= self.room


def resolve_device_defaults(config: RunConfig) -> Resolved:
    """The fenced topology's defaults function (see the module docstring): probes the
    devices of ``model.device`` in a child process, on CUDA only."""
    if not isinstance(config, Config):
        raise TypeError(f"device defaults need the actors' Config, got {type(config).__name__}")
    model = config.model
    if model.device == "cpu":
        return Resolved(config)
    # The preflight's check first: a device that does not exist is named as it always was.
    check_device(model.device, model.dtype, config.parallel.tp_size)
    resolved = device_defaults(config, probe_devices(model.device, config.parallel.tp_size))
    assert isinstance(resolved.config, Config)
    return Resolved(spawn_children(resolved.config), resolved.notes)


def spawn_children(config: Config) -> Config:
    """``config`` with its children started by ``spawn`` (a run on CUDA): a fork server
    that imported the Worker's modules asked torch about CUDA, and a child it forks cannot
    use CUDA (``runtime/starter.py``). ValueError where ``runtime.start_method`` was set to
    ``forkserver``."""
    if config.runtime.start_method == "spawn":
        return config
    if START_KEY in config.explicit:
        raise ValueError(
            f"{START_KEY}: forkserver cannot start a Worker on {config.model.device} (its "
            "server imported torch's CUDA checks, and a process forked after them cannot use "
            "CUDA); set it to spawn, or leave it unset"
        )
    return dataclasses.replace(
        config, runtime=dataclasses.replace(config.runtime, start_method="spawn")
    )


def device_defaults(config: Config, devices: Sequence[DeviceMemory]) -> Resolved:
    """``config`` with its unset GPU defaults filled in for ``devices`` (one per rank), and
    one note saying what was chosen and why. ValueError naming ``cache.device_blocks`` for
    a set pool that does not fit, ``cache.gpu_memory_utilization`` when nothing fits."""
    if config.model.device == "cpu":
        return Resolved(config)
    sched = config.sched
    batch = {key: value for key, value in GPU_SCHED.items() if key not in config.explicit}
    if batch:
        limits: dict[str, Any] = {key.partition(".")[2]: value for key, value in batch.items()}
        sched = dataclasses.replace(sched, **limits)
    config = dataclasses.replace(config, sched=sched)
    plan = plan_memory(config, _shape(config), devices)
    chosen = [f"{key} = {value}" for key, value in batch.items()]
    where = (
        f"{plan.device.device} ({plan.device.name}: {plan.device.total_bytes / GIB:.1f} GiB, "
        f"{plan.device.free_bytes / GIB:.1f} GiB free)"
    )
    if POOL_KEY in config.explicit:
        _check_pool(config.cache.device_blocks, plan)
    else:
        blocks = min(plan.blocks, MAX_AUTO_BLOCKS)
        if blocks < 1:
            raise ValueError(f"{UTILIZATION_KEY}: {_no_room(config, plan)}")
        config = dataclasses.replace(
            config, cache=dataclasses.replace(config.cache, device_blocks=blocks)
        )
        chosen.insert(0, f"{POOL_KEY} = {blocks} ({_split(blocks, plan)})")
    if not chosen:
        return Resolved(config)
    return Resolved(config, (f"defaults for {where}: {', '.join(chosen)}",))


def plan_memory(config: Config, shape: ModelShape, devices: Sequence[DeviceMemory]) -> MemoryPlan:
    """How a rank's memory is shared out at this config, on the rank of ``devices`` whose
    budget is the smallest. The figures are estimates from the shape alone (nothing is
    loaded); each term says what it stands for in :class:`MemoryPlan`."""
    if not devices:
        raise ValueError(f"model.device: {config.model.device}: no CUDA device was probed")
    ranks = config.parallel.tp_size
    itemsize = ITEMSIZE[config.model.dtype]
    fraction = config.cache.gpu_memory_utilization
    device = min(devices, key=lambda d: min(int(d.total_bytes * fraction), d.free_bytes))
    budget = min(int(device.total_bytes * fraction), device.free_bytes)
    kv_heads, sched = shape.kv_heads // ranks, config.sched
    block_bytes = shape.layers * 2 * config.cache.block_size * kv_heads * shape.head_dim * itemsize
    tokens, rows = sched.max_batched_tokens, sched.max_num_seqs
    per_token = itemsize * (
        4 * shape.hidden
        + (shape.heads + 2 * shape.kv_heads) * shape.head_dim // ranks
        + 3 * shape.intermediate // ranks
    )
    longest = sched.max_model_len or shape.max_position
    return MemoryPlan(
        device=device,
        budget=budget,
        weights=weight_bytes(shape, itemsize, ranks),
        reserved=PROCESSES_PER_RANK * CONTEXT_BYTES + WORKSPACE_BYTES,
        activations=tokens * per_token + rows * shape.vocab_size * SAMPLER_BYTES_PER_LOGIT,
        gather=rows * longest * block_bytes // (shape.layers * config.cache.block_size),
        layers=shape.layers,
        block_bytes=block_bytes,
    )


def weight_bytes(shape: ModelShape, itemsize: int, ranks: int = 1) -> int:
    """Bytes of one rank's weights: the decoder layers split over the ranks; the embedding,
    the final norm and an untied LM head replicated on each (``actors/model/parallel.py``)."""
    replicated = sharded = 0
    for name, dims in expected_tensors(shape).items():
        if name == "lm_head.weight" and shape.tie_embeddings:
            continue
        if name.startswith("model.layers."):
            sharded += math.prod(dims)
        else:
            replicated += math.prod(dims)
    return (replicated + -(-sharded // ranks)) * itemsize


def probe_devices(device: str, ranks: int = 1) -> list[DeviceMemory]:
    """Total and free memory of the ``ranks`` CUDA devices from ``device`` on, read by a child
    process (see the module docstring). ValueError naming ``model.device`` when the child
    fails or does not answer within :data:`PROBE_TIMEOUT_S`."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, device, str(ranks)],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"model.device: reading the memory of {device} took over {PROBE_TIMEOUT_S:.0f} s"
        ) from None
    if done.returncode:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise ValueError(f"model.device: cannot read the memory of {device}: {lines[-1]}")
    return [DeviceMemory(**entry) for entry in json.loads(done.stdout)]


def _shape(config: Config) -> ModelShape:
    if not config.model.path:
        return PRESETS[config.model.preset]
    return checkpoint_shape(config.model.path)  # its errors name model.path


def _check_pool(blocks: int, plan: MemoryPlan) -> None:
    if plan.fits(blocks):
        return
    raise ValueError(
        f"{POOL_KEY}: {blocks} blocks of {plan.block_bytes / 2**20:.2f} MiB "
        f"({blocks * plan.block_bytes / GIB:.1f} GiB) do not fit on {plan.device.device}: "
        f"{_room(plan)} leave {plan.pool_bytes / GIB:.1f} GiB, {plan.blocks} blocks; "
        f"set it to at most that, leave it unset, or raise {UTILIZATION_KEY}"
    )


def _no_room(config: Config, plan: MemoryPlan) -> str:
    return (
        f"{config.cache.gpu_memory_utilization} of {plan.device.device}: {_room(plan)} leave "
        f"no room for one KV block of {plan.block_bytes / 2**20:.2f} MiB"
    )


def _room(plan: MemoryPlan) -> str:
    return (
        f"{plan.budget / GIB:.1f} GiB (of {plan.device.total_bytes / GIB:.1f} GiB, "
        f"{plan.device.free_bytes / GIB:.1f} GiB free) less {plan.weights / GIB:.2f} GiB of "
        f"weights, {plan.reserved / GIB:.2f} GiB for the CUDA contexts and "
        f"{plan.activations / GIB:.2f} GiB for activations (and up to "
        f"{plan.gather / GIB:.2f} GiB for the decode gather)"
    )


def _split(blocks: int, plan: MemoryPlan) -> str:
    capped = " (capped)" if blocks == MAX_AUTO_BLOCKS else ""
    return f"{blocks * plan.block_bytes / GIB:.1f} GiB of KV{capped}: {_room(plan)}"
