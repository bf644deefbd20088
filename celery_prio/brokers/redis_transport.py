"""kombu's Redis transport with an atomic, capped publish for tier queues.

``install()`` selects it (``broker_transport``) when the broker is Redis and
passes the caps through ``broker_transport_options['prio_caps']``. Every
other queue, and every consumer-side operation, is kombu's own code.
"""

from __future__ import annotations

import math
import time
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps

from ..errors import QueueFull
from ..tiers import parse_tier
from .redis_scripts import GUARDED_PUSH


class Channel(kombu_redis.Channel):
    _guarded_push = None

    def _put(self, queue: str, message: dict, **kwargs: Any) -> None:
        options = self.connection.client.transport_options
        caps = options.get("prio_caps") or {}
        rule = caps.get(queue)
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
