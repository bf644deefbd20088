"""What ``install()`` and the publish path need of Redis: the capped transport, sub-queue registry,
continuations, boost and bulk sessions."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from ...tiers import TIERS, Tier
from ..publishing import BulkSession, Publisher
from .pruning import mention

if TYPE_CHECKING:
    from kombu import Connection

    from .boost import RedisBooster
    from .continuations import RedisContinuations

logger = logging.getLogger(__name__)

REDIS_TRANSPORT_PATH = "celery_prio.brokers.redis.transport:Transport"

SENTINEL_PATH = "celery_prio.brokers.redis.transport:SentinelTransport"


class RedisPublisher(Publisher):
    kind = "redis"

    def introduce_subqueue(self, tier: Tier, name: str) -> None:
        # Every fetch script call returns the registry's version: a worker re-reads the set when it moved.
        settings = self.settings
        with self.app.connection_for_write() as conn:
            client = conn.default_channel.client
            if client.sadd(settings.subqueue_registry, name):
                client.incr(settings.subqueue_registry_version)
            mention(client, settings, "subqueues", [name])  # in use: not pruned for prio_prune_after

    @functools.cached_property
    def continuations(self) -> RedisContinuations:
        from .continuations import RedisContinuations

        return RedisContinuations(self)

    @functools.cached_property
    def booster(self) -> RedisBooster:
        from .boost import RedisBooster

        return RedisBooster(self, self.continuations)

    def configure(self, options: dict[str, object]) -> None:
        settings = self.settings
        # Capacity on Redis lives in an atomic publish script (kombu's Redis
        # transport has no max-length); the subclass runs it for tier queues.
        use_capped_redis_transport()
        # Every tier queue goes through the guarded push (-1: no cap), which also rings the tier's doorbell.
        options["prio_caps"] = {
            settings.queue_name(t): [-1 if cap is None else cap, settings.overflow[t], t.label]
            for t, cap in settings.max_length.items()
        }
        # Every sub-queue of a tier (``<prefix>.<tier>.<name>``) has this cap.
        options["prio_subqueue_caps"] = {
            settings.queue_name(t) + ".": [
                cap if (cap := settings.subqueue_cap(t)) is not None else -1,
                settings.overflow[t],
                t.label,
            ]
            for t in TIERS
        }
        # Tiers with a wait budget (``prio_max_wait``): the publish script predicts each call's wait from the
        # work waiting in the tier and the live slots serving it, atomically with the push.
        lanes = settings.front_lanes()
        options["prio_wait_rules"] = {
            t.label: [budget, settings.queue_name(t), lanes.get(t) or "", settings.queue_name(t) + "."]
            for t, budget in settings.max_wait.items()
            if budget is not None
        }
        options["prio_admission_key"] = settings.admission_key
        options["prio_registry_key"] = settings.subqueue_registry
        options["prio_estimates_key"] = settings.estimates_key
        options["prio_bell_prefix"] = settings.bell_key(Tier.REALTIME).removesuffix(Tier.REALTIME.label)
        # A queue of the app's own (``task_routes`` -> ``default``) counts as the default tier's: a publish to it
        # rings that tier's bell, or a worker serving it, idle on its bells, would see it only at the timeout.
        options["prio_default_bell"] = settings.bell_key(settings.default_tier)
        options["prio_dead_queue"] = settings.dead_letter_queue
        options["prio_stats_key"] = settings.stats_key
        options["prio_owners_key"] = settings.owners_key
        options["prio_ready_key"] = settings.ready_key  # lists with work: a fetch asks only those
        options["prio_wait_replicas"] = settings.wait_replicas
        # This app's in-flight messages in keys of its own: kombu's visibility-timeout restore (which
        # every Redis worker runs) then scans only them, never another app's messages in the same db.
        for name in ("unacked_key", "unacked_index_key", "unacked_mutex_key"):
            options.setdefault(name, f"{settings.queue_prefix}.{name.removesuffix('_key')}")

    def new_bulk_session(self, connection: Connection, tier: Tier, queue: str | None) -> BulkSession:
        from .bulk import RedisBulkSession

        return RedisBulkSession(self.app, connection, self.settings, tier, queue)


def use_capped_redis_transport() -> None:
    """Point kombu's ``redis``/``rediss`` names at our transport subclass.

    Through kombu's own alias table rather than ``broker_transport``: URLs keep
    their ``redis://`` scheme, so tools that read the broker URL back (Flower's
    broker page, ``as_uri()`` in logs) still see Redis. The subclass differs
    only for queues named in ``prio_caps`` transport options, so other Redis
    connections in the process behave exactly as before.
    """
    from kombu import transport

    for name, path in (("redis", REDIS_TRANSPORT_PATH), ("rediss", REDIS_TRANSPORT_PATH), ("sentinel", SENTINEL_PATH)):
        if transport.TRANSPORT_ALIASES.get(name) != path:
            transport.TRANSPORT_ALIASES[name] = path
            transport._transport_cache.pop(name, None)  # a class resolved before install()
