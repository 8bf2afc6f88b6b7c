"""The storage registry: a backend is a module and one entry, and nothing else names it.

A fake backend registered here (as a new module's one registry line would) is opened by
the one function every actor uses, and the engine's launch checks accept or refuse it by
its entry alone.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import typing
from pathlib import Path

import pytest

from ringfence.actors.config import Config
from ringfence.actors.engine.launch import check_role, check_storage
from ringfence.cache.config import Backend as BackendName
from ringfence.cache.config import StorageConfig
from ringfence.cache.storage import StorageBackend, StorageLog
from ringfence.cache.storage.local import LocalBackend
from ringfence.cache.storage.memory import MemoryBackend
from ringfence.cache.storage.registry import BACKENDS, Backend, Place, open_backend, open_storage
from ringfence.runtime import extras
from ringfence.runtime.extras import MissingExtra
from ringfence.shm.errors import ConfigError

FP = hashlib.blake2b(b"model-a", digest_size=16).digest()


class Opened:
    """An opener that records where each backend of its name was opened."""

    def __init__(self) -> None:
        self.places: list[Place] = []

    def __call__(self, fingerprint: bytes, place: Place, log: StorageLog | None) -> StorageBackend:
        self.places.append(place)
        return MemoryBackend(fingerprint=fingerprint, max_bytes=place.max_bytes, log=log)


def register(monkeypatch: pytest.MonkeyPatch, name: str, **entry: typing.Any) -> Opened:
    """Register backend ``name`` for this test only; its opener records every open."""
    opened = Opened()
    monkeypatch.setitem(BACKENDS, name, Backend(open=opened, **entry))
    return opened


def role_config(backend: str, role: str = "prefill", path: str = "") -> Config:
    config = Config.load(None, [f"engine.role={role}", "sched.preemption=save"])
    storage = StorageConfig(backend=backend, path=path)
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, storage=storage))


def test_a_registered_backend_is_opened_by_the_one_function_with_every_setting(
    monkeypatch, tmp_path
):
    opened = register(monkeypatch, "fake", shared=True, how_shared="a fake tier")
    settings = StorageConfig(backend="fake", url="fake://tier", max_bytes=123, timeout_s=0.5)
    backend = open_storage(settings, fingerprint=FP, run_dir=tmp_path, require_server=False)
    assert isinstance(backend, MemoryBackend) and backend.fingerprint == FP
    assert opened.places == [
        Place(path="", url="fake://tier", max_bytes=123, timeout_s=0.5, require_server=False)
    ]
    backend.close()


def test_an_empty_path_is_the_run_dirs_own_only_where_the_entry_says_so(monkeypatch, tmp_path):
    in_run = register(monkeypatch, "fake-dir", shared=True, path_in_run_dir=True)
    elsewhere = register(monkeypatch, "fake-server", shared=True)
    open_storage(StorageConfig(backend="fake-dir"), fingerprint=FP, run_dir=tmp_path).close()
    open_storage(StorageConfig(backend="fake-dir"), fingerprint=FP, run_dir=None).close()
    given = StorageConfig(backend="fake-dir", path="/srv/tier")
    open_storage(given, fingerprint=FP, run_dir=tmp_path).close()
    open_storage(StorageConfig(backend="fake-server"), fingerprint=FP, run_dir=tmp_path).close()
    assert [p.path for p in in_run.places] == [str(tmp_path / "storage"), "", "/srv/tier"]
    assert [p.path for p in elsewhere.places] == [""]


def test_the_local_backend_keeps_a_run_of_its_own_in_the_run_dir(tmp_path):
    backend = open_storage(StorageConfig(backend="local"), fingerprint=FP, run_dir=tmp_path)
    assert isinstance(backend, LocalBackend) and Path(backend.root) == tmp_path / "storage"
    backend.close()
    with pytest.raises(ConfigError, match=r"cache\.storage\.path: the local backend needs"):
        open_storage(StorageConfig(backend="local"), fingerprint=FP, run_dir=None)


def test_an_unknown_backend_is_a_config_error_naming_the_key_and_the_known_names():
    with pytest.raises(ConfigError) as caught:
        open_backend("s3", fingerprint=FP)
    assert caught.value.key == "cache.storage.backend"
    assert str(caught.value) == (
        "cache.storage.backend: must be one of 'local', 'redis', 'memory', 'none', got 's3'"
    )


def test_the_role_check_takes_a_shared_tier_by_its_registry_entry(monkeypatch):
    register(monkeypatch, "fake-shared", shared=True, how_shared="the fake's cache.storage.url")
    register(monkeypatch, "fake-private", shared=False)
    check_role(role_config("fake-shared"))
    check_role(role_config("fake-shared", role="decode"))
    with pytest.raises(ValueError) as caught:
        check_role(role_config("fake-private"))
    assert str(caught.value) == (
        "engine.role = 'prefill' hands KV over through a shared storage tier, but "
        "cache.storage.backend is 'fake-private': use 'local' with a directory every "
        "instance of the pair uses (cache.storage.path), or 'redis' with the server's "
        "cache.storage.url, or 'fake-shared' with the fake's cache.storage.url"
    )


def test_the_role_check_refuses_an_empty_path_where_the_entry_puts_it_in_the_run(monkeypatch):
    register(monkeypatch, "fake-dir", shared=True, how_shared="a fake dir", path_in_run_dir=True)
    check_role(role_config("fake-dir", path="/srv/tier"))
    with pytest.raises(ValueError, match=r"cache.storage.path is empty .*: set it to a fake dir"):
        check_role(role_config("fake-dir"))


def test_the_launch_requires_the_client_library_the_entry_names(monkeypatch):
    register(monkeypatch, "fake-client", shared=True, requires="ringfence_no_such_client")
    register(monkeypatch, "fake-plain", shared=True)
    monkeypatch.setitem(extras.MODULE_EXTRAS, "ringfence_no_such_client", "fake")
    check_storage(role_config("fake-plain"))
    with pytest.raises(MissingExtra) as caught:
        check_storage(role_config("fake-client"))
    assert str(caught.value) == (
        "cache.storage.backend = 'fake-client' needs the 'ringfence_no_such_client' module, "
        "which is not installed: pip install 'ringfence[fake]'"
    )


def test_the_launch_refuses_a_storage_secret_it_cannot_read_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv("RINGFENCE_STORAGE_SECRET", raising=False)
    missing = tmp_path / "nope.secret"
    config = Config.load(None, [f"cache.storage.secret_file={missing}"])
    with pytest.raises(ConfigError, match=f"cache.storage.secret_file {missing}: No such file"):
        check_storage(config)
    (tmp_path / "ok.secret").write_text("s3cret\n")
    monkeypatch.setenv("RINGFENCE_STORAGE_SECRET", "another")
    config = Config.load(None, [f"cache.storage.secret_file={tmp_path / 'ok.secret'}"])
    with pytest.raises(ConfigError, match="2 different secrets are set"):
        check_storage(config)
    no_tier = ["cache.storage.backend=none", f"cache.storage.secret_file={missing}"]
    check_storage(Config.load(None, no_tier))  # no tier: no secret to read


def test_the_configs_backend_choices_are_the_registrys_names():
    assert typing.get_args(BackendName) == tuple(BACKENDS)
    assert Config.load(None, ["cache.storage.backend=memory"]).cache.storage.backend == "memory"


def test_no_product_module_outside_the_registry_compares_a_backend_name():
    # What a new backend touches is its module and its registry line: the launch checks,
    # the config's choices and every opener read the registry, never a name.
    root = Path(__file__).resolve().parents[2]
    named = []
    for package in ("actors", "runtime", "sched", "cache"):
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if relative.startswith(("cache/storage/", "actors/tools/")):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare) and _names_a_backend(node):
                    named.append(f"{relative}:{node.lineno}")
    assert named == []


def _names_a_backend(node: ast.Compare) -> bool:
    """Whether ``node`` compares a ``.backend`` with a literal name (or names)."""
    sides = [node.left, *node.comparators]
    if not any(isinstance(side, ast.Attribute) and side.attr == "backend" for side in sides):
        return False
    literals = [c for side in sides for c in ast.walk(side) if isinstance(c, ast.Constant)]
    return any(isinstance(c.value, str) and c.value in BACKENDS for c in literals)


def test_the_scan_for_backend_names_sees_a_comparison():
    (compare,) = [n for n in ast.walk(ast.parse("x = s.backend in ('none', 'memory')"))
                  if isinstance(n, ast.Compare)]  # fmt: skip
    assert _names_a_backend(compare)
    (compare,) = [n for n in ast.walk(ast.parse("x = s.backend == NO_TIER"))
                  if isinstance(n, ast.Compare)]  # fmt: skip
    assert not _names_a_backend(compare)
