"""Publish-side admission: a full tier refuses at once with ``QueueFull``.

Redis refuses inside the atomic publish script (``brokers/redis/transport.py``)
and raises ``QueueFull`` itself. RabbitMQ refuses with a publisher-confirm
nack, which kombu surfaces as ``OperationalError``; the wrapper around
``app.send_task`` (``celery_hooks.guard_send_task``) takes the tier and queue the router recorded for the call
(``Prio.routed``) and hands them to the broker's ``Publisher.refusal``, which
turns the nack into ``QueueFull``.
"""

from __future__ import annotations

from typing import Any

from ..errors import QueueFull
from ..runtime import Prio
from ..settings import PrioSettings
from ..tiers import Tier


def before_send(runtime: Prio, options: dict[str, Any]) -> None:
    """Before a call is published: the broker's ``before_send``, and a sub-queue named by name resolved."""
    runtime.publishing.before_send()
    _named_subqueue(runtime, options)


def _named_subqueue(runtime: Prio, options: dict[str, Any]) -> None:
    """A call that names one of our sub-queues by name (Celery's retry does: ``queue=<the routing key it came
    with>``) goes to that sub-queue as declared, not to a queue of that name Celery would make with no
    arguments (which RabbitMQ refuses: ``PRECONDITION_FAILED - inequivalent arg 'x-max-length'``)."""
    queue = options.get("queue")
    settings = runtime.settings
    tier = settings.tier_for_queue(queue) if isinstance(queue, str) else None
    sub = settings.subqueue_of(queue, tier) if tier is not None else None
    if sub is not None:
        options["queue"] = runtime.publishing.subqueue(tier, sub)


def refused(runtime: Prio, settings: PrioSettings, exc: BaseException) -> QueueFull | None:
    """``QueueFull`` for a publish the broker refused, naming the tier and queue the router sent its call to
    (recorded as it routed the call: not routed again here)."""
    route = runtime.routed.get()
    tier = settings.default_tier if route is None or route.tier is None else route.tier
    queue = None if route is None else route.queue
    return runtime.publishing.refusal(Tier(tier), queue, exc)
