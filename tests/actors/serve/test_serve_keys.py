"""``ringfence serve`` with API keys: every route but /health and /metrics answers 401
without a key it holds and does nothing; the key is never written to the run dir or printed;
a key file that cannot be read stops the command before a run exists; a body over
``server.max_body_bytes`` is 413; with ``server.salt_by_key`` tenants share no cached prefix."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from launching import ringfence
from serving import Server, served

KEY, FILE_KEY = "sk-inline-5c1e2b", "sk-file-a09d44"
TEAM_KEYS = ("sk-team-one-77f0", "sk-team-two-1b3c")  # one tenant, "team", in the key file
OPEN = {"/health", "/metrics"}
MODEL = "ringfence-tiny"
MAX_BODY = 65536


@pytest.fixture(scope="module")
def keyed(tmp_path_factory) -> Iterator[tuple[Server, Path]]:
    tmp = tmp_path_factory.mktemp("serve-keys")
    key_file = tmp / "keys.txt"
    team = "".join(f"{key} team\n" for key in TEAM_KEYS)
    key_file.write_text(f"# the service's keys\n{FILE_KEY}\n{team}")
    sets = ("model.preset=tiny", f"server.api_key={KEY}", f"server.api_key_file={key_file}",
            f"server.max_body_bytes={MAX_BODY}", "server.salt_by_key=true")  # fmt: skip
    with served(tmp, *sets) as server:
        yield server, tmp


def routes(server: Server) -> dict[str, str]:
    """Every path of the API and one method it takes, from its own OpenAPI document."""
    with server.http() as client:
        document = client.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
    assert document.status_code == 200
    paths = document.json()["paths"]
    return {p: "post" if "post" in ops else "get" for p, ops in paths.items()}


def test_every_route_but_health_and_metrics_answers_401_without_a_key_it_holds(keyed):
    server, _ = keyed
    paths = routes(server)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
            "/detokenize", "/ringfence/reserve", "/ringfence/prefill",
            "/ringfence/instance", "/ringfence/load"} <= paths.keys()  # fmt: skip
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    with server.http() as client:
        for path, method in sorted({**paths, "/openapi.json": "get", "/docs": "get"}.items()):
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}):
                answer = client.request(method, path, headers=headers, json=body)
                if path in OPEN:
                    assert answer.status_code == 200, (path, headers, answer.text)
                    continue
                assert answer.status_code == 401, (path, headers, answer.text)
                assert answer.json()["error"]["code"] == "invalid_api_key"
    assert server.engine_events("request.arrive") == []  # nothing reached the engine
    with pytest.raises(openai.AuthenticationError):
        wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)


@pytest.mark.parametrize("key", [KEY, FILE_KEY])
def test_the_settings_key_and_the_key_files_are_each_taken(keyed, key):
    server, _ = keyed
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert completion.usage is not None and completion.usage.completion_tokens == 2
    answer = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {key}"}
    )
    assert answer.status_code == 200


def test_no_key_is_in_any_file_of_the_run_dir_or_in_what_the_command_printed(keyed):
    server, tmp = keyed
    server.post("/v1/completions", {"model": MODEL, "prompt": "hi"})  # a 401, not logged
    leaked = []
    for path in (tmp / "run").rglob("*"):
        if path.is_file() and any(
            k.encode() in path.read_bytes() for k in (KEY, FILE_KEY, *TEAM_KEYS)
        ):
            leaked.append(str(path))
    assert leaked == []
    printed = server.launch.stdout() + server.launch.stderr()
    assert not [k for k in (KEY, FILE_KEY, *TEAM_KEYS) if k in printed]
    config = (tmp / "run" / "config.toml").read_text()
    assert 'api_key = ""' in config and "api_key_file = " in config


def test_a_key_file_that_cannot_be_read_is_named_before_a_run_exists(tmp_path):
    missing = tmp_path / "nope.keys"
    done = ringfence(
        "serve", "--port", "0", "--run-dir", tmp_path / "run",
        "--set", "model.preset=tiny", "--set", f"server.api_key_file={missing}",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"api key file {missing}: No such file or directory" in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_body_over_server_max_body_bytes_is_413_and_reaches_nothing(keyed):
    server, _ = keyed
    huge = {"model": MODEL, "prompt": "x" * MAX_BODY, "max_tokens": 1}
    arrived = len(server.engine_events("request.arrive"))
    with server.http() as client:
        answer = client.post(
            "/v1/completions", json=huge, headers={"Authorization": f"Bearer {KEY}"}
        )
        assert answer.status_code == 413, answer.text
        assert answer.json()["error"]["code"] == "request_too_large"
        unkeyed = client.post("/v1/completions", json=huge)  # the key is asked for first
        assert unkeyed.status_code == 401
        small = {"model": MODEL, "prompt": "hi", "max_tokens": 1}  # what does arrive, and when
        assert (
            client.post(
                "/v1/completions", json=small, headers={"Authorization": f"Bearer {KEY}"}
            ).status_code
            == 200
        )
    assert len(server.engine_events("request.arrive")) == arrived + 1


def cached(server: Server, key: str, prompt: str, **extra: object) -> int:
    """The prompt tokens a completion of ``prompt`` found cached, asked with ``key``."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    completion = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra or None
    )
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    return completion.usage.prompt_tokens_details.cached_tokens or 0


def test_salted_by_key_another_tenant_finds_nothing_cached_and_the_same_one_does(keyed):
    server, _ = keyed
    prompt = "A prefix that only the first tenant has sent before, long enough for blocks. " * 3
    assert cached(server, KEY, prompt) == 0
    assert cached(server, FILE_KEY, prompt) == 0  # another tenant: nothing shared
    assert cached(server, KEY, prompt) >= 192  # the same tenant again: its blocks
    assert cached(server, FILE_KEY, prompt) >= 192  # its own, from its first call
    # A client's cache_salt splits a tenant further; it never reaches another tenant's.
    assert cached(server, KEY, prompt, cache_salt="split") == 0
    assert cached(server, KEY, prompt, cache_salt="split") >= 192
    # Keys an operator gave one tenant name share their prefixes.
    assert cached(server, TEAM_KEYS[0], prompt) == 0
    assert cached(server, TEAM_KEYS[1], prompt) >= 192


def test_a_bad_cache_salt_is_a_400_naming_it(keyed):
    server, _ = keyed
    with server.http() as client:
        for salt in ("", 7, "x" * 1025):
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "cache_salt": salt}
            answer = client.post(
                "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
            )
            assert answer.status_code == 400, (salt, answer.text)
            assert answer.json()["error"]["param"] == "cache_salt", answer.text


def test_salting_by_key_with_no_key_stops_the_command_before_a_run_exists(tmp_path):
    done = ringfence(
        "serve", "--port", "0", "--run-dir", tmp_path / "run",
        "--set", "model.preset=tiny", "--set", "server.salt_by_key=true",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "server.salt_by_key salts requests by their API key, and no key is set" in done.stderr
    assert not (tmp_path / "run").exists()
