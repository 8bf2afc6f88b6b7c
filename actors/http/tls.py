"""TLS for ``ringfence serve`` and ``ringfence router``: their listeners' certificates, and
the router's trust in its instances'.

A listener speaks TLS when given a certificate and its private key (PEM files, the
certificate file may hold the chain); given a CA file as well, every client must present a
certificate that CA issued (``ssl.CERT_REQUIRED``: mutual TLS), and one that does not is
refused in the handshake, before any HTTP. The files are read and checked once at start
(:meth:`ListenerTls.context`): a missing, unreadable or wrong file stops the command naming
it and the setting that gave it, before a run exists.

The router's client side (:func:`instance_context`) always verifies: an instance's
certificate must chain to the CA file it was given (else the system's trust store) and
name the host of the instance's URL. There is no way to turn the check off.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol


class TlsNames(NamedTuple):
    """What the user calls each file, for the errors that name them."""

    keyfile: str
    certfile: str
    ca_certs: str


SERVE_NAMES = TlsNames("server.ssl_keyfile", "server.ssl_certfile", "server.ssl_ca_certs")
ROUTER_NAMES = TlsNames("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs")
INSTANCE_NAMES = TlsNames(
    "--instance-ssl-keyfile", "--instance-ssl-certfile", "--instance-ca-certs"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ListenerTls:
    """A listener's TLS files (paths as given; relative ones to the working directory)."""

    certfile: str  # its certificate (and chain), PEM
    keyfile: str  # the certificate's private key, PEM, not encrypted
    ca_certs: str = ""  # clients must present a certificate this CA issued ("": none asked)
    names: TlsNames = SERVE_NAMES

    @classmethod
    def of(cls, keyfile: str, certfile: str, ca_certs: str, names: TlsNames) -> ListenerTls | None:
        """The checked files (None: plain HTTP); ValueError naming the setting and the file
        that is missing, unreadable or not what it should be (:meth:`context`)."""
        if not keyfile and not certfile:
            if ca_certs:
                raise ValueError(
                    f"{names.ca_certs} asks clients for certificates, which needs TLS: "
                    f"give {names.certfile} and {names.keyfile} too"
                )
            return None
        if not keyfile or not certfile:
            given, missing = (
                (names.keyfile, names.certfile) if keyfile else (names.certfile, names.keyfile)
            )
            raise ValueError(f"{given} is given but {missing} is not: TLS needs both")
        tls = cls(certfile=certfile, keyfile=keyfile, ca_certs=ca_certs, names=names)
        tls.context()
        return tls

    @property
    def client_certificates(self) -> bool:
        """Whether every client must present a certificate."""
        return bool(self.ca_certs)

    def context(self) -> ssl.SSLContext:
        """The server side's context (TLS 1.2 or later); ValueError naming the file."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        load_chain(context, self.certfile, self.keyfile, self.names)
        if self.ca_certs:
            load_ca(context, self.ca_certs, self.names.ca_certs)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def uvicorn_options(self) -> dict[str, Any]:
        """uvicorn.Config's arguments for these files (it builds :meth:`context`'s twin)."""
        return {
            "ssl_certfile": self.certfile,
            "ssl_keyfile": self.keyfile,
            "ssl_ca_certs": self.ca_certs or None,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if self.ca_certs else ssl.CERT_NONE,
        }


class TlsSettings(Protocol):
    """What :func:`serve_tls` reads of a server's settings (``serve``'s ``[server]``)."""

    @property
    def ssl_keyfile(self) -> str: ...
    @property
    def ssl_certfile(self) -> str: ...
    @property
    def ssl_ca_certs(self) -> str: ...


def serve_tls(server: TlsSettings) -> ListenerTls | None:
    """``ringfence serve``'s TLS files, checked (None: plain HTTP); ValueError naming them."""
    return ListenerTls.of(server.ssl_keyfile, server.ssl_certfile, server.ssl_ca_certs, SERVE_NAMES)


def scheme(tls: ListenerTls | None) -> str:
    return "http" if tls is None else "https"


def instance_context(ca_certs: str = "", certfile: str = "", keyfile: str = "") -> ssl.SSLContext:
    """The router's context for https instance URLs: certificates verified against
    ``ca_certs`` ("": the system's trust store), host names checked; with ``certfile`` and
    ``keyfile``, the client certificate presented to instances that ask for one.
    ValueError naming the option and the file that is wrong."""
    names = INSTANCE_NAMES
    if bool(certfile) != bool(keyfile):
        given, missing = (
            (names.certfile, names.keyfile) if certfile else (names.keyfile, names.certfile)
        )
        raise ValueError(f"{given} is given but {missing} is not: a client certificate needs both")
    if ca_certs:
        # Only this CA, not the system's store besides: the instances are the user's own.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies, checks host names
        load_ca(context, ca_certs, names.ca_certs)
    else:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if certfile:
        load_chain(context, certfile, keyfile, names)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    return context


def load_chain(context: ssl.SSLContext, certfile: str, keyfile: str, names: TlsNames) -> None:
    """``context.load_cert_chain``, its failures as ValueError naming the file at fault."""
    _readable(certfile, names.certfile)
    _readable(keyfile, names.keyfile)
    try:  # the certificate file alone first: a failure then is the certificate's
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=certfile)
    except ssl.SSLError as e:
        raise ValueError(
            f"{names.certfile} {certfile}: not a PEM certificate ({_reason(e)})"
        ) from None
    try:
        context.load_cert_chain(certfile, keyfile, password=_no_password)
    except (ssl.SSLError, _Encrypted) as e:
        why = "encrypted" if isinstance(e, _Encrypted) else _reason(e)
        raise ValueError(
            f"{names.keyfile} {keyfile}: not the unencrypted PEM private key of "
            f"{names.certfile} {certfile} ({why})"
        ) from None


def load_ca(context: ssl.SSLContext, ca_certs: str, name: str) -> None:
    """``context.load_verify_locations``, its failures as ValueError naming the file."""
    _readable(ca_certs, name)
    try:
        context.load_verify_locations(cafile=ca_certs)
    except ssl.SSLError as e:
        raise ValueError(f"{name} {ca_certs}: no PEM CA certificate in it ({_reason(e)})") from None


class _Encrypted(Exception):
    """The key file asked for a password (none is taken: the server has no one to ask)."""


def _no_password() -> str:
    raise _Encrypted


def _readable(path: str, name: str) -> None:
    try:
        with Path(path).open("rb") as f:
            f.read(1)
    except OSError as e:
        raise ValueError(f"{name} {path}: {e.strerror or e}") from None


def _reason(e: ssl.SSLError) -> str:
    return str(e.reason or e.strerror or e)
