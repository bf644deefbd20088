"""Dynamic batching: one run of a task serves many waiting calls, within a delay bound, inside its tier.

    @app.task(tier="realtime", batch=celery_prio.Batch(max_size=32, max_delay=0.005))
    def classify(calls):  # a list of celery_prio.Call(id, args, kwargs), oldest first
        return [model(c.args[0]) for c in calls]  # one result per call, same order

Callers are unchanged: ``classify.delay(image)`` returns an ``AsyncResult``
whose ``.get()`` is that call's result. A batched task's calls wait in a
queue of their own inside their tier (``<prefix>.<tier>.sjf-<task>``); when
the scheduler gives that queue a slot, the worker takes up to ``max_size``
of them in one fetch, waits at most ``max_delay`` for more while fewer are
waiting, runs the function once with the list and stores one result per
call. The batch is one run to the scheduler (charged its measured time), and
each message is acked on its own (``acks_late`` honoured). An exception
raised by the function fails every call of the batch; an ``Exception``
instance in the returned list fails that call only; a list of the wrong
length fails all of them with :class:`BatchResultError`.

Outside a worker's batch (a direct call, eager mode, a call with an ETA) the
function still receives a list: of one call.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from .errors import ConfigError

if TYPE_CHECKING:
    from celery import Task

T = TypeVar("T")

#: The most calls one batch may hold (a batch is one message of each call in hand, and one pool job).
MAX_BATCH = 10_000
#: The longest ``max_delay`` (seconds): a batch holds a worker slot while it waits.
MAX_DELAY = 60.0
#: Bytes of call messages a batch holds at most: it takes no more calls once its messages weigh this much
#: (it always holds the call that started it), so ``max_size`` large calls cannot exhaust a worker's memory.
MAX_BATCH_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Batch:
    """How a task's calls are batched: at most ``max_size`` per run, waiting at most ``max_delay`` seconds
    beyond a free slot for the batch to fill.

    Limits: ``max_size`` is a whole number from 1 to ``MAX_BATCH`` (10,000); ``max_delay`` is seconds from 0 to
    ``MAX_DELAY`` (60 s). One run also takes at most ``MAX_BATCH_BYTES`` (64 MiB) of message bodies: calls beyond it
    wait for the next run. Anything else raises ``ValueError`` naming the argument.
    """

    max_size: int = 32
    max_delay: float = 0.005

    def __post_init__(self) -> None:
        size, delay = self.max_size, self.max_delay
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_BATCH:
            raise ValueError(f"celery_prio.Batch(max_size=...) must be a whole number 1..{MAX_BATCH}, got {size!r}")
        number = isinstance(delay, (int, float)) and not isinstance(delay, bool) and math.isfinite(delay)
        if not number or not 0 <= delay <= MAX_DELAY:
            raise ValueError(f"celery_prio.Batch(max_delay=...) must be seconds, 0..{MAX_DELAY:g}, got {delay!r}")


@dataclass(frozen=True)
class Call:
    """One call of a batched task: its task id, and the arguments it was called with."""

    id: str
    args: tuple = ()
    kwargs: dict[str, object] = field(default_factory=dict)


#: A batched task as written: it takes the list of calls and returns one result per call, in order.
BatchFunction = Callable[[list[Call]], object]


class BatchResultError(Exception):
    """A batched task returned something other than one result per call."""


def batch_of(task: Task) -> Batch | None:
    """The task's ``batch=`` option, checked (``ConfigError`` naming the task for anything but a ``Batch``)."""
    spec = getattr(task, "batch", None)
    if spec is None or isinstance(spec, Batch):
        return spec
    raise ConfigError(f"task {getattr(task, 'name', task)!r}: batch= takes celery_prio.Batch(...), not {spec!r}")


def results_of(run: BatchFunction, calls: list[Call], name: str) -> list[object]:
    """Run the batched function once; one outcome per call: its result, or the exception that failed it."""
    try:
        results = run(calls)
    except Exception as exc:  # the whole call failed: so did every call of the batch
        return [exc] * len(calls)
    if not isinstance(results, Sequence) or isinstance(results, (str, bytes)) or len(results) != len(calls):
        got = f"{len(results)} results" if isinstance(results, Sequence) else repr(type(results).__name__)
        error = BatchResultError(
            f"batched task {name!r} returned {got} for {len(calls)} calls; it must return a list with one result "
            f"per call, in the calls' order"
        )
        return [error] * len(calls)
    return list(results)


#: In a pool child, while Celery's tracer runs one call of a batch: that call's outcome (and the traceback of
#: its exception), already computed by the batch's one run. Keyed by task id; each entry lives for one trace.
_SETTLED: dict[str, tuple[object, TracebackType | None]] = {}


def settle_through_tracer(task_id: str, outcome: object, traceback: TracebackType | None, trace: Callable[[], T]) -> T:
    """Run ``trace`` (Celery's tracer for one call of a batch) with the call returning ``outcome``: the tracer
    then stores it, runs the call's chain, chord, links and signals exactly as for an unbatched call."""
    _SETTLED[task_id] = (outcome, traceback)
    try:
        return trace()
    finally:
        _SETTLED.pop(task_id, None)


#: The function each batched task was written as (it takes the list of calls), by task.
_BATCH_RUNS: weakref.WeakKeyDictionary[Task, BatchFunction] = weakref.WeakKeyDictionary()


def keep_batch_run(task: Task, run: BatchFunction) -> bool:
    """Keep ``run`` as the function ``task`` was written as; False where one is kept already."""
    if task in _BATCH_RUNS:
        return False
    _BATCH_RUNS[task] = run
    return True


def settled_outcome(task_id: str | None) -> tuple[object, TracebackType | None] | None:
    """Inside Celery's tracer for one call of a worker's batch: that call's ``(outcome, traceback)``, once."""
    return _SETTLED.pop(task_id or "", None)


def batch_run(task: Task) -> BatchFunction:
    """The function ``task`` was written as, which takes the list of calls (``celery_hooks.takes_batches`` kept it)."""
    run = _BATCH_RUNS.get(task)
    if run is None:
        raise RuntimeError(f"task {getattr(task, 'name', task)!r} is not batched (no batch=celery_prio.Batch(...))")
    return run


__all__ = [
    "MAX_BATCH_BYTES",
    "Batch",
    "BatchResultError",
    "Call",
    "batch_of",
    "batch_run",
    "keep_batch_run",
    "results_of",
    "settle_through_tracer",
    "settled_outcome",
]
