"""API keys (actors/http/auth.py): where they come from, how a key is checked, and the
middleware's 401 in OpenAI's error body; a secret setting never reaches the run dir."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from ringfence.actors.http.auth import (
    Keys,
    RequireKey,
    exposed_without_key,
    instance_key,
    keys_in_clear,
    load_keys,
    open_paths,
)
from ringfence.actors.serve.config import ServerConfig
from ringfence.runtime.config import dump_config, load_config
from ringfence.runtime.secrets import export_secrets

SERVE = "runtime.topology=ringfence.actors.serve.topology:TOPOLOGY"


def test_a_key_is_accepted_only_as_a_bearer_token_equal_to_one_held():
    keys = Keys(["sk-one", "sk-two"])
    assert keys.accepts(b"Bearer sk-one") and keys.accepts(b"bearer sk-two")
    assert not keys.accepts(b"Bearer sk-on")
    assert not keys.accepts(b"Bearer sk-one2")
    assert not keys.accepts(b"Basic sk-one")
    assert not keys.accepts(b"sk-one")
    assert not keys.accepts(None)
    assert repr(keys) == "Keys(2 keys)" and "sk-one" not in repr(keys)


def test_keys_come_from_the_setting_the_environment_and_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGFENCE_API_KEY", "sk-env1, sk-env2")
    path = tmp_path / "keys"
    path.write_text("# the team's keys\nsk-file\n\n")
    keys = load_keys("sk-inline", str(path))
    assert len(keys) == 4
    for key in ("sk-inline", "sk-env1", "sk-env2", "sk-file"):
        assert keys.accepts(f"Bearer {key}".encode()), key
    monkeypatch.delenv("RINGFENCE_API_KEY")
    assert not load_keys()  # none anywhere: no check at all


def test_a_bad_key_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=f"api key file {tmp_path}/missing: No such file"):
        load_keys(key_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="empty: no key in it"):
        load_keys(key_file=str(tmp_path / "empty"))
    (tmp_path / "two").write_text("sk-a\nsk-b\n")
    with pytest.raises(ValueError, match="presents one key to its instances, not 2"):
        instance_key(str(tmp_path / "two"))


def test_the_routers_instance_key_comes_from_its_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("RINGFENCE_INSTANCE_API_KEY", raising=False)
    assert instance_key() == ""
    monkeypatch.setenv("RINGFENCE_INSTANCE_API_KEY", "sk-inst")
    assert instance_key() == "sk-inst"
    (tmp_path / "k").write_text("sk-from-file\n")
    assert instance_key(str(tmp_path / "k")) == "sk-from-file"


def test_a_secret_setting_leaves_the_config_for_the_environment_and_is_never_dumped():
    config = load_config(None, [SERVE, "server.api_key=sk-secret-1", "server.port=9"])
    assert "sk-secret-1" not in dump_config(config)  # the run dir's config.toml
    environ: dict[str, str] = {"RINGFENCE_API_KEY": "sk-already"}
    exported = export_secrets(config, environ)
    assert environ == {
        "RINGFENCE_API_KEY": "sk-already,sk-secret-1",
        "RINGFENCE_SECRET_VARS": "RINGFENCE_API_KEY,RINGFENCE_STORAGE_PASSWORD,"
        "RINGFENCE_STORAGE_SECRET",
    }
    server = exported.section("server")
    assert isinstance(server, ServerConfig)
    assert (server.api_key, server.port) == ("", 9)
    assert load_config(None, [SERVE, "server.port=9"]) == exported


def app_with_keys(protect_metrics: bool = False) -> Starlette:
    async def ok(request):
        return PlainTextResponse(f"{request.method} {request.url.path}")

    routes = [Route(p, ok, methods=["GET", "POST"]) for p in ("/health", "/metrics", "/v1/x")]
    middleware = Middleware(RequireKey, keys=Keys(["sk-1"]), open_paths=open_paths(protect_metrics))
    return Starlette(routes=routes, middleware=[middleware])


@pytest.mark.parametrize("protect_metrics", [False, True])
def test_every_path_but_the_open_ones_answers_401_without_the_key(protect_metrics):
    with TestClient(app_with_keys(protect_metrics)) as client:
        for headers in ({}, {"Authorization": "Bearer sk-2"}, {"Authorization": "sk-1"}):
            answer = client.post("/v1/x", content=b"{}", headers=headers)
            assert answer.status_code == 401, headers
            assert answer.headers["www-authenticate"] == "Bearer"
            assert answer.json()["error"]["code"] == "invalid_api_key"
            assert answer.json()["error"]["type"] == "invalid_request_error"
            metrics = client.get("/metrics", headers=headers)
            assert metrics.status_code == (401 if protect_metrics else 200)
            assert client.get("/health", headers=headers).status_code == 200
        good = {"Authorization": "Bearer sk-1"}
        assert client.post("/v1/x", headers=good).text == "POST /v1/x"
        assert client.get("/metrics", headers=good).status_code == 200


def test_a_server_beyond_loopback_without_a_key_is_exposed():
    none, some = Keys(()), Keys(["sk-1"])
    assert exposed_without_key("0.0.0.0", none) and exposed_without_key("10.1.2.3", none)
    assert exposed_without_key("::", none) and exposed_without_key("example.org", none)
    assert not exposed_without_key("127.0.0.1", none) and not exposed_without_key("::1", none)
    assert not exposed_without_key("localhost", none)
    assert not exposed_without_key("0.0.0.0", some)


def test_keys_asked_for_beyond_loopback_over_plain_http_travel_in_clear():
    none, some = Keys(()), Keys(["sk-1"])
    assert keys_in_clear("0.0.0.0", some, tls=False) and keys_in_clear("::", some, tls=False)
    assert not keys_in_clear("0.0.0.0", some, tls=True)
    assert not keys_in_clear("127.0.0.1", some, tls=False)
    assert not keys_in_clear("0.0.0.0", none, tls=False)  # the no-key warning's case


def test_a_key_file_path_is_no_secret(tmp_path: Path):
    config = load_config(None, [SERVE, f"server.api_key_file={tmp_path}/keys"])
    assert f'api_key_file = "{tmp_path}/keys"' in dump_config(config)


def test_a_key_files_tenant_names_group_keys_and_a_key_without_one_is_its_own(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-a1 team-a\nsk-a2   team-a  \nsk-b\n# sk-c team-c\n")
    keys = load_keys(key_file=str(path))
    a1, a2 = keys.tenant(b"Bearer sk-a1"), keys.tenant(b"Bearer sk-a2")
    b = keys.tenant(b"Bearer sk-b")
    assert a1 == a2 == "team-a"
    assert b is not None and b.startswith("key-") and len(b) == 4 + 16
    assert "sk-b" not in b and b == Keys(["sk-b"]).tenant(b"Bearer sk-b")  # the same anywhere
    assert Keys(["sk-c"]).tenant(b"Bearer sk-c") != b
    assert keys.tenant(b"Bearer sk-c") is None and keys.tenant(None) is None
    path.write_text("sk-a team a\n")
    with pytest.raises(ValueError, match="line 1: a key and at most a tenant name, not 3 words"):
        load_keys(key_file=str(path))


def test_the_salt_by_key_puts_the_tenant_before_the_clients_salt():
    from ringfence.actors.http.auth import tenant_salt

    assert tenant_salt("team-a", None, salt_by_key=False) == ""
    assert tenant_salt("team-a", "s", salt_by_key=False) == "s"
    assert tenant_salt(None, "s", salt_by_key=True) == "s"  # no keys: nothing to salt by
    assert tenant_salt("team-a", None, salt_by_key=True) == "team-a"
    assert tenant_salt("team-a", "s", salt_by_key=True) == "team-a s"
    # A client's salt never makes another tenant's: the tenant's name ends at the first space.
    assert tenant_salt("team-a", "team-b", salt_by_key=True) != tenant_salt("team-b", None, True)


def test_the_middleware_hands_the_route_the_callers_tenant():
    from ringfence.actors.http.auth import TENANT_SCOPE

    async def who(request):
        return PlainTextResponse(str(request.scope.get(TENANT_SCOPE)))

    keys = Keys([("sk-1", "one"), ("sk-2", "two")])
    app = Starlette(routes=[Route("/v1/x", who)], middleware=[Middleware(RequireKey, keys=keys)])
    with TestClient(app) as client:
        assert client.get("/v1/x", headers={"Authorization": "Bearer sk-2"}).text == keys.salt_of(1)
        assert client.get("/v1/x", headers={"Authorization": "Bearer sk-1"}).text == keys.salt_of(0)


def test_a_tenants_salt_is_made_by_its_keys_not_its_name_alone():
    team = Keys([("sk-a1", "team-a"), ("sk-a2", "team-a"), ("sk-b", "team-b"), "sk-c"])
    a1, a2, b, c = (team.salt_of(i) for i in range(4))
    assert a1 == a2 and a1.startswith("team-a-") and len(a1) == len("team-a-") + 16
    assert b.startswith("team-b-") and b != a1
    assert c == team.tenant(b"Bearer sk-c")  # a key's own name is one-way already
    # The same key file anywhere: the same salt; the name without its keys: another one.
    assert Keys([("sk-a2", "team-a"), ("sk-a1", "team-a")]).salt_of(0) == a1
    assert Keys([("sk-guess", "team-a")]).salt_of(0) != a1
    assert " " not in a1 + b + c
