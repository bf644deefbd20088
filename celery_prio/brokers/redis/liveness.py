"""A Redis worker's heartbeat, from a thread of its own.

The beat says "this process is alive": any live worker returns the messages
of an owner whose beat is older than the tier's ``prio_redeliver_after``.
It used to be a job on the worker's event loop, so anything that held the
loop (a task under the solo pool, a long housekeeping pass) made a live
worker look dead: its task was taken over and run a second time. From a
thread it goes on while the loop is busy, which is what lets the bounds be
short (≤ 10 s for every tier by default).

The thread lives as long as the process: during a warm shutdown the
``acks_late`` tasks still finishing must keep their owner alive, and a dead
process (SIGKILL, OOM) stops beating with it. After a reconnect the new
connection's source takes over the same thread (one per process).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: Seconds between beats. Several beats fit in the shortest bound (``MIN_REDELIVER_AFTER``, 2 s).
HEARTBEAT_INTERVAL = 1.0
#: Seconds the housekeeper lease lasts without a beat (at most; never longer than the shortest
#: ``prio_redeliver_after``): a dead housekeeper's jobs move to another worker within this plus one beat
#: (every beat of the holder renews it).
HOUSEKEEPER_LEASE = 3.0


class Heartbeat:
    """One daemon thread per process calling the current ``beat`` every ``interval`` seconds."""

    def __init__(self, interval: float = HEARTBEAT_INTERVAL) -> None:
        self.interval = interval
        self._beat: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.beats = 0  # beats sent (tests, reports)
        self.failures = 0  # consecutive beats that failed (Redis down: the next one retries)

    def attach(self, beat: Callable[[], None]) -> None:
        """Beat with ``beat`` from now on (a new connection's), starting the thread on first use."""
        with self._lock:
            self._beat = beat
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="celery-prio-heartbeat", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                beat = self._beat
            if beat is not None:
                try:
                    beat()
                    self.beats += 1
                    self.failures = 0
                except Exception as exc:  # Redis down or restarting: keep beating, never die
                    self.failures += 1
                    if self.failures in (1, 10) or self.failures % 60 == 0:
                        logger.warning("celery-prio: heartbeat failed %d time(s) in a row: %r", self.failures, exc)
            self._wake.wait(self.interval)


#: The process's heartbeat (a worker process has one owner incarnation, so one beat).
PROCESS_HEARTBEAT = Heartbeat()
