"""The router's run of one request over fake instances: reserve, prefill, claim, relay, and
what it does when an instance says no, is slow, or dies."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
import orjson
import pytest
from fake_instance import event_bytes, whole
from launching import wait_until
from routing import routed

PROMPT = "the quick brown fox jumps over the lazy dog"
BODY = {"model": "fake", "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
MESSAGES: list[Any] = [{"role": "user", "content": PROMPT}]
CHAT = {"model": "fake", "messages": MESSAGES, "max_tokens": 3}
TEXT = "tok0 tok1 tok2 "
RUN = [("d", "/ringfence/reserve"), ("p", "/ringfence/prefill"), ("d", "/v1/completions")]


def test_a_completion_is_reserved_then_prefilled_with_its_ids_then_claimed_with_the_header(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d")
    with routed([prefill], [decode]) as rig:
        answer = rig.openai().completions.create(model="fake", prompt=PROMPT, max_tokens=3)
        assert answer.choices[0].text == TEXT
        assert rig.journal == RUN
        reserve, claim = decode.calls
        sent = {"model": "fake", "prompt": PROMPT, "max_tokens": 3}
        assert reserve.body == {"kind": "completions", "body": sent}
        (done,) = prefill.calls
        (line,) = rig.log.events("router.answered")
        assert done.body == {
            "prompt_token_ids": list(PROMPT.encode()),
            "request_id": line["request"],
        }
        assert claim.reservation == "rsv-1"
        assert orjson.loads(claim.raw) == sent
        assert (line["outcome"], line["status"], line["claims"]) == ("ok", 200, 1)
        assert rig.metric("ringfence_router_requests_total", outcome="ok") == 1
        assert rig.metric("ringfence_router_prefills_total") == 1


def test_the_claim_carries_the_clients_body_byte_for_byte(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d")
    raw = b'{"prompt":  [5, 6, 7],\n "max_tokens": 2, "unknown_field": {"kept": true}}'
    with routed([prefill], [decode]) as rig, rig.http() as client:
        answer = client.post("/v1/completions", content=raw)
        assert answer.status_code == 200, answer.text
        assert decode.calls[-1].raw == raw
        assert decode.calls[0].raw == b'{"kind":"completions","body":' + raw + b"}"
        assert prefill.calls[0].body["prompt_token_ids"] == [5, 6, 7]


def test_a_streamed_chat_is_relayed_byte_for_byte_to_done(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d")
    body = {**CHAT, "stream": True}
    with routed([prefill], [decode]) as rig:
        with rig.http() as client, client.stream("POST", "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200
            assert s.headers["content-type"].startswith("text/event-stream")
            assert s.read() == event_bytes("chat", body)
        stream = rig.openai().chat.completions.create(
            model="fake", messages=MESSAGES, max_tokens=3, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream) == TEXT
        paths = [p for _, p in rig.journal]
        assert paths == ["/ringfence/reserve", "/ringfence/prefill", "/v1/chat/completions"] * 2
        assert rig.metric("ringfence_router_requests_total", outcome="ok") == 2
        count = "ringfence_router_stage_seconds_count"
        assert rig.metric(count, stage="claim_to_first_byte") == 2


def test_a_plain_chat_and_a_streamed_completion_through_the_openai_client(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d")
    with routed([prefill], [decode]) as rig:
        client = rig.openai()
        chat = client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=3)
        assert chat.choices[0].message.content == TEXT
        assert chat.model_dump(exclude_none=True)["usage"] == whole("chat", CHAT)["usage"]
        stream = client.completions.create(model="fake", prompt=PROMPT, max_tokens=3, stream=True)
        assert "".join(c.choices[0].text for c in stream) == TEXT


def test_no_room_twice_then_granted_is_two_reserve_retries(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d", no_room=2)
    with routed([prefill], [decode]) as rig:
        answer = rig.post("/v1/completions", BODY)
        assert answer.status_code == 200, answer.text
        assert rig.journal == [("d", "/ringfence/reserve")] * 2 + RUN
        assert rig.metric("ringfence_router_reserve_retries_total") == 2
        assert rig.log.events("router.answered")[0]["retries"] == 2


def test_no_room_on_one_decode_instance_tries_the_other_before_waiting(fakes):
    prefill = fakes("p", role="prefill")
    first, second = fakes("d1", no_room=1), fakes("d2")
    with routed([prefill], [first, second]) as rig:
        assert rig.post("/v1/completions", BODY).status_code == 200
        assert rig.journal == [
            ("d1", "/ringfence/reserve"), ("d2", "/ringfence/reserve"),
            ("p", "/ringfence/prefill"), ("d2", "/v1/completions"),
        ]  # fmt: skip


def test_no_room_until_the_reserve_timeout_is_a_503_with_retry_after(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d", no_room=10**6, retry_after="0")
    with routed([prefill], [decode], reserve_timeout_s=0.3) as rig:
        answer = rig.post("/v1/completions", BODY)
        assert answer.status_code == 503
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "no_room"
        assert "within 0.3 s" in answer.json()["error"]["message"]
        assert prefill.calls == []
        assert rig.metric("ringfence_router_requests_total", outcome="no_room") == 1
        assert rig.log.events("router.gave_up")[0]["waited_s"] == 0.3


def test_a_bad_field_is_the_decode_instances_400_relayed_as_is(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d", bad_field="temperature")
    with routed([prefill], [decode]) as rig:
        with pytest.raises(openai.BadRequestError) as raised:
            rig.openai().completions.create(model="fake", prompt=PROMPT, temperature=9)
        assert raised.value.body == {  # openai's error body: the "error" object
            "message": "temperature: bad value", "type": "invalid_request_error",
            "param": "temperature", "code": None,
        }  # fmt: skip
        assert rig.journal == [("d", "/ringfence/reserve")]
        assert rig.metric("ringfence_router_requests_total", outcome="relayed_error") == 1


@pytest.mark.parametrize("raw", [b"[1, 2]", b"not json", b'"a string"'])
def test_a_body_that_is_no_json_object_is_the_routers_own_400(fakes, raw):
    prefill, decode = fakes("p", role="prefill"), fakes("d")
    with routed([prefill], [decode]) as rig, rig.http() as client:
        answer = client.post("/v1/chat/completions", content=raw)
        assert answer.status_code == 400
        assert answer.json()["error"]["type"] == "invalid_request_error"
        assert rig.journal == []
        assert rig.metric("ringfence_router_requests_total", outcome="bad_request") == 1


@pytest.mark.parametrize(
    ("how", "why"),
    [("slow", "timeout"), ("503", "http_error"), ("garbage", "bad_answer"), ("down", "refused")],
)
def test_a_failed_prefill_is_counted_by_why_and_the_claim_still_happens(fakes, how, why):
    prefill = fakes("p", role="prefill", prefill="ok" if how == "down" else how)
    decode = fakes("d")
    with routed([prefill], [decode], prefill_timeout_s=0.3) as rig:
        if how == "down":
            prefill.stop()
        answer = rig.post("/v1/completions", BODY)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == TEXT
        assert decode.paths() == ["/ringfence/reserve", "/v1/completions"]
        assert rig.metric("ringfence_router_prefill_fallbacks_total", why=why) == 1
        assert rig.metric("ringfence_router_prefills_total") == 0
        (line,) = rig.log.events("router.fell_back")
        assert (line["why"], line["prefill"], line["decode"]) == (why, prefill.url, decode.url)
        assert line["level"] == "warning"
        assert rig.log.events("router.answered")[0]["fallback"] == why


def test_the_default_prefill_deadline_is_the_reservations_ttl_less_a_margin(fakes):
    prefill = fakes("p", role="prefill", prefill="slow", prefill_delay_s=1.0)
    decode = fakes("d", ttl_s=0.8)  # deadline: 0.8 - min(2, 0.4) = 0.4 s
    with routed([prefill], [decode]) as rig:
        assert rig.post("/v1/completions", BODY).status_code == 200
        (line,) = rig.log.events("router.fell_back")
        assert (line["why"], line["error"]) == ("timeout", "no answer within 0.4 s")


def test_an_expired_reservation_is_reserved_again_and_claimed_again(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d", expire_once=True)
    with routed([prefill], [decode]) as rig:
        answer = rig.post("/v1/completions", BODY)
        assert answer.status_code == 200, answer.text
        assert rig.journal == [*RUN, ("d", "/ringfence/reserve"), ("d", "/v1/completions")]
        claims = [c.reservation for c in decode.calls if c.path == "/v1/completions"]
        assert claims == ["rsv-1", "rsv-2"]
        assert rig.metric("ringfence_router_reservations_expired_total") == 1
        assert rig.log.events("router.answered")[0]["claims"] == 2


def test_a_decode_instance_that_dies_mid_stream_ends_it_with_an_error_event_then_done(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d", die_after=2)
    body = {**BODY, "stream": True}
    with routed([prefill], [decode]) as rig:
        with rig.http() as client, client.stream("POST", "/v1/completions", json=body) as s:
            assert s.status_code == 200
            events = s.read().split(b"\n\n")
        expected = event_bytes("completions", body).split(b"\n\n")[:2]
        assert events[:2] == expected
        assert events[3:] == [b"data: [DONE]", b""]
        error = orjson.loads(events[2].removeprefix(b"data: "))["error"]
        assert (error["type"], error["code"]) == ("server_error", "decode_failed")
        assert decode.url in error["message"]
        assert rig.metric("ringfence_router_requests_total", outcome="decode_failed") == 1
        (lost,) = rig.log.events("router.decode_lost")
        assert (lost["level"], lost["decode"]) == ("error", decode.url)


def test_a_decode_instance_that_dies_mid_answer_is_a_502(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d", die_after=20)
    with routed([prefill], [decode]) as rig:
        answer = rig.post("/v1/completions", BODY)
        assert answer.status_code == 502
        assert answer.json()["error"]["code"] == "decode_failed"
        assert rig.metric("ringfence_router_requests_total", outcome="decode_failed") == 1


def test_the_decode_instance_with_fewer_requests_in_flight_gets_the_next(fakes):
    gate = threading.Event()
    prefill = fakes("p", role="prefill")
    first, second = fakes("d1", gate=gate), fakes("d2", gate=gate)
    with routed([prefill], [first, second]) as rig, rig.http() as client:
        body = {**BODY, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as held:
            events = held.iter_raw()
            next(events)  # its first event: it is in flight on d1
            for _ in range(2):  # round robin alone would give d1 the second of these
                assert client.post("/v1/completions", json=BODY).status_code == 200
            gate.set()
            assert b"".join(events).endswith(b"data: [DONE]\n\n")
        assert first.paths() == ["/ringfence/reserve", "/v1/completions"]
        assert second.paths() == ["/ringfence/reserve", "/v1/completions"] * 2


def test_equal_loads_take_turns(fakes):
    prefill = fakes("p", role="prefill")
    decodes = [fakes("d1"), fakes("d2"), fakes("d3")]
    with routed([prefill], decodes) as rig:
        for _ in range(6):
            assert rig.post("/v1/completions", BODY).status_code == 200
        claims = [name for name, path in rig.journal if path == "/v1/completions"]
        assert claims == ["d1", "d2", "d3"] * 2


def test_a_client_that_leaves_a_stream_has_the_decode_instances_stream_closed(fakes):
    gate = threading.Event()
    prefill, decode = fakes("p", role="prefill"), fakes("d", gate=gate)
    with routed([prefill], [decode]) as rig:
        body = {**BODY, "stream": True}
        with rig.http() as client, client.stream("POST", "/v1/completions", json=body) as s:
            next(s.iter_raw())

        def closed() -> bool:
            return rig.metric("ringfence_router_requests_total", outcome="client_closed") == 1

        wait_until("the router to see the client go", closed, 5.0)
        gate.set()
        wait_until("the fake to see its stream closed", lambda: decode.aborted == ["rsv-1"], 5.0)
        assert rig.router.pool.instances[1].in_flight == 0


def test_health_is_ok_while_a_decode_instance_is_up_and_names_what_is_down(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d")
    with routed([prefill], [decode]) as rig, rig.http() as client:
        assert client.get("/health").json() == {"status": "ok", "down": []}
        prefill.stop()
        answer = client.get("/health")
        assert answer.status_code == 200
        assert answer.json()["status"] == "degraded"
        (down,) = answer.json()["down"]
        assert down.startswith(f"prefill {prefill.url}: ConnectError")
        decode.stop()
        answer = client.get("/health")
        assert answer.status_code == 503
        assert answer.json()["status"] == "unavailable"
        assert len(answer.json()["down"]) == 2


def test_models_are_a_decode_instances(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d")
    with routed([prefill], [decode]) as rig:
        assert [m.id for m in rig.openai().models.list()] == ["fake"]
        with rig.http() as client:
            assert client.get("/v1/models").json() == httpx.get(f"{decode.url}/v1/models").json()


def test_an_unknown_route_and_a_wrong_method_are_answered_in_openais_error_body(fakes):
    prefill, decode = fakes("p", role="prefill"), fakes("d")
    with routed([prefill], [decode]) as rig, rig.http() as client:
        for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
            answer = client.request(method, path)
            assert answer.status_code == status
            assert answer.json()["error"]["type"] == "invalid_request_error"
        assert rig.journal == []
