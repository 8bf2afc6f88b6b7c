"""The router's API keys: its clients' keys guard every route but /health (and /metrics
unless protected), and it presents the instances' key on every call to them; its body limit;
salting by key: each client key's tenant salts the request on every instance it reaches."""

from __future__ import annotations

import threading

import pytest
from routing import routed, router_refusal
from starlette.routing import Route

from ringfence.actors.http.auth import Keys
from ringfence.actors.router.app import build_app
from ringfence.actors.router.instances import PoolRefused
from ringfence.actors.router.options import RouterOptions

CLIENT_KEY, INSTANCE_KEY = "sk-client-7f3a", "sk-instance-91c2"
OPEN = {"/health", "/metrics"}


def test_every_route_but_health_and_metrics_asks_the_client_for_its_key(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d")
    with routed([prefill], [decode], client_keys=Keys([CLIENT_KEY])) as rig:
        routes = [r for r in build_app(rig.router).routes if isinstance(r, Route)]
        paths = {r.path: sorted(r.methods or ()) for r in routes}
        assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= paths.keys()
        with rig.http() as client:
            for path, methods in paths.items():
                method = "POST" if "POST" in methods else "GET"
                for headers in ({}, {"Authorization": f"Bearer {INSTANCE_KEY}"}):
                    answer = client.request(method, path, headers=headers, content=b"{}")
                    if path in OPEN:
                        assert answer.status_code != 401, (path, headers)
                    else:
                        assert answer.status_code == 401, (path, headers)
                        assert answer.json()["error"]["code"] == "invalid_api_key"
        assert prefill.calls == [] and decode.calls == []  # nothing reached an instance
        answer = rig.post("/v1/completions", {"model": "fake", "prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 401
        with rig.http() as client:
            good = client.post(
                "/v1/completions",
                json={"model": "fake", "prompt": "hi", "max_tokens": 2},
                headers={"Authorization": f"Bearer {CLIENT_KEY}"},
            )
        assert good.status_code == 200, good.text
        assert good.json()["choices"][0]["text"] == "tok0 tok1 "


def test_protected_metrics_ask_for_the_key_too(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d")
    keys = Keys([CLIENT_KEY])
    with (
        routed([prefill], [decode], client_keys=keys, protect_metrics=True) as rig,
        rig.http() as client,
    ):
        assert client.get("/metrics").status_code == 401
        assert client.get("/health").status_code == 200
        ok = client.get("/metrics", headers={"Authorization": f"Bearer {CLIENT_KEY}"})
        assert ok.status_code == 200


def test_the_router_presents_the_instances_key_on_every_call(fakes):
    prefill = fakes("p", role="prefill", api_key=INSTANCE_KEY)
    decode = fakes("d", api_key=INSTANCE_KEY)
    with routed([prefill], [decode], instance_key=INSTANCE_KEY) as rig:
        answer = rig.post("/v1/completions", {"model": "fake", "prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == "tok0 tok1 "
        assert decode.paths() == ["/ringfence/reserve", "/v1/completions"]
        assert prefill.paths() == ["/ringfence/prefill"]


@pytest.mark.parametrize("key", ["", "sk-wrong"])
def test_an_instance_that_refuses_the_routers_key_fails_the_start_naming_it(fakes, key):
    prefill = fakes("p", role="prefill", api_key=INSTANCE_KEY)
    decode = fakes("d", api_key=INSTANCE_KEY)
    with pytest.raises(PoolRefused) as refused, routed([prefill], [decode], instance_key=key):
        pass
    assert "refused the router's API key (HTTP 401)" in str(refused.value)
    assert "RINGFENCE_INSTANCE_API_KEY" in str(refused.value)
    assert INSTANCE_KEY not in str(refused.value)


def test_ringfence_router_with_a_key_file_it_cannot_read_exits_2_naming_it(tmp_path):
    missing = tmp_path / "clients.keys"
    done = router_refusal(
        "--instance", "http://127.0.0.1:1", "--api-key-file", str(missing), started=False
    )
    assert done.stderr.splitlines()[-1] == (
        f"ringfence router: api key file {missing}: No such file or directory"
    )


def test_a_body_over_the_routers_limit_is_413_and_reaches_no_instance(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d")
    with routed([prefill], [decode], max_body_bytes=4096) as rig:
        huge = {"model": "fake", "prompt": "x" * 5000, "max_tokens": 2}
        answer = rig.post("/v1/completions", huge)
        assert answer.status_code == 413
        assert answer.json()["error"]["code"] == "request_too_large"
        assert prefill.calls == [] and decode.calls == []
        small = rig.post("/v1/completions", {"model": "fake", "prompt": "hi", "max_tokens": 2})
        assert small.status_code == 200


def test_salted_by_key_each_tenants_requests_carry_its_salt_to_prefill_and_decode(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d")
    keys = Keys([(CLIENT_KEY, "team-a"), ("sk-other-44d1", "")])
    with routed([prefill], [decode], client_keys=keys, salt_by_key=True) as rig, rig.http() as c:
        for key, salt in (
            (CLIENT_KEY, None),
            (CLIENT_KEY, "mine"),
            ("sk-other-44d1", None),
            (CLIENT_KEY, 7),
        ):
            body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
            if salt is not None:
                body["cache_salt"] = salt
            answer = c.post(
                "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            assert answer.status_code == 200, answer.text
    claims = [call.body for call in decode.calls if call.path == "/v1/completions"]
    prefills = [call.body for call in prefill.calls]
    team, other = keys.salt_of(0), Keys(["sk-other-44d1"]).tenant(b"Bearer sk-other-44d1")
    assert team.startswith("team-a-")  # the tenant's salt, made by its keys
    assert [c.get("cache_salt") for c in claims] == [team, f"{team} mine", other, 7]
    # The prefill keys the blocks as the claim will; a salt an instance refuses passes as is.
    assert [p.get("cache_salt") for p in prefills] == [team, f"{team} mine", other, None]


def test_salting_by_key_needs_client_keys_and_an_instance_salting_by_key_is_refused(fakes):
    with pytest.raises(ValueError, match="--salt-by-key salts requests by their client key"):
        RouterOptions(instances=("http://127.0.0.1:1",), salt_by_key=True)
    prefill, decode = fakes("p", role="prefill"), fakes("d", salt_by_key=True)
    with pytest.raises(PoolRefused) as refused, routed([prefill], [decode]):
        pass
    assert f"{decode.url}: the instance salts requests by API key" in str(refused.value)


def test_a_client_keys_streams_past_its_cap_are_429_while_another_keys_are_routed(fakes):
    gate = threading.Event()
    prefill, decodes = fakes("p", role="prefill"), [fakes(d, gate=gate) for d in ("d1", "d2")]
    keys = Keys([CLIENT_KEY, "sk-second-02aa"])
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2, "stream": True}
    mine, other = ({"Authorization": f"Bearer {k}"} for k in (CLIENT_KEY, "sk-second-02aa"))
    with (
        routed([prefill], decodes, client_keys=keys, max_requests_per_key=1) as rig,
        rig.http() as first,
        rig.http() as second,
        rig.http() as third,  # one client a call
        first.stream("POST", "/v1/completions", json=body, headers=mine) as held,
    ):
        events = held.iter_raw()  # kept: a dropped iterator closes the stream
        next(events)  # its stream runs, held by the fake after its first event
        refused = second.post("/v1/completions", json=body, headers=mine)
        assert refused.status_code == 429, refused.text
        assert "--max-requests-per-key" in refused.json()["error"]["message"]
        with third.stream("POST", "/v1/completions", json=body, headers=other) as routed_too:
            assert routed_too.status_code == 200
            more = routed_too.iter_raw()
            next(more)
            gate.set()
            assert b"[DONE]" in b"".join(more)
        assert b"[DONE]" in b"".join(events)
        again = second.post("/v1/completions", json={**body, "stream": False}, headers=mine)
        assert again.status_code == 200  # its count went back
    with pytest.raises(ValueError, match="--max-requests-per-key counts by client key"):
        RouterOptions(instances=("http://127.0.0.1:1",), max_requests_per_key=1)
