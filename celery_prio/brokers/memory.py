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
from typing import Any

from ..policy.served import ServedQueues
from ..settings import PrioSettings
from ..tiers import Tier
from .base import FetchSource, Take


@dataclass(frozen=True)
class Malformed:
    """An element the fetch source cannot read."""

    reason: str


class MemoryFetchSource(FetchSource):
    def __init__(self, served: ServedQueues, settings: PrioSettings) -> None:
        super().__init__(served, settings)
        self.queues: dict[str, deque[Any]] = defaultdict(deque)
        self.dead: list[tuple[Any, str, Tier]] = []

    def publish(self, queue: str, *messages: Any) -> None:
        self.queues[queue].extend(messages)

    def take(self, order: list[Tier]) -> Take:
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

    def dead_letter(self, message: Any, reason: str, tier: Tier) -> None:
        self.dead.append((message, reason, tier))
