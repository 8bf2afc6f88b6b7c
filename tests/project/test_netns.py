"""The multi-host harness (tests/netns.py): hosts reach each other by address and nothing
else, a process run in one is the test's own pid, and the exit leaves nothing behind.

Each test runs both ways of making namespaces: as root, and in a user namespace (which
root may make too), so that the way a non-root machine takes is tested here as well.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from netns import Hosts, probe

PORT = 8000
# Listens on argv[1]:PORT, prints its pid, and answers every connection with "hello".
SERVER = f"""
import os, signal, socket, sys
if sys.argv[2] == "deaf":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
else:  # a shell's background job starts with SIGINT ignored: polite hears it regardless
    signal.signal(signal.SIGINT, signal.default_int_handler)
s = socket.create_server((sys.argv[1], {PORT}))
print(os.getpid(), flush=True)
while True:
    c, _ = s.accept()
    c.sendall(b"hello")
    c.close()
"""
WAYS = ["root", "userns"]


def namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in listed.stdout.splitlines()]


def serve(hosts: Hosts, name: str, mode: str = "polite") -> subprocess.Popen[bytes]:
    """SERVER in host ``name``, once it listens; checks it runs as the pid the test holds."""
    proc = hosts.run(
        name, [sys.executable, "-c", SERVER, hosts.address(name), mode], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    assert int(proc.stdout.readline()) == proc.pid  # ``ip netns exec`` execs: no middleman
    return proc


@pytest.fixture(params=WAYS)
def way(request) -> str:
    if request.param == "root" and probe().way != "root":
        pytest.skip("not root")
    return str(request.param)


def test_hosts_reach_each_other_by_address_each_on_its_own_port_and_an_unlinked_host_reaches_none(
    way,
):
    with Hosts("a", "b", "c", unlinked=("outside",), way=way) as hosts:
        assert [hosts.address(n) for n in "abc"] == [str(hosts.subnet[i]) for i in (2, 3, 4)]
        serve(hosts, "a")
        serve(hosts, "b")  # the same port: ports are per host
        for src, dst in [("c", "a"), ("c", "b"), ("a", "b"), ("b", "a")]:
            assert hosts.connect(src, hosts.address(dst), PORT) == "connected", (src, dst)
        assert hosts.connect("c", hosts.address("c"), PORT) == "ECONNREFUSED"
        assert hosts.connect("outside", hosts.address("a"), PORT) == "ENETUNREACH"
        assert hosts.output("outside", ["ip", "-o", "link"]).decode().count(": lo:") == 1


def test_the_exit_ends_every_process_and_removes_every_namespace_also_when_the_block_raises(way):
    hosts = Hosts("polite", "deaf", way=way, stop_timeout_s=1.0)
    with pytest.raises(RuntimeError, match="the test failed"), hosts:
        polite, deaf = serve(hosts, "polite"), serve(hosts, "deaf", "deaf")
        made = [hosts.namespace(n) for n in ("polite", "deaf")]
        if way == "root":
            assert set(made) <= set(namespaces())
        raise RuntimeError("the test failed")
    assert polite.returncode == -signal.SIGINT  # Python's exit on an unhandled Ctrl-C
    assert deaf.returncode == -signal.SIGKILL  # ignored SIGINT for stop_timeout_s
    assert not [n for n in namespaces() if n.startswith(f"{hosts.tag}-")]
