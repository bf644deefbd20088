"""Producer side: tier -> queue routing and the enqueue stamp.

The router (a ``task_routes`` entry) names each call's queue: the tier and
sub-queue ``policy/routes.py`` decides, raised by inheritance (a child of a
running task, a step published by a boosted task). Un-tiered tasks fall
through to the user's own routes and then to ``task_default_queue``, which
``install()`` points at the default tier's queue.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kombu import Queue

from ..headers import ENQUEUED_HEADER
from ..policy.routes import subqueue_of_call, tier_of_call
from ..runtime import Route
from ..settings import PrioSettings
from ..tiers import TIERS, Tier
from .inherit import boosted_floor, higher, parent_tier

if TYPE_CHECKING:
    from celery import Task

#: A sub-queue's kombu Queue (declared and made known to workers on first use): ``(tier, name) -> Queue``.
SubqueueOf = Callable[[Tier, str], Queue]


def route_of_call(
    settings: PrioSettings, name: str, args: Any, kwargs: Any, options: dict, task: Task | None = None
) -> tuple[Tier | None, str | None]:
    """``(tier, sub-queue)`` of a call; pops our ``tier`` and ``subqueue`` options (kombu never sees them)."""
    tier = tier_of_call(settings, name, options.pop("tier", None), task)
    # Nothing names one: a child of a running task runs at its parent's tier. Published by a boosted
    # task (a chain's next step, a child): at least at the tier it was lifted to.
    tier = parent_tier(settings) if tier is None else higher(tier, boosted_floor(settings))
    if getattr(task, "batch", None) is not None:  # celery_prio.Batch: the task's calls wait in its own queue
        if options.pop("subqueue", None) is not None:
            raise ValueError(
                f"task {name!r} is batched: its calls wait in a queue of their own; subqueue= does not apply"
            )
        return (settings.default_tier if tier is None else tier), settings.sjf_subqueue(name)
    sub = subqueue_of_call(settings, name, options.pop("subqueue", None), task, (args, kwargs, options))
    if sub is not None and tier is None:
        tier = settings.default_tier  # a sub-queue lives in a tier: the default one unless named
    if sub is None and tier is Tier.REALTIME and settings.sjf:
        sub = settings.sjf_subqueue(name)  # one realtime sub-queue per task name: shortest expected first
    return tier, sub


def make_router(
    settings: PrioSettings,
    subqueue: SubqueueOf | None = None,
    routed: contextvars.ContextVar[Route | None] | None = None,
    admit: Callable[[Tier, str], None] | None = None,
):
    """A Celery router function (``task_routes`` entry) that maps tiers (and sub-queues) to queues.

    ``subqueue(tier, name)`` returns the kombu Queue of a sub-queue (made
    known to the workers on first use). ``routed`` records each decision for
    the publish that follows (a refusal names the tier and queue from it).
    ``admit(tier, queue)`` raises ``QueueFull`` for a call its tier cannot take
    in time (RabbitMQ's admission by predicted wait), before anything is sent.
    """
    queue_for = {tier: settings.queue_name(tier) for tier in TIERS}

    def route_by_tier(name: str, args: Any, kwargs: Any, options: dict, task: Task | None = None, **_: object):
        tier, sub = route_of_call(settings, name, args, kwargs, options, task)
        queue = None if tier is None or sub is None else settings.subqueue_name(tier, sub)
        if routed is not None:
            routed.set(Route(tier, queue))
        if tier is None:
            return None
        if sub is not None:
            if subqueue is None:
                raise ValueError("sub-queues need celery_prio.install(app)")
            kombu_queue = subqueue(tier, sub)
            register_subqueue(kombu_queue.name)  # stamped like a tier queue
            if admit is not None:
                admit(tier, kombu_queue.name)
            return {"queue": kombu_queue}
        if admit is not None:
            admit(tier, queue_for[tier])
        return {"queue": queue_for[tier]}

    route_by_tier.celery_prio = True  # type: ignore[attr-defined]
    return route_by_tier


# Tier queue names of every installed app in this process; the publish hook
# stamps only messages bound for them.
_TIER_QUEUES: set[str] = set()


def register_tier_queues(settings: PrioSettings) -> None:
    _TIER_QUEUES.update(settings.queue_name(t) for t in TIERS)


def register_subqueue(name: str) -> None:
    _TIER_QUEUES.add(name)


def stamp_enqueue_time(
    sender: Any = None, routing_key: str | None = None, headers: dict | None = None, **_: object
) -> None:
    """``before_task_publish`` receiver: record when the message entered its tier (or sub-queue)."""
    if headers is not None and routing_key in _TIER_QUEUES:
        headers[ENQUEUED_HEADER] = time.time()
