"""What the worker and the operator tools ask of a broker: the only interface outside ``brokers/``.

Two halves, one per connection:

* :class:`FetchSource` — bound to a worker consumer's own channel: takes the
  next message for an ordered list of tiers, copies unrunnable messages to
  the dead letters, names the housekeeping jobs the broker needs on the
  worker's event loop, and reads broker-wide figures for the worker report.
* :class:`Broker` — a connection of its own, for CLIs, exporters and tests:
  depths, counters, drain rates, oldest age, dead letters, aging.

``RedisFetchSource``/``RedisAdapter`` and ``AmqpFetchSource``/``AmqpAdapter``
implement them completely, ``MemoryFetchSource`` the first for fast tests;
nothing outside ``brokers/`` branches on the broker kind.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..policy.served import ServedQueues
from ..settings import PrioSettings
from ..tiers import Tier


@dataclass
class Take:
    """What one fetch found."""

    tier: Tier | None = None  # the tier the message came from
    message: Any = None  # a kombu Message, or None
    empty: tuple[Tier, ...] = ()  # tiers found empty on the way (the scheduler stops banking their time)
    dead_lettered: int = 0  # malformed elements moved to the dead letters instead: ask again at once
    queue: str | None = None  # the queue the message came from
    empty_queues: tuple[str, ...] = ()  # queues found empty on the way (their share stops banking time)


#: What ``celery_prio.boost`` can report (see :class:`Boost`).
BOOST_OUTCOMES = ("boosted", "already", "running", "finished", "not_found", "refused")


@dataclass(frozen=True)
class Boost:
    """What one ``celery_prio.boost(task, tier)`` did.

    ``boosted``: lifted into ``tier``'s front lane (from ``from_tier``'s
    ``queue``). ``already``: queued at ``tier`` or above, nothing to do.
    ``running``: a worker holds it (running, reserved or waiting for its
    ETA). ``finished``: its result is in. ``not_found``: not queued where this
    process can lift it, and not known to have started (``detail`` says why).
    ``refused``: not lifted because it could not be done safely (``detail``).
    """

    outcome: str
    task_id: str
    tier: Tier
    from_tier: Tier | None = None
    queue: str | None = None
    detail: str = ""

    @property
    def lifted(self) -> bool:
        return self.outcome == "boosted"


@dataclass(frozen=True)
class Job:
    """A housekeeping job the worker runs on its event loop every ``interval`` seconds."""

    interval: float
    run: Callable[[], None]
    name: str


@dataclass
class BrokerFigures:
    """Broker-wide figures a worker reports, read on its own loop (never from the metrics thread)."""

    counters: dict[str, int] | None = None  # None: the broker keeps none (RabbitMQ)
    oldest_age: dict[Tier, float | None] = field(default_factory=dict)  # at ``read_at``; None: unknown
    depth: dict[Tier, int] = field(default_factory=dict)  # waiting in the queues this worker serves, per tier
    read_at: float = 0.0
    dead_letters: int | None = None  # the dead-letter queue's length


class FetchSource(ABC):
    """The worker's side of a broker, on the consumer's channel."""

    #: The kombu channel the source fetches and acks on (Celery binds the worker's queues to it).
    channel: Any = None

    def __init__(self, served: ServedQueues, settings: PrioSettings) -> None:
        self.served = served
        self.settings = settings
        self.broker_calls = 0  # round trips made by take(); reported, and bounded while idle (tested)
        # For a source the broker pushes messages to: called when one arrives (the fetch loop then pumps),
        # and how many slots the worker has free (how many messages it may have coming).
        self.on_arrival: Callable[[], None] = lambda: None
        self.free_slots: Callable[[], int] = lambda: 1

    @abstractmethod
    def take(self, order: list[Tier]) -> Take:
        """The oldest message of the first tier in ``order`` that has one (promoted sub-queue first)."""

    @abstractmethod
    def dead_letter(self, message: Any, reason: str, tier: Tier) -> None:
        """Copy ``message`` untouched to ``<prefix>.dead`` with ``reason``; the caller then acks or rejects it."""

    #: Messages delivered to this worker that wait for a slot (a source the broker pushes to holds some).
    held = 0

    def stop(self) -> None:  # noqa: B027 - sources that hold nothing have nothing to give back
        """The worker stops fetching (warm shutdown, cancel): give back whatever the source holds."""

    def prepare_subqueues(self, names: list[str]) -> None:  # noqa: B027 - most brokers need nothing
        """Make sure the sub-queues ``names`` exist before they are asked (RabbitMQ: asking a missing one fails)."""

    #: Seconds between looks for new sub-queues, where the broker does not tell the worker of them itself.
    discovery_interval = 2.0
    #: True where one call asks all of a worker's queues (Redis' fetch script): the worker then serves the
    #: shortest-first queue of every task it has registered from the start, with no discovery at all.
    asks_all_queues_in_one_call = False
    #: Why this worker cannot find new sub-queues now, or None; reported with the worker's figures.
    discovery_problem: str | None = None

    def discover_subqueues(self) -> list[str] | None:
        """Every sub-queue published to (``<prefix>.<tier>.<name>``); None when the broker cannot say now."""
        return None

    def fleet_serving(self) -> dict[Tier, int] | None:
        """How many live workers serve each tier (this one included); None when the broker cannot say now."""
        return None

    def recover_own(self, held: set[str]) -> int:
        """After a reconnect: return to their queues the messages this process fetched on a connection that
        died and no longer holds (``held``: delivery tags it still runs or waits to run). How many."""
        return 0

    def join_fleet(self) -> list[list[Any]]:
        """Called before the first fetch: count this worker among those a boost asks; the boost records it
        must know (``[[task id, generation, at], ...]``, see ``superseded.py``). Only RabbitMQ needs any."""
        return []

    def housekeeping(self, dispatched: Callable[[], Mapping[Tier, int]]) -> list[Job]:
        """Jobs this broker needs on the worker's loop (``dispatched`` gives the counts per tier so far)."""
        return []

    def broker_figures(self, now: float) -> BrokerFigures:
        """Counters, oldest ages and depths, for the worker report. Called on the worker's loop."""
        return BrokerFigures(depth=self.served_depths(), read_at=now, dead_letters=self.dead_letter_depth())

    def dead_letter_depth(self) -> int | None:
        """Length of the dead-letter queue (read for the report and its metric)."""
        return self.queue_depths([self.settings.dead_letter_queue])[0]

    #: Queues per tier whose depth a worker reads for its report (a tier with more sub-queues: the first ones).
    DEPTH_QUEUES_PER_TIER = 50

    def served_depths(self) -> dict[Tier, int]:
        """Messages waiting per tier in the queues this worker serves (front lanes included)."""
        out: dict[Tier, int] = {}
        for tier in self.served.tiers:
            names = [c.name for c in self.served.candidates(tier)][: self.DEPTH_QUEUES_PER_TIER]
            out[tier] = sum(self.queue_depths(names))
        return out

    def queue_depths(self, names: list[str]) -> list[int]:
        """Depth of each of ``names`` (0 for one that does not exist)."""
        return [0 for _ in names]


class Broker(ABC):
    """A broker seen from outside a worker (CLI, exporter, tests), on a connection of its own."""

    kind = "?"

    def __init__(self, app: Any) -> None:
        self.app = app

    @abstractmethod
    def depth(self, queue: str) -> int:
        """Messages waiting in ``queue`` (not counting those held unacked by workers); 0 if it does not exist."""

    def depths(self, queues: list[str]) -> list[int]:
        """``depth`` of each queue."""
        return [self.depth(q) for q in queues]

    def subqueues(self, settings: PrioSettings) -> list[str]:
        """This app's sub-queues the broker knows of (``<prefix>.<tier>.<name>``)."""
        return []

    def serving(self, settings: PrioSettings) -> dict[Tier, int] | None:
        """How many live workers serve each tier; None where the broker cannot say."""
        return None

    def tier_depth(self, settings: PrioSettings, tier: Tier) -> int:
        """Messages waiting in ``tier``: its queue and its sub-queues (the front lane not counted)."""
        names = [settings.queue_name(tier)]
        names += [n for n in self.subqueues(settings) if settings.subqueue_of(n, tier) is not None]
        return sum(self.depth(n) for n in names)

    @abstractmethod
    def delete_queues(self, queues: list[str]) -> None:
        """Remove queues and everything in them (tests and ``prio purge``)."""

    def counters(self, settings: PrioSettings) -> dict[str, int] | None:
        """Broker-wide rejected/dropped/promoted/dead-lettered counts; None where the broker keeps none."""
        return None

    @abstractmethod
    def drain_rate(self, settings: PrioSettings, tier: Tier) -> float:
        """Messages per second leaving ``tier`` lately (0.0 when unknown)."""

    def oldest_age(self, queue: str, now: float) -> float | None:
        """Seconds the oldest message of ``queue`` has waited; None when empty or unknown."""
        return None

    @abstractmethod
    def dead_list(self, settings: PrioSettings, limit: int = 100) -> list[dict[str, Any]]:
        """Dead letters, oldest first: ``{"id", "task", "reason", "queue", "at"}``; never raises on bad entries."""

    @abstractmethod
    def dead_requeue(self, settings: PrioSettings, limit: int | None = None) -> tuple[int, int, int]:
        """Back to this app's tier queues only: ``(moved, left, skipped)``; stops at a full tier."""

    @abstractmethod
    def dead_purge(self, settings: PrioSettings) -> int:
        """Delete every dead letter; how many there were."""

    def promote_aged(self, settings: PrioSettings, tier: Tier, now: float) -> int:
        """One aging pass over ``tier``; 0 where the broker ages by itself (RabbitMQ)."""
        return 0

    @abstractmethod
    def close(self) -> None:
        """Release connections."""
