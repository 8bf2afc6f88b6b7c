"""guidellm (the load generator) benchmarks ``ringfence serve`` of SmolLM2 as its users run it.

``guidellm run`` with the OpenAI HTTP backend, one request at a time, four requests of
synthetic text (64 prompt tokens counted by the checkpoint's own tokenizer, 16 output
tokens), streaming. Each is a ``POST /v1/chat/completions`` carrying ``stream: true``,
``stream_options: {include_usage, continuous_usage_stats}``, ``max_completion_tokens: 16``
and ``ignore_eos: true``, and the messages' content as a list of text parts; guidellm
pins the output length with ``ignore_eos`` and reads the token counts from ``usage``.
Every request must succeed and report exactly the 16 output tokens asked for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from client_runs import require_answer, served_model
from serving import Server

pytest.importorskip("guidellm", reason="the client under test (the test extra installs guidellm)")

GUIDELLM = Path(sys.executable).with_name("guidellm")  # the venv's console script
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 4, 64, 16
TIMEOUT_S = 240.0  # four requests of 16 tokens take seconds; the CLI imports for ~10 s


def guidellm_body(server: Server) -> dict[str, Any]:
    """One request as guidellm 0.8.1's chat handler builds it (captured from its run)."""
    return {
        "model": served_model(server),
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Say one word."}]}],
    }


def streamed_chat(server: Server) -> tuple[int, str]:
    """The status and the whole event stream of :func:`guidellm_body` sent to ``server``."""
    body = guidellm_body(server)
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as answer:
        return answer.status_code, answer.read().decode()


@pytest.fixture(scope="module")
def report(smollm2_server: Server, tokenizer_dir: Path, tmp_path_factory: Any) -> dict[str, Any]:
    """The JSON report of one ``guidellm run`` against the server."""
    status, text = streamed_chat(smollm2_server)
    assert status == 200, (
        "guidellm's streamed chat request needs ignore_eos and "
        f"stream_options.continuous_usage_stats: answered {status} {text}"
    )
    tmp = tmp_path_factory.mktemp("guidellm")
    out = tmp / "benchmarks.json"
    command = [
        str(GUIDELLM), "run",
        "--backend", f"kind=openai_http,target={smollm2_server.url}",
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                  f"output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(
        command, cwd=tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert proc.returncode == 0, f"guidellm run exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    assert out.is_file(), proc.stdout[-4000:]
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_guidellms_streamed_request_is_answered_with_usage_on_every_chunk(
    smollm2_server: Server,
) -> None:
    """continuous_usage_stats: each chunk with a choice carries the usage so far; the last
    one is the usage alone (include_usage); ignore_eos gives all 16 tokens."""
    require_answer(
        smollm2_server, "POST", "/v1/chat/completions",
        {**guidellm_body(smollm2_server), "stream": False, "stream_options": None},
        "guidellm pins the output length with ignore_eos",
    )  # fmt: skip
    status, text = streamed_chat(smollm2_server)
    assert status == 200, text
    events = [line.removeprefix("data: ") for line in text.splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    *streamed, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == OUTPUT_TOKENS
    assert all(chunk.get("usage") for chunk in streamed), streamed
    counts = [chunk["usage"]["completion_tokens"] for chunk in streamed]
    assert counts == sorted(counts) and counts[-1] == OUTPUT_TOKENS


def test_every_request_succeeds_with_the_output_length_asked_for(report: dict[str, Any]) -> None:
    (benchmark,) = report["benchmarks"]
    requests = benchmark["requests"]
    errors = [r["info"]["error"] for r in requests["errored"]]
    assert not errors and not requests["incomplete"], errors
    successful = requests["successful"]
    # guidellm's max_requests window may close before it records the last request it sent:
    # seen once in CI (3 successful of 4, none errored, none incomplete). The server's
    # failures show as errored or incomplete, which must be none.
    assert REQUESTS - 1 <= len(successful) <= REQUESTS, len(successful)
    for request in successful:
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS, request
        # The 64 synthetic tokens inside the chat template's turn markers.
        assert request["input_metrics"]["text_tokens"] >= PROMPT_TOKENS, request
        assert request["output"], request
    tokens = [
        (r["input_metrics"]["text_tokens"], r["output_metrics"]["text_tokens"]) for r in successful
    ]
    print(f"guidellm: (prompt, output) tokens of each request {tokens}")
