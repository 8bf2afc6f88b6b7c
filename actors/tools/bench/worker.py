"""``ringfence bench worker``: the paged model path against a contiguous transformers forward.

Prefill and decode tokens per second of a model on the paged path
(``PagedExecutor.step`` over a block-major KV tensor, block size 16, every sequence's
block table a shuffled run of block ids), next to transformers holding the very same
weights, run in the same process on the same threads. The model is a preset
(``--preset``, ``small``), which transformers runs as a ``LlamaForCausalLM`` built
from our weights, or a checkpoint of any supported family (``--model PATH``: a directory, or
a GGUF file, which transformers reads with ``gguf_file=``),
which we load with ``load_checkpoint`` and transformers with
``AutoModelForCausalLM.from_pretrained``, both in the benchmark's dtype. The ratio
paged / transformers is reported for each; the target is at least 0.8x
(informational, like every benchmark's targets).

Before anything is timed, both sides compute the logits of one short sequence and the
largest absolute difference is reported; in float32 it must be below 1e-3, or no
ratio is reported (exit status 1). In bfloat16 that gate runs on the float32 copies of
the weights (bfloat16 rounding of two different operation orders is no test of the
mapping) and the bfloat16 difference is only reported.

What each side does, so that both do the work a server does:

* Prefill: ``--prefill-seqs`` (1) prompts of ``--prefill-tokens`` (512) tokens, from
  Python lists of token ids. Paged: one step with one prefill piece per sequence,
  which writes every layer's K/V into the blocks and computes the last token's logits.
  Transformers: one batched forward with ``use_cache=True`` into a fresh
  ``DynamicCache`` of the model's config, as ``generate`` makes (its analogue of our KV
  write; a sliding window's layers keep only their window) and ``logits_to_keep=1``
  (only the last position's logits, as ``generate`` asks for), SDPA attention.
* Decode: ``--decode-seqs`` (8) sequences with ``--decode-context`` (256) tokens of
  context each, then ``--decode-steps`` (32) greedy tokens. Paged: one step of one
  decode piece per sequence per token. Transformers: one batched forward of the next
  token of every sequence with its cache (same lengths, so no padding).
  Only the decode steps are timed, not the prefill of the context.

Rounds (``--rounds``, 5) alternate which side runs first, after one untimed warm-up
round, so drift affects both sides alike; figures are medians over the rounds.

The paged side runs as the Worker does (``--attention``, ``auto``; ``--no-graphs`` turns its
CUDA graphs off): the Triton kernels and CUDA graphs on a GPU with Triton, the torch
attention elsewhere. Then each attention backend (``--backends``: ``torch``, ``triton``,
``triton+graphs``; all of them on CUDA, none on the CPU unless named) is timed alone, and
every decode step is set against the roofline: the bytes it reads (weights and the
context's KV) over the device's copy bandwidth measured in the same run
(``worker_backends.py``).
``--quick`` (the test) runs short lengths for 2 rounds, on the ``tiny`` preset unless
``--model`` names a checkpoint.

Transformers is an optional dependency (the ``bench`` extra); without it this benchmark
says so and exits with status 2. torch, transformers and the model are imported only
when the benchmark runs, so the ``ringfence`` command starts fast.
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import sys
from typing import TYPE_CHECKING, Any

import orjson

from ringfence.actors.text.grammars import model_grammars
from ringfence.actors.text.tokenizer import model_tokenizer
from ringfence.actors.tools.bench.options import add_counts, resolve_counts, resolve_preset
from ringfence.actors.tools.bench.sampling import sampling_costs
from ringfence.actors.tools.bench.subject import Subject
from ringfence.actors.tools.bench.worker_backends import (
    default_variants,
    parse_variants,
    roofline,
    time_variants,
)
from ringfence.actors.tools.bench.worker_sides import (
    BLOCK_SIZE,
    SEED,
    WORKER_PATH,
    Sides,
    logits_diff,
)

if TYPE_CHECKING:
    pass

TARGET_RATIO = 0.8
DTYPES = ("float32", "bfloat16")
CHECK_TOKENS = 40  # length of the logits check's sequence (crosses block boundaries)
CHECK_TOLERANCE = 1e-3  # max abs logits difference allowed in float32

# name: (default, quick default, help)
COUNTS: dict[str, tuple[int, int, str]] = {
    "prefill_tokens": (512, 64, "tokens per prefill prompt"),
    "prefill_seqs": (1, 1, "prompts per prefill step / batch"),
    "decode_seqs": (8, 4, "sequences decoded together"),
    "decode_context": (256, 32, "context tokens of each decoding sequence"),
    "decode_steps": (32, 4, "greedy tokens generated per sequence (timed)"),
    "rounds": (5, 2, "timed rounds (after one warm-up round)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument("--quick", action="store_true", help="tiny preset, short lengths (tests)")
    parser.add_argument("--preset", help="model preset (small; quick: tiny)")
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="a checkpoint directory of any supported family, or a GGUF file (no preset)",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="%(default)s")
    add_counts(parser, COUNTS)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (torch's default)")
    parser.add_argument(
        "--device", default="cpu", help="where both sides run: cpu or cuda (%(default)s)"
    )
    parser.add_argument(
        "--attention",
        choices=("auto", "torch", "triton"),
        default="auto",
        help="the paged side's model.attention (%(default)s)",
    )
    parser.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the paged side's model.cuda_graphs (on CUDA with triton attention)",
    )
    parser.add_argument(
        "--backends",
        metavar="NAMES",
        help="attention variants timed alone, comma-separated: torch, triton, triton+graphs "
        "(default: all on CUDA, none on the CPU)",
    )


def bench_worker(
    subject: Subject,
    dtype_name: str,
    counts: dict[str, int],
    transformers: Any,
    device: str = "cpu",
    *,
    path: dict[str, Any] | None = None,
    backends: list[str] | None = None,
) -> dict[str, Any]:
    """The report: logits check, then (when it passes) median tok/s of both sides and ratios,
    both sides on ``device``; the paged side with ``path``'s attention options (the
    Worker's defaults when None); then ``backends`` (``worker_backends.VARIANTS``; the
    device's default when None) timed alone, and the roofline."""
    import torch

    path = WORKER_PATH if path is None else path

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    reference, hf_reference = subject.load(torch.float32, transformers, device)
    c = reference.config
    for key in ("prefill_tokens", "decode_context"):
        longest = counts[key] + (counts["decode_steps"] if key == "decode_context" else 0)
        if longest > c.max_position:
            raise ValueError(f"--{key.replace('_', '-')}: {longest} positions > {c.max_position}")
    check_ids = [random.Random(SEED + 2).randrange(c.vocab_size) for _ in range(CHECK_TOKENS)]
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "device": device if device == "cpu" else torch.cuda.get_device_name(device),
        "preset": subject.preset,
        "checkpoint": subject.checkpoint,
        "family": c.family,
        "dtype": dtype_name,
        "parameters": sum(p.numel() for p in reference.parameters()),
        "block_size": BLOCK_SIZE,
        "counts": counts,
    }
    report["attn_implementation"] = hf_reference.config._attn_implementation
    diff, argmax_equal = logits_diff(reference, hf_reference, check_ids, path)
    check: dict[str, Any] = {
        "tokens": CHECK_TOKENS,
        "float32_max_abs_diff": diff,
        "float32_argmax_equal": argmax_equal,
        "tolerance": CHECK_TOLERANCE,
        "passed": diff < CHECK_TOLERANCE,
    }
    report["logits_check"] = check
    if not check["passed"]:
        return report
    if dtype == torch.float32:
        model, hf = reference, hf_reference
    else:
        del reference, hf_reference
        model, hf = subject.load(dtype, transformers, device)
        diff, argmax_equal = logits_diff(model, hf, check_ids, path)
        check[f"{dtype_name}_max_abs_diff"] = diff
        check[f"{dtype_name}_argmax_equal"] = argmax_equal
    with torch.inference_mode():
        sides = Sides(model, hf, counts, path)
        executor = sides.decode_executor
        report["paged_path"] = {
            "attention": executor.backend_name,
            "cuda_graphs": executor.graphs is not None,
        }
        report["transformers_prefill_kwargs"] = {"use_cache": True, **sides.keep_last}
        runs = {
            "prefill": (sides.paged_prefill, sides.hf_prefill),
            "decode": (sides.paged_decode, sides.hf_decode),
        }
        seconds: dict[str, dict[str, list[float]]] = {
            phase: {"paged": [], "transformers": []} for phase in runs
        }
        for round_no in range(counts["rounds"] + 1):  # round 0 warms up, untimed
            for phase, (paged, theirs) in runs.items():
                order = [("paged", paged), ("transformers", theirs)]
                for side, run in order if round_no % 2 else order[::-1]:
                    elapsed = run()
                    if round_no:
                        seconds[phase][side].append(elapsed)
    prefill_tokens = counts["prefill_seqs"] * counts["prefill_tokens"]
    decode_tokens = counts["decode_seqs"] * counts["decode_steps"]
    tok_s = {
        phase: {
            side: (prefill_tokens if phase == "prefill" else decode_tokens) / statistics.median(s)
            for side, s in sides_seconds.items()
        }
        for phase, sides_seconds in seconds.items()
    }
    ratios = {phase: t["paged"] / t["transformers"] for phase, t in tok_s.items()}
    same = sum(
        a == b
        for ours, theirs in zip(sides.paged_tokens, sides.hf_tokens, strict=True)
        for a, b in zip(ours, theirs, strict=True)
    )
    names = default_variants(next(model.parameters()).device) if backends is None else backends
    with torch.inference_mode():
        variants = time_variants(model, hf, counts, names)
    roof = roofline(torch, model, counts)
    decode_ms = {
        "paged": statistics.median(seconds["decode"]["paged"]) * 1e3 / counts["decode_steps"]
    }
    decode_ms |= {name: v["decode_step_ms"] for name, v in variants.items()}
    roof["ratio_to_floor"] = {name: ms / roof["decode_floor_ms"] for name, ms in decode_ms.items()}
    report.update(
        {
            "backends": variants,
            "paged_decode_step_ms": decode_ms["paged"],
            "roofline": roof,
            "tok_s": tok_s,
            "seconds": seconds,
            "ratios": ratios,
            "target_ratio": TARGET_RATIO,
            "meets_target": {phase: r >= TARGET_RATIO for phase, r in ratios.items()},
            "decode_greedy_tokens_equal": same / (decode_tokens + counts["decode_seqs"]),
            "sampling": sampling_costs(
                c.vocab_size,
                counts["decode_seqs"],
                counts["rounds"],
                grammars=model_grammars(subject.checkpoint or "", c.vocab_size),
                encode=model_tokenizer(subject.checkpoint or "").encode,
                device=device,
            ),
        }
    )
    return report


def _named(report: dict[str, Any]) -> str:
    if report["checkpoint"] is None:
        return f"preset {report['preset']}"
    return f"{report['family']} checkpoint {report['checkpoint']}"


def _print(report: dict[str, Any]) -> None:
    n = report["counts"]
    print(
        f"torch {report['torch']}, transformers {report['transformers']}, "
        f"{report['threads']} thread(s), on {report['device']}; {_named(report)} "
        f"({report['parameters']:,} parameters), {report['dtype']}, block size {BLOCK_SIZE}"
    )
    check = report["logits_check"]
    line = (
        f"logits check ({check['tokens']} tokens, paged step vs transformers): max abs diff "
        f"{check['float32_max_abs_diff']:.2e} in float32 (tolerance {check['tolerance']:g})"
    )
    if f"{report['dtype']}_max_abs_diff" in check and report["dtype"] != "float32":
        line += f", {check[report['dtype'] + '_max_abs_diff']:.2e} in {report['dtype']}"
    print(line)
    if "tok_s" not in report:
        return
    print(f"median of {n['rounds']} round(s), tokens per second:")
    shapes = {
        "prefill": f"{n['prefill_seqs']} x {n['prefill_tokens']} tokens",
        "decode": (
            f"{n['decode_seqs']} seqs x {n['decode_steps']} steps "
            f"after {n['decode_context']} tokens"
        ),
    }
    print(f"  {'':<8} {'paged':>10} {'transformers':>13} {'ratio':>7}   shape")
    for phase, t in report["tok_s"].items():
        print(
            f"  {phase:<8} {t['paged']:10.1f} {t['transformers']:13.1f} "
            f"{report['ratios'][phase]:6.2f}x   {shapes[phase]}"
        )
    print(f"  greedy decode tokens equal on both sides: {report['decode_greedy_tokens_equal']:.0%}")
    for phase, ratio in report["ratios"].items():
        passed = report["meets_target"][phase]
        print(
            f"{'PASS' if passed else 'FAIL'} {phase} paged >= {TARGET_RATIO}x transformers: "
            f"{ratio:.2f}x"
        )
    path, roof = report["paged_path"], report["roofline"]
    print(
        f"paged side: {path['attention']} attention, CUDA graphs "
        f"{'on' if path['cuda_graphs'] else 'off'}; decode "
        f"{report['paged_decode_step_ms']:.3f} ms/step"
    )
    print(
        f"roofline: a decode step reads {roof['decode_step_bytes'] / 1e6:.1f} MB at "
        f"{roof['copy_bandwidth_gb_s']:.1f} GB/s (copy): floor {roof['decode_floor_ms']:.3f} ms"
    )
    ratios = roof["ratio_to_floor"]
    for name, v in report["backends"].items():
        print(
            f"  {name:<14} prefill {v['prefill_ms']:9.3f} ms, decode {v['decode_step_ms']:8.3f} "
            f"ms/step ({ratios[name]:.1f}x the floor), greedy tokens equal to the first "
            f"{v['greedy_tokens_equal_to_first']:.0%}"
        )
    print(f"  {'paged side':<14} decode {ratios['paged']:.1f}x the floor")
    sampling = report["sampling"]
    print(
        f"sampling one decode step of {n['decode_seqs']} seqs, ms (ratio to plain): "
        + ", ".join(
            f"{name} {ms:.3f} ({sampling['ratio_to_plain'][name]:.2f}x)"
            for name, ms in sampling["ms_per_step"].items()
        )
    )
    print("(targets are informational)")


def main(args: argparse.Namespace) -> int:
    counts = resolve_counts(args, COUNTS)
    if args.model is not None:
        if args.preset is not None:
            raise ValueError("--model and --preset: give one of them")
        subject = Subject(checkpoint=args.model)
    else:
        subject = Subject(preset=resolve_preset(args))
    # Before transformers, which imports Triton: without CUDA, the kernels package sets
    # Triton's interpreter variable first (actors/model/kernels/__init__.py says why).
    importlib.import_module("ringfence.actors.model.kernels")
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as exc:
        print(
            f"ringfence bench worker: needs transformers (pip install 'ringfence[bench]'): {exc}",
            file=sys.stderr,
        )
        return 2
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise ValueError(f"--device: {args.device!r} is neither cpu nor cuda")
    if args.device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: torch sees no CUDA device")
    path = {"attention": args.attention, "cuda_graphs": args.graphs}
    backends = None if args.backends is None else parse_variants(args.backends)
    report = bench_worker(
        subject, args.dtype, counts, transformers, args.device, path=path, backends=backends
    )
    _print(report)
    if not report["logits_check"]["passed"]:
        print(
            "ringfence bench worker: the paged path and transformers disagree on the logits "
            f"(max abs diff {report['logits_check']['float32_max_abs_diff']:.3g} >= "
            f"{CHECK_TOLERANCE:g}); not reporting ratios",
            file=sys.stderr,
        )
        return 1
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0
