"""``celery_prio.slices``: GPU time slices for long tasks.

A task wraps its own loop::

    @app.task(bind=True, tier="batch")
    def score(self, items, start=0):
        for i in celery_prio.slices(self, range(start, len(items)), resume="start"):
            ...  # one micro-batch of GPU work

Between two elements, when this run has held its slot for at least its
tier's ``prio_slice``, the worker's main process says that every slot is
busy and which higher tiers the scheduler would serve first
(``slice_board``), and the broker has work of such a tier waiting (asked
from here, at most every 20 ms), the task is published
again under the same id with ``resume`` set to the next element, into its
tier's front lane (``<tier>.promoted``, served before the tier's queue: the
job keeps its turn among its own tier and only higher tiers get in between),
and this run ends with Celery's ``Ignore`` (no state, no result, message
acked). The last run stores the result, so ``AsyncResult.get()``, chains and
chords see one result, once.

Exactly once across a crash between the publish and the ack: every
continuation carries its generation, and the broker records, in the same
atomic step as the publish (Redis MULTI, RabbitMQ transaction), how many
continuations were committed. A redelivered copy of an earlier generation is
stale and is acked without running.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from celery.exceptions import Ignore, Reject
from celery.utils.log import get_task_logger

from .brokers.publishing import Continuation, Continuations
from .headers import ENQUEUED_HEADER, PROMOTED_HEADER, SLICE_HEADER
from .runtime import publisher_of, settings_for
from .tiers import Tier
from .worker.slice_board import board

if TYPE_CHECKING:
    from celery import Celery, Task
    from celery.worker.request import Request

logger = get_task_logger(__name__)

T = TypeVar("T")

#: Least time between two broker checks of one sliced run (its elements may be shorter).
BROKER_CHECK_INTERVAL = 0.02


def slices(task: Task, iterable: Iterable[T], resume: str, carry: Mapping[str, Any] | None = None) -> Iterator[T]:
    """Iterate ``iterable``; between elements, give the slot back when a higher tier waits.

    ``task`` is the bound task (``bind=True``); ``resume`` names the task
    argument that says where to start (it receives the next element).
    ``carry`` maps other argument names to what the next run must get for
    them, as they are when the run yields: pass the objects the loop fills in
    place (``carry={"done": done}`` with ``done`` a list the loop appends to),
    so partial results travel with the continuation. Called outside a worker
    (``task()``, eager mode) it simply iterates.
    """
    run = _SliceRun.begin(task, resume, dict(carry or {}))
    iterator = iter(iterable)
    for count, item in enumerate(iterator):
        if count and run is not None and run.should_yield():
            run.yield_at(item)  # raises Ignore
        yield item


class _SliceRun:
    """One run of a sliced task in a worker: its tier, slice length and generation."""

    def __init__(
        self,
        task: Task,
        arguments: dict[str, Any],
        tier: Tier,
        slice_length: float,
        generation: int,
        enqueued_at: Any,
        began: float,
    ) -> None:
        self.task = task
        self.arguments = arguments  # resume + carry: argument name -> value for the next run
        self.request = task.request
        self.tier = tier
        self.slice_length = slice_length
        self.generation = generation
        self.enqueued_at = enqueued_at
        # The slot is held from the run's start, the broker checks above included (on RabbitMQ a new pool
        # child's first list of sub-queues waits 50 ms for the registry to go quiet): counted from after them, a
        # run's first boundary past the slice length came one element late, and realtime waited two elements.
        self.started = began
        self.checked_at = float("-inf")
        self.board = board()

    @classmethod
    def begin(cls, task: Task, resume: str, carry: dict[str, Any]) -> _SliceRun | None:
        began = time.monotonic()
        request = task.request
        if request.called_directly or request.is_eager or not request.delivery_info:
            return None
        for name in (resume, *carry):
            _check_argument(task, name)
        app = task.app
        settings = settings_for(app)
        queue = (request.delivery_info or {}).get("routing_key") or ""
        tier = settings.tier_for_queue(queue)
        if tier is None:
            return None  # not on a tier queue: nothing to yield to
        headers = request.headers or {}
        marker = getattr(request, SLICE_HEADER, None) or headers.get(SLICE_HEADER) or {}
        generation = marker.get("gen", 0) if isinstance(marker, dict) else 0
        generation = generation if isinstance(generation, int) and not isinstance(generation, bool) else 0
        enqueued_at = marker.get("enqueued_at") if isinstance(marker, dict) else None
        if enqueued_at is None:
            enqueued_at = getattr(request, ENQUEUED_HEADER, None) or headers.get(ENQUEUED_HEADER)
        since = float(enqueued_at) if isinstance(enqueued_at, (int, float)) and not isinstance(enqueued_at, bool) else 0
        continuations = _continuations(app)
        try:
            stale = continuations.stale(request.id, generation, _is_redelivered(request), since)
        except Exception as exc:
            # Unknown whether a continuation took over: running it might run slices twice. Back to its queue.
            logger.warning("celery-prio: %s[%s]: could not check for a newer continuation (%r); given back to its "
                           "queue to be checked again", task.name, request.id, exc)  # fmt: skip
            raise Reject(exc, requeue=True) from None
        if stale:
            logger.info(
                "celery-prio: %s[%s] generation %d was already continued: stale copy acked unrun",
                task.name,
                request.id,
                generation,
            )
            raise Ignore()
        slice_length = settings.slice[tier]
        if slice_length is None:
            return None
        # Seen at once by the main process, which works out a tier's preemptors only while its sliced tasks
        # look at the board: a run's first boundary then finds them (the first run of a tier found none and
        # ran a second element before it could yield).
        board().ask(tier, began)
        continuations.ready(board().queue_changes())
        return cls(task, {resume: None, **carry}, tier, slice_length, generation, enqueued_at, began)

    def should_yield(self) -> bool:
        now = time.monotonic()
        preemptors = self.board.ask(self.tier, now)
        if not preemptors or now - self.started < self.slice_length or now - self.checked_at < BROKER_CHECK_INTERVAL:
            return False
        self.checked_at = now
        app = self.task.app
        for tier in preemptors:  # highest first
            try:  # in its queues, and pushed to this worker waiting for a slot (not in the queues' count)
                waiting = _continuations(app).waiting(tier, self.board.queue_changes()) + self.board.held(tier)
            except Exception:  # the broker is unreachable now: running on is always safe
                logger.debug("celery-prio: could not ask the broker whether %s waits", tier.label, exc_info=True)
                return False
            if waiting and self.board.claim_yield(self.tier, tier, waiting):
                return True
        return False

    def yield_at(self, item: Any) -> None:
        """Publish the continuation from ``item`` (same id, tier, enqueue time) and end this run."""
        app, request = self.task.app, self.request
        settings = settings_for(app)
        resume = next(iter(self.arguments))
        args, kwargs = _with_arguments(
            self.task, list(request.args or ()), dict(request.kwargs or {}), {**self.arguments, resume: item}
        )
        generation = self.generation + 1
        headers = {k: v for k, v in (request.headers or {}).items() if k != PROMOTED_HEADER}
        headers[SLICE_HEADER] = {"gen": generation, "enqueued_at": self.enqueued_at}
        if self.enqueued_at is not None:
            headers[ENQUEUED_HEADER] = self.enqueued_at  # aging counts from the first publish
        lane = settings.front_lanes()[self.tier]
        signature = self.task.signature_from_request(request, args, kwargs, queue=lane)
        signature.options.update(headers=headers, declare=[])  # the lane exists, declared with its arguments

        def send(producer: Any = None, **options: object) -> None:
            signature.apply_async(producer=producer, **options)

        try:
            _continuations(app).publish(Continuation(request.id, generation, send, self.tier, self.enqueued_at))
        except Exception:
            # Not yielding is always safe; yielding twice is not. If the broker
            # took the continuation after all (a reply lost), this run stops.
            logger.warning("celery-prio: %s[%s] could not yield; running on", self.task.name, request.id, exc_info=True)
            if not self._committed_anyway(generation):
                self.started = time.monotonic()  # try again one slice later, not at every element
                return
        logger.debug("celery-prio: %s[%s] yielded its slot at %r", self.task.name, request.id, item)
        raise Ignore()

    def _committed_anyway(self, generation: int) -> bool:
        app = self.task.app
        try:
            return _continuations(app).committed(self.request.id) >= generation
        except Exception:
            return False


def _is_redelivered(request: Request) -> bool:
    """Given back to its queue once (its worker died before the ack), or dead-lettered on the way (RabbitMQ's
    ``x-death``: aged into the tier above): only such a copy can be older than a committed continuation."""
    info, headers = request.delivery_info or {}, request.headers or {}
    died = getattr(request, "x-death", None) or headers.get("x-death")
    return bool(info.get("redelivered") or headers.get("redelivered") or died)


def _check_argument(task: Task, name: str) -> None:
    try:
        params = inspect.signature(task.run).parameters
    except (TypeError, ValueError):
        return
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if name not in params and not takes_any:
        raise TypeError(f"celery_prio.slices(): task {task.name!r} has no argument {name!r} to resume with")


def _with_arguments(task: Task, args: list, kwargs: dict, values: dict[str, Any]) -> tuple[list, dict]:
    """The call's arguments with ``values`` set, each positional or keyword as the call had it."""
    try:
        names = [
            p.name
            for p in inspect.signature(task.run).parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        names = []
    for name, value in values.items():
        if name in names and names.index(name) < len(args):
            args[names.index(name)] = value
        else:
            kwargs[name] = value
    return args, kwargs


def _continuations(app: Celery) -> Continuations:
    """The app's continuations (its broker's), bound to the app by ``install()``."""
    publishing = publisher_of(app)
    if publishing is None:
        raise RuntimeError("celery_prio.slices() needs celery_prio.install(app) first")
    return publishing.continuations


__all__ = ["slices"]
