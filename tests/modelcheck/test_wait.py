"""The executors' fence wait, from one source: the code's wait (``LaneExecutor.wait_fence``
in actors/executors/lanes.py, which waits lane by lane) decides exactly as the model's
guard (``FENCE_OK`` in protocol.pml, one guard over all lanes) on every state of a small
space: each lane, each fence and each set of watermarks up to 3. The guard is read from
protocol.pml's text, so an edit of either side that changes what runs fails here; and
mutants of the code's wait (a comparison off by one, a lane skipped), made by editing
lanes.py's source, must fail it."""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ringfence.actors.executors import lanes as lanes_module
from ringfence.cache.fences import Fence, Lane
from ringfence.cache.ids import Seq

PROTOCOL = Path(__file__).with_name("protocol.pml")
LANES = (Lane.STEP, Lane.SWAP, Lane.STORE)  # protocol.pml's STEP, SWAP, STORE: 0, 1, 2
VALUES = range(4)  # watermarks and fence values 0..3


def model_guard() -> Callable[[int, list[int], list[int]], bool]:
    """``FENCE_OK(r, k)`` of protocol.pml as a function of (the op's lane index, the fence by
    lane, the watermarks by lane), translated from its C-preprocessor text."""
    text = PROTOCOL.read_text()
    found = re.search(r"#define FENCE_OK\(r, k\) (.*?)\n#define", text, re.S)
    assert found, "protocol.pml has no FENCE_OK guard"
    expr = found.group(1).replace("\\\n", " ")
    for name, index in (("STEP", 0), ("SWAP", 1), ("STORE", 2)):
        expr = expr.replace(f"SEEN(r, {name})", f"wm[{index}]")
        expr = expr.replace(f"ofs[(k) * NL + {name}]", f"fence[{index}]")
        expr = expr.replace(f"olane[k] == {name}", f"lane == {index}")
    expr = expr.replace("&&", " and ").replace("||", " or ")
    assert re.fullmatch(r"[\s()a-z_\[\]0-9=<>]+", expr), f"untranslated guard: {expr}"
    code = compile(expr, "FENCE_OK", "eval")
    return lambda lane, fence, wm: bool(eval(code, {}, {"lane": lane, "fence": fence, "wm": wm}))


class Mark:
    """A watermark at a fixed value; its overdue error is what a wait past its deadline
    raises."""

    def __init__(self, value: int) -> None:
        self._value = value

    def value(self) -> int:
        return self._value

    def overdue(self, target: int, detail: str = "") -> Exception:
        return TimeoutError(f"{self._value} < {target} {detail}")


def code_runs(module: ModuleType, lane: Lane, fence: list[int], wm: list[int]) -> bool:
    """Whether ``module``'s ``LaneExecutor.wait_fence`` lets an op of ``lane`` with ``fence``
    run at watermarks ``wm`` now (a wait that would block gives up at once)."""
    lane_class = type("Lane", (module.LaneExecutor,), {"lane": lane})
    executor: Any = object.__new__(lane_class)
    executor.marks = {name: Mark(wm[i]) for i, name in enumerate(LANES)}
    executor.skip_fences = False
    executor.wait_until = lambda reached, *args, **kwargs: reached()
    executor.stale = lambda epoch: ""
    own = LANES.index(lane)
    given = [0 if i == own else value for i, value in enumerate(fence)]
    try:
        executor.wait_fence(
            1, 1, Fence(step=Seq(given[0]), swap=Seq(given[1]), store=Seq(given[2]))
        )
    except TimeoutError:
        return False
    return True


def disagreements(module: ModuleType) -> list[tuple[str, list[int], list[int]]]:
    guard = model_guard()
    found = []
    for own, lane in enumerate(LANES):
        for fence in itertools.product(VALUES, repeat=3):
            f = [0 if i == own else v for i, v in enumerate(fence)]
            for wm in itertools.product(VALUES, repeat=3):
                if guard(own, f, list(wm)) != code_runs(module, lane, f, list(wm)):
                    found.append((str(lane), f, list(wm)))
    return found


def mutated(old: str, new: str) -> ModuleType:
    """lanes.py with ``old`` replaced by ``new`` (once; it must be there), as a module."""
    source = Path(lanes_module.__file__).read_text()
    assert source.count(old) == 1, f"lanes.py no longer holds {old!r}"
    spec = importlib.util.spec_from_loader("lanes_mutant", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["lanes_mutant"] = module
    try:
        exec(compile(source.replace(old, new), "lanes_mutant", "exec"), module.__dict__)
    finally:
        del sys.modules["lanes_mutant"]
    return module


def test_the_codes_wait_decides_as_the_models_guard_on_every_small_state() -> None:
    assert disagreements(lanes_module) == []


CODE_MUTANTS = {
    "off by one": ("mark.value() < target", "mark.value() < target - 1"),
    "a lane skipped": ("for lane, target in fence.waits().items():",
                       "for lane, target in list(fence.waits().items())[1:]:"),
}  # fmt: skip


@pytest.mark.parametrize("name", CODE_MUTANTS)
def test_a_mutant_of_the_codes_wait_disagrees_with_the_model(name: str) -> None:
    found = disagreements(mutated(*CODE_MUTANTS[name]))
    assert found, f"the mutant {name!r} of lanes.py's wait went unnoticed"
    print(f"{name}: {len(found)} states disagree, first {found[0]}")
