"""The router and TLS: it verifies https instances against the CA it is given and refuses,
by name, an instance whose certificate does not verify; it presents its client certificate
to instances that ask for one; its own listener speaks HTTPS with --ssl-certfile."""

from __future__ import annotations

import httpx
import openai
import pytest
from certificates import Certificates, Pair, make_certificates
from routing import ROUTER_START_S, routed, router_process, router_refusal

from ringfence.actors.http.tls import ROUTER_NAMES, SERVE_NAMES, ListenerTls
from ringfence.actors.router.instances import PoolRefused

REQUEST = {"model": "fake", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("router-tls"))


def listener(pair: Pair, ca_certs: str = "") -> ListenerTls:
    return ListenerTls(certfile=pair.certfile, keyfile=pair.keyfile, ca_certs=ca_certs)


def test_the_router_verifies_https_instances_against_the_ca_it_is_given(fakes, certs):
    tls = listener(certs.server)
    prefill, decode = fakes("p", role="prefill", tls=tls), fakes("d", tls=tls)
    assert prefill.url.startswith("https://127.0.0.1:")
    with routed([prefill], [decode], instance_ca_certs=certs.ca) as rig:
        answer = rig.post("/v1/completions", REQUEST)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == "tok0 tok1 "
        assert decode.paths() == ["/ringfence/reserve", "/v1/completions"]
        assert prefill.paths() == ["/ringfence/prefill"]


@pytest.mark.parametrize(
    ("pair", "reason"),
    [
        ("other_ca", "unable to get local issuer certificate"),
        ("other_host", "IP address mismatch, certificate is not valid for '127.0.0.1'."),
    ],
)
def test_an_instance_whose_certificate_does_not_verify_is_refused_by_name(
    fakes, certs, pair, reason
):
    prefill = fakes("p", role="prefill", tls=listener(certs.server))
    decode = fakes("d", tls=listener(getattr(certs, pair)))
    with (
        pytest.raises(PoolRefused) as refused,
        routed([prefill], [decode], instance_ca_certs=certs.ca, start_timeout_s=30.0),
    ):
        pass
    assert str(refused.value) == (
        f"{decode.url}: its TLS certificate does not verify: {reason} (the router verifies "
        "instances against --instance-ca-certs, else the system's trust store)"
    )
    assert decode.calls == []  # refused in the handshake: no HTTP request was made


def test_without_a_ca_the_system_trust_store_refuses_a_private_cas_instance(fakes, certs):
    prefill = fakes("p", role="prefill", tls=listener(certs.server))
    decode = fakes("d", tls=listener(certs.server))
    with pytest.raises(PoolRefused) as refused, routed([prefill], [decode]):
        pass
    assert "its TLS certificate does not verify" in str(refused.value)


def test_the_router_presents_its_client_certificate_to_instances_that_ask(fakes, certs):
    tls = listener(certs.server, ca_certs=certs.ca)  # clients must show a certificate
    prefill, decode = fakes("p", role="prefill", tls=tls), fakes("d", tls=tls)
    client = {"instance_certfile": certs.client.certfile,
              "instance_keyfile": certs.client.keyfile}  # fmt: skip
    with routed([prefill], [decode], instance_ca_certs=certs.ca, **client) as rig:
        answer = rig.post("/v1/completions", REQUEST)
        assert answer.status_code == 200, answer.text
    anonymous = httpx.Client(verify=certs.client_context(), trust_env=False)
    with anonymous, pytest.raises(httpx.TransportError):  # without one the handshake fails
        anonymous.get(f"{decode.url}/health")
    with httpx.Client(verify=certs.client_context(present=True), trust_env=False) as known:
        assert known.get(f"{decode.url}/health").status_code == 200


def test_an_instance_that_asks_for_a_client_certificate_the_router_lacks_is_refused_at_once(
    fakes, certs
):
    tls = listener(certs.server, ca_certs=certs.ca)  # clients must show a certificate
    prefill, decode = fakes("p", role="prefill", tls=tls), fakes("d", tls=tls)
    with (
        pytest.raises(PoolRefused) as refused,
        routed([prefill], [decode], instance_ca_certs=certs.ca, start_timeout_s=30.0),
    ):
        pass
    # Under TLS 1.3 the refusal comes after the handshake: named, not a start timeout.
    assert str(refused.value).endswith(
        "the instance closes the TLS connection before answering: it asks for a client "
        "certificate the router does not present, or does not take the one it does "
        "(--instance-ssl-certfile and --instance-ssl-keyfile)"
    ), refused.value


def test_ringfence_router_serves_https_with_its_certificate(fakes, certs):
    tls = listener(certs.server)
    prefill, decode = fakes("p", role="prefill", tls=tls), fakes("d", tls=tls)
    with router_process(
        "--prefill", prefill.url, "--decode", decode.url, "--instance-ca-certs", certs.ca,
        "--ssl-certfile", certs.server.certfile, "--ssl-keyfile", certs.server.keyfile,
    ) as (url, proc):  # fmt: skip
        assert url.startswith("https://")
        verified = openai.DefaultHttpxClient(
            verify=certs.client_context(), trust_env=False, timeout=10
        )
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=verified
        )
        completion = client.completions.create(model="fake", prompt="hi", max_tokens=2)
        assert completion.choices[0].text == "tok0 tok1 "
        plain = url.replace("https://", "http://")
        with pytest.raises(httpx.TransportError):  # plain HTTP to the TLS port: no answer
            httpx.get(f"{plain}/health", timeout=10, trust_env=False)
        proc.terminate()
        _, err = proc.communicate(timeout=ROUTER_START_S)
        assert proc.returncode == 0, err
        assert '"event":"router.started"' in err and '"tls":true' in err


def test_ringfence_router_exits_2_naming_an_instance_whose_certificate_does_not_verify(
    fakes, certs
):
    prefill = fakes("p", role="prefill", tls=listener(certs.server))
    decode = fakes("d", tls=listener(certs.other_ca))
    done = router_refusal(
        "--prefill", prefill.url, "--decode", decode.url, "--instance-ca-certs", certs.ca
    )
    assert done.stderr.startswith(
        f"ringfence router: {decode.url}: its TLS certificate does not verify: unable to get "
        "local issuer certificate"
    )


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--ssl-keyfile", "{key}"], "--ssl-keyfile is given but --ssl-certfile is not"),
        (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{missing}"],
         "--ssl-keyfile {missing}: No such file or directory"),
        (["--instance-ca-certs", "{key}"], "--instance-ca-certs {key}: no PEM CA certificate"),
        (["--instance-ssl-certfile", "{cert}"],
         "--instance-ssl-certfile is given but --instance-ssl-keyfile is not"),
    ],
)  # fmt: skip
def test_ringfence_router_with_a_tls_file_missing_or_wrong_exits_2_naming_it(
    certs, tmp_path, flags, error
):
    names = {"key": certs.server.keyfile, "cert": certs.server.certfile,
             "missing": str(tmp_path / "none.key")}  # fmt: skip
    done = router_refusal(
        "--instance", "http://127.0.0.1:1", *(f.format(**names) for f in flags), started=False
    )
    assert done.stderr.splitlines()[-1].startswith(f"ringfence router: {error.format(**names)}")


def test_the_files_are_checked_and_named_as_the_user_gave_them(certs, tmp_path):
    with pytest.raises(ValueError, match=r"^server.ssl_certfile is given but server.ssl_keyfile"):
        ListenerTls.of("", certs.server.certfile, "", SERVE_NAMES)
    with pytest.raises(ValueError, match=r"^--ssl-ca-certs asks clients for certificates"):
        ListenerTls.of("", "", certs.ca, ROUTER_NAMES)
    wrong_key = certs.client.keyfile  # another certificate's key
    with pytest.raises(ValueError) as mismatch:
        ListenerTls.of(wrong_key, certs.server.certfile, "", SERVE_NAMES)
    assert str(mismatch.value) == (
        f"server.ssl_keyfile {wrong_key}: not the unencrypted PEM private key of "
        f"server.ssl_certfile {certs.server.certfile} (KEY_VALUES_MISMATCH)"
    )
    with pytest.raises(ValueError, match=r"^server\.ssl_certfile .*: not a PEM certificate"):
        ListenerTls.of(certs.server.keyfile, certs.server.keyfile, "", SERVE_NAMES)
    assert ListenerTls.of("", "", "", SERVE_NAMES) is None
    tls = ListenerTls.of(certs.server.keyfile, certs.server.certfile, certs.ca, SERVE_NAMES)
    assert tls is not None and tls.client_certificates
