"""A ``ringfence router`` over fake instances (tests/fake_instance.py): :func:`routed` serves
one in the test's process with uvicorn in a thread on 127.0.0.1 (a free port);
:func:`router_process` runs the command, and :func:`router_refusal` runs one that must not
start."""

from __future__ import annotations

import asyncio
import io
import re
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import orjson
from fake_instance import FakeInstance
from fake_serve import listening_socket
from launching import RINGFENCE, launch_env
from prometheus_client.parser import text_string_to_metric_families

from ringfence.actors.router.app import build_app
from ringfence.actors.router.log import RouterLog
from ringfence.actors.router.options import RouterOptions
from ringfence.actors.router.server import nodelay
from ringfence.actors.router.state import Router, open_router
from ringfence.actors.serve.server import HttpThread


class LogLines(io.StringIO):
    """The router's log, kept for the test (written from the server's thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def write(self, s: str) -> int:
        with self.lock:
            return super().write(s)

    def events(self, event: str) -> list[dict[str, Any]]:
        with self.lock:
            lines = [orjson.loads(line) for line in self.getvalue().splitlines()]
        return [line for line in lines if line["event"] == event]


@dataclass
class Rig:
    """A router serving in this process, as a test sees it."""

    url: str
    router: Router
    log: LogLines
    journal: list[tuple[str, str]] = field(default_factory=list)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30.0, trust_env=False)

    def post(self, path: str, body: Any) -> httpx.Response:
        with self.http() as client:
            return client.post(path, content=orjson.dumps(body))

    def metric(self, name: str, **labels: str) -> float:
        """The value of the sample ``name`` with ``labels`` in GET /metrics."""
        with self.http() as client:
            text = client.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        raise AssertionError(f"no sample {name}{labels} in /metrics:\n{text}")


@contextmanager
def routed(
    prefill: list[FakeInstance], decode: list[FakeInstance], **options: Any
) -> Iterator[Rig]:
    """A router over these fakes until the block ends (the journal: after its start)."""
    journal = (prefill + decode)[0].journal

    def started() -> None:
        journal.clear()  # the start-up's identity calls are not the tests' business
        for fake in prefill + decode:
            fake.calls.clear()

    with routed_urls(
        [f.url for f in prefill],
        [f.url for f in decode],
        journal=journal,
        on_start=started,
        start_timeout_s=options.pop("start_timeout_s", 5.0),
        **options,
    ) as rig:
        yield rig


@contextmanager
def routed_urls(
    prefill: list[str],
    decode: list[str],
    *,
    journal: list[tuple[str, str]] | None = None,
    on_start: Any = None,
    **options: Any,
) -> Iterator[Rig]:
    """A router over the instances at these URLs (real ones: ``tests/serving.py``) until
    the block ends."""
    opts = RouterOptions(prefill=tuple(prefill), decode=tuple(decode), **options)
    log = LogLines()
    loop = asyncio.new_event_loop()
    try:
        router = loop.run_until_complete(open_router(opts, RouterLog(log)))
    except BaseException:
        loop.close()
        raise
    sock = listening_socket("127.0.0.1", 0)
    nodelay(sock)
    host, port = sock.getsockname()[:2]
    http = HttpThread(build_app(router), sock, loop)
    http.start()
    if on_start is not None:
        on_start()
    try:
        yield Rig(f"http://{host}:{port}", router, log, journal if journal is not None else [])
    finally:
        asyncio.run_coroutine_threadsafe(router.aclose(), loop).result(5.0)
        assert http.stop(5.0), "the router's server did not stop"


ROUTER_START_S = 30.0  # the command imports fastapi, httpx, prometheus_client; the machine is busy
LISTENING = re.compile(
    r"^ringfence router: listening on (https?://127\.0\.0\.1:\d+) \(pid (\d+)\)$"
)


def router_command(*args: str) -> list[str]:
    """``ringfence router`` on a free loopback port, giving its instances 10 s to answer."""
    return [str(RINGFENCE), "router", "--port", "0", "--start-timeout-s", "10", *args]


@contextmanager
def router_process(*args: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``ringfence router *args`` started: its URL, once it printed where it listens (its pid
    the process's) and that it is ready, and the process; killed if it is running at the end."""
    proc = subprocess.Popen(
        router_command(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=launch_env(),
    )
    try:
        assert proc.stdout is not None
        first, second = proc.stdout.readline(), proc.stdout.readline()
        match = LISTENING.match(first.rstrip("\n"))
        said = f"{first!r} {second!r}"
        assert match and second == "ringfence router: ready\n", (
            f"{said}: {proc.communicate(timeout=ROUTER_START_S)}"
        )
        assert int(match[2]) == proc.pid, said
        yield match[1], proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def router_refusal(*args: str, started: bool = True) -> subprocess.CompletedProcess[str]:
    """``ringfence router *args`` run to its end, which must be exit 2 with nothing on stdout
    (``started``: as :func:`router_command` starts it; else with ``args`` alone)."""
    command = router_command(*args) if started else [str(RINGFENCE), "router", *args]
    done = subprocess.run(
        command, capture_output=True, text=True, env=launch_env(), timeout=60, check=False
    )
    assert (done.returncode, done.stdout) == (2, ""), done
    return done
