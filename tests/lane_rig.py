"""An in-process lane executor (Worker, swap or store lane) on a real driver, for tests.

:func:`start_executor` runs ``actor_cls`` as instance ``<name>-0`` in a driver thread,
with a local inbox from "engine-0" and a local inbox the test reads its replies from,
a real shared-memory ``lanes`` counter block and a control block (counter 0 is the run
epoch). The test plays every other actor: it writes their watermarks, ringing the
executor's waiter as their real writers would.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ringfence.actors.config import Config
from ringfence.actors.protocol.lanes import LANE_SLOTS, LANES
from ringfence.runtime.actor import Actor, config_of
from ringfence.runtime.codec import Registry
from ringfence.runtime.control import InstanceControl, control_count
from ringfence.runtime.driver import Driver
from ringfence.runtime.log import ActorLog
from ringfence.runtime.mailbox import ConditionWaiter, LocalInbox, LocalOutbox, Mailbox
from ringfence.shm import names
from ringfence.shm.counter import CounterBlock

WAIT_S = 10.0  # deadline of every wait for a reply


@dataclass
class Executor:
    driver: Driver
    waiter: ConditionWaiter  # the executor's own waiter: what its watermark writers ring
    inbox: LocalInbox  # engine -> executor
    replies: LocalInbox  # executor -> engine, read by the test
    replies_box: Mailbox
    lanes: CounterBlock
    control: CounterBlock
    log_path: Path

    def next_reply(self) -> object:
        """The next message from the executor, waiting up to WAIT_S."""
        assert self.replies_box.waiter.wait_until(self.replies.pending, WAIT_S), "no reply"
        delivery = self.replies.read()
        assert delivery is not None
        return delivery.msg

    def stop(self) -> None:
        self.driver.stop("test over")
        assert self.driver.join(WAIT_S)
        self.lanes.close()
        self.control.close()


def start_executor(
    actor_cls: type[Actor],
    name: str,
    *,
    config: Config,
    run_id: str,
    log_dir: Path,
    inbox: Registry,
    replies: Registry,
    epoch: int = 0,
    rank: int = 0,
    run_dir: Path | None = None,
) -> Executor:
    """Start ``actor_cls`` as ``<name>-<rank>`` of run ``run_id`` (names: the caller cleans the
    run); the ``lanes`` block holds ranks 0..rank."""
    lanes = CounterBlock.create(names.posix_name(run_id, LANES), LANE_SLOTS * (rank + 1))
    control = CounterBlock.create(names.posix_name(run_id, "control"), control_count(1))
    control[0].advance(epoch)
    waiter = ConditionWaiter()
    mailbox = Mailbox(waiter)
    ops = mailbox.add_local_inbox("engine-0", inbox)
    replies_box = Mailbox(ConditionWaiter())
    answers = replies_box.add_local_inbox(f"{name}-{rank}", replies)
    mailbox.outboxes["engine-0"] = LocalOutbox("engine-0", answers)
    log_path = log_dir / f"{name}-{rank}.jsonl"
    driver = Driver(
        actor_cls,
        name=name,
        rank=rank,
        mailbox=mailbox,
        runtime=config.runtime,
        log=ActorLog(log_path, actor=name, rank=rank, epoch=0),
        config=config_of(actor_cls, config),  # its own sections, as a launch gives
        run_id=run_id,
        run_dir=run_dir,
        counters={LANES: lanes},
        control=InstanceControl.of(control, 0),
    )
    driver.start_thread()
    return Executor(driver, waiter, ops, answers, replies_box, lanes, control, log_path)
