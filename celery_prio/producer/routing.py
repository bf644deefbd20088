"""Producer side: tier -> queue routing and the enqueue stamp.

A tier comes, in this order, from ``apply_async(..., tier=...)``, from the
task's ``tier`` attribute (``@app.task(tier="realtime")``), from the
``prio_routes`` name-pattern map; un-tiered tasks fall through to the user's
own routes and then to ``task_default_queue``, which ``install()`` points at
the default tier's queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..headers import ENQUEUED_HEADER
from ..settings import PrioSettings, subqueue_name_problem
from ..tiers import TIERS, Tier, parse_tier
from .admission import last_route

# Tier queue names of every installed app in this process; the publish hook
# stamps only messages bound for them.
_TIER_QUEUES: set[str] = set()


def tier_of_call(settings: PrioSettings, name: str, explicit: Any, task: Any = None) -> Tier | None:
    """The tier of a call: the call's ``tier``, the task's, the ``prio_routes`` pattern; None if none names one.

    None leaves the call to the user's own routes, then ``task_default_queue``.
    """
    raw = explicit if explicit is not None else getattr(task, "tier", None)
    return parse_tier(raw) if raw is not None else settings.tier_for_task_name(name)


def subqueue_of_call(settings: PrioSettings, name: str, explicit: Any, task: Any, call: tuple) -> str | None:
    """The sub-queue of a call: the call's ``subqueue``, the task's, ``prio_subqueue_key``; None if none names one.

    Raises ``ValueError`` naming the problem for a name that cannot be a queue's.
    """
    sub = explicit if explicit is not None else getattr(task, "subqueue", None)
    if sub is None:
        sub = settings.subqueue_for_call(name, *call)
    if sub is not None:
        problem = subqueue_name_problem(sub)
        if problem:
            raise ValueError(f"task {name!r}: {problem}")
    return sub


def make_router(settings: PrioSettings, subqueue: Callable[[Tier, str], Any] | None = None):
    """A Celery router function (``task_routes`` entry) that maps tiers (and sub-queues) to queues.

    ``subqueue(tier, name)`` returns the kombu Queue of a sub-queue (made
    known to the workers on first use).
    """
    queue_for = {tier: settings.queue_name(tier) for tier in TIERS}

    def route_by_tier(name: str, args: Any, kwargs: Any, options: dict, task: Any = None, **_: Any):
        # ``tier`` and ``subqueue`` are ours, not publish options: pop them so kombu never sees them.
        tier = tier_of_call(settings, name, options.pop("tier", None), task)
        from .inherit import boosted_floor, higher, parent_tier

        # Nothing names one: a child of a running task runs at its parent's tier. Published by a boosted
        # task (a chain's next step, a child): at least at the tier it was lifted to.
        tier = parent_tier(settings) if tier is None else higher(tier, boosted_floor(settings))
        sub = subqueue_of_call(settings, name, options.pop("subqueue", None), task, (args, kwargs, options))
        if sub is not None and tier is None:
            tier = settings.default_tier  # a sub-queue lives in a tier: the default one unless named
        if sub is None and tier is Tier.REALTIME and settings.sjf:
            sub = settings.sjf_subqueue(name)  # one realtime sub-queue per task name: shortest expected first
        # Remembered for admission: a refused publish names its tier (and the queue that refused).
        last_route.tier = settings.default_tier if tier is None else tier
        last_route.queue = None
        if tier is None:
            return None
        if sub is not None:
            if subqueue is None:
                raise ValueError("sub-queues need celery_prio.install(app)")
            queue = subqueue(tier, sub)
            last_route.queue = queue.name
            return {"queue": queue}
        return {"queue": queue_for[tier]}

    route_by_tier.celery_prio = True  # type: ignore[attr-defined]
    return route_by_tier


def sjf_queues(settings: PrioSettings, tasks: Any, every_task: bool = False) -> list[str]:
    """The shortest-first queues a worker serves from the start, without discovery (``tasks``: ``app.tasks``).

    Any task can reach realtime per call (``apply_async(tier="realtime")``),
    as a child of a realtime task or through canvas inheritance, and then
    goes to its own shortest-first queue. With ``every_task`` (a broker that
    asks all of a worker's queues in one call, as Redis' fetch script does)
    that is every registered task's: a worker can only run what it has
    registered, so it knows them all. Otherwise the tasks whose own tier is
    realtime; the rest are found through the sub-queue registry.
    """
    out = []
    for name, task in list(tasks.items()):
        try:
            if every_task or tier_of_call(settings, name, None, task) is Tier.REALTIME:
                out.append(settings.sjf_queue(name))
        except ValueError:  # a task with a bad tier: check_task_tiers stops the worker with the reason
            continue
    return out


def register_tier_queues(settings: PrioSettings) -> None:
    _TIER_QUEUES.update(settings.queue_name(t) for t in TIERS)


def register_subqueue(name: str) -> None:
    _TIER_QUEUES.add(name)


def stamp_enqueue_time(
    sender: Any = None, routing_key: str | None = None, headers: dict | None = None, **_: Any
) -> None:
    """``before_task_publish`` receiver: record when the message entered its tier (or sub-queue)."""
    if headers is not None and routing_key in _TIER_QUEUES:
        headers[ENQUEUED_HEADER] = time.time()
