"""The producer's side of a broker, one object per app: :class:`Publisher` (chosen from the broker URL by
``install()``: tier queues, capacity, refusals, sub-queues) and the roles it hands out, each bound to it —
:class:`BulkSession` (chunks of one task's messages into one queue), :class:`Continuations` (a sliced task's
next run, published and recorded in one step), :class:`Booster` (lifting a queued task to a higher tier).

``brokers/redis/`` and ``brokers/amqp/`` implement them; nothing outside ``brokers/`` branches on the broker
kind. Reached at run time through the app's runtime (``celery_prio.runtime.publisher_of``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from celery import Celery
from celery.app.amqp import task_message
from kombu.connection import Connection
from kombu.entity import Exchange, Queue

from ..errors import QueueFull
from ..settings import PrioSettings
from ..tiers import TIERS, Tier
from .base import Boost

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Continuation:
    """The next run of a sliced task: ``send(producer=None, **publish_options)`` publishes it."""

    task_id: str
    generation: int
    send: Callable[..., None]
    tier: Tier
    enqueued_at: object  # the first publish's stamp, as the message carried it (checked before use)


class Bound:
    """A broker role bound to one app's publisher: its app and its current settings, read from there (``install()``
    may apply itself again with new settings; every role of the app then sees them)."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher

    @property
    def app(self) -> Celery:
        return self.publisher.app

    @property
    def settings(self) -> PrioSettings:
        return self.publisher.settings


class Continuations(Bound, ABC):
    """Sliced tasks' continuations: published and recorded in one step, so a stale copy knows it is stale."""

    @abstractmethod
    def publish(self, continuation: Continuation) -> None:
        """Publish ``continuation`` and record its generation as committed, atomically."""

    @abstractmethod
    def committed(self, task_id: str) -> int:
        """How many continuations of ``task_id`` were committed (a copy of an earlier generation is stale)."""

    def stale(self, task_id: str, generation: int, redelivered: bool, since: float = 0) -> bool:
        """Whether this copy of ``task_id`` (its ``generation``; ``redelivered``: given back or dead-lettered before;
        ``since``: its first publish's time, 0 if unknown) is older than a committed continuation: then acked unrun."""
        return (redelivered or generation > 0) and self.committed(task_id) > generation

    @abstractmethod
    def waiting(self, tier: Tier, changes: int | None = None) -> int:
        """Messages waiting in ``tier`` (its queues and front lane), asked from a pool child; ``changes``: the
        worker's count of changes to the queues it serves (``SliceBoard.queue_changes``)."""

    _ready_in = 0  # the process whose connection and sub-queue list ``ready`` set up

    def ready(self, changes: int | None = None) -> None:
        """Connect and list the sub-queues now, once per process: a sliced run's first check whether a higher
        tier waits is what a realtime call arriving mid-run waits on, and cold it costs a connection and, on
        RabbitMQ, a read of the registry stream (70 ms here). Asked as a sliced run starts, on its own time
        (``changes`` as for ``waiting``)."""
        if self.readied:
            return
        self._ready_in = os.getpid()
        try:
            self.waiting(Tier.REALTIME, changes)
        except Exception:  # the check itself tries again, and runs on while the broker is away
            logger.debug("celery-prio: could not ready this process's slice checks", exc_info=True)

    @property
    def readied(self) -> bool:
        """Whether this process has readied its slice checks (``ready``)."""
        return self._ready_in == os.getpid()


class Booster(Bound, ABC):
    """``celery_prio.boost``: lift a queued task into a higher tier's front lane."""

    @abstractmethod
    def lift(self, task_id: str, tier: Tier) -> Boost | None:
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
    """What ``install()`` and the publish path need of one app's broker; the base does nothing broker-specific.

    Made by ``install()`` for its app and bound to the app's settings (``bind``, again whenever ``install()``
    applies itself again); the roles it hands out (continuations, booster, bulk sessions) read both from it.
    """

    kind = "?"

    def __init__(self, app: Celery) -> None:
        self._app = weakref.ref(app)  # the runtime is kept per app, weakly: a publisher must not keep its app alive
        self._settings: PrioSettings | None = None
        self._subqueues: dict[str, Queue] = {}
        self._introduced_at: dict[str, float] = {}  # monotonic time each sub-queue was last made known
        self._subqueues_lock = threading.Lock()

    @property
    def app(self) -> Celery:
        app = self._app()
        if app is None:
            raise RuntimeError("celery-prio: the app this publisher was made for is gone")
        return app

    @property
    def settings(self) -> PrioSettings:
        if self._settings is None:
            raise RuntimeError("celery-prio: the publisher is not bound to settings yet (install() binds it)")
        return self._settings

    def bind(self, settings: PrioSettings) -> None:
        """The app's settings from now on (``install()``, and again when it applies itself again)."""
        self._settings = settings

    REINTRODUCE_AFTER = 24 * 3600.0  # a sub-queue in use is introduced again at least this often

    def reintroduce_after(self) -> float:
        """Well inside ``prio_prune_after``: a prune pass never drops a sub-queue publishers still use."""
        return min(self.REINTRODUCE_AFTER, self.settings.prune_after / 2)

    def subqueue(self, tier: Tier, subqueue: str) -> Queue:
        """The kombu Queue of a sub-queue, made known to the workers (and declared) on first use in this process."""
        name = self.settings.subqueue_name(tier, subqueue)
        queue = self._subqueues.get(name)
        every = self.reintroduce_after()
        if queue is None or time.monotonic() - self._introduced_at[name] > every:
            with self._subqueues_lock:
                queue = self._subqueues.get(name)
                if queue is None or time.monotonic() - self._introduced_at[name] > every:
                    # Before the first message: a worker serves the queue from that message on.
                    self.introduce_subqueue(tier, name)
                    self._introduced_at[name] = time.monotonic()
                if queue is None:
                    # Published through the default exchange, straight to the queue.
                    queue = self._subqueues[name] = Queue(name, Exchange(""), routing_key=name, no_declare=True)
        return queue

    def introduce_subqueue(self, tier: Tier, name: str) -> None:
        """Create ``name`` where the broker needs it and let workers find it."""

    def check(self) -> None:
        """Refuse, before anything is declared, settings this broker cannot honour."""

    def queues(self) -> list[Queue]:
        """The three tier queues, declared like Celery's own (a direct exchange per queue)."""
        return [Queue(n, Exchange(n, type="direct"), routing_key=n) for n in map(self.settings.queue_name, TIERS)]

    def configure(self, options: dict[str, object]) -> None:
        """Adjust ``broker_transport_options`` (and the transport) for capacity."""

    def before_send(self) -> None:
        """Called before every publish through the app (cheap after the first)."""

    def admit(self, tier: Tier, queue: str) -> None:
        """Raise ``QueueFull`` before a call to ``queue`` of ``tier`` is published if it would wait past the
        tier's ``prio_max_wait`` (RabbitMQ); Redis predicts the wait inside its publish script instead."""

    def refusal(self, tier: Tier, queue: str | None, exc: BaseException) -> QueueFull | None:
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

    def remember_publishes(self) -> None:
        """Called by ``install()``: keep what a boost from this process needs (RabbitMQ)."""

    def bulk_session(self, connection: Connection, tier: Tier, subqueue: str | None = None) -> BulkSession:
        """A session that publishes chunks of prepared task messages to ``tier`` or one of its sub-queues."""
        queue = None if subqueue is None else self.subqueue(tier, subqueue).name
        return self.new_bulk_session(connection, tier, queue)

    def new_bulk_session(self, connection: Connection, tier: Tier, queue: str | None) -> BulkSession:
        raise NotImplementedError(f"bulk publish supports Redis and RabbitMQ, not {connection.transport.driver_type!r}")
