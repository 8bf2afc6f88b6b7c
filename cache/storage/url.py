"""A redis server's URL without its password: the password travels as a secret, the URL
is printed whole.

``cache.storage.url`` takes what redis-py takes: ``redis://`` or ``rediss://`` (TLS),
``[user[:password]@]host[:port][/db]``, or ``unix://``, and options in its query string
(``?password=...`` among them). A password written in the URL, before its host or in its
query, is taken out of it when the settings are built (:func:`split_password`) and into
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
    redis-py will say so) is returned as it is. A password before the host wins over one in
    the query, as in redis-py; either way neither stays."""
    return _rewritten(url, None)


def password_of(inline: str, environ: Mapping[str, str] | None = None) -> str:
    """The server's password: ``inline`` (``cache.storage.password`` where the caller was
    handed it in process), else :data:`PASSWORD_ENV`'s ("" for none)."""
    return inline or (os.environ if environ is None else environ).get(PASSWORD_ENV, "")


def redact(url: str) -> str:
    """``url`` with its password, if it holds one (before its host or in its query),
    written as ``***``."""
    return _rewritten(url, HIDDEN).url


def _rewritten(url: str, shown: str | None) -> SplitUrl:
    """``url`` with every password in it dropped (``shown`` None) or written as ``shown``,
    and the password redis-py would take from it ("" for none)."""
    parts = _parts(url)
    if parts is None:
        return SplitUrl(url, "")
    query, in_query = _query_password(parts.query, shown)
    if parts.password is None and in_query is None:
        return SplitUrl(url, "")
    netloc = parts.netloc if parts.password is None else _netloc(parts, shown)
    password = in_query if parts.password is None else unquote(parts.password)
    return SplitUrl(_join(parts, netloc, query), password or "")


def _join(parts: SplitResult, netloc: str, query: str) -> str:
    """The URL of ``parts`` with ``netloc`` and ``query``; ``unix:///path`` keeps its
    empty host (urlunsplit would write ``unix:/path``)."""
    url = (
        f"{parts.scheme}://{netloc}{parts.path}"
        if parts.scheme
        else urlunsplit(parts._replace(netloc=netloc, query="", fragment=""))
    )
    return url + (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")


def _query_password(query: str, shown: str | None) -> tuple[str, str | None]:
    """``query`` with each ``password=`` option dropped (``shown`` None) or its value written
    as ``shown``, the other options as written; and the first password (None: none), as
    redis-py reads it."""
    kept: list[str] = []
    found: str | None = None
    for option in query.split("&") if query else ():
        name, _, value = option.partition("=")
        if unquote(name) != "password":
            kept.append(option)
            continue
        found = unquote(value) if found is None else found
        if shown is not None:
            kept.append(f"{name}={shown}")
    return "&".join(kept), found


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
