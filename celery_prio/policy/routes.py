"""Which tier and sub-queue a call goes to, and which queues a worker serves from the start. Pure.

A tier comes, in this order, from ``apply_async(..., tier=...)``, from the
task's ``tier`` attribute (``@app.task(tier="realtime")``), from the
``prio_routes`` name-pattern map; None leaves the call to the user's own
routes and then ``task_default_queue``. The producer's router
(``producer/routing.py``), inheritance, the worker and the brokers' pool-child
helpers all decide with these functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import ConfigError
from ..settings import PrioSettings, subqueue_name_problem
from ..tiers import TIERS, Tier, parse_tier


def tier_of_call(settings: PrioSettings, name: str, explicit: object, task: object = None) -> Tier | None:
    """The tier of a call: the call's ``tier``, the task's, the ``prio_routes`` pattern; None if none names one.

    None leaves the call to the user's own routes, then ``task_default_queue``.
    """
    raw = explicit if explicit is not None else getattr(task, "tier", None)
    return parse_tier(raw) if raw is not None else settings.tier_for_task_name(name)


def subqueue_of_call(
    settings: PrioSettings,
    name: str,
    explicit: object,
    task: object,
    call: tuple[Sequence[object], Mapping[str, object], Mapping[str, object]],
) -> str | None:
    """The sub-queue of a call: the call's ``subqueue``, the task's, ``prio_subqueue_key``; None if none names one.

    Raises ``ValueError`` naming the problem for a name that cannot be a queue's.
    """
    sub = explicit if explicit is not None else getattr(task, "subqueue", None)
    if sub is None:
        sub = settings.subqueue_for_call(name, *call)
    if sub is None:
        return None
    problem = subqueue_name_problem(sub)
    if problem or not isinstance(sub, str):
        raise ValueError(f"task {name!r}: {problem}")
    return sub


def sjf_queues(settings: PrioSettings, tasks: Mapping[str, object], every_task: bool = False) -> list[str]:
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


def batched_queues(settings: PrioSettings, tasks: Mapping[str, object]) -> list[str]:
    """The queue of each batched task (``celery_prio.Batch``) in every tier: its calls wait there, on their own."""
    return [
        settings.subqueue_name(tier, settings.sjf_subqueue(name))
        for name, task in list(tasks.items())
        if getattr(task, "batch", None) is not None
        for tier in TIERS
    ]


def check_task_tiers(tasks: Mapping[str, object]) -> None:
    """Every task's ``tier`` attribute must name a tier: checked at worker start (``ConfigError``)."""
    for name, task in tasks.items():
        tier = getattr(task, "tier", None)
        if tier is not None:
            try:
                parse_tier(tier)
            except ValueError as exc:
                raise ConfigError(f"task {name!r}: {exc}") from None
