"""Queues that hold messages no worker will take: found, timed and reported. Pure (no broker, no Celery).

A tier's queues are served by every live worker that serves the tier (its
sub-queues and shortest-first queues come with it, found through the
sub-queue registry). So a queue is *unserved* when it holds messages and no
live worker serves its tier: a realtime queue with only ``-Q prio.batch``
workers up, or a tier whose workers all died. Left alone that is a silent
outage (the client keeps publishing, nothing runs), so it is reported once it
has lasted ``UNSERVED_AFTER`` seconds: by ``prio status``, in ``inspect
prio_stats``, as ``celery_prio_unserved_seconds{queue}`` and in a log line a
minute while it lasts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..settings import PrioSettings
from ..tiers import TIERS, Tier

#: Seconds a queue must hold messages with nobody serving its tier before it is reported
#: (a worker restarting, or a new sub-queue being found, is not an outage).
UNSERVED_AFTER = 3.0
#: Seconds between a worker's looks at the tiers it does not serve itself.
UNSERVED_CHECK_INTERVAL = 5.0
#: Seconds between log lines while something stays unserved (or a worker cannot discover sub-queues).
LOG_EVERY = 60.0


@dataclass(frozen=True)
class Unserved:
    """One queue with messages and no live worker serving its tier, for ``seconds`` so far."""

    queue: str
    tier: str
    depth: int
    seconds: float

    def as_dict(self) -> dict:
        return {"tier": self.tier, "depth": self.depth, "seconds": round(self.seconds, 1)}


def app_queues(
    settings: PrioSettings, subqueues: Iterable[str], tiers: Iterable[Tier] = TIERS, most: int = 200
) -> list[tuple[str, Tier]]:
    """Where ``tiers``' work waits: each tier queue, its front lane, and those of ``subqueues`` in them
    (at most ``most`` in all: a look stays cheap with thousands of tenants)."""
    tiers = list(tiers)
    lanes = settings.front_lanes()
    out = [(settings.queue_name(t), t) for t in tiers] + [(lanes[t], t) for t in tiers if t in lanes]
    for name in subqueues:
        tier = settings.tier_for_queue(name)
        if tier in tiers and settings.subqueue_of(name, tier) is not None:
            out.append((name, tier))
    return out[:most]


def unserved_now(depths: Iterable[tuple[str, Tier, int]], serving: Mapping[Tier, int]) -> list[tuple[str, Tier, int]]:
    """The queues among ``(queue, tier, depth)`` that hold messages while no live worker serves their tier."""
    return [(q, tier, depth) for q, tier, depth in depths if depth > 0 and serving.get(tier, 0) == 0]


class UnservedTracker:
    """Remembers since when each queue has been unserved; reports those past ``after`` seconds."""

    def __init__(self, after: float = UNSERVED_AFTER) -> None:
        self.after = after
        self._since: dict[str, float] = {}
        self.rows: list[Unserved] = []  # the last report (read by the worker report, any thread)

    def update(
        self, now: float, depths: Iterable[tuple[str, Tier, int]], serving: Mapping[Tier, int]
    ) -> list[Unserved]:
        current = unserved_now(depths, serving)
        names = {q for q, _, _ in current}
        self._since = {q: t for q, t in self._since.items() if q in names}
        rows = []
        for queue, tier, depth in current:
            since = self._since.setdefault(queue, now)
            if now - since >= self.after:
                rows.append(Unserved(queue, tier.label, depth, now - since))
        self.rows = rows
        return rows


class EveryMinute:
    """A log line at most every ``interval`` seconds while a condition lasts (and at once when it starts)."""

    def __init__(self, interval: float = LOG_EVERY) -> None:
        self.interval = interval
        self._last: float | None = None

    def due(self, now: float, active: bool) -> bool:
        if not active:
            self._last = None
            return False
        if self._last is None or now - self._last >= self.interval:
            self._last = now
            return True
        return False
