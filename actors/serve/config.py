"""The ``[server]`` section: where ``ringfence serve`` listens and how much it queues; and
:class:`FrontEndSettings`, every section its front end reads."""

from __future__ import annotations

import dataclasses

from ringfence.actors.engine.config import EngineConfig
from ringfence.actors.http.env import API_KEY_ENV
from ringfence.actors.model.config import ModelConfig, ParallelConfig
from ringfence.cache.config import CacheConfig
from ringfence.runtime.config import setting
from ringfence.runtime.secrets import secret
from ringfence.sched.config import SchedConfig


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """[server]: the HTTP front end of ``ringfence serve`` (read by its ``frontend`` actor)."""

    host: str = setting("127.0.0.1", "address the HTTP server listens on")
    port: int = setting(8000, "TCP port the HTTP server listens on; 0 = any free port", ge=0)
    max_pending: int = setting(
        256,
        "requests the front end has in the engine at once; more are answered 429",
        ge=1,
    )
    retry_after_s: int = setting(1, "the Retry-After a 429 answer carries, in seconds", ge=1)
    model_name: str = setting(
        "", "the model's name in the API; empty = the checkpoint folder's name or the preset's"
    )
    request_timeout_s: float = setting(
        600.0, "a request with no output for this long ends with an error", gt=0
    )
    api_key: str = secret(
        "API keys every route but /health and /metrics asks for (comma-separated); a secret: "
        f"never written to the run dir, handed to the front end as {API_KEY_ENV}",
        env=API_KEY_ENV,
    )
    api_key_file: str = setting(
        "", "a file of more API keys, one a line ('#' starts a comment); empty = none"
    )
    protect_metrics: bool = setting(False, "GET /metrics asks for an API key too")
    salt_by_key: bool = setting(
        False,
        "every request is cache-salted by its API key's tenant: tenants share no cached prefix",
    )
    max_body_bytes: int = setting(
        32 << 20, "the largest request body taken; a larger one is answered 413", ge=1024
    )
    header_timeout_s: float = setting(
        10.0, "a connection whose request head is not whole this long is closed", gt=0, le=3600
    )
    body_timeout_s: float = setting(
        60.0, "a request body not whole this long after its head is answered 408", gt=0, le=3600
    )
    max_requests_per_key: int = setting(
        0, "requests one API key may have running at once; more are answered 429; 0 = any", ge=0
    )
    ssl_keyfile: str = setting(
        "", "the TLS certificate's private key (PEM, unencrypted); with ssl_certfile: HTTPS"
    )
    ssl_certfile: str = setting("", "the TLS certificate (PEM, with its chain); empty = HTTP")
    ssl_ca_certs: str = setting(
        "", "every client must present a certificate this CA file (PEM) issued; empty = none"
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FrontEndSettings:
    """What the front end receives of the run's config (its ``config_section``): each field
    the section of the same name, filled by the runtime when it starts."""

    model: ModelConfig  # the tokenizer, the chat template, the name and identity it reports
    cache: CacheConfig  # the block size the router's instance card reports
    sched: SchedConfig  # max_model_len: the longest request it lets through
    engine: EngineConfig  # the role (which routes of the router's API answer)
    parallel: ParallelConfig  # the ranks: one fingerprint each
    server: ServerConfig  # where it listens, how much it queues, its timeouts
