"""The distribution: subpackage layout, both install modes, and the dependency direction."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "actors", "shm", "cache", "sched")


def run(*cmd: str, cwd: Path, env_path: Path | None = None) -> str:
    env = None
    if env_path is not None:
        import os

        env = {**os.environ, "PYTHONPATH": str(env_path)}
    proc = subprocess.run(
        cmd, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for item in ("setup.cfg", "pyproject.toml", "README.md", *PACKAGES):
        path = ROOT / item
        if path.is_dir():
            shutil.copytree(path, src / item, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / item)
    out = tmp_path_factory.mktemp("wheel")
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(out),
        ".",
        cwd=src,
    )
    (built,) = out.glob("ringfence-*.whl")
    return built


def test_the_wheel_holds_ringfence_subpackages_and_no_top_level_ones(wheel):
    files = zipfile.ZipFile(wheel).namelist()
    tops = {f.split("/")[0] for f in files if not f.startswith("ringfence-")}
    assert tops == {"ringfence"}, f"unexpected top-level entries: {tops}"
    for pkg in PACKAGES:
        assert f"ringfence/{pkg}/__init__.py" in files
        assert f"ringfence/{pkg}/py.typed" in files
    assert "ringfence/shm/ring.py" in files
    # Every subpackage of the tree is in the wheel (setup.cfg lists each one).
    for init in sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")):
        assert f"ringfence/{init.relative_to(ROOT).as_posix()}" in files, init
    assert "ringfence/__init__.py" not in files  # a namespace package: no folder of its own
    entry_points = zipfile.ZipFile(wheel).read(
        next(f for f in files if f.endswith("entry_points.txt"))
    )
    assert b"ringfence = ringfence.runtime.cli:console_main" in entry_points


def test_an_installed_wheel_imports_from_site_packages_and_leaves_the_stdlib_sched_alone(
    wheel, tmp_path
):
    target = tmp_path / "site"
    run(
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "-q",
        "--target",
        str(target),
        str(wheel),
        cwd=tmp_path,
    )
    out = run(
        sys.executable,
        "-c",
        "import sched, ringfence.shm.ring as r, ringfence.sched\n"
        "print(sched.__file__); print(r.__file__)",
        cwd=tmp_path,
        env_path=target,
    )
    stdlib_sched, ring_file = out.split()
    assert "site-packages" not in stdlib_sched and str(ROOT) not in stdlib_sched
    assert ring_file.startswith(str(target))


def imported_by(module: str) -> set[str]:
    code = f"import sys, importlib, pkgutil; m = importlib.import_module({module!r})\n"
    code += "for i in pkgutil.walk_packages(m.__path__, m.__name__ + '.'):\n"
    code += "    importlib.import_module(i.name)\n"
    code += "print(' '.join(sorted(k.split('.')[0] for k in sys.modules)))"
    return set(run(sys.executable, "-c", code, cwd=ROOT.parent).split())


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("ringfence.cache", {"torch", "posix_ipc", "multiprocess", "structlog"}),
        # sched uses cache (block keys), and cache may use orjson: so may sched, through it.
        ("ringfence.sched", {"torch", "posix_ipc", "multiprocess", "structlog"}),
        ("ringfence.shm", {"torch", "multiprocess", "orjson", "structlog"}),
        ("ringfence.runtime", {"torch"}),
        # The text room: the Engine and the HTTP front end tokenize and template without torch;
        # the tokenizers, gguf and llguidance packages load when a file or grammar needs them.
        ("ringfence.actors.text", {"torch", "numpy", "gguf", "tokenizers", "llguidance"}),
    ],
)
def test_each_package_imports_only_what_the_dependency_direction_allows(package, forbidden):
    assert imported_by(package) & forbidden == set()


def test_the_console_script_is_installed_and_lists_its_commands():
    script = Path(sys.executable).with_name("ringfence")
    out = run(str(script), "--help", cwd=ROOT)
    assert "bench" in out and "clean" in out


def test_the_supervisor_and_the_engine_import_no_torch(tmp_path) -> None:
    # `ringfence launch` and the Engine read model shapes and KV handles but never run a
    # tensor; importing torch would cost each of them seconds of start-up and its memory.
    code = (
        "import sys\n"
        "import ringfence.runtime.cli, ringfence.runtime.supervisor\n"
        "import ringfence.actors.engine.actor, ringfence.actors.engine.launch\n"
        "import ringfence.actors.engine.begin, ringfence.actors.engine.storage\n"
        "import ringfence.actors.engine.summary\n"
        "from ringfence.runtime.imports import import_target\n"
        "import_target('ringfence.actors.engine:TOPOLOGY')\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    assert run(sys.executable, "-c", code, cwd=tmp_path).strip() == "[]"
