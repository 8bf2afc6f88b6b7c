"""A redis server's URL without its password: the password travels as a secret, the URL
is printed whole.

``cache.storage.url`` takes what redis-py takes: ``redis://`` or ``rediss://`` (TLS),
``[user[:password]@]host[:port][/db]``, or ``unix://``. A password written in the URL is
taken out of it when the settings are built (:func:`split_password`) and into
``cache.storage.password``, a secret, so the run dir's config.toml, the logs and every
message hold ``redis://user@host:port/db``; a URL that must be shown while it still holds
one is shown as :func:`redact` writes it, ``redis://user:***@host:port/db``. An actor
reads the password from :data:`PASSWORD_ENV` (:func:`password_of`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final, NamedTuple
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

HIDDEN: Final = "***"
PASSWORD_ENV: Final = "RINGFENCE_STORAGE_PASSWORD"  # how cache.storage.password reaches actors


class SplitUrl(NamedTuple):
    url: str  # the URL with no password in it (a user stays)
    password: str  # the password it held, percent-decoded ("" for none)


def split_password(url: str) -> SplitUrl:
    """``url`` without its password, and the password; a URL with none (or that is no URL:
    redis-py will say so) is returned as it is."""
    parts = _parts(url)
    if parts is None or parts.password is None:
        return SplitUrl(url, "")
    bare = urlunsplit(parts._replace(netloc=_netloc(parts, None)))
    return SplitUrl(bare, unquote(parts.password))


def password_of(inline: str, environ: Mapping[str, str] | None = None) -> str:
    """The server's password: ``inline`` (``cache.storage.password`` where the caller was
    handed it in process), else :data:`PASSWORD_ENV`'s ("" for none)."""
    return inline or (os.environ if environ is None else environ).get(PASSWORD_ENV, "")


def redact(url: str) -> str:
    """``url`` with its password, if it holds one, written as ``***``."""
    parts = _parts(url)
    if parts is None or parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=_netloc(parts, HIDDEN)))


def _parts(url: str) -> SplitResult | None:
    try:
        return urlsplit(url)
    except ValueError:  # such as an unclosed "[" of an IPv6 address
        return None


def _netloc(parts: SplitResult, password: str | None) -> str:
    """The URL's ``user[:password]@host:port`` with ``password`` (None: no password)."""
    user = parts.username or ""
    hostport = parts.netloc.rpartition("@")[2]
    credentials = user if password is None else f"{user}:{password}"
    return f"{credentials}@{hostport}" if credentials else hostport
