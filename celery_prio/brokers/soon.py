"""A job run on the worker's loop soon after something happened, instead of polled at that pace.

Figures that must travel fast when they change (a cold fleet's first run-time
estimates, for admission by predicted wait) were looked for every 10 to 25 ms:
each look wakes the event loop, and an idle worker paid 1.7 % of a core for
looks that found nothing. Now the event (a run of a queue not yet shared, a
report with news) asks for a look within ``delay``; a slow paced job covers
the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kombu.asynchronous import Hub

logger = logging.getLogger(__name__)

#: How often such figures are looked at with no event since the last look (the slower paces at which they are
#: sent when nothing is news, 0.5 s and more, are kept within it).
PACE_INTERVAL = 0.25


class Soon:
    """``job`` run on ``hub`` within ``delay`` seconds of a ``nudge()``: once per ``delay`` however many nudges.

    A nudge made before the hub is attached does nothing (the paced job covers it). Keeps no timer handle: a
    look lost with a restarted loop only delays the next nudge's until its due time has passed."""

    def __init__(self, job: Callable[[], None], delay: float, name: str) -> None:
        self.job, self.delay, self.name = job, delay, name
        self.hub: Hub | None = None
        self._due = float("-inf")

    def nudge(self) -> None:
        now = time.monotonic()
        if self.hub is not None and now >= self._due:
            self._due = now + self.delay
            self.hub.call_later(self.delay, self._run)

    def _run(self) -> None:
        self._due = float("-inf")  # a nudge from here on (the job's own, to go on at this pace) asks again
        try:
            self.job()
        except Exception:  # as a housekeeping job's: logged, and the next look tries again
            logger.exception("celery-prio: %s failed", self.name)


__all__ = ["PACE_INTERVAL", "Soon"]
