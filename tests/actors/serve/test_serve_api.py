"""`ringfence serve` against real clients: the openai package, httpx and curl, on loopback.

One server for the module (the tiny preset, a 256-token context so limits are quick to
reach); each test leaves it as it found it.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import orjson
import pytest
from serving import Server

MAX_MODEL_LEN = 256  # the shared server's (conftest.py)
MODEL = "ringfence-tiny"
PROMPTS = [[10 + i, 20 + 2 * i, 30 + 3 * i, 40, 50 + i] for i in range(8)]


@pytest.fixture(scope="module")
def server(tiny_server: Server) -> Server:
    return tiny_server


def greedy(server: Server, prompt: list[int], max_tokens: int = 12) -> list[int]:
    answer = server.post(
        "/v1/completions",
        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True},
    )
    assert answer.status_code == 200, answer.text
    return list(answer.json()["choices"][0]["token_ids"])


# The openai client.


def test_a_completion_through_the_openai_client_reports_its_text_tokens_and_usage(server):
    client = server.client()
    answer = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    (choice,) = answer.choices
    assert choice.finish_reason == "length"
    ids = choice.model_extra["token_ids"]
    assert len(ids) == 12 and choice.model_extra["prompt_token_ids"] == PROMPTS[0]
    assert choice.text == bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")
    usage = answer.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (5, 12, 17)
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert usage.model_extra["ringfence"]["cached_tokens"] == {"device": 0, "host": 0, "storage": 0}


def test_a_streamed_completion_has_the_same_tokens_and_ends_with_its_usage(server):
    whole = greedy(server, PROMPTS[1])
    chunks = list(
        server.client().completions.create(
            model=MODEL,
            prompt=PROMPTS[1],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    *tokens, last = chunks
    assert [t for c in tokens for t in c.choices[0].model_extra["token_ids"]] == whole
    assert tokens[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == 12


def test_chat_through_the_openai_client_streamed_or_not_gives_the_same_answer(server):
    client = server.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    rendered = "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert answer.usage.prompt_tokens == len(rendered.encode())
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == choice.message.content


def test_the_models_list_names_the_model_and_its_fingerprint(server):
    (model,) = server.client().models.list().data
    assert model.id == "ringfence-tiny"
    extra = model.model_extra
    assert extra["max_model_len"] == MAX_MODEL_LEN
    assert extra["ringfence"]["model_id"] == "preset-tiny-seed0"
    assert len(extra["ringfence"]["fingerprint"]) == 32


def test_a_stop_string_ends_the_text_before_it(server):
    body = {"prompt": "The quick brown fox", "max_tokens": 60, "temperature": 0}
    text = server.post("/v1/completions", body).json()["choices"][0]["text"]
    # The first character that the text did not hold before: the output must end there.
    cut = next(i for i in range(1, len(text)) if text[i] not in text[:i])
    answer = server.post("/v1/completions", {**body, "stop": ["zzz", text[cut]]}).json()
    assert answer["choices"][0]["text"] == text[:cut]
    assert answer["choices"][0]["finish_reason"] == "stop"


def test_a_seeded_sampled_completion_repeats_and_top_p_near_zero_is_greedy(server):
    body = {"prompt": PROMPTS[3], "max_tokens": 16, "temperature": 1.5, "seed": 7}
    first, again = (server.post("/v1/completions", body).json() for _ in range(2))
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    narrow = {**body, "top_p": 1e-6, "return_token_ids": True}
    assert server.post("/v1/completions", narrow).json()["choices"][0]["token_ids"] == greedy(
        server, PROMPTS[3], 16
    )


# curl: the bytes of the event stream.


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_sees_data_lines_each_followed_by_a_blank_line_then_done(server):
    body = {"prompt": "ab", "max_tokens": 5, "temperature": 0, "stream": True}
    out = subprocess.run(
        ["curl", "-sN", "-H", "Content-Type: application/json", "-d", orjson.dumps(body).decode(),
         f"{server.url}/v1/completions"],
        capture_output=True, check=True, timeout=60,
    ).stdout.decode()  # fmt: skip
    events = out.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [orjson.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert [c["object"] for c in chunks] == ["text_completion"] * len(chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# Many at once.


def test_sixty_four_concurrent_streams_each_get_the_tokens_they_get_alone(server):
    alone = [greedy(server, p, 24) for p in PROMPTS]

    async def one(client, i: int) -> list[int]:
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPTS[i % 8], max_tokens=24, temperature=0, stream=True,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        return [t async for c in stream for t in c.choices[0].model_extra["token_ids"]]

    async def all_of_them() -> list[list[int]]:
        async with server.async_openai() as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    got = asyncio.run(all_of_them())
    assert got == [alone[i % 8] for i in range(64)]
    metrics = server.get("/metrics").text
    assert "ringfence_requests_pending 0.0" in metrics


def test_launch_gives_the_same_greedy_tokens_for_the_same_requests(server, tmp_path):
    from launching import launched

    lines = [
        {"id": f"r{i}", "prompt_token_ids": p, "max_tokens": 12, "temperature": 0.0}
        for i, p in enumerate(PROMPTS[:4])
    ]
    workload = tmp_path / "requests.jsonl"
    workload.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    sets = ("runtime.topology=ringfence.actors.engine.launch:TOPOLOGY", "model.preset=tiny",
            f"engine.workload={workload}", f"sched.max_model_len={MAX_MODEL_LEN}")  # fmt: skip
    with launched(tmp_path, *sets) as launch:
        assert launch.wait(120) == 0, launch.stderr()
        outputs = [orjson.loads(x) for x in (launch.run_dir / "outputs.jsonl").read_bytes().split()]
    assert [o["token_ids"] for o in outputs] == [greedy(server, p) for p in PROMPTS[:4]]


# Health and metrics.


def test_health_is_ok_and_metrics_show_the_requests_served(server):
    assert server.get("/health").json() == {"status": "ok"}
    greedy(server, PROMPTS[4])
    text = server.get("/metrics").text
    for name in (
        "ringfence_time_to_first_token_seconds_bucket",
        "ringfence_inter_token_latency_seconds_bucket",
        "ringfence_prompt_tokens_total",
        "ringfence_generation_tokens_total",
        'ringfence_cached_tokens_total{tier="host"}',
        "ringfence_requests_running",
        "ringfence_requests_waiting",
        'ringfence_preemptions_total{policy="swap"}',
        'ringfence_lane_ops_total{lane="step"}',
        'ringfence_lane_ops_in_flight{lane="swap"}',
        'ringfence_lane_bytes_total{direction="swap_out"}',
        'ringfence_restarts_total{actor="worker-0"} 0.0',
        'ringfence_actor_up{actor="engine-0"} 1.0',
    ):
        assert name in text, name
