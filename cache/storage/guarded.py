"""A storage client whose presence answers never raise: the engine's view of the tier.

The engine asks the storage tier what it holds (``longest_prefix``) from inside its
scheduler, between steps. An exception there would escape into the engine's handler,
and a server that is down would be asked again at every admission. So the engine's
client is wrapped: when the backend cannot be reached (``StorageUnavailable``, or any
``OSError``: a local directory gone or unreadable) the answer is "nothing stored", a
miss that the scheduler turns into recomputation, never into wrong tokens. The
backend is then left alone until a back-off has passed (measured with
``time.monotonic``, so no thread and no sleep: the next question after it retries);
each failed retry doubles the back-off up to ``backoff_max_s``, and the first answer
that succeeds ends the outage. One ``storage.unavailable`` warning is logged per
outage and one ``storage.restored`` when it ends, never one per question.

What this bounds: a stopped server fails a question at once (connection refused). A
hung one would cost the backend's timeout (``cache.storage.timeout_s``, seconds) inside
the engine's loop; with ``answer_s`` (the engine's ``cache.storage.presence_timeout_s``)
a question is asked on a thread of the guard's own and waited for that long at most.
An answer that does not come in time is a miss, and the outage starts
(``storage.unavailable``); while that question is still in the backend, later ones are
misses at once, without asking. When it ends, an answer means the tier is back, an
error starts the back-off. So a hung server costs the engine ``answer_s`` once per
outage, not a timeout per question. Only ``longest_prefix`` is guarded: the engine asks
nothing else, and the store lane, which reads and writes, reports its own failures as
failed ops. The other methods pass through unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as AnswerLate
from typing import Final

from ringfence.cache.ids import BlockHash
from ringfence.cache.storage.backend import (
    StorageBackend,
    StorageLog,
    StorageStats,
    StorageUnavailable,
)
from ringfence.cache.storage.blob import Buffer
from ringfence.cache.storage.counters import stdlib_log

BACKOFF_S: Final = 0.5  # the first retry after a failure
BACKOFF_MAX_S: Final = 30.0  # the cap of the doubled back-off


class GuardedBackend:
    """A :class:`~ringfence.cache.storage.StorageBackend` whose ``longest_prefix`` answers 0
    instead of raising while the backend is unreachable; see the module docstring.

    Owner: one thread (the engine's). Mutates only its own outage state. With ``answer_s``
    the backend's ``longest_prefix`` runs on the guard's one asking thread instead, and
    nothing else of the backend runs while a question is there but ``close``.
    """

    def __init__(
        self,
        backend: StorageBackend,
        *,
        log: StorageLog | None = None,
        backoff_s: float = BACKOFF_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        answer_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < backoff_s <= backoff_max_s:
            raise ValueError(f"need 0 < backoff_s <= backoff_max_s: {backoff_s}, {backoff_max_s}")
        if answer_s is not None and not answer_s > 0:
            raise ValueError(f"answer_s must be > 0 (or None: ask in the caller), got {answer_s}")
        self.backend = backend
        self.name = backend.name
        self.log: StorageLog = log if log is not None else stdlib_log()
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._clock = clock
        self._down_since: float | None = None  # clock() at the first failure of this outage
        self._retry_at = 0.0  # no question reaches the backend before this clock() value
        self._delay = backoff_s  # the back-off after the next failure
        self._failures = 0  # failed questions of this outage (the ones that reached it)
        self.answer_s = answer_s
        self._asker: ThreadPoolExecutor | None = None  # made at the first question
        self._late: Future[int] | None = None  # a question still in the backend

    @property
    def available(self) -> bool:
        """False from a failure until a question succeeds again."""
        return self._down_since is None

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        """The backend's answer; 0 while it is unreachable or backing off. Never raises
        for an unreachable backend (a caller's bug, a bad key, still raises)."""
        now = self._clock()
        if self._late is not None:
            if not self._late.done():
                return 0  # the last question is still in the backend: do not pile up more
            late, self._late = self._late, None
            if (error := late.exception()) is not None:
                self._failed(error)
                return 0
        if self._down_since is not None and now < self._retry_at:
            return 0
        try:
            found = self._ask(keys)
        except AnswerLate:  # first: it is a TimeoutError, so an OSError too
            self._failed(StorageUnavailable(f"no answer within {self.answer_s} s"), late=True)
            return 0
        except (StorageUnavailable, OSError) as error:
            self._failed(error)
            return 0
        if self._down_since is not None:
            self.log.info(
                "storage.restored",
                backend=self.name,
                outage_s=round(now - self._down_since, 3),
                failures=self._failures,
            )
            self._down_since = None
            self._failures = 0
            self._delay = self.backoff_s
        return found

    def _ask(self, keys: Sequence[BlockHash]) -> int:
        """The backend's answer: in this thread, or within ``answer_s`` on the asker's
        (raises ``AnswerLate`` and keeps the question as ``_late`` if it takes longer)."""
        if self.answer_s is None:
            return self.backend.longest_prefix(keys)
        if self._asker is None:
            self._asker = ThreadPoolExecutor(1, thread_name_prefix="ringfence-storage-ask")
        question = self._asker.submit(self.backend.longest_prefix, list(keys))
        try:
            return question.result(timeout=self.answer_s)
        except AnswerLate:
            self._late = question
            raise

    def _failed(self, error: BaseException, *, late: bool = False) -> None:
        # Timed after the failure: a question that waited out a timeout is not retried at once.
        # A late question is not counted until it ends: the back-off starts then.
        if late:
            if self._down_since is None:
                self._down_since = self._clock()
                self.log.warning(
                    "storage.unavailable", backend=self.name, error=str(error), retry_s=0.0
                )
            return
        now = self._clock()
        if self._down_since is None:
            self._down_since = now
            self.log.warning(
                "storage.unavailable", backend=self.name, error=str(error), retry_s=self._delay
            )
        self._failures += 1
        self._retry_at = now + self._delay
        self._delay = min(2 * self._delay, self.backoff_max_s)

    def put_many(self, items: Iterable[tuple[BlockHash, Buffer]]) -> int:
        return self.backend.put_many(items)

    def get_many(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        return self.backend.get_many(keys)

    def get_into(self, items: Sequence[tuple[BlockHash, Buffer]]) -> list[bool]:
        return self.backend.get_into(items)

    def delete(self, keys: Iterable[BlockHash]) -> int:
        return self.backend.delete(keys)

    def stats(self) -> StorageStats:
        return self.backend.stats()

    def close(self) -> None:
        if self._asker is not None:  # a question still in the backend ends with the backend
            self._asker.shutdown(wait=False, cancel_futures=True)
            self._asker = None
        self.backend.close()
