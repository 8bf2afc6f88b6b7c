"""Every command of the ``ringfence`` script works on a plain install (``install_requires``
only), and one that needs an optional extra says which, in one line, with exit status 2.

Proved without a second install: the commands run with every module outside
``install_requires`` refused at import (``tests/plain_install.py``), in their own process
and in every actor process they start. The main job broke exactly this way once: building
the command line imported a benchmark that needed a test extra.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from plain_install import (
    allowed_modules,
    extra_requires,
    install_requires,
    plain_env,
    ringfence,
)

from ringfence.actors import commands
from ringfence.runtime import cli
from ringfence.runtime.commands import Command
from ringfence.runtime.extras import MODULE_EXTRAS
from ringfence.shm import names

COMMANDS = [
    (),
    *[(name,) for name in ("launch", "serve", "router", "replay", "clean", "bench")],
    *[("bench", name) for name in commands.TABLE.benchmarks],
]
# What `ringfence --help` and `ringfence clean` must not import: they answer at once.
HEAVY = {"torch", "numpy", "fastapi", "uvicorn", "httpx", "tokenizers", "jinja2", "structlog"}


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict[str, str]:
    return plain_env(tmp_path_factory.mktemp("plain"))


def failure(proc, env: dict[str, str]) -> str:
    """What a command that failed printed, and every import the refusal turned away."""
    refused = Path(env["RINGFENCE_PLAIN_REFUSED"])
    turned_away = (
        sorted({line.split()[1] for line in refused.read_text().splitlines()})
        if (refused.exists())
        else []
    )
    return (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\n"
        f"modules refused as outside install_requires: {turned_away}"
    )


def test_the_refusal_covers_the_extras_and_spares_install_requires(plain, tmp_path):
    # The check has teeth: a module of an extra is refused, naming it; a dependency is not.
    allowed = allowed_modules()
    assert {"torch", "orjson", "posix_ipc", "multiprocess", "structlog", "fastapi"} <= allowed
    assert {"zmq", "msgpack"} <= allowed  # KV events: the router follows them by default
    assert not {"redis", "matplotlib", "transformers", "pytest", "hypothesis"} & allowed
    script = "import orjson, torch\nimport redis"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=plain,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert "ModuleNotFoundError: No module named 'redis'" in proc.stderr
    assert "redis" in Path(plain["RINGFENCE_PLAIN_REFUSED"]).read_text().split()


@pytest.mark.parametrize("words", COMMANDS, ids=[" ".join(c) or "ringfence" for c in COMMANDS])
def test_every_commands_help_works_on_a_plain_install(plain, tmp_path, words):
    proc = ringfence(*words, "--help", env=plain, cwd=tmp_path)
    assert proc.returncode == 0, failure(proc, plain)
    assert proc.stdout.startswith(f"usage: ringfence {' '.join(words)}".rstrip())


def test_help_and_clean_import_nothing_heavy(tmp_path):
    loaded = tmp_path / "loaded"
    env = plain_env(tmp_path / "site", loaded=loaded)
    # clean of a run that does not exist: the command's whole path, removing nothing (--all
    # would remove other tests' names that have no lease, on the other test worker).
    for args in (("--help",), ("clean", names.new_run_id())):
        proc = ringfence(*args, env=env, cwd=tmp_path)
        assert proc.returncode == 0, failure(proc, env)
        (record,) = tmp_path.glob("loaded.*")
        modules = set(record.read_text().split())
        record.unlink()
        assert not modules & HEAVY, f"ringfence {' '.join(args)} imported {modules & HEAVY}"


def test_a_launch_its_replay_and_clean_run_on_a_plain_install(plain, tmp_path):
    # Its actors are processes of their own: the refusal holds in them too.
    run_dir = tmp_path / "run"
    launch = ringfence(
        "launch",
        "--workload",
        "synthetic:unique",
        "--set",
        "engine.requests=2",
        "--set",
        "model.preset=tiny",
        "--run-dir",
        str(run_dir),
        env=plain,
        cwd=tmp_path,
        timeout=240,
    )
    assert launch.returncode == 0, failure(launch, plain)
    assert "2 finished" in launch.stdout
    replay = ringfence("replay", str(run_dir), env=plain, cwd=tmp_path)
    assert replay.returncode == 0, failure(replay, plain)
    clean = ringfence("clean", str(run_dir), env=plain, cwd=tmp_path)
    assert clean.returncode == 0, failure(clean, plain)


def test_a_backend_whose_extra_is_missing_is_named_in_one_line_before_the_run(plain, tmp_path):
    proc = ringfence(
        "launch",
        "--set",
        "cache.storage.backend=redis",
        "--run-dir",
        str(tmp_path / "run"),
        env=plain,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, failure(proc, plain)
    assert proc.stderr.splitlines() == [
        "ringfence launch: cache.storage.backend = 'redis' needs the 'redis' module, which is "
        "not installed: pip install 'ringfence[redis]'"
    ]
    assert not (tmp_path / "run").exists()  # refused before the run existed


@pytest.fixture
def bench_needing(tmp_path, monkeypatch):
    """``ringfence bench ring`` pointed at a module that needs ``module`` (not installed):
    at import (``at="import"``) or when it runs (``at="main"``)."""

    def make(module: str, at: str) -> None:
        missing = f'raise ModuleNotFoundError("No module named {module!r}", name={module!r})'
        body = {
            "import": f"{missing}\n",
            "main": f"def add_arguments(parser):\n    pass\n\ndef main(args):\n    {missing}\n",
        }[at]
        (tmp_path / f"bench_needing_{module}_{at}.py").write_text(body)
        monkeypatch.syspath_prepend(str(tmp_path))
        ring = Command(module=f"bench_needing_{module}_{at}", help="a benchmark needing an extra")
        table = commands.TABLE
        benchmarks = {**table.benchmarks, "ring": ring}
        monkeypatch.setattr(commands, "TABLE", dataclasses.replace(table, benchmarks=benchmarks))

    return make


def test_a_command_module_that_needs_an_extra_is_named_in_one_line(bench_needing, capsys):
    bench_needing("transformers", at="import")
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "ring", "--help"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        "ringfence bench ring: needs the 'transformers' module, which is not installed: "
        "pip install 'ringfence[bench]'\n"
    )


def test_a_command_that_reaches_for_an_extra_while_it_runs_names_it_in_one_line(
    bench_needing, capsys
):
    bench_needing("matplotlib", at="main")
    assert cli.main(["bench", "ring"]) == 2
    assert capsys.readouterr().err == (
        "ringfence bench: needs the 'matplotlib' module, which is not installed: "
        "pip install 'ringfence[bench]'\n"
    )


def test_a_missing_module_that_no_extra_installs_is_left_as_it_is(bench_needing):
    # A module of install_requires that is missing is a broken install, not an extra.
    bench_needing("orjson", at="main")
    with pytest.raises(ModuleNotFoundError, match="orjson"):
        cli.main(["bench", "ring"])


def test_the_extras_map_agrees_with_setup_cfg():
    # Each mapped module is installed by a distribution that its extra lists, and every
    # requirement of an optional extra is mapped (so a missing one is always named).
    providers = metadata.packages_distributions()
    core = {r.name.lower().replace("_", "-") for r in install_requires()}
    for extra in {*MODULE_EXTRAS.values()}:
        listed = {r.name.lower().replace("_", "-") for r in extra_requires(extra)}
        mapped = {m for m, e in MODULE_EXTRAS.items() if e == extra}
        assert not listed & core, f"[{extra}] repeats install_requires: {listed & core}"
        for module in mapped:
            dists = {d.lower().replace("_", "-") for d in providers.get(module, [])}
            assert dists & listed, f"{module} is mapped to [{extra}], which does not install it"
        installed = {d.lower().replace("_", "-") for m in mapped for d in providers.get(m, [])}
        assert listed <= installed, f"[{extra}] lists {listed - installed} that no module maps"
