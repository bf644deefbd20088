"""How fast a worker starts each tier's tasks, counted over the last second. Pure: the caller passes the time.

What a pushed RabbitMQ queue may hold is the starts its tier is expected to get within a stated time: the pace
measured here, not a task's run time, because a slot's turns are shared with the other tiers (batch gets two of
every three on a worker draining batch and offline) and, on a loaded host, last longer than the task itself.
"""

from __future__ import annotations

from collections import deque

from ..tiers import Tier

#: Seconds of starts counted: long enough to hold a steady drain's pace, short enough to follow a change.
WINDOW = 1.0


class StartRates:
    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self._starts: dict[Tier, deque[float]] = {}

    def started(self, tier: Tier, now: float) -> None:
        starts = self._starts.setdefault(tier, deque())
        starts.append(now)
        self._forget_before(starts, now - self.window)

    def within(self, seconds: float, tier: Tier, now: float) -> int:
        """Starts of ``tier`` expected within ``seconds`` at the pace of the last ``window`` (0: none lately)."""
        starts = self._starts.get(tier)
        if not starts:
            return 0
        self._forget_before(starts, now - self.window)
        return int(len(starts) * seconds / self.window)

    @staticmethod
    def _forget_before(starts: deque[float], since: float) -> None:
        while starts and starts[0] < since:
            starts.popleft()
