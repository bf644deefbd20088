"""A worker's runtime: the fetch source, the queues it serves, the scheduler and fetch loop, the batcher, the
intake of messages, the fleet watch, slice preemption and housekeeping, built once per consumer (re)start.

``task_consumer.TierFetcher`` stands where Celery keeps ``consumer.task_consumer``
and only wires this to kombu's Consumer interface. The served-queue state has
one owner here (``served``, :class:`~celery_prio.policy.served.ServedQueues`):
the fetch source reads it, the fetch loop orders by it, discovery writes it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Container, Iterable
from typing import TYPE_CHECKING

from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.utils.log import get_logger
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer
from vine import promise

from ..brokers import Job, fetch_source_for
from ..policy.count_scheduler import scheduler_for
from ..policy.routes import batched_queues, sjf_queues
from ..policy.served import ServedQueues
from ..policy.superseded import PENDING_FOR, Superseded
from ..settings import PrioSettings
from ..tiers import Tier
from .batching import Batcher, BatchRun
from .fetchloop import FetchLoop
from .fleet_watch import FleetWatch
from .foreign_work import announce_tasks
from .held_requests import delivery_tags, held_requests
from .housekeeping import FIGURES_INTERVAL, RECONCILE_INTERVAL, Housekeeping
from .intake import Intake
from .report import WorkerReport, build_report
from .slice_board import board
from .slice_preemption import SlicePreemption
from .stats import WorkerStats
from .unserved import UNSERVED_CHECK_INTERVAL

if TYPE_CHECKING:
    from celery.worker.request import Request
    from kombu.message import Message

logger = get_logger(__name__)

#: This worker process's incarnation. The owner of what it fetches is node name + this, so a process
#: restarted under the same node name (a pod or systemd unit coming back after an OOM kill) is a new
#: owner, and what the dead one had in flight is returned once its heartbeats stop.
INCARNATION = uuid.uuid4().hex[:12]


class WorkerRuntime:
    def __init__(self, consumer: Consumer, settings: PrioSettings, superseded: Superseded) -> None:
        hub = consumer.hub
        if hub is None:
            raise RuntimeError(
                "celery-prio needs Celery's event loop (prefork, threads or solo pool); "
                "gevent/eventlet pools are not supported"
            )
        self.app, self.settings, self.hub, self.superseded = consumer.app, settings, hub, superseded
        self.served = ServedQueues(settings)
        self.source = fetch_source_for(
            consumer.app, consumer.connection, self.served, settings, f"{consumer.hostname}#{INCARNATION}"
        )
        self.source.attach_loop(hub)
        concurrency = concurrency_of(consumer)
        self.source.slots = concurrency
        # Slots held back for realtime arrivals, while this worker serves realtime (see ``serve``).
        self.realtime_reserve = settings.effective_reserve(concurrency)
        self.scheduler = scheduler_for(
            settings.scheduler,
            weights=settings.weights,
            concurrency=concurrency,
            reserve=self.realtime_reserve,
            min_share=settings.min_share,
            idle_share=settings.idle_share,
        )
        self.stats = WorkerStats(settings.realtime_target)
        self.loop = FetchLoop(
            self.source,
            self.scheduler,
            self.stats,
            loop=hub,
            cancel=hub.timer.cancel,
            clock=time.monotonic,
            poll_interval=settings.poll_interval,
            reraise=tuple(consumer.connection_errors),
            lanes=self.served,
        )
        self.loop.defer_refill = type(consumer.pool).__module__ == "celery.concurrency.solo"  # tasks on this thread
        # Prefork reports a task's end on this loop's thread, from outside the task: its slot is refilled right
        # there (``slot_freed``). Others defer: threads report from a pool thread, solo from inside our own pump.
        # (The consumer starts on the thread that runs its event loop; None: no pool reports there.)
        self._results_thread = threading.get_ident() if results_on_loop(consumer.pool) else None
        if settings.trace_file is not None:
            from .trace import TraceRecorder

            self.loop.on_settled = TraceRecorder(settings.trace_file, settings.trace_max).record
        self.board = board()
        self.batcher = Batcher(consumer, hub, self._take_more)
        self.batcher.on_start = lambda batch: self.loop.started(batch, batch.tier)
        self.batcher.on_done = self._batch_done
        self.intake = Intake(
            self.source, self.loop, self.served, self.stats, self.batcher, superseded, consumer.on_decode_error,
            hub.call_later,
        )  # fmt: skip
        self.intake.deadline = settings.realtime_deadline
        self.watch = FleetWatch(self.source, self.served, settings, self._idle)
        self.slices = SlicePreemption(
            self.board, self.scheduler, self.loop, hub, self.source.held_by_tier, lambda: self.served.version
        )
        self.housekeeping = Housekeeping(hub)
        self._settle_scheduled = False
        # One promise, called once per task: kombu's ``call_soon`` would otherwise wrap the method in a new one.
        self._settle_soon = promise(self.settle)
        self._serve_known_subqueues()

    def _serve_known_subqueues(self) -> None:
        """Shortest-first queues served from the start, without waiting for discovery: every registered task's
        where asking more queues is free (Redis), else those of the tasks tiered realtime (the rest are pushed
        to the worker through the registry as they are first published to); and every batched task's queue in
        each tier. Per-task queues of tasks this worker cannot run (another app's) are never served."""
        settings, tasks = self.settings, self.app.tasks
        known = batched_queues(settings, tasks)
        if settings.sjf:
            known += sjf_queues(settings, tasks, every_task=self.source.asks_all_queues_in_one_call)
        known = list(dict.fromkeys(known))
        self.served.set_registered(settings.sjf_subqueue(name) for name in tasks)
        self.source.prepare_subqueues(known)
        self.served.set_known(known)

    def serve(self, names: Iterable[str]) -> None:
        """The queues ``-Q`` (or ``add_consumer``) named, now; their sub-queues are served beside them."""
        self.served.set_names(names)
        self.scheduler.set_served(self.served.tiers)
        # A worker that serves no realtime queue (``-Q`` of the app's own queues) keeps no slot for it:
        # nothing could ever take that slot.
        self.scheduler.reserve = self.realtime_reserve if Tier.REALTIME in self.served.tiers else 0
        self.loop.wake()  # an idle worker waits on the queues it served until now: fetch from the new set

    def start(self, reconnected: bool, jobs: Iterable[Job]) -> None:
        """Begin fetching. ``reconnected``: this process fetched on a connection before (it died)."""
        # Before the first fetch: boosts from now on wait for this worker's answer, earlier ones are read here.
        self.superseded.merge(self.source.join_fleet(), time.time(), pending_for=PENDING_FOR)
        announce_tasks(self.source, self.app.tasks)  # what this worker can run: other apps' workers forward it
        if reconnected:  # what was fetched on the connection that died and is not held goes back
            self.source.recover_own(delivery_tags(held_requests(self.hub.timer)))
        self.loop.start()
        self.housekeeping.start(
            [
                # Safety net for requests that end without a pool callback (revoked before they ran, cancelled).
                Job(RECONCILE_INTERVAL, self.settle, "settle ended requests"),
                Job(FIGURES_INTERVAL, self.watch.read_figures, "read broker figures"),
                Job(self.source.discovery_interval, self.watch.discover_subqueues, "discover sub-queues"),
                Job(UNSERVED_CHECK_INTERVAL, self.watch.check_unserved, "look for queues nobody serves"),
                *jobs,
                *self.source.housekeeping(lambda: {t: st.dispatched for t, st in self.scheduler.tiers.items()}),
            ]
        )
        self.watch.read_figures()
        self.watch.discover_subqueues()

    def stop(self) -> None:
        self.loop.stop()
        self.batcher.stop()
        self.housekeeping.stop()
        self.slices.stop()

    def track(self, request: Request) -> None:
        """Called for every request Celery hands to the pool."""
        tier = self.loop.fetching
        if tier is None:  # an ETA or rate-limited request whose time has come
            tier = self.served.tier_of((request.delivery_info or {}).get("routing_key") or "")
        self.loop.started(request, tier)
        self.slices.arm()

    def slot_freed(self, by_result: bool = False) -> None:
        """A pool job ended (any thread): settle and refill.

        A prefork job that ended through its result callback (``by_result``) is settled in that callback: the
        next job is then in the pool's outbound buffer before the loop's next turn, as Celery's own prefetched
        jobs are, and the freed child is written to in that turn (a no-op drain's main process spends about
        8 % less per task than through ``call_soon``); an error it meets is raised again from the loop. Every
        other end (a thread pool's, solo's, a job the pool lost, a batch's) is settled from the event loop,
        via ``call_soon``: it runs at the top of the next loop turn, before the prefork pool's on-tick hook
        that registers pipe writes for queued jobs. Fetching from an on-tick hook of our own would race that
        hook and could leave a job unwritten until the next poll timeout.
        """
        if by_result and threading.get_ident() == self._results_thread:
            try:
                self.settle()
                return
            except Exception as exc:  # raised again below, not handled
                # Raised again at the top of the loop's next turn, as when the refill ran there: a lost
                # connection reaches the consumer, which reconnects. Not here: billiard would log it as a
                # callback's error and go on, and the worker with it, on a dead channel.
                self.hub.call_soon(_raise, exc)
                return
        if not self._settle_scheduled:
            self._settle_scheduled = True
            self.hub.call_soon(self._settle_soon)

    def settle(self) -> None:
        self._settle_scheduled = False
        # A sliced task that yielded did so for a waiting tier: the freed slot goes to it.
        pending, yielded_for = self.board.pending()
        if yielded_for is not None:
            self.scheduler.hand_off_to(yielded_for)
        reserved, batches = worker_state.reserved_requests, self.batcher.running
        self.loop.settle(_Held(reserved, batches) if batches else reserved)  # (no batch in flight: nearly always)
        if pending or yielded_for is not None:  # once per task: the board is written only when a yield was pending
            self.board.refilled()

    def _idle(self) -> bool:
        return self.loop.idle_since is not None and not len(self.loop.ledger)

    # -- batches (``celery_prio.Batch``, ``batching.py``) -----------------------------------
    def _take_more(self, batch: BatchRun, count: int, max_bytes: int) -> list[Message]:
        """More of a batched task's calls from its own queue in the batch's tier (one broker call)."""
        name = batch.task.name
        queue = self.settings.subqueue_name(batch.tier, self.settings.sjf_subqueue(name))
        if queue not in self.served.all_names():  # not served here (a worker of other tiers): the batch is what it is
            return []
        return self.source.take_more(queue, batch.tier, count, name, max_bytes)

    def _batch_done(self, batch: BatchRun, failed: int) -> None:
        self.stats.observe_batch(batch.tier, len(batch.requests), failed)
        queue = self.settings.subqueue_name(batch.tier, self.settings.sjf_subqueue(batch.task.name))
        self.served.batch_ran(queue, len(batch.requests))
        self.slot_freed()

    def report(self, on_loop: bool = False) -> WorkerReport:
        """The worker's report. From the metrics thread (``on_loop`` False) no broker call: the broker's figures
        as last read, and read again within ``FIGURES_INTERVAL`` for the next reader. On the worker's loop (a
        control command, ``inspect stats``) they are read now if older than that."""
        if on_loop:
            figures = self.watch.fresh_figures(FIGURES_INTERVAL)
        else:
            figures = self.watch.figures
            self.watch.wanted()
        return build_report(
            self.scheduler,
            self.stats,
            self.served,
            figures,
            self.source.broker_calls,
            time.monotonic(),
            yields=self.board.yields(),
            slice_lengths=self.settings.slice,
            stale_skipped=self.superseded.skipped,
            held=self.source.held,
            unserved=self.watch.unserved.rows,
            discovery_problem=self.source.discovery_problem,
        )


def _raise(exc: BaseException) -> None:
    raise exc


def results_on_loop(pool: object) -> bool:
    """Whether ``pool`` reports its jobs' results on the worker's event loop, from outside the job: Celery's
    prefork pool (its children write results to pipes the loop reads). The thread pool calls back from its
    own threads, and solo from inside the task's own ``apply_async``, within the fetch loop's pump."""
    return isinstance(pool, PreforkPool)


def concurrency_of(consumer: Consumer) -> int:
    controller = consumer.controller
    limit = getattr(controller, "max_concurrency", None) or getattr(consumer.pool, "num_processes", None)
    return max(int(limit or 1), 1)


class _Held:
    """What still holds a slot: Celery's reserved requests, and the batches in flight."""

    def __init__(self, requests: Container[object], batches: Container[object]) -> None:
        self.requests, self.batches = requests, batches

    def __contains__(self, key: object) -> bool:
        return key in self.requests or key in self.batches


__all__ = ["INCARNATION", "WorkerRuntime", "concurrency_of"]
