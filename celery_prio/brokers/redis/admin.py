"""Redis as operators see it: depths, counters, dead letters and aging passes, on a connection of its own."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from ...headers import DEAD_AT, DEAD_QUEUE, DEAD_REASON, PROMOTED_SUFFIX
from ...settings import PrioSettings
from ...tiers import TIERS, Tier
from ...untrusted import decode_redis_element
from ..base import Broker
from . import figures
from .aging import AGING_WINDOW, RedisAging
from .scripts import (
    DEAD_REQUEUE,
)
from .transport import drain_rate, registered_subqueues

if TYPE_CHECKING:
    from celery import Celery
    from redis import Redis

logger = logging.getLogger(__name__)


class RedisAdapter(Broker):
    kind = "redis"

    def __init__(self, app: Celery, client: Redis | None = None) -> None:
        super().__init__(app)
        self.connection = None
        if client is None:
            self.connection = app.connection_for_write()
            # The transport's own client: same URL, password, SSL and db as Celery uses.
            client = self.connection.default_channel.client
        self.client = client
        self.aging = RedisAging(client)

    def depth(self, queue: str) -> int:
        return int(self.client.llen(queue))

    def subqueues(self, settings: PrioSettings) -> list[str]:
        return registered_subqueues(self.client, settings.subqueue_registry)

    def serving(self, settings: PrioSettings) -> dict[Tier, int]:
        return figures.serving(self.client, settings)

    def delete_queues(self, queues: list[str]) -> None:
        for name in queues:
            self.client.delete(name, f"_kombu.binding.{name}")

    # -- capacity bookkeeping -----------------------------------------------
    def counters(self, settings: PrioSettings) -> dict[str, int]:
        return figures.counters(self.client, settings)

    def drain_rate(self, settings: PrioSettings, tier: Tier) -> float:
        return drain_rate(self.client, settings.stats_key, tier.label)

    # -- dead letters -------------------------------------------------------
    def dead_list(self, settings: PrioSettings, limit: int = 100) -> list[dict[str, object]]:
        """Oldest first. An entry that is not a dead-letter envelope is listed as malformed."""
        return [
            describe_dead_entry(raw) for raw in reversed(self.client.lrange(settings.dead_letter_queue, -limit, -1))
        ]

    def dead_requeue(self, settings: PrioSettings, limit: int | None = None) -> tuple[int, int, int]:
        """Back where they came from: ``(moved, left, skipped)``. Only this app's queues are destinations:
        tier queues, front lanes and the tiers' sub-queues (shortest-first queues and tenants)."""
        caps: list[Any] = []
        for tier in TIERS:
            cap, sub_cap = settings.max_length[tier], settings.subqueue_cap(tier)
            caps += [settings.queue_name(tier), cap if cap is not None else -1]
            caps += [settings.queue_name(tier) + PROMOTED_SUFFIX, -1]
            caps += [settings.queue_name(tier) + ".", sub_cap if sub_cap is not None else -1]
        # Chunk by chunk (each call bounded in entries and bytes): Redis serves others in between, and an
        # interrupted requeue has moved whole entries only. Each entry is looked at once per requeue.
        requeue = self.client.register_script(DEAD_REQUEUE)
        to_look = self.client.llen(settings.dead_letter_queue)
        moved = skipped = 0
        left = to_look
        while to_look > 0 and (limit is None or moved < limit):
            chunk = min(REQUEUE_CHUNK, to_look)
            want = REQUEUE_CHUNK if limit is None else limit - moved
            m, left, s, looked, full = (
                int(x)
                for x in requeue(keys=[settings.dead_letter_queue, settings.ready_key], args=[want, chunk, *caps])
            )
            moved, skipped, to_look = moved + m, skipped + s, to_look - looked
            if full or looked == 0:
                break
        return moved, int(left), skipped

    def dead_purge(self, settings: PrioSettings) -> int:
        with self.client.pipeline() as pipe:
            pipe.llen(settings.dead_letter_queue)
            pipe.delete(settings.dead_letter_queue)
            count, _ = pipe.execute()
        return int(count)

    # -- aging --------------------------------------------------------------
    def promote_aged(
        self, settings: PrioSettings, tier: Tier, now: float, batch: int = AGING_WINDOW, source: str | None = None
    ) -> int:
        """One aging pass over ``tier`` (or ``source``, one of its sub-queues): see ``aging.RedisAging``."""
        return self.aging.promote_aged(settings, tier, now, batch, source)

    def oldest_age(self, queue: str, now: float) -> float | None:
        return figures.oldest_age(self.client, queue, now)

    def close(self) -> None:
        if self.connection is not None:
            self.connection.release()


def describe_dead_entry(raw: bytes) -> dict[str, object]:
    """One dead-letter list element as ``dead list`` shows it; never raises."""
    if isinstance(raw, bytes):  # a dead malformed element may hold any bytes
        raw = raw.decode("utf-8", "surrogateescape")
    try:
        entry = json.loads(raw)
        headers, message = entry["headers"], entry["message"]
        reason, queue, at = headers[DEAD_REASON], headers[DEAD_QUEUE], headers.get(DEAD_AT)
    except (ValueError, TypeError, KeyError):
        return {"id": None, "task": None, "reason": "malformed dead-letter entry", "queue": None, "at": None}
    task_id = task = None
    inner, _ = decode_redis_element(message) if isinstance(message, str) else (None, None)
    if inner is not None and isinstance(inner.get("headers"), dict):
        task_id, task = inner["headers"].get("id"), inner["headers"].get("task")
    return {
        "id": task_id if isinstance(task_id, str) else None,
        "task": task if isinstance(task, str) else None,
        "reason": str(reason),
        "queue": str(queue),
        "at": at if isinstance(at, (int, float)) and not isinstance(at, bool) else None,
    }


#: Dead letters one requeue call looks at (the whole requeue is a series of such calls).
REQUEUE_CHUNK = 500
