"""DESIGN.md's dependency table, enforced between the project's own packages.

Every ``import`` and ``from ... import`` in the source (at any depth: an import inside a
function is still a static import) is checked against the rules below. Import paths
held as strings (``runtime.topology``, the benchmark table of ``ringfence bench``, the
config schema and the tools' sections) are how the lower layers name the upper ones, and
are not imports.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shm", "runtime", "cache", "sched", "actors")
# What each package may import of the project (a prefix matches the module and below it).
ALLOWED = {
    "shm": ("ringfence.shm",),
    "runtime": ("ringfence.runtime", "ringfence.shm"),
    "cache": ("ringfence.cache", "ringfence.shm.errors"),
    "sched": ("ringfence.sched", "ringfence.cache", "ringfence.shm.errors"),
    "actors": ("ringfence.",),
}
# The tools (benchmarks, the test oracle, harness and helpers: all of actors/tools/) and
# replay. The product never imports them; no package below ``actors`` holds one.
TOOLS = (
    "ringfence.actors.tools",
    "ringfence.actors.replay",
)


class Import(NamedTuple):
    where: str  # "actors/engine/actor.py:42"
    importer: str  # the importing module, dotted
    imported: str  # the imported module, dotted


def module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["ringfence", *parts])


def is_module(root: Path, module: str) -> bool:
    """Whether dotted ``module`` (of ``ringfence``) is a module or package under ``root``."""
    path = root.joinpath(*module.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(root: Path) -> list[Import]:
    """Every import of a ``ringfence`` module by a module of the five packages under ``root``."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            importer = module_of(path, root)
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    # "from ringfence.actors import engine" imports ringfence.actors.engine.
                    inner = [f"{node.module}.{a.name}" for a in node.names]
                    names = [m for m in inner if is_module(root, m)] or [node.module]
                where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
                for name in names:
                    if name.startswith("ringfence."):
                        found.append(Import(where, importer, name))
    return found


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(
        module == p or module.startswith(p if p.endswith(".") else p + ".") for p in prefixes
    )


def violations(root: Path) -> list[str]:
    """What breaks the dependency table in the tree at ``root``, one line each."""
    found = []
    for imp in imports(root):
        package = imp.importer.split(".")[1]
        if not _under(imp.imported, ALLOWED[package]):
            found.append(f"{imp.where}: {package} may not import {imp.imported}")
        elif not _under(imp.importer, TOOLS) and _under(imp.imported, TOOLS):
            found.append(f"{imp.where}: product module {imp.importer} imports tool {imp.imported}")
    return found


def test_the_tree_keeps_the_dependency_table():
    assert violations(ROOT) == []


def test_every_tool_is_a_package_of_actors_in_the_tree():
    assert all(tool.startswith("ringfence.actors.") for tool in TOOLS)
    assert [tool for tool in TOOLS if not is_module(ROOT, tool)] == []


def test_the_scan_sees_the_imports_it_must_judge():
    found = {(i.importer, i.imported) for i in imports(ROOT)}
    assert ("ringfence.cache.block_pool", "ringfence.shm.errors") in found
    assert ("ringfence.actors.engine.actor", "ringfence.actors.engine.ledger") in found
    assert ("ringfence.actors.tools.bench.e2e", "ringfence.actors.tools.testing.local") in found


def write(root: Path, module: str, text: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(
    ("module", "text", "problem"),
    [
        (
            "actors/engine/actor",
            "def f():\n    from ringfence.actors.tools.bench import plot\n",
            "actors/engine/actor.py:2: product module ringfence.actors.engine.actor imports tool "
            "ringfence.actors.tools.bench",
        ),
        (
            "actors/kv/space",
            "from ringfence.actors.tools.testing.shm import reap\n",
            "actors/kv/space.py:1: product module ringfence.actors.kv.space imports tool "
            "ringfence.actors.tools.testing.shm",
        ),
        (
            "actors/executors/worker",
            "import ringfence.actors.replay.log\n",
            "actors/executors/worker.py:1: product module ringfence.actors.executors.worker "
            "imports tool ringfence.actors.replay.log",
        ),
        (
            "runtime/supervisor",
            "from ringfence.actors.engine.actor import Engine\n",
            "runtime/supervisor.py:1: runtime may not import ringfence.actors.engine.actor",
        ),
        (
            "cache/block_pool",
            "from ringfence.shm.ring import RingWriter\n",
            "cache/block_pool.py:1: cache may not import ringfence.shm.ring",
        ),
        (
            "sched/scheduler",
            "from ringfence.runtime.log import ActorLog\n",
            "sched/scheduler.py:1: sched may not import ringfence.runtime.log",
        ),
    ],
    ids=["product-imports-bench", "product-imports-test-helper", "product-imports-replay",
         "runtime-imports-actors", "cache-imports-shm-ring", "sched-imports-runtime"],
)  # fmt: skip
def test_an_import_against_the_table_is_named_with_its_file_and_line(
    tmp_path, module, text, problem
):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    write(tmp_path, module, text)
    assert violations(tmp_path) == [problem]


def test_a_tool_may_import_the_product_and_other_tools(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    write(
        tmp_path,
        "actors/tools/bench/e2e",
        "from ringfence.actors.tools.testing.local import LocalRunner\n",
    )
    write(tmp_path, "actors/replay/redrive", "from ringfence.sched.scheduler import Scheduler\n")
    assert violations(tmp_path) == []
