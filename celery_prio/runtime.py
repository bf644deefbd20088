"""One per-app runtime: what ``install(app)`` decided and the broker kit bound to it, reached through one accessor.

``install()`` makes a :class:`Prio` for its app and binds it here. It holds
the validated settings, the app's :class:`~celery_prio.brokers.publishing.Publisher`
(bound once to the app and its settings; the continuations, booster, bulk
sessions, refusal figures and recent publishes hang off it), and the routing
decision of the call being published, so that a refusal names the tier and
queue the call was routed to without routing it again.

``install()`` writes into the app's configuration (the tier router in
``task_routes``, the tier queues, the consumer, transport options). An
app's later configuration can replace those values: a multi-module config
assigning ``app.conf.task_routes = {...}``, or ``config_from_object()``
loading a module after ``install()`` (which rebuilds the whole config).
:func:`celery_prio.install.ensure_installed` compares the live
configuration with what is kept here and applies ``install()`` again,
saying which setting was replaced.

The app carries no attribute of it: everything goes through
:func:`runtime_of`, :func:`settings_for` and :func:`publisher_of`.
"""

from __future__ import annotations

import contextvars
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery import Celery

from .brokers.publishing import Publisher
from .settings import PrioSettings, load_settings
from .tiers import Tier

if TYPE_CHECKING:
    from celery import Celery


@dataclass(frozen=True)
class Route:
    """Where the router sent one call: its tier (None: not ours, the app's own routes or default queue) and the
    sub-queue inside it (None: the tier's own queue)."""

    tier: Tier | None
    queue: str | None


@dataclass
class Prio:
    """An app's celery-prio runtime (made by ``install()``)."""

    overrides: dict[str, Any]
    publishing: Publisher
    settings: PrioSettings
    #: The app's ``task_default_queue`` before ``install()``: producers not yet upgraded still publish there.
    original_default_queue: str
    #: The values ``install()`` last wrote, to tell when the app's configuration replaced them.
    conf: Any = None
    routes: Any = None
    transport_options: Any = None
    task_queues: Any = None
    #: What ``install()`` changed in the app's configuration, as readable lines (logged once by the worker).
    changes: list[str] = field(default_factory=list)
    #: The routing decision of the call this thread (or task) is publishing now; set by the router.
    routed: contextvars.ContextVar[Route | None] = field(
        default_factory=lambda: contextvars.ContextVar("celery_prio_routed", default=None)
    )

    def use(self, settings: PrioSettings) -> None:
        """The app's settings from now on, for the runtime and every role of its broker kit."""
        self.settings = settings
        self.publishing.bind(settings)

    @property
    def legacy_queues(self) -> tuple[str, ...]:
        """Queues workers of the default tier drain while they hold messages (``prio_legacy_queues``)."""
        if self.settings.legacy_queues is not None:
            names = self.settings.legacy_queues
        else:
            names = (self.original_default_queue,)
        ours = {self.settings.queue_name(t) for t in self.settings.weights}
        return tuple(n for n in names if n and n not in ours)


_RUNTIMES: weakref.WeakKeyDictionary[Celery, Prio] = weakref.WeakKeyDictionary()
#: Settings of apps without celery-prio installed in this process (a worker's or a tool's view of an app whose
#: ``install()`` ran elsewhere), read once per app.
_LOADED: weakref.WeakKeyDictionary[Celery, PrioSettings] = weakref.WeakKeyDictionary()


def runtime_of(app: Celery) -> Prio | None:
    """The runtime ``install()`` made for ``app``; None for an app without celery-prio."""
    try:
        return _RUNTIMES.get(app)
    except TypeError:  # not weak-referenceable: not a Celery app
        return None


def publisher_of(app: Celery) -> Publisher | None:
    """The app's bound publisher (``install()`` made it); None for an app without celery-prio."""
    runtime = runtime_of(app)
    return None if runtime is None else runtime.publishing


def settings_for(app: Celery) -> PrioSettings:
    """The validated settings of an app (``install()`` keeps them; otherwise read from ``app.conf`` once)."""
    runtime = runtime_of(app)
    if runtime is not None:
        return runtime.settings
    try:
        loaded = _LOADED.get(app)
    except TypeError:  # not weak-referenceable: read every time
        return load_settings(app.conf)
    if loaded is None:
        loaded = _LOADED[app] = load_settings(app.conf)
    return loaded


def bind(app: Celery, runtime: Prio) -> None:
    _RUNTIMES[app] = runtime
    _LOADED.pop(app, None)


__all__ = ["Prio", "Route", "bind", "publisher_of", "runtime_of", "settings_for"]
