"""``ringfence serve``: an instance with the OpenAI-compatible HTTP front end.

It is ``ringfence launch`` on the serving topology (:mod:`.topology`) with ``--host`` and
``--port`` as ``server.host`` and ``server.port``. The front end prints the address it
listens on, then ``ringfence serve: ready`` once every actor is live; Ctrl-C (or SIGTERM)
stops the instance in order and removes every shared-memory name.
"""

from __future__ import annotations

import argparse

from ringfence.runtime.cli import add_run_arguments, supervise

TOPOLOGY_PATH = "ringfence.actors.serve.topology:TOPOLOGY"

DESCRIPTION = (
    "Serve the OpenAI API over HTTP: POST /v1/completions and /v1/chat/completions "
    "(streaming with stream=true), GET /v1/models, /health and /metrics (Prometheus). "
    "It starts an instance (engine, worker, transfer lanes) and an HTTP front end, and runs "
    "until Ctrl-C. Exit status: 0 when stopped normally, 2 for a bad config or command line, "
    "1 when an actor failed."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser)
    parser.add_argument("--host", help="the address to listen on (server.host, 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, help="the TCP port to listen on (server.port, 8000; 0: any free)"
    )


def main(args: argparse.Namespace) -> int:
    from ringfence.runtime.config import load_config

    overrides = [f"runtime.topology={TOPOLOGY_PATH}", *args.overrides]
    if args.host is not None:
        overrides.append(f"server.host={args.host}")
    if args.port is not None:
        overrides.append(f"server.port={args.port}")
    # A server stopped by Ctrl-C or its orchestrator's SIGTERM did its job: exit 0.
    config = load_config(args.config, overrides)
    from ringfence.actors.serve.auth import server_keys
    from ringfence.actors.serve.config import ServerConfig

    server = config.section("server")
    assert isinstance(server, ServerConfig)
    server_keys(server)  # a bad key file, salting by key without keys: exit 2, before a run
    return supervise("serve", config, args.run_dir, signal_is_success=True)
