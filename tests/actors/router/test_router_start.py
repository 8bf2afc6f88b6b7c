"""The router's start: it waits for every instance, refuses a pool it cannot run (roles,
fingerprints, storage secrets), and as ``ringfence router`` prints where it listens, then
ready, and exits 0 on Ctrl-C or SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from typing import cast

import httpx
import pytest
from routing import ROUTER_START_S, routed, router_process, router_refusal

from ringfence.actors.router.instances import Identity, PoolRefused, StartTimeout, identify
from ringfence.actors.router.options import RouterOptions
from ringfence.actors.router.state import _differs, open_router
from ringfence.actors.router.upstream import CallTimeout, ConnectError, Upstream


def closed_port_url() -> str:
    """A loopback URL where nothing listens (the port was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        host, port = sock.getsockname()
    return f"http://{host}:{port}"


def test_instances_with_differing_fingerprints_are_refused_naming_both(fakes):
    prefill = fakes("p", role="prefill", fingerprints=("aa", "bb"))
    decode = fakes("d", fingerprints=("aa", "cc"))
    with pytest.raises(PoolRefused) as refused, routed([prefill], [decode]):
        pass
    assert str(refused.value) == (
        f"{prefill.url} (prefill, fingerprints [aa, bb]) and {decode.url} (decode, "
        "fingerprints [aa, cc]) cannot share KV: their fingerprints differ (another model, "
        "dtype, block size or tp size)"
    )


@pytest.mark.parametrize(("prefill_id", "decode_id"), [("5ec1", "5ec2"), ("5ec1", None)])
def test_instances_with_differing_storage_secrets_are_refused_naming_both(
    fakes, prefill_id, decode_id
):
    prefill = fakes("p", role="prefill", storage_secret_id=prefill_id)
    decode = fakes("d", storage_secret_id=decode_id)
    with pytest.raises(PoolRefused) as refused, routed([prefill], [decode]):
        pass
    theirs = f"secret {decode_id}" if decode_id else "no secret"
    assert str(refused.value) == (
        f"{prefill.url} (prefill, fingerprints [f0]) and {decode.url} (decode, fingerprints "
        f"[f0]) cannot share KV: their storage secrets differ (secret {prefill_id} and "
        f"{theirs}; cache.storage.secret)"
    )


def test_instances_with_one_storage_secret_make_a_pool(fakes):
    prefill = fakes("p", role="prefill", storage_secret_id="5ec1")
    decode = fakes("d", storage_secret_id="5ec1")
    with routed([prefill], [decode]) as rig:
        assert [i.identity.secret_id for i in rig.router.pool.instances] == ["5ec1", "5ec1"]


def test_an_instance_that_answers_again_with_another_storage_secret_is_not_taken_back():
    was = Identity(role="decode", model="m", fingerprints=("f0",), secret_id="5ec1")
    assert _differs(was, was) is None
    now = Identity(role="decode", model="m", fingerprints=("f0",), secret_id="")
    assert _differs(was, now) == "its storage secret (no secret) is not the pool's (secret 5ec1)"


@pytest.mark.parametrize("wrong", ["prefill", "decode"])
def test_an_instance_of_the_wrong_role_is_refused_naming_it(fakes, wrong):
    prefill = fakes("p", role="both" if wrong == "prefill" else "prefill")
    decode = fakes("d", role="prefill" if wrong == "decode" else "decode")
    with pytest.raises(PoolRefused) as refused, routed([prefill], [decode]):
        pass
    url, role = (prefill.url, "both") if wrong == "prefill" else (decode.url, "prefill")
    assert str(refused.value) == (
        f"--{wrong} {url}: the instance's role is {role!r}, not {wrong!r} (engine.role={wrong})"
    )


def test_an_instance_that_never_answers_fails_the_start_at_its_deadline(fakes):
    # Long enough for a refused connection to come back well before it on a loaded machine
    # (the last try, cut short by the deadline, must not hide it).
    prefill, nobody = fakes("p", role="prefill"), closed_port_url()
    options = RouterOptions(prefill=(prefill.url,), decode=(nobody,), start_timeout_s=2.0)
    with pytest.raises(StartTimeout) as late:
        asyncio.run(open_router(options))
    assert str(late.value).startswith(f"{nobody} did not answer /ringfence/instance in time")
    assert "ConnectError" in str(late.value)


def test_a_try_the_start_deadline_cuts_short_does_not_hide_an_earlier_failure():
    class Refusing:
        """Refuses the first connection, then hangs until the call's own deadline."""

        def __init__(self):
            self.calls = 0

        async def get(self, url, *, timeout):
            self.calls += 1
            if self.calls == 1:
                raise ConnectError("Cannot connect to host: Connection refused")
            raise CallTimeout(f"no answer in {timeout:.2f} s")

        async def closed_after_handshake(self, url, *, timeout):
            return False

    with pytest.raises(StartTimeout) as late:
        client = cast(Upstream, Refusing())  # the two calls identify makes
        asyncio.run(identify(client, "http://127.0.0.1:9", time.monotonic() + 0.3))
    assert "(last: ConnectError: Cannot connect to host: Connection refused)" in str(late.value)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_ringfence_router_serves_until_a_signal_then_exits_0(fakes, stop):
    prefill, decode = fakes("p", role="prefill"), fakes("d")
    with router_process("--prefill", prefill.url, "--decode", decode.url) as (url, proc):
        body = {"prompt": "hello there", "max_tokens": 2}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=10, trust_env=False)
        assert answer.json()["choices"][0]["text"] == "tok0 tok1 "
        assert [p for _, p in decode.journal][-3:] == [
            "/ringfence/reserve", "/ringfence/prefill", "/v1/completions",
        ]  # fmt: skip
        proc.send_signal(stop)
        out, err = proc.communicate(timeout=ROUTER_START_S)
        assert proc.returncode == 0, err
        assert out == "ringfence router: stopped\n"
        assert '"event":"router.answered"' in err


def test_ringfence_router_exits_2_naming_both_instances_when_fingerprints_differ(fakes):
    prefill = fakes("p", role="prefill", fingerprints=("aa",))
    decode = fakes("d", fingerprints=("bb",))
    done = router_refusal("--prefill", prefill.url, "--decode", decode.url)
    assert done.stderr.startswith(f"ringfence router: {prefill.url} (prefill, fingerprints [aa])")
    assert f"and {decode.url} (decode, fingerprints [bb]) cannot share KV" in done.stderr


def test_ringfence_router_without_decode_exits_2_naming_what_is_missing():
    done = router_refusal("--prefill", "http://x:1", started=False)
    assert done.stderr.splitlines()[-1] == (
        "ringfence router: --decode: at least one decode instance is needed (or --instance)"
    )
