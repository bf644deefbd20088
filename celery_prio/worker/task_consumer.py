"""The object that stands where Celery keeps ``consumer.task_consumer``.

It quacks like a ``kombu.Consumer`` (``queues``, ``add_queue``,
``cancel_by_queue``, ``consuming_from``, ``consume``, ``cancel``, ``close``),
so ``inspect active_queues``, ``add_consumer``/``cancel_consumer``, warm
shutdown and Flower keep working, and it connects Celery's task handler to
the fetch loop: what Celery is handed, what cannot run (dead letters), what
ended (the ledger), what the worker reports.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from celery.utils.log import get_logger
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer
from kombu import Exchange, Queue

from ..brokers import BrokerFigures, Job, fetch_source_for
from ..headers import BOOST_GENERATION_HEADER, BOOSTED_HEADER, PROMOTED_HEADER, SLICE_HEADER
from ..policy.routes import batched_queues, sjf_queues
from ..policy.scheduler import TierScheduler
from ..policy.served import ServedQueues
from ..policy.superseded import PENDING_FOR, RUN, STALE, generation_of, superseded
from ..settings import PrioSettings
from ..tiers import TIERS, Tier
from ..untrusted import enqueue_age, headers_problem, was_promoted_by_broker
from .batching import Batcher
from .fetchloop import FetchLoop
from .foreign_work import LEGACY_CHECK_INTERVAL, LegacyQueues, announce_tasks
from .held_requests import delivery_tags, held_requests
from .report import WorkerReport, build_report
from .slice_board import board
from .stats import WorkerStats
from .unserved import UNSERVED_CHECK_INTERVAL, EveryMinute, UnservedTracker, app_queues

logger = get_logger(__name__)

#: This worker process's incarnation. The owner of what it fetches is node name + this, so a process
#: restarted under the same node name (a pod or systemd unit coming back after an OOM kill) is a new
#: owner, and what the dead one had in flight is returned once its heartbeats stop.
INCARNATION = uuid.uuid4().hex[:12]
RECONCILE_INTERVAL = 1.0  # seconds between sweeps for requests that ended off the pool
FIGURES_INTERVAL = 2.0  # seconds between reads of broker-wide figures for the report
# GPU time slices: how often the board tells running sliced tasks which tiers
# they yield to (no broker call: the tasks ask the broker themselves); and how
# long after a sliced task last looked at the board it still counts as
# running (elements should be much shorter than this).
SLICE_CHECK_INTERVAL = 0.02
SLICE_ACTIVE_WINDOW = 10.0


class TierFetcher:
    """``consumer.task_consumer`` for celery-prio: kombu's Consumer interface over the fetch loop."""

    def __init__(self, consumer: Consumer, settings: PrioSettings) -> None:
        self.c = consumer
        self.settings = settings
        self.hub = consumer.hub
        if self.hub is None:
            raise RuntimeError(
                "celery-prio needs Celery's event loop (prefork, threads or solo pool); "
                "gevent/eventlet pools are not supported"
            )
        self.consumed: list[Any] = []  # the queues -Q (or add_consumer) named; sub-queues are served beside them
        self.served = ServedQueues(settings)
        self.source = fetch_source_for(
            consumer.app, consumer.connection, self.served, settings, f"{consumer.hostname}#{INCARNATION}"
        )
        self.source.attach_loop(self.hub)
        concurrency = self._concurrency()
        # Slots held back for realtime arrivals, while this worker serves realtime (see ``_update_served``).
        self.realtime_reserve = settings.effective_reserve(concurrency)
        self.scheduler = TierScheduler(
            weights=settings.weights,
            concurrency=concurrency,
            reserve=self.realtime_reserve,
            min_share=settings.min_share,
            mode=settings.scheduler,
            idle_share=settings.idle_share,
        )
        self.stats = WorkerStats()
        self.loop = FetchLoop(
            self.source,
            self.scheduler,
            self.stats,
            loop=self.hub,
            cancel=self.hub.timer.cancel,
            clock=time.monotonic,
            poll_interval=settings.poll_interval,
            reraise=tuple(consumer.connection_errors),
            lanes=self.served,
        )
        self.loop.defer_refill = type(consumer.pool).__module__ == "celery.concurrency.solo"  # tasks on this thread
        if settings.trace_file is not None:
            from .trace import TraceRecorder

            self.loop.on_settled = TraceRecorder(settings.trace_file, settings.trace_max).record
        self.figures = BrokerFigures()
        self.board = board()
        self._handler: Any = None  # Celery's task handler (``on_message``)
        self._housekeeping: list[Any] = []
        self._slice_timer: Any = None  # the next slice check, while tasks run
        self._settle_scheduled = False
        for queue in consumer.app.amqp.queues.consume_from.values():
            self.add_queue(queue)
        # Shortest-first queues served from the start, without waiting for discovery: every registered
        # task's where asking more queues is free (Redis), else those of the tasks tiered realtime
        # (the rest are pushed to the worker through the registry as they are first published to);
        # and every batched task's queue in each tier.
        known = batched_queues(settings, consumer.app.tasks)
        if settings.sjf:
            known += sjf_queues(settings, consumer.app.tasks, every_task=self.source.asks_all_queues_in_one_call)
        known = list(dict.fromkeys(known))
        # Per-task queues of tasks this worker cannot run (another app's on the same broker) are never served.
        self.served.set_registered(settings.sjf_subqueue(name) for name in consumer.app.tasks)
        self.source.prepare_subqueues(known)
        self.served.set_known(known)
        self.batcher = Batcher(consumer, self.hub, self._take_more)
        self.batcher.on_start = lambda batch: self.loop.started(batch, batch.tier)
        self.batcher.on_done = self._batch_done
        self.unserved = UnservedTracker()
        self.legacy = LegacyQueues(self)
        self._unserved_log = EveryMinute()
        self._discovery_log = EveryMinute()

    # -- kombu.Consumer look-alike ------------------------------------------
    @property
    def on_message(self) -> Any:
        return self._handler

    @on_message.setter
    def on_message(self, handler: Any) -> None:  # set by Celery's loop to its task handler
        self._handler = handler
        self.loop.deliver = None if handler is None else self._deliver

    @property
    def channel(self) -> Any:
        """The channel the worker fetches and acks on (the source may replace it after a failed declare)."""
        return self.source.channel

    @property
    def active(self) -> bool:
        return self.loop.active

    @property
    def queues(self) -> list[Any]:
        """What ``inspect active_queues`` (and so Flower's broker page) lists: the queues consumed, then the
        sub-queues served beside them that have been published to (realtime's per-task shortest-first queues,
        tenants', batched tasks'), so that every queue where a tier's work waits shows with its depth."""
        consumed = {q.name for q in self.consumed}
        discovered = set(self.served.discovered)
        subqueues = [n for n in self.served.all_names() if n in discovered and n not in consumed]
        return self.consumed + [Queue(n, Exchange(""), routing_key=n, no_declare=True) for n in subqueues]

    def add_queue(self, queue: Any) -> Any:
        if not self.consuming_from(queue.name):
            queue = queue.bind(self.channel)
            queue.declare()
            self.consumed.append(queue)
            self._update_served()
        return queue

    def consuming_from(self, queue: Any) -> bool:
        name = getattr(queue, "name", queue)
        return any(q.name == name for q in self.consumed)

    def cancel_by_queue(self, queue: str) -> None:
        self.consumed = [q for q in self.consumed if q.name != queue]
        self.legacy.forget(queue)
        self._update_served()

    def consume(self, no_ack: bool | None = None) -> None:
        if self.loop.active:
            return
        # Before the first fetch: boosts from now on wait for this worker's answer, earlier ones are read here.
        superseded.merge(self.source.join_fleet(), time.time(), pending_for=PENDING_FOR)
        announce_tasks(self)  # what this worker can run: other apps' workers forward such tasks to it
        global _CONNECTIONS
        _CONNECTIONS += 1
        if _CONNECTIONS > 1:  # a reconnect: what was fetched on the connection that died and is not held
            self.source.recover_own(delivery_tags(held_requests(self.hub.timer)))
        self.loop.start()
        jobs = [
            # Safety net for requests that end without a pool callback
            # (revoked before they ran, cancelled): retire them anyway.
            Job(RECONCILE_INTERVAL, self._settle, "settle ended requests"),
            Job(FIGURES_INTERVAL, self._read_figures, "read broker figures"),
            Job(self.source.discovery_interval, self._discover_subqueues, "discover sub-queues"),
            Job(UNSERVED_CHECK_INTERVAL, self._check_unserved, "look for queues nobody serves"),
            Job(LEGACY_CHECK_INTERVAL, self.legacy.drain, "drain the queues of producers without celery-prio"),
            *self.source.housekeeping(lambda: {t: st.dispatched for t, st in self.scheduler.tiers.items()}),
        ]
        self._read_figures()
        self._discover_subqueues()
        self.legacy.drain()
        self._housekeeping = [self.hub.call_repeatedly(job.interval, _guarded(job)) for job in jobs]

    def cancel(self) -> None:
        self.loop.stop()
        self.batcher.stop()
        for entry in self._housekeeping:
            self.hub.timer.cancel(entry)
        self._housekeeping.clear()
        if self._slice_timer is not None:
            self.hub.timer.cancel(self._slice_timer)
            self._slice_timer = None

    def close(self) -> None:
        # The channel closes with the connection; closing it here would make
        # the Redis transport restore messages whose acks_late tasks are
        # still finishing during a warm shutdown.
        self.cancel()

    def qos(self, prefetch_count: int = 0, **_: Any) -> None:
        """Prefetch does not apply: basic_get ignores basic.qos; the scheduler limits fetches."""

    # -- wiring ------------------------------------------------------------------
    def _concurrency(self) -> int:
        controller = self.c.controller
        limit = getattr(controller, "max_concurrency", None) or getattr(self.c.pool, "num_processes", None)
        return max(int(limit or 1), 1)

    def _update_served(self) -> None:
        self.served.set_names(q.name for q in self.consumed)
        self.scheduler.set_served(self.served.tiers)
        # A worker that serves no realtime queue (``-Q`` of the app's own queues) keeps no slot for it:
        # nothing could ever take that slot.
        self.scheduler.reserve = self.realtime_reserve if Tier.REALTIME in self.served.tiers else 0
        self.loop.wake()  # an idle worker waits on the queues it served until now: fetch from the new set

    def track(self, request: Any) -> None:
        """Called for every request Celery hands to the pool."""
        tier = self.loop.fetching
        if tier is None:  # an ETA or rate-limited request whose time has come
            tier = self.served.tier_of((request.delivery_info or {}).get("routing_key") or "")
        self.loop.started(request, tier)
        if self._slice_timer is None and self.loop.active:
            self._slice_timer = self.hub.call_later(SLICE_CHECK_INTERVAL, self._check_slices)

    def slot_freed(self) -> None:
        """A pool job ended (any thread): settle and refill from the event loop.

        Via ``call_soon`` on purpose: it runs at the top of the next loop turn,
        before the prefork pool's on-tick hook that registers pipe writes for
        queued jobs. Fetching from an on-tick hook of our own would race that
        hook and could leave a job unwritten until the next poll timeout.
        """
        if not self._settle_scheduled:
            self._settle_scheduled = True
            self.hub.call_soon(self._settle)

    def _settle(self) -> None:
        self._settle_scheduled = False
        # A sliced task that yielded did so for a waiting tier: the freed slot goes to it.
        yielded_for = self.board.yielded_for()
        if yielded_for is not None:
            self.scheduler.hand_off_to(yielded_for)
        self.loop.settle(_Held(worker_state.reserved_requests, self.batcher.running))
        self.board.refilled()

    # -- batches (``celery_prio.Batch``, ``batching.py``) -----------------------------------
    def _take_more(self, batch: Any, count: int, max_bytes: int) -> list[Any]:
        """More of a batched task's calls from its own queue in the batch's tier (one broker call)."""
        name = batch.task.name
        queue = self.settings.subqueue_name(batch.tier, self.settings.sjf_subqueue(name))
        if queue not in self.served.all_names():  # not served here (a worker of other tiers): the batch is what it is
            return []
        return self.source.take_more(queue, batch.tier, count, name, max_bytes)

    def _batch_done(self, batch: Any, failed: int) -> None:
        self.stats.observe_batch(batch.tier, len(batch.requests), failed)
        self.slot_freed()

    def _check_slices(self) -> None:
        """Tell running sliced tasks which higher tiers they yield to (no broker call here); and learn which
        running tasks are blocked waiting on other work (``celery_prio.wait``).

        Every ``SLICE_CHECK_INTERVAL`` while tasks run, and not at all while none does (a task's start arms
        it again): an idle worker's event loop sleeps."""
        self._slice_timer = None
        blocked = self.board.waiting()
        if blocked != self.scheduler.blocked:  # a task began or ended waiting on others: its tier may take a slot
            self.scheduler.blocked = blocked
            self.loop.wake()
        sliced = self.board.active_tiers(time.monotonic() - SLICE_ACTIVE_WINDOW)
        preemptors = self.scheduler.preemptors(sliced, self.loop.ledger.overrun(self.loop.clock())) if sliced else {}
        self.board.set_preemptors(preemptors)
        if len(self.loop.ledger) and self.loop.active:
            self._slice_timer = self.hub.call_later(SLICE_CHECK_INTERVAL, self._check_slices)

    def _discover_subqueues(self) -> None:
        names = self.source.discover_subqueues()
        if names is not None and names != self.served.discovered:
            self.served.set_discovered(names)
        problem = self.source.discovery_problem
        if self._discovery_log.due(time.monotonic(), problem is not None):
            logger.warning(
                "celery-prio: this worker cannot discover new sub-queues of %s: %s (queues it found so far are "
                "still served; new tenants' and per-call realtime tasks' queues wait until it can)",
                ", ".join(t.label for t in self.served.tiers),
                problem,
            )

    def _check_unserved(self) -> None:
        """Queues with messages whose tier no live worker serves; only tiers this worker does not serve
        need a look (it serves the others itself), so a worker that serves every tier asks nothing."""
        now = time.monotonic()
        missing = [t for t in TIERS if t not in self.served.tiers]
        depths: list[tuple[str, Tier, int]] = []
        serving: dict[Tier, int] | None = {}
        if missing:
            serving = self.source.fleet_serving()
            if serving is None:
                return  # the broker cannot say now: keep the last figures
            queues = app_queues(self.settings, self.served.discovered, missing)
            counts = self.source.queue_depths([name for name, _ in queues])
            depths = [(name, tier, n) for (name, tier), n in zip(queues, counts, strict=True)]
        rows = self.unserved.update(now, depths, serving)
        if self._unserved_log.due(now, bool(rows)):
            logger.warning(
                "celery-prio: messages wait where no live worker serves their tier: %s",
                "; ".join(f"{r.queue} ({r.depth} waiting, {r.seconds:.0f} s, tier {r.tier})" for r in rows),
            )

    def _read_figures(self) -> None:
        """Broker-wide figures for the report, every ``FIGURES_INTERVAL``. While the worker is idle (every
        queue it serves found empty, waiting on the broker) their depths are known to be zero and are not
        asked: an idle worker reads only the counters and the dead letters."""
        idle = self.loop.idle_since is not None and not len(self.loop.ledger)
        self.figures = self.source.broker_figures(time.monotonic(), idle=idle)

    def dead_letter(self, message: Any, reason: str) -> None:
        """Copy ``message`` to ``<prefix>.dead`` with ``reason``; the caller settles the original."""
        tier = self.loop.fetching
        if tier is None:
            tier = self.served.tier_of(getattr(message, "prio_queue", "") or "")
        self.source.dead_letter(message, reason[:500], tier)

    def _deliver(self, tier: Tier, message: Any) -> None:
        """Hand one message to Celery (or, a batched task's call, start or join a batch); anything that cannot
        run goes to the dead letters, never up the stack."""
        if not self._admit(tier, message):
            return
        if self.batcher.batches(message):
            self.batcher.deliver(tier, message, self.loop.fetching_queue, self._hand_over, self._admit_and_hand)
            return
        self._hand_over(message)

    def _admit_and_hand(self, tier: Tier, message: Any) -> None:
        """A batch's top-up: each message is checked like any fetched one before Celery sees it."""
        if self._admit(tier, message):
            self._hand_over(message)

    def _admit(self, tier: Tier, message: Any) -> bool:
        """Whether ``message`` goes on to Celery: not undecodable, not malformed, not a boosted task's stale
        copy (each of those is settled here); its wait counted."""
        if message.errors:
            try:
                message._reraise_error()  # kombu keeps the decode error on the message
            except Exception as exc:  # Celery's handler (PrioConsumer's, below) dead-letters it and acks
                self.c.on_decode_error(message, exc)
            return False
        problem = headers_problem(message.headers)
        if problem is not None:
            self.dead_letter(message, problem)
            message.ack()
            return False
        headers = message.headers or {}
        verdict = superseded.verdict(
            headers.get("id"), generation_of(headers.get(BOOST_GENERATION_HEADER)), time.time()
        )
        if verdict == STALE:
            # A RabbitMQ boost published a lifted copy of this task: this is the original, left behind.
            superseded.skipped += 1
            logger.info("celery-prio: %s[%s] was boosted: stale copy acked unrun", headers.get("task"), headers["id"])
            message.ack()
            return False
        if verdict != RUN:  # a boost of it is under way: its copy may not be on the broker yet; ask again
            self.hub.call_later(float(verdict), lambda: self._deliver(tier, message))
            return False
        now = time.time()
        if BOOSTED_HEADER in headers:
            self.stats.observe_boosted(tier)
        if SLICE_HEADER in headers:  # a sliced task resuming: neither a new arrival nor a new promotion
            self.stats.observe_fetch(tier, None, False, now)
        else:
            promoted = PROMOTED_HEADER in headers or was_promoted_by_broker(headers)
            wait = enqueue_age(headers, now)
            self.stats.observe_fetch(tier, wait, promoted, now)
            if wait is not None and self.loop.fetching_queue:
                self.served.observe_wait(self.loop.fetching_queue, wait)
        return True

    def _hand_over(self, message: Any) -> None:
        try:
            self._handler(message)
        except Exception as exc:  # Celery's handler let it through: still never lost, never fatal
            logger.exception("celery-prio: could not hand a message to Celery")
            if not message.acknowledged:
                self.dead_letter(message, f"delivery failed: {exc!r}")
                message.ack()

    # -- reporting -----------------------------------------------------------
    def report(self) -> WorkerReport:
        """No broker call: safe from the metrics thread."""
        return build_report(
            self.scheduler,
            self.stats,
            self.served,
            self.figures,
            self.source.broker_calls,
            time.monotonic(),
            yields=self.board.yields(),
            slice_lengths=self.settings.slice,
            stale_skipped=superseded.skipped,
            held=self.source.held,
            unserved=self.unserved.rows,
            discovery_problem=self.source.discovery_problem,
        )

    def info(self) -> dict[str, Any]:
        return self.report().as_dict()


#: Connections this worker process has fetched on (more than one: it reconnected).
_CONNECTIONS = 0


class _Held:
    """What still holds a slot: Celery's reserved requests, and the batches in flight."""

    def __init__(self, requests: Any, batches: Any) -> None:
        self.requests, self.batches = requests, batches

    def __contains__(self, key: object) -> bool:
        return key in self.requests or key in self.batches


def _guarded(job: Job) -> Any:
    def run() -> None:
        try:
            job.run()
        except Exception:  # housekeeping never stops a worker; the next round retries
            logger.exception("celery-prio: %s failed", job.name)

    return run
