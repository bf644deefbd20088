"""``install(app)``: the one call an existing Celery app adds."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, signals
from kombu import Connection

from . import control  # noqa: F401 - registers `celery inspect prio_stats`
from .admission import guard_send_task
from .errors import ConfigError
from .routing import make_router, register_tier_queues, stamp_enqueue_time, tier_queues
from .settings import DEFAULTS, PrioSettings, load_settings
from .tiers import parse_tier

logger = logging.getLogger(__name__)

CONSUMER_PATH = "celery_prio.consumer:PrioConsumer"
REDIS_TRANSPORT_PATH = "celery_prio.brokers.redis_transport:Transport"


def use_capped_redis_transport() -> None:
    """Point kombu's ``redis``/``rediss`` names at our transport subclass.

    Through kombu's own alias table rather than ``broker_transport``: URLs keep
    their ``redis://`` scheme, so tools that read the broker URL back (Flower's
    broker page, ``as_uri()`` in logs) still see Redis. The subclass differs
    only for queues named in ``prio_caps`` transport options, so other Redis
    connections in the process behave exactly as before.
    """
    from kombu import transport

    for name in ("redis", "rediss"):
        if transport.TRANSPORT_ALIASES.get(name) != REDIS_TRANSPORT_PATH:
            transport.TRANSPORT_ALIASES[name] = REDIS_TRANSPORT_PATH
            transport._transport_cache.pop(name, None)  # a class resolved before install()


def broker_kind(app: Celery) -> str:
    """'redis', 'amqp' or another kombu driver type, from the broker URL (no connection made)."""
    url = app.conf.broker_write_url or app.conf.broker_url or "amqp://"
    scheme = url.split("://", 1)[0]
    if scheme in ("redis", "rediss", "sentinel"):
        return "redis"
    if scheme in ("amqp", "amqps", "pyamqp"):
        return "amqp"
    return Connection(url).transport.driver_type


def install(app: Celery, **overrides: Any) -> PrioSettings:
    """Route tasks into tier queues and make workers schedule them by tier.

    ``overrides`` take the ``prio_*`` setting names without the prefix
    (``install(app, weights={"realtime": 8, ...}, aging={"offline": 600})``).
    They are validated here and written back into ``app.conf`` so that worker
    processes, which import the same app, see the same values.
    """
    settings = load_settings(app.conf, overrides)
    for name, value in overrides.items():
        app.conf[f"prio_{name.removeprefix('prio_')}"] = value
    app._celery_prio_settings = settings

    # Queues: keep the user's, add the three tiers (so a plain
    # ``celery -A app worker`` consumes them and tools can list them).
    kind = broker_kind(app)
    settings.check_for_broker(kind)
    existing = list(app.conf.task_queues or [])
    names = {q.name for q in existing}
    queues = existing + [q for q in tier_queues(settings, kind) if q.name not in names]
    app.conf.task_queues = queues
    app.conf.task_default_queue = settings.queue_name(settings.default_tier)
    app.conf.task_default_exchange = settings.queue_name(settings.default_tier)
    app.conf.task_default_routing_key = settings.queue_name(settings.default_tier)
    if "queues" in app.amqp.__dict__:  # amqp.queues already built: extend it too
        for q in queues:
            if q.name not in app.amqp.queues:
                app.amqp.queues.select_add(q)

    routes = app.conf.task_routes
    routes = [] if routes is None else list(routes) if isinstance(routes, (list, tuple)) else [routes]
    routes = [r for r in routes if not getattr(r, "celery_prio", False)]
    app.conf.task_routes = [make_router(settings), *routes]

    app.conf.worker_consumer = CONSUMER_PATH
    # The Redis transport pays one RPOP per priority step on every fetch;
    # tiers replace broker priorities, so one step is enough.
    options = dict(app.conf.broker_transport_options or {})
    options.setdefault("priority_steps", [0])
    if kind == "redis":
        # Capacity on Redis lives in an atomic publish script (kombu's Redis
        # transport has no max-length); the subclass runs it for tier queues.
        use_capped_redis_transport()
        if (app.conf.broker_url or "").startswith("sentinel://"):
            logger.warning(
                "celery-prio: prio_max_length is not enforced on sentinel:// brokers "
                "(kombu's Sentinel transport keeps its own publish)"
            )
        options["prio_caps"] = {
            settings.queue_name(t): [cap, settings.overflow[t], t.label]
            for t, cap in settings.max_length.items()
            if cap is not None
        }
        options["prio_dead_queue"] = settings.dead_letter_queue
        options["prio_stats_key"] = settings.stats_key
    elif kind == "amqp" and any(
        settings.max_length[t] is not None and settings.overflow[t] == "reject" for t in settings.max_length
    ):
        # A full reject-publish queue only tells a publisher that uses confirms
        # (one broker round trip per publish: the price of never losing one).
        options["confirm_publish"] = True
    app.conf.broker_transport_options = options
    guard_send_task(app, settings, kind)

    register_tier_queues(settings)
    signals.before_task_publish.connect(stamp_enqueue_time, weak=False, dispatch_uid="celery_prio.stamp")
    app.on_after_finalize.connect(_log_task_tier_errors, weak=False)
    return settings


def settings_for(app: Celery) -> PrioSettings:
    """The validated settings of an app (re-read from ``app.conf`` in a worker)."""
    cached = getattr(app, "_celery_prio_settings", None)
    if cached is None:
        cached = load_settings(app.conf)
        app._celery_prio_settings = cached
    return cached


def check_task_tiers(app: Celery) -> None:
    """Every task's ``tier`` attribute must name a tier: checked at worker start (``ConfigError``)."""
    for name, task in app.tasks.items():
        tier = getattr(task, "tier", None)
        if tier is not None:
            try:
                parse_tier(tier)
            except ValueError as exc:
                raise ConfigError(f"task {name!r}: {exc}") from None


def _log_task_tier_errors(sender: Celery, **_: Any) -> None:
    # Celery's signal dispatcher swallows exceptions; this only says it early.
    # The worker refuses to start in check_task_tiers.
    try:
        check_task_tiers(sender)
    except ConfigError as exc:
        logger.error("celery-prio: %s", exc)


__all__ = ["DEFAULTS", "install", "settings_for"]
