"""One per-app runtime: what ``install(app)`` decided, kept so that it can be checked and applied again.

``install()`` writes into the app's configuration (the tier router in
``task_routes``, the tier queues, the consumer, transport options). An
app's later configuration can replace those values: a multi-module config
assigning ``app.conf.task_routes = {...}``, or ``config_from_object()``
loading a module after ``install()`` (which rebuilds the whole config).
:func:`celery_prio.install.ensure_installed` compares the live
configuration with what is kept here and applies ``install()`` again,
saying which setting was replaced.

Reached through :func:`runtime_of` only: the app carries no attribute of
it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from celery import Celery

from .brokers.base import Publisher
from .settings import PrioSettings


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


def runtime_of(app: Any) -> Prio | None:
    """The runtime ``install()`` made for ``app``; None for an app without celery-prio."""
    try:
        return _RUNTIMES.get(app)
    except TypeError:  # not weak-referenceable: not a Celery app
        return None


def bind(app: Celery, runtime: Prio) -> None:
    _RUNTIMES[app] = runtime


__all__ = ["Prio", "bind", "runtime_of"]
