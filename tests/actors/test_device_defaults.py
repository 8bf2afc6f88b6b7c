"""On CUDA a run's device pool and batch limits are the device's unless set; the CPU keeps
its defaults. Devices here are fakes (total and free bytes): no GPU is needed."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest

from ringfence.actors import device_defaults as dd
from ringfence.actors import preflight
from ringfence.actors.config import Config
from ringfence.actors.device_defaults import (
    GIB,
    MAX_AUTO_BLOCKS,
    DeviceMemory,
    device_defaults,
    plan_memory,
    weight_bytes,
)
from ringfence.actors.model.shape import PRESETS
from ringfence.runtime.config import dump_config, loads_config
from ringfence.runtime.run import resolve

H200 = DeviceMemory(
    device="cuda:0", name="NVIDIA H200", total_bytes=140 * GIB, free_bytes=139 * GIB
)
GPU = ("model.device=cuda", "model.preset=small", "model.dtype=bfloat16")


class Filled(NamedTuple):
    config: Config
    notes: tuple[str, ...]


def defaults(config: Config, devices: list[DeviceMemory]) -> Filled:
    """device_defaults, its config typed as the actors' Config."""
    resolved = device_defaults(config, devices)
    assert isinstance(resolved.config, Config)
    return Filled(resolved.config, resolved.notes)


def gpu_config(*sets: str) -> Config:
    config = Config.load(None, [*GPU, *sets])
    assert isinstance(config, Config)
    return config


def test_on_the_cpu_nothing_changes_and_nothing_is_said():
    config = Config.load(None, ["model.preset=small"])
    resolved = defaults(config, [H200])  # a device present changes nothing either
    assert resolved.config == config and resolved.notes == ()
    assert (config.sched.max_num_seqs, config.sched.max_batched_tokens) == (16, 512)
    assert config.cache.device_blocks == 256


def test_on_cuda_the_batch_limits_are_a_gpu_servers_and_the_pool_fills_the_fraction():
    resolved = defaults(gpu_config(), [H200])
    config = resolved.config
    assert (config.sched.max_num_seqs, config.sched.max_batched_tokens) == (256, 8192)
    assert config.sched.steps_in_flight == 2
    plan = plan_memory(config, PRESETS["small"], [H200])
    assert plan.budget == int(0.9 * H200.total_bytes)
    # The small preset: 20,980,224 parameters, tied, two bytes each in bfloat16; a block
    # of 8 layers x K,V x 16 tokens x 4 KV heads x 64 x 2 bytes is 128 KiB.
    assert plan.weights == 20_980_224 * 2 and plan.block_bytes == 128 << 10
    blocks = config.cache.device_blocks
    assert plan.fits(blocks) and not plan.fits(blocks + 1)
    used = blocks * plan.block_bytes + plan.weights + plan.reserved + plan.activations
    assert plan.budget - 2 * plan.gather <= used <= plan.budget
    (note,) = resolved.notes
    assert note.startswith("defaults for cuda:0 (NVIDIA H200: 140.0 GiB, 139.0 GiB free): ")
    assert f"cache.device_blocks = {blocks} (" in note
    assert "sched.max_num_seqs = 256, sched.max_batched_tokens = 8192" in note
    assert "sched.steps_in_flight = 2" in note


def test_the_budget_is_what_is_free_when_that_is_less_than_the_fraction():
    busy = dataclasses.replace(H200, free_bytes=40 * GIB)
    plan = plan_memory(gpu_config(), PRESETS["small"], [busy])
    assert plan.budget == 40 * GIB
    smaller = defaults(gpu_config(), [busy]).config.cache.device_blocks
    assert smaller < defaults(gpu_config(), [H200]).config.cache.device_blocks


def test_a_lower_utilization_gives_a_smaller_pool_in_proportion():
    full = defaults(gpu_config(), [H200]).config.cache.device_blocks
    half = defaults(gpu_config("cache.gpu_memory_utilization=0.45"), [H200])
    assert half.config.cache.device_blocks < full / 2  # the weights and reserves stay whole
    assert half.config.cache.device_blocks > full / 2 - (4 * GIB) // (128 << 10)


def test_the_rank_with_the_least_room_sizes_every_ranks_pool():
    other = dataclasses.replace(H200, device="cuda:1", free_bytes=20 * GIB)
    config = gpu_config("parallel.tp_size=2")
    plan = plan_memory(config, PRESETS["small"], [H200, other])
    assert plan.device == other and plan.budget == 20 * GIB
    assert plan.block_bytes == 64 << 10  # each rank holds two of the four KV heads


def test_settings_given_explicitly_win_even_when_they_equal_the_cpu_defaults():
    config = gpu_config(
        "sched.max_num_seqs=16", "cache.device_blocks=1000", "sched.steps_in_flight=1"
    )
    resolved = defaults(config, [H200]).config
    assert resolved.sched.max_num_seqs == 16  # the CPU default, but written: kept
    assert resolved.sched.steps_in_flight == 1
    assert resolved.cache.device_blocks == 1000
    assert resolved.sched.max_batched_tokens == 8192  # not written: the GPU's


def test_settings_in_a_toml_file_count_as_given(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[sched]\nmax_batched_tokens = 512\n")
    config = Config.load(path, GPU)
    assert {"sched", "sched.max_batched_tokens", "model.device"} <= config.explicit
    resolved = defaults(config, [H200]).config
    assert (resolved.sched.max_num_seqs, resolved.sched.max_batched_tokens) == (256, 512)


def test_the_explicit_keys_are_no_toml_key_and_a_dumped_config_gives_every_key():
    config = gpu_config().with_overrides({"cache.host_blocks": 8})
    assert {"model.device", "cache.host_blocks"} <= config.explicit
    text = dump_config(config)
    assert "explicit" not in text
    again = loads_config(text)
    assert again == config and "cache.device_blocks" in again.explicit
    with pytest.raises(ValueError, match=r"^<string>: explicit: unknown key"):
        loads_config("explicit = 1\n")


def test_a_pool_given_that_does_not_fit_is_an_error_naming_the_setting():
    config = gpu_config("cache.device_blocks=2000000")  # 244 GiB of 128 KiB blocks
    with pytest.raises(ValueError, match=r"^cache.device_blocks: 2000000 blocks of 0.12 MiB"):
        defaults(config, [H200])
    fits = defaults(gpu_config(), [H200]).config.cache.device_blocks
    defaults(gpu_config(f"cache.device_blocks={fits}"), [H200])  # the most that fits


def test_a_device_too_small_for_the_weights_is_an_error_naming_the_fraction():
    small = dataclasses.replace(H200, total_bytes=2 * GIB, free_bytes=2 * GIB)
    with pytest.raises(ValueError, match=r"^cache.gpu_memory_utilization: 0.9 of cuda:0: "):
        defaults(gpu_config(), [small])


def test_a_toy_models_pool_is_capped_so_the_engines_bookkeeping_stays_small():
    config = Config.load(None, ["model.device=cuda"])  # tiny: 8 KiB blocks
    resolved = defaults(config, [H200])
    assert resolved.config.cache.device_blocks == MAX_AUTO_BLOCKS
    assert "(capped)" in resolved.notes[0]


def test_the_weights_of_a_1b_llama_are_counted_from_its_shape():
    shape = dataclasses.replace(
        PRESETS["small"],
        vocab_size=32000,
        hidden=2048,
        layers=22,
        heads=32,
        kv_heads=4,
        head_dim=64,
        intermediate=5632,
        tie_embeddings=False,
    )
    assert weight_bytes(shape, 2) == 1_100_048_384 * 2  # TinyLlama-1.1B's parameter count
    two = weight_bytes(shape, 2, ranks=2)
    assert 1_100_048_384 < two < 1_100_048_384 * 2  # layers halved, embeddings whole


def test_the_supervisor_runs_the_config_with_the_devices_defaults(monkeypatch):
    probed: list[tuple[str, int]] = []

    def probe(device: str, ranks: int) -> list[DeviceMemory]:
        probed.append((device, ranks))
        return [H200]

    monkeypatch.setattr(dd, "probe_devices", probe)
    monkeypatch.setattr(dd, "check_device", lambda *args: None)
    monkeypatch.setattr(preflight, "check_device", lambda *args: None)
    prepared = resolve(gpu_config())
    assert isinstance(prepared.config, Config)
    assert probed == [("cuda", 1)]
    assert prepared.config.sched.max_num_seqs == 256
    assert prepared.config.cache.device_blocks > 256
    assert prepared.notes and prepared.notes[0].startswith("defaults for cuda:0")
    on_cpu = resolve(Config.load(None, ["model.preset=small"]))
    assert probed == [("cuda", 1)] and on_cpu.notes == ()
    # On CUDA the children start from fresh interpreters; on the CPU from the fork server.
    assert prepared.config.runtime.start_method == "spawn"
    assert on_cpu.config.runtime.start_method == "forkserver"


def test_on_cuda_children_are_spawned_and_a_fork_server_asked_for_is_refused_by_name():
    assert dd.spawn_children(gpu_config()).runtime.start_method == "spawn"
    kept = gpu_config("runtime.start_method=spawn")
    assert dd.spawn_children(kept) is kept
    with pytest.raises(ValueError, match=r"^runtime\.start_method: forkserver cannot start"):
        dd.spawn_children(gpu_config("runtime.start_method=forkserver"))
