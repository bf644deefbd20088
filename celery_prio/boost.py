"""Priority inheritance at run time: lift queued work that a higher tier now waits on.

    celery_prio.boost(result_or_id, "realtime")   # -> Boost(outcome="boosted", ...)
    celery_prio.wait(result, tier="realtime", timeout=5)

``boost`` moves a task that is still queued, in any lower tier or sub-queue,
into the front lane of ``tier`` (served before the tier's own queue), keeping
its id and original enqueue stamp. It is idempotent and harmless for a task
that already started, finished or is unknown: the returned :class:`Boost`
says what happened. How each broker does it, and what it guarantees:
``brokers/redis/boost.py`` (an atomic move, from any process) and
``brokers/amqp/boost.py`` (a lifted copy, from the publishing process; the
stale original is skipped by every worker).

``wait`` boosts everything a result still waits on (the task, a group's
members, a chord's header, a chain's earlier steps) to the waiter's tier,
then waits for it, boosting what appears meanwhile. Tasks that a boosted task
publishes run at least at its tier (``routing.py``), so a chain's later steps
follow.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from celery.exceptions import TimeoutError as CeleryTimeout
from celery.result import AsyncResult, ResultBase, ResultSet
from celery.utils.log import get_logger

from .brokers.base import BOOST_OUTCOMES, Boost
from .producer.inherit import running_task_tier
from .runtime import publisher_of
from .tiers import Tier, TierName, parse_tier
from .worker.slice_board import blocked_waiting

if TYPE_CHECKING:
    from celery import Celery

logger = get_logger(__name__)

#: Seconds between two rounds of boosts while ``wait`` waits (new steps of a chain, late group members).
WAIT_ROUND = 0.5

#: Outcomes after which a task needs no further boost (``not_found`` ones are asked again each round).
SETTLED = frozenset({"boosted", "already", "running", "finished"})


def boost(result_or_id: AsyncResult | str, tier: TierName, *, app: Celery | None = None) -> Boost:
    """Lift a queued task to ``tier`` (``"realtime"``, ``"p1"``, ``0`` ...); returns what happened.

    ``result_or_id``: an ``AsyncResult`` or a task id (then ``app``, or the
    current app, is the one that published it). Unknown tiers raise
    ``ValueError``; a broker error propagates (nothing is lost either way).
    """
    tier = parse_tier(tier)
    if isinstance(result_or_id, AsyncResult):
        task_id, app = result_or_id.id, app or result_or_id.app
    elif isinstance(result_or_id, str) and result_or_id:
        task_id = result_or_id
    else:
        raise TypeError(f"celery_prio.boost() takes an AsyncResult or a task id, not {result_or_id!r}")
    if app is None:
        from celery import current_app

        app = current_app._get_current_object()
    publishing = publisher_of(app)
    if publishing is None:
        raise RuntimeError("celery_prio.boost() needs celery_prio.install(app) first")
    state = _state(app, task_id)
    if state in ("SUCCESS", "FAILURE", "REVOKED"):
        return Boost("finished", task_id, tier, detail=state)
    outcome = publishing.booster.lift(task_id, tier)
    if outcome is not None:
        return outcome
    state = _state(app, task_id)  # it may have left its queue and run while the boost looked
    if state in ("SUCCESS", "FAILURE", "REVOKED"):
        return Boost("finished", task_id, tier, detail=state)
    if state in ("STARTED", "RETRY"):
        return Boost("running", task_id, tier, detail=state)
    return Boost("not_found", task_id, tier, detail=publishing.boost_not_found)


def _state(app: Celery, task_id: str) -> str | None:
    """The task's state in the result backend; None for an app that keeps no results."""
    from celery.backends.base import DisabledBackend

    if isinstance(app.backend, DisabledBackend):  # no result_backend configured
        return None
    return app.AsyncResult(task_id).state


def waited_on(result: ResultBase) -> list[AsyncResult]:
    """Every task result ``result`` depends on: itself, group members, chord headers, chain parents."""
    out: list[AsyncResult] = []
    stack, seen = [result], set()
    while stack:
        item = stack.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, ResultSet):  # GroupResult too: a chord's header, a group
            stack.extend(item.results)
        elif isinstance(item, AsyncResult):
            out.append(item)
        if isinstance(item, ResultBase):
            stack.append(getattr(item, "parent", None))
    return out


def wait(
    result: ResultBase,
    timeout: float | None = None,
    *,
    tier: TierName | None = None,
    propagate: bool = True,
    interval: float = WAIT_ROUND,
    **get_options: object,
) -> object:
    """Boost what ``result`` waits on to the waiter's tier, then wait for it (``result.get``).

    The waiter's tier is ``tier``, else the tier of the task running this
    code (inside a worker). Inside a task it waits with
    ``disable_sync_subtasks=False`` (that is the point). Raises Celery's
    ``TimeoutError`` after ``timeout`` seconds, like ``get``.
    """
    if not isinstance(result, ResultBase):
        raise TypeError(f"celery_prio.wait() takes a Celery result, not {result!r}")
    app = result.app
    inside = running_task_tier(app)
    waiter = parse_tier(tier) if tier is not None else inside
    if waiter is None:
        raise ValueError("celery_prio.wait(): outside a task, name the waiting tier (tier='realtime')")
    if inside is not None or _inside_task():
        get_options.setdefault("disable_sync_subtasks", False)
    with blocked_waiting(inside):  # this slot runs nothing while it waits: the worker may give its tier another
        return _wait(app, result, waiter, timeout, propagate, interval, get_options)


def _wait(
    app: Celery,
    result: ResultBase,
    waiter: Tier,
    timeout: float | None,
    propagate: bool,
    interval: float,
    get_options: dict[str, object],
) -> object:
    deadline = None if timeout is None else time.monotonic() + timeout
    settled: set[str] = set()
    while True:
        _boost_round(app, result, waiter, settled)
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise CeleryTimeout("The operation timed out.")
        try:
            return result.get(
                timeout=interval if left is None else min(interval, left), propagate=propagate, **get_options
            )
        except CeleryTimeout:
            if left is not None and left <= interval:
                raise


def _boost_round(app: Celery, result: ResultBase, tier: Tier, settled: set[str]) -> None:
    for dependency in waited_on(result):
        if dependency.id in settled or dependency.ready():
            continue
        try:
            outcome = boost(dependency, tier, app=app)
        except Exception:  # a broker hiccup: waiting goes on, the next round tries again
            logger.warning("celery-prio: could not boost %s", dependency.id, exc_info=True)
            continue
        if outcome.outcome in SETTLED:
            settled.add(dependency.id)


def _inside_task() -> bool:
    from celery import current_task

    task = current_task._get_current_object() if current_task else None
    request = getattr(task, "request", None)
    return task is not None and request is not None and not request.called_directly


__all__ = ["BOOST_OUTCOMES", "Boost", "boost", "wait", "waited_on"]
