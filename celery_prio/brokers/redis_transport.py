"""kombu's Redis transport with an atomic, capped publish for tier queues.

``install()`` selects it (``broker_transport``) when the broker is Redis and
passes the caps through ``broker_transport_options['prio_caps']``. Every
other queue, and every consumer-side operation, is kombu's own code.
"""

from __future__ import annotations

import logging
import math
import time
from base64 import b64encode
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..errors import QueueFull
from ..headers import PROMOTED_SUFFIX
from ..tiers import parse_tier
from .continuations import pending_marker
from .publishing import BulkSession, fast_json
from .redis_scripts import BULK_PUSH, GUARDED_PUSH

logger = logging.getLogger(__name__)


#: Delivery tags this process settled (acked, or rejected without requeue) while Redis was unreachable:
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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Read once, while the channel has its connection: an ack or reject after the connection died
        # (a Redis restart) still finds it, where reading it then raised AttributeError and killed the worker.
        self._owners_key = self.channel.connection.client.transport_options.get("prio_owners_key")

    def ack(self, delivery_tag):
        try:
            self._remove_from_indices(delivery_tag).execute()
        except (RedisConnectionError, RedisTimeoutError) as exc:
            self._settle_later(delivery_tag, "ack", exc)
        kombu_redis.virtual.QoS.ack(self, delivery_tag)  # this process's own bookkeeping, either way

    def reject(self, delivery_tag, requeue=False):
        if requeue:  # a failed requeue leaves it unacked and owned: the reconnect's recovery requeues it
            return super().reject(delivery_tag, requeue=True)
        try:
            self._remove_from_indices(delivery_tag).execute()
        except (RedisConnectionError, RedisTimeoutError) as exc:
            self._settle_later(delivery_tag, "reject", exc)
        kombu_redis.virtual.QoS.ack(self, delivery_tag)

    @staticmethod
    def _settle_later(delivery_tag: Any, what: str, exc: Exception) -> None:
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
            with self.conn_or_acquire() as client:
                pipe = client.pipeline(transaction=True)
                pipe.lpush(self._q_for_pri(queue, self._get_message_priority(message, reverse=False)), dumps(message))
                pipe.set(key, generation, ex=ttl)
                pipe.execute()
            return
        options = self.connection.client.transport_options
        rule = cap_rule(options, queue)
        if rule is None:
            return super()._put(queue, message, **kwargs)
        batch = kwargs.pop("_publish_batch", None)
        if batch is not None:
            # kombu's Producer.batch() pipelines plain LPUSHes, which would
            # bypass the cap. A capped tier is published at once instead,
            # through the guarded script, after what the batch buffered before
            # it (so order holds and a refusal reaches the caller right here).
            batch.flush()
        cap, policy, tier = rule
        pri = self._get_message_priority(message, reverse=False)
        key = self._q_for_pri(queue, pri)
        with self.conn_or_acquire() as client:
            if self._guarded_push is None:
                Channel._guarded_push = client.register_script(GUARDED_PUSH)
            accepted, depth = self._guarded_push(
                keys=[key, options["prio_dead_queue"], options["prio_stats_key"]],
                args=[dumps(message), cap, policy, tier, time.time()],
                client=client,
            )
            if not accepted:
                rate = drain_rate(client, options["prio_stats_key"], tier)
                raise QueueFull.from_drain_rate(parse_tier(tier), int(depth), rate)
            wait_for_replicas(client, options)


def wait_for_replicas(client: Any, options: dict) -> None:
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
    """``[cap, policy, tier]`` for a capped tier queue or sub-queue (front lanes are never capped)."""
    rule = (options.get("prio_caps") or {}).get(queue)
    if rule is not None or queue.endswith(PROMOTED_SUFFIX):
        return rule
    for head, sub_rule in (options.get("prio_subqueue_caps") or {}).items():
        if queue.startswith(head):
            return sub_rule
    return None


def registered_subqueues(client: Any, registry: str) -> list[str]:
    """The sub-queues publishers added to the Redis set ``registry`` (``PrioSettings.subqueue_registry``)."""
    return sorted(m.decode(errors="replace") if isinstance(m, bytes) else str(m) for m in client.smembers(registry))


RATE_FRESH_FOR = 10.0  # seconds a worker's reported rate counts


def drain_rate(client: Any, stats_key: str, tier: str) -> float:
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


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """The same capped publish and owner-aware QoS, on the master that Redis Sentinel names (``sentinel://``)."""


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


class RedisBulkSession(BulkSession):
    """A chunk is one script call: pushed under the cap atomically, the refused tail reported."""

    def __init__(self, app: Any, connection: Any, settings: Any, tier: Any, queue: str | None = None) -> None:
        super().__init__(app, connection, settings, tier, queue)
        self.client = self.channel.client
        self._push = self.client.register_script(BULK_PUSH)
        self.depth = 0
        self._shared_cache: dict[str, str] | None = None
        self._shared_kwargs: Any = None

    def publish(self, messages: list[Any]) -> list[bool]:
        payloads = [self._envelope(message) for message in messages]
        accepted, self.depth = self._push(
            keys=[self.queue, self.settings.dead_letter_queue, self.settings.stats_key],
            args=[
                -1 if self.cap is None else self.cap,
                self.settings.overflow[self.tier],
                self.tier.label,
                time.time(),
                *payloads,
            ],
        )
        wait_for_replicas(self.client, self.channel.connection.client.transport_options)
        return [i < accepted for i in range(len(messages))]

    def _envelope(self, message: Any) -> str:
        """The JSON kombu's Redis channel writes for a publish (prepare_message + _inplace_augment_message).

        This is the hot loop of a bulk publish, so what every message of the
        chunk shares is encoded once (``_shared``) and only the per-message
        fields are encoded here.
        """
        if self.serializer != "json" or self.channel.body_encoding != "base64":
            return self._envelope_generic(message)
        args, kwargs, _ = message.body
        shared = self._shared(message)
        kwargs_json = shared["kwargs"] if kwargs is self._shared_kwargs else fast_json(kwargs)
        body = f"[{fast_json(args)}, {kwargs_json}, {shared['embed']}]".encode()
        headers = message.headers
        task_id = headers["id"]
        variable = {k: headers[k] for k in self.VARIABLE_HEADERS if k in headers}
        # Ids are "<uuid>-<n>": nothing in them needs escaping.
        return (
            f'{{"body": "{b64encode(body).decode()}", {shared["content"]}, '
            f'"headers": {{{shared["headers"]}, {fast_json(variable)[1:-1]}}}, '
            f'"properties": {{{shared["properties"]}, "correlation_id": "{task_id}", '
            f'"delivery_tag": "{task_id}.t"}}}}'
        )

    def _shared(self, message: Any) -> dict[str, str]:
        """What every message of this publish has in common (one template per session), encoded once."""
        if self._shared_cache is None:
            _, kwargs, embed = message.body
            headers = {k: v for k, v in message.headers.items() if k not in self.VARIABLE_HEADERS}
            properties = {k: v for k, v in message.properties.items() if k != "correlation_id"}
            properties.update(
                delivery_mode=2,
                delivery_info={"exchange": "", "routing_key": self.queue},  # as a single publish to the queue
                priority=self.channel.default_priority,
                body_encoding="base64",
            )
            self._shared_kwargs = kwargs  # bulk() shares one kwargs object; group calls each have their own
            self._shared_cache = {
                "kwargs": fast_json(kwargs),
                "embed": fast_json(embed),
                "content": '"content-encoding": "utf-8", "content-type": "application/json"',
                "headers": dumps(headers)[1:-1],
                "properties": dumps(properties)[1:-1],
            }
        return self._shared_cache

    def _envelope_generic(self, message: Any) -> str:
        prepared = self.prepare(message)
        self.channel._inplace_augment_message(prepared, "", self.queue)
        return dumps(prepared)

    def queue_full(self, accepted: int) -> QueueFull:
        rate = drain_rate(self.client, self.settings.stats_key, self.tier.label)
        return QueueFull.from_drain_rate(self.tier, int(self.depth), rate)
