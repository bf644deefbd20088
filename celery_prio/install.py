"""``install(app)``: the one call an existing Celery app adds."""

from __future__ import annotations

import logging
import re
from typing import Any

from celery import Celery, signals

from .batching import batch_of, takes_batches
from .brokers import publisher_for
from .errors import ConfigError
from .policy.routes import check_task_tiers
from .producer.admission import guard_send_task
from .producer.canvas import route_groups_through_bulk
from .producer.inherit import lift_canvases
from .producer.routing import make_router, register_tier_queues, stamp_enqueue_time
from .settings import DEFAULTS, PrioSettings, load_settings
from .worker import control  # noqa: F401 - registers `celery inspect prio_stats` and `prio_supersede`
from .worker.slice_board import board

logger = logging.getLogger(__name__)

CONSUMER_PATH = "celery_prio.worker.consumer:PrioConsumer"


def _mask_in_inspect_conf(word: str) -> None:
    """``celery inspect conf`` masks settings whose names match Celery's ``HIDDEN_SETTINGS`` (KEY, PASS,
    SECRET ...); ``prio_management_url`` may hold credentials too, so its name joins that list."""
    from celery.app import utils

    if word not in utils.HIDDEN_SETTINGS.pattern:
        utils.HIDDEN_SETTINGS = re.compile(f"{utils.HIDDEN_SETTINGS.pattern}|{word}", re.IGNORECASE)


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
    _mask_in_inspect_conf("MANAGEMENT_URL")

    # Queues: keep the user's, add the three tiers (so a plain
    # ``celery -A app worker`` consumes them and tools can list them).
    publishing = app._celery_prio_publishing = publisher_for(app)
    publishing.check(settings)
    existing = list(app.conf.task_queues or [])
    names = {q.name for q in existing}
    queues = existing + [q for q in publishing.queues(settings) if q.name not in names]
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
    app.conf.task_routes = [
        make_router(settings, lambda tier, sub: publishing.subqueue(app, settings, tier, sub)),
        *routes,
    ]

    app.conf.worker_consumer = CONSUMER_PATH
    # The Redis transport pays one RPOP per priority step on every fetch;
    # tiers replace broker priorities, so one step is enough.
    options = dict(app.conf.broker_transport_options or {})
    options.setdefault("priority_steps", [0])
    publishing.configure(app, settings, options)
    app.conf.broker_transport_options = options
    guard_send_task(app, settings, publishing)

    board()  # shared with the pool children: made here, before a worker forks them
    route_groups_through_bulk()
    lift_canvases()
    register_tier_queues(settings)
    signals.before_task_publish.connect(stamp_enqueue_time, weak=False, dispatch_uid="celery_prio.stamp")
    publishing.remember_publishes(settings)  # after the stamp: what a boost republishes carries it
    app.on_after_finalize.connect(_on_finalize, weak=False)
    return settings


def _on_finalize(sender: Celery, **_: Any) -> None:
    """The app's tasks are all there: batched tasks take a single call as a batch of one (a direct call, eager
    mode, an ETA), in every process of the app (a worker's pool children are forked after this)."""
    # Celery's signal dispatcher swallows exceptions; this only says it early.
    # The worker refuses to start in check_task_tiers (and with a bad batch=).
    try:
        check_task_tiers(sender.tasks)
        for task in sender.tasks.values():
            if batch_of(task) is not None:
                takes_batches(task)
    except ConfigError as exc:
        logger.error("celery-prio: %s", exc)


__all__ = ["DEFAULTS", "install"]
