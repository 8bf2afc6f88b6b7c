"""Running spin: build a model's verifier (pan) with a configuration's -D flags, run it,
read what it reports, and replay a counterexample's trail to name the violated property.

Every run works in a folder of its own (the model's .pml files copied in), so runs can go
side by side. Standard library only; needs ``spin`` and a C compiler on PATH.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MODELS = Path(__file__).resolve().parent
MEMORY_MB = 6144  # pan's memory limit (MEMLIM): a run past it stops, reported as such
DEPTH = 20_000  # pan's search depth limit (the deepest trail seen is about 1,300 steps)
HASH_BITS = 24  # exhaustive searches' hash table (-w); bitstate uses BITSTATE_BITS
BITSTATE_BITS = 27  # 2^27 bits (16 MiB): a few minutes a search, a partial coverage


# How the models' printf names a property before its assert fails: "I1 violated ...".
PROPERTY = re.compile(r"\b(?:I[1-4]|R|S|E1|F|P|D[1-3]) violated")


class SpinError(RuntimeError):
    """spin or the C compiler failed, or pan said something this module cannot read."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """What one pan run found."""

    errors: int
    states: int  # stored
    transitions: int
    depth: int  # reached
    vector_bytes: int
    memory_mb: float  # total actual memory usage
    seconds: float  # wall time of the pan run
    complete: bool  # the search finished (not cut by memory or depth)
    violation: str = ""  # the first line of a counterexample that names a property
    trail_steps: int | None = None  # the counterexample's length
    output: str = field(default="", repr=False)


def _number(pattern: str, text: str, kind: type = int) -> float | int:
    match = re.search(pattern, text)
    if match is None:
        raise SpinError(f"pan's report has no {pattern!r}:\n{text[-2000:]}")
    value = match.group(1).replace(",", "")
    return kind(float(value)) if kind is int else kind(value)


def _run(args: Sequence[str], cwd: Path, timeout: float, *, check: bool = True) -> str:
    """What the command printed; SpinError if it exits nonzero and ``check``."""
    try:
        done = subprocess.run(
            list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise SpinError(f"{' '.join(args)} ran past {timeout:g} s") from None
    if check and done.returncode != 0:
        raise SpinError(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return done.stdout + done.stderr


def flags(defines: Mapping[str, int | bool]) -> list[str]:
    """-D flags for spin's preprocessor: ``{"NOPS": 3, "MUT_X": True}`` -> -DNOPS=3 -DMUT_X."""
    return [f"-D{k}" if v is True else f"-D{k}={v}" for k, v in defines.items() if v is not False]


def prepare(folder: Path, model: str, extra: Mapping[str, str] | None = None) -> Path:
    """``folder`` holding every model file, and ``extra`` files by name; the model's path."""
    folder.mkdir(parents=True, exist_ok=True)
    for source in MODELS.glob("*.pml"):
        shutil.copy(source, folder / source.name)
    for name, text in (extra or {}).items():
        (folder / name).write_text(text)
    return folder / model


def verify(
    folder: Path,
    model: str,
    defines: Mapping[str, int | bool],
    *,
    bitstate: bool = False,
    liveness: bool = False,
    fair: bool = True,
    optimize: bool = False,
    breadth_first: bool = False,
    timeout: float = 3600.0,
) -> Result:
    """Verify ``model`` with ``defines``: safety (assertions, invalid end states), or with
    ``liveness`` the model's LTL claim under weak fairness (acceptance cycles; without it
    when ``fair`` is False: then a process may be starved forever). Exhaustive,
    with states stored collapsed, or ``bitstate`` (a supertrace: a partial search).
    ``optimize``: compile pan with -O2 (seconds more to build, twice as fast a search: for
    the large configurations), else -O0. ``breadth_first`` (safety only): search level by
    level (-DBFS), so the first error found is a shortest counterexample, found once the
    levels above it are done rather than wherever the depth-first search first meets it; the
    same states are searched where there is none."""
    path = prepare(folder, model)
    d = flags(defines)
    _run(["spin", *d, "-a", path.name], folder, timeout)
    cc = ["gcc", "-O2" if optimize else "-O0", "-w", f"-DMEMLIM={MEMORY_MB}", "-DNFAIR=12"]
    cc += ["-o", "pan", "pan.c"]
    cc.insert(3, "-DBITSTATE" if bitstate else "-DCOLLAPSE")
    if not liveness:
        cc[3:3] = ["-DSAFETY", "-DNOCLAIM", *(["-DBFS"] if breadth_first else [])]
    elif breadth_first:
        raise ValueError("a breadth-first search is of safety only")
    _run(cc, folder, timeout)
    pan = ["./pan", f"-m{DEPTH}", f"-w{BITSTATE_BITS if bitstate else HASH_BITS}"]
    if liveness:
        pan += ["-a", "-f"] if fair else ["-a"]
    start = time.perf_counter()
    out = _run(pan, folder, timeout, check=False)
    seconds = time.perf_counter() - start
    errors = int(_number(r"errors: (\d+)", out))
    cut = ("max search depth too small", "out of memory", "MEMLIM")
    complete = not any(reason in out for reason in cut)
    result = Result(
        errors=errors,
        states=int(_number(r"([\d.e+]+) states, stored", out)),
        transitions=int(_number(r"([\d.e+]+) transitions", out)),
        depth=int(_number(r"depth reached (\d+)", out)),
        vector_bytes=int(_number(r"State-vector (\d+) byte", out)),
        memory_mb=float(_number(r"([\d.]+)\s+total actual memory usage", out, float)),
        seconds=seconds,
        complete=complete,
        output=out,
    )
    if errors:
        return _replayed(result, folder, path.name, d, timeout)
    return result


def _replayed(result: Result, folder: Path, model: str, d: list[str], timeout: float) -> Result:
    """``result`` with the counterexample's first named violation and its length."""
    out = _run(["spin", "-t", *d, model], folder, timeout, check=False)
    named = [line.strip() for line in out.splitlines() if PROPERTY.search(line)]
    pans = [
        line.strip()
        for line in result.output.splitlines()
        if line.startswith("pan:") and ("invalid end state" in line or "acceptance cycle" in line)
    ]
    violation = (named or pans or ["an assertion (no property named)"])[0]
    steps = re.search(r"trail ends after (\d+) steps", out)
    return dataclasses.replace(
        result, violation=violation, trail_steps=int(steps.group(1)) if steps else None
    )


def simulate(folder: Path, model: str, defines: Mapping[str, int | bool], timeout: float) -> str:
    """One simulation run of ``model`` in ``folder`` (no verifier built): what it printed
    (an assertion that fails stops it, with spin's ``assertion violated`` line)."""
    return _run(["spin", *flags(defines), model], folder, timeout, check=False)
