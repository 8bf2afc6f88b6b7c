"""Hosts for multi-host tests: network namespaces on one bridge, made and removed by a test.

Use::

    with Hosts("redis", "inst-a", "inst-b", "client", unlinked=("outside",)) as hosts:
        proc = hosts.run("inst-a", ["ringfence", "serve", "--host", hosts.address("inst-a")])
        answer = hosts.request("client", f"http://{hosts.address('inst-a')}:8000/health")

Each name is a network namespace of its own (ports are per namespace: every host may
listen on 8000) with ``lo`` up and one veth link ``eth0`` whose peer sits on a bridge in
a hub namespace, addressed in a private /24 (``10.213.X.0/24``, X from the test's pid
unless given); a name in ``unlinked`` gets ``lo`` only, so nothing it runs can reach the
others. Nothing is added to the test's own network namespace: the test process reaches
the hosts through a process it runs in one (:meth:`Hosts.request`, :meth:`Hosts.connect`).

:meth:`Hosts.run` starts a process in a namespace (``ip netns exec NS argv``, which execs:
the pid of the ``Popen`` is the command's own) and the test owns that pid;
:meth:`Hosts.command` is the argv prefix that does the same, for helpers that start
processes themselves (``launched(..., prefix=...)``), which then reap them. On the way out,
also when the block raised: every process :meth:`run` started gets SIGINT, then SIGKILL
after ``STOP_TIMEOUT_S``, and is reaped; then every namespace is deleted (with the hub,
the bridge and every link go), and the exit asserts none of them is left.

As root the namespaces are made directly. Elsewhere they are made inside a user namespace
(``unshare --user --map-root-user --net --mount``, a keeper process per ``Hosts``, with a
tmpfs on its own ``/run`` for ``ip netns``'s names) when the kernel allows it; else the
test is skipped naming why. :func:`probe` finds out once per session. Either way the
processes share the host's ``/dev/shm`` (the probe checks it), so the leak guard sees
their names.
"""

from __future__ import annotations

import functools
import ipaddress
import itertools
import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import pytest

STOP_TIMEOUT_S = 10.0  # from SIGINT to SIGKILL, and from SIGKILL to reaped
COMMAND_TIMEOUT_S = 10.0  # one ``ip`` command, or the keeper's start
FIRST_HOST = 2  # the first address of the /24 a host gets (.1 is left to a gateway)
_counter = itertools.count()

# Runs in a namespace (no third-party import: starts fast): connect to HOST:PORT and
# print "connected" or the errno's name.
_CONNECT = """
import errno, socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except OSError as e:
    print(errno.errorcode.get(e.errno, type(e).__name__) if e.errno else type(e).__name__)
"""
# Runs in a namespace: one HTTP request (stdlib only); prints the status line, then the body.
_REQUEST = """
import sys, urllib.error, urllib.request
body = sys.stdin.buffer.read() or None
req = urllib.request.Request(sys.argv[1], data=body, method=sys.argv[2])
req.add_header("Content-Type", "application/json")
try:
    with urllib.request.urlopen(req, timeout=float(sys.argv[3])) as answer:
        status, data = answer.status, answer.read()
except urllib.error.HTTPError as e:
    status, data = e.code, e.read()
sys.stdout.buffer.write(b"%d\\n" % status + data)
"""


class Probe(NamedTuple):
    """How namespaces can be made here: ``way`` "root" or "userns", or None and ``why`` not."""

    way: str | None
    why: str


class Answer(NamedTuple):
    """An HTTP answer as :meth:`Hosts.request` got it."""

    status: int
    body: bytes


def _run_checked(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Run a setup command; RuntimeError naming it and its stderr if it fails."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(argv)} took over {COMMAND_TIMEOUT_S}s") from e
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _end(
    proc: subprocess.Popen[bytes], signum: int = signal.SIGINT, timeout_s: float = STOP_TIMEOUT_S
) -> None:
    """Signal ``proc`` by its pid, SIGKILL it if it has not exited in time, and reap it."""
    if proc.poll() is None:
        os.kill(proc.pid, signum)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(STOP_TIMEOUT_S)


class _Keeper:
    """A process holding a user namespace (root mapped to us) with a private mount namespace
    whose ``/run`` is a tmpfs, so that ``ip netns add`` may write its names there. Commands
    run in it through ``nsenter``; it exits when its stdin closes."""

    def __init__(self) -> None:
        script = "mount -t tmpfs rft-run /run && echo ready && exec cat"
        argv = ["unshare", "--user", "--map-root-user", "--net", "--mount", "sh", "-c", script]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], COMMAND_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else b""
        if line != b"ready\n":
            self.close()
            raise RuntimeError(f"{' '.join(argv)}: {self.proc.stderr.read().decode().strip()}")
        self.prefix = (
            "nsenter",
            f"--target={self.proc.pid}",
            "--user",
            "--net",
            "--mount",
            "--preserve-credentials",
            "--",
        )

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # cat sees its end of file and exits
        _end(self.proc, signal.SIGTERM)


def _try(prefix: Sequence[str], tag: str) -> None:
    """Make a namespace, see that a process in it writes the host's /dev/shm, remove it."""
    shm = Path("/dev/shm") / f"{tag}-probe"
    _run_checked([*prefix, "ip", "netns", "add", tag])
    try:
        _run_checked([*prefix, "ip", "netns", "exec", tag, "sh", "-c", f"echo ok > {shm}"])
        if not shm.exists():
            raise RuntimeError(f"{shm} written in a namespace is not in the host's /dev/shm")
    finally:
        shm.unlink(missing_ok=True)
        _run_checked([*prefix, "ip", "netns", "delete", tag])


def _check(way: str) -> str:
    """Why namespaces cannot be made the ``way`` given ("root", "userns"); "" if they can."""
    tag = f"rft{os.getpid()}probe"
    try:
        keeper = _Keeper() if way == "userns" else None
    except RuntimeError as e:
        return f"no user namespace: {e}"
    try:
        _try(keeper.prefix if keeper else (), tag)
    except RuntimeError as e:
        return f"{'in a user namespace' if keeper else 'as root'}: {e}"
    finally:
        if keeper:
            keeper.close()
    return ""


@functools.cache
def probe() -> Probe:
    """Find out once per session whether and how network namespaces can be made here."""
    if shutil.which("ip") is None:
        return Probe(None, "no `ip` command (Debian: apt-get install iproute2)")
    if os.geteuid() == 0:
        why = _check("root")
        return Probe(None if why else "root", why)
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return Probe(None, "not root, and no unshare/nsenter (util-linux)")
    why = _check("userns")
    return Probe(None if why else "userns", f"not root; {why}" if why else "")


class Hosts:
    """Named network namespaces on one bridge for the length of a ``with`` block (see the
    module docstring). Owned by the test's thread; not thread-safe."""

    def __init__(
        self,
        *names: str,
        unlinked: Sequence[str] = (),
        third: int | None = None,
        way: str | None = None,
        stop_timeout_s: float = STOP_TIMEOUT_S,
    ):
        """``names``: linked hosts, addressed .2, .3, ... in that order; ``unlinked``: hosts
        with no link; ``third``: the /24's third octet (default from the pid); ``way``:
        "root" or "userns" (default: :func:`probe`'s); ``stop_timeout_s``: from SIGINT to
        SIGKILL at the exit."""
        assert len({*names, *unlinked}) == len(names) + len(unlinked), "a name repeats"
        assert len(names) < 250, "one /24"
        self.names, self.unlinked = tuple(names), tuple(unlinked)
        self.subnet = ipaddress.IPv4Network(f"10.213.{third or os.getpid() % 254 + 1}.0/24")
        self.tag = f"rft{os.getpid()}n{next(_counter)}"  # unique per test process and Hosts
        self._addresses = {name: str(self.subnet[FIRST_HOST + i]) for i, name in enumerate(names)}
        self._prefix: tuple[str, ...] = ()  # runs a command where the namespaces live
        self._keeper: _Keeper | None = None
        self._made: list[str] = []  # namespaces, in the order made
        self._procs: list[subprocess.Popen[bytes]] = []  # what run() started
        self.way, self.stop_timeout_s = way, stop_timeout_s

    # The hosts.

    def address(self, name: str) -> str:
        """The IPv4 address of linked host ``name``."""
        return self._addresses[name]

    def namespace(self, name: str) -> str:
        """The network namespace's name (``ip netns``) of host ``name``."""
        assert name in self.names or name in self.unlinked, f"no host {name!r}"
        return f"{self.tag}-{name}"

    def command(self, name: str) -> list[str]:
        """The argv prefix that runs a command in host ``name`` (its pid is the command's)."""
        return [*self._prefix, "ip", "netns", "exec", self.namespace(name)]

    def run(self, name: str, argv: Sequence[str], **popen: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` in host ``name`` (``popen``: Popen's keywords: env, cwd, stdout, ...);
        ended at the block's exit if still running (SIGINT, then SIGKILL)."""
        popen.setdefault("stdin", subprocess.DEVNULL)
        proc: subprocess.Popen[bytes] = subprocess.Popen([*self.command(name), *argv], **popen)
        self._procs.append(proc)
        return proc

    def output(
        self, name: str, argv: Sequence[str], *, stdin: bytes = b"", timeout: float = 30.0
    ) -> bytes:
        """Run ``argv`` in host ``name`` to its end; its stdout. AssertionError if it fails."""
        done = subprocess.run(
            [*self.command(name), *argv],
            input=stdin,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        assert done.returncode == 0, f"{argv} in {name} exited {done.returncode}: {done.stderr!r}"
        return done.stdout

    def connect(self, name: str, address: str, port: int, timeout: float = 2.0) -> str:
        """Try a TCP connection from host ``name``: "connected", or the errno's name."""
        argv = [sys.executable, "-c", _CONNECT, address, str(port), str(timeout)]
        return self.output(name, argv, timeout=timeout + COMMAND_TIMEOUT_S).decode().strip()

    def request(
        self, name: str, url: str, body: bytes = b"", *, method: str = "", timeout: float = 60.0
    ) -> Answer:
        """One HTTP request from host ``name`` (POST when ``body`` is given, else GET)."""
        method = method or ("POST" if body else "GET")
        argv = [sys.executable, "-c", _REQUEST, url, method, str(timeout)]
        status, _, data = self.output(name, argv, stdin=body, timeout=timeout + 10).partition(b"\n")
        return Answer(int(status), data)

    # Making and removing.

    def __enter__(self) -> Hosts:
        found = probe()
        if found.way is None:
            pytest.skip(f"network namespaces cannot be made here: {found.why}")
        self.way = self.way or found.way
        try:
            if self.way == "userns":
                self._keeper = _Keeper()
                self._prefix = self._keeper.prefix
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _ip(self, *args: str) -> None:
        _run_checked([*self._prefix, "ip", *args])

    def _add(self, namespace: str) -> None:
        self._ip("netns", "add", namespace)
        self._made.append(namespace)
        self._ip("-n", namespace, "link", "set", "lo", "up")

    def _make(self) -> None:
        hub = f"{self.tag}-hub"
        self._add(hub)
        self._ip("-n", hub, "link", "add", "br0", "type", "bridge")
        self._ip("-n", hub, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            namespace = self.namespace(name)
            self._add(namespace)
            # Made in the hub with its peer put straight into the host: no link is ever named
            # in the test's own namespace.
            peer = ("peer", "name", "eth0", "netns", namespace)
            self._ip("-n", hub, "link", "add", f"v{i}", "type", "veth", *peer)
            self._ip("-n", hub, "link", "set", f"v{i}", "master", "br0", "up")
            address = f"{self.address(name)}/{self.subnet.prefixlen}"
            self._ip("-n", namespace, "addr", "add", address, "dev", "eth0")
            self._ip("-n", namespace, "link", "set", "eth0", "up")
        for name in self.unlinked:
            self._add(self.namespace(name))

    def close(self) -> None:
        """End every process :meth:`run` started, then delete every namespace made
        (idempotent; also after a half-made setup)."""
        while self._procs:
            _end(self._procs.pop(), timeout_s=self.stop_timeout_s)
        failed = []
        while self._made:
            namespace = self._made.pop()
            try:
                self._ip("netns", "delete", namespace)
            except RuntimeError as e:
                failed.append(str(e))
        listed = subprocess.run(
            [*self._prefix, "ip", "netns", "list"], capture_output=True, text=True, check=False
        ).stdout
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None
        left = [line.split()[0] for line in listed.splitlines() if line.startswith(f"{self.tag}-")]
        assert not failed and not left, f"namespaces left: {left} {failed}"
