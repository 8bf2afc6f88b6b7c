"""Tests of the run configuration: precedence, exact error messages, dump/load round trips."""

from __future__ import annotations

import dataclasses
import pickle
import re
import typing
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringfence.actors.config import Config
from ringfence.actors.model.config import ModelConfig
from ringfence.actors.tools.testing.demo import DemoConfig
from ringfence.cache import config as cache_config
from ringfence.cache.config import CacheConfig, StorageConfig
from ringfence.runtime.config import (
    ActorPolicy,
    RunConfig,
    check_actor_names,
    dump_config,
    load_config,
    loads_config,
    parse_override,
    setting,
)
from ringfence.runtime.config_tables import ACTOR_NAME, SECRET
from ringfence.runtime.imports import import_target
from ringfence.runtime.secrets import export_secrets
from ringfence.shm.errors import ConfigError

# Hypothesis prints a reproduction blob with any failure, which stands in for the seed.
FAST = settings(
    max_examples=80, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)


def write_config(tmp_path, text: str) -> str:
    path = tmp_path / "cfg.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def error_of(file_text: str | None = None, *overrides: str) -> ConfigError:
    """The error of loading ``cfg.toml`` (in the current folder) with ``overrides``."""
    if file_text is not None:
        with open("cfg.toml", "w", encoding="utf-8") as f:
            f.write(file_text)
    with pytest.raises(ConfigError) as info:
        Config.load(None if file_text is None else "cfg.toml", overrides)
    return info.value


def test_defaults_load_without_a_file_and_equal_a_default_config():
    cfg = Config.load()
    assert cfg == Config()
    assert hash(cfg) == hash(Config())
    assert (cfg.cache.block_size, cfg.cache.storage.max_bytes) == (16, 1 << 30)
    assert cfg.runtime.topology == "ringfence.actors.engine:TOPOLOGY"
    assert dict(cfg.actors) == {}


def test_a_file_overrides_only_the_keys_it_names(tmp_path):
    path = write_config(tmp_path, '[model]\ndtype = "bfloat16"\n[sched]\nmax_num_seqs = 4\n')
    cfg = Config.load(path)
    assert cfg.model == ModelConfig(dtype="bfloat16")
    assert cfg.sched.max_num_seqs == 4
    assert cfg.sched.max_batched_tokens == 512
    assert cfg.cache == CacheConfig()


def test_set_beats_the_file_and_a_later_set_beats_an_earlier_one(tmp_path):
    path = write_config(tmp_path, "[model]\nseed = 1\n[demo]\nmessages = 5\n")
    cfg = Config.load(path, ["model.seed=2", "model.seed=3", "demo.payload_bytes=8"])
    assert (cfg.model.seed, cfg.section("demo")) == (3, DemoConfig(messages=5, payload_bytes=8))


def test_nested_storage_and_actor_tables_load_from_a_file(tmp_path):
    text = '[cache.storage]\nbackend = "local"\npath = "/tmp/kv"\n'
    text += '[actors.relay]\nrestart = "never"\n[actors.echo]\nplacement = "external"\n'
    cfg = Config.load(write_config(tmp_path, text))
    assert cfg.cache.storage == StorageConfig(backend="local", path="/tmp/kv")
    assert list(cfg.actors) == ["echo", "relay"]
    assert cfg.actors["relay"] == ActorPolicy(restart="never")
    assert cfg.actor("echo") == ActorPolicy(placement="external")


def test_nested_storage_and_actor_keys_can_be_set_on_the_command_line(tmp_path):
    path = write_config(tmp_path, '[actors.relay]\nrestart = "never"\n')
    overrides = ["cache.storage.backend=redis", "actors.relay.max_restarts=7"]
    cfg = Config.load(path, [*overrides, "actors.sink.backoff_s=2"])
    assert cfg.cache.storage.backend == "redis"
    assert cfg.actors["relay"] == ActorPolicy(restart="never", max_restarts=7)
    assert cfg.actors["sink"] == ActorPolicy(backoff_s=2.0)


def test_an_unquoted_override_is_a_string_and_a_toml_value_keeps_its_type():
    assert parse_override("model.device=cuda") == ("model.device", "cuda")
    assert parse_override("model.path=/data/ckpt") == ("model.path", "/data/ckpt")
    assert parse_override('model.path="1 2"') == ("model.path", "1 2")
    assert parse_override("model.path=") == ("model.path", "")
    assert parse_override("runtime.spin_us=20") == ("runtime.spin_us", 20)
    assert parse_override("cache.poison_freed=true") == ("cache.poison_freed", True)
    assert parse_override("model.path=1\nx = 2") == ("model.path", "1\nx = 2")
    assert Config.load(overrides=["model.device=cuda:1"]).model.device == "cuda:1"


def test_an_int_is_accepted_for_a_float_field_and_becomes_a_float():
    spin_us = Config.load(overrides=["runtime.spin_us=20"]).runtime.spin_us
    assert (spin_us, type(spin_us)) == (20.0, float)


def bad(override: str, reason: str, key: str | None = None) -> tuple[str, str, str]:
    """A bad override, the dotted key its error names (the override's, unless given), the reason."""
    return override, key or override.split("=", 1)[0], reason


BAD_VALUES = [
    bad("runtime.spinus=20", "unknown key (did you mean runtime.spin_us?)"),
    bad("modle.seed=1", "unknown key (did you mean model?)", "modle"),
    bad("actors.relay.restrat=never", "unknown key (did you mean actors.relay.restart?)"),
    bad("model=3", "expected a table, got int 3"),
    bad("runtime.spin_us=fast", "expected a number, got str 'fast'"),
    bad("cache.block_size=true", "expected an int, got bool True"),
    bad("cache.block_size=1.5", "expected an int, got float 1.5"),
    bad("cache.poison_freed=1", "expected a bool, got int 1"),
    bad("cache.block_size=0", "must be >= 1, got 0"),
    bad("cache.block_size=4097", "must be <= 4096, got 4097"),
    bad("runtime.heartbeat_s=0", "must be > 0, got 0.0"),
    bad("runtime.ring_bytes=4100", "must be a multiple of 8, got 4100"),
    bad(f"demo.messages={2**63}", f"must fit a signed 64-bit integer, got {2**63}"),
    bad("runtime.spin_us=inf", "must be finite, got inf"),
    bad("transfer.chaos_delay_ms=nan", "must be finite, got nan"),
    bad("model.dtype=fp16", "must be one of 'float32', 'bfloat16', 'float64', got 'fp16'"),
    bad("cache.storage.backend=s3", "must be one of 'local', 'redis', 'memory', 'none', got 's3'"),
    bad("model.device=gpu", "must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
    bad("model.device=cuda:x", "must be 'cpu', 'cuda' or 'cuda:N', got 'cuda:x'"),
    bad("runtime.topology=demo", "must be an import path 'module:ATTRIBUTE', got 'demo'"),
    bad("actors.Relay.restart=never", "bad name, must match [a-z][a-z0-9_]{0,31}", "actors.Relay"),
    bad(
        "runtime.heartbeat_s=20",
        "must be > runtime.heartbeat_s (20.0), got 10.0",
        "runtime.heartbeat_timeout_s",
    ),
]
BAD_IDS = [f"{key}:{reason.split(',')[0]}" for _, key, reason in BAD_VALUES]


@pytest.mark.parametrize(("override", "key", "reason"), BAD_VALUES, ids=BAD_IDS)
def test_a_bad_override_names_set_and_the_dotted_key(override, key, reason):
    error = error_of(None, override)
    assert str(error) == f"--set {key}: {reason}"
    assert error.key == key


@pytest.mark.parametrize(("override", "key", "reason"), BAD_VALUES, ids=BAD_IDS)
def test_the_same_bad_value_in_a_file_names_the_file(override, key, reason, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    dotted, text = override.split("=", 1)
    *section, name = dotted.split(".")
    value = f'"{text}"' if isinstance(parse_override(override)[1], str) else text
    table = f"[{'.'.join(section)}]\n" if section else ""
    assert str(error_of(f"{table}{name} = {value}\n")) == f"cfg.toml: {key}: {reason}"


def test_the_cross_field_check_blames_the_layer_that_wrote_last(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    error = error_of("[runtime]\nheartbeat_timeout_s = 5\n", "runtime.heartbeat_s=6")
    assert (
        str(error)
        == "--set runtime.heartbeat_timeout_s: must be > runtime.heartbeat_s (6.0), got 5.0"
    )
    error = error_of(
        "[runtime]\nheartbeat_timeout_s = 5\n",
        "runtime.heartbeat_s=6",
        "runtime.heartbeat_timeout_s=5",
    )
    assert str(error).startswith("--set runtime.heartbeat_timeout_s: must be > ")
    assert (
        error_of("[runtime]\nheartbeat_s = 20\n")
        .args[0]
        .startswith("cfg.toml: runtime.heartbeat_timeout_s")
    )


def test_a_missing_file_is_an_error_that_names_it(tmp_path):
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"^.*nope\.toml: no such config file$"):
        Config.load(missing)


def test_a_toml_syntax_error_names_the_file_line_and_column(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    error = error_of("[model]\nseed = = 1\n")
    assert str(error) == "cfg.toml: invalid TOML: Invalid value (at line 2, column 8)"


@pytest.mark.parametrize("text", ["model.seed", "=3", "model..seed=1", ".seed=1"])
def test_an_override_without_equals_or_with_an_empty_key_names_the_text(text):
    with pytest.raises(ConfigError) as info:
        parse_override(text)
    assert str(info.value) == f"--set {text!r}: expected section.key=value"


def test_check_actor_names_rejects_a_name_the_topology_lacks_and_suggests_one():
    cfg = Config.load(overrides=["actors.relya.restart=never", "actors.sink.max_restarts=1"])
    check_actor_names(cfg, ["relya", "sink", "source"], "cfg.toml")
    with pytest.raises(ConfigError) as info:
        check_actor_names(cfg, ["relay", "sink"], "cfg.toml")
    assert str(info.value) == "cfg.toml: actors.relya: unknown actor (did you mean actors.relay?)"
    assert info.value.key == "actors.relya"


def test_section_returns_a_table_by_its_toml_name_and_rejects_an_unknown_one():
    cfg = Config(cache=CacheConfig(storage=StorageConfig(backend="memory")))
    assert cfg.section("model") is cfg.model
    assert cfg.section("cache.storage") == StorageConfig(backend="memory")
    with pytest.raises(ConfigError, match=r"^modle: unknown section \(did you mean model\?\)$"):
        cfg.section("modle")
    with pytest.raises(
        ConfigError, match=r"^cache\.storag: unknown section \(did you mean cache\.storage\?\)$"
    ):
        cfg.section("cache.storag")


def test_actor_gives_the_default_policy_for_an_actor_without_a_table():
    cfg = Config.load(overrides=["actors.relay.restart=never"])
    assert cfg.actor("relay") == ActorPolicy(restart="never")
    assert cfg.actor("sink") == ActorPolicy()


def test_with_overrides_applies_dotted_keys_to_a_loaded_config():
    cfg = Config().with_overrides({"model.seed": 9, "actors.relay.restart": "never"})
    assert (cfg.model.seed, cfg.actor("relay").restart) == (9, "never")
    with pytest.raises(ConfigError, match=r"^workload: model\.seed: must be >= 0, got -1$"):
        cfg.with_overrides({"model.seed": -1}, source="workload")


ESCAPES = 'quote " backslash \\ newline \n tab \t nul \x00 del \x7f bell \x07 é 🙂'


@pytest.mark.parametrize(
    "cfg",
    [
        Config(),
        Config(actors={"relay": ActorPolicy(restart="never"), "echo": ActorPolicy(backoff_s=1e-6)}),
        Config(
            model=ModelConfig(path=ESCAPES), cache=CacheConfig(storage=StorageConfig(url=ESCAPES))
        ),
    ],
    ids=["defaults", "actors", "escapes"],
)
def test_dump_then_load_gives_back_the_same_config(cfg, tmp_path):
    assert Config.load(write_config(tmp_path, dump_config(cfg))) == cfg


SECTIONS = (
    "model cache cache.storage sched transfer engine parallel server events runtime demo "
    "harness "
    "actors.relay"
)


def test_dump_writes_every_key_under_a_doc_comment_with_floats_that_read_back_as_floats():
    text = dump_config(Config(actors={"relay": ActorPolicy()}))
    lines = text.splitlines()
    headers = [line for line in lines if line.startswith("[")]
    assert headers == [f"[{name}]" for name in SECTIONS.split()]
    keys = [i for i, line in enumerate(lines) if " = " in line and not line.startswith("#")]
    # [model]: 11, [server]: 17
    assert len(keys) == 11 + 7 + 9 + 6 + 6 + 9 + 1 + 17 + 6 + 11 + 2 + 4 + 7
    assert all(lines[i - 1].startswith("# ") for i in keys)
    assert "spin_us = 50.0" in lines and "chaos_delay_ms = 0.0" in lines


def value_strategy(tp, meta) -> st.SearchStrategy:
    """Valid values of one schema field, read from its annotation and metadata."""
    if dataclasses.is_dataclass(tp):
        return config_strategy(tp)
    if typing.get_origin(tp) is Mapping:
        names = st.from_regex(ACTOR_NAME, fullmatch=True)
        return st.dictionaries(names, config_strategy(typing.get_args(tp)[1]), max_size=3)
    if typing.get_origin(tp) is typing.Literal:
        return st.sampled_from(typing.get_args(tp))
    if tp is bool:
        return st.booleans()
    if tp is str:
        pattern = meta.get("pattern")
        return st.from_regex(pattern[0], fullmatch=True) if pattern else st.text()
    low, high = meta.get("ge", meta.get("gt")), meta.get("le")
    if tp is float:
        return st.floats(low, high, exclude_min="gt" in meta, allow_nan=False, allow_infinity=False)
    step = meta.get("multiple_of", 1)
    return st.integers(
        low if low is not None else -(2**63), high if high is not None else 2**63 - 1
    ).map(lambda v: v - v % step)


def config_strategy(cls) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if not f.metadata.get("tools")]
    strategies = {f.name: value_strategy(hints[f.name], f.metadata) for f in fields}
    if tools := getattr(cls, "TOOLS", {}):  # the tools' sections, by their import paths
        sections = {name: config_strategy(import_target(path)) for name, path in tools.items()}
        strategies["tools"] = st.fixed_dictionaries(sections)
    built = st.builds(cls, **strategies)
    above = [(f.name, f.metadata["above"]) for f in fields if "above" in f.metadata]
    return built.filter(lambda obj: all(getattr(obj, a) > getattr(obj, b) for a, b in above))


@FAST
@given(cfg=config_strategy(Config))
def test_any_valid_config_survives_a_dump_and_load(cfg):
    # All but its secrets (server.api_key), which a dump holds empty: they reach the actors
    # by environment (runtime/secrets.py), never through a run dir's config.toml.
    public = export_secrets(cfg, {})
    assert Config.loads(dump_config(cfg)) == public


def test_the_storage_secret_and_password_leave_the_config_for_the_environment():
    # The cache declares its secrets itself (it may not import the runtime): the same key.
    assert cache_config.SECRET == SECRET
    sets = [
        "cache.storage.secret=tier-secret",
        "cache.storage.url=redis://alice:pass-word@10.0.0.2:6379/0",
    ]
    cfg = Config.load(None, sets)
    assert cfg.cache.storage.url == "redis://alice@10.0.0.2:6379/0"
    environ: dict[str, str] = {}
    public = export_secrets(cfg, environ)
    assert environ == {
        "RINGFENCE_STORAGE_SECRET": "tier-secret",
        "RINGFENCE_STORAGE_PASSWORD": "pass-word",
        # Every secret's variable, set or not: what each process's log redacts.
        "RINGFENCE_SECRET_VARS": "RINGFENCE_API_KEY,RINGFENCE_STORAGE_PASSWORD,"
        "RINGFENCE_STORAGE_SECRET",
    }
    text = dump_config(public)
    assert "tier-secret" not in text and "pass-word" not in text
    assert 'url = "redis://alice@10.0.0.2:6379/0"' in text
    assert (public.cache.storage.secret, public.cache.storage.password) == ("", "")


def test_the_config_is_immutable_down_to_the_actor_mapping():
    policies = {"relay": ActorPolicy()}
    cfg = Config(actors=policies)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = ModelConfig()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache.storage.backend = "local"  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.actors["sink"] = ActorPolicy()  # type: ignore[index]
    policies["sink"] = ActorPolicy()
    assert list(cfg.actors) == ["relay"]


def test_a_config_with_actors_pickles_for_a_spawned_actor():
    cfg = Config(actors={"relay": ActorPolicy(restart="never")})
    copy = pickle.loads(pickle.dumps(cfg))
    assert copy == cfg
    assert type(copy.actors) is type(cfg.actors)


def test_the_runtime_loads_the_schema_it_finds_by_import_path():
    cfg = load_config(None, ["model.seed=2", "harness.ops=7"])
    assert type(cfg) is Config and cfg == Config.load(None, ["model.seed=2", "harness.ops=7"])
    assert loads_config("[sched]\nmax_num_seqs = 3\n") == Config(
        sched=Config.loads("[sched]\nmax_num_seqs = 3\n").sched
    )


def test_the_runtime_alone_knows_only_its_own_sections():
    assert RunConfig.load(None, ["runtime.spin_us=3"]).runtime.spin_us == 3.0
    with pytest.raises(ConfigError) as info:
        RunConfig.load(None, ["model.seed=1"])
    assert str(info.value) == "--set model: unknown key"


def test_a_tools_section_is_loaded_by_its_path_and_its_errors_name_its_keys():
    cfg = Config.load(None, ["demo.messages=3"])
    assert cfg.section("demo") == DemoConfig(messages=3) and cfg.tools["demo"] is cfg.section(
        "demo"
    )
    with pytest.raises(ConfigError) as info:
        Config.load(None, ["harness.progams=3"])
    assert str(info.value) == "--set harness.progams: unknown key (did you mean harness.programs?)"
    with pytest.raises(ConfigError, match=r"^dem: unknown section \(did you mean demo\?\)$"):
        cfg.section("dem")


def section_with(**metadata: object) -> type:
    return dataclasses.make_dataclass(
        "Odd",
        [("x", int, dataclasses.field(default=1, metadata=metadata))],
        frozen=True,
        slots=True,
        kw_only=True,
    )


@pytest.mark.parametrize(
    ("metadata", "problem"),
    [
        ({}, "Odd.x: a config field needs setting(..., doc)"),
        ({"doc": "x", "gte": 1}, "Odd.x: unknown setting rules ['gte']"),
    ],
)
def test_a_section_declared_without_a_doc_or_with_an_unknown_rule_is_refused_on_load(
    metadata, problem
):
    odd = section_with(**metadata)
    schema: Any = dataclasses.make_dataclass(
        "Schema",
        [("odd", odd, dataclasses.field(default_factory=odd))],
        bases=(RunConfig,),
        frozen=True,
        slots=True,
        kw_only=True,
    )
    with pytest.raises(TypeError, match=rf"^{re.escape(problem)}$"):
        schema.load()


def test_setting_keeps_the_doc_and_the_rules_in_the_field_metadata():
    field: Any = setting(3, "three", ge=1)
    assert (field.default, dict(field.metadata)) == (3, {"doc": "three", "ge": 1})
