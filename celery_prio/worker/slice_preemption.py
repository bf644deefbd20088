"""Telling running sliced tasks whom to yield to, and learning which running tasks wait on others.

Every ``SLICE_CHECK_INTERVAL`` while tasks run, and not at all while none
does (a task's start arms it again): an idle worker's event loop sleeps. A
change to the queues served is counted on the board there too. No
broker call here: the board is memory shared with the pool children, and a
sliced task asks the broker itself (``slices.py``), adding what this worker
holds in hand (RabbitMQ pushed it here: its queue no longer counts it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..policy.scheduler import TierScheduler
from ..tiers import Tier
from .fetchloop import FetchLoop
from .slice_board import SliceBoard

if TYPE_CHECKING:
    from kombu.asynchronous import Hub

#: How often the board tells running sliced tasks which tiers they yield to.
SLICE_CHECK_INTERVAL = 0.02
#: How long after a sliced task last looked at the board it still counts as running (elements should be much
#: shorter than this).
SLICE_ACTIVE_WINDOW = 10.0


class SlicePreemption:
    def __init__(
        self,
        board: SliceBoard,
        scheduler: TierScheduler,
        loop: FetchLoop,
        hub: Hub,
        held: Callable[[], Mapping[Tier, int]] = dict,
        served_version: Callable[[], int] = int,
    ) -> None:
        self.board, self.scheduler, self.loop, self.hub = board, scheduler, loop, hub
        self.held = held  # per tier, messages pushed to this worker that wait for a slot (the source's hand)
        self.served_version = served_version  # bumped whenever the queues served may have changed
        self._served_seen: int | None = None  # the version last counted on the board (None: none yet)
        self._timer: Any = None  # the next check, while tasks run

    def arm(self) -> None:
        """A task started: check from now on, while tasks run."""
        if self._timer is None and self.loop.active:
            self._timer = self.hub.call_later(SLICE_CHECK_INTERVAL, self._check)

    def stop(self) -> None:
        if self._timer is not None:
            self.hub.timer.cancel(self._timer)
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        served = self.served_version()
        if served != self._served_seen:  # a sub-queue found (or gone): a sliced run lists its tier's queues again
            self._served_seen = served
            self.board.queues_changed()
        blocked = self.board.waiting()
        if blocked != self.scheduler.blocked:  # a task began or ended waiting on others: its tier may take a slot
            self.scheduler.blocked = blocked
            self.loop.wake()
        sliced = self.board.active_tiers(time.monotonic() - SLICE_ACTIVE_WINDOW)
        preemptors = self.scheduler.preemptors(sliced, self.loop.ledger.overrun(self.loop.clock())) if sliced else {}
        self.board.set_preemptors(preemptors)
        if preemptors:
            self.board.set_held(self.held())
        if len(self.loop.ledger) and self.loop.active:
            self._timer = self.hub.call_later(SLICE_CHECK_INTERVAL, self._check)


__all__ = ["SLICE_ACTIVE_WINDOW", "SLICE_CHECK_INTERVAL", "SlicePreemption"]
