"""Producer side: tier -> queue routing and the enqueue stamp.

A tier comes, in this order, from ``apply_async(..., tier=...)``, from the
task's ``tier`` attribute (``@app.task(tier="realtime")``), from the
``prio_routes`` name-pattern map; un-tiered tasks fall through to the user's
own routes and then to ``task_default_queue``, which ``install()`` points at
the default tier's queue.
"""

from __future__ import annotations

import time
from typing import Any

from .admission import last_route
from .headers import ENQUEUED_HEADER
from .settings import PrioSettings
from .tiers import TIERS, Tier, parse_tier

# Tier queue names of every installed app in this process; the publish hook
# stamps only messages bound for them.
_TIER_QUEUES: set[str] = set()


def tier_of_call(settings: PrioSettings, name: str, explicit: Any, task: Any = None) -> Tier | None:
    """The tier of a call: the call's ``tier``, the task's, the ``prio_routes`` pattern; None if none names one.

    None leaves the call to the user's own routes, then ``task_default_queue``.
    """
    raw = explicit if explicit is not None else getattr(task, "tier", None)
    return parse_tier(raw) if raw is not None else settings.tier_for_task_name(name)


def make_router(settings: PrioSettings):
    """A Celery router function (``task_routes`` entry) that maps tiers to queues."""
    queue_for = {tier: settings.queue_name(tier) for tier in TIERS}

    def route_by_tier(name: str, args: Any, kwargs: Any, options: dict, task: Any = None, **_: Any):
        # ``tier`` is ours, not a publish option: pop it so kombu never sees it.
        tier = tier_of_call(settings, name, options.pop("tier", None), task)
        # Remembered for admission: a refused publish names its tier.
        last_route.tier = settings.default_tier if tier is None else tier
        if tier is None:
            return None
        return {"queue": queue_for[tier]}

    route_by_tier.celery_prio = True  # type: ignore[attr-defined]
    return route_by_tier


def register_tier_queues(settings: PrioSettings) -> None:
    _TIER_QUEUES.update(settings.queue_name(t) for t in TIERS)


def stamp_enqueue_time(
    sender: Any = None, routing_key: str | None = None, headers: dict | None = None, **_: Any
) -> None:
    """``before_task_publish`` receiver: record when the message entered its tier."""
    if headers is not None and routing_key in _TIER_QUEUES:
        headers[ENQUEUED_HEADER] = time.time()
