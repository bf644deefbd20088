"""An in-process broker behind the worker interface, for fast tests (like dramatiq's stub broker).

The fetch loop, ledger and scheduler run together against it with a
simulated clock and event loop, without broker processes. It knows nothing
of kombu: a message is any object; a :class:`Malformed` one is moved to
``dead`` the way a real broker's fetch source moves an unreadable element.
Real-broker behaviour (atomic scripts, confirms, restores) is tested against
real Redis and RabbitMQ, not here.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..policy.served import ServedQueues
from ..settings import PrioSettings
from ..tiers import Tier
from .base import FetchSource, Take

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class Malformed:
    """An element the fetch source cannot read."""

    reason: str


class MemoryDoorbell:
    """The in-process broker's doorbells (as Redis' ``doorbell.py``): idle sources wait on their tiers, and each
    message put into a tier wakes the source that has waited longest on it."""

    def __init__(self) -> None:
        self.waiting: list[tuple[MemoryFetchSource, frozenset[Tier]]] = []

    def wait(self, source: MemoryFetchSource, tiers: list[Tier]) -> None:
        self.leave(source)
        self.waiting.append((source, frozenset(tiers)))

    def leave(self, source: MemoryFetchSource) -> None:
        self.waiting = [(s, t) for s, t in self.waiting if s is not source]

    def ring(self, tier: Tier) -> None:
        for i, (source, tiers) in enumerate(self.waiting):
            if tier in tiers:
                del self.waiting[i]
                source.on_arrival()
                return


class MemoryFetchSource(FetchSource[object]):
    def __init__(self, served: ServedQueues, settings: PrioSettings, doorbell: MemoryDoorbell | None = None) -> None:
        super().__init__(served, settings)
        self.queues: dict[str, deque[Any]] = defaultdict(deque)
        self.dead: list[tuple[Any, str, Tier]] = []
        self.doorbell = doorbell  # None: an idle source is polled, as before doorbells

    def publish(self, queue: str, *messages: Any) -> None:
        self.queues[queue].extend(messages)

    def wait_for_work(self, order: list[Tier]) -> bool:
        if self.doorbell is None:
            return False
        self.doorbell.wait(self, order)
        return True

    def take(self, order: list[Tier]) -> Take:
        if self.doorbell is not None:
            self.doorbell.leave(self)  # fetching: no longer waiting
        empty: list[Tier] = []
        passed: list[str] = []
        for tier in order:
            for candidate in self.served.candidates(tier):
                self.broker_calls += 1
                queue = self.queues.get(candidate.name)
                if not queue:
                    passed.append(candidate.name)
                    continue
                message = queue.popleft()
                if isinstance(message, Malformed):
                    self.dead.append((message, message.reason, tier))
                    return Take(dead_lettered=1, empty=tuple(empty), empty_queues=tuple(passed))
                return Take(tier, message, tuple(empty), 0, candidate.name, tuple(passed))
            empty.append(tier)
        return Take(empty=tuple(empty), empty_queues=tuple(passed))

    def dead_letter(self, message: object, reason: str, tier: Tier) -> None:
        self.dead.append((message, reason, tier))
