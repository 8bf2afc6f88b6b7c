"""The engine's preflight: ``ringfence launch`` refuses a checkpoint, a setting or a device
the Worker could not run before anything exists (exit 2, one line naming the file and the
field or tensor), and a good one passes without importing torch.

In process: :func:`check_model` on configs; launched: the real command on bad checkpoints.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hf_checkpoints import save_family
from launching import QUICK, launch_env, launched

from ringfence.actors.config import Config
from ringfence.actors.preflight import check_model
from ringfence.shm import names

safetensors_torch = pytest.importorskip("safetensors.torch", reason="rewrites checkpoints")
pytest.importorskip("transformers", reason="checkpoints are saved by transformers")

ENGINE = "runtime.topology=ringfence.actors.engine:TOPOLOGY"


def config(*sets: str) -> Config:
    return Config.load(None, sets)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A good small Llama checkpoint (max_position_embeddings 512), in one file."""
    root = tmp_path / "ckpt"
    save_family(root, "LlamaForCausalLM", seed=1, max_position_embeddings=512)
    return root


# In process.


def test_a_good_checkpoint_and_the_presets_pass(checkpoint):
    check_model(config(f"model.path={checkpoint}"))
    check_model(config("model.preset=small"))


def test_a_block_longer_than_the_models_positions_is_named(checkpoint):
    with pytest.raises(
        ValueError, match=r"^cache.block_size: 1024 tokens exceeds the model's 512 positions"
    ):
        check_model(config(f"model.path={checkpoint}", "cache.block_size=1024"))


def test_kv_pools_larger_than_the_room_in_dev_shm_are_named():
    with pytest.raises(ValueError, match=r"^cache: the KV pools \(cache.host_blocks .* MiB free"):
        check_model(config("cache.device_blocks=1000000000"))


@pytest.mark.parametrize("how", ["on", "late"])
def test_launching_ahead_where_the_worker_cannot_is_named(how):
    on = f"model.launch_ahead={how}"
    check_model(config(on))  # one rank, fences, the look-ahead on by it
    with pytest.raises(ValueError, match=rf"^{on}: .* parallel.tp_size=2"):
        check_model(config(on, "parallel.tp_size=2", "model.preset=tiny-4kv"))
    with pytest.raises(ValueError, match=rf"^{on}: not under transfer.mode=lock"):
        check_model(config(on, "transfer.mode=lock"))
    with pytest.raises(ValueError, match=rf"^{on}: .* model.look_ahead is off"):
        check_model(config(on, "model.look_ahead=off"))
    check_model(config("parallel.tp_size=2", "model.preset=tiny-4kv", "transfer.mode=lock"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_cuda_asked_for_on_a_host_without_it_is_named():
    with pytest.raises(ValueError, match=r"^model.device: 'cuda', but torch sees no CUDA device$"):
        check_model(config("model.device=cuda"))


def test_the_preflight_of_a_cpu_run_imports_no_torch(checkpoint):
    code = (
        "import sys\n"
        "from ringfence.actors.config import Config\n"
        "from ringfence.actors.preflight import check_model\n"
        f"check_model(Config.load(None, ['model.path={checkpoint}']))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=launch_env(), capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


# Launched.


def refused(tmp_path: Path, *sets: str) -> str:
    """Launch the engine on a workload with ``sets``; assert it exits 2 quickly, having
    created nothing, and return its one stderr line."""
    started = time.monotonic()
    with launched(tmp_path, ENGINE, "engine.workload=synthetic:multiturn", *sets, *QUICK) as run:
        assert run.wait() == 2, run.tail()
        elapsed = time.monotonic() - started
        stderr = run.stderr()
        assert stderr.startswith("ringfence launch: ") and stderr.count("\n") == 1, stderr
        assert run.stdout() == ""  # no run announced: no actor was started
        assert not run.run_dir.exists()
        leases = [names.read_lease(rid) for rid in {e.run_id for e in names.list_names()}]
        assert [s for s in leases if s is not None and s.pid == run.proc.pid] == []
    assert elapsed < 15.0, f"the refusal took {elapsed:.1f}s"
    return stderr.removeprefix("ringfence launch: ").rstrip("\n")


def test_a_launch_with_a_model_path_that_does_not_exist_exits_2_naming_it(tmp_path):
    missing = tmp_path / "nonexistent"
    said = refused(tmp_path, f"model.path={missing}")
    assert said == f"model.path: {missing}: no such directory"


def test_a_launch_with_a_missing_shard_exits_2_naming_the_index_and_the_shard(tmp_path):
    root = tmp_path / "ckpt"
    save_family(root, "LlamaForCausalLM", seed=1, max_shard_size="50KB")
    shard = sorted(root.glob("model-*.safetensors"))[1]
    shard.unlink()
    said = refused(tmp_path, f"model.path={root}")
    assert str(root) in said and f"weight_map names {shard.name}" in said, said


def test_a_launch_with_a_tensor_of_the_wrong_shape_exits_2_naming_the_file_and_tensor(
    tmp_path, checkpoint
):
    file = checkpoint / "model.safetensors"
    tensors = safetensors_torch.load_file(file)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(48, 64)
    safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})
    said = refused(tmp_path, f"model.path={checkpoint}")
    assert said == (
        f"{file}: tensor 'model.layers.1.self_attn.k_proj.weight' has shape [48, 64], "
        "the model needs [32, 64]"
    )


def test_a_launch_with_an_unknown_architecture_exits_2_naming_config_json_and_the_field(
    tmp_path, checkpoint
):
    file = checkpoint / "config.json"
    file.write_text(file.read_text().replace("LlamaForCausalLM", "GemmaForCausalLM"))
    said = refused(tmp_path, f"model.path={checkpoint}")
    assert re.search(r"config.json: architectures: .*got \['GemmaForCausalLM'\]", said), said


def test_a_launch_with_a_tokenizer_file_that_does_not_parse_exits_2_naming_it(tmp_path, checkpoint):
    file = checkpoint / "tokenizer.json"
    file.write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    said = refused(tmp_path, f"model.path={checkpoint}")
    assert said.startswith(f"{file}: not a tokenizer the tokenizers package reads"), said


def test_a_launch_with_a_chat_template_that_does_not_compile_exits_2_naming_it(
    tmp_path, checkpoint
):
    file = checkpoint / "chat_template.jinja"
    file.write_text("{% for message in messages %}{{ message.content }}")
    said = refused(tmp_path, f"model.path={checkpoint}")
    assert said.startswith(f"{file}: the chat template does not compile"), said
