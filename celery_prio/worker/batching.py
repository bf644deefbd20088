"""The worker's side of dynamic batching (``celery_prio.Batch``): collect a batch, run it once, settle each call.

When the fetch loop hands over the first message of a batched task, the
task consumer starts a :class:`BatchRun`: one slot, charged as one run. It
takes up to ``max_size - 1`` more of the task's waiting calls from its queue
in one broker call (``BrokerFetchSource.take_more``) and, while fewer than
``max_size`` are in hand, waits at most ``max_delay`` for more (a timer on
the worker's loop, then one more top-up). Each message still goes through
Celery's own handler: decoding, validation and unknown tasks behave as
always, a revoked id is skipped, and the task's strategy — replaced here for
batched tasks — adds the request to the batch instead of sending it to the
pool. Then one pool job runs the function with the list (``run_batch``, in
the child) and stores one result per task id; each message is acked on its
own, when the job is accepted, or when it ends for ``acks_late`` tasks.

A call with an ETA or countdown is not batched: Celery's own strategy runs it
at its time, as a batch of one (``celery_hooks.takes_batches``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from celery import current_app
from celery.app.trace import build_tracer, report_internal_error
from celery.utils.log import get_logger

from ..batching import (
    MAX_BATCH_BYTES,
    Batch,
    Call,
    batch_of,
    batch_run,
    results_of,
    settle_through_tracer,
)
from ..celery_hooks import takes_batches
from ..tiers import Tier

if TYPE_CHECKING:
    from celery import Task
    from celery.worker.consumer import Consumer
    from celery.worker.request import Request
    from kombu.asynchronous import Hub
    from kombu.asynchronous.timer import Entry
    from kombu.message import Message

logger = get_logger(__name__)


@dataclass(eq=False)
class BatchRun:
    """One batch: the calls collected for one run of ``task`` in one slot."""

    task: Task
    spec: Batch
    tier: Tier
    queue: str | None  # the queue its first message came from
    requests: list[Request] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    timer: Entry | None = None  # the max_delay wait, while it lasts
    submitted: bool = False
    bytes: int = 0  # what its calls' messages weigh (bounded by MAX_BATCH_BYTES)

    @property
    def room(self) -> int:
        """How many more calls it may take: none once its messages weigh ``MAX_BATCH_BYTES``."""
        return 0 if self.bytes >= MAX_BATCH_BYTES else self.spec.max_size - len(self.requests)


class Batcher:
    """A worker's batches: the strategy that collects their requests, the top-ups, the pool job, the settling."""

    def __init__(self, consumer: Consumer, hub: Hub, take_more: Callable[[BatchRun, int, int], list[Message]]) -> None:
        self.c = consumer
        self.hub = hub
        # (batch, how many, bytes at most) -> messages from the task's own queue in its tier
        self.take_more = take_more
        self.specs: dict[str, Batch] = {}  # batched task name -> its Batch (install_strategies)
        self.collecting: BatchRun | None = None  # the batch Celery's handler is adding to right now
        self.running: set[BatchRun] = set()  # each holds a slot: collecting, waiting for more, or in the pool
        self._waiting: dict[tuple[str, Tier], BatchRun] = {}  # batches waiting max_delay for more calls
        self.on_start: Callable[[BatchRun], None] = lambda batch: None  # it took a slot
        self.on_done: Callable[[BatchRun, int], None] = lambda batch, failed: None  # it left it (failed calls)

    # -- set-up ---------------------------------------------------------------------
    def install_strategies(self) -> None:
        """Celery's strategy of each batched task (which would run one call at a time) replaced by one that
        adds the request to the batch being collected (called after ``Consumer.update_strategies``).
        ``ConfigError`` for a ``batch=`` that is no ``celery_prio.Batch``: the worker does not start."""
        self.specs = {name: spec for name, task in self.c.app.tasks.items() if (spec := batch_of(task)) is not None}
        for name in self.specs:
            takes_batches(self.c.app.tasks[name])
            self.c.strategies[name] = self._strategy(self.c.app.tasks[name], self.c.strategies[name])

    def batches(self, message: Message) -> bool:
        """Whether ``message`` is a batched task's call that runs in a batch (one with an ETA runs alone)."""
        headers = message.headers or {}
        return headers.get("task") in self.specs and not headers.get("eta")

    def _strategy(self, task: Task, celery_strategy: Callable[..., object]) -> Callable[..., object]:
        # Celery's own handler, built over a view of the consumer whose last step (``on_task_request``, which
        # would send the request to the pool) adds it to the batch instead: decoding, the received log line and
        # event, ``task_received``, revoked and expired ids, reserved state stay Celery's.
        gather = task.start_strategy(self.c.app, _Gathering(self.c, self._gathered))

        def collect(
            message: Message,
            body: object,
            ack: Callable[..., object],
            reject: Callable[..., object],
            callbacks: set[Callable[..., object]] | None,
            **kwargs: object,
        ) -> object:
            # Not fetched for a batch (an ETA whose time came): Celery runs it alone, a batch of one.
            handler = celery_strategy if self.collecting is None else gather
            return handler(message, body, ack, reject, callbacks, **kwargs)

        return collect

    def _gathered(self, request: Request) -> None:
        if self.collecting is None:  # reached later, through a rate limit's timer: it runs alone
            self.c.on_task_request(request)
        else:
            self.collecting.requests.append(request)

    # -- a batch --------------------------------------------------------------------
    def deliver(
        self,
        tier: Tier,
        message: Message,
        queue: str | None,
        hand: Callable[[Message], None],
        admit_and_hand: Callable[[Tier, Message], None],
    ) -> None:
        """A batched task's call, fetched for a free slot: it joins the batch of its task that waits for more in
        this tier, or starts one (one slot), which tops up at once and waits at most ``max_delay`` for more."""
        name = message.headers["task"]
        waiting = self._waiting.get((name, tier))
        if waiting is not None:  # no second slot: it joins
            self._collect(waiting, [message], hand)
            if waiting.room <= 0:
                self._submit(waiting)
            return
        batch = BatchRun(self.c.app.tasks[name], self.specs[name], tier, queue)
        self.running.add(batch)
        self.on_start(batch)
        self._collect(batch, [message], hand)
        self._top_up(batch, lambda m: admit_and_hand(tier, m))
        if batch.room > 0 and batch.spec.max_delay > 0:
            self._waiting[(name, tier)] = batch
            batch.timer = self.hub.call_later(batch.spec.max_delay, self._waited, batch, admit_and_hand)
        else:
            self._submit(batch)

    def _collect(self, batch: BatchRun, messages: list[Message], hand: Callable[[Message], None]) -> None:
        """Hand ``messages`` to Celery's handler with ``batch`` collecting their requests."""
        self.collecting = batch
        try:
            for message in messages:
                batch.bytes += len(getattr(message, "body", b"") or b"")
                hand(message)
        finally:
            self.collecting = None

    def _top_up(self, batch: BatchRun, hand: Callable[[Message], None]) -> None:
        if batch.room <= 0:
            return
        try:
            self._collect(batch, self.take_more(batch, batch.room, MAX_BATCH_BYTES - batch.bytes), hand)
        except Exception:  # the broker is away: the batch runs with what it has
            logger.warning("celery-prio: could not top up a batch of %s", batch.task.name, exc_info=True)

    def _waited(self, batch: BatchRun, admit_and_hand: Callable[[Tier, Message], None]) -> None:
        batch.timer = None
        self._top_up(batch, lambda m: admit_and_hand(batch.tier, m))
        self._submit(batch)

    def _submit(self, batch: BatchRun) -> None:
        """One pool job runs the batch. Each call settles through its own Celery request, as an unbatched call
        does: accepted (``task-started``, acked unless ``acks_late``), then succeeded or failed (events, acks,
        ``task_reject_on_worker_lost``), a time limit per call; a call revoked while the batch waited is
        skipped, as Celery skips a revoked call before it reaches the pool."""
        if batch.submitted:
            return
        batch.submitted = True
        self._waiting.pop((batch.task.name, batch.tier), None)
        if batch.timer is not None:
            self.hub.timer.cancel(batch.timer)
            batch.timer = None
        requests = [request for request in batch.requests if not request.revoked()]
        batch.requests = requests
        if not requests:  # every message was invalid or revoked: nothing to run, the slot is free again
            self._finished(batch, 0)
            return

        def accepted(pid: int, time_accepted: float) -> None:
            for request in requests:
                request.on_accepted(pid, time_accepted)

        def returned(outcome: object) -> None:
            if not (isinstance(outcome, list) and len(outcome) == len(requests)):
                failed(outcome)  # the child could not run the batch at all (an internal error)
                return
            for request, result in zip(requests, outcome, strict=True):
                request.on_success(result)
            self._finished(batch, sum(1 for result in outcome if result[0]))

        def failed(exc_info: object) -> None:  # the pool job died (its child was killed, a hard time limit)
            for request in requests:
                request.on_failure(exc_info)
            self._finished(batch, len(requests))

        def timed_out(soft: bool, timeout: float) -> None:
            for request in requests:
                request.on_timeout(soft, timeout)

        hard, soft = _time_limits(batch.task, requests)
        calls = [(request.id, *_trace_arguments(request, self.c.hostname)) for request in requests]
        self.c.pool.apply_async(
            run_batch,
            args=(batch.task.name, calls),
            accept_callback=accepted,
            callback=returned,
            error_callback=failed,
            timeout_callback=timed_out,
            timeout=hard,
            soft_timeout=soft,
        )

    def _finished(self, batch: BatchRun, failed: int) -> None:
        self.running.discard(batch)
        self.on_done(batch, failed)

    def stop(self) -> None:
        """The worker stops fetching: a batch still waiting for more runs with what it has."""
        for batch in list(self._waiting.values()):
            self._submit(batch)


class _Gathering:
    """The consumer as Celery's strategy for a batched task sees it: requests are handed to the batch."""

    def __init__(self, consumer: Consumer, gathered: Callable[[Request], None]) -> None:
        self._consumer = consumer
        self.on_task_request = gathered

    def __getattr__(self, name: str) -> object:
        return getattr(self._consumer, name)


def _time_limits(task: Task, requests: list[Request]) -> tuple[float | None, float | None]:
    """The batch's pool job limits: the tightest any of its calls has (its own ``time_limit`` option, else the
    task's, else the app's). A call over its limit fails as Celery fails it, and so does the rest of its batch."""

    def tightest(values: list[float | None]) -> float | None:
        given = [float(v) for v in values if v]
        return min(given) if given else None

    conf = task.app.conf
    limits = [request.time_limits for request in requests]
    hard = tightest([h or task.time_limit or conf.task_time_limit for h, _ in limits])
    soft = tightest([s or task.soft_time_limit or conf.task_soft_time_limit for _, s in limits])
    return hard, soft


def _trace_arguments(request: Request, hostname: str) -> tuple[list, dict, dict]:
    """A call's arguments and the request Celery's tracer gets for it in the child (as ``fast_trace_task``
    builds it: the headers, the message's embedded chain, chord, callbacks and errbacks, its arguments)."""
    args, kwargs, embed = request._payload
    context = {**request.request_dict, **(embed or {})}
    context.update(args=args, kwargs=kwargs, hostname=hostname, is_eager=False)
    return list(args or ()), dict(kwargs or {}), context


#: Per pool process: Celery's tracer of each batched task, built after the task takes single calls.
_TRACERS: dict[str, Callable[..., tuple[object, object, object, str | None]]] = {}


def run_batch(task_name: str, calls: list[tuple[str, list, dict, dict]]) -> list[tuple[int, object, float]]:
    """In a pool child: the batched function once with every call; then each call through Celery's tracer with
    its outcome, which stores it and runs what follows it (chain, chord, links, signals, retries) as for an
    unbatched call. Returns what ``fast_trace_task`` returns, per call: ``(failed, result or error, runtime)``."""
    app = current_app._get_current_object()
    task = app.tasks[task_name]
    takes_batches(task)
    tracer = _TRACERS.get(task_name)
    if tracer is None:
        tracer = _TRACERS[task_name] = build_tracer(task_name, task, app.loader, app=app)
    started = time.monotonic()
    batch = [Call(task_id, tuple(args), kwargs) for task_id, args, kwargs, _ in calls]
    outcomes = results_of(batch_run(task), batch, task_name)
    runtime = time.monotonic() - started  # each call took the batch's time
    settled: list[tuple[int, object, float]] = []
    for (task_id, args, kwargs, request), outcome in zip(calls, outcomes, strict=True):
        traceback = outcome.__traceback__ if isinstance(outcome, BaseException) else None
        try:
            result, info, _, text = settle_through_tracer(
                task_id, outcome, traceback, functools.partial(tracer, task_id, args, kwargs, request)
            )
        except Exception as exc:  # Celery's tracer itself failed: reported as Celery's trace_task does
            result, info, text = report_internal_error(task, exc), True, None
        settled.append((1, result, runtime) if info else (0, text, runtime))
    return settled
