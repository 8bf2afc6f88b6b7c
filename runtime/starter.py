"""How the supervisor starts its children: forked from a server that imported their modules,
or each from a fresh interpreter (``runtime.start_method``).

A child started from a fresh interpreter (multiprocess's ``spawn``) imports its actor's
module itself: torch and the model code, about 2.5 s for each executor on a 2-core machine,
where the executors of a run start together and contend for the cores. ``forkserver`` (the
default) forks every child from one server process that imported those modules once, so a
child, and a restarted one, is running in a few milliseconds. The supervisor starts the
server as soon as it knows the topology (:class:`Starter`) and runs its own checks of the
topology, which import the same modules, in a child forked from it (:meth:`Starter.call`),
so the supervisor's process never imports torch. A launch of the ``tiny`` preset with four
requests, from the command to its exit on a 2-core machine, median of five side by side:
7.4 s with ``spawn``, 3.4 s with ``forkserver`` (CPU: 11.7 s and 3.9 s).

Forking a process that imported torch is safe while it ran nothing: no CUDA context, no
OpenMP thread pool. The server only imports. On CUDA the Worker's own modules ask torch
whether CUDA is there at import (the kernels' backend), which makes every later fork unable
to use CUDA, so a run on CUDA starts its children with ``spawn`` unless ``runtime.start_method``
is set (``actors/device_defaults.py``). A child's thread count (``actors.<name>.threads``) is
then set through torch, which was imported before the child could set OpenMP's variable
(``child.py``).

The server imports by the interpreter's own path (multiprocess passes it no other): a module
only the supervisor's ``sys.path`` finds (a test's actor) is imported by each child instead.

The server, and the resource tracker multiprocess starts beside it (for ``spawn`` too), are
the supervisor's processes: :meth:`Starter.close` stops both and waits for their exit, so no
process of a run outlives its supervisor (the tracker exits once every holder of its pipe
closed it: the supervisor and the children, which are all reaped by then; the server is
killed, as it holds nothing). multiprocess keeps one server per process, so one supervisor
runs at a time in a process (as the signal handlers and the waker already require); the next
one starts a server of its own, with its own modules. ``close`` reads multiprocess's private
fields of the two (their pid and pipe): it has no public way to stop them.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal

import multiprocess

StartMethod = Literal["forkserver", "spawn"]
START_METHODS: Final = ("forkserver", "spawn")
# Imported by every child whatever its actor: the body of the child, and what attaches it.
RUNTIME_MODULES: Final = ("ringfence.runtime.child", "ringfence.runtime.embed")
STOP_TIMEOUT_S: Final = 5.0  # for the server and the tracker to exit once their pipe closed


class Starter:
    """Starts the supervisor's children by ``method``; with ``forkserver``, the server that
    imports ``modules`` starts now. Main thread of the supervisor only."""

    def __init__(self, method: StartMethod, modules: Sequence[str] = ()) -> None:
        if method not in START_METHODS:
            raise ValueError(f"runtime.start_method must be one of {START_METHODS}: {method!r}")
        self.method = method
        self._context: Any = multiprocess.get_context(method)
        self._server = False
        if method == "forkserver":
            preload = list(dict.fromkeys([*RUNTIME_MODULES, *modules]))
            self._context.set_forkserver_preload(preload)
            from multiprocess import forkserver

            forkserver.ensure_running()  # it imports while the supervisor goes on
            self._server = True

    @property
    def forks(self) -> bool:
        """Whether children fork from the server (which imported the actors' modules)."""
        return self._server

    def process(self, target: Callable[..., object], args: tuple[Any, ...], name: str) -> Any:
        """A child process (not yet started) that runs ``target(*args)``."""
        return self._context.Process(target=target, args=args, name=name)

    def call(self, fn: Callable[..., object], args: tuple[Any, ...], *, timeout: float) -> None:
        """Run ``fn(*args)`` in a child and raise here what it raised (its result is
        dropped): with the server, work that imports the actors' modules costs this process
        none of their import. TimeoutError past ``timeout`` seconds (the child is killed);
        RuntimeError if the child ended without an answer."""
        receive, send = self._context.Pipe(duplex=False)
        proc = self._context.Process(target=_answer, args=(send, fn, args), name="rf-call")
        proc.start()
        send.close()  # the child's end: EOF here once the child is gone
        try:
            if not receive.poll(timeout):
                proc.kill()
                raise TimeoutError(f"{_name(fn)} took more than {timeout:g} s")
            try:
                error = receive.recv()
            except EOFError:
                proc.join(STOP_TIMEOUT_S)
                raise RuntimeError(
                    f"{_name(fn)} ended with no answer (exit code {proc.exitcode})"
                ) from None
        finally:
            receive.close()
            proc.join(STOP_TIMEOUT_S)
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop the fork server and the resource tracker (which multiprocess starts for
        either method), waiting for their exit (idempotent; call it once no child of this
        starter is alive)."""
        from multiprocess import forkserver, resource_tracker, util

        if self._server:
            self._server = False
            server = forkserver._forkserver
            with server._lock:
                address = server._forkserver_address
                # Killed: it holds nothing, and leaving at its pipe's end, it would tear down
                # torch and the actors' modules first (most of a second the launch waits for).
                _stop_helper(server, "_forkserver_alive_fd", "_forkserver_pid", kill=True)
                server._forkserver_address = None
                if address is not None and not util.is_abstract_socket_namespace(address):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(address)
        tracker = resource_tracker._resource_tracker
        with tracker._lock:
            _stop_helper(tracker, "_fd", "_pid")


def _answer(send: Any, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
    """The body of :meth:`Starter.call`'s child: ``fn(*args)``, then None or what it raised."""
    try:
        fn(*args)
        answer: BaseException | None = None
    except BaseException as e:  # every outcome goes back to the caller, who raises it
        answer = e
    try:
        send.send(answer)
    except Exception:  # an exception that does not pickle: its text instead
        send.send(RuntimeError(f"{type(answer).__name__}: {answer}"))
    send.close()


def _name(fn: Callable[..., object]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _stop_helper(helper: Any, fd_field: str, pid_field: str, *, kill: bool = False) -> None:
    """Close the helper process's pipe (it exits at the pipe's end) and reap it within
    STOP_TIMEOUT_S, killing it past that, or at once with ``kill``."""
    fd, pid = getattr(helper, fd_field), getattr(helper, pid_field)
    if fd is not None:
        os.close(fd)
        setattr(helper, fd_field, None)
    if pid is None:
        return
    setattr(helper, pid_field, None)
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:  # already reaped
        return
    try:
        if kill or not select.select([handle], [], [], STOP_TIMEOUT_S)[0]:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    finally:
        os.close(handle)


def modules_of(targets: Sequence[str]) -> list[str]:
    """The modules of actor import paths ("package.module:Class" -> "package.module")."""
    return [target.partition(":")[0] for target in targets]
