"""``install(app)``: the one call an existing Celery app adds.

It writes celery-prio's part into the app's configuration and keeps a
runtime (``runtime.py``) of what it wrote. Configuration set *after*
``install()`` (a later ``app.conf.task_routes = ...``, a config module
loaded afterwards) would silently undo it; :func:`ensure_installed` runs at
finalize, at worker start and before every publish, applies ``install()``
again where a value was replaced, and logs which one. A worker whose
``worker_consumer`` was replaced by another consumer refuses to start,
naming the setting.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from celery import Celery, signals
from celery.utils.imports import symbol_by_name

from .batching import batch_of
from .brokers import publisher_for
from .celery_hooks import (
    batched_from_the_start,
    count_result_waits,
    guard_send_task,
    lift_canvases,
    mask_in_inspect_conf,
    route_groups_through_bulk,
    takes_batches,
)
from .errors import ConfigError
from .policy.routes import check_task_tiers
from .producer.routing import make_router, register_tier_queues, stamp_enqueue_time
from .runtime import Prio, bind, runtime_of
from .settings import DEFAULTS, PrioSettings, load_settings
from .tiers import TIERS
from .worker import control  # noqa: F401 - registers `celery inspect prio_stats` and `prio_supersede`
from .worker.gpus import add_worker_option
from .worker.slice_board import board

if TYPE_CHECKING:
    from celery.worker import WorkController

logger = logging.getLogger(__name__)

CONSUMER_PATH = "celery_prio.worker.consumer:PrioConsumer"
#: Celery's own values of what install() replaces: a config reloaded after install() brings these back.
CELERY_DEFAULT_CONSUMER = "celery.worker.consumer:Consumer"
CELERY_DEFAULT_QUEUE = "celery"
DEFAULT_QUEUE_KEYS = ("task_default_queue", "task_default_exchange", "task_default_routing_key")


def install(app: Celery, **overrides: object) -> PrioSettings:
    """Route tasks into tier queues and make workers schedule them by tier.

    ``overrides`` take the ``prio_*`` setting names without the prefix
    (``install(app, weights={"realtime": 8, ...}, aging={"offline": 600})``).
    They are validated here and written back into ``app.conf`` so that worker
    processes, which import the same app, see the same values. Configuration
    the app sets afterwards does not undo this (see ``ensure_installed``).
    """
    settings = load_settings(app.conf, overrides)
    publishing = publisher_for(app)
    publishing.bind(settings)
    publishing.check()
    _check_consumer(app.conf.worker_consumer, before_install=True)
    runtime = Prio(
        overrides=dict(overrides),
        publishing=publishing,
        settings=settings,
        original_default_queue=app.conf.task_default_queue or CELERY_DEFAULT_QUEUE,
    )
    bind(app, runtime)
    mask_in_inspect_conf("MANAGEMENT_URL")  # prio_management_url may hold credentials
    runtime.changes = _apply(app, runtime, first=True)
    logger.info("celery-prio: install() changed this app's configuration: %s", "; ".join(runtime.changes))

    board()  # shared with the pool children: made here, before a worker forks them
    route_groups_through_bulk()
    lift_canvases()
    count_result_waits()
    batched_from_the_start()
    signals.before_task_publish.connect(stamp_enqueue_time, weak=False, dispatch_uid="celery_prio.stamp")
    publishing.remember_publishes()  # after the stamp: what a boost republishes carries it
    app.on_after_finalize.connect(_on_finalize, weak=False)
    signals.celeryd_init.connect(_on_worker_init, weak=False, dispatch_uid="celery_prio.worker_init")
    add_worker_option(app)  # --prio-gpus: GPU-pinned pool processes (worker/gpus.py)
    return runtime.settings


def _apply(app: Celery, runtime: Prio, first: bool) -> list[str]:
    """Write celery-prio's part into ``app.conf`` (again); the changes, as readable lines."""
    conf = app.conf
    changes: list[str] = []
    for name, value in runtime.overrides.items():
        conf[f"prio_{name.removeprefix('prio_')}"] = value
    settings = load_settings(conf, runtime.overrides)  # the config may have new prio_* keys
    runtime.use(settings)
    publishing = runtime.publishing

    # Queues: keep the user's, add the three tiers (so a plain ``celery -A app worker`` consumes them and
    # tools can list them).
    existing = list(conf.task_queues or [])
    names = {q.name for q in existing}
    added = [q for q in publishing.queues() if q.name not in names]
    if added:
        changes.append(f"task_queues: + {', '.join(q.name for q in added)}")
    conf.task_queues = runtime.task_queues = existing + added
    if "queues" in app.amqp.__dict__:  # amqp.queues already built: extend it too
        for q in conf.task_queues:
            if q.name not in app.amqp.queues:
                app.amqp.queues.select_add(q)

    # Un-tiered calls with no route of the app's own go to the default tier's queue. Producers not yet
    # upgraded keep publishing to the old one: workers drain it while it has messages (prio_legacy_queues).
    ours = settings.queue_name(settings.default_tier)
    for key in DEFAULT_QUEUE_KEYS:
        current = conf.get(key)
        if current == ours:
            continue
        if first or current in (None, "", CELERY_DEFAULT_QUEUE):
            conf[key] = ours
            changes.append(f"{key} {current!r} -> {ours!r}")
    if first and runtime.legacy_queues:
        changes.append(
            f"workers that serve {settings.default_tier.label} also drain {', '.join(runtime.legacy_queues)} "
            "while it holds messages (prio_legacy_queues)"
        )

    routes = conf.task_routes
    routes = [] if routes is None else list(routes) if isinstance(routes, (list, tuple)) else [routes]
    routes = [r for r in routes if not getattr(r, "celery_prio", False)]
    router = make_router(settings, publishing.subqueue, runtime.routed, publishing.admit)
    conf.task_routes = runtime.routes = [router, *routes]
    changes.append("task_routes: the tier router first" + (", then the app's own routes" if routes else ""))

    if not _serves_prio(conf.worker_consumer):  # a PrioConsumer subclass of the app's own stays
        _check_consumer(conf.worker_consumer, before_install=first)
        changes.append(f"worker_consumer {conf.worker_consumer!r} -> {CONSUMER_PATH!r}")
        conf.worker_consumer = CONSUMER_PATH

    # The Redis transport pays one RPOP per priority step on every fetch; tiers replace broker priorities,
    # so one step is enough.
    options = dict(conf.broker_transport_options or {})
    before = dict(options)
    options.setdefault("priority_steps", [0])
    publishing.configure(options)
    conf.broker_transport_options = runtime.transport_options = options
    added_options = sorted(k for k in options if k not in before or before[k] != options[k])
    if added_options:
        changes.append(f"broker_transport_options: + {', '.join(added_options)}")
    runtime.conf = conf

    guard_send_task(app, runtime, lambda: ensure_installed(app))
    register_tier_queues(settings)
    if not first:  # connections and routes made from the replaced values are dropped: the next use rebuilds them
        app.amqp.flush_routes()
        app.amqp.__dict__.pop("router", None)
        app.amqp._producer_pool = None
        app._pool = None
    return changes


@functools.lru_cache(maxsize=16)
def _serves_prio(value: object) -> bool:
    """Whether ``worker_consumer`` is celery-prio's consumer or the app's own subclass of it."""
    if value == CONSUMER_PATH:
        return True
    from .worker.consumer import PrioConsumer

    try:
        cls = symbol_by_name(value) if isinstance(value, str) else value
    except Exception:  # an import error in the user's module: not ours (Celery reports it as it would)
        return False
    return isinstance(cls, type) and issubclass(cls, PrioConsumer)


def _check_consumer(value: object, before_install: bool) -> None:
    """``worker_consumer`` must be Celery's (install() replaces it) or celery-prio's, or a subclass of it."""
    if value in (None, CELERY_DEFAULT_CONSUMER, CONSUMER_PATH):
        return
    try:
        symbol_by_name(value) if isinstance(value, str) else value
    except Exception:  # an import error in the user's module: let Celery report it as it would
        return
    if _serves_prio(value):
        return
    when = "before" if before_install else "after"
    raise ConfigError(
        f"worker_consumer is set to {value!r} {when} celery_prio.install(): celery-prio's worker needs its own "
        f"consumer ({CONSUMER_PATH}); make yours a subclass of celery_prio.worker.consumer.PrioConsumer"
    )


def replaced_settings(app: Celery, runtime: Prio) -> list[str]:
    """The settings whose values are no longer what ``install()`` wrote (empty: all in place)."""
    conf = app.conf
    out = []
    routes = conf.task_routes
    if not isinstance(routes, (list, tuple)) or not routes or routes[0] is not runtime.routes[0]:
        out.append("task_routes")
    options = conf.broker_transport_options or {}
    if any(options.get(k) != v for k, v in runtime.transport_options.items() if k.startswith("prio_")):
        out.append("broker_transport_options")
    queues = {getattr(q, "name", None) for q in conf.task_queues or ()}
    if any(runtime.settings.queue_name(t) not in queues for t in TIERS):
        out.append("task_queues")
    if not _serves_prio(conf.worker_consumer):
        out.append("worker_consumer")
    for name, value in runtime.overrides.items():
        key = f"prio_{name.removeprefix('prio_')}"
        if conf.get(key) != value:
            out.append(key)
    return out


def ensure_installed(app: Celery, worker: bool = False) -> PrioSettings:
    """The app's settings, after applying ``install()`` again if its configuration replaced what it wrote.

    Cheap when nothing changed (three identity checks): it runs before every publish.
    """
    runtime = runtime_of(app)
    if runtime is None:
        raise RuntimeError("celery-prio is not installed on this app: call celery_prio.install(app)")
    conf = app.conf
    if (
        conf is runtime.conf
        and conf.get("task_routes") is runtime.routes
        and conf.get("broker_transport_options") is runtime.transport_options
        and conf.get("task_queues") is runtime.task_queues
        and (not worker or _serves_prio(conf.get("worker_consumer")))
    ):
        return runtime.settings
    replaced = replaced_settings(app, runtime)
    if not replaced:  # equal values in new objects (a copy): remember these
        runtime.conf, runtime.routes = conf, conf.task_routes
        runtime.transport_options, runtime.task_queues = conf.broker_transport_options, conf.task_queues
        return runtime.settings
    _apply(app, runtime, first=False)
    logger.warning(
        "celery-prio: %s replaced after celery_prio.install(); celery-prio applied itself again (its router in "
        "front of the new routes, its queues and transport options merged in). Call install() after the app's "
        "configuration to keep this quiet.",
        ", ".join(f"app.conf.{name}" for name in replaced) + (" was" if len(replaced) == 1 else " were"),
    )
    return runtime.settings


def _on_worker_init(sender: object = None, instance: WorkController | None = None, **_: object) -> None:
    """``celeryd_init``: before the worker reads ``worker_consumer``, its queues and its connection settings.

    A consumer of the app's own set after install() cannot run with celery-prio's: the worker refuses to
    start, naming the setting (a ``SystemExit``: Celery's signal dispatch would swallow an exception)."""
    app = getattr(instance, "app", None)
    if app is None or runtime_of(app) is None:
        return
    try:
        ensure_installed(app, worker=True)
    except ConfigError as exc:
        raise SystemExit(f"celery-prio: {exc}") from None


def _on_finalize(sender: Celery, **_: object) -> None:
    """The app's tasks are all there: batched tasks take a single call as a batch of one (a direct call, eager
    mode, an ETA), in every process of the app (a worker's pool children are forked after this); and
    configuration set since ``install()`` has not undone it."""
    # Celery's signal dispatcher swallows exceptions; this only says it early.
    # The worker refuses to start in check_task_tiers (and with a bad batch=).
    try:
        if runtime_of(sender) is not None:
            ensure_installed(sender)
        check_task_tiers(sender.tasks)
        for task in sender.tasks.values():
            if batch_of(task) is not None:
                takes_batches(task)
    except ConfigError as exc:
        logger.error("celery-prio: %s", exc)


__all__ = ["DEFAULTS", "ensure_installed", "install"]
