"""The worker's side of dynamic batching (``celery_prio.Batch``): collect a batch, run it once, settle each call.

When the fetch loop hands over the first message of a batched task, the
task consumer starts a :class:`BatchRun`: one slot, charged as one run. It
takes up to ``max_size - 1`` more of the task's waiting calls from its queue
in one broker call (``FetchSource.take_more``) and, while fewer than
``max_size`` are in hand, waits at most ``max_delay`` for more (a timer on
the worker's loop, then one more top-up). Each message still goes through
Celery's own handler: decoding, validation and unknown tasks behave as
always, a revoked id is skipped, and the task's strategy — replaced here for
batched tasks — adds the request to the batch instead of sending it to the
pool. Then one pool job runs the function with the list (``run_batch``, in
the child) and stores one result per task id; each message is acked on its
own, when the job is accepted, or when it ends for ``acks_late`` tasks.

A call with an ETA or countdown is not batched: Celery's own strategy runs it
at its time, as a batch of one (``batching.takes_batches``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery import current_app, signals
from celery.app.task import Context
from celery.exceptions import WorkerLostError
from celery.utils.log import get_logger
from celery.worker import state as worker_state
from celery.worker.request import create_request_cls
from celery.worker.strategy import hybrid_to_proto2, proto1_to_proto2
from kombu.utils.imports import symbol_by_name

from ..batching import Batch, Call, batch_of, results_of, takes_batches
from ..tiers import Tier

logger = get_logger(__name__)


@dataclass(eq=False)
class BatchRun:
    """One batch: the calls collected for one run of ``task`` in one slot."""

    task: Any
    spec: Batch
    tier: Tier
    queue: str | None  # the queue its first message came from
    requests: list[Any] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    timer: Any = None  # the max_delay wait, while it lasts
    submitted: bool = False

    @property
    def room(self) -> int:
        return self.spec.max_size - len(self.requests)


class Batcher:
    """A worker's batches: the strategy that collects their requests, the top-ups, the pool job, the settling."""

    def __init__(self, consumer: Any, hub: Any, take_more: Callable[[BatchRun, int], list[Any]]) -> None:
        self.c = consumer
        self.hub = hub
        self.take_more = take_more  # (batch, how many) -> messages from the task's own queue in its tier
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

    def batches(self, message: Any) -> bool:
        """Whether ``message`` is a batched task's call that runs in a batch (one with an ETA runs alone)."""
        headers = message.headers or {}
        return headers.get("task") in self.specs and not headers.get("eta")

    def _strategy(self, task: Any, celery_strategy: Callable[..., Any]) -> Callable[..., Any]:
        c, app = self.c, self.c.app
        Request = create_request_cls(
            symbol_by_name(task.Request), task, c.pool, c.hostname, c.event_dispatcher, app=app
        )

        def collect(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kwargs: Any) -> Any:
            batch = self.collecting
            if batch is None:
                # Not fetched for a batch (an ETA whose time came): Celery runs it alone, a batch of one.
                return celery_strategy(message, body, ack, reject, callbacks, **kwargs)
            if body is None and "args" not in message.payload:
                body, headers, decoded, utc = message.body, message.headers, False, app.uses_utc_timezone()
            elif "args" in message.payload:
                body, headers, decoded, utc = hybrid_to_proto2(message, message.payload)
            else:
                body, headers, decoded, utc = proto1_to_proto2(message, body)
            request = Request(
                message, on_ack=ack, on_reject=reject, app=app, hostname=c.hostname, eventer=c.event_dispatcher,
                task=task, connection_errors=c.connection_errors, body=body, headers=headers, decoded=decoded,
                utc=utc,
            )  # fmt: skip
            if (request.expires or request.id in worker_state.revoked) and request.revoked():
                return None  # revoked (or expired): acked and recorded by Celery, skipped here
            signals.task_received.send(sender=c, request=request)
            worker_state.task_reserved(request)
            batch.requests.append(request)
            return None

        return collect

    # -- a batch --------------------------------------------------------------------
    def deliver(
        self,
        tier: Tier,
        message: Any,
        queue: str | None,
        hand: Callable[[Any], None],
        admit_and_hand: Callable[[Tier, Any], None],
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

    def _collect(self, batch: BatchRun, messages: list[Any], hand: Callable[[Any], None]) -> None:
        """Hand ``messages`` to Celery's handler with ``batch`` collecting their requests."""
        self.collecting = batch
        try:
            for message in messages:
                hand(message)
        finally:
            self.collecting = None

    def _top_up(self, batch: BatchRun, hand: Callable[[Any], None]) -> None:
        if batch.room <= 0:
            return
        try:
            self._collect(batch, self.take_more(batch, batch.room), hand)
        except Exception:  # the broker is away: the batch runs with what it has
            logger.warning("celery-prio: could not top up a batch of %s", batch.task.name, exc_info=True)

    def _waited(self, batch: BatchRun, admit_and_hand: Callable[[Tier, Any], None]) -> None:
        batch.timer = None
        self._top_up(batch, lambda m: admit_and_hand(batch.tier, m))
        self._submit(batch)

    def _submit(self, batch: BatchRun) -> None:
        """One pool job runs the batch; every call's message is acked on its own (at accept, or at the end for
        ``acks_late``)."""
        if batch.submitted:
            return
        batch.submitted = True
        self._waiting.pop((batch.task.name, batch.tier), None)
        if batch.timer is not None:
            self.hub.timer.cancel(batch.timer)
            batch.timer = None
        requests = batch.requests
        if not requests:  # every message was invalid or revoked: nothing to run, the slot is free again
            self._finished(batch, 0)
            return
        acks_late = bool(batch.task.acks_late)

        def accepted(pid: int, time_accepted: float) -> None:
            for request in requests:
                worker_state.task_accepted(request)
                if not acks_late:
                    request.acknowledge()

        def returned(outcome: Any) -> None:
            self._settle(batch, acks_late, lost=None)
            self._finished(batch, int(outcome.get("failed", 0)) if isinstance(outcome, dict) else 0)

        def failed(exc_info: Any) -> None:  # the pool job died (its child was killed, a time limit)
            self._settle(batch, acks_late, lost=getattr(exc_info, "exception", exc_info))
            self._finished(batch, len(requests))

        calls = [(r.id, list(r.args or ()), dict(r.kwargs or {}), _picklable(r.request_dict)) for r in requests]
        self.c.pool.apply_async(
            run_batch,
            args=(batch.task.name, calls),
            accept_callback=accepted,
            callback=returned,
            error_callback=failed,
        )

    def _settle(self, batch: BatchRun, acks_late: bool, lost: Any) -> None:
        for request in batch.requests:
            if lost is not None:
                # As Celery settles a job its pool lost: again if task_reject_on_worker_lost says so, else failed.
                if acks_late and batch.task.reject_on_worker_lost:
                    request.reject(requeue=True)
                else:
                    batch.task.backend.mark_as_failure(
                        request.id, WorkerLostError(f"the pool job of this batch ended: {lost!r}"),
                        request=request._context,
                    )  # fmt: skip
                    if acks_late:
                        request.acknowledge()
            elif acks_late:
                request.acknowledge()
            worker_state.task_ready(request)

    def _finished(self, batch: BatchRun, failed: int) -> None:
        self.running.discard(batch)
        self.on_done(batch, failed)

    def stop(self) -> None:
        """The worker stops fetching: a batch still waiting for more runs with what it has."""
        for batch in list(self._waiting.values()):
            self._submit(batch)


def _picklable(request_dict: dict[str, Any]) -> dict[str, Any]:
    """What the child needs of a call's request to store its result like Celery does (chords, groups)."""
    keep = ("id", "group", "group_index", "chord", "root_id", "parent_id", "reply_to", "correlation_id", "retries")
    return {k: request_dict[k] for k in keep if k in request_dict}


def run_batch(task_name: str, calls: list[tuple[str, list, dict, dict]]) -> dict[str, int]:
    """In a pool child: the batched function once with every call, one result (or failure) stored per task id."""
    app = current_app._get_current_object()
    task = app.tasks[task_name]
    run = getattr(task, "_celery_prio_batch_run", None) or task.run
    batch = [Call(task_id, tuple(args), kwargs) for task_id, args, kwargs, _ in calls]
    outcomes = results_of(run, batch, task_name)
    failed = 0
    for (task_id, args, kwargs, request), outcome in zip(calls, outcomes, strict=True):
        context = Context({**request, "id": task_id, "args": args, "kwargs": kwargs, "task": task_name})
        if isinstance(outcome, BaseException):
            failed += 1
            task.backend.mark_as_failure(task_id, outcome, request=context)
        elif not task.ignore_result:
            task.backend.mark_as_done(task_id, outcome, request=context)
    return {"size": len(calls), "failed": failed}
