"""Read-only figures of an app's Redis keys, for a worker's report and for operators alike: live workers per
tier, the broker-wide counters, the oldest wait of a list. Functions of a Redis client: each side passes its
own (a worker its fetch channel's, an operator tool its own connection)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from ...policy.admission import slot_share
from ...settings import PrioSettings
from ...tiers import TIERS, Tier
from ...untrusted import decode_redis_element, enqueue_age
from ..shared import as_text

if TYPE_CHECKING:
    from redis import Redis

#: A worker whose last heartbeat (every second) is older than this no longer counts as serving its tiers.
PRESENCE_FRESH = 5.0


def serving(client: Redis, settings: PrioSettings) -> dict[Tier, int]:
    """Live workers per tier: a fresh heartbeat, and the tiers it last said it serves."""
    workers = _live_workers(client, settings, with_slots=False)
    return {tier: int(count) for tier, count in _per_live_worker(workers, lambda *_: 1).items()}


def slots_serving(client: Redis, settings: PrioSettings) -> dict[Tier, float]:
    """The slots of the live workers serving each tier, each worker's split between the tiers it serves by
    their weights (``prio_weights``): what a tier gets of them while every tier has work. A realtime-only
    worker gives realtime all its slots; one serving every tier gives it 8/11 of them by default."""
    workers = _live_workers(client, settings, with_slots=True)
    slots = workers.slots

    def share(worker: bytes, tier: Tier, served: list[Tier]) -> float:
        try:
            concurrency = max(1, int(slots.get(worker, b"1")))
        except ValueError:  # anyone can write to Redis: an unreadable figure is one slot
            concurrency = 1
        return slot_share(concurrency, tier, served, settings.weights)

    return _per_live_worker(workers, share)


class _Workers(NamedTuple):
    now: float  # the Redis server's clock (the heartbeats are stamped with it)
    beats: dict[bytes, bytes]
    serving: dict[bytes, bytes]
    slots: dict[bytes, bytes]  # each worker's concurrency (empty unless asked ``with_slots``)


def _live_workers(client: Redis, settings: PrioSettings, with_slots: bool) -> _Workers:
    """The clock, the heartbeats, the tiers each worker serves (and its slots), in one round trip: the fleet's
    housekeeper reads them every second."""
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.hgetall(settings.heartbeats_key)
    pipe.hgetall(settings.serving_key)
    if with_slots:
        pipe.hgetall(settings.slots_key)
    now, beats, serving, *rest = pipe.execute()
    return _Workers(now[0] + now[1] / 1e6, beats, serving, rest[0] if rest else {})


def _per_live_worker(workers: _Workers, weight: Callable[[bytes, Tier, list[Tier]], float]) -> dict[Tier, float]:
    out = dict.fromkeys(TIERS, 0.0)
    for worker, tiers in workers.serving.items():
        try:
            alive = workers.now - float(workers.beats.get(worker, b"0")) <= PRESENCE_FRESH
        except ValueError:  # anyone can write to Redis: an unreadable beat is no live worker
            alive = False
        labels = as_text(tiers).split(",") if alive else []
        served = [t for t in TIERS if t.label in labels]
        for tier in served:
            out[tier] += weight(worker, tier, served)
    return out


def counters(client: Redis, settings: PrioSettings) -> dict[str, int]:
    """Broker-wide counters; a field that is not a whole number is skipped, not fatal."""
    out = {}
    for key, value in client.hgetall(settings.stats_key).items():
        try:
            out[as_text(key)] = int(value)
        except ValueError:
            continue
    return out


def oldest_age(client: Redis, queue: str, now: float) -> float | None:
    """Seconds the oldest waiting message of ``queue`` has waited (None if empty, unstamped or malformed)."""
    raw = client.lindex(queue, -1)
    if raw is None:
        return None
    message, _ = decode_redis_element(raw)
    return None if message is None else enqueue_age(message.get("headers"), now)


__all__ = ["PRESENCE_FRESH", "counters", "oldest_age", "serving"]
