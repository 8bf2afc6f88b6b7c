"""TLS certificates made for a test (``trustme``): a CA, a server certificate it issued for
127.0.0.1, a client certificate it issued, and the two a verifying client must refuse (one
from another CA, one for another host name), as PEM files in a folder."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass(frozen=True)
class Pair:
    """A certificate (with its chain) and its private key, as files."""

    certfile: str
    keyfile: str


@dataclass(frozen=True)
class Certificates:
    """The files of :func:`make_certificates`."""

    ca: str  # the CA every certificate below but ``other_ca`` chains to
    server: Pair  # for 127.0.0.1 and localhost
    client: Pair  # a client's (router's) certificate
    other_ca: Pair  # for 127.0.0.1, issued by another CA
    other_host: Pair  # issued by ``ca``, for example.org only

    def client_context(self, *, present: bool = False) -> ssl.SSLContext:
        """A client's context trusting ``ca`` alone (presenting ``client`` if ``present``)."""
        context = ssl.create_default_context(cafile=self.ca)
        if present:
            context.load_cert_chain(self.client.certfile, self.client.keyfile)
        return context


def make_certificates(folder: Path) -> Certificates:
    ca, other = trustme.CA(), trustme.CA()
    folder.mkdir(parents=True, exist_ok=True)
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))

    def pair(name: str, issuer: trustme.CA, *hosts: str) -> Pair:
        cert = issuer.issue_cert(*hosts)
        certfile, keyfile = folder / f"{name}.crt", folder / f"{name}.key"
        for blob in cert.cert_chain_pems:
            blob.write_to_path(str(certfile), append=True)
        cert.private_key_pem.write_to_path(str(keyfile))
        return Pair(str(certfile), str(keyfile))

    return Certificates(
        ca=str(folder / "ca.pem"),
        server=pair("server", ca, "127.0.0.1", "localhost"),
        client=pair("client", ca, "router.example"),
        other_ca=pair("other-ca", other, "127.0.0.1"),
        other_host=pair("other-host", ca, "example.org"),
    )
