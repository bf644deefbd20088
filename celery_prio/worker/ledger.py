"""What a worker is running, per tier, so the scheduler can be charged the real run time. Pure.

Celery gives no reliable "this request ended" callback for every path (a
revoke before it ran, a cancelled job), so the consumer asks Celery which
requests it still holds and settles every other one here. The clock is
passed in.
"""

from __future__ import annotations

from collections.abc import Container, Hashable
from typing import NamedTuple

from ..tiers import Tier


# Named tuples, not dataclasses: one of each is made per task a worker runs, and a frozen dataclass's
# ``__init__`` costs several times a tuple's.
class Entry(NamedTuple):
    tier: Tier
    started: float
    charge: float  # what the scheduler charged at dispatch (see TierScheduler.dispatched)
    queue: str | None = None  # the queue it came from, and what that queue was charged inside its tier
    queue_charge: float = 0.0
    waited: float | None = None  # seconds it waited from its publish to its fetch (None: unstamped)


class Settled(NamedTuple):
    tier: Tier
    runtime: float
    charge: float
    queue: str | None = None
    queue_charge: float = 0.0
    key: Hashable = None  # what was started (the worker: Celery's request)
    waited: float | None = None


class Ledger:
    def __init__(self) -> None:
        self._entries: dict[Hashable, Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def start(
        self,
        key: Hashable,
        tier: Tier,
        charge: float,
        now: float,
        queue: str | None = None,
        queue_charge: float = 0.0,
        waited: float | None = None,
    ) -> None:
        self._entries[key] = Entry(tier, now, charge, queue, queue_charge, waited)

    def settle(self, still_held: Container, now: float) -> list[Settled]:
        """Retire every entry whose key is no longer in ``still_held``; what each ran for."""
        entries = self._entries
        done = [key for key in entries if key not in still_held]
        out = []
        for key in done:
            tier, started, charge, queue, queue_charge, waited = entries.pop(key)
            out.append(Settled(tier, max(0.0, now - started), charge, queue, queue_charge, key, waited))
        return out

    def running(self, tier: Tier) -> int:
        return sum(1 for e in self._entries.values() if e.tier is tier)

    def overrun(self, now: float) -> dict[Tier, float]:
        """Per tier, run time of tasks still running beyond what the scheduler charged for them."""
        out: dict[Tier, float] = {}
        for e in self._entries.values():
            out[e.tier] = out.get(e.tier, 0.0) + max(0.0, now - e.started - e.charge)
        return out
