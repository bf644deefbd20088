"""Which queues a worker serves, grouped by tier, in the order it asks them. Pure.

A worker consumes the tier queues its ``-Q`` names (plus any queue added at
run time). Inside a tier the queues are asked round robin; a tier that
receives promotions (aging) has a ``.promoted`` sub-queue that is asked
first, oldest first, on both brokers. Queues that are not tier queues count
as sub-queues of the default tier.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .settings import PrioSettings
from .tiers import TIERS, Tier

#: Aging moves batch -> realtime and offline -> batch.
AGING_TIERS = (Tier.BATCH, Tier.OFFLINE)


@dataclass(frozen=True)
class Candidate:
    """One queue to ask for ``tier``'s next message."""

    tier: Tier
    name: str
    position: int | None  # place in the tier's round robin; None for the promoted sub-queue


class ServedQueues:
    def __init__(self, settings: PrioSettings, names: Iterable[str] = ()) -> None:
        self.settings = settings
        self.names: list[str] = []
        self._rr = dict.fromkeys(TIERS, 0)
        self.set_names(names)

    def tier_of(self, name: str) -> Tier:
        tier = self.settings.tier_for_queue(name)
        return self.settings.default_tier if tier is None else tier

    def set_names(self, names: Iterable[str]) -> None:
        self.names = list(dict.fromkeys(names))
        self.by_tier = {t: [n for n in self.names if self.tier_of(n) is t] for t in TIERS}
        for tier in TIERS:
            self._rr[tier] %= max(len(self.by_tier[tier]), 1)
        self.promoted = {
            tier: lane
            for tier, lane in self.settings.front_lanes().items()
            if self.settings.queue_name(tier) in self.by_tier[tier]
        }

    @property
    def tiers(self) -> list[Tier]:
        """Tiers with at least one served queue."""
        return [t for t in TIERS if self.by_tier[t]]

    def all_names(self) -> list[str]:
        """Every queue a fetch may ask, promoted sub-queues included."""
        return self.names + list(self.promoted.values())

    def candidates(self, tier: Tier) -> list[Candidate]:
        """``tier``'s queues in asking order: promoted first, then round robin from the next in turn."""
        out = [Candidate(tier, self.promoted[tier], None)] if tier in self.promoted else []
        queues = self.by_tier[tier]
        start = self._rr[tier]
        for i in range(len(queues)):
            position = (start + i) % len(queues)
            out.append(Candidate(tier, queues[position], position))
        return out

    def took(self, candidate: Candidate) -> None:
        """A message came from ``candidate``: the next fetch of its tier starts after it."""
        if candidate.position is not None:
            self._rr[candidate.tier] = (candidate.position + 1) % len(self.by_tier[candidate.tier])
