"""Run ``ringfence serve`` as a subprocess of a test and talk to it over HTTP on loopback.

:func:`served` starts the command (``--port 0``: the front end picks a free port and prints
it), waits for its ``ready`` line, yields a :class:`Server`, and stops it with SIGINT as a
user's Ctrl-C would, checking that it exits 0; then ``launched``'s reaping checks that no
process and no shared-memory name of the run is left.
"""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
from launching import QUICK, Launch, launched, wait_until

LISTENING = re.compile(r"listening on (https?://[0-9.]+:\d+) \(front end pid (\d+)\)")
READY = "ringfence serve: ready"
START_TIMEOUT_S = 90.0  # every actor imports torch; the machine may be busy with other tests
STOP_TIMEOUT_S = 30.0


@dataclass
class Server:
    """A running ``ringfence serve`` as a test sees it."""

    launch: Launch
    url: str
    frontend_pid: int

    def http(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs)

    def async_openai(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs
        )

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        with self.http() as client:
            return client.post(path, json=body)

    def get(self, path: str) -> httpx.Response:
        with self.http() as client:
            return client.get(path)

    def wait_health(self, status: int, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until GET /health answers ``status``."""

        def answers() -> bool:
            if self.launch.proc.poll() is not None:
                raise AssertionError(f"ringfence serve exited: {self.launch.stderr()}")
            try:
                return self.get("/health").status_code == status
            except httpx.TransportError:
                return False

        wait_until(f"/health to answer {status}", answers, timeout)

    def engine_events(self, event: str, **fields: Any) -> list[dict[str, Any]]:
        return self.launch.events(event, log="engine-0", **fields)

    def frontend_events(self, event: str, **fields: Any) -> list[dict[str, Any]]:
        return self.launch.events(event, log="frontend-0", **fields)


def started(stack: contextlib.ExitStack, servers: list[ContextManager[Server]]) -> list[Server]:
    """Enter every context at once (each instance takes seconds to start); their exits go on
    ``stack``, those that entered, before a failure to start is raised."""
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(server.__enter__) for server in servers]
    for server, future in zip(servers, futures, strict=True):
        if future.exception() is None:
            stack.push(server.__exit__)
    return [future.result() for future in futures]


@contextmanager
def served(
    tmp_path: Path,
    *sets: str,
    stop: bool = True,
    host: str | None = None,
    port: int = 0,
    prefix: Sequence[str] = (),
) -> Iterator[Server]:
    """``ringfence serve --port 0 --set S ...`` until the block ends (see the module docstring).

    ``host``, ``port``: ``--host`` (default the server's, 127.0.0.1) and ``--port``;
    ``prefix``: a command that runs it elsewhere (``Hosts.command``: in a network namespace,
    from where :meth:`Server.http` cannot reach it).
    """
    command = ("serve", *(("--host", host) if host else ()), "--port", str(port))
    with launched(tmp_path, *QUICK, *sets, command=command, prefix=prefix) as launch:

        def line(pattern: str) -> bool:
            if launch.proc.poll() is not None:
                raise AssertionError(
                    f"ringfence serve exited ({launch.proc.returncode}) before {pattern!r}:\n"
                    f"{launch.stdout()}\n{launch.stderr()}"
                )
            return pattern in launch.stdout()

        wait_until("the listening line", lambda: line("listening on"), START_TIMEOUT_S)
        match = LISTENING.search(launch.stdout())
        assert match, launch.stdout()
        wait_until("the ready line", lambda: line(READY), START_TIMEOUT_S)
        server = Server(launch, match[1], int(match[2]))
        yield server
        if stop and launch.proc.poll() is None:
            launch.send_signal(signal.SIGINT)
            code = launch.wait(STOP_TIMEOUT_S)
            assert code == 0, f"ringfence serve exited {code}:\n{launch.stderr()}"
