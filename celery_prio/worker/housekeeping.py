"""The worker's housekeeping jobs: run every few seconds on its event loop, never allowed to stop it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from celery.utils.log import get_logger

from ..brokers import Job

if TYPE_CHECKING:
    from kombu.asynchronous import Hub

logger = get_logger(__name__)

#: Seconds between sweeps for requests that ended off the pool (revoked before they ran, cancelled).
RECONCILE_INTERVAL = 1.0
#: Seconds between reads of broker-wide figures for the report.
FIGURES_INTERVAL = 2.0


class Housekeeping:
    """Starts ``jobs`` on ``hub`` (kombu's event loop) and stops them; a job that fails is logged and retried
    at its next round."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self._entries: list[Any] = []

    def start(self, jobs: Iterable[Job]) -> None:
        self.stop()
        self._entries = [self.hub.call_repeatedly(job.interval, guarded(job)) for job in jobs]

    def stop(self) -> None:
        for entry in self._entries:
            self.hub.timer.cancel(entry)
        self._entries.clear()


def guarded(job: Job) -> Callable[[], None]:
    def run() -> None:
        try:
            job.run()
        except Exception:  # housekeeping never stops a worker; the next round retries
            logger.exception("celery-prio: %s failed", job.name)

    return run


__all__ = ["FIGURES_INTERVAL", "RECONCILE_INTERVAL", "Housekeeping", "guarded"]
