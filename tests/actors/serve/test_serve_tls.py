"""``ringfence serve`` over TLS: with server.ssl_certfile and server.ssl_keyfile it answers
HTTPS a client verifies against the test's CA, and nothing over plain HTTP; with
server.ssl_ca_certs every client must present a certificate that CA issued. A key without
its certificate, or a file that cannot be read, stops the command before a run exists."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from certificates import Certificates, make_certificates
from launching import ringfence
from serving import Server, served

MODEL = "ringfence-tiny"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("serve-tls-certs"))


@pytest.fixture(scope="module")
def mutual(tmp_path_factory, certs) -> Iterator[Server]:
    """One server asking every client for a certificate the test's CA issued."""
    tmp = tmp_path_factory.mktemp("serve-tls")
    sets = (
        "model.preset=tiny",
        f"server.ssl_certfile={certs.server.certfile}",
        f"server.ssl_keyfile={certs.server.keyfile}",
        f"server.ssl_ca_certs={certs.ca}",
    )
    with served(tmp, *sets) as server:
        yield server


def test_serve_answers_https_to_a_client_with_a_certificate_of_its_ca(mutual, certs):
    assert mutual.url.startswith("https://127.0.0.1:")
    verified = openai.DefaultHttpxClient(verify=certs.client_context(present=True), timeout=60)
    client = openai.OpenAI(
        base_url=f"{mutual.url}/v1", api_key="unused", max_retries=0, http_client=verified
    )
    completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert completion.usage is not None and completion.usage.completion_tokens == 2
    [listening] = mutual.frontend_events("server.listening")
    assert (listening["tls"], listening["client_certificates"]) == (True, True)


def test_a_client_without_a_certificate_of_the_ca_is_refused_in_the_handshake(mutual, certs):
    stranger = certs.client_context()
    stranger.load_cert_chain(certs.other_ca.certfile, certs.other_ca.keyfile)
    for context in (certs.client_context(), stranger):
        client = httpx.Client(verify=context, timeout=60)
        with client, pytest.raises(httpx.TransportError):
            client.get(f"{mutual.url}/health")


def test_plain_http_to_the_tls_port_gets_no_answer(mutual):
    plain = mutual.url.replace("https://", "http://")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{plain}/health", timeout=60)


def test_a_key_without_its_certificate_stops_serve_before_a_run_exists(tmp_path, certs):
    done = ringfence(
        "serve", "--port", "0", "--run-dir", tmp_path / "run", "--set", "model.preset=tiny",
        "--ssl-keyfile", certs.server.keyfile,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert (
        "server.ssl_keyfile is given but server.ssl_certfile is not: TLS needs both" in done.stderr
    )
    assert not (tmp_path / "run").exists()


def test_a_certificate_that_cannot_be_read_stops_serve_naming_it(tmp_path, certs):
    missing = tmp_path / "server.crt"
    done = ringfence(
        "serve", "--port", "0", "--run-dir", tmp_path / "run", "--set", "model.preset=tiny",
        "--ssl-certfile", missing, "--ssl-keyfile", certs.server.keyfile,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"server.ssl_certfile {missing}: No such file or directory" in done.stderr
    assert not (tmp_path / "run").exists()
