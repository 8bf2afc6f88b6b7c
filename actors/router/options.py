"""What a router is told at start: its instances, its address and its deadlines."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from ringfence.actors.http.auth import Keys
from ringfence.actors.http.tls import ListenerTls, instance_context
from ringfence.actors.router.policy import DEFAULT_OVERLAP_WEIGHT, POLICIES

PREFILL_MARGIN_S = 2.0  # the default prefill deadline: the reservation's ttl_s less this
RETRY_CAP_S = 2.0  # the longest wait between two reserve rounds (Retry-After is capped here)
FIRST_BACKOFF_S = 0.05  # the first wait between two reserve rounds; it doubles each round
MAX_CLAIMS = 3  # claims of one request (each expired reservation costs one more)


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterOptions:
    """The command line of ``ringfence router``, checked (ValueError naming the option)."""

    prefill: tuple[str, ...] = ()  # base URLs of the prefill instances ("http://host:port")
    decode: tuple[str, ...] = ()  # base URLs of the decode instances (at least one with prefill)
    instances: tuple[str, ...] = ()  # aggregated instances (engine.role both): --instance
    policy: str = "cache"  # how an aggregated instance is picked (router/policy.py)
    # The cost function's weight of the prefill still needed (RESULTS.md: the sweep of
    # `bench route --overlap-weight` that chose it).
    overlap_weight: float = DEFAULT_OVERLAP_WEIGHT
    reserve_timeout_s: float = 30.0  # how long one request may wait for room on a decode
    prefill_timeout_s: float | None = None  # None: the reservation's ttl_s less a margin
    start_timeout_s: float = 120.0  # how long every instance has to answer at start
    retry_cap_s: float = RETRY_CAP_S
    max_claims: int = MAX_CLAIMS
    client_keys: Keys = field(default_factory=lambda: Keys(()))  # none: anyone may call
    protect_metrics: bool = False  # GET /metrics asks for a client key too
    salt_by_key: bool = False  # the client key's tenant salts every request (http/auth.py)
    instance_key: str = field(default="", repr=False)  # presented on every call to an instance
    max_body_bytes: int = 32 << 20  # a larger request body is answered 413 (as an instance's)
    header_timeout_s: float = 10.0  # a connection whose request head is not whole is closed
    body_timeout_s: float = 60.0  # a request body not whole this long after its head: 408
    max_requests_per_key: int = 0  # one client key's requests running at once; 0: any
    tls: ListenerTls | None = None  # the router's own listener: HTTPS (None: HTTP)
    # https instance URLs: their certificates verified against this CA file ("": the system's
    # trust store); the client certificate presented to instances that ask for one.
    instance_ca_certs: str = ""
    instance_certfile: str = ""
    instance_keyfile: str = ""

    def __post_init__(self) -> None:
        if self.instances and (self.prefill or self.decode):
            raise ValueError("--instance: either aggregated instances or --prefill/--decode")
        if not self.instances and not self.decode:
            raise ValueError("--decode: at least one decode instance is needed (or --instance)")
        if not self.instances and not self.prefill:
            raise ValueError("--prefill: at least one prefill instance is needed (or --instance)")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}: got {self.policy!r}")
        if not self.overlap_weight >= 0:
            raise ValueError("--overlap-weight: must be >= 0")
        urls = [*self.prefill, *self.decode, *self.instances]
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r}: an instance URL starts with http:// or https://")
        twice = sorted({u for u in urls if urls.count(u) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)}: each instance may be named once")
        if self.max_requests_per_key < 0:
            raise ValueError("--max-requests-per-key: must be >= 0")
        if self.max_requests_per_key and not self.client_keys:
            raise ValueError("--max-requests-per-key counts by client key, and no key is given")
        names = ("reserve_timeout_s", "start_timeout_s", "retry_cap_s", "header_timeout_s",
                 "body_timeout_s")  # fmt: skip
        for name in names:
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be > 0")
        if self.salt_by_key and not self.client_keys:
            raise ValueError(
                "--salt-by-key salts requests by their client key, and no key is given "
                "(--api-key-file, or RINGFENCE_API_KEY)"
            )
        if not self.max_body_bytes >= 1024:
            raise ValueError("--max-body-bytes: must be >= 1024")
        if self.prefill_timeout_s is not None and not self.prefill_timeout_s > 0:
            raise ValueError("--prefill-timeout-s: must be > 0")
        if self.instance_ca_certs or self.instance_certfile or self.instance_keyfile:
            self.instance_tls()  # a file that is missing or wrong, named now

    def instance_tls(self) -> ssl.SSLContext:
        """The context of the router's calls to https instance URLs (it always verifies)."""
        return instance_context(
            self.instance_ca_certs, self.instance_certfile, self.instance_keyfile
        )

    def prefill_deadline_s(self, ttl_s: float) -> float:
        """How long the prefill of a reservation that lives ``ttl_s`` seconds may take."""
        if self.prefill_timeout_s is not None:
            return self.prefill_timeout_s
        return max(ttl_s - min(PREFILL_MARGIN_S, ttl_s / 2), 0.1)
