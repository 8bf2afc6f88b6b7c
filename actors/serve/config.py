"""The ``[server]`` section: where ``ringfence serve`` listens and how much it queues."""

from __future__ import annotations

import dataclasses

from ringfence.runtime.config import setting


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
