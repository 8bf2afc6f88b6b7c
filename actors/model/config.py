"""The ``[model]`` section: which weights to run, in which dtype, on which device; and
``[parallel]``: in how many ranks (tensor parallelism).

Read by the Worker (and every tool that loads the model) through ``actors/model/loader.py``,
and by every actor that derives the model's shape or identity, or the KV layout of its
rank, without loading it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from ringfence.runtime.config import setting

# ruff: noqa: RUF009 (setting() returns a dataclasses.field(), which ruff cannot see)

Preset = Literal["tiny", "tiny-4kv", "small"]
Dtype = Literal["float32", "bfloat16", "float64"]
LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
Attention = Literal["auto", "torch", "triton"]  # actors/model/attention.py
LookAhead = Literal["auto", "on", "off"]  # actors/executors/worker.py
LaunchAhead = Literal["auto", "on", "late", "off"]  # actors/executors/worker.py
_DEVICE = (r"cpu|cuda(:[0-9]+)?", "'cpu', 'cuda' or 'cuda:N'")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """[model]: which weights to run, in which dtype, on which device."""

    preset: Preset = setting("tiny", "built-in model preset, used when model.path is empty")
    path: str = setting(
        "",
        "checkpoint directory, or a .gguf file (dequantized to model.dtype at load); when set "
        "it takes precedence over the preset",
    )
    dtype: Dtype = setting("float32", "dtype of the weights and the KV cache")
    device: str = setting("cpu", "torch device: 'cpu', 'cuda' or 'cuda:N'", pattern=_DEVICE)
    seed: int = setting(0, "random seed of the model (preset weights, sampling)", ge=0)
    logprobs_mode: LogprobsMode = setting(
        "raw_logprobs",
        "what log probabilities are of (vLLM's names and default): 'raw_logprobs', the "
        "model's logits; 'processed_logprobs', the logits after logit_bias, penalties and "
        "temperature that the token was drawn from",
    )
    attention: Attention = setting(
        "auto",
        "how attention reads the paged KV: 'torch' gathers each piece's blocks and calls SDPA "
        "(the reference); 'triton' reads them in place with Triton kernels; 'auto' is triton "
        "on a CUDA device when Triton is installed and the dtype is not float64, else torch",
    )
    cuda_graphs: bool = setting(
        True,
        "replay decode-only steps as CUDA graphs, one per batch-size bucket up to "
        "sched.max_num_seqs (on CUDA with the triton attention and parallel.tp_size 1 only)",
    )
    attention_splits: int = setting(
        16,
        "the most programs the triton attention shares a decode step's keys among, per "
        "sequence and KV head, where a step has too few sequences to keep the GPU's "
        "multiprocessors busy (one sequence of 8 KV heads is 8 programs): each reads its own "
        "run of at least 256 keys, and their outputs are merged; 1 never splits",
        ge=1,
        le=64,
    )
    look_ahead: LookAhead = setting(
        "auto",
        "while a step runs on the device, the Worker reads and checks the next step's plan "
        "if it arrives before the device is done (two steps in flight), so that its check "
        "does not hold the device between steps; 'auto' is on for a CUDA device, whose steps "
        "run beside the host, and off on the CPU, where the step is the host's own work",
    )
    launch_ahead: LaunchAhead = setting(
        "auto",
        "when the next step's plan was checked ahead and its fence is already met, the Worker "
        "queues that step's kernels before it reports the step before: 'on' as soon as the "
        "look-ahead has checked it, its pending inputs taken from the step before's draw on "
        "the device before its tokens are read back (if that step then fails, so does this "
        "one), so the device goes from step to step without waiting for the host; 'late' "
        "only once the step before's tokens are on the host; either way the report, the "
        "engine's frame and the plan's turn run beside the next step on the device; 'auto' "
        "is 'on' for a CUDA device with one rank and transfer.mode fence or sync (the lock's "
        "exclusion covers a step's device work whole), off elsewhere; 'on' and 'late' turn "
        "the look-ahead on too (on the CPU, what a test runs: there the forward is the "
        "host's own work, and launching ahead puts a whole forward before each report)",
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """[parallel]: how many ranks the Worker, the swap lane and the store lane run in."""

    tp_size: int = setting(
        1,
        "Worker ranks of one instance (tensor parallelism): each holds its share of the heads "
        "and of the MLP, with its own swap and store lanes; must divide the KV heads",
        ge=1,
        le=64,
    )
