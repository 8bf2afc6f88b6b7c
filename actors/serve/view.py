"""The front end as its HTTP routes see it (:class:`FrontEndView`).

The routes (``app.py``, ``router_api.py``) read the front-end actor's gateway, prompter,
liveness and the engine's latest stats through this protocol, and the actor
(``frontend.py``) builds them: so neither side imports the other's module.
"""

from __future__ import annotations

from typing import Protocol

from ringfence.actors.http.load import LoadWatch
from ringfence.actors.protocol.client import Stats
from ringfence.actors.serve.config import FrontEndSettings
from ringfence.actors.serve.gateway import Gateway
from ringfence.actors.serve.health import Liveness
from ringfence.actors.serve.prompts import Prompter
from ringfence.runtime.log import ActorLog


class FrontEndView(Protocol):
    """What the routes read of the front end. Attributes are set by the actor's thread;
    the event loop reads them (a stale ``stats`` is fine: it is a snapshot anyway)."""

    @property
    def config(self) -> FrontEndSettings: ...
    @property
    def gateway(self) -> Gateway: ...
    @property
    def prompter(self) -> Prompter: ...
    @property
    def liveness(self) -> Liveness: ...
    @property
    def started_at(self) -> float: ...
    @property
    def stats(self) -> Stats | None: ...
    @property
    def load(self) -> LoadWatch:
        """The engine's load as ``GET /ringfence/load`` follows it (event-loop thread)."""
        ...

    @property
    def log(self) -> ActorLog:
        """The front-end actor's log (a request's ignored fields are logged there)."""
        ...

    def health(self) -> list[str]:
        """The instances that are down now ([] when all serve), for ``/health``."""
        ...

    def engine_down_reason(self) -> str:
        """Why the engine cannot take a request now, or "" when it can."""
        ...
