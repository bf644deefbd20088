"""Continuations of sliced tasks: publish the next generation and record it in one atomic step.

A run that yields publishes its continuation and only then is its own
message acked. A crash between the two would leave two copies of the task:
the continuation and the redelivered original. So the broker also records,
atomically with the publish, how many continuations of the task id were
committed; a redelivered copy of an earlier generation then knows it is
stale and is acked without running (``slices._SliceRun.begin``).

* Redis: the continuation's LPUSH and ``SET <prefix>.slice.<id> <n>`` in one
  MULTI/EXEC (the transport's ``_put`` does both when a marker is pending).
* RabbitMQ: a marker queue ``<prefix>.slice.<id>`` (``x-expires``) and an AMQP
  transaction that publishes the continuation and one marker message
  together; the marker queue's message count is the committed count.

Markers expire after :data:`MARKER_TTL` seconds; a stale copy cannot be
redelivered later than that in practice (Redis: ``visibility_timeout``;
RabbitMQ: when the dead worker's connection closes).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..headers import SLICE_MARKER_SUFFIX
from ..settings import PrioSettings
from ..tiers import Tier

MARKER_TTL = 24 * 3600

#: (key, generation, ttl) for the next ``_put`` on this thread (Redis).
pending_marker = threading.local()


@dataclass(frozen=True)
class Continuation:
    """The next run of a sliced task: ``send(producer=None, **publish_options)`` publishes it."""

    task_id: str
    generation: int
    send: Callable[..., None]
    tier: Tier
    enqueued_at: Any


def marker_name(settings: PrioSettings, task_id: str) -> str:
    return f"{settings.queue_prefix}{SLICE_MARKER_SUFFIX}{task_id}"


class _ProcessConnection:
    """One broker connection per process (pool children are forked: never share the parent's socket)."""

    transport_options: dict[str, Any] = {}

    def __init__(self) -> None:
        self._conn: Any = None
        self._pid = 0

    def connection(self, app: Any) -> Any:
        if self._conn is None or self._pid != os.getpid():
            self._conn = app.connection_for_write(transport_options=self.transport_options)
            self._pid = os.getpid()
        return self._conn

    def forget(self) -> None:
        self._conn = None  # reconnect on the next call

    _subqueues: tuple[float, list[str]] | None = None

    def subqueues(self, app: Any, settings: PrioSettings) -> list[str]:
        """This app's sub-queues (listed, and realtime's shortest-first ones), at most every
        ``SUBQUEUE_LIST_TTL`` seconds per process: asked at sliced tasks' element boundaries."""
        now = time.monotonic()
        if self._subqueues is None or now - self._subqueues[0] > SUBQUEUE_LIST_TTL or self._pid != os.getpid():
            try:
                names = self.list_subqueues(app, settings)
            except Exception:  # a listing that fails leaves the last one in use
                names = self._subqueues[1] if self._subqueues else []
            if settings.sjf:
                from ..producer.routing import sjf_queues

                names = [*names, *sjf_queues(settings, app.tasks, every_task=self.every_task_sjf)]
            self._subqueues = (now, names)
        return self._subqueues[1]

    def list_subqueues(self, app: Any, settings: PrioSettings) -> list[str]:
        raise NotImplementedError

    #: Counts every registered task's shortest-first queue (as the worker serves them: see ``sjf_queues``).
    every_task_sjf = False


SUBQUEUE_LIST_TTL = 2.0  # seconds a pool child reuses its list of a tier's sub-queues


def tier_queues(settings: PrioSettings, tier: Tier, subqueues: list[str]) -> list[str]:
    """Where ``tier``'s work waits: its queue, its front lane and those of ``subqueues`` that are its."""
    lane = settings.front_lanes().get(tier)
    names = [settings.queue_name(tier), *([lane] if lane else [])]
    names += [n for n in subqueues if settings.subqueue_of(n, tier) is not None]
    return list(dict.fromkeys(names))


class RedisContinuations(_ProcessConnection):
    every_task_sjf = True  # one pipelined LLEN each: a missing list costs nothing

    def _client(self, app: Any) -> Any:
        return self.connection(app).default_channel.client

    def publish(self, app: Any, settings: PrioSettings, continuation: Continuation) -> None:
        # Aging on Redis reads the enqueue stamp the continuation carries: nothing to adjust.
        pending_marker.value = (marker_name(settings, continuation.task_id), continuation.generation, MARKER_TTL)
        try:
            continuation.send()
        finally:
            left = pending_marker.value
            pending_marker.value = None
        if left is not None:
            raise RuntimeError("celery-prio: the continuation was not published through celery-prio's Redis transport")

    def committed(self, app: Any, settings: PrioSettings, task_id: str) -> int:
        raw = self._guarded(app, lambda client: client.get(marker_name(settings, task_id)))
        try:
            return int(raw or 0)
        except ValueError:  # anyone can write to Redis: an unreadable marker marks nothing stale
            return 0

    def waiting(self, app: Any, settings: PrioSettings, tier: Tier) -> int:
        """Messages waiting in ``tier`` (one round trip): asked by a sliced task at an element boundary."""

        names = tier_queues(settings, tier, self.subqueues(app, settings))

        def count(client: Any) -> int:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.llen(name)
            return sum(int(n) for n in pipe.execute())

        return self._guarded(app, count)

    def list_subqueues(self, app: Any, settings: PrioSettings) -> list[str]:
        from .redis_transport import registered_subqueues

        return self._guarded(app, lambda client: registered_subqueues(client, settings.subqueue_registry))

    def _guarded(self, app: Any, work: Callable[[Any], Any]) -> Any:
        conn = self.connection(app)
        try:
            return work(self._client(app))
        except conn.connection_errors:
            self.forget()
            raise


class AmqpContinuations(_ProcessConnection):
    # A channel is either in confirm mode or in a transaction: this connection's are not in confirm mode.
    transport_options = {"confirm_publish": False}

    _follower: Any = None

    def list_subqueues(self, app: Any, settings: PrioSettings) -> list[str]:
        """The registry's sub-queues (they exist: declared before they were announced), followed on this
        process's connection: its first call reads what is there, later ones only what arrived since."""
        from .amqp_registry import RegistryFollower

        conn = self.connection(app)
        follower, quiet = self._follower, 0.002  # what arrived since is in the socket's buffer already
        if follower is None or follower.connection is not conn or follower.pid != os.getpid():
            follower, quiet = RegistryFollower(settings), 0.05
            follower.start(conn.connection)
            follower.connection, follower.pid = conn, os.getpid()
            self._follower = follower
        try:
            follower.catch_up(conn, quiet)
        except conn.connection_errors:
            self.forget()
            self._follower = None
            raise
        return list(follower.names)

    def _with_channel(self, app: Any, work: Callable[[Any], Any]) -> Any:
        conn = self.connection(app)
        try:
            channel = conn.channel()
            try:
                return work(channel)
            finally:
                if channel.is_open:
                    channel.close()
        except conn.connection_errors:
            self.forget()
            raise

    def publish(self, app: Any, settings: PrioSettings, continuation: Continuation) -> None:
        from kombu import Producer

        marker = marker_name(settings, continuation.task_id)
        options = _aging_expiration(settings, continuation.tier, continuation.enqueued_at)

        def work(channel: Any) -> None:
            channel.queue_declare(
                queue=marker, durable=True, auto_delete=False, arguments={"x-expires": MARKER_TTL * 1000}
            )
            channel.tx_select()
            continuation.send(Producer(channel, auto_declare=False), **options)
            channel.basic_publish(
                channel.prepare_message(b"", properties={"delivery_mode": 2}), exchange="", routing_key=marker
            )
            channel.tx_commit()

        self._with_channel(app, work)

    def committed(self, app: Any, settings: PrioSettings, task_id: str) -> int:
        from amqp.exceptions import NotFound

        def work(channel: Any) -> int:
            try:
                return channel.queue_declare(queue=marker_name(settings, task_id), passive=True).message_count
            except NotFound:
                return 0

        return self._with_channel(app, work)

    def waiting(self, app: Any, settings: PrioSettings, tier: Tier) -> int:
        """Messages waiting in ``tier``: a passive declare per queue (they exist: workers declared them)."""
        from amqp.exceptions import NotFound

        names = tier_queues(settings, tier, self.subqueues(app, settings))

        def work(channel: Any) -> int:
            total = 0
            for name in names:
                try:
                    total += channel.queue_declare(queue=name, passive=True).message_count
                except NotFound:  # the channel is closed by the broker: nothing more to ask on it
                    break
            return total

        return self._with_channel(app, work)


def _aging_expiration(settings: PrioSettings, tier: Tier, enqueued_at: Any) -> dict[str, float]:
    """RabbitMQ ages by time in queue: the continuation expires (is promoted) when the first publish would have."""
    threshold = settings.aging[tier]
    if threshold is None or not isinstance(enqueued_at, (int, float)):
        return {}
    return {"expiration": max(threshold - (time.time() - enqueued_at), 0.001)}
