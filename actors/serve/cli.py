"""``ringfence serve``: an instance with the OpenAI-compatible HTTP front end.

It is ``ringfence launch`` on the serving topology (:mod:`.topology`) with ``--host`` and
``--port`` as ``server.host`` and ``server.port``, and vLLM's ``--ssl-keyfile``,
``--ssl-certfile`` and ``--ssl-ca-certs`` as ``server.ssl_*`` (HTTPS, :mod:`.tls`). The
front end prints the address it listens on, then ``ringfence serve: ready`` once every
actor is live; Ctrl-C (or SIGTERM) stops the instance in order and removes every
shared-memory name.
"""

from __future__ import annotations

import argparse
import json

from ringfence.runtime.cli import add_run_arguments, supervise

TOPOLOGY_PATH = "ringfence.actors.serve.topology:TOPOLOGY"

DESCRIPTION = (
    "Serve the OpenAI API over HTTP (HTTPS with --ssl-certfile and --ssl-keyfile): POST "
    "/v1/completions and /v1/chat/completions (streaming with stream=true), GET /v1/models, "
    "/health and /metrics (Prometheus). "
    "It starts an instance (engine, worker, transfer lanes) and an HTTP front end, and runs "
    "until Ctrl-C. Exit status: 0 when stopped normally, 2 for a bad config or command line, "
    "1 when an actor failed."
)


# vLLM's flags, each one setting of [server]; the key and the certificate make it HTTPS.
TLS_FLAGS = {
    "ssl-keyfile": ("server.ssl_keyfile", "the TLS certificate's private key (PEM)"),
    "ssl-certfile": ("server.ssl_certfile", "the TLS certificate (PEM): serve HTTPS"),
    "ssl-ca-certs": (
        "server.ssl_ca_certs",
        "a CA file (PEM): every client must present a certificate it issued",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser)
    parser.add_argument("--host", help="the address to listen on (server.host, 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, help="the TCP port to listen on (server.port, 8000; 0: any free)"
    )
    for flag, (setting, what) in TLS_FLAGS.items():
        parser.add_argument(f"--{flag}", metavar="FILE", help=f"{what} ({setting})")


def main(args: argparse.Namespace) -> int:
    from ringfence.runtime.config import load_config

    overrides = [f"runtime.topology={TOPOLOGY_PATH}", *args.overrides]
    if args.host is not None:
        overrides.append(f"server.host={args.host}")
    if args.port is not None:
        overrides.append(f"server.port={args.port}")
    for flag, (setting, _) in TLS_FLAGS.items():
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:  # quoted: a path is a string, whatever it looks like
            overrides.append(f"{setting}={json.dumps(value)}")
    # A server stopped by Ctrl-C or its orchestrator's SIGTERM did its job: exit 0.
    config = load_config(args.config, overrides)
    from ringfence.actors.http.auth import server_keys
    from ringfence.actors.http.tls import serve_tls
    from ringfence.actors.serve.config import ServerConfig

    server = config.section("server")
    assert isinstance(server, ServerConfig)
    # A bad key file or certificate, salting by key without keys: exit 2, before a run exists.
    server_keys(server)
    serve_tls(server)
    return supervise("serve", config, args.run_dir, signal_is_success=True)
