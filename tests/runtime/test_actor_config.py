"""An actor receives only its own config: the sections its ``config_section`` declares.

``config_of`` is what ``attach`` hands an instance as ``ctx.config`` (a launched run's
children, an embedded actor, the test rigs): None, one section by name, or the actor's
settings (a frozen, slotted dataclass of sections) filled by field name. The whole
config reaches no actor. A launched actor that declares a section the run lacks fails
its start: ``test_startup.py``.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from ringfence.actors.config import Config
from ringfence.actors.model.config import ModelConfig
from ringfence.cache.config import CacheConfig, StorageConfig
from ringfence.runtime.actor import Actor, config_of
from ringfence.shm.errors import ConfigError


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ReaderSettings:
    model: ModelConfig
    cache: CacheConfig


class Reader(Actor):
    config_section = ReaderSettings


class StorageReader(Actor):
    config_section = "cache.storage"


class Unconfigured(Actor):
    pass


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MisspeltSettings:
    model: ModelConfig
    cahce: CacheConfig


class Misspelt(Actor):
    config_section = MisspeltSettings


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MistypedSettings:
    cache: ModelConfig  # [cache] is a CacheConfig


class Mistyped(Actor):
    config_section = MistypedSettings


CONFIG = Config.load(None, ["model.seed=7", "cache.block_size=32"])


def test_an_actor_receives_the_sections_it_declares_each_by_its_name():
    settings = config_of(Reader, CONFIG)
    assert settings == ReaderSettings(model=CONFIG.model, cache=CONFIG.cache)
    assert isinstance(settings, ReaderSettings)
    assert settings.model is CONFIG.model and settings.cache is CONFIG.cache
    assert (settings.model.seed, settings.cache.block_size) == (7, 32)


def test_reading_a_section_the_actor_did_not_declare_is_an_attribute_error():
    settings = config_of(Reader, CONFIG)
    assert isinstance(settings, ReaderSettings)
    for undeclared in ("sched", "server", "engine", "runtime", "parallel"):
        with pytest.raises(AttributeError):
            getattr(settings, undeclared)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.model = CONFIG.model  # type: ignore[misc]


def test_a_section_named_by_its_table_is_handed_over_alone_and_none_without_one():
    storage = config_of(StorageReader, Config.load(None, ["cache.storage.backend=memory"]))
    assert storage == StorageConfig(backend="memory")
    assert config_of(Unconfigured, CONFIG) is None


def test_a_declared_section_the_schema_lacks_is_a_config_error_naming_the_actor_and_the_field():
    with pytest.raises(ConfigError) as caught:
        config_of(Misspelt, CONFIG)
    assert str(caught.value) == (
        f"actor {__name__}:Misspelt: MisspeltSettings.cahce: the run's config has no "
        "section 'cahce' (did you mean cache?)"
    )
    assert caught.value.key == "cahce"


def test_a_section_not_of_the_declared_type_is_a_type_error_naming_the_field():
    message = "MistypedSettings.cache: the run's [cache] is a CacheConfig, not a ModelConfig"
    with pytest.raises(TypeError, match=re.escape(message)):
        config_of(Mistyped, CONFIG)


def test_a_misspelt_section_name_is_a_config_error_naming_the_actor():
    class Lost(Actor):
        config_section = "cache.storag"

    with pytest.raises(ConfigError, match=re.escape(f"actor {__name__}:")) as caught:
        config_of(Lost, CONFIG)
    assert "cache.storag: unknown section (did you mean cache.storage?)" in str(caught.value)


def test_the_whole_config_reaches_no_actor():
    with pytest.raises(TypeError, match=r"Whole.config_section = '': the whole config reaches"):

        class Whole(Actor):
            config_section = ""

    with pytest.raises(ConfigError, match="the whole config is no section"):
        CONFIG.section("")


@dataclasses.dataclass(slots=True, kw_only=True)
class Mutable:
    model: ModelConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unslotted:
    model: ModelConfig


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Scalar:
    model: ModelConfig
    seed: int


@pytest.mark.parametrize(
    ("declared", "problem"),
    [
        (Mutable, "Mutable must be a frozen, slotted dataclass"),
        (Unslotted, "Unslotted must be a frozen, slotted dataclass"),
        (Scalar, "Scalar.seed is not a section (a dataclass)"),
        (ModelConfig(), "a section's name or a dataclass of sections, got ModelConfig("),
    ],
    ids=["not-frozen", "not-slotted", "a-field-not-a-section", "an-instance"],
)
def test_settings_are_a_frozen_slotted_dataclass_of_sections_checked_at_class_creation(
    declared, problem
):
    with pytest.raises(TypeError, match=re.escape(f"Bad.config_section: {problem}")):

        class Bad(Actor):
            config_section = declared
