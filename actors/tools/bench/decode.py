"""``ringfence bench decode``: a decode step of the whole runtime, of its forward alone, of
transformers' fastest path and of the hardware's floor, side by side on the same weights.

For each batch size N of ``--seqs`` (1, 8, 64, 256 on CUDA; 1, 8, 64 on the CPU):

1. ``ringfence launch``: N requests of ``--prompt-tokens`` tokens each decoding
   ``--output-tokens`` (128 and 256; 64 and 32 on the CPU), all arriving at once,
   ``sched.max_num_seqs`` = N and a pool that holds them all (``decode_launch.py``):
   output tokens per second, TTFT p50, TPOT p50 and p90, and its steady decode step split
   into forward, sampling, engine and idle from the run's logs, with the device's busy
   fraction;
2. the Worker's forward alone at N sequences of ``--prompt-tokens`` context
   (``bench worker``'s paged decode, ``--forward-steps`` steps);
3. transformers on a static cache: compiled with ``reduce-overhead`` on CUDA, eager on the
   CPU (``decode_inproc.py`` says why), at each N of ``--transformers-seqs`` (every N unless
   given: a compile per batch size is most of the benchmark's time on a GPU);
4. the roofline: the bytes a decode step reads (weights and the context's KV) over the
   device's measured copy bandwidth, and each step's ratio to it (1.0 is the hardware's pace);
5. where the forward's time goes: its kernels grouped by class from torch's profiler, per
   step, and the GEMMs' time against the weights' floor (``decode_kernels.py``);
6. with ``--vs KEY=VALUE``, the same launch again with that override too, beside the first
   (at each N of ``--vs-seqs``, every N unless given): one setting against the default in
   one run, as ``--vs model.launch_ahead=late`` weighs launching the next step on the
   device's tokens against launching it on the host's.

The launches run first, while this process holds no device memory; then the model is
loaded here once for the rest. The model is ``--model PATH`` (a checkpoint directory) or
a preset (``--preset``: small; tiny with ``--quick``), in ``--dtype`` (bfloat16 on CUDA,
float32 on the CPU). ``--json FILE`` writes the report, ``--plot FILE`` a PNG (matplotlib,
the ``bench`` extra). ``--quick`` is the test's form: tiny, N = 1 and 4, a few tokens.
The engine's lines that time a step are trace lines (``runtime.log_level = trace``, the
default here; ``--log-level info`` measures without their cost and leaves engine and idle
as one figure).
"""

from __future__ import annotations

import argparse
import importlib
import random
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from ringfence.actors.tools.bench.decode_launch import Shape, launch_figures
from ringfence.actors.tools.bench.decode_report import print_report, write_plot
from ringfence.actors.tools.bench.options import (
    add_counts,
    add_overrides,
    environment,
    resolve_counts,
)
from ringfence.runtime.extras import require

if TYPE_CHECKING:
    from ringfence.actors.model.shape import ModelShape

DESCRIPTION = __doc__.split("\n\n")[0].replace("``", "") if __doc__ else None
SEQS = {"cuda": (1, 8, 64, 256), "cpu": (1, 8, 64), "quick": (1, 4)}
# name: (default, quick default, help); the defaults are a GPU's
COUNTS: dict[str, tuple[int, int, str]] = {
    "prompt_tokens": (128, 8, "prompt tokens of each request (the forward's context; CPU 64)"),
    "output_tokens": (256, 4, "tokens each request decodes (CPU 32)"),
    "forward_steps": (32, 2, "timed steps of the forward alone and of transformers (CPU 16)"),
}
# The CPU's short form: a couple of minutes for the small preset at 1, 8 and 64 sequences.
CPU_COUNTS = {
    name: (cpu, quick, text)
    for (name, (_, quick, text)), cpu in zip(COUNTS.items(), (64, 32, 16), strict=True)
}
SEED = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument("--quick", action="store_true", help="tiny preset, N = 1 and 4 (tests)")
    parser.add_argument("--preset", help="model preset (small; quick: tiny)")
    parser.add_argument("--model", metavar="PATH", help="a checkpoint directory (no preset)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (%(default)s)")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), help="bfloat16 on CUDA, float32 on the CPU"
    )
    parser.add_argument(
        "--seqs", help="batch sizes, comma-separated (CUDA 1,8,64,256; CPU 1,8,64; quick 1,4)"
    )
    add_counts(parser, COUNTS)
    parser.add_argument(
        "--log-level",
        choices=("trace", "info"),
        default="trace",
        help="the launches' runtime.log_level: trace times the engine (%(default)s)",
    )
    parser.add_argument("--threads", type=int, help="CPU threads of the Worker and of this process")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a launch may take")
    parser.add_argument("--folder", type=Path, help="where the run dirs go (a temporary folder)")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG of the figures")
    add_overrides(parser, "the model's, the batch's and the pool's")
    parser.add_argument(
        "--vs",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="launch again with this override as well, beside the first (repeatable)",
    )
    parser.add_argument("--vs-seqs", help="the batch sizes of the --vs launches (every N)")
    parser.add_argument(
        "--transformers-seqs", help="the batch sizes transformers is timed at (every N)"
    )


def seqs_of(args: argparse.Namespace, cuda: bool) -> tuple[int, ...]:
    """``--seqs``, else the device's batch sizes; ValueError naming a bad one."""
    if args.seqs is None:
        return SEQS["quick" if args.quick else "cuda" if cuda else "cpu"]
    try:
        seqs = tuple(int(text) for text in args.seqs.split(","))
    except ValueError:
        raise ValueError(f"--seqs: {args.seqs!r} is not a comma-separated list of ints") from None
    if not seqs or min(seqs) < 1:
        raise ValueError(f"--seqs: {args.seqs!r}: every batch size must be >= 1")
    return seqs


def bench_decode(
    args: argparse.Namespace, transformers: Any, save: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """The report (see the module docstring), handed to ``save`` as it grows: after each
    launch and each batch size's measurements, so a run cut short keeps what it measured."""
    import torch

    cuda = args.device != "cpu"
    counts = resolve_counts(args, COUNTS if cuda else CPU_COUNTS)
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    preset, shape = _model_of(args)
    model_set = [f"model.device={args.device}", f"model.dtype={dtype}"]
    model_set.append(f"model.path={args.model}" if args.model else f"model.preset={preset}")
    longest = counts["prompt_tokens"] + max(counts["output_tokens"], counts["forward_steps"])
    if longest > shape.max_position:
        raise ValueError(f"--prompt-tokens and --output-tokens: {longest} > {shape.max_position}")
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    env = {"OMP_NUM_THREADS": str(threads)}
    model_set.append(f"actors.worker.threads={threads}")
    folder = args.folder or Path(tempfile.mkdtemp(prefix="ringfence-bench-decode-"))
    seqs = seqs_of(args, cuda)
    vs_seqs = _vs_seqs(args, seqs, cuda)
    hf_seqs = _some_seqs(args.transformers_seqs, "--transformers-seqs", seqs)
    points: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "environment": environment(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": args.device,
        "threads": threads,
        "model": {"preset": preset, "checkpoint": args.model, "dtype": dtype, "parameters": None},
        "counts": counts,
        "log_level": args.log_level,
        "overrides": list(args.overrides),
        "copy_bandwidth_gb_s": None,
        "points": points,
    }
    for n in seqs:  # the launches first: this process holds no device memory yet
        run = Shape(
            seqs=n,
            prompt_tokens=counts["prompt_tokens"],
            output_tokens=counts["output_tokens"],
            vocab_size=shape.vocab_size,
            seed=SEED,
        )
        trace = args.log_level == "trace"
        launched = launch_figures(
            folder, run, [*model_set, *args.overrides], trace=trace, timeout=args.timeout, env=env
        )
        points.append({"seqs": n, "launch": launched})
        save(report)
        for i, extra in enumerate(args.vs if n in vs_seqs else []):
            given = [*model_set, *args.overrides, extra]
            beside = launch_figures(
                folder / f"vs-{i}", run, given, trace=trace, timeout=args.timeout, env=env
            )
            points[-1].setdefault("vs", {})[extra] = beside
            save(report)
    return _in_process(args, transformers, save, report, shape, preset, counts | {"hf": hf_seqs})


def _vs_seqs(args: argparse.Namespace, seqs: tuple[int, ...], cuda: bool) -> tuple[int, ...]:
    """The batch sizes of the ``--vs`` launches; ValueError naming a bad option."""
    if bad := [kv for kv in args.vs if "=" not in kv]:
        raise ValueError(f"--vs: {bad[0]!r} is not KEY=VALUE")
    return _some_seqs(args.vs_seqs, "--vs-seqs", seqs)


def _some_seqs(text: str | None, option: str, seqs: tuple[int, ...]) -> tuple[int, ...]:
    """The batch sizes of ``seqs`` that ``option`` names (every one when None; a size it
    names that ``--seqs`` lacks has no point to apply to); ValueError naming it for a list
    that is not of batch sizes."""
    if text is None:
        return seqs
    try:
        some = seqs_of(argparse.Namespace(seqs=text, quick=False), cuda=False)
    except ValueError as e:
        raise ValueError(str(e).replace("--seqs", option, 1)) from None
    return tuple(n for n in seqs if n in some)


def _in_process(  # noqa: PLR0917
    args: argparse.Namespace,
    transformers: Any,
    save: Callable[[dict[str, Any]], None],
    report: dict[str, Any],
    shape: ModelShape,
    preset: str | None,
    counts: dict[str, Any],
) -> dict[str, Any]:
    """The measurements in this process, after the launches: the forward alone,
    transformers (at the batch sizes ``counts["hf"]``), the roofline and the kernels, at
    each point of ``report``."""
    import torch

    from ringfence.actors.tools.bench import decode_inproc as inproc
    from ringfence.actors.tools.bench.decode_kernels import profile_forward
    from ringfence.actors.tools.bench.subject import Subject

    cuda = args.device != "cpu"
    points = report["points"]
    subject = Subject(preset=preset) if preset else Subject(checkpoint=args.model)
    model, hf = subject.load(getattr(torch, report["model"]["dtype"]), transformers, args.device)
    device = next(model.parameters()).device
    if cuda:
        report["device"] = torch.cuda.get_device_name(device)
    report["model"]["parameters"] = sum(p.numel() for p in model.parameters())
    bandwidth = inproc.copy_bandwidth(torch, device)
    report["copy_bandwidth_gb_s"] = bandwidth / 1e9
    gen = random.Random(SEED + 1)
    for point in points:
        n, context, steps = point["seqs"], counts["prompt_tokens"], counts["forward_steps"]
        forward_ms = inproc.forward_alone(model, hf, n, context, steps)
        contexts = [[gen.randrange(shape.vocab_size) for _ in range(context)] for _ in range(n)]
        theirs = None
        if n in counts["hf"]:
            theirs = inproc.transformers_static(
                torch, transformers, hf, contexts, steps=steps, compile=cuda
            )
        launch_context = context + counts["output_tokens"] / 2  # the mean over the decode
        floor = {
            "forward": inproc.step_bytes(model, n, context + steps / 2) / bandwidth * 1e3,
            "launch": inproc.step_bytes(model, n, launch_context) / bandwidth * 1e3,
        }
        point |= {"forward": {"step_ms": forward_ms}, "transformers": theirs}
        point["roofline"] = _roofline(floor, point)
        kernels = profile_forward(model, hf, n, context)
        kernels["weights_floor_ms"] = inproc.step_bytes(model, 0, 0) / bandwidth * 1e3
        point["kernels"] = kernels
        save(report)
    return report


def _model_of(args: argparse.Namespace) -> tuple[str | None, ModelShape]:
    """The preset (None for ``--model``) and the model's shape; ValueError naming the option
    at fault."""
    from ringfence.actors.model.families import read_config
    from ringfence.actors.model.shape import PRESETS

    if args.model is not None and args.preset is not None:
        raise ValueError("--model and --preset: give one of them")
    if args.model is not None:
        return None, read_config(args.model)
    preset: str = args.preset or ("tiny" if args.quick else "small")
    if preset not in PRESETS:
        raise ValueError(f"--preset: unknown preset {preset!r}; known: {sorted(PRESETS)}")
    return preset, PRESETS[preset]


def _roofline(floor: dict[str, float], point: dict[str, Any]) -> dict[str, Any]:
    """Each side's floor over its step: 1.0 is the hardware's pace."""
    return {
        "floor_ms": floor,
        "launch": floor["launch"] / point["launch"]["step"]["step_ms"],
        "forward": floor["forward"] / point["forward"]["step_ms"],
        "transformers": None
        if point["transformers"] is None
        else floor["forward"] / point["transformers"]["step_ms"],
    }


def _stopped(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(args: argparse.Namespace) -> int:
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise ValueError(f"--device: {args.device!r} is neither cpu nor cuda")
    require("transformers", "ringfence bench decode")  # the CLI prints the extra to install
    transformers = importlib.import_module("transformers")
    path: Path | None = args.json

    def save(report: dict[str, Any]) -> None:
        if path is not None:
            path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))

    # Stopped by SIGTERM (a timeout), the launch in flight is killed with its process
    # group as on Ctrl-C (launcher.run), not left running on the device.
    previous = signal.signal(signal.SIGTERM, _stopped)
    try:
        report = bench_decode(args, transformers, save)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_report(report)
    if args.plot is not None:
        write_plot(args.plot, report)
    return 0
