"""kombu's Redis transport with an atomic, capped publish for tier queues.

``install()`` selects it (``broker_transport``) when the broker is Redis and
passes the caps through ``broker_transport_options['prio_caps']``. Every
other queue, and every consumer-side operation, is kombu's own code."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any

from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps
from redis import exceptions as redis_exceptions
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ...errors import QueueFull
from ...headers import PROMOTED_SUFFIX, READY_INDEX
from ...tiers import parse_tier
from .scripts import BELL_MAX, GUARDED_PUSH, MARK_READY

if TYPE_CHECKING:
    from redis import Redis

logger = logging.getLogger(__name__)

#: (key, generation, ttl) for the next ``_put`` on this thread (Redis).
pending_marker = threading.local()


#: Replies a Redis server gives while it changes role or briefly cannot write: a failover's ``REPLICAOF``
#: (``READONLY``), a replica without its master (``MASTERDOWN``), ``OOM`` under ``noeviction``, ``TRYAGAIN``.
#: Counted as connection errors, so that Celery restarts the consumer and reconnects (with its retry and
#: backoff) as for a lost connection, instead of ending the worker ("Unrecoverable error"); an ack they
#: refuse is logged, and its message comes back after ``prio_redeliver_after`` (at least once, as Celery's).
TRANSIENT_REPLIES: tuple[type[Exception], ...] = tuple(
    getattr(redis_exceptions, name)
    for name in ("ReadOnlyError", "MasterDownError", "OutOfMemoryError", "TryAgainError")
    if hasattr(redis_exceptions, name)  # redis-py 5.0 has not all of them
)


#: Delivery tags this process settled (acked, or rejected without requeue) while Redis was unreachable, or
#: refused writes for a moment (``TRANSIENT_REPLIES``, below: a failover):
#: the message is done, but its unacked entry and owner record are still in Redis. Settled on the new
#: connection after the reconnect (``RedisFetchSource.recover_own``), so it is never returned and run again.
UNSETTLED: set[str] = set()


class QoS(kombu_redis.QoS):
    """kombu's Redis ack emulation, aware of message owners (prompt recovery, ``RedisFetchSource``).

    A settled message's owner record goes with it. kombu's visibility-timeout
    restore (which every Redis worker runs) skips messages that have an owner:
    a live owner's long task is never run twice because it is long, and a
    dead owner's messages are returned sooner by the owner sweep. Messages
    without one (fetched by plain kombu consumers) are restored as kombu does.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        # Read once, while the channel has its connection: an ack or reject after the connection died
        # (a Redis restart) still finds it, where reading it then raised AttributeError and killed the worker.
        self._owners_key = self.channel.connection.client.transport_options.get("prio_owners_key")

    def ack(self, delivery_tag):
        try:
            self._remove_from_indices(delivery_tag).execute()
        except (RedisConnectionError, RedisTimeoutError, *TRANSIENT_REPLIES) as exc:
            self._settle_later(delivery_tag, "ack", exc)
        kombu_redis.virtual.QoS.ack(self, delivery_tag)  # this process's own bookkeeping, either way

    def reject(self, delivery_tag, requeue=False):
        if requeue:  # a failed requeue leaves it unacked and owned: the reconnect's recovery requeues it
            return super().reject(delivery_tag, requeue=True)
        try:
            self._remove_from_indices(delivery_tag).execute()
        except (RedisConnectionError, RedisTimeoutError, *TRANSIENT_REPLIES) as exc:
            self._settle_later(delivery_tag, "reject", exc)
        kombu_redis.virtual.QoS.ack(self, delivery_tag)

    @staticmethod
    def _settle_later(delivery_tag: object, what: str, exc: Exception) -> None:
        tag = delivery_tag.decode() if isinstance(delivery_tag, bytes) else str(delivery_tag)
        UNSETTLED.add(tag)
        logger.warning("celery-prio: %s of %s failed (%r); it is settled after the reconnect", what, tag, exc)

    def _remove_from_indices(self, delivery_tag, pipe=None):
        pipe = super()._remove_from_indices(delivery_tag, pipe)
        return pipe.hdel(self._owners_key, delivery_tag) if self._owners_key else pipe

    def restore_visible(self, start=0, num=10, interval=10):
        owners = self._owners_key
        if owners is None:
            return super().restore_visible(start, num, interval)
        self._vrestore_count += 1
        if (self._vrestore_count - 1) % (interval or 1):
            return None
        with self.channel.conn_or_acquire() as client:
            ceil = time.time() - self.visibility_timeout
            try:
                with kombu_redis.Mutex(client, self.unacked_mutex_key, self.unacked_mutex_expire):
                    visible = client.zrange(
                        self.unacked_index_key, ceil, 0, desc=True, byscore=True, offset=num and start, num=num
                    )
                    for tag in visible or []:
                        if not client.hexists(owners, tag):
                            try:
                                self.restore_by_tag(tag, client)
                            except (RedisConnectionError, RedisTimeoutError):
                                raise
                            except Exception as exc:
                                # One entry kombu cannot read back must not stop the others' restore.
                                logger.error("celery-prio: unacked message %s cannot be restored: %r", tag, exc)
            except kombu_redis.MutexHeld:
                pass
        return None


class Channel(kombu_redis.Channel):
    QoS = QoS
    _guarded_push = None

    def _put(self, queue: str, message: dict, **kwargs: Any) -> None:
        marker = getattr(pending_marker, "value", None)
        if marker is not None:
            # A sliced task's continuation: pushed together with the count of
            # committed continuations, or neither (see brokers/continuations).
            pending_marker.value = None
            key, generation, ttl = marker
            bell = bell_of(self.connection.client.transport_options, queue)
            with self.conn_or_acquire() as client:
                pipe = client.pipeline(transaction=True)
                target = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
                pipe.lpush(target, dumps(message))
                self._mark_ready(_on(pipe), queue, target)
                pipe.set(key, generation, ex=ttl)
                if bell:  # the continuation's tier: an idle worker takes it at once
                    pipe.lpush(bell, 1).ltrim(bell, 0, BELL_MAX - 1)
                pipe.execute()
            return
        options = self.connection.client.transport_options
        rule = cap_rule(options, queue)
        if rule is None:
            return self._put_ringing(queue, message, options.get("prio_default_bell"), **kwargs)
        batch = kwargs.get("_publish_batch")
        cap, policy, tier = rule
        wait_rule = (options.get("prio_wait_rules") or {}).get(tier)
        if batch is not None and cap < 0 and wait_rule is None:
            # Uncapped: kombu's batching keeps pipelining it, and the tier's doorbell rings in the same pipeline.
            super()._put(queue, message, **kwargs)
            self._mark_ready(
                batch.add, queue, self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
            )
            bell = bell_key(options, tier)
            if bell:
                batch.add("lpush", bell, 1)
                batch.add("ltrim", bell, 0, BELL_MAX - 1)
            return
        kwargs.pop("_publish_batch", None)
        if batch is not None:
            # kombu's Producer.batch() pipelines plain LPUSHes, which would
            # bypass the cap. A capped tier is published at once instead,
            # through the guarded script, after what the batch buffered before
            # it (so order holds and a refusal reaches the caller right here).
            batch.flush()
        pri = self._get_message_priority(message, reverse=False)
        key = self._q_for_pri(queue, pri)
        with self.conn_or_acquire() as client:
            if self._guarded_push is None:
                Channel._guarded_push = client.register_script(GUARDED_PUSH)
            budget, tier_queue, lane, head = wait_rule or (-1, "", "", "")
            accepted, depth, *predicted = self._guarded_push(
                keys=[
                    key,
                    options["prio_dead_queue"],
                    options["prio_stats_key"],
                    bell_key(options, tier),
                    options.get("prio_admission_key", ""),
                    options.get("prio_registry_key", ""),
                    options.get("prio_estimates_key", ""),
                    options.get("prio_ready_key", ""),
                ],
                args=[dumps(message), cap, policy, tier, time.time(), budget, tier_queue, lane, head],
                client=client,
            )
            if predicted:
                raise QueueFull.over_budget(parse_tier(tier), int(depth), float(predicted[0]), budget)
            if not accepted:
                rate = drain_rate(client, options["prio_stats_key"], tier)
                raise QueueFull.from_drain_rate(parse_tier(tier), int(depth), rate)
            wait_for_replicas(client, options)

    def _put_ringing(self, queue: str, message: dict, bell: str | None, **kwargs: Any) -> None:
        """A queue of the app's own (no tier queue): kombu's push, and the default tier's bell in the same round
        trip. Not for kombu's reply queues (remote control answers): no worker serves those."""
        if (
            not bell
            or queue.endswith(PIDBOX_SUFFIX)
            or queue == self.connection.client.transport_options.get("prio_dead_queue")
        ):
            return super()._put(queue, message, **kwargs)
        batch = kwargs.get("_publish_batch")
        key = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
        if batch is not None:  # kombu's Producer.batch(): the bell joins its pipeline
            super()._put(queue, message, **kwargs)
            self._mark_ready(batch.add, queue, key)
            batch.add("lpush", bell, 1)
            batch.add("ltrim", bell, 0, BELL_MAX - 1)
            return None
        with self.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False).lpush(key, dumps(message))
            self._mark_ready(_on(pipe), queue, key)  # a front lane's push (a resumed task)
            pipe.lpush(bell, 1).ltrim(bell, 0, BELL_MAX - 1).execute()
        return None

    def _mark_ready(self, add: Any, queue: str, key: str) -> None:
        """``add(command, *args)`` queues the command by which ``key`` (a list of ``queue``) joins the ready index,
        where ``queue`` is a tier queue, front lane or sub-queue (``lua/fetch.lua`` asks those only while
        indexed): a plain ``ZADD`` (score 0: may have work) for a tier list or lane; for a sub-queue's, the
        script that also bumps the
        index's version when it joins (``lua/mark_ready.lua``: workers pass the fetch only the sub-queue lists
        their copy holds, and read it again when the version moves)."""
        index = ready_of(self.connection.client.transport_options, queue)
        if index and pinned_list(index, key):
            add("zadd", index, {key: 0})
        elif index:
            add("eval", MARK_READY, 2, index, key)

    def _do_restore_message(self, payload, exchange, routing_key, pipe, leftmost=False):
        """kombu's restore (a worker gone, a visibility timeout), and the list it refills joins the ready index
        in the same transaction."""
        super()._do_restore_message(payload, exchange, routing_key, pipe, leftmost)
        for queue in self._lookup(exchange, routing_key):
            key = self._q_for_pri(queue, self._get_message_priority(payload, reverse=False))
            self._mark_ready(_on(pipe), queue.split(self.sep, 1)[0], key)


#: kombu's remote-control reply queues (``<id>.reply.celery.pidbox``).
PIDBOX_SUFFIX = ".pidbox"


def wait_for_replicas(client: Redis, options: dict) -> None:
    """``prio_wait_replicas``: return only once that many replicas have the write (Sentinel failover loses none).

    Redis replicates asynchronously: a failover can drop writes the old master
    acknowledged but had not passed on. ``WAIT`` closes that window for the
    publish it follows; too few replicas in time raise ``NotReplicated`` (the
    message is on the master: a retry may publish it twice, never zero times).
    """
    replicas = options.get("prio_wait_replicas") or 0
    if replicas:
        got = int(client.execute_command("WAIT", replicas, WAIT_REPLICAS_MS))
        if got < replicas:
            raise NotReplicated(
                f"celery-prio: {got} of {replicas} replica(s) confirmed the publish in {WAIT_REPLICAS_MS} ms"
            )


#: How long a publish waits for its replicas (``prio_wait_replicas``).
WAIT_REPLICAS_MS = 1000


class NotReplicated(Exception):
    """A publish the master took but fewer replicas than ``prio_wait_replicas`` confirmed in time."""


def cap_rule(options: dict, queue: str) -> list | None:
    """``[cap (-1: none), policy, tier]`` for a tier queue or sub-queue; None for any other queue (front lanes
    are never capped: what enters them was admitted already)."""
    rule = (options.get("prio_caps") or {}).get(queue)
    if rule is not None or queue.endswith(PROMOTED_SUFFIX):
        return rule
    for head, sub_rule in (options.get("prio_subqueue_caps") or {}).items():
        if queue.startswith(head):
            return sub_rule
    return None


def bell_key(options: dict, tier_label: str) -> str:
    """The doorbell of a tier (``''`` for an app installed before doorbells: nothing rings)."""
    prefix = options.get("prio_bell_prefix")
    return f"{prefix}{tier_label}" if prefix else ""


def bell_of(options: dict, queue: str) -> str:
    """The doorbell of the tier ``queue`` (a tier queue, front lane or sub-queue) belongs to, or ``''``."""
    rule = cap_rule(options, queue.removesuffix(PROMOTED_SUFFIX))
    return "" if rule is None else bell_key(options, rule[2])


def ready_of(options: dict, queue: str) -> str:
    """The ready index ``queue``'s lists join when pushed to (a tier queue, front lane or sub-queue), or ``''``."""
    indexed = cap_rule(options, queue.removesuffix(PROMOTED_SUFFIX)) is not None
    return options.get("prio_ready_key", "") if indexed else ""


def pinned_list(index: str, key: str) -> bool:
    """Whether ``key`` (a list the ready index ``index`` covers) is a tier list or front lane, which every worker
    passes to its fetch whatever its copy of the index holds (one joining does not move the index's version);
    the same reading as ``lua/mark_ready.lua``'s."""
    if "\x06" in key:  # kombu's list of a message priority ("<list>\x06\x16<n>"): rare, not pinned
        return False
    rest = key[len(index) - len(READY_INDEX) :]  # after "<prefix>."
    dot = rest.find(".")
    return dot < 0 or rest[dot:] == PROMOTED_SUFFIX


def _on(pipe: Any) -> Any:
    """``add(command, *args)`` onto a redis-py pipeline (as kombu's ``PublishBatch.add`` takes them)."""
    return lambda name, *args: getattr(pipe, name)(*args)


def registered_subqueues(client: Redis, registry: str) -> list[str]:
    """The sub-queues publishers added to the Redis set ``registry`` (``PrioSettings.subqueue_registry``)."""
    return sorted(m.decode(errors="replace") if isinstance(m, bytes) else str(m) for m in client.smembers(registry))


RATE_FRESH_FOR = 10.0  # seconds a worker's reported rate counts


def drain_rate(client: Redis, stats_key: str, tier: str) -> float:
    """Tasks/s the cluster takes from ``tier``: the sum of fresh per-worker reports."""
    now, total = time.time(), 0.0
    for field, value in client.hgetall(f"{stats_key}.rates").items():
        name = field.decode(errors="replace") if isinstance(field, bytes) else field
        if not name.endswith(f"|{tier}"):
            continue
        try:  # written by workers, but anyone can write to Redis: a bad entry is skipped
            rate, at = (float(x) for x in (value.decode() if isinstance(value, bytes) else value).split())
        except (ValueError, UnicodeDecodeError):
            continue
        if now - at <= RATE_FRESH_FOR and math.isfinite(rate) and rate > 0:
            total += rate
    return total


class Transport(kombu_redis.Transport):
    Channel = Channel
    connection_errors = (*kombu_redis.Transport.connection_errors, *TRANSIENT_REPLIES)


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """The same capped publish and owner-aware QoS, on the master that Redis Sentinel names (``sentinel://``)."""


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel
    connection_errors = (*kombu_redis.SentinelTransport.connection_errors, *TRANSIENT_REPLIES)
