"""What the rest of celery-prio asks of a broker: one typed interface per role, the only one outside ``brokers/``.

* :class:`FetchSource` — a worker's side, on its consumer's channel: the
  next message for an ordered list of tiers, dead letters, the broker's
  housekeeping jobs, broker-wide figures for the worker report.
* :class:`Broker` — operators' side (CLI, exporters, tests), on a connection
  of its own: depths, counters, drain rates, dead letters, aging.
* :class:`Publisher` — the producer's side, chosen from the broker URL by
  ``install()``: tier queues, capacity, refusals, sub-queues, and the three
  roles below.
* :class:`BulkSession` (chunks of one task's messages into one queue),
  :class:`Continuations` (a sliced task's next run, published and recorded
  in one step), :class:`Booster` (lifting a queued task to a higher tier).

``brokers/redis/`` and ``brokers/amqp/`` implement them all,
``brokers/memory.py`` the fetch source for fast tests; nothing outside
``brokers/`` branches on the broker kind, and the two brokers' packages never
import each other. Messages are opaque here (``object``): kombu's on real
brokers, anything in the memory broker.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from celery import Celery
from celery.app.amqp import task_message
from kombu import Connection, Exchange, Queue

from ..errors import QueueFull
from ..policy.served import ServedQueues
from ..settings import PrioSettings
from ..tiers import TIERS, Tier

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

    counters: dict[str, int] | None = None  # None: the broker keeps none (RabbitMQ)
    oldest_age: dict[Tier, float | None] = field(default_factory=dict)  # at ``read_at``; None: unknown
    depth: dict[Tier, int] = field(default_factory=dict)  # waiting in the queues this worker serves, per tier
    read_at: float = 0.0
    dead_letters: int | None = None  # the dead-letter queue's length


MAX_ANNOUNCED_TASKS = 10_000  # task names one worker records in the fleet's directory (announce_tasks)


class FetchSource(ABC):
    """The worker's side of a broker, on the consumer's channel."""

    #: The kombu channel the source fetches and acks on (Celery binds the worker's queues to it).
    channel: object = None

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
    def dead_letter(self, message: object, reason: str, tier: Tier) -> None:
        """Copy ``message`` untouched to ``<prefix>.dead`` with ``reason``; the caller then acks or rejects it."""

    #: Messages delivered to this worker that wait for a slot (a source the broker pushes to holds some).
    held = 0

    def stop(self) -> None:  # noqa: B027 - sources that hold nothing have nothing to give back
        """The worker stops fetching (warm shutdown, cancel): give back whatever the source holds."""

    def attach_loop(self, hub: object) -> None:  # noqa: B027 - a source that never blocks needs no loop
        """The worker's event loop (kombu's Hub), for a source that waits on the broker while idle."""

    def take_more(self, queue: str, tier: Tier, count: int, task: str, max_bytes: int = 0) -> list[object]:
        """A batch's top-up: up to ``count`` more messages of ``task`` from ``queue`` (about ``max_bytes`` of them
        at most, 0: no bound), oldest first, each recorded as this worker's like any fetch (none: an empty list)."""
        return []

    def wait_for_work(self, order: list[Tier]) -> bool:
        """Every queue of ``order`` was empty: wait on the broker and call ``on_arrival`` when work may have
        come (or after about a second). False where this source cannot: the fetch loop polls instead."""
        return False

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

    def announce_tasks(self, names: list[str]) -> None:  # noqa: B027 - a broker without a directory keeps none
        """Record in the broker's task directory that a worker of this fleet registered the tasks ``names``."""

    def fleet_knows_task(self, name: str) -> bool:
        """Whether a worker of this fleet ever registered ``name`` (False: no directory; it is dead-lettered)."""
        return False

    def recover_own(self, held: set[str]) -> int:
        """After a reconnect: return to their queues the messages this process fetched on a connection that
        died and no longer holds (``held``: delivery tags it still runs or waits to run). How many."""
        return 0

    def join_fleet(self) -> list[BoostRecord]:
        """Called before the first fetch: count this worker among those a boost asks; the boost records it
        must know (``[[task id, generation, at], ...]``, see ``superseded.py``). Only RabbitMQ needs any."""
        return []

    def housekeeping(self, dispatched: Callable[[], Mapping[Tier, int]]) -> list[Job]:
        """Jobs this broker needs on the worker's loop (``dispatched`` gives the counts per tier so far)."""
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


@dataclass(frozen=True)
class Continuation:
    """The next run of a sliced task: ``send(producer=None, **publish_options)`` publishes it."""

    task_id: str
    generation: int
    send: Callable[..., None]
    tier: Tier
    enqueued_at: object  # the first publish's stamp, as the message carried it (checked before use)


class Continuations(ABC):
    """Sliced tasks' continuations: published and recorded in one step, so a stale copy knows it is stale."""

    @abstractmethod
    def publish(self, app: Celery, settings: PrioSettings, continuation: Continuation) -> None:
        """Publish ``continuation`` and record its generation as committed, atomically."""

    @abstractmethod
    def committed(self, app: Celery, settings: PrioSettings, task_id: str) -> int:
        """How many continuations of ``task_id`` were committed (a copy of an earlier generation is stale)."""

    def stale(
        self, app: Celery, settings: PrioSettings, task_id: str, generation: int, redelivered: bool, since: float = 0
    ) -> bool:
        """Whether this copy of ``task_id`` (its ``generation``; ``redelivered``: given back or dead-lettered before;
        ``since``: its first publish's time, 0 if unknown) is older than a committed continuation: then acked unrun."""
        return (redelivered or generation > 0) and self.committed(app, settings, task_id) > generation

    @abstractmethod
    def waiting(self, app: Celery, settings: PrioSettings, tier: Tier) -> int:
        """Messages waiting in ``tier`` (its queues and front lane), asked from a pool child."""


class Booster(ABC):
    """``celery_prio.boost``: lift a queued task into a higher tier's front lane."""

    @abstractmethod
    def lift(self, app: Celery, settings: PrioSettings, task_id: str, tier: Tier) -> Boost | None:
        """What the boost did, or None where this process cannot find the task."""


class BulkSession(ABC):
    """Publishes chunks of Celery task messages (``amqp.task_message``) to one tier queue or sub-queue.

    ``bulk`` publishes a chunk in three steps, so that it can build and encode
    the next chunk while the broker takes this one: ``encode`` (no I/O),
    ``send`` (returns a ticket), ``collect`` (waits for the broker's answer:
    per message, accepted or not). By default ``send`` publishes at once.
    """

    #: Header fields that differ between the messages of one bulk publish (the rest is encoded once).
    VARIABLE_HEADERS = ("id", "root_id", "argsrepr", "kwargsrepr", "prio_enqueued_at", "group_index")

    def __init__(
        self, app: Celery, connection: Connection, settings: PrioSettings, tier: Tier, queue: str | None = None
    ) -> None:
        self.app = app
        self.settings = settings
        self.tier = tier
        self.queue = queue or settings.queue_name(tier)  # the tier's queue, or one of its sub-queues
        self.cap = settings.max_length[tier] if queue is None else settings.subqueue_cap(tier)
        self.channel = connection.channel()
        self.serializer = app.conf.task_serializer or "json"

    def prepare(self, message: task_message) -> object:
        """The broker's own message for a Celery task message (as kombu's Producer would build it)."""
        from kombu.serialization import dumps

        content_type, content_encoding, body = dumps(message.body, serializer=self.serializer)
        properties = {k: v for k, v in message.properties.items() if v}  # no empty reply_to
        properties["delivery_mode"] = 2  # persistent, as Celery's default
        return self.channel.prepare_message(body, 0, content_type, content_encoding, message.headers, properties)

    @abstractmethod
    def publish(self, messages: list[task_message]) -> list[bool]:
        """Per message, whether the broker accepted it. Stops nothing: the caller reports refusals."""

    def encode(self, messages: list[task_message]) -> object:
        return messages

    def send(self, encoded: object) -> object:
        return self.publish(encoded)  # type: ignore[arg-type]  # the default ticket is the messages

    def collect(self, ticket: object) -> list[bool]:
        return ticket  # type: ignore[return-value]  # the default ``send`` answered at once

    @abstractmethod
    def queue_full(self, accepted: int) -> QueueFull:
        """The error for a chunk the tier did not take whole."""


class Publisher:
    """What ``install()`` and the publish path need of a broker; the base does nothing broker-specific."""

    kind = "?"

    def __init__(self) -> None:
        self._subqueues: dict[str, Queue] = {}
        self._introduced_at: dict[str, float] = {}  # monotonic time each sub-queue was last made known
        self._subqueues_lock = threading.Lock()

    REINTRODUCE_AFTER = 24 * 3600.0  # a sub-queue in use is introduced again at least this often

    def reintroduce_after(self, settings: PrioSettings) -> float:
        """Well inside ``prio_prune_after``: a prune pass never drops a sub-queue publishers still use."""
        return min(self.REINTRODUCE_AFTER, settings.prune_after / 2)

    def subqueue(self, app: Celery, settings: PrioSettings, tier: Tier, subqueue: str) -> Queue:
        """The kombu Queue of a sub-queue, made known to the workers (and declared) on first use in this process."""
        name = settings.subqueue_name(tier, subqueue)
        queue = self._subqueues.get(name)
        every = self.reintroduce_after(settings)
        if queue is None or time.monotonic() - self._introduced_at[name] > every:
            with self._subqueues_lock:
                queue = self._subqueues.get(name)
                if queue is None or time.monotonic() - self._introduced_at[name] > every:
                    # Before the first message: a worker serves the queue from that message on.
                    self.introduce_subqueue(app, settings, tier, name)
                    self._introduced_at[name] = time.monotonic()
                if queue is None:
                    # Published through the default exchange, straight to the queue.
                    queue = self._subqueues[name] = Queue(name, Exchange(""), routing_key=name, no_declare=True)
        return queue

    def introduce_subqueue(self, app: Celery, settings: PrioSettings, tier: Tier, name: str) -> None:
        """Create ``name`` where the broker needs it and let workers find it."""

    def check(self, settings: PrioSettings) -> None:
        """Refuse, before anything is declared, settings this broker cannot honour."""

    def queues(self, settings: PrioSettings) -> list[Queue]:
        """The three tier queues, declared like Celery's own (a direct exchange per queue)."""
        return [Queue(n, Exchange(n, type="direct"), routing_key=n) for n in map(settings.queue_name, TIERS)]

    def configure(self, app: Celery, settings: PrioSettings, options: dict[str, object]) -> None:
        """Adjust ``broker_transport_options`` (and the transport) for capacity."""

    def before_send(self, app: Celery, settings: PrioSettings) -> None:
        """Called before every publish through the app (cheap after the first)."""

    def refusal(
        self, app: Celery, settings: PrioSettings, tier: Tier, queue: str | None, exc: BaseException
    ) -> QueueFull | None:
        """``QueueFull`` when ``exc`` is this broker saying ``tier`` (its ``queue``) is full; else None."""
        return None

    @property
    def continuations(self) -> Continuations:
        raise NotImplementedError("GPU time slices support Redis and RabbitMQ")

    @property
    def booster(self) -> Booster:
        raise NotImplementedError("celery_prio.boost supports Redis and RabbitMQ")

    #: Why a boost may find nothing (``Boost.detail`` of ``not_found``).
    boost_not_found = "not queued in this app's tier queues (unknown id, or running without task_track_started)"

    def remember_publishes(self, settings: PrioSettings) -> None:
        """Called by ``install()``: keep what a boost from this process needs (RabbitMQ)."""

    def bulk_session(
        self, app: Celery, connection: Connection, settings: PrioSettings, tier: Tier, subqueue: str | None = None
    ) -> BulkSession:
        """A session that publishes chunks of prepared task messages to ``tier`` or one of its sub-queues."""
        queue = None if subqueue is None else self.subqueue(app, settings, tier, subqueue).name
        return self.new_bulk_session(app, connection, settings, tier, queue)

    def new_bulk_session(
        self, app: Celery, connection: Connection, settings: PrioSettings, tier: Tier, queue: str | None
    ) -> BulkSession:
        raise NotImplementedError(f"bulk publish supports Redis and RabbitMQ, not {connection.transport.driver_type!r}")
