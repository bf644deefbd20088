"""Redis: tier queues are lists; LPUSH adds on the left, RPOP takes the oldest on the right."""

from __future__ import annotations

import json
import time
from typing import Any

from ..aging import enqueue_age, plan_promotions
from ..settings import PrioSettings
from ..tiers import TIERS, Tier
from .base import BrokerAdapter
from .redis_scripts import DEAD_REQUEUE, FETCH, PROMOTE, STAMP
from .redis_transport import drain_rate


class RedisAdapter(BrokerAdapter):
    kind = "redis"

    def __init__(self, app: Any, client: Any = None) -> None:
        super().__init__(app)
        self.connection = None
        if client is None:
            self.connection = app.connection_for_write()
            # The transport's own client: same URL, password, SSL and db as Celery uses.
            client = self.connection.default_channel.client
        self.client = client
        self._promote = self.client.register_script(PROMOTE)
        self._stamp = self.client.register_script(STAMP)

    def depth(self, queue: str) -> int:
        return int(self.client.llen(queue))

    def delete_queues(self, queues: list[str]) -> None:
        for name in queues:
            self.client.delete(name, f"_kombu.binding.{name}")

    # -- capacity bookkeeping -----------------------------------------------
    def counters(self, settings: PrioSettings) -> dict[str, int]:
        raw = self.client.hgetall(settings.stats_key)
        return {k.decode(): int(v) for k, v in raw.items()}

    def drain_rate(self, settings: PrioSettings, tier: Tier) -> float:
        return drain_rate(self.client, settings.stats_key, tier.label)

    # -- dead letters -------------------------------------------------------
    def dead_list(self, settings: PrioSettings, limit: int = 100) -> list[dict[str, Any]]:
        out = []
        for raw in reversed(self.client.lrange(settings.dead_letter_queue, -limit, -1)):
            entry = json.loads(raw)
            message = json.loads(entry["message"])
            headers = entry["headers"]
            out.append(
                {
                    "id": message.get("headers", {}).get("id"),
                    "task": message.get("headers", {}).get("task"),
                    "reason": headers["prio_dead_reason"],
                    "queue": headers["prio_dead_queue"],
                    "at": headers["prio_dead_at"],
                }
            )
        return out

    def dead_requeue(self, settings: PrioSettings, limit: int | None = None) -> tuple[int, int]:
        caps: list[Any] = []
        for tier in TIERS:
            cap = settings.max_length[tier]
            caps += [settings.queue_name(tier), cap if cap is not None else 2**62]
        moved, left = self.client.eval(
            DEAD_REQUEUE, 1, settings.dead_letter_queue, limit if limit is not None else 2**62, *caps
        )
        return int(moved), int(left)

    def dead_purge(self, settings: PrioSettings) -> int:
        with self.client.pipeline() as pipe:
            pipe.llen(settings.dead_letter_queue)
            pipe.delete(settings.dead_letter_queue)
            count, _ = pipe.execute()
        return int(count)

    # -- aging --------------------------------------------------------------
    def promote_aged(self, settings: PrioSettings, tier: Tier, now: float, batch: int = 100) -> int:
        """Move ``tier``'s due messages one tier up; returns how many moved."""
        threshold = settings.aging[tier]
        if threshold is None or tier is Tier.REALTIME:
            return 0
        source, upper = settings.queue_name(tier), settings.queue_name(tier.promoted())
        cap = settings.max_length[tier.promoted()]
        moved = 0
        while True:
            oldest_first = self.client.lrange(source, -batch, -1)[::-1]
            plan = plan_promotions(oldest_first, tier, upper, threshold, now)
            if plan.originals:
                n = len(plan.originals)
                done = int(
                    self._promote(
                        keys=[source, upper, settings.stats_key],
                        args=[-1 if cap is None else cap, tier.label, n, *plan.originals, *plan.rewritten],
                    )
                )
                moved += done
                if done < n:
                    break  # another ager got there first, or the upper tier is full
                if n == len(oldest_first) == batch:
                    continue  # the whole window was due: look at the next one
            if plan.stamp is not None and not plan.originals:
                index, original, stamped = plan.stamp
                self._stamp(keys=[source], args=[-1 - index, original, stamped])
            break
        return moved

    def oldest_age(self, queue: str, now: float) -> float | None:
        """Seconds the oldest waiting message of ``queue`` has waited (None if empty/unstamped)."""
        raw = self.client.lindex(queue, -1)
        if raw is None:
            return None
        try:
            return enqueue_age(json.loads(raw).get("headers"), now)
        except ValueError:
            return None

    def close(self) -> None:
        if self.connection is not None:
            self.connection.release()


#: How often a worker returns messages whose consumer died (unacked for longer
#: than the visibility timeout) to their queues.
RESTORE_INTERVAL = 10.0


def restore_expired_unacked(channel: Any) -> None:
    """Put back messages a dead worker took but never acked.

    kombu does this only for channels with ``basic_consume`` subscriptions;
    a celery-prio worker fetches with ``basic_get`` and so must ask itself.
    The scan is guarded by kombu's Redis mutex, so workers can all call it.
    """
    try:
        channel.qos.restore_visible(num=channel.unacked_restore_limit, interval=1)
    except channel.connection_errors:
        pass  # broken connection: the consumer reconnects, the next round retries


def report_drain_rates(channel: Any, stats_key: str, worker: str, rates: dict[Tier, float]) -> None:
    """Publish this worker's per-tier take rate; publishers turn it into Retry-After."""
    now = time.time()
    mapping = {f"{worker}|{tier.label}": f"{rate:.4f} {now:.3f}" for tier, rate in rates.items()}
    try:
        channel.client.hset(f"{stats_key}.rates", mapping=mapping)
    except channel.connection_errors:
        pass


class RedisFetcher:
    """One round trip per fetch on Redis: the first message of several lists, recorded unacked.

    Used by the worker instead of one ``basic_get`` per list: an empty tier
    costs nothing extra, and the message is in kombu's unacked hash (so a
    dead worker's message is restored) from the instant it leaves its list.
    """

    def __init__(self, channel: Any) -> None:
        from kombu.transport import virtual

        self.channel = channel
        self._script = channel.client.register_script(FETCH)
        self._local_append = virtual.QoS.append  # kombu's in-process bookkeeping only

    def keys_for(self, queue: str) -> list[str]:
        return [self.channel._q_for_pri(queue, pri) for pri in self.channel.priority_steps]

    def fetch(self, keys: list[str]) -> tuple[int, Any] | None:
        """``(index into keys, kombu Message)`` for the first non-empty key, or None."""
        channel = self.channel
        hit = self._script(
            keys=[*keys, channel.unacked_key, channel.unacked_index_key], args=[time.time()], client=channel.client
        )
        if not hit:
            return None
        position, raw = hit
        message = channel.Message(json.loads(raw), channel=channel)
        self._local_append(channel.qos, message, message.delivery_tag)
        return int(position) - 1, message
