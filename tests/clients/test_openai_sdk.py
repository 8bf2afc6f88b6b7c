"""The openai SDK (``chat.completions.create``) against ``ringfence serve`` of SmolLM2: greedy
answers equal transformers' ``generate`` on the same file, and ``logprobs`` /
``top_logprobs`` equal ``log_softmax`` of transformers' logits within ``TOLERANCE``.

The server is the package's (tests/clients/conftest.py); transformers' copy of the model and
its greedy answers are made once per session (``tests/hf_reference.py``). The SDK's other
fields (echo, n, penalties, bad values) are tested on a preset in
tests/actors/serve/test_serve_logprobs.py and test_serve_sampling.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_reference import (
    MAX_TOKENS,
    QUESTIONS,
    chat_ids,
    greedy_answers,
    question_chat,
    reference_dir,
)
from serving import Server

pytest.importorskip("openai", reason="the client under test (the test extra installs openai)")

# float32 logits of the two stacks agree within 3e-4 (tests/actors/model/test_gguf.py); a
# log probability is within that of its logit's difference from the largest one.
TOLERANCE = 3e-4
TOP = 3


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """transformers' float32 model and tokenizer of the file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = str(reference_dir(tmp_path_factory))
    model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(directory)


def test_greedy_answers_and_their_logprobs_are_transformers(
    smollm2_server: Server, hf: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    model, tokenizer = hf
    expected = greedy_answers(tmp_path_factory)
    client = smollm2_server.client(timeout=240)
    for index in range(len(QUESTIONS)):
        answer = client.chat.completions.create(  # type: ignore[call-overload]
            model=None,  # type: ignore[arg-type]  # the served one
            messages=question_chat(index),  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=True,
            top_logprobs=TOP,
            extra_body={"return_token_ids": True},
        )
        choice = answer.choices[0]
        tokens = tuple((choice.model_extra or {})["token_ids"])
        print(f"served q{index}: {choice.message.content!r}")
        assert tokens == expected[f"q{index}"], index
        assert choice.logprobs is not None and choice.logprobs.content is not None
        ids = torch.tensor([chat_ids(tokenizer, question_chat(index)) + list(tokens)])
        with torch.inference_mode():
            reference = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        start = ids.shape[1] - len(tokens) - 1  # the row that predicts the first output token
        worst = 0.0
        for i, (token, entry) in enumerate(zip(tokens, choice.logprobs.content, strict=True)):
            row = reference[start + i]
            worst = max(worst, abs(entry.logprob - float(row[token])))
            best = [float(v) for v in torch.sort(row, descending=True).values[:TOP]]
            got = [alt.logprob for alt in entry.top_logprobs]
            assert max(abs(a - b) for a, b in zip(got, best, strict=True)) < TOLERANCE, i
        print(f"q{index}: max abs logprob diff against transformers {worst:.2e}")
        assert worst < TOLERANCE
