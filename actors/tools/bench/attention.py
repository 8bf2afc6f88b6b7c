"""``ringfence bench attention``: the paged attention kernel alone, each context's keys read by
one program or shared out among several (``kernels/split_keys.py``), against the roofline.

For each batch size N (``--seqs``) and context (``--context``): N decodes, each over a
context of that many keys in shuffled blocks of a block-major KV tensor of every layer
(the 1.1B Llama's attention by default: 32 heads, 8 KV heads, head_dim 64, 16 layers, block
size 16, bfloat16), attended layer after layer as a decode step does. Each split setting
(``--splits``: ``1``, one program a piece and KV head; ``auto``, what an eager step of that
context picks, ``split_count``; ``graph``, what a CUDA graph's bucket of that batch picks,
captured for contexts up to ``--graph-context``, 2048, of which a shorter context uses only
the shares it needs; or a fixed count), at each ``--tiles`` (keys a program visits per loop
iteration; the kernel's own by default), is timed on the same KV and queries: on CUDA a
graph of one call per layer is captured and replayed (what a decode step's graph replays; a
call launched from Python would time Triton's launcher, not the kernel), the median of
``--rounds`` replays after one untimed. Reported per setting: microseconds a layer, the KV
bytes it reads over that time (GB/s) and over the copy bandwidth measured in the same run
(1.0 is the hardware's pace), its speed against the first setting, and the largest
difference of its output from the first setting's (they attend the same keys). A point whose
KV would pass ``--max-kv-gib`` is skipped.

With ``--chunk`` Q > 1 each sequence's last Q tokens are a prefill chunk's queries instead
(causal among themselves; never split): what a long prompt's step runs, reported in TFLOP/s
too (every setting reports it: a decode's products are few).

On the CPU the kernels run in Triton's interpreter, a program at a time: ``--quick`` (the
test) runs a tiny shape there, split in three, to check the report and that the settings
agree, not to measure. Triton is needed (CUDA builds of torch ship it).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any

import orjson

from ringfence.sched.ops import Piece

# The 1.1B Llama of issue 46's figures (hidden 2048 = 32 heads x 64).
GPU_SHAPE = {"heads": 32, "kv_heads": 8, "head_dim": 64, "layers": 16, "block_size": 16}
QUICK_SHAPE = {"heads": 4, "kv_heads": 2, "head_dim": 16, "layers": 2, "block_size": 4}
SEED = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument("--quick", action="store_true", help="a tiny shape on the CPU (tests)")
    parser.add_argument("--device", help="cuda where there is one, else cpu")
    parser.add_argument("--seqs", help="batch sizes, comma-separated (1,8,64,256; quick 1,3)")
    parser.add_argument(
        "--context", help="keys of each sequence, comma-separated (512,4096,16384; quick 40)"
    )
    parser.add_argument(
        "--splits", help="settings, comma-separated: 1, auto or a count (1,auto; quick 1,3)"
    )
    parser.add_argument(
        "--tiles", help="keys a program visits per iteration, comma-separated (the kernel's)"
    )
    parser.add_argument(
        "--graph-context",
        type=int,
        default=2048,
        help="the widest context a graph is captured for: the 'graph' setting's (2048)",
    )
    parser.add_argument(
        "--chunk",
        type=int,
        default=1,
        help="query tokens of each sequence, the last of its context: 1 a decode (the "
        "default), more a prefill chunk (read whole: only decode steps split)",
    )
    parser.add_argument("--rounds", type=int, help="timed replays (20; quick 1)")
    parser.add_argument(
        "--max-kv-gib", type=float, default=24.0, help="skip a point whose KV is larger (24)"
    )


def parse_splits(text: str) -> list[int | str]:
    """``--splits``: ``1``, ``auto``, ``graph`` or counts of at least 1 (ValueError naming the
    bad one)."""
    out: list[int | str] = []
    for word in (w.strip() for w in text.split(",") if w.strip()):
        if word in {"auto", "graph"}:
            out.append(word)
        elif word.isdigit() and int(word) >= 1:
            out.append(int(word))
        else:
            raise ValueError(f"--splits: {word!r} is not auto, graph or a count of at least 1")
    if not out:
        raise ValueError("--splits names no setting")
    return out


class Point:
    """One batch size and context: its KV (random, every layer's), its queries (``chunk`` a
    sequence, at the end of its context) and the step's pieces; each setting attends over
    the same."""

    def __init__(
        self, torch: Any, shape: dict[str, int], seqs: int, context: int, *, device: Any, chunk: int
    ):
        bs, kv_heads, head_dim = shape["block_size"], shape["kv_heads"], shape["head_dim"]
        self.torch, self.shape, self.device = torch, shape, device
        self.seqs, self.context, self.chunk = seqs, context, chunk
        per_seq = -(-context // bs)
        blocks = list(range(seqs * per_seq))
        random.Random(SEED).shuffle(blocks)
        dims = (len(blocks), shape["layers"], 2, bs, kv_heads, head_dim)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        gen = torch.Generator(device=device).manual_seed(SEED)
        self.kv = torch.randn(dims, generator=gen, device=device, dtype=dtype)
        tokens = seqs * chunk
        self.q = torch.randn(tokens, shape["heads"], head_dim, generator=gen, device=device)
        self.q = self.q.to(dtype)
        self.pieces = [
            Piece(
                seq_id=i,
                token_ids=(0,) * chunk,
                start=context - chunk,
                block_table=tuple(blocks[i * per_seq : (i + 1) * per_seq]),
                sample=False,
            )
            for i in range(seqs)
        ]

    def kv_bytes(self) -> int:
        """The keys and values one step reads: every layer's, every sequence's context."""
        s = self.shape
        per_token = s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * self.kv.element_size()
        return int(self.seqs * self.context * per_token)

    def flops(self) -> int:
        """The products of one layer's attention: each query token's scores and weighted
        values (2 x 2 x head_dim a key and head) over the keys it sees (causal)."""
        seen = sum(self.context - self.chunk + t + 1 for t in range(self.chunk))
        return 4 * self.shape["heads"] * self.shape["head_dim"] * self.seqs * seen

    def splits_of(self, setting: int | str, graph_context: int) -> int:
        """``auto``: what an eager decode step of this context picks; ``graph``: what a CUDA
        graph's bucket of this batch picks, captured for contexts up to ``graph_context``
        (here the kernel shares this context out among as few as it needs)."""
        from ringfence.actors.model.kernels.split_keys import split_count

        programs = self.seqs * self.shape["kv_heads"]
        if self.chunk > 1:  # a prefill chunk is never split (kernels/backend.py)
            return 1
        if setting == "auto":
            return split_count(programs, self.context, self.device)
        if setting == "graph":
            return split_count(programs, max(graph_context, self.context), self.device)
        return int(setting)

    def run(self, splits: int, rounds: int, tile: int) -> tuple[float, Any]:
        """Seconds a layer (median over ``rounds``) and the last layer's output."""
        from ringfence.actors.model.kernels.backend import step_tensors
        from ringfence.actors.model.kernels.paged_attention import paged_attention
        from ringfence.actors.model.kernels.split_keys import SPLIT_KEYS, Partials, acc_dtype

        torch, kv, q = self.torch, self.kv, self.q
        group = self.shape["heads"] // self.shape["kv_heads"]
        tensors = step_tensors(self.pieces, self.shape["block_size"], group, self.device)
        split_keys = SPLIT_KEYS if self.device.type == "cuda" else 1
        tensors = tensors._replace(splits=splits, split_keys=split_keys)
        partials = Partials.empty(q, splits, acc_dtype(kv.dtype)) if splits > 1 else None
        out = torch.empty_like(q)
        layers = self.shape["layers"]

        def step() -> None:
            for layer in range(layers):
                k, v = kv[:, layer, 0], kv[:, layer, 1]
                paged_attention(q, k, v, out, tensors, window=None, partials=partials, tile=tile)

        step()  # compiles (on CUDA), or runs once in the interpreter
        if self.device.type != "cuda":
            took = []
            for _ in range(rounds):
                start = time.perf_counter()
                step()
                took.append(time.perf_counter() - start)
            return statistics.median(took) / layers, out
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        took = []
        for _ in range(rounds):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            took.append(begin.elapsed_time(end) / 1e3)
        return statistics.median(took) / layers, out


def measure(
    point: Point, settings: list[int | str], tiles: list[int], options: dict[str, Any]
) -> list[dict[str, Any]]:
    """Each setting's figures at ``point`` for each tile (the module docstring); ``options``:
    rounds, bandwidth (bytes/s) and graph_context."""
    results: list[dict[str, Any]] = []
    first: Any = None
    per_layer = point.kv_bytes() / point.shape["layers"]
    for setting in settings:
        splits = point.splits_of(setting, options["graph_context"])
        for tile in tiles:
            seconds, out = point.run(splits, options["rounds"], tile)
            first = out.clone() if first is None else first
            gbps = per_layer / seconds / 1e9
            results.append({
                "tflops": point.flops() / seconds / 1e12,
                "setting": setting,
                "splits": splits,
                "tile": tile,
                "us": seconds * 1e6,
                "gbps": gbps,
                "roofline": gbps * 1e9 / options["bandwidth"],
                "speedup": results[0]["us"] / (seconds * 1e6) if results else 1.0,
                "max_diff": float((out.float() - first.float()).abs().max()),
            })  # fmt: skip
    return results


def main(args: argparse.Namespace) -> int:
    from ringfence.actors.model.kernels import triton_available

    if not triton_available():
        print(
            "ringfence bench attention: needs Triton, which CUDA builds of torch ship "
            "(pip install triton, or the test extra)",
            file=sys.stderr,
        )
        return 2
    import torch

    from ringfence.actors.model.kernels.paged_attention import TILE_N
    from ringfence.actors.tools.bench.decode_inproc import copy_bandwidth

    quick = args.quick
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = QUICK_SHAPE if quick else GPU_SHAPE
    seqs = [int(n) for n in (args.seqs or ("1,3" if quick else "1,8,64,256")).split(",")]
    contexts = [int(n) for n in (args.context or ("40" if quick else "512,4096,16384")).split(",")]
    settings = parse_splits(args.splits or ("1,3" if quick else "1,auto,graph"))
    tiles = [int(n) for n in (args.tiles or str(TILE_N)).split(",")]
    if any(t < 16 or t & (t - 1) for t in tiles):
        raise ValueError(f"--tiles: each must be a power of two of at least 16, got {tiles}")
    rounds = args.rounds if args.rounds is not None else 1 if quick else 20
    if min(seqs) < 1 or min(contexts) < 1 or rounds < 1 or args.chunk < 1:
        raise ValueError("--seqs, --context, --chunk and --rounds must be positive")
    if args.chunk > min(contexts):
        raise ValueError(f"--chunk {args.chunk} is longer than a context of {min(contexts)}")
    bandwidth = copy_bandwidth(torch, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "interpreted"
    itemsize = 2 if device.type == "cuda" else 4  # bfloat16 there, float32 in the interpreter
    print(
        f"paged attention alone on {device} ({name}): "
        f"{shape['heads']} heads, {shape['kv_heads']} KV heads, head_dim {shape['head_dim']}, "
        f"{shape['layers']} layers, block size {shape['block_size']}; "
        f"{'decodes' if args.chunk == 1 else f'prefill chunks of {args.chunk} tokens'}; "
        f"copy bandwidth {bandwidth / 1e9:,.0f} GB/s"
    )
    print(
        f"{'N':>4} {'context':>8} {'setting':>8} {'splits':>6} {'tile':>4} {'us/layer':>9} "
        f"{'GB/s':>8} {'roofline':>8} {'TFLOP/s':>8} {'speedup':>8} {'max diff':>9}"
    )
    points = []
    for n in seqs:
        for context in contexts:
            point_report: dict[str, Any] = {"seqs": n, "context": context}
            per_token = shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * itemsize
            if n * context * per_token > args.max_kv_gib * 2**30:
                point_report["skipped"] = f"KV over {args.max_kv_gib} GiB"
                print(f"{n:>4} {context:>8} skipped: {point_report['skipped']}")
                points.append(point_report)
                continue
            point = Point(torch, shape, n, context, device=device, chunk=args.chunk)
            point_report["kv_bytes"] = point.kv_bytes()
            options = {
                "rounds": rounds,
                "bandwidth": bandwidth,
                "graph_context": args.graph_context,
            }
            point_report["settings"] = measure(point, settings, tiles, options)
            for r in point_report["settings"]:
                print(
                    f"{n:>4} {context:>8} {r['setting']!s:>8} {r['splits']:>6} {r['tile']:>4} "
                    f"{r['us']:>9.1f} "
                    f"{r['gbps']:>8.1f} {r['roofline']:>8.2f} {r['tflops']:>8.2f} "
                    f"{r['speedup']:>7.2f}x "
                    f"{r['max_diff']:>9.2g}"
                )
            points.append(point_report)
            del point
    print(
        "us/layer: one layer's attention of the step (a graph of every layer replayed on CUDA); "
        "GB/s: its KV bytes over that; roofline: over the copy bandwidth; TFLOP/s: its "
        "products over that; speedup: against the first setting; max diff: its output "
        "against the first's"
    )
    if args.json is not None:
        report = {
            "device": str(device),
            "copy_gbps": bandwidth / 1e9,
            "shape": shape,
            "chunk": args.chunk,
            "rounds": rounds,
            "points": points,
        }
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0
