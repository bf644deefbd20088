"""Read-only figures of an app's Redis keys, for a worker's report and for operators alike: live workers per
tier, the broker-wide counters, the oldest wait of a list. Functions of a Redis client: each side passes its
own (a worker its fetch channel's, an operator tool its own connection)."""

from __future__ import annotations

from typing import Any

from ...settings import PrioSettings
from ...tiers import TIERS, Tier
from ...untrusted import decode_redis_element, enqueue_age
from ..shared import as_text

#: A worker whose last heartbeat (every second) is older than this no longer counts as serving its tiers.
PRESENCE_FRESH = 5.0


def serving(client: Any, settings: PrioSettings) -> dict[Tier, int]:
    """Live workers per tier: a fresh heartbeat, and the tiers it last said it serves."""
    now = client.time()
    now = now[0] + now[1] / 1e6
    beats = client.hgetall(settings.heartbeats_key)
    out = dict.fromkeys(TIERS, 0)
    for worker, tiers in client.hgetall(settings.serving_key).items():
        try:
            alive = now - float(beats.get(worker, b"0")) <= PRESENCE_FRESH
        except ValueError:  # anyone can write to Redis: an unreadable beat is no live worker
            alive = False
        for label in as_text(tiers).split(",") if alive else ():
            tier = next((t for t in TIERS if t.label == label), None)
            if tier is not None:
                out[tier] += 1
    return out


def counters(client: Any, settings: PrioSettings) -> dict[str, int]:
    """Broker-wide counters; a field that is not a whole number is skipped, not fatal."""
    out = {}
    for key, value in client.hgetall(settings.stats_key).items():
        try:
            out[as_text(key)] = int(value)
        except ValueError:
            continue
    return out


def oldest_age(client: Any, queue: str, now: float) -> float | None:
    """Seconds the oldest waiting message of ``queue`` has waited (None if empty, unstamped or malformed)."""
    raw = client.lindex(queue, -1)
    if raw is None:
        return None
    message, _ = decode_redis_element(raw)
    return None if message is None else enqueue_age(message.get("headers"), now)


__all__ = ["PRESENCE_FRESH", "counters", "oldest_age", "serving"]
