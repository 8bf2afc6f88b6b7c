"""The engine's KV events: the scheduler's journal, encoded and published once a round.

With ``events.enabled`` the engine makes a :class:`KVEventsOut` when its scheduler
begins: a :class:`~ringfence.cache.kv_events.KVEventJournal` the scheduler's pools and
pieces tell (``Scheduler(kv_events=...)``), and an
:class:`~ringfence.actors.events.publisher.EventPublisher` bound to ``events.endpoint``
and ``events.replay_endpoint``. Its first batch clears every tier (this engine knows
nothing that was cached before it); after every round of the engine's work (``flush``,
from ``Engine.flush``) the events since the last one go out as one batch in
``events.layout``. The endpoints bound are reported in every Stats (``events``), which is
how ``ringfence serve`` advertises them on ``/v1/models``.

Engine thread only (the publisher's socket thread is its own).
"""

from __future__ import annotations

import time

from ringfence.actors.events.config import EventsConfig
from ringfence.actors.events.publisher import EventPublisher
from ringfence.actors.events.wire import encode_batch
from ringfence.cache.kv_events import KVEventJournal
from ringfence.runtime.log import ActorLog
from ringfence.sched.config import TierConfig

LINEAGE_PER_BLOCK = 4  # keys whose tokens are kept, per device and host block


class KVEventsOut:
    """See the module docstring."""

    def __init__(self, config: EventsConfig, tiers: TierConfig, log: ActorLog) -> None:
        self.config = config
        self.log = log
        self.journal = KVEventJournal(
            tiers.block_size, lineage=LINEAGE_PER_BLOCK * (tiers.device_blocks + tiers.host_blocks)
        )
        self.publisher = EventPublisher(
            config.endpoint,
            config.replay_endpoint,
            buffer_steps=config.buffer_steps,
            topic=config.topic,
        )
        with self.journal.clearing(None):
            pass
        self.batches = 0
        self.events = 0
        bound = self.publisher.endpoints
        log.info("events.ready", endpoint=bound.publish, replay_endpoint=bound.replay,
                 layout=config.layout)  # fmt: skip

    @property
    def endpoints(self) -> dict[str, str]:
        bound = self.publisher.endpoints
        return {"endpoint": bound.publish, "replay_endpoint": bound.replay}

    def flush(self) -> None:
        """Publish the events since the last flush as one batch (nothing when there are none)."""
        events = self.journal.take()
        if events:
            self.publisher.publish(encode_batch(time.time(), events, layout=self.config.layout))
            self.batches += 1
            self.events += len(events)

    def close(self) -> None:
        self.flush()
        counts = self.publisher.counts
        self.publisher.close()
        self.log.info("events.stop", batches=self.batches, events=self.events,
                      published=counts.published, dropped=counts.dropped,
                      replays=counts.replays, bad_replays=counts.bad_replays,
                      degraded=self.journal.degraded)  # fmt: skip
