"""A throwaway redis-server for tests and benchmarks: loopback (or an address a test
made), no persistence, stopped by PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server")  # None: the redis tests skip
READY_LINE = b"Ready to accept connections"
START_ATTEMPTS = 3  # a free port can be taken between choosing it and the server binding it


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class _Output:
    """Drains the server's log from its pipe on a thread, and tells when it is ready.

    Draining also keeps the server from ever blocking on a full pipe.
    """

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self._pipe = proc.stdout
        self.text = b""
        self.settled = threading.Event()  # set on the ready line, or when the log ends
        self.ready = False
        self._thread = threading.Thread(target=self._drain, name="redis-log", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        for line in self._pipe:
            self.text += line
            if READY_LINE in line:
                self.ready = True
                self.settled.set()
        self.settled.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        self._pipe.close()


def _stop(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM the server by its PID, SIGKILL it if it does not exit in time, and reap it."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout_s)


def url_port(url: str) -> int:
    """The port of a ``redis://127.0.0.1:PORT/0`` URL that :func:`redis_server` yielded."""
    return int(url.rpartition(":")[2].partition("/")[0])


@contextmanager
def redis_server(
    workdir: Path,
    *,
    port: int | None = None,
    timeout_s: float = 10.0,
    bind: str = "127.0.0.1",
    prefix: Sequence[str] = (),
    user: tuple[str, str] | None = None,
    tls: tuple[str, str, str] | None = None,
) -> Iterator[str]:
    """Run redis-server on ``bind`` with ``workdir`` as its dir; yield its URL; stop it.

    ``port``: the port to listen on (a server restarted where one was stopped);
    default a free one. Ready means: its log said it accepts connections (no polling)
    and it answered a PING. Raises ``RuntimeError`` with the server's log if it never
    got there.

    ``bind`` and ``prefix``: listen on another address, started through a command that
    execs it (a test's network namespace: ``ip netns exec NS``). Then ``port`` is
    required (this process cannot tell which ports are free there), it is not pinged
    (its log line is the readiness), and protected mode is off (its clients are not on
    loopback).

    ``user``: an ACL user ``(name, password)`` that may do anything, and the default user
    off, so a client must log in as it (the yielded URL holds neither; the PING does).

    ``tls``: ``(certfile, keyfile, ca_certs)``: it speaks TLS only (no plain port), asks no
    client certificate, and the yielded URL is ``rediss://...?ssl_ca_certs=<ca_certs>``.
    """
    import redis

    if REDIS_SERVER is None:
        raise RuntimeError("redis-server is not on PATH")
    if prefix and port is None:
        raise ValueError("redis_server: a server started through a prefix needs a port")
    log = b""
    for _ in range(1 if port else START_ATTEMPTS):
        listen = port or free_port()
        ports = ["--port", str(listen)]
        if tls is not None:
            ports = ["--port", "0", "--tls-port", str(listen), "--tls-cert-file", tls[0]]
            ports += ["--tls-key-file", tls[1], "--tls-ca-cert-file", tls[2]]
            ports += ["--tls-auth-clients", "no"]
        args = [*prefix, REDIS_SERVER, "--bind", bind, *ports, "--dir", str(workdir)]
        args += ["--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", ""]
        if prefix:
            args += ["--protected-mode", "no"]
        if user is not None:
            args += ["--user", user[0], "on", f">{user[1]}", "~*", "&*", "+@all"]
            args += ["--user", "default", "off"]
        proc = subprocess.Popen(
            args,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        output = _Output(proc)
        try:
            output.settled.wait(timeout_s)
            if output.ready:
                url = f"redis://{bind}:{listen}/0"
                if tls is not None:
                    url = f"rediss://{bind}:{listen}/0?ssl_ca_certs={tls[2]}"
                if not prefix:
                    login = {"username": user[0], "password": user[1]} if user else {}
                    with redis.Redis.from_url(url, socket_timeout=timeout_s, **login) as client:
                        assert client.ping()
                yield url
                return
        finally:
            _stop(proc)
            output.join(timeout_s)
        log = output.text
    raise RuntimeError(f"redis-server did not start:\n{log.decode(errors='replace')}")
