"""Worker side: a Consumer whose task fetch is driven by the tier scheduler.

Celery's default Tasks step subscribes to every queue with ``basic.consume``
and lets the broker push up to ``prefetch`` messages; once those sit in the
worker, priorities are gone (celery #4819, #6500). Here nothing is pushed:
for every free pool slot the scheduler names a tier and one message is
pulled from it with ``basic_get`` (RabbitMQ and Redis alike). The message
then goes through Celery's own strategy/Request/pool path, so acks,
retries, ETA, revokes, rate and time limits behave exactly as before.

The wiring is thin on purpose; the decisions live in ``scheduler.py``.
"""

from __future__ import annotations

import time
from typing import Any

from celery import bootsteps
from celery.utils.log import get_logger
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer
from celery.worker.consumer.control import Control
from celery.worker.consumer.mingle import Mingle
from kombu.common import QoS
from kombu.serialization import prepare_accept_content

from .brokers.amqp import AmqpFetcher, declare_tier_queues, promoted_queue
from .brokers.redis import (
    RESTORE_INTERVAL,
    RedisAdapter,
    RedisFetcher,
    report_drain_rates,
    restore_expired_unacked,
)
from .headers import PROMOTED_HEADER
from .install import check_task_tiers, settings_for
from .metrics import serve_metrics
from .scheduler import TierScheduler
from .settings import PrioSettings
from .stats import WorkerStats
from .tiers import TIERS, Tier
from .untrusted import enqueue_age, headers_problem, was_promoted_by_broker

logger = get_logger(__name__)

# Back-off while every served tier is empty: start fast so a burst after a
# short lull is picked up at once, settle at ``prio_poll_interval`` so an
# idle worker makes a bounded number of broker calls per second.
MIN_BACKOFF_FRACTION = 1 / 16
PROBE_FRACTION = 1 / 10  # an empty queue is re-asked after poll_interval / 10 at the soonest
AGING_TIERS = (Tier.BATCH, Tier.OFFLINE)  # batch -> realtime first, so offline -> batch finds room
RECONCILE_INTERVAL = 1.0  # seconds between sweeps for requests that ended off the pool
RATE_INTERVAL = 2.0  # seconds between drain-rate reports (Redis: Retry-After for publishers)


class TierFetcher:
    """Pulls one message per free slot from the tier the scheduler picks.

    It stands where Celery keeps ``consumer.task_consumer`` and quacks like a
    ``kombu.Consumer`` (``queues``, ``add_queue``, ``cancel_by_queue``,
    ``consuming_from``, ``consume``, ``cancel``, ``close``), so
    ``inspect active_queues``, ``add_consumer``/``cancel_consumer``, warm
    shutdown and Flower keep working.
    """

    def __init__(self, consumer: Consumer, settings: PrioSettings) -> None:
        self.c = consumer
        self.settings = settings
        self.hub = consumer.hub
        if self.hub is None:
            raise RuntimeError(
                "celery-prio needs Celery's event loop (prefork, threads or solo pool); "
                "gevent/eventlet pools are not supported"
            )
        app = consumer.app
        # A channel of our own: basic_get round trips and the acks of the
        # messages they return live on it.
        self.channel = consumer.connection.channel()
        self.broker = consumer.connection.transport.driver_type
        if self.broker == "amqp":
            self.channel = declare_tier_queues(self.channel, settings)
        self.redis = RedisAdapter(consumer.app, client=self.channel.client) if self.broker == "redis" else None
        self.redis_fetcher = RedisFetcher(self.channel, settings) if self.broker == "redis" else None
        # Whatever the broker: the one that can copy a message to the dead letters.
        self.source = self.redis_fetcher or AmqpFetcher(self.channel, settings)
        self.accept = prepare_accept_content(app.conf.accept_content)
        self.queues: list[Any] = []
        self.on_message = None  # set by Celery's loop to its task handler
        self.active = False
        concurrency = self._concurrency()
        self.scheduler = TierScheduler(
            weights=settings.weights,
            concurrency=concurrency,
            reserve=settings.effective_reserve(concurrency),
            min_share=settings.min_share,
            mode=settings.scheduler,
        )
        self.inflight: dict[Any, tuple[Tier, float, float]] = {}
        self.stats = WorkerStats()
        self._fetching: Tier | None = None
        self._rr: dict[Tier, int] = {t: 0 for t in TIERS}
        self._timer = None
        self._backoff = settings.poll_interval * MIN_BACKOFF_FRACTION
        self.broker_calls = 0
        self._housekeeping: list[Any] = []
        self._reap_scheduled = False
        self._empty_at: dict[str, float] = {}  # queue name -> when a basic_get last found it empty
        self._probe_interval = settings.poll_interval * PROBE_FRACTION
        self._rate_mark: tuple[float, dict[Tier, int]] | None = None
        for queue in app.amqp.queues.consume_from.values():
            self.add_queue(queue)

    # -- kombu.Consumer look-alike ------------------------------------------
    def add_queue(self, queue: Any) -> Any:
        if not self.consuming_from(queue.name):
            queue = queue.bind(self.channel)
            queue.declare()
            self.queues.append(queue)
            self._update_served()
        return queue

    def consuming_from(self, queue: Any) -> bool:
        name = getattr(queue, "name", queue)
        return any(q.name == name for q in self.queues)

    def cancel_by_queue(self, queue: str) -> None:
        self.queues = [q for q in self.queues if q.name != queue]
        self._update_served()

    def consume(self, no_ack: bool | None = None) -> None:
        if not self.active:
            self.active = True
            self.hub.call_soon(self.pump)
            # Safety net for requests that end without a pool callback
            # (revoked before they ran, cancelled): retire them anyway.
            self._housekeeping.append(self.hub.call_repeatedly(RECONCILE_INTERVAL, self._reap_and_pump))
            if self.broker == "redis":
                self._housekeeping += [
                    self.hub.call_repeatedly(RESTORE_INTERVAL, restore_expired_unacked, self.channel),
                    self.hub.call_repeatedly(RATE_INTERVAL, self._report_rates),
                ]
                if any(self.settings.aging[t] is not None for t in AGING_TIERS):
                    self._housekeeping.append(self.hub.call_repeatedly(self.settings.aging_interval, self._age))

    def cancel(self) -> None:
        self.active = False
        for entry in self._housekeeping:
            self.hub.timer.cancel(entry)
        self._housekeeping.clear()
        if self._timer is not None:
            self.hub.timer.cancel(self._timer)
            self._timer = None

    def close(self) -> None:
        # The channel closes with the connection; closing it here would make
        # the Redis transport restore messages whose acks_late tasks are
        # still finishing during a warm shutdown.
        self.cancel()

    def qos(self, prefetch_count: int = 0, **_: Any) -> None:
        """Prefetch does not apply: basic_get ignores basic.qos; the scheduler limits fetches."""

    # -- tier bookkeeping ----------------------------------------------------
    def _concurrency(self) -> int:
        controller = self.c.controller
        limit = getattr(controller, "max_concurrency", None) or getattr(self.c.pool, "num_processes", None)
        return max(int(limit or 1), 1)

    def tier_of_queue(self, name: str) -> Tier:
        # Queues that are not tier queues are sub-queues of the default tier.
        tier = self.settings.tier_for_queue(name)
        return self.settings.default_tier if tier is None else tier

    def _update_served(self) -> None:
        self._by_tier = {t: [q for q in self.queues if self.tier_of_queue(q.name) is t] for t in TIERS}
        self.scheduler.set_served(t for t, qs in self._by_tier.items() if qs)
        # Aging delivers promoted messages to a sub-queue of the upper tier
        # that goes first (oldest first), on both brokers.
        self._promoted_first = {
            lower.promoted(): promoted_queue(self.settings, lower.promoted())
            for lower in AGING_TIERS
            if self.settings.aging[lower] is not None
            and any(q.name == self.settings.queue_name(lower.promoted()) for q in self._by_tier[lower.promoted()])
        }

    def track(self, request: Any) -> None:
        """Called for every request Celery hands to the pool."""
        tier = self._fetching
        self._fetching = None
        if tier is None:  # an ETA or rate-limited request whose time has come
            routing_key = (request.delivery_info or {}).get("routing_key") or ""
            tier = self.tier_of_queue(routing_key)
        charge = self.scheduler.dispatched(tier)
        self.inflight[request] = (tier, time.monotonic(), charge)

    # -- the fetch loop ------------------------------------------------------
    def slot_freed(self) -> None:
        """A pool job ended (any thread): refill from the event loop.

        Via ``call_soon`` on purpose: it runs at the top of the next loop turn,
        before the prefork pool's on-tick hook that registers pipe writes for
        queued jobs. Fetching from an on-tick hook of our own would race that
        hook and could leave a job unwritten until the next poll timeout.
        """
        if not self._reap_scheduled:
            self._reap_scheduled = True
            self.hub.call_soon(self._reap_and_pump)

    def _reap_and_pump(self) -> None:
        """Retire requests Celery no longer holds, charge their run time, refill."""
        self._reap_scheduled = False
        reserved = worker_state.reserved_requests
        done = [r for r in self.inflight if r not in reserved]
        if not done:
            return
        now = time.monotonic()
        for request in done:
            tier, started, charge = self.inflight.pop(request)
            self.scheduler.finished(tier, now - started, charge)
            self.stats.observe_run(tier, now - started)
        if self.active:
            self._backoff = self.settings.poll_interval * MIN_BACKOFF_FRACTION
            self.pump()

    def _mark_empty(self, tier: Tier) -> None:
        self.scheduler.empty(tier)
        self.stats.observe_empty(tier)

    def _take(self, order: list[Tier]) -> tuple[Tier, Any] | None:
        """The first message of the first tier in ``order`` that has one (a round trip per queue)."""
        now = time.monotonic()
        for tier in order:
            message, asked = self._get(tier, now)
            if message is not None:
                return tier, message
            if asked:  # a tier whose queues were all skipped is not known to be empty
                self._mark_empty(tier)
        return None

    def _take_redis(self, order: list[Tier]) -> tuple[Tier, Any] | None:
        """The same in one round trip: every queue of every tier, in order, in one script.

        Returns ``(tier, None)`` when the script only moved malformed
        elements to the dead letters: the caller asks again.
        """
        keys: list[str] = []
        owners: list[tuple[Tier, int | None]] = []
        for tier in order:
            if tier in self._promoted_first:
                keys.append(self._promoted_first[tier])
                owners.append((tier, None))
            queues = self._by_tier[tier]
            start = self._rr[tier]
            for i in range(len(queues)):
                position = (start + i) % len(queues)
                for key in self.redis_fetcher.keys_for(queues[position].name):
                    keys.append(key)
                    owners.append((tier, position))
        self.broker_calls += 1
        hit = self.redis_fetcher.fetch(keys, [tier for tier, _ in owners])
        if hit is not None and hit[1] is None:
            return order[0], None
        found = owners[hit[0]][0] if hit else None
        for tier in order:
            if tier is found:
                break
            self._mark_empty(tier)
        if hit is None:
            return None
        tier, position = owners[hit[0]]
        if position is not None:
            self._rr[tier] = (position + 1) % len(self._by_tier[tier])
        message = hit[1]
        message.accept = self.accept
        return tier, message

    def _get(self, tier: Tier, now: float) -> tuple[Any, bool]:
        """One message from ``tier``, or None; and whether any of its queues was asked.

        The promoted sub-queue (RabbitMQ) goes first, then the tier's queues
        round robin. A queue found empty a moment ago is not asked again at
        once: on a busy worker that would double the broker round trips.
        """
        queues = self._by_tier[tier]
        start = self._rr[tier]
        candidates = [(None, self._promoted_first[tier])] if tier in self._promoted_first else []
        candidates += [((start + i) % len(queues), queues[(start + i) % len(queues)].name) for i in range(len(queues))]
        asked = False
        for position, name in candidates:
            if now - self._empty_at.get(name, float("-inf")) < self._probe_interval:
                continue
            asked = True
            message = self._basic_get(name)
            while message is self.DEAD_LETTERED:  # a malformed one went to the dead letters: the next
                message = self._basic_get(name)
            if message is not None:
                if position is not None:
                    self._rr[tier] = (position + 1) % len(queues)
                return message, True
            self._empty_at[name] = now
        return None, asked

    DEAD_LETTERED = object()  # _basic_get: one was taken and moved to the dead letters

    def _basic_get(self, queue: str) -> Any:
        self.broker_calls += 1
        took, message = self.source.get(queue)
        if message is None:
            return self.DEAD_LETTERED if took else None
        message.accept = self.accept
        return message

    def dead_letter(self, message: Any, reason: str) -> None:
        """Copy ``message`` to ``<prefix>.dead`` with ``reason``; the caller settles the original."""
        tier = self._fetching
        if tier is None:
            tier = self.tier_of_queue(getattr(message, "prio_queue", "") or "")
        self.source.dead_letter(message, reason, tier)

    def _deliver(self, tier: Tier, message: Any) -> None:
        """Hand one message to Celery; anything that cannot run goes to the dead letters, never up the stack."""
        self._fetching = tier
        try:
            if message.errors:
                try:
                    message._reraise_error()  # kombu keeps the decode error on the message
                except Exception as exc:  # Celery's handler (ours, below) dead-letters it and acks
                    self.c.on_decode_error(message, exc)
                return
            problem = headers_problem(message.headers)
            if problem is not None:
                logger.error("celery-prio: %s", problem)
                self.dead_letter(message, problem)
                message.ack()
                return
            headers = message.headers or {}
            now = time.time()
            promoted = PROMOTED_HEADER in headers or was_promoted_by_broker(headers)
            self.stats.observe_fetch(tier, enqueue_age(headers, now), promoted, now)
            try:
                self.on_message(message)
            except Exception as exc:  # Celery's handler let it through: still never lost, never fatal
                logger.exception("celery-prio: could not hand a message to Celery")
                if not message.acknowledged:
                    self.dead_letter(message, f"delivery failed: {exc!r}"[:500])
                    message.ack()
        finally:
            self._fetching = None

    def pump(self) -> None:
        """Fill free slots; when every served tier is empty, retry after a back-off."""
        if self._timer is not None:  # called early (a slot freed): drop the pending retry
            self.hub.timer.cancel(self._timer)
            self._timer = None
        if not self.active or self.on_message is None:
            return
        try:
            self._fill_slots()
        except self.c.connection_errors:
            raise  # Celery's consumer reconnects and builds a new fetcher
        except Exception:
            # Whatever went wrong, the loop goes on: a fetcher that stops
            # pumping is a worker that answers ping and runs nothing.
            logger.exception("celery-prio: fetch failed; retrying")
            self._retry_later()

    def _fill_slots(self) -> None:
        # Bounded per turn: messages that do not take a slot (ETA, rate
        # limited, rejected, dead-lettered) must not keep the event loop here.
        for _ in range(2 * self.scheduler.concurrency + 2):
            order = self.scheduler.order()
            if not order:
                return  # no free slot: a finishing task calls pump again
            taken = self._take_redis(order) if self.redis_fetcher else self._take(order)
            if taken is None:
                self._retry_later()
                return
            tier, message = taken
            self._backoff = self.settings.poll_interval * MIN_BACKOFF_FRACTION
            if message is not None:
                self._deliver(tier, message)
        self.hub.call_soon(self.pump)

    def _retry_later(self) -> None:
        if self._timer is None and self.active:
            self._timer = self.hub.call_later(self._backoff, self.pump)
            self._backoff = min(self._backoff * 2, self.settings.poll_interval)

    def _age(self) -> None:
        """One aging pass (Redis; RabbitMQ ages by itself). Every worker runs it, whatever its -Q."""
        now = time.time()
        try:
            for tier in AGING_TIERS:
                self.redis.promote_aged(self.settings, tier, now)
        except Exception:  # housekeeping must never stop the worker; the next pass retries
            logger.exception("celery-prio: aging pass failed")

    def _report_rates(self) -> None:
        now = time.monotonic()
        counts = {t: st.dispatched for t, st in self.scheduler.tiers.items()}
        last_at, last = self._rate_mark or (now, counts)
        self._rate_mark = (now, counts)
        if now > last_at:
            rates = {t: (counts[t] - last[t]) / (now - last_at) for t in TIERS}
            try:
                report_drain_rates(self.channel, self.settings.stats_key, self.c.hostname, rates)
            except Exception:
                logger.exception("celery-prio: could not report drain rates")

    # -- reporting -----------------------------------------------------------
    def info(self) -> dict[str, Any]:
        s = self.scheduler
        shares = s.shares()
        configured = s.configured_shares()
        now = time.time()
        counters = self.redis.counters(self.settings) if self.redis else {}
        tiers = {}
        for tier, st in s.tiers.items():
            oldest = (
                self.redis.oldest_age(self.settings.queue_name(tier), now)
                if self.redis
                else self.stats.oldest_wait(tier, now)
            )
            tiers[tier.label] = {
                "queues": [q.name for q in self._by_tier[tier]],
                "dispatched": st.dispatched,
                "finished": st.finished,
                "running": st.running,
                "busy_seconds": round(st.busy_seconds, 3),
                "slot_time_share": round(shares[tier], 4),
                "configured_share": round(configured[tier], 4),
                "runtime_estimate_s": round(st.estimate, 4),
                "oldest_wait_s": None if oldest is None else round(oldest, 3),
                # Broker-wide counters (Redis); RabbitMQ keeps none, see README.
                "promoted": counters.get(f"promoted:{tier.label}", 0) if self.redis else None,
                "rejected": counters.get(f"rejected:{tier.label}", 0) if self.redis else None,
                "dropped": counters.get(f"dropped:{tier.label}", 0) if self.redis else None,
                **self.stats.summary(tier),
            }
        return {
            "concurrency": s.concurrency,
            "reserve": s.reserve,
            "scheduler": s.mode,
            "broker_calls": self.broker_calls,
            "polled_queues": [q.name for q in self.queues] + list(self._promoted_first.values()),
            "tiers": tiers,
        }


class PrioTasks(bootsteps.StartStopStep):
    """Replaces ``celery.worker.consumer.tasks:Tasks``: same contract, pull-based fetch."""

    requires = (Mingle,)

    def __init__(self, c: Consumer, **kwargs: Any) -> None:
        c.task_consumer = c.qos = None
        self.collector = None
        super().__init__(c, **kwargs)

    def start(self, c: Consumer) -> None:
        settings = settings_for(c.app)
        check_task_tiers(c.app)  # a task with a bogus tier stops the worker here, loudly
        fetcher = TierFetcher(c, settings)
        c.update_strategies()
        # Celery's ETA path bumps ``c.qos``; with basic_get there is no
        # broker-side window to move, so the setter does nothing.
        c.qos = QoS(fetcher.qos, fetcher.scheduler.concurrency)
        c.task_consumer = fetcher
        if settings.metrics_port is not None:
            if self.collector is None:  # one exporter per worker, kept across reconnects
                self.collector = serve_metrics(fetcher, c.app, settings.metrics_host, settings.metrics_port)
            self.collector.fetcher = fetcher
        logger.info(
            "celery-prio: serving %s (concurrency %d, %d reserved for realtime, weights %s)",
            ", ".join(q.name for q in fetcher.queues),
            fetcher.scheduler.concurrency,
            fetcher.scheduler.reserve,
            {t.label: w for t, w in settings.weights.items()},
        )

    def stop(self, c: Consumer) -> None:
        if c.task_consumer is not None:
            c.task_consumer.cancel()

    def shutdown(self, c: Consumer) -> None:
        if c.task_consumer is not None:
            c.task_consumer.close()
            c.task_consumer = None

    def info(self, c: Consumer) -> dict[str, Any]:
        fetcher = c.task_consumer
        if not isinstance(fetcher, TierFetcher):
            return {"prefetch_count": "N/A"}
        # Flower reads prefetch_count; the honest figure is the slot bound.
        return {"prefetch_count": fetcher.scheduler.concurrency, "prio": fetcher.info()}


class PrioControl(Control):
    """Celery's remote-control step, re-pointed at PrioTasks (it requires the Tasks step)."""

    requires = (PrioTasks,)


class PrioConsumer(Consumer):
    """Selected by ``install()`` through the ``worker_consumer`` setting."""

    class Blueprint(Consumer.Blueprint):
        default_steps = [
            "celery.worker.consumer.connection:Connection",
            "celery.worker.consumer.mingle:Mingle",
            "celery.worker.consumer.events:Events",
            "celery.worker.consumer.gossip:Gossip",
            "celery.worker.consumer.heart:Heart",
            "celery_prio.consumer:PrioControl",
            "celery_prio.consumer:PrioTasks",
            # DelayedDelivery (native delays on quorum queues) is left out:
            # tier queues are classic queues and ETA uses Celery's timer.
            "celery.worker.consumer.consumer:Evloop",
            "celery.worker.consumer.agent:Agent",
        ]

    # Celery's handlers for messages it cannot run log, then ack or reject
    # (drop) them. Here they first copy the message to the dead letters with
    # the reason, so a bad message is kept as data and never redelivered
    # into a crash loop.
    def _dead_letter(self, message: Any, reason: str) -> None:
        fetcher = self.task_consumer
        if isinstance(fetcher, TierFetcher) and not message.acknowledged:
            fetcher.dead_letter(message, reason[:500])

    def on_unknown_message(self, body: Any, message: Any) -> None:
        self._dead_letter(message, "unknown message format (neither task protocol 1 nor 2)")
        super().on_unknown_message(body, message)

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        self._dead_letter(message, f"unregistered task: {exc}")
        super().on_unknown_task(body, message, exc)

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        self._dead_letter(message, f"invalid task: {exc!r}")
        super().on_invalid_task(body, message, exc)

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        self._dead_letter(message, f"cannot decode: {exc!r}")
        super().on_decode_error(message, exc)

    def __init__(self, on_task_request: Any, *args: Any, pool: Any = None, **kwargs: Any) -> None:
        def on_task_request_tracked(request: Any) -> Any:
            fetcher = self.task_consumer
            if isinstance(fetcher, TierFetcher):
                fetcher.track(request)
            return on_task_request(request)

        if pool is not None:
            _notify_when_jobs_end(pool, self)
        super().__init__(on_task_request_tracked, *args, pool=pool, **kwargs)


def _notify_when_jobs_end(pool: Any, consumer: Consumer) -> None:
    """Wrap ``pool.apply_async`` so the fetcher hears when a job leaves its slot.

    Installed before the task strategies are built (they capture
    ``pool.apply_async``), so every request Celery runs goes through it.
    """
    apply_async = pool.apply_async

    def notify(callback: Any) -> Any:
        def called(*args: Any, **kwargs: Any) -> Any:
            try:
                return callback(*args, **kwargs)
            finally:
                fetcher = consumer.task_consumer
                if isinstance(fetcher, TierFetcher):
                    fetcher.slot_freed()

        return called

    def apply_async_notifying(*args: Any, callback: Any = None, error_callback: Any = None, **kwargs: Any) -> Any:
        return apply_async(
            *args,
            callback=notify(callback) if callback else None,
            error_callback=notify(error_callback) if error_callback else None,
            **kwargs,
        )

    pool.apply_async = apply_async_notifying
