"""Keep the fleet's Redis bookkeeping bounded: prune what nobody has mentioned for ``prio_prune_after``.

Workers come and go (every restart is a new incarnation), task names and
tenants come and go, and each leaves a field behind: a heartbeat, the tiers
it served, its drain rates, a run-time estimate, a sub-queue in the
registry. Without pruning these hashes grow for as long as the app lives,
and every reader of them (the sweep, ``prio status``, Retry-After) pays for
it. One worker of the fleet at a time (a lease) prunes, in HSCAN chunks.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ...settings import PrioSettings
from ..shared import as_text

if TYPE_CHECKING:
    from redis import Redis

#: Seconds between pruning passes; one worker of the fleet takes each (``SET NX PX``).
PRUNE_INTERVAL = 60.0
#: Fields one HSCAN/SSCAN call reads (each call is a short step; Redis serves others between them).
PRUNE_CHUNK = 500


def _stamp(value: object) -> float | None:
    try:
        return float(as_text(value).split()[-1])
    except (ValueError, IndexError):
        return None  # anyone can write to Redis: unreadable is treated as old


def seen_key(settings: PrioSettings, what: str) -> str:
    """Hash ``name -> last time it was mentioned`` beside a structure that keeps no time of its own."""
    return f"{settings.queue_prefix}.{what}.seen"


def prune(client: Redis, settings: PrioSettings, worker: str, now: float | None = None) -> dict[str, int]:
    """One pass, if this worker takes the lease: how many fields went, per structure."""
    if not client.set(f"{settings.queue_prefix}.prune", worker, nx=True, px=int(PRUNE_INTERVAL * 900)):
        return {}
    now = time.time() if now is None else now
    old = now - settings.prune_after
    gone: dict[str, int] = {}

    # Workers: a heartbeat older than the bound (Redis time), with the tiers it served and its rates.
    dead = [
        as_text(w)
        for w, beat in client.hscan_iter(settings.heartbeats_key, count=PRUNE_CHUNK)
        if (_stamp(beat) or 0.0) < old
    ]
    for i in range(0, len(dead), PRUNE_CHUNK):
        chunk = dead[i : i + PRUNE_CHUNK]
        client.hdel(settings.heartbeats_key, *chunk)
        client.hdel(settings.serving_key, *chunk)
        client.hdel(settings.slots_key, *chunk)
    gone["heartbeats"] = len(dead)
    rates_key = f"{settings.stats_key}.rates"
    stale = [f for f, v in client.hscan_iter(rates_key, count=PRUNE_CHUNK) if (_stamp(v) or 0.0) < old]
    gone["rates"] = _delete_fields(client, rates_key, stale)

    # Estimates and sub-queues keep no time: their "seen" hash does (written as they are used).
    estimates = settings.estimates_key
    gone["estimates"] = _prune_by_seen(client, estimates, seen_key(settings, "estimates"), old, now, is_set=False)
    moved = _prune_by_seen(
        client,
        settings.subqueue_registry,
        seen_key(settings, "subqueues"),
        old,
        now,
        is_set=True,
        keep=lambda name: client.exists(name) > 0,  # a sub-queue with messages waiting stays, however old
    )
    if moved:
        client.incr(settings.subqueue_registry_version)  # workers re-read the registry
    gone["subqueues"] = moved
    return gone


def _delete_fields(client: Redis, key: str, fields: list[bytes | str]) -> int:
    for i in range(0, len(fields), PRUNE_CHUNK):
        client.hdel(key, *fields[i : i + PRUNE_CHUNK])
    return len(fields)


def _prune_by_seen(client: Redis, key: str, seen: str, old: float, now: float, *, is_set: bool, keep=None) -> int:
    if is_set:
        names = client.sscan_iter(key, count=PRUNE_CHUNK)
    else:
        names = (f for f, _ in client.hscan_iter(key, count=PRUNE_CHUNK))
    stamps = client.hgetall(seen) if client.exists(seen) else {}
    first_seen, dropped = {}, []
    for name in names:
        stamp = _stamp(stamps.get(name if isinstance(name, bytes) else as_text(name).encode(), b""))
        if stamp is None:
            first_seen[name] = f"{now:.3f}"  # written before pruning existed: its time starts now
        elif stamp < old and not (keep and keep(as_text(name))):
            dropped.append(name)
    if first_seen:
        client.hset(seen, mapping=first_seen)
    for i in range(0, len(dropped), PRUNE_CHUNK):
        chunk = dropped[i : i + PRUNE_CHUNK]
        (client.srem if is_set else client.hdel)(key, *chunk)
        client.hdel(seen, *chunk)
    return len(dropped)


def mention(client: Redis, settings: PrioSettings, what: str, names: list[str], now: float | None = None) -> None:
    """``names`` are in use now (so not pruned for ``prio_prune_after``)."""
    if names:
        stamp = f"{time.time() if now is None else now:.3f}"
        client.hset(seen_key(settings, what), mapping=dict.fromkeys(names, stamp))
