"""docs/design.md, "The dependency table", enforced between the project's own packages.

Every ``import`` and ``from ... import`` in the source (at any depth: an import inside a
function is still a static import) is checked against the rules below. Import paths
held as strings (``runtime.topology``, the benchmark table of ``ringfence bench``, the
config schema and the tools' sections) are how the lower layers name the upper ones, and
are not imports.
"""

from __future__ import annotations

import ast
import itertools
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


def violations(root: Path, scanned: list[Import] | None = None) -> list[str]:
    """What breaks the dependency table in the tree at ``root`` (``scanned``: its imports,
    where already read), one line each."""
    found = []
    for imp in imports(root) if scanned is None else scanned:
        package = imp.importer.split(".")[1]
        if not _under(imp.imported, ALLOWED[package]):
            found.append(f"{imp.where}: {package} may not import {imp.imported}")
        elif not _under(imp.importer, TOOLS) and _under(imp.imported, TOOLS):
            found.append(f"{imp.where}: product module {imp.importer} imports tool {imp.imported}")
    return found


@pytest.fixture(scope="module")
def tree_imports() -> list[Import]:
    """``imports(ROOT)``: the tree read once for every test of this file that judges it (a
    read parses every module of the five packages, seconds on two shared cores)."""
    return imports(ROOT)


def test_the_tree_keeps_the_dependency_table(tree_imports):
    assert violations(ROOT, tree_imports) == []


def test_every_tool_is_a_package_of_actors_in_the_tree():
    assert all(tool.startswith("ringfence.actors.") for tool in TOOLS)
    assert [tool for tool in TOOLS if not is_module(ROOT, tool)] == []


def test_the_scan_sees_the_imports_it_must_judge(tree_imports):
    found = {(i.importer, i.imported) for i in tree_imports}
    assert ("ringfence.cache.block_pool", "ringfence.shm.errors") in found
    assert ("ringfence.actors.engine.actor", "ringfence.actors.engine.ledger") in found
    assert (
        "ringfence.actors.tools.bench.e2e_runs",
        "ringfence.actors.tools.testing.local",
    ) in found


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


# --- Inside ``ringfence.actors``: imports only run down ----------------------------------------


# The layers of ``ringfence.actors``, written once, lowest first. A layer holds subpackages
# and modules (named under ``ringfence.actors``; the longest name that covers a module
# places it, so a role's config section, a leaf the run's schema composes, sits apart from
# its subpackage) and stands on the layers it names as ``over``. A module may import its own
# layer and every layer below it, directly or not; nothing else: not a layer above, and not
# one beside it (the engine and the executors only exchange messages of the protocol).
class Layer(NamedTuple):
    name: str
    holds: tuple[str, ...]  # subpackages and modules under ringfence.actors
    over: tuple[str, ...] = ()  # the layers right below it


ACTOR_LAYERS: tuple[Layer, ...] = (
    Layer("sections", ("model.config", "executors.config", "engine.config", "serve.config",
                       "events.config", "http.env")),
    Layer("schema", ("config",), over=("sections",)),  # the sections composed
    # Tokenizers, chat templates, grammars, tool calls: no torch (test_packaging checks).
    Layer("text", ("text",)),
    Layer("model", ("model",), over=("schema", "text")),  # shape, weights, what it announces
    Layer("kv", ("kv",), over=("model",)),  # each tier's KV tensor, its layout, block copies
    Layer("protocol", ("protocol",), over=("kv",)),  # every channel's messages, the lanes' counters
    Layer("executors", ("executors",), over=("protocol",)),  # the Worker, the Transfer lanes
    Layer("client", ("client",), over=("protocol",)),  # the users' client and its slots
    # The checks, the GPU defaults, the fenced topology.
    Layer("launch", ("preflight", "device_defaults", "topology"), over=("protocol",)),
    Layer("events", ("events",), over=("schema",)),  # KV events on the wire, their publisher
    Layer("engine", ("engine",), over=("client", "launch", "events")),
    # The HTTP edge serve and router share: errors, keys, TLS, limits and deadlines, load.
    Layer("http", ("http",), over=("protocol",)),
    Layer("serve", ("serve",), over=("engine", "http")),
    Layer("router", ("router",), over=("http", "events")),  # never serve: the edge is shared
    Layer("replay", ("replay",), over=("engine",)),
    Layer("tools", ("tools",), over=("executors", "serve", "router", "replay")),
    Layer("commands", ("commands",)),  # every command's module by name; it imports none
)  # fmt: skip
ACTORS = "ringfence.actors"


def below(layers: tuple[Layer, ...] = ACTOR_LAYERS) -> dict[str, set[str]]:
    """Each layer's name -> the names of every layer under it, directly or not. A layer may
    stand only on layers written before it, so the order has no circle (ValueError)."""
    under: dict[str, set[str]] = {}
    for layer in layers:
        if unknown := [name for name in layer.over if name not in under]:
            raise ValueError(f"layer {layer.name} stands on {unknown}, not written before it")
        under[layer.name] = set(layer.over).union(*(under[name] for name in layer.over))
    return under


def layer_of(module: str, layers: tuple[Layer, ...] = ACTOR_LAYERS) -> str | None:
    """The name of the layer of ``module`` (dotted, under ``ringfence.actors``; the package
    itself is in the lowest), or None where no layer holds it."""
    rest = module.removeprefix(ACTORS).removeprefix(".")
    if not rest:
        return layers[0].name
    covering = [
        (len(name), layer.name)
        for layer in layers
        for name in layer.holds
        if rest == name or rest.startswith(name + ".")
    ]
    return max(covering)[1] if covering else None


def upward_imports(root: Path, scanned: list[Import] | None = None) -> list[str]:
    """Each import inside ``ringfence.actors`` that goes to a layer not below its own, and
    each module of ``actors/`` that no layer holds, one line each (``scanned``: the tree's
    imports, where already read)."""
    under = below()
    found = [
        f"{path.relative_to(root)}: {module} has no layer in ACTOR_LAYERS"
        for path in sorted((root / "actors").rglob("*.py"))
        if layer_of(module := module_of(path, root)) is None
    ]
    for imp in imports(root) if scanned is None else scanned:
        if not (_under(imp.importer, (ACTORS,)) and _under(imp.imported, (ACTORS,))):
            continue
        own, other = layer_of(imp.importer), layer_of(imp.imported)
        if own is None or other is None or other == own or other in under[own]:
            continue
        where = "above" if own in under[other] else "beside"
        found.append(
            f"{imp.where}: {imp.importer} ({own}) imports {imp.imported} ({other}), "
            f"a layer {where} its own"
        )
    return found


def import_cycles(root: Path, scanned: list[Import] | None = None) -> list[str]:
    """Each knot of modules that import each other in a circle (lazily, under
    ``TYPE_CHECKING`` or at the top: every import counts), named by one of its circles
    with the file and line of each arrow (``scanned``: the tree's imports, where already
    read)."""
    edges: dict[str, dict[str, str]] = {}
    for imp in imports(root) if scanned is None else scanned:
        if imp.importer != imp.imported:
            edges.setdefault(imp.importer, {}).setdefault(imp.imported, imp.where)
    found = []
    for knot in _knots(edges):
        start = min(knot)
        path = _shortest_way_back(edges, start, knot)
        arrows = ", ".join(edges[a][b] for a, b in itertools.pairwise(path))
        more = len(knot) - (len(path) - 1)
        extra = f" (and {more} more modules in the knot)" if more else ""
        found.append(f"cycle {' -> '.join(path)} ({arrows}){extra}")
    return sorted(found)


def _knots(edges: dict[str, dict[str, str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    knots = []
    for root_node in sorted(edges):
        if root_node in index:
            continue
        work = [(root_node, iter(sorted(edges.get(root_node, {}))))]
        index[root_node] = low[root_node] = len(index)
        stack.append(root_node)
        on_stack.add(root_node)
        while work:
            node, successors = work[-1]
            child = next(successors, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                knot = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    knot.add(member)
                    if member == node:
                        break
                if len(knot) > 1:
                    knots.append(knot)
    return knots


def _shortest_way_back(edges: dict[str, dict[str, str]], start: str, knot: set[str]) -> list[str]:
    """The shortest circle from ``start`` back to it through ``knot`` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(edges.get(node, {})):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt in knot and nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{start} is in a knot but has no way back")


def test_inside_actors_every_import_runs_down_the_layers(tree_imports):
    assert upward_imports(ROOT, tree_imports) == []


def test_no_modules_import_each_other_in_a_circle(tree_imports):
    assert import_cycles(ROOT, tree_imports) == []


def test_every_name_of_the_layer_order_is_a_subpackage_or_module_of_actors():
    below()  # each layer stands on layers written before it
    names = [name for layer in ACTOR_LAYERS for name in layer.holds]
    assert len(names) == len(set(names))
    for name in names:
        assert is_module(ROOT, f"{ACTORS}.{name}"), name


def test_a_layer_may_stand_only_on_layers_written_before_it():
    with pytest.raises(ValueError, match=r"layer kv stands on \['protocol'\]"):
        below((Layer("kv", ("kv",), over=("protocol",)), Layer("protocol", ("protocol",))))


def tree(tmp_path: Path, modules: dict[str, str]) -> Path:
    """A source tree at ``tmp_path`` with the five packages and ``modules`` (path -> text)."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    for module, text in modules.items():
        write(tmp_path, module, text)
    return tmp_path


@pytest.mark.parametrize(
    ("modules", "problem"),
    [
        (
            {"actors/model/loader": "def f():\n    from ringfence.actors.kv.space import x\n",
             "actors/kv/space": ""},
            "actors/model/loader.py:2: ringfence.actors.model.loader (model) imports "
            "ringfence.actors.kv.space (kv), a layer above its own",
        ),
        (
            {"actors/protocol/client": "import ringfence.actors.engine.summary\n",
             "actors/engine/summary": ""},
            "actors/protocol/client.py:1: ringfence.actors.protocol.client (protocol) imports "
            "ringfence.actors.engine.summary (engine), a layer above its own",
        ),
        (
            {"actors/engine/actor": "from ringfence.actors.executors import lanes\n",
             "actors/executors/lanes": ""},
            "actors/engine/actor.py:1: ringfence.actors.engine.actor (engine) imports "
            "ringfence.actors.executors.lanes (executors), a layer beside its own",
        ),
        (
            {"actors/config": "from ringfence.actors.engine.actor import Engine\n",
             "actors/engine/actor": ""},
            "actors/config.py:1: ringfence.actors.config (schema) imports "
            "ringfence.actors.engine.actor (engine), a layer above its own",
        ),
        (
            {"actors/serve/app": "from ringfence.actors.tools.bench.e2e import run\n",
             "actors/tools/bench/e2e": ""},
            "actors/serve/app.py:1: ringfence.actors.serve.app (serve) imports "
            "ringfence.actors.tools.bench.e2e (tools), a layer above its own",
        ),
        (
            {"actors/router/flow": "from ringfence.actors.serve.api import CompletionRequest\n",
             "actors/serve/api": ""},
            "actors/router/flow.py:1: ringfence.actors.router.flow (router) imports "
            "ringfence.actors.serve.api (serve), a layer beside its own",
        ),
        (
            {"actors/gadgets/thing": ""},
            "actors/gadgets/thing.py: ringfence.actors.gadgets.thing has no layer in ACTOR_LAYERS",
        ),
    ],
    ids=["model-imports-kv-lazily", "protocol-imports-engine", "engine-imports-executors",
         "schema-imports-an-actor", "product-imports-bench", "router-imports-serve",
         "unplaced-subpackage"],
)  # fmt: skip
def test_an_import_that_runs_up_a_layer_is_named_with_its_file_and_line(tmp_path, modules, problem):
    assert upward_imports(tree(tmp_path, modules)) == [problem]


def test_imports_down_or_within_a_layer_and_a_section_under_the_schema_pass(tmp_path):
    root = tree(
        tmp_path,
        {
            "actors/kv/layout": "from ringfence.actors.model.shape import ModelShape\n",
            "actors/model/shape": "from ringfence.actors.config import Config\n",
            "actors/config": "from ringfence.actors.engine.config import EngineConfig\n",
            "actors/engine/config": "",
            "actors/engine/launch": "from ringfence.actors.client.slot import CLIENT\n",
            "actors/client/slot": "from ringfence.actors.protocol.client import Submit\n",
            "actors/protocol/client": "",
            "actors/router/app": "from ringfence.actors.http.errors import ApiError\n",
            "actors/serve/api": "from ringfence.actors.http.errors import ApiError\n",
            "actors/http/errors": "from ringfence.sched.request import SamplingParams\n",
            "actors/tools/bench/e2e": "from ringfence.actors.replay.log import read\n",
            "actors/replay/log": "",
        },
    )
    assert upward_imports(root) == []


def test_a_circle_of_imports_is_named_lazy_or_not_with_each_arrow(tmp_path):
    root = tree(
        tmp_path,
        {
            "runtime/actor": "from ringfence.runtime.config import RunConfig\n",
            "runtime/config": "from ringfence.runtime.topology import import_target\n",
            "runtime/topology": "def check():\n    from ringfence.runtime.actor import Actor\n",
            "actors/serve/app": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from ringfence.actors.serve.frontend import FrontEnd\n",
            "actors/serve/frontend": "def start():\n    from ringfence.actors.serve.app import a\n",
            "cache/pool": "from ringfence.cache.ids import BlockId\n",
            "cache/ids": "",
        },
    )
    assert import_cycles(root) == [
        "cycle ringfence.actors.serve.app -> ringfence.actors.serve.frontend -> "
        "ringfence.actors.serve.app (actors/serve/app.py:3, actors/serve/frontend.py:2)",
        "cycle ringfence.runtime.actor -> ringfence.runtime.config -> ringfence.runtime.topology"
        " -> ringfence.runtime.actor (runtime/actor.py:1, runtime/config.py:1, "
        "runtime/topology.py:2)",
    ]


def test_a_knot_larger_than_its_named_circle_says_how_many_more(tmp_path):
    root = tree(
        tmp_path,
        {
            "shm/a": "import ringfence.shm.b\nimport ringfence.shm.c\n",
            "shm/b": "import ringfence.shm.a\n",
            "shm/c": "import ringfence.shm.a\n",
        },
    )
    assert import_cycles(root) == [
        "cycle ringfence.shm.a -> ringfence.shm.b -> ringfence.shm.a (shm/a.py:1, shm/b.py:1) "
        "(and 1 more modules in the knot)"
    ]


# --- The whole config: only the composition root imports it ------------------------------------


# The run's schema, every section composed (``runtime.config`` finds it by the import path
# it holds as a string, which is not an import). An actor declares the sections it reads
# (``Actor.config_section``) and receives only those; every other module takes the sections it
# reads, or any object that has them, so a leaf cannot grow a dependency on an unrelated key.
# Only the composition root imports the whole: the model's launch check, which reads the
# checkpoint against every section that names a shape, the device defaults, which build a
# new config from the whole, and the tools, which build configs. The topologies' other
# launch checks take the sections they read, as everything else does.
CONFIG = "ringfence.actors.config"
CONFIG_ROOT = (
    "ringfence.actors.preflight",  # check_model
    "ringfence.actors.device_defaults",  # resolve_device_defaults
)


def whole_config_imports(root: Path, scanned: list[Import] | None = None) -> list[str]:
    """Each import of the run's whole schema by a module outside the composition root (and
    not a tool), one line each (``scanned``: the tree's imports, where already read)."""
    return [
        f"{imp.where}: {imp.importer} imports the whole config ({CONFIG}); "
        "take the sections it reads"
        for imp in (imports(root) if scanned is None else scanned)
        if _under(imp.imported, (CONFIG,))
        and imp.importer not in CONFIG_ROOT
        and not _under(imp.importer, TOOLS)
    ]


def test_only_the_composition_root_and_the_tools_import_the_whole_config(tree_imports):
    assert whole_config_imports(ROOT, tree_imports) == []


def test_each_module_of_the_composition_root_still_needs_the_whole_config(tree_imports):
    importers = {imp.importer for imp in tree_imports if imp.imported == CONFIG}
    assert sorted(set(CONFIG_ROOT) - importers) == []


def test_a_leaf_that_imports_the_whole_config_is_named_with_its_file_and_line(tmp_path):
    root = tree(
        tmp_path,
        {
            "actors/config": "from ringfence.actors.engine.config import EngineConfig\n",
            "actors/kv/layout": "from ringfence.actors.config import Config\n",
            "actors/engine/intake": "def f():\n    from ringfence.actors import config\n",
            "actors/preflight": "from ringfence.actors.config import Config\n",
            "actors/tools/testing/local": "from ringfence.actors.config import Config\n",
            "actors/engine/config": "",
        },
    )
    assert whole_config_imports(root) == [
        "actors/engine/intake.py:2: ringfence.actors.engine.intake imports the whole config "
        "(ringfence.actors.config); take the sections it reads",
        "actors/kv/layout.py:1: ringfence.actors.kv.layout imports the whole config "
        "(ringfence.actors.config); take the sections it reads",
    ]


# --- The runtime names the actors by two import paths ------------------------------------------

# The run's config schema and the actors' command table: how the runtime reaches the actors
# (a topology is a config value, whose default the schema gives).
RUNTIME_NAMES = ("ringfence.actors.commands:TABLE", "ringfence.actors.config:Config")


def actor_paths_in_runtime(root: Path) -> list[str]:
    """Each string in the code of ``runtime/`` (docstrings aside) that names something
    under ``ringfence.actors``, as ``file:line: text``."""
    found = []
    for path in sorted((root / "runtime").rglob("*.py")):
        module = ast.parse(path.read_text(), filename=str(path))
        documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(module)
            if isinstance(node, documented) and node.body and isinstance(node.body[0], ast.Expr)
        }
        found += [
            f"{path.relative_to(root)}:{node.lineno}: {node.value}"
            for node in ast.walk(module)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "ringfence.actors" in node.value
            and id(node) not in docstrings
        ]
    return found


def test_the_runtime_names_only_the_command_table_and_the_config_schema():
    named = actor_paths_in_runtime(ROOT)
    assert sorted(line.split(": ", 1)[1] for line in named) == list(RUNTIME_NAMES), named


def test_a_runtime_module_that_names_an_actor_module_is_named_with_its_file_and_line(tmp_path):
    text = '"""Runs ``ringfence.actors.serve.cli``."""\n\nSERVE = "ringfence.actors.serve.cli"\n'
    root = tree(tmp_path, {"runtime/cli": text})
    assert actor_paths_in_runtime(root) == ["runtime/cli.py:3: ringfence.actors.serve.cli"]
