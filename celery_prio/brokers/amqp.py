"""RabbitMQ (AMQP 0-9-1 through py-amqp).

Capacity and aging are RabbitMQ's own: ``x-max-length`` with ``x-overflow``
``reject-publish`` (the publisher, which uses confirms, gets a nack that
becomes ``QueueFull``) or ``drop-head`` (the oldest is dead-lettered into the
``<prefix>.dead`` queue, RabbitMQ's ``x-death`` header giving reason, queue
and time); ``x-message-ttl`` = the aging threshold, the expired message
dead-lettered into the tier above. See ``queue_arguments``.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
import urllib.request
from base64 import b64encode
from typing import Any

from amqp.exceptions import NotFound, PreconditionFailed
from kombu import Exchange, Queue

from ..settings import PrioSettings
from ..tiers import TIERS, Tier
from .base import BrokerAdapter

logger = logging.getLogger(__name__)

OVERFLOW_ARG = {"reject": "reject-publish", "drop_oldest": "drop-head"}


def dead_letter_exchange(settings: PrioSettings, tier: Tier) -> str:
    return f"{settings.queue_name(tier)}.dlx"


def queue_arguments(settings: PrioSettings, tier: Tier) -> dict[str, Any] | None:
    """Capacity and aging as RabbitMQ queue arguments.

    A tier that drops or ages dead-letters into its own headers exchange,
    which routes on ``x-first-death-reason``: ``maxlen`` (capacity) to the
    dead-letter queue, ``expired`` (aging TTL) to the tier above. Keeping the
    two apart is why this is not a plain fanout DLX (needs RabbitMQ >= 3.10
    for ``x-match: all-with-x``).
    """
    args: dict[str, Any] = {}
    cap = settings.max_length[tier]
    if cap is not None:
        args["x-max-length"] = cap
        args["x-overflow"] = OVERFLOW_ARG[settings.overflow[tier]]
    if aging_ttl(settings, tier) is not None:
        args["x-message-ttl"] = aging_ttl(settings, tier)
    if "x-message-ttl" in args or args.get("x-overflow") == "drop-head":
        args["x-dead-letter-exchange"] = dead_letter_exchange(settings, tier)
    return args or None


def promoted_queue(settings: PrioSettings, tier: Tier) -> str:
    """Where RabbitMQ delivers messages promoted *into* ``tier``.

    Dead-lettering appends at the tail; in the tier's own queue a promoted
    message would wait behind the whole backlog it already outwaited. Workers
    serving ``tier`` take from this sub-queue first.
    """
    return f"{settings.queue_name(tier)}.promoted"


def aging_ttl(settings: PrioSettings, tier: Tier) -> int | None:
    seconds = settings.aging[tier]
    return None if seconds is None or tier is Tier.REALTIME else max(1, int(seconds * 1000))


def tier_queue(settings: PrioSettings, tier: Tier) -> Queue:
    name = settings.queue_name(tier)
    # no_declare: kombu would redeclare with these arguments on every new
    # connection and fail with PRECONDITION_FAILED after a cap change;
    # declare_tier_queues() does it once and handles that case.
    return Queue(
        name,
        Exchange(name, type="direct"),
        routing_key=name,
        queue_arguments=queue_arguments(settings, tier),
        no_declare=True,
    )


def declare_tier_queues(channel: Any, settings: PrioSettings, tiers=TIERS) -> Any:
    """Declare tier queues, the dead-letter queue and the routes between them.

    A queue declared earlier with other arguments cannot be redeclared
    (RabbitMQ answers PRECONDITION_FAILED and closes the channel). Instead of
    crashing, log what differs and how to fix it, and use the queue as it is.
    Returns the channel to go on with (a new one if that happened).
    """
    dead = settings.dead_letter_queue
    channel.queue_declare(queue=dead, durable=True, auto_delete=False)
    for tier in TIERS:  # every tier queue: aging routes into the one above
        name = settings.queue_name(tier)
        args = queue_arguments(settings, tier)
        channel.exchange_declare(exchange=name, type="direct", durable=True, auto_delete=False)
        try:
            channel.queue_declare(queue=name, durable=True, auto_delete=False, arguments=args)
        except PreconditionFailed as exc:
            logger.error(
                "celery-prio: queue %s exists with other arguments than prio_max_length/prio_overflow/"
                "prio_aging ask for (%s): %s. Using the queue as it is. To apply the new settings, drain "
                "and delete the queue, or set a RabbitMQ policy "
                "(rabbitmqctl set_policy ... '{\"max-length\": N}').",
                name,
                args,
                exc.reply_text,
            )
            channel = channel.connection.channel()
            channel.queue_declare(queue=name, passive=True)
        channel.queue_bind(queue=name, exchange=name, routing_key=name)
    for tier in TIERS:
        dlx = dead_letter_exchange(settings, tier)
        channel.exchange_declare(exchange=dlx, type="headers", durable=True, auto_delete=False)
        channel.queue_bind(
            queue=dead,
            exchange=dlx,
            routing_key="",
            arguments={"x-match": "all-with-x", "x-first-death-reason": "maxlen"},
        )
        if aging_ttl(settings, tier) is not None:
            upper = tier.promoted()
            # Uncapped (its source tier is capped); ages on like its tier.
            ttl = aging_ttl(settings, upper)
            args = None
            if ttl:
                args = {"x-message-ttl": ttl, "x-dead-letter-exchange": dead_letter_exchange(settings, upper)}
            try:
                channel.queue_declare(
                    queue=promoted_queue(settings, upper), durable=True, auto_delete=False, arguments=args
                )
            except PreconditionFailed as exc:
                logger.error(
                    "celery-prio: %s exists with other arguments (%s): %s; using it as it is",
                    promoted_queue(settings, upper),
                    args,
                    exc.reply_text,
                )
                channel = channel.connection.channel()
            channel.queue_bind(
                queue=promoted_queue(settings, upper),
                exchange=dlx,
                routing_key="",
                arguments={"x-match": "all-with-x", "x-first-death-reason": "expired"},
            )
    return channel


class AmqpAdapter(BrokerAdapter):
    kind = "amqp"

    def __init__(self, app: Any) -> None:
        super().__init__(app)
        self.connection = app.connection_for_write()
        self.connection.ensure_connection(max_retries=3)

    def _channel(self):
        return self.connection.default_channel

    def depth(self, queue: str) -> int:
        try:
            return int(self._channel().queue_declare(queue=queue, passive=True).message_count)
        except NotFound:
            self.connection.close()  # a failed passive declare closes the channel
            self.connection = self.app.connection_for_write()
            return 0

    def delete_queues(self, queues: list[str]) -> None:
        channel = self._channel()
        for name in queues:
            channel.queue_delete(queue=name)
            channel.exchange_delete(exchange=name)

    # -- dead letters -------------------------------------------------------
    def dead_list(self, settings: PrioSettings, limit: int = 100) -> list[dict[str, Any]]:
        """Browse without consuming: fetch, describe, then give them all back."""
        channel = self.connection.channel()
        try:
            out = []
            for _ in range(limit):
                message = channel.basic_get(queue=settings.dead_letter_queue, no_ack=False)
                if message is None:
                    break
                out.append(describe_dead(message.headers or {}, message.properties))
            return out
        finally:
            channel.close()  # unacked messages go back to the queue, in order

    def dead_requeue(self, settings: PrioSettings, limit: int | None = None) -> tuple[int, int]:
        """Publish dead messages back to their tier (with confirms), then ack them."""
        moved = 0
        with self.app.connection_for_write() as conn:
            conn.transport_options["confirm_publish"] = True
            channel = conn.channel()
            channel.confirm_select()
            before = channel.queue_declare(queue=settings.dead_letter_queue, passive=True).message_count
            while limit is None or moved < limit:
                raw = channel.basic_get(queue=settings.dead_letter_queue, no_ack=False)
                if raw is None:
                    break
                origin = (raw.headers or {}).get("x-death", [{}])[0].get("queue")
                tier = settings.tier_for_queue(origin or "")
                cap = settings.max_length[tier] if tier is not None else None
                # A drop-head tier never refuses: publishing into a full one
                # would just evict another message into this queue. Stop at full.
                if not origin or (
                    cap is not None and channel.queue_declare(queue=origin, passive=True).message_count >= cap
                ):
                    channel.basic_reject(raw.delivery_tag, requeue=True)
                    break
                # A fresh start in its tier: without the old death headers the
                # tier's dead-letter routes judge its next death, not its last.
                headers = raw.properties.get("application_headers") or {}
                for key in [k for k in headers if k == "x-death" or k.startswith("x-first-death")]:
                    del headers[key]
                try:
                    channel.basic_publish(raw, exchange="", routing_key=origin)
                except Exception:  # nacked: the tier is full again
                    channel.basic_reject(raw.delivery_tag, requeue=True)
                    break
                channel.basic_ack(raw.delivery_tag)
                moved += 1
            channel.close()
        return moved, before - moved

    def dead_purge(self, settings: PrioSettings) -> int:
        return int(self._channel().queue_purge(queue=settings.dead_letter_queue) or 0)

    def drain_rate(self, settings: PrioSettings, tier: Tier) -> float:
        """Messages/s leaving the tier queue, from the management API (0 if unknown)."""
        info = self.connection.info()
        host = info.get("hostname") or "localhost"
        vhost = info.get("virtual_host") or "/"
        url = f"http://{host}:15672/api/queues/{urllib.parse.quote(vhost, safe='')}/{settings.queue_name(tier)}"
        request = urllib.request.Request(url)
        token = b64encode(f"{info.get('userid') or 'guest'}:{info.get('password') or 'guest'}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=0.3) as response:
                stats = json.load(response).get("message_stats") or {}
        except Exception:
            return 0.0
        return float((stats.get("deliver_get_details") or {}).get("rate") or 0.0)

    def close(self) -> None:
        self.connection.release()


def describe_dead(headers: dict[str, Any], properties: dict[str, Any] | None = None) -> dict[str, Any]:
    death = (headers.get("x-death") or [{}])[0]
    when = death.get("time")
    return {
        "id": headers.get("id"),
        "task": headers.get("task"),
        "reason": "drop_oldest" if death.get("reason") == "maxlen" else death.get("reason"),
        "queue": death.get("queue"),
        "at": when.timestamp() if hasattr(when, "timestamp") else when,
    }
