"""``install(app)``: the one call an existing Celery app adds."""

from __future__ import annotations

from typing import Any

from celery import Celery, signals

from .routing import make_router, register_tier_queues, stamp_enqueue_time, tier_queues
from .settings import DEFAULTS, PrioSettings, load_settings
from .tiers import parse_tier

CONSUMER_PATH = "celery_prio.consumer:PrioConsumer"


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
    app._celery_prio_settings = settings  # noqa: SLF001 - cached for settings_for()

    # Queues: keep the user's, add the three tiers (so a plain
    # ``celery -A app worker`` consumes them and tools can list them).
    existing = list(app.conf.task_queues or [])
    names = {q.name for q in existing}
    queues = existing + [q for q in tier_queues(settings) if q.name not in names]
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
    app.conf.broker_transport_options = options

    register_tier_queues(settings)
    signals.before_task_publish.connect(stamp_enqueue_time, weak=False, dispatch_uid="celery_prio.stamp")
    app.on_after_finalize.connect(_check_task_tiers, weak=False)
    return settings


def settings_for(app: Celery) -> PrioSettings:
    """The validated settings of an app (re-read from ``app.conf`` in a worker)."""
    cached = getattr(app, "_celery_prio_settings", None)
    if cached is None:
        cached = load_settings(app.conf)
        app._celery_prio_settings = cached  # noqa: SLF001
    return cached


def _check_task_tiers(sender: Celery, **_: Any) -> None:
    """Fail at start-up, not at first call, when a task declares a bogus tier."""
    for name, task in sender.tasks.items():
        tier = getattr(task, "tier", None)
        if tier is not None:
            try:
                parse_tier(tier)
            except ValueError as exc:
                raise ValueError(f"task {name!r}: {exc}") from None


__all__ = ["install", "settings_for", "DEFAULTS"]
