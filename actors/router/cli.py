"""``ringfence router``: one OpenAI-compatible endpoint over aggregated instances (picked by
a policy, ``cache`` by default: where the prompt's prefix is cached, from their KV events),
or over prefill and decode instances.

It waits until every instance answers ``GET /ringfence/instance``, refuses instances that
cannot work together (exit 2), prints the address it listens on, then ``ringfence router:
ready``, and serves until Ctrl-C or SIGTERM (exit 0).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable

# router/policy.py's POLICIES and DEFAULT_OVERLAP_WEIGHT (kept here: --help imports no
# more than it needs; tests/actors/router/test_policy.py checks they agree).
POLICY_CHOICES = ("round_robin", "least_loaded", "approximate", "cache")
OVERLAP_WEIGHT = 4.0

DESCRIPTION = (
    "Serve the OpenAI API (POST /v1/completions and /v1/chat/completions, GET /v1/models, "
    "/health and /metrics) over instances of ringfence serve: aggregated ones (--instance, "
    "each request sent to one of them by --policy; cache: where most of its prompt is "
    "cached, as their KV events say, weighed against their load), or prefill and decode "
    "ones (engine.role=prefill or decode sharing one storage tier): each request is "
    "reserved on a decode instance, prefilled into the tier by a prefill instance, then "
    "decoded. Exit "
    "status: 0 when stopped by Ctrl-C or SIGTERM, 2 for a bad command line or instances "
    "that cannot work together (a wrong role, differing fingerprints, a key refused, a TLS "
    "certificate that does not verify), 1 when an instance "
    "did not answer in time."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--instance", action="append", default=[], metavar="URL",
        help="an aggregated instance (engine.role both), e.g. http://10.0.0.2:8000 (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--policy", default="cache", choices=POLICY_CHOICES,
        help="how --instance instances are picked (default cache; see actors/router/policy.py)",
    )  # fmt: skip
    parser.add_argument(
        "--overlap-weight", type=float, default=OVERLAP_WEIGHT, metavar="W",
        help="the cost function's weight of the prefill an instance would still need "
        f"(default {OVERLAP_WEIGHT:g})",
    )  # fmt: skip
    parser.add_argument(
        "--prefill", action="append", default=[], metavar="URL",
        help="a prefill instance, e.g. http://10.0.0.2:8000 (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--decode", action="append", default=[], metavar="URL",
        help="a decode instance (repeatable)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument(
        "--port", type=int, default=8000, help="the TCP port to listen on (0: any free one)"
    )
    parser.add_argument(
        "--reserve-timeout-s", type=float, default=30.0, metavar="S",
        help="how long a request may wait for room on a decode instance before a 503",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-timeout-s", type=float, default=None, metavar="S",
        help="the prefill deadline (default: the reservation's lifetime less a margin); past "
        "it the decode instance computes the prompt itself",
    )  # fmt: skip
    parser.add_argument(
        "--start-timeout-s", type=float, default=120.0, metavar="S",
        help="how long every instance has to answer at start",
    )  # fmt: skip
    parser.add_argument(
        "--api-key-file", metavar="FILE",
        help="a file of the API keys the router's clients must present (one a line), besides "
        "RINGFENCE_API_KEY's (comma-separated); with none, anyone may call",
    )  # fmt: skip
    parser.add_argument(
        "--instance-api-key-file", metavar="FILE",
        help="a file holding the key the router presents to its instances (their "
        "RINGFENCE_API_KEY), or set RINGFENCE_INSTANCE_API_KEY",
    )  # fmt: skip
    parser.add_argument(
        "--protect-metrics", action="store_true", help="GET /metrics asks for a client key too"
    )
    parser.add_argument(
        "--salt-by-key", action="store_true",
        help="cache-salt every request by its client key's tenant (the key file's name after "
        "the key, else the key's own): tenants share no cached prefix",
    )  # fmt: skip
    parser.add_argument(
        "--max-body-bytes", type=int, default=32 << 20, metavar="N",
        help="the largest request body taken (default 32 MiB); a larger one is answered 413",
    )  # fmt: skip
    parser.add_argument(
        "--header-timeout-s", type=float, default=10.0, metavar="S",
        help="a connection whose request head is not whole in S seconds is closed (default 10)",
    )  # fmt: skip
    parser.add_argument(
        "--body-timeout-s", type=float, default=60.0, metavar="S",
        help="a request body not whole S seconds after its head is answered 408 (default 60)",
    )  # fmt: skip
    parser.add_argument(
        "--max-requests-per-key", type=int, default=0, metavar="N",
        help="requests one client key may have running at once; more are answered 429 "
        "(default 0: any)",
    )  # fmt: skip
    tls = parser.add_argument_group("TLS (the router's own listener, as ringfence serve's)")
    tls.add_argument("--ssl-keyfile", metavar="FILE", help="the certificate's private key (PEM)")
    tls.add_argument(
        "--ssl-certfile", metavar="FILE", help="the TLS certificate (PEM): serve HTTPS"
    )
    tls.add_argument(
        "--ssl-ca-certs", metavar="FILE",
        help="a CA file (PEM): every client must present a certificate it issued",
    )  # fmt: skip
    tls = parser.add_argument_group("TLS to the instances (https:// instance URLs)")
    tls.add_argument(
        "--instance-ca-certs", metavar="FILE",
        help="the CA file (PEM) instances' certificates must chain to (default: the system's "
        "trust store); a certificate that does not verify fails the start",
    )  # fmt: skip
    tls.add_argument(
        "--instance-ssl-certfile", metavar="FILE",
        help="a client certificate (PEM) presented to instances that ask for one",
    )  # fmt: skip
    tls.add_argument(
        "--instance-ssl-keyfile", metavar="FILE", help="the client certificate's private key"
    )


def main(args: argparse.Namespace) -> int:
    from ringfence.actors.http import auth
    from ringfence.actors.http.tls import ROUTER_NAMES, ListenerTls
    from ringfence.actors.router.instances import StartTimeout
    from ringfence.actors.router.options import RouterOptions
    from ringfence.actors.router.server import listen, serve

    options = RouterOptions(
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        instances=tuple(args.instance),
        policy=args.policy,
        overlap_weight=args.overlap_weight,
        reserve_timeout_s=args.reserve_timeout_s,
        prefill_timeout_s=args.prefill_timeout_s,
        start_timeout_s=args.start_timeout_s,
        client_keys=auth.load_keys(key_file=args.api_key_file or ""),
        protect_metrics=args.protect_metrics,
        salt_by_key=args.salt_by_key,
        max_body_bytes=args.max_body_bytes,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        max_requests_per_key=args.max_requests_per_key,
        instance_key=auth.instance_key(args.instance_api_key_file or ""),
        tls=ListenerTls.of(
            args.ssl_keyfile or "", args.ssl_certfile or "", args.ssl_ca_certs or "", ROUTER_NAMES
        ),
        instance_ca_certs=args.instance_ca_certs or "",
        instance_certfile=args.instance_ssl_certfile or "",
        instance_keyfile=args.instance_ssl_keyfile or "",
    )  # ValueError: the command line's fault, named (exit 2)
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    if auth.exposed_without_key(args.host, options.client_keys):
        print(auth.exposed_warning("router", host, port), file=sys.stderr, flush=True)
    if auth.keys_in_clear(args.host, options.client_keys, options.tls is not None):
        flags = "--ssl-certfile and --ssl-keyfile"
        print(auth.clear_keys_warning("router", host, port, flags), file=sys.stderr, flush=True)
    # While it starts, SIGTERM stops it as Ctrl-C does (serving, uvicorn handles both).
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(serve(options, sock, out=sys.stdout))
        print("ringfence router: stopped", flush=True)
    except KeyboardInterrupt:
        print("ringfence router: stopped while starting", file=sys.stderr)
    except StartTimeout as e:
        print(
            f"ringfence router: {e} (--start-timeout-s {args.start_timeout_s:g})", file=sys.stderr
        )
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
    return 0


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (uvicorn's ``standard`` extra brings it), else
    None (asyncio's): the router's every request is a few wake-ups of its loop and a few
    socket writes, which uvloop's loop does in C."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
