"""What ``bench decode`` measures in its own process, on the weights the launches ran: the
Worker's forward alone, transformers' fastest decode, the device's copy bandwidth and the
bytes a decode step reads (the roofline).

* The forward alone is ``bench worker``'s paged decode (``worker_sides.Sides``): one
  ``PagedExecutor.step`` of one decode piece per sequence, over shuffled block tables,
  and the greedy token read back; no engine, no rings, no sampler.
* Transformers on a ``StaticCache`` (gpt-fast's recipe): on CUDA its one-token step under
  ``torch.compile(mode="reduce-overhead")`` (CUDA graphs); on the CPU eager, since that
  mode's CUDA graphs do not exist there and inductor's C++ build takes longer than the
  whole benchmark. A compile that fails falls back to eager and says why.
* The copy bandwidth: a large device-to-device copy (1 GiB on CUDA, 256 MiB on the CPU),
  read and written, so twice its bytes over its time.
* A decode step reads every weight once (the embedding table only where the LM head is
  that table) and the K and V of every sequence's context once; over the copy bandwidth,
  that is the step's floor (:func:`step_bytes`).

torch and transformers are imported by the caller; every timing ends with the device's
queue drained.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ringfence.actors.tools.bench.worker_sides import Sides

if TYPE_CHECKING:
    from ringfence.actors.model.decoder import Model

WARMUP_STEPS = 3  # untimed steps before a timed run (compiles, CUDA graph recordings)
COPY_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}
COPY_ROUNDS = 5


def forward_alone(model: Model, hf: Any, seqs: int, context: int, steps: int) -> float:
    """Milliseconds of one decode step of the paged forward at ``seqs`` x ``context``
    (``bench worker``'s decode, run once untimed, then timed)."""
    counts = {
        "prefill_tokens": 1,
        "prefill_seqs": 1,
        "decode_seqs": seqs,
        "decode_context": context,
        "decode_steps": steps,
    }
    sides = Sides(model, hf, counts)
    sides.paged_decode()  # warm-up: allocator, kernels' first launches
    return sides.paged_decode() * 1e3 / steps


def transformers_static(
    torch: Any, transformers: Any, hf: Any, contexts: list[list[int]], *, steps: int, compile: bool
) -> dict[str, Any]:
    """Milliseconds of one greedy decode step of transformers on a static cache at
    ``len(contexts)`` sequences, compiled where ``compile`` (see the module docstring)."""
    device = next(hf.parameters()).device
    seqs, context = len(contexts), len(contexts[0])
    cache = transformers.StaticCache(
        config=hf.config, max_cache_len=context + WARMUP_STEPS + steps + 1
    )
    keyword = {"cache": cache} if _takes(hf, "cache") else {"past_key_values": cache}
    ids = torch.tensor(contexts, device=device)
    positions = torch.arange(context, device=device).expand(seqs, context)
    with torch.inference_mode():
        out = hf(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **keyword)
    token = out.logits[:, -1].argmax(-1, keepdim=True)

    def one(token: Any, position: Any) -> Any:
        logits = hf(input_ids=token, position_ids=position, use_cache=True, **keyword).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    how = "eager"
    step: Callable[[Any, Any], Any] = one
    if compile:
        # One compile for the first batch size, one more (dynamic) for the rest of them.
        step = torch.compile(one, mode="reduce-overhead", fullgraph=True)
        how = "torch.compile(mode='reduce-overhead')"
    position = context

    def run(count: int) -> None:
        nonlocal token, position
        for _ in range(count):
            if compile:
                torch.compiler.cudagraph_mark_step_begin()
            where = torch.full((seqs, 1), position, device=device, dtype=torch.long)
            token = step(token, where).clone()  # a graph's output is overwritten by the next
            position += 1

    with torch.inference_mode():
        try:
            run(WARMUP_STEPS)
        except Exception as e:  # a compile that fails: eager, and the report says why
            if not compile:
                raise
            how, compile, step = f"eager (torch.compile failed: {type(e).__name__})", False, one
            run(WARMUP_STEPS)
        seconds = _timed(torch, device, lambda: run(steps))
    return {"step_ms": seconds * 1e3 / steps, "how": how}


def copy_bandwidth(torch: Any, device: Any) -> float:
    """Bytes per second of a large copy on ``device``: read and written (twice the bytes),
    the best of :data:`COPY_ROUNDS` after one untimed copy."""
    nbytes = COPY_BYTES["cuda" if device.type == "cuda" else "cpu"]
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    copy()
    best = min(_timed(torch, device, copy) for _ in range(COPY_ROUNDS))
    return 2 * nbytes / best


def step_bytes(model: Model, seqs: int, context: float) -> int:
    """Bytes one decode step reads at ``seqs`` sequences of ``context`` tokens (mean): every
    weight once (the embedding table only as the tied LM head), and every K and V once."""
    c = model.config
    itemsize = next(model.parameters()).element_size()
    weights = sum(p.numel() for p in model.parameters()) * itemsize
    if not c.tie_embeddings:  # the lookup reads one row a sequence, not the table
        weights -= c.vocab_size * c.hidden * itemsize
    kv_per_token = c.layers * 2 * c.kv_heads * c.head_dim * itemsize
    return int(weights + seqs * context * kv_per_token)


def _takes(hf: Any, name: str) -> bool:
    import inspect

    return name in inspect.signature(hf.forward).parameters


def _timed(torch: Any, device: Any, run: Callable[[], object]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
