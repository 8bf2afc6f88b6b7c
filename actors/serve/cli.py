"""``ringfence serve``: an instance with the OpenAI-compatible HTTP front end.

It is ``ringfence launch`` on the serving topology (:mod:`.topology`) with ``--host`` and
``--port`` as ``server.host`` and ``server.port``. The front end prints the address it
listens on, then ``ringfence serve: ready`` once every actor is live; Ctrl-C (or SIGTERM)
stops the instance in order and removes every shared-memory name.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

TOPOLOGY_PATH = "ringfence.actors.serve.topology:TOPOLOGY"
STOP_CODES = {128 + signal.SIGINT, 128 + signal.SIGTERM}  # the supervisor's exit on a signal

DESCRIPTION = (
    "Serve the OpenAI API over HTTP: POST /v1/completions and /v1/chat/completions "
    "(streaming with stream=true), GET /v1/models, /health and /metrics (Prometheus). "
    "It starts an instance (engine, worker, transfer lanes) and an HTTP front end, and runs "
    "until Ctrl-C. Exit status: 0 when stopped normally, 2 for a bad config or command line, "
    "1 when an actor failed."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE", help="a TOML config file")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help="override one config key, e.g. model.preset=small (repeatable)",
    )
    parser.add_argument(
        "--run-dir", type=Path, metavar="DIR", help="the run dir (default: runtime.run_dir/<id>)"
    )
    parser.add_argument("--host", help="the address to listen on (server.host, 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, help="the TCP port to listen on (server.port, 8000; 0: any free)"
    )


def main(args: argparse.Namespace) -> int:
    from ringfence.runtime.config import load_config
    from ringfence.runtime.supervisor import Supervisor

    overrides = [f"runtime.topology={TOPOLOGY_PATH}", *args.overrides]
    if args.host is not None:
        overrides.append(f"server.host={args.host}")
    if args.port is not None:
        overrides.append(f"server.port={args.port}")
    config = load_config(args.config, overrides)
    supervisor = Supervisor(config, args.run_dir)  # the preflight runs here
    print(f"ringfence serve: run {supervisor.run_id} in {supervisor.run_dir}", flush=True)
    code = supervisor.run()
    if code in STOP_CODES and not supervisor.failure:
        code = 0  # a server stopped by Ctrl-C or its orchestrator's SIGTERM did its job
    if supervisor.failure:
        sys.stdout.flush()
        head, *rest = supervisor.failure
        print("\n".join([f"ringfence serve: {head}", *rest]), file=sys.stderr, flush=True)
    print(
        f"ringfence serve: run {supervisor.run_id} ended ({supervisor.stop_reason}), "
        f"exit status {code}",
        flush=True,
    )
    return code
