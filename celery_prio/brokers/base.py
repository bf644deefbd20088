"""What the rest of celery-prio asks of a broker: one typed interface per role, the only one outside ``brokers/``.

* :class:`FetchSource` — what the fetch loop needs of a source of messages;
  :class:`BrokerFetchSource` — a worker's side of a real broker, on its
  consumer's channel: the next message for an ordered list of tiers, dead
  letters, discovery, the fleet, the broker's housekeeping jobs, broker-wide
  figures for the worker report. Required methods are abstract; the few
  optional capabilities say what a broker without them does.
* :class:`Broker` — operators' side (CLI, exporters, tests), on a connection
  of its own: depths, counters, drain rates, dead letters, aging.
* The producer's side (one ``Publisher`` per app and the roles it hands out)
  is in ``brokers/publishing.py``.

``brokers/redis/`` and ``brokers/amqp/`` implement them all,
``brokers/memory.py`` the fetch source for fast tests; nothing outside
``brokers/`` branches on the broker kind, and the two brokers' packages never
import each other. A fetch source is generic in its messages: kombu's on real
brokers, anything in the memory broker.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from celery import Celery
from kombu.asynchronous import Hub
from kombu.message import Message

from ..policy.served import ServedQueues
from ..settings import PrioSettings
from ..tiers import Tier

#: A boost record a worker must know before its first fetch: ``[task id, generation, at]`` (``superseded.py``).
BoostRecord = list[str | int | float]


@dataclass
class Take:
    """What one fetch found."""

    tier: Tier | None = None  # the tier the message came from
    message: object = None  # a kombu Message, or None
    empty: tuple[Tier, ...] = ()  # tiers found empty on the way (the scheduler stops banking their time)
    dead_lettered: int = 0  # malformed elements moved to the dead letters instead: ask again at once
    queue: str | None = None  # the queue the message came from
    empty_queues: tuple[str, ...] = ()  # queues found empty on the way (their share stops banking time)


#: What ``celery_prio.boost`` can report (see :class:`Boost`).
BOOST_OUTCOMES = ("boosted", "already", "running", "finished", "not_found", "refused")


@dataclass(frozen=True)
class Boost:
    """What one ``celery_prio.boost(task, tier)`` did.

    ``boosted``: lifted into ``tier``'s front lane (from ``from_tier``'s ``queue``). ``already``: queued at
    ``tier`` or above, nothing to do. ``running``: a worker holds it (running, reserved or waiting for its ETA).
    ``finished``: its result is in. ``not_found``: not queued where this process can lift it, and not known to
    have started (``detail`` says why). ``refused``: not lifted: ``tier`` is full, or it could not be done safely.
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

    counters: dict[str, int] | None = None  # None: the broker keeps none
    kept: tuple[str, ...] | None = None  # the counters it keeps (None: all; RabbitMQ keeps the refusals only)
    oldest_age: dict[Tier, float | None] = field(default_factory=dict)  # at ``read_at``; None: unknown
    depth: dict[Tier, int] = field(default_factory=dict)  # waiting in the queues this worker serves, per tier
    read_at: float = 0.0
    dead_letters: int | None = None  # the dead-letter queue's length


#: The messages a fetch source hands out.
M = TypeVar("M")

MAX_ANNOUNCED_TASKS = 10_000  # task names one worker records in the fleet's directory (announce_tasks)


class FetchSource(ABC, Generic[M]):
    """What the fetch loop needs of a source of messages: a broker's (:class:`BrokerFetchSource`), or the
    in-memory one of the simulator and the fast tests (``brokers/memory.py``)."""

    #: The kombu channel the source fetches and acks on (Celery binds the worker's queues to it).
    channel: object = None

    def __init__(self, served: ServedQueues, settings: PrioSettings) -> None:
        self.served = served
        self.settings = settings
        self.broker_calls = 0  # round trips made by take(); reported, and bounded while idle (tested)
        self.slots = 1  # the worker's concurrency: the fleet's slots per tier predict a call's wait (admission)
        # For a source the broker pushes messages to: called when one arrives (the fetch loop then pumps),
        # and how many slots the worker has free (how many messages it may have coming).
        self.on_arrival: Callable[[], None] = lambda: None
        self.free_slots: Callable[[], int] = lambda: 1
        # A message of a known tier was pushed (the fetch loop may leave it until a slot frees).
        self.on_delivery: Callable[[Tier], None] = lambda tier: self.on_arrival()
        self.starts_within: Callable[[float, Tier], int] = lambda seconds, tier: self.free_slots()

    @abstractmethod
    def take(self, order: list[Tier]) -> Take:
        """The oldest message of the first tier in ``order`` that has one (promoted sub-queue first)."""

    @abstractmethod
    def dead_letter(self, message: M, reason: str, tier: Tier) -> None:
        """Copy ``message`` untouched to ``<prefix>.dead`` with ``reason``; the caller then acks or rejects it."""

    @abstractmethod
    def wait_for_work(self, order: list[Tier]) -> bool:
        """Every queue of ``order`` was empty: wait on the broker and call ``on_arrival`` when work may have
        come (or after about a second). False where this source cannot: the fetch loop polls instead."""

    #: Capability of a source the broker pushes messages to (RabbitMQ's consumers): messages delivered to this
    #: worker that wait for a slot. A source that only pulls holds none.
    held = 0

    def held_by_tier(self) -> Mapping[Tier, int]:
        """``held`` per tier: a sliced task asks the broker whether a tier waits, and these are not in its queues
        any more (delivered, unacked), so the worker tells it through the slice board."""
        return {}

    def stop(self) -> None:
        """The worker stops fetching (warm shutdown, cancel): give back whatever the source holds."""


class BrokerFetchSource(FetchSource[Message]):
    """The worker's side of a real broker, on the consumer's channel: what the worker's runtime needs beyond
    the fetch loop's contract. Every method without a body is required; the few with one are capabilities
    that some brokers lack, and their body says what a broker without them does."""

    @abstractmethod
    def attach_loop(self, hub: Hub) -> None:
        """The worker's event loop (kombu's Hub): the source waits on the broker on it while idle."""

    @abstractmethod
    def take_more(self, queue: str, tier: Tier, count: int, task: str, max_bytes: int = 0) -> list[Message]:
        """A batch's top-up: up to ``count`` more messages of ``task`` from ``queue`` (about ``max_bytes`` of them
        at most, 0: no bound), oldest first, each recorded as this worker's like any fetch (none: an empty list)."""

    @abstractmethod
    def discover_subqueues(self) -> list[str] | None:
        """Every sub-queue published to (``<prefix>.<tier>.<name>``); None when the broker cannot say now."""

    @abstractmethod
    def fleet_serving(self) -> dict[Tier, int] | None:
        """How many live workers serve each tier (this one included); None when the broker cannot say now."""

    @abstractmethod
    def announce_tasks(self, names: list[str]) -> None:
        """Record in the broker's task directory that a worker of this fleet registered the tasks ``names``."""

    @abstractmethod
    def fleet_knows_task(self, name: str) -> bool:
        """Whether a worker of this fleet ever registered ``name`` (False: it is dead-lettered)."""

    @abstractmethod
    def join_fleet(self) -> list[BoostRecord]:
        """Called before the first fetch: count this worker among those a boost asks; the boost records it
        must know (``[[task id, generation, at], ...]``, see ``superseded.py``)."""

    @abstractmethod
    def queue_depths(self, names: list[str]) -> list[int]:
        """Depth of each of ``names`` (0 for one that does not exist)."""

    #: Seconds between looks for new sub-queues, where the broker does not tell the worker of them itself.
    discovery_interval: float = 2.0
    #: True where one call asks all of a worker's queues (Redis' fetch script): the worker then serves the
    #: shortest-first queue of every task it has registered from the start, with no discovery at all.
    asks_all_queues_in_one_call = False
    #: Why this worker cannot find new sub-queues now, or None; reported with the worker's figures.
    discovery_problem: str | None = None

    def prepare_subqueues(self, names: list[str]) -> None:
        """Capability of a broker on which asking a queue that does not exist fails (RabbitMQ): create the
        sub-queues ``names`` before they are asked. Elsewhere nothing to do."""

    def recover_own(self, held: set[str]) -> int:
        """Capability of a broker that does not give a dead connection's messages back by itself (Redis): after
        a reconnect, return to their queues the messages this process fetched on the connection that died and
        no longer holds (``held``: delivery tags it still runs or waits to run). How many. Elsewhere 0."""
        return 0

    def housekeeping(self, dispatched: Callable[[], Mapping[Tier, int]]) -> list[Job]:
        """Capability of a broker whose fleet-wide jobs the workers run (Redis: aging, recovery, pruning):
        the jobs for the worker's loop (``dispatched`` gives the counts per tier so far). None where the
        broker does them itself (RabbitMQ: TTLs, dead-letter exchanges, stream retention)."""
        return []

    def broker_figures(self, now: float, idle: bool = False) -> BrokerFigures:
        """Counters, oldest ages and depths, for the worker report. Called on the worker's loop. ``idle``: the
        worker found every queue it serves empty and waits on the broker, so their depths are not asked."""
        depth = dict.fromkeys(self.served.tiers, 0) if idle else self.served_depths()
        return BrokerFigures(depth=depth, read_at=now, dead_letters=self.dead_letter_depth())

    def dead_letter_depth(self) -> int | None:
        """Length of the dead-letter queue (read for the report and its metric)."""
        return self.queue_depths([self.settings.dead_letter_queue])[0]

    #: Queues per tier whose depth a worker reads for its report (a tier with more sub-queues: the first ones).
    DEPTH_QUEUES_PER_TIER = 50

    def served_depths(self) -> dict[Tier, int]:
        """Messages waiting per tier in the queues this worker serves (front lanes included)."""
        asked = [
            (t, c.name) for t in self.served.tiers for c in self.served.candidates(t)[: self.DEPTH_QUEUES_PER_TIER]
        ]
        out: dict[Tier, int] = dict.fromkeys(self.served.tiers, 0)
        for (tier, _), depth in zip(asked, self.queue_depths([name for _, name in asked]), strict=True):
            out[tier] += depth  # one read for every tier: one probe, not one per tier
        return out


class Broker(ABC):
    """A broker seen from outside a worker (CLI, exporter, tests), on a connection of its own."""

    kind = "?"

    def __init__(self, app: Celery) -> None:
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
    def dead_list(self, settings: PrioSettings, limit: int = 100) -> list[dict[str, object]]:
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
