"""What ``ringfence bench serve --security`` measures: the serve side again with an API key
(``keys``), and with a key over HTTPS (``keys+tls``), each on a fresh server, against the
plain serve side of the same (workload, rate).

The key is made for the run (never written anywhere: the server gets it as
``RINGFENCE_API_KEY``, the load sends it as a bearer token). TLS takes the user's files:
the server's certificate for 127.0.0.1 and its key (``--ssl-certfile``, ``--ssl-keyfile``),
and the CA the load verifies it against (``--ssl-ca-certs``): the load verifies, as a real
client does, so the handshake's whole cost is in the figures. Each request of the load
opens its own connection (the load client keeps one a request in flight), so TTFT counts
a TLS handshake for most of them.
"""

from __future__ import annotations

import argparse
import secrets
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ringfence.actors.http.env import API_KEY_ENV

MODES = ("keys", "keys+tls")


@dataclass(frozen=True, slots=True, kw_only=True)
class Security:
    """One mode's server settings and client credentials."""

    mode: str  # one of MODES
    key: str = field(repr=False)
    certfile: str = ""  # keys+tls: the server's certificate, its key, the client's CA
    keyfile: str = ""
    ca_certs: str = ""

    @property
    def tls(self) -> bool:
        return self.mode == "keys+tls"

    def settings(self) -> list[str]:
        """The server's ``--set`` overrides (after the run's own)."""
        if not self.tls:
            return []
        return [f"server.ssl_certfile={self.certfile}", f"server.ssl_keyfile={self.keyfile}"]

    def env(self) -> dict[str, str]:
        """The server's environment: the key."""
        return {API_KEY_ENV: self.key}

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def verify(self) -> ssl.SSLContext | bool:
        """What the load verifies the server's certificate with."""
        return ssl.create_default_context(cafile=self.ca_certs) if self.tls else True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--security",
        default="",
        help=f"also run the serve side with each of these, comma-separated ({', '.join(MODES)}), "
        "each on a fresh server: what an API key and TLS cost, against the plain serve side",
    )
    parser.add_argument(
        "--ssl-certfile", metavar="FILE", help="keys+tls: the server's certificate for 127.0.0.1"
    )
    parser.add_argument("--ssl-keyfile", metavar="FILE", help="keys+tls: its private key")
    parser.add_argument(
        "--ssl-ca-certs", metavar="FILE", help="keys+tls: the CA the load verifies it against"
    )


def modes(args: argparse.Namespace) -> list[Security]:
    """The modes asked for; ValueError naming the option that is wrong."""
    asked = [m.strip() for m in args.security.split(",") if m.strip()]
    unknown = [m for m in asked if m not in MODES]
    if unknown:
        raise ValueError(f"--security: unknown {unknown}; known: {', '.join(MODES)}")
    if len(set(asked)) != len(asked):
        raise ValueError("--security: a mode given twice")
    files = (args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)
    if "keys+tls" in asked and not all(files):
        raise ValueError("--security keys+tls needs --ssl-certfile, --ssl-keyfile, --ssl-ca-certs")
    key = f"sk-bench-{secrets.token_urlsafe(24)}"
    certfile, keyfile, ca_certs = (f or "" for f in files)
    made = dict(key=key, certfile=certfile, keyfile=keyfile, ca_certs=ca_certs)
    return [Security(mode=m, **made) for m in asked]


def compare(plain: Mapping[str, Any], secured: Mapping[str, Any]) -> dict[str, float | None]:
    """``secured``'s TTFT p50 and p90 and output-token throughput over ``plain``'s."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return {
        "ttft_p50": ratio(secured["ttft_s"]["p50"], plain["ttft_s"]["p50"]),
        "ttft_p90": ratio(secured["ttft_p90_s"], plain["ttft_p90_s"]),
        "output_tokens_per_s": ratio(
            secured["throughput"]["output_tokens_per_s"], plain["throughput"]["output_tokens_per_s"]
        ),
    }


def table_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The report's lines for the security sides (none without them)."""
    if not any(r.get("security") for r in rows):
        return []
    lines = [
        f"{'workload':<8}{'rate':>5}  {'side':<9}{'done':>7}{'TTFT p50/90 ms':>16}{'tok/s':>9}"
        f"{'TTFT p50 x':>12}{'TTFT p90 x':>12}{'tok/s x':>9}   (x: against plain serve)"
    ]
    for r in rows:
        sides: list[tuple[str, Mapping[str, Any], Mapping[str, Any] | None]]
        sides = [("plain", r["serve"], None)]
        sides += [(m, s["figures"], s["ratios"]) for m, s in r.get("security", {}).items()]
        for mode, f, x in sides:
            done = f"{f['requests']['finished']}/{f['requests']['total']}"
            ttft = f"{_ms(f['ttft_s']['p50'])}/{_ms(f['ttft_p90_s'])}"
            tokens = _num(f["throughput"]["output_tokens_per_s"], ".1f")
            line = f"{r['workload']:<8}{r['rate']:>5}  {mode:<9}{done:>7}{ttft:>16}{tokens:>9}"
            if x is not None:
                line += f"{_x(x['ttft_p50']):>12}{_x(x['ttft_p90']):>12}"
                line += f"{_x(x['output_tokens_per_s']):>9}"
            lines.append(line)
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
