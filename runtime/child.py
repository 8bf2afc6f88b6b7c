"""The body of a process the supervisor spawns: attach one instance, run it, exit with its status.

Exit status: 0 when the instance stopped as asked (or found the supervisor gone),
1 when it failed: the error is in its log, and its failure record (``failure.py``) in the
run dir tells the supervisor what it was and where. SIGINT is ignored, because a Ctrl-C at
the terminal reaches the whole process group and the supervisor alone decides the
order of the shutdown; SIGTERM keeps its default (the process ends at once, which
the supervisor treats as a failure).

The instances of the run placed on this one (``placement = "hosted"``, hosting.py) run on
threads of this process, started before its own instance and stopped after it. One that
fails is restarted on its thread as the supervisor decides; this process lives on. Only a
guest it can no longer keep (the supervisor silent past every deadline) ends it: both
records are written, and it exits 1.

The process leaves by ``os._exit`` once the instance closed (its log flushed and closed,
its mailbox and bells closed): the interpreter's own teardown of torch and the other
modules takes most of a second, and a stop in topology order waits for each exit in turn.
Nothing the runtime opens needs an exit handler; ``stdout`` and ``stderr`` are flushed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import dataclass
from typing import NoReturn


@dataclass(frozen=True, slots=True)
class ChildSpec:
    run_dir: str
    name: str
    rank: int
    incarnation: int
    threads: int = 0  # [actors.<name>] threads: 0 leaves the libraries' default


def main(spec: ChildSpec) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.threads:  # before the actor's module (and torch) is imported by attach
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(spec.threads)
        # Forked from the fork server (starter.py), torch is imported already: OpenMP read
        # its variable then, so the count is set through torch (before any thread pool).
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(spec.threads)
    from ringfence.runtime.embed import attach
    from ringfence.runtime.failure import record_failure
    from ringfence.runtime.hosting import Guest, Guests

    instance = f"{spec.name}-{spec.rank}"
    try:
        driver = attach(
            spec.run_dir, spec.name, spec.rank, placement="spawn", incarnation=spec.incarnation
        )
        guests = Guests.open(spec.run_dir, instance)
    except Exception as e:
        print(f"ringfence: {instance} could not attach: {e}", file=sys.stderr)
        record_failure(spec.run_dir, instance, spec.incarnation, "attach", e)
        _leave(1)

    def guest_lost(guest: Guest, error: BaseException) -> None:
        # The supervisor neither wanted the guest again nor stopped this host: end both.
        where = f"hosting {guest.id}"
        record_failure(spec.run_dir, instance, spec.incarnation, where, error)
        _leave(1)

    guests.start(guest_lost)  # before the host's own start: they load nothing
    try:
        driver.run()
    except Exception as e:  # logged by the driver, with its traceback
        record_failure(spec.run_dir, instance, spec.incarnation, driver.failed_in or "loop", e)
        _leave(1)
    guests.stop(f"{instance} stopped", driver.runtime.stop_timeout_s)
    _leave(0)


def _leave(status: int) -> NoReturn:
    """Exit now with ``status``, skipping the interpreter's teardown (see the module doc)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing to say
            stream.flush()
    os._exit(status)
