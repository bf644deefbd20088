"""RabbitMQ as operators see it: depths, dead letters, drain rates and refusal figures."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from amqp.exceptions import NotFound

from ...headers import DEAD_AT, DEAD_QUEUE, DEAD_REASON, PROMOTED_SUFFIX
from ...settings import PrioSettings
from ...tiers import TIERS, Tier
from ...untrusted import death_records
from ..base import Broker
from .management import listed_subqueues, management_client
from .registry import existing_depths, read_registry, serving_counts
from .topology import declare_subqueue

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger(__name__)


class AmqpAdapter(Broker):
    kind = "amqp"

    def __init__(self, app: Celery) -> None:
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

    def subqueues(self, settings: PrioSettings) -> list[str]:
        """The registry's sub-queues, and those the management API lists where it answers."""
        listed = [name for name, _ in listed_subqueues(self.app, settings) or []]
        return list(dict.fromkeys([*read_registry(self.connection.connection, settings), *listed]))

    def app_queues(self, settings: PrioSettings) -> list[str]:
        """Every queue of the app besides its tier queues that its names tell, the management API not needed
        (a teardown's list): sub-queues (the registry's, and each task's shortest-first queue in every tier),
        presence queues, the registry, the fleet's figures, lease and journals."""
        tasks = [name for name in self.app.tasks if not name.startswith("celery.")]
        names = self.subqueues(settings)
        names += [settings.subqueue_name(t, settings.sjf_subqueue(task)) for t in TIERS for task in tasks]
        names += [settings.presence_queue(t) for t in TIERS]
        prefix = settings.queue_prefix
        names += [settings.subqueue_registry, settings.admission_key, settings.housekeeper_key]
        names += [f"{prefix}.fleet", f"{prefix}.boosts", f"{prefix}.slices"]
        return list(dict.fromkeys(names))

    def serving(self, settings: PrioSettings) -> dict[Tier, int]:
        return serving_counts(self.connection.connection, settings)

    def depths(self, queues: list[str]) -> list[int]:
        return existing_depths(self.connection.connection, queues)

    def delete_queues(self, queues: list[str]) -> None:
        channel = self._channel()
        for name in queues:
            channel.queue_delete(queue=name)
            channel.exchange_delete(exchange=name)

    # -- dead letters -------------------------------------------------------
    def dead_list(self, settings: PrioSettings, limit: int = 100) -> list[dict[str, object]]:
        """Browse without consuming: fetch, describe, then give them all back."""
        channel = self.connection.channel()
        try:
            out = []
            for _ in range(limit):
                message = channel.basic_get(queue=settings.dead_letter_queue, no_ack=False)
                if message is None:
                    break
                out.append(describe_dead(message.properties.get("application_headers")))
            return out
        finally:
            channel.close()  # unacked messages go back to the queue, in order

    def dead_requeue(self, settings: PrioSettings, limit: int | None = None) -> tuple[int, int, int]:
        """Publish dead messages back to their queue (with confirms), then ack them: ``(moved, left, skipped)``.

        Only this app's queues are destinations: tier queues, front lanes and
        the tiers' sub-queues (shortest-first queues, tenants; declared first,
        with their tier's arguments); an entry naming anything else, or none, is skipped and
        stays in the dead-letter queue (held until the end of the pass, so it
        is not fetched again, then given back in order).
        """
        allowed = {settings.queue_name(t) for t in TIERS} | {settings.queue_name(t) + PROMOTED_SUFFIX for t in TIERS}
        moved = skipped = 0
        with self.app.connection_for_write() as conn:
            channel = conn.channel()
            before = channel.queue_declare(queue=settings.dead_letter_queue, passive=True).message_count
            for _ in range(before):
                if limit is not None and moved >= limit:
                    break
                raw = channel.basic_get(queue=settings.dead_letter_queue, no_ack=False)
                if raw is None:
                    break
                headers = raw.properties.get("application_headers")
                origin = dead_origin(headers)
                if origin not in allowed and not settings.is_subqueue(origin):
                    skipped += 1  # held unacked: back in the queue when the channel closes
                    continue
                tier = settings.tier_for_queue(origin)
                cap = settings.max_length[tier] if tier is not None and origin == settings.queue_name(tier) else None
                if settings.is_subqueue(origin):
                    cap = settings.subqueue_cap(tier)
                    # Through the default exchange a missing queue would drop it: make sure it is there
                    # (on a channel of its own: a failed declare closes its channel, not this one).
                    probe = declare_subqueue(conn.channel(), settings, tier, origin)
                    if probe.is_open:
                        probe.close()
                # A drop-head tier never refuses: publishing into a full one
                # would just evict another message into this queue. Stop at full.
                if cap is not None and channel.queue_declare(queue=origin, passive=True).message_count >= cap:
                    break
                # A fresh start in its tier: without the old death headers the
                # tier's dead-letter routes judge its next death, not its last.
                fresh = {k: v for k, v in (headers or {}).items() if not _death_annotation(k)}
                raw.properties["application_headers"] = fresh
                try:
                    channel.basic_publish_confirm(raw, exchange="", routing_key=origin)
                except Exception:  # nacked: the tier is full again
                    break
                channel.basic_ack(raw.delivery_tag)
                moved += 1
            channel.close()  # whatever is still unacked (skipped, or the one refused) goes back, in order
        return moved, before - moved, skipped

    def dead_purge(self, settings: PrioSettings) -> int:
        return int(self._channel().queue_purge(queue=settings.dead_letter_queue) or 0)

    def drain_rate(self, settings: PrioSettings, tier: Tier) -> float:
        """Messages/s leaving the tier queue, from the management API (0 if unknown)."""
        return tier_drain_rate(self.app, settings, tier)

    def close(self) -> None:
        self.connection.release()


def tier_drain_rate(app: Celery, settings: PrioSettings, tier: Tier) -> float:
    return management_client(app, settings).drain_rate(settings.queue_name(tier))


def _death_annotation(key: object) -> bool:
    return isinstance(key, str) and (key == "x-death" or key.startswith(("x-first-death", "prio_dead_")))


def dead_origin(headers: object) -> str | None:
    """The queue a dead letter came from: our own annotation first, else RabbitMQ's ``x-death``."""
    if not isinstance(headers, dict):
        return None
    origin = headers.get(DEAD_QUEUE)
    if origin is None:
        deaths = death_records(headers)
        origin = deaths[0].get("queue") if deaths else None
    return origin if isinstance(origin, str) else None


def describe_dead(headers: object) -> dict[str, object]:
    """One dead letter as ``dead list`` shows it; never raises on odd headers."""
    if not isinstance(headers, dict):
        headers = {}
    deaths = death_records(headers)
    death = deaths[0] if deaths else {}
    reason = headers.get(DEAD_REASON) or death.get("reason")
    when = headers.get(DEAD_AT) or death.get("time")
    when = when.timestamp() if hasattr(when, "timestamp") else when
    text = lambda v: v if isinstance(v, str) else None  # noqa: E731
    return {
        "id": text(headers.get("id")),
        "task": text(headers.get("task")),
        "reason": "drop_oldest" if reason == "maxlen" else text(reason) or "unknown",
        "queue": dead_origin(headers),
        "at": when if isinstance(when, (int, float)) and not isinstance(when, bool) else None,
    }
