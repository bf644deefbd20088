"""Publish-side admission: a full tier refuses at once with ``QueueFull``.

Redis refuses inside the atomic publish script (``brokers/redis/transport.py``)
and raises ``QueueFull`` itself. RabbitMQ refuses with a publisher-confirm
nack, which kombu surfaces as ``OperationalError``; this wrapper around
``app.send_task`` works out where the refused call was routed (the same
decision the router made) and hands tier and queue to the broker's
``Publisher.refusal``, which turns the nack into ``QueueFull``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError

from ..brokers.base import Publisher
from ..errors import QueueFull
from ..settings import PrioSettings
from ..tiers import Tier
from .routing import route_of_call


def guard_send_task(app: Celery, current_settings: Callable[[], PrioSettings], publishing: Publisher) -> None:
    """Wrap ``app.send_task``: ``current_settings()`` first (it applies ``install()`` again if the app's
    configuration replaced it since), the broker's ``before_send``, and refusals turned into ``QueueFull``."""
    send_task = app.send_task
    if getattr(send_task, "celery_prio", False):
        send_task = send_task.__wrapped__

    @functools.wraps(send_task)
    def send_task_admitted(*args: Any, **kwargs: Any) -> Any:
        settings = current_settings()
        publishing.before_send(app, settings)
        _named_subqueue(app, settings, publishing, kwargs)
        try:
            return send_task(*args, **kwargs)
        except OperationalError as exc:
            full = _refused(app, settings, publishing, args, kwargs, exc)
            if full is None:
                raise
            raise full from None

    send_task_admitted.celery_prio = True  # type: ignore[attr-defined]
    app.send_task = send_task_admitted


def _named_subqueue(app: Celery, settings: PrioSettings, publishing: Publisher, options: dict[str, Any]) -> None:
    """A call that names one of our sub-queues by name (Celery's retry does: ``queue=<the routing key it came
    with>``) goes to that sub-queue as declared, not to a queue of that name Celery would make with no
    arguments (which RabbitMQ refuses: ``PRECONDITION_FAILED - inequivalent arg 'x-max-length'``)."""
    queue = options.get("queue")
    tier = settings.tier_for_queue(queue) if isinstance(queue, str) else None
    sub = settings.subqueue_of(queue, tier) if tier is not None else None
    if sub is not None:
        options["queue"] = publishing.subqueue(app, settings, tier, sub)


def _refused(
    app: Celery, settings: PrioSettings, publishing: Publisher, args: tuple, kwargs: dict, exc: BaseException
) -> QueueFull | None:
    """``QueueFull`` for a publish the broker refused, naming the tier and queue its call was routed to."""
    name = args[0] if args else kwargs.get("name")
    call_args = args[1] if len(args) > 1 else kwargs.get("args")
    call_kwargs = args[2] if len(args) > 2 else kwargs.get("kwargs")
    options = {k: v for k, v in kwargs.items() if k not in ("name", "args", "kwargs")}
    try:
        tier, sub = route_of_call(settings, str(name), call_args, call_kwargs, options, app.tasks.get(name))
    except ValueError:  # the router refused it before anything was published: not a refusal by the broker
        return None
    tier = settings.default_tier if tier is None else tier
    queue = None if sub is None else settings.subqueue_name(tier, sub)
    return publishing.refusal(app, settings, Tier(tier), queue, exc)
