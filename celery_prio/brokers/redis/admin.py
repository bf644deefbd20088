"""Redis as operators see it: depths, counters, dead letters and aging passes, on a connection of its own."""

from __future__ import annotations

import json
import logging
from typing import Any

from ...headers import DEAD_AT, DEAD_QUEUE, DEAD_REASON, PROMOTED_SUFFIX
from ...policy.aging import plan_promotions
from ...settings import PrioSettings
from ...tiers import TIERS, Tier
from ...untrusted import decode_redis_element, enqueue_age
from ..base import Broker
from .scripts import (
    DEAD_HEAD,
    DEAD_REQUEUE,
    PROMOTE,
    SCRIPT_BYTES,
    STAMP,
)
from .transport import drain_rate, registered_subqueues

logger = logging.getLogger(__name__)

#: How many of the oldest elements one aging look reads (and may stamp).
AGING_WINDOW = 100

#: Garbage one aging pass moves aside at most: a pass stays short, the next goes on.
MAX_DEAD_PER_PASS = 1000

#: A worker whose last heartbeat (every second) is older than this no longer counts as serving its tiers.
PRESENCE_FRESH = 5.0


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class RedisAdapter(Broker):
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
        self._dead_head = self.client.register_script(DEAD_HEAD)
        # Per source list: how deep the stamping look has reached beyond the head window.
        self._stamp_cursor: dict[str, int] = {}
        self._aging_window: dict[str, int] = {}  # per list: elements an aging look reads (bounded by bytes)

    def depth(self, queue: str) -> int:
        return int(self.client.llen(queue))

    def subqueues(self, settings: PrioSettings) -> list[str]:
        return registered_subqueues(self.client, settings.subqueue_registry)

    def serving(self, settings: PrioSettings) -> dict[Tier, int]:
        """Live workers per tier: a fresh heartbeat, and the tiers it last said it serves."""
        now = self.client.time()
        now = now[0] + now[1] / 1e6
        beats = self.client.hgetall(settings.heartbeats_key)
        out = dict.fromkeys(TIERS, 0)
        for worker, tiers in self.client.hgetall(settings.serving_key).items():
            try:
                alive = now - float(beats.get(worker, b"0")) <= PRESENCE_FRESH
            except ValueError:  # anyone can write to Redis: an unreadable beat is no live worker
                alive = False
            for label in _text(tiers).split(",") if alive else ():
                tier = next((t for t in TIERS if t.label == label), None)
                if tier is not None:
                    out[tier] += 1
        return out

    def delete_queues(self, queues: list[str]) -> None:
        for name in queues:
            self.client.delete(name, f"_kombu.binding.{name}")

    # -- capacity bookkeeping -----------------------------------------------
    def counters(self, settings: PrioSettings) -> dict[str, int]:
        """Broker-wide counters; a field that is not a whole number is skipped, not fatal."""
        out = {}
        for key, value in self.client.hgetall(settings.stats_key).items():
            try:
                out[_text(key)] = int(value)
            except ValueError:
                continue
        return out

    def drain_rate(self, settings: PrioSettings, tier: Tier) -> float:
        return drain_rate(self.client, settings.stats_key, tier.label)

    # -- dead letters -------------------------------------------------------
    def dead_list(self, settings: PrioSettings, limit: int = 100) -> list[dict[str, Any]]:
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
                int(x) for x in requeue(keys=[settings.dead_letter_queue], args=[want, chunk, *caps])
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
        """Move due messages of ``tier`` (its queue, or ``source``: one of its sub-queues) into the upper
        tier's front lane; returns how many moved. A sub-queue's messages go to the front lane too: they
        have waited long enough for their tenant's turn in the upper tier not to matter."""
        threshold = settings.aging[tier]
        if threshold is None or tier is Tier.REALTIME:
            return 0
        source = source or settings.queue_name(tier)
        upper = settings.queue_name(tier.promoted())
        promoted = upper + PROMOTED_SUFFIX
        cap = settings.max_length[tier.promoted()]
        moved = dead = 0
        batch = self._window_for(source, batch)
        for _ in range(10_000):  # bounded: a pass ends even if producers outpace it
            oldest_first = self.client.lrange(source, -batch, -1)[::-1]
            self._learn_window(source, oldest_first, AGING_WINDOW)
            plan = plan_promotions(oldest_first, tier, promoted, threshold, now)
            if plan.dead_heads:
                args: list[Any] = [tier.label, now]
                for raw, reason in plan.dead_heads:
                    args += [raw, reason]
                done = int(self._dead_head(keys=[source, settings.dead_letter_queue, settings.stats_key], args=args))
                dead += done
                if done < len(plan.dead_heads) or dead >= MAX_DEAD_PER_PASS:
                    break  # someone else moved them, or enough garbage for one pass: the next pass goes on
                continue
            if plan.stamps:
                self._stamp_all(source, plan.stamps)
            if not plan.originals:
                if not plan.stamps and len(oldest_first) == batch and moved == 0:
                    # Only on passes that promoted nothing: a promoting pass is busy enough.
                    self._stamp_deeper(source, tier, now, batch)
                break
            n = len(plan.originals)
            done = int(
                self._promote(
                    keys=[source, promoted, upper, settings.stats_key, settings.bell_key(tier.promoted())],
                    args=[-1 if cap is None else cap, tier.label, n, *plan.originals, *plan.rewritten],
                )
            )
            moved += done
            if done < n or n < len(oldest_first) or len(oldest_first) < batch:
                break  # another ager got there first, the upper tier is full, or the due run ended
        return moved

    def _window_for(self, source: str, most: int) -> int:
        """Elements one aging look at ``source`` reads: ``most``, fewer where its messages are big, so a
        look (and the promote call carrying originals and copies) stays near ``SCRIPT_BYTES``. The first
        look at a list is sized by its oldest element."""
        window = self._aging_window.get(source)
        if window is None:
            head = self.client.lindex(source, -1)
            window = _fitting(len(head) if head else 1, most)
        return min(window, most)

    def _learn_window(self, source: str, elements: list[bytes], most: int) -> None:
        if elements:
            self._aging_window[source] = _fitting(sum(len(e) for e in elements) / len(elements), most)

    def _stamp_all(self, source: str, stamps: list[tuple[int, bytes, str]]) -> None:
        args: list[Any] = []
        for index, original, stamped in stamps:
            args += [-1 - index, original, stamped]
        self._stamp(keys=[source], args=args)

    def _stamp_deeper(self, source: str, tier: Tier, now: float, batch: int) -> None:
        """Stamp one more window behind the head, a window per pass, so a deep unstamped backlog starts aging."""
        offset = self._stamp_cursor.get(source, batch)
        window = self.client.lrange(source, -(offset + batch), -(offset + 1))[::-1]
        plan = plan_promotions(window, tier, "", float("inf"), now, offset=offset)
        if plan.stamps:
            self._stamp_all(source, plan.stamps)
        self._stamp_cursor[source] = offset + batch if len(window) == batch else batch

    def oldest_age(self, queue: str, now: float) -> float | None:
        """Seconds the oldest waiting message of ``queue`` has waited (None if empty, unstamped or malformed)."""
        raw = self.client.lindex(queue, -1)
        if raw is None:
            return None
        message, _ = decode_redis_element(raw)
        return None if message is None else enqueue_age(message.get("headers"), now)

    def close(self) -> None:
        if self.connection is not None:
            self.connection.release()


def _fitting(element_bytes: float, most: int) -> int:
    """How many elements of about ``element_bytes`` fit in ``SCRIPT_BYTES`` (1 to ``most``)."""
    return max(1, min(most, int(SCRIPT_BYTES // max(element_bytes, 1.0))))


def describe_dead_entry(raw: bytes) -> dict[str, Any]:
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
