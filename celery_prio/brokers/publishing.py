"""What ``install()`` and the publish path need of a broker, chosen from the broker URL.

Redis: capacity lives in an atomic publish script run by a kombu transport
subclass (``redis_transport``), which refuses with ``QueueFull`` itself.
RabbitMQ: capacity is queue arguments; a refusal reaches the publisher as a
confirm nack, translated here to ``QueueFull``.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from typing import Any

from kombu import Connection, Exchange, Queue

from ..errors import ConfigError, QueueFull
from ..settings import PrioSettings
from ..tiers import TIERS, Tier
from .redis_pruning import mention

logger = logging.getLogger(__name__)

REDIS_TRANSPORT_PATH = "celery_prio.brokers.redis_transport:Transport"
SENTINEL_PATH = "celery_prio.brokers.redis_transport:SentinelTransport"


class Publishing:
    """Broker-specific set-up of an app; the default is a no-op."""

    kind = "?"

    def __init__(self) -> None:
        self._subqueues: dict[str, Queue] = {}
        self._introduced_at: dict[str, float] = {}  # monotonic time each sub-queue was last made known
        self._subqueues_lock = threading.Lock()

    #: A sub-queue in use is introduced again this often (the registry may forget names unused for long).
    REINTRODUCE_AFTER = 24 * 3600.0

    def subqueue(self, app: Any, settings: PrioSettings, tier: Tier, subqueue: str) -> Queue:
        """The kombu Queue of a sub-queue, made known to the workers (and declared) on first use in this process."""
        name = settings.subqueue_name(tier, subqueue)
        queue = self._subqueues.get(name)
        if queue is None or time.monotonic() - self._introduced_at[name] > self.REINTRODUCE_AFTER:
            with self._subqueues_lock:
                queue = self._subqueues.get(name)
                if queue is None or time.monotonic() - self._introduced_at[name] > self.REINTRODUCE_AFTER:
                    # Before the first message: a worker serves the queue from that message on.
                    self.introduce_subqueue(app, settings, tier, name)
                    self._introduced_at[name] = time.monotonic()
                if queue is None:
                    from ..producer.routing import register_subqueue

                    register_subqueue(name)  # stamped like a tier queue
                    # Published through the default exchange, straight to the queue.
                    queue = self._subqueues[name] = Queue(name, Exchange(""), routing_key=name, no_declare=True)
        return queue

    def introduce_subqueue(self, app: Any, settings: PrioSettings, tier: Tier, name: str) -> None:
        """Create ``name`` where the broker needs it and let workers find it."""

    def check(self, settings: PrioSettings) -> None:
        """Refuse, before anything is declared, settings this broker cannot honour."""

    def queues(self, settings: PrioSettings) -> list[Queue]:
        """The three tier queues, declared like Celery's own (a direct exchange per queue)."""
        out = []
        for tier in TIERS:
            name = settings.queue_name(tier)
            out.append(Queue(name, Exchange(name, type="direct"), routing_key=name))
        return out

    def configure(self, app: Any, settings: PrioSettings, options: dict[str, Any]) -> None:
        """Adjust ``broker_transport_options`` (and the transport) for capacity."""

    def before_send(self, app: Any, settings: PrioSettings) -> None:
        """Called before every publish through the app (cheap after the first)."""

    def refusal(self, app: Any, settings: PrioSettings, tier: Tier, exc: BaseException) -> QueueFull | None:
        """``QueueFull`` when ``exc`` is this broker saying the tier is full; else None."""
        return None

    def publish_continuation(self, app: Any, settings: PrioSettings, continuation: Any) -> None:
        """Publish a sliced task's next run (``brokers.continuations.Continuation``) and record it atomically."""
        self.continuations.publish(app, settings, continuation)

    def committed_continuations(self, app: Any, settings: PrioSettings, task_id: str) -> int:
        """How many continuations of ``task_id`` were committed (a copy of an earlier generation is stale)."""
        return self.continuations.committed(app, settings, task_id)

    def waiting_in_tier(self, app: Any, settings: PrioSettings, tier: Tier) -> int:
        """Messages waiting in ``tier`` (queue and front lane), asked from a pool child (its own connection)."""
        return self.continuations.waiting(app, settings, tier)

    @property
    def continuations(self) -> Any:
        raise NotImplementedError("GPU time slices support Redis and RabbitMQ")

    def boost(self, app: Any, settings: PrioSettings, task_id: str, tier: Tier) -> Any:
        """Lift a queued task into ``tier`` (``brokers.base.Boost``), or None where this process cannot find it."""
        return self.booster.lift(app, settings, task_id, tier)

    #: Why a boost may find nothing (``Boost.detail`` of ``not_found``).
    boost_not_found = "not queued in this app's tier queues (unknown id, or running without task_track_started)"

    @property
    def booster(self) -> Any:
        raise NotImplementedError("celery_prio.boost supports Redis and RabbitMQ")

    def remember_publishes(self, settings: PrioSettings) -> None:
        """Called by ``install()``: keep what a boost from this process needs (RabbitMQ)."""

    def bulk_session(
        self, app: Any, connection: Any, settings: PrioSettings, tier: Tier, subqueue: str | None = None
    ) -> BulkSession:
        """A session that publishes chunks of prepared task messages to ``tier`` or one of its sub-queues
        (see ``celery_prio.bulk``)."""
        queue = None if subqueue is None else self.subqueue(app, settings, tier, subqueue).name
        return self.new_bulk_session(app, connection, settings, tier, queue)

    def new_bulk_session(
        self, app: Any, connection: Any, settings: PrioSettings, tier: Tier, queue: str | None
    ) -> BulkSession:
        raise NotImplementedError(f"bulk publish supports Redis and RabbitMQ, not {connection.transport.driver_type!r}")


def fast_json(value: Any) -> str:
    """The standard library's C encoder for plain data; kombu's (datetimes, UUIDs, ...) for the rest."""
    try:
        return json.dumps(value)
    except TypeError:
        from kombu.utils.json import dumps

        return dumps(value)


class BulkSession:
    """Publishes chunks of Celery task messages (``amqp.task_message``) to one tier queue."""

    #: Header fields that differ between the messages of one bulk publish (the rest is encoded once).
    VARIABLE_HEADERS = ("id", "root_id", "argsrepr", "kwargsrepr", "prio_enqueued_at", "group_index")

    def __init__(self, app: Any, connection: Any, settings: PrioSettings, tier: Tier, queue: str | None = None) -> None:
        self.app = app
        self.settings = settings
        self.tier = tier
        self.queue = queue or settings.queue_name(tier)  # the tier's queue, or one of its sub-queues
        self.cap = settings.max_length[tier] if queue is None else settings.subqueue_cap(tier)
        self.channel = connection.channel()
        self.serializer = app.conf.task_serializer or "json"

    def prepare(self, message: Any) -> Any:
        """The broker's own message for a Celery task message (as kombu's Producer would build it)."""
        from kombu.serialization import dumps

        content_type, content_encoding, body = dumps(message.body, serializer=self.serializer)
        properties = {k: v for k, v in message.properties.items() if v}  # no empty reply_to
        properties["delivery_mode"] = 2  # persistent, as Celery's default
        return self.channel.prepare_message(body, 0, content_type, content_encoding, message.headers, properties)

    def publish(self, messages: list[Any]) -> list[bool]:
        """Per message, whether the broker accepted it. Stops nothing: the caller reports refusals."""
        raise NotImplementedError

    # ``bulk`` publishes a chunk in three steps, so that it can build and encode the next chunk while
    # the broker takes this one: ``encode`` (no I/O), ``send`` (returns a ticket), ``collect`` (waits
    # for the broker's answer: per message, accepted or not). By default ``send`` publishes at once.
    def encode(self, messages: list[Any]) -> Any:
        return messages

    def send(self, encoded: Any) -> Any:
        return self.publish(encoded)

    def collect(self, ticket: Any) -> list[bool]:
        return ticket

    def queue_full(self, accepted: int) -> QueueFull:
        """The error for a chunk the tier did not take whole."""
        raise NotImplementedError


class RedisPublishing(Publishing):
    kind = "redis"

    def introduce_subqueue(self, app: Any, settings: PrioSettings, tier: Tier, name: str) -> None:
        # Every fetch script call returns the registry's version: a worker re-reads the set when it moved.
        with app.connection_for_write() as conn:
            client = conn.default_channel.client
            if client.sadd(settings.subqueue_registry, name):
                client.incr(settings.subqueue_registry_version)
            mention(client, settings, "subqueues", [name])  # in use: not pruned for prio_prune_after

    @functools.cached_property
    def continuations(self) -> Any:
        from .continuations import RedisContinuations

        return RedisContinuations()

    @functools.cached_property
    def booster(self) -> Any:
        from .redis_boost import RedisBooster

        return RedisBooster(self.continuations)

    def configure(self, app: Any, settings: PrioSettings, options: dict[str, Any]) -> None:
        # Capacity on Redis lives in an atomic publish script (kombu's Redis
        # transport has no max-length); the subclass runs it for tier queues.
        use_capped_redis_transport()
        options["prio_caps"] = {
            settings.queue_name(t): [cap, settings.overflow[t], t.label]
            for t, cap in settings.max_length.items()
            if cap is not None
        }
        # Every sub-queue of a tier (``<prefix>.<tier>.<name>``) has this cap.
        options["prio_subqueue_caps"] = {
            settings.queue_name(t) + ".": [settings.subqueue_cap(t), settings.overflow[t], t.label]
            for t in TIERS
            if settings.subqueue_cap(t) is not None
        }
        options["prio_dead_queue"] = settings.dead_letter_queue
        options["prio_stats_key"] = settings.stats_key
        options["prio_owners_key"] = settings.owners_key
        options["prio_wait_replicas"] = settings.wait_replicas
        # This app's in-flight messages in keys of its own: kombu's visibility-timeout restore (which
        # every Redis worker runs) then scans only them, never another app's messages in the same db.
        for name in ("unacked_key", "unacked_index_key", "unacked_mutex_key"):
            options.setdefault(name, f"{settings.queue_prefix}.{name.removesuffix('_key')}")

    def new_bulk_session(
        self, app: Any, connection: Any, settings: PrioSettings, tier: Tier, queue: str | None
    ) -> BulkSession:
        from .redis_transport import RedisBulkSession

        return RedisBulkSession(app, connection, settings, tier, queue)


class AmqpPublishing(Publishing):
    kind = "amqp"

    def __init__(self) -> None:
        super().__init__()
        self._declared = threading.Event()

    def introduce_subqueue(self, app: Any, settings: PrioSettings, tier: Tier, name: str) -> None:
        # Declared with the tier's aging and the sub-queue's cap, then appended to the registry stream
        # that every worker follows (brokers/amqp_registry.py): no management API needed.
        from .amqp import declare_subqueue
        from .amqp_registry import announce

        self.before_send(app, settings)
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=3)
            channel = declare_subqueue(conn.channel(), settings, tier, name)
            announce(channel, settings, name)

    @functools.cached_property
    def continuations(self) -> Any:
        from .continuations import AmqpContinuations

        return AmqpContinuations()

    boost_not_found = (
        "not among the tasks this process published lately: on RabbitMQ a task is boosted from the process "
        "that published it (prio_boost_memory), or it runs without task_track_started"
    )

    @functools.cached_property
    def booster(self) -> Any:
        from .amqp_boost import AmqpBooster

        return AmqpBooster()

    def remember_publishes(self, settings: PrioSettings) -> None:
        """Keep this process's recent batch/offline messages: what a boost here republishes."""
        from celery import signals

        from .amqp_boost import recent_publishes

        recent_publishes.watch(settings)
        signals.before_task_publish.connect(recent_publishes.before_publish, weak=False, dispatch_uid="prio.recent")
        signals.after_task_publish.connect(recent_publishes.after_publish, weak=False, dispatch_uid="prio.recent")

    def check(self, settings: PrioSettings) -> None:
        tier = Tier.BATCH  # the only tier that both receives promotions and can age
        if settings.overflow[tier] == "drop_oldest" and settings.aging[tier] is not None:
            raise ConfigError(
                f"prio_overflow[{tier.label}]='drop_oldest' with prio_aging[{tier.label}]="
                f"{settings.aging[tier]!r} is not supported on RabbitMQ: a message promoted into "
                f"{tier.label} could not be told apart from an evicted one. Use 'reject', or "
                f"prio_aging[{tier.label}]=None"
            )

    def queues(self, settings: PrioSettings) -> list[Queue]:
        from .amqp import tier_queue  # carries the capacity and aging queue arguments

        return [tier_queue(settings, tier) for tier in TIERS]

    def configure(self, app: Any, settings: PrioSettings, options: dict[str, Any]) -> None:
        if any(settings.max_length[t] is not None and settings.overflow[t] == "reject" for t in TIERS):
            # A full reject-publish queue only tells a publisher that uses confirms
            # (one broker round trip per publish: the price of never losing one).
            options["confirm_publish"] = True
        if settings.queue_type == "quorum":
            # Replicated queues are chosen so that nothing accepted is lost: a publish is accepted when
            # a majority of the queue's nodes have it, which only a confirm tells.
            options["confirm_publish"] = True

    def before_send(self, app: Any, settings: PrioSettings) -> None:
        if not self._declared.is_set():
            from .amqp import declare_tier_queues

            with app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=3)
                declare_tier_queues(conn.channel(), settings)
            self._declared.set()

    def new_bulk_session(
        self, app: Any, connection: Any, settings: PrioSettings, tier: Tier, queue: str | None
    ) -> BulkSession:
        from .amqp import AmqpBulkSession

        self.before_send(app, settings)
        return AmqpBulkSession(app, connection, settings, tier, queue)

    def refusal(self, app: Any, settings: PrioSettings, tier: Tier, exc: BaseException) -> QueueFull | None:
        from amqp.exceptions import MessageNacked

        from .amqp import refusal_figures

        seen = set()
        while exc is not None and id(exc) not in seen:
            if isinstance(exc, MessageNacked):
                from ..producer.admission import last_route

                depth, rate = refusal_figures(app, settings, tier, getattr(last_route, "queue", None))
                return QueueFull.from_drain_rate(tier, depth, rate)
            seen.add(id(exc))
            exc = exc.__cause__ or exc.__context__
        return None


def use_capped_redis_transport() -> None:
    """Point kombu's ``redis``/``rediss`` names at our transport subclass.

    Through kombu's own alias table rather than ``broker_transport``: URLs keep
    their ``redis://`` scheme, so tools that read the broker URL back (Flower's
    broker page, ``as_uri()`` in logs) still see Redis. The subclass differs
    only for queues named in ``prio_caps`` transport options, so other Redis
    connections in the process behave exactly as before.
    """
    from kombu import transport

    for name, path in (("redis", REDIS_TRANSPORT_PATH), ("rediss", REDIS_TRANSPORT_PATH), ("sentinel", SENTINEL_PATH)):
        if transport.TRANSPORT_ALIASES.get(name) != path:
            transport.TRANSPORT_ALIASES[name] = path
            transport._transport_cache.pop(name, None)  # a class resolved before install()


def publishing_for(app: Any) -> Publishing:
    """The broker's publish-side support, from the broker URL (no connection made)."""
    url = app.conf.broker_write_url or app.conf.broker_url or "amqp://"
    if isinstance(url, (list, tuple)):
        url = url[0]
    scheme = url.split("://", 1)[0]
    if scheme in ("redis", "rediss", "sentinel"):
        return RedisPublishing()
    if scheme in ("amqp", "amqps", "pyamqp"):
        return AmqpPublishing()
    kind = Connection(url).transport.driver_type
    return {"redis": RedisPublishing, "amqp": AmqpPublishing}.get(kind, Publishing)()
