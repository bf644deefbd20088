"""The fetch loop: one message per free slot, from the tier the scheduler names.

No Celery and no broker here: the loop is given a :class:`FetchSource`, a
scheduler, a clock and a way to schedule callbacks (the worker's event loop,
or a simulated one in tests), and hands each message to ``deliver``.
``consumer.py`` is the Celery wiring around it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Hashable
from typing import Any, Protocol

from ..brokers.base import FetchSource
from ..policy.scheduler import TierScheduler
from ..policy.served import ServedQueues
from ..policy.start_rate import StartRates
from ..tiers import Tier
from .ledger import Ledger, Settled
from .stats import WorkerStats

logger = logging.getLogger(__name__)

# Back-off while every served tier is empty: start fast so a burst after a
# short lull is picked up at once, settle at ``poll_interval`` so an idle
# worker makes a bounded number of broker calls per second.
MIN_BACKOFF_FRACTION = 1 / 16
#: Seconds between two tracebacks of the same fetch failure.
FAILURE_LOG_INTERVAL = 60.0


class EventLoop(Protocol):
    """What the loop needs of an event loop (kombu's Hub has these)."""

    def call_soon(self, callback: Callable[..., object], *args: object) -> object: ...
    def call_later(self, delay: float, callback: Callable[..., object], *args: object) -> object: ...


class FetchLoop:
    def __init__(
        self,
        source: FetchSource[Any],
        scheduler: TierScheduler,
        stats: WorkerStats,
        loop: EventLoop,
        cancel: Callable[[object], None],
        clock: Callable[[], float],
        poll_interval: float,
        reraise: tuple[type[BaseException], ...] = (),
        lanes: ServedQueues | None = None,
    ) -> None:
        self.source = source
        self.scheduler = scheduler
        self.stats = stats
        self.ledger = Ledger()
        self.loop = loop
        self.cancel_timer = cancel
        self.clock = clock
        self.poll_interval = poll_interval
        self.reraise = reraise  # connection errors: the consumer reconnects and builds a new loop
        # Set where tasks run on the loop's own thread (``-P solo``): a refill waits for the end of the turn, so
        # that the acks Celery queued on it (``call_soon``, run in no set order) go before the next task runs.
        self.defer_refill = False
        self._refill_pending = False
        # The tier's time among its queues (``ServedQueues``: dispatched/finished/empty per queue), if any.
        self.lanes = lanes
        self.deliver: Callable[[Tier, Any], None] | None = None  # the source's message type
        self.on_settled: Callable[[Settled], None] | None = None  # each finished run (``ledger.Settled``): the trace
        self.active = False
        self.fetching: Tier | None = None  # the tier of the message being delivered right now
        self.fetching_queue: str | None = None  # and the queue it came from
        self.fetching_waited: float | None = None  # and how long it waited since its publish (intake reads it)
        self._timer: object = None
        self._backoff = poll_interval * MIN_BACKOFF_FRACTION
        self._wake_pending = False
        self._waiting_on: frozenset[Tier] | None = None  # the tiers an idle loop asked last (None: not idle)
        self.start_rates = StartRates()  # each tier's recent pace of starts (what a pushed queue may hold)
        #: Since when the worker has found nothing to fetch and waits on the broker (None while it fetches).
        self.idle_since: float | None = None
        self._last_failure: str | None = None  # the last fetch failure logged with its traceback, and when
        self._last_failure_at = 0.0
        source.on_arrival = self.wake
        source.on_delivery = self.delivered
        source.free_slots = scheduler.free_slots
        source.starts_within = self.starts_within

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        if not self.active:
            self.active = True
            self.loop.call_soon(self.pump)

    def stop(self) -> None:
        self.active = False
        if self._timer is not None:
            self.cancel_timer(self._timer)
            self._timer = None
        self.source.stop()

    def wake(self) -> None:
        """A message was pushed to the source: pump on the next loop turn (once, however many arrive).

        A timer due now, not ``call_soon``: kombu's hub runs what ``call_soon`` adds from inside a ready
        callback only after its next poll, which an idle worker blocked on the broker may sit in for a
        second; a due timer fires in the same turn."""
        # No slot free: the next task to finish pumps anyway (a busy drain would otherwise pump once per push).
        if self.active and not self._wake_pending and self.scheduler.free_slots() > 0:
            self._wake_pending = True
            self.loop.call_later(0, self._woken)

    def delivered(self, tier: Tier) -> None:
        """A message of ``tier`` was pushed to the source: pump, unless the loop went idle asking only other
        tiers (a slot kept for realtime while batch drains). The scheduler's order changes only when a task
        finishes (which pumps) or through a ``wake``, so until then a pump would not take it: a drain of
        short tasks would pump once per push for nothing."""
        if self._waiting_on is None or tier in self._waiting_on:
            self.wake()

    def _woken(self) -> None:
        self._wake_pending = False
        self._backoff = self.poll_interval * MIN_BACKOFF_FRACTION
        self.pump()

    # -- the loop ------------------------------------------------------------
    def pump(self) -> None:
        """Fill free slots; when every served tier is empty, retry after a back-off."""
        if self._timer is not None:  # called early (a slot freed): drop the pending retry
            self.cancel_timer(self._timer)
            self._timer = None
        self._waiting_on = None
        if not self.active or self.deliver is None:
            return
        try:
            self._fill_slots()
        except self.reraise:
            raise
        except Exception as exc:
            # Whatever went wrong, the loop goes on: a worker that stops
            # pumping answers ping and runs nothing. The same failure again (a failover in progress, a queue
            # deleted under the worker) is logged with its traceback once a minute, not on every retry.
            now, said = self.clock(), repr(exc)
            if said != self._last_failure or now - self._last_failure_at >= FAILURE_LOG_INTERVAL:
                logger.exception("celery-prio: fetch failed; retrying")
                self._last_failure, self._last_failure_at = said, now
            else:
                logger.debug("celery-prio: fetch failed again (%s); retrying", said)
            self._retry_later()

    def _fill_slots(self) -> None:
        # Bounded per turn: messages that take no slot (ETA, rate limited,
        # rejected, dead-lettered) must not keep the event loop here.
        for _ in range(2 * self.scheduler.concurrency + 2):
            order = self.scheduler.order()
            if not order:
                return  # no free slot: a finishing task calls pump again
            take = self.source.take(order)
            for tier in take.empty:
                self.scheduler.empty(tier)
                self.stats.observe_empty(tier)
            if self.lanes is not None:
                for queue in take.empty_queues:
                    self.lanes.empty(queue)
            if take.message is None:
                if take.dead_lettered:
                    continue
                # Idle: block on the broker where the source can (woken by the next arrival), else poll.
                if self.idle_since is None:
                    self.idle_since = self.clock()
                if self.source.wait_for_work(order):
                    self._waiting_on = frozenset(order)
                else:
                    self._retry_later()
                return
            self.idle_since = None
            self._backoff = self.poll_interval * MIN_BACKOFF_FRACTION
            self.fetching, self.fetching_queue = take.tier, take.queue
            try:
                self.deliver(take.tier, take.message)
            finally:
                self.fetching = self.fetching_queue = self.fetching_waited = None
        self.loop.call_soon(self.pump)

    def _retry_later(self) -> None:
        if self._timer is None and self.active:
            self._timer = self.loop.call_later(self._backoff, self.pump)
            self._backoff = min(self._backoff * 2, self.poll_interval)

    # -- slots -------------------------------------------------------------
    def started(self, key: Hashable, tier: Tier) -> None:
        """A delivered message took a slot (Celery handed its request to the pool)."""
        queue = self.fetching_queue  # None for an ETA request whose time has come: no queue to charge
        queue_charge = self.lanes.dispatched(queue) if self.lanes is not None and queue else 0.0
        dispatched = self.scheduler.dispatched(tier)
        now = self.clock()
        self.start_rates.started(tier, now)
        self.ledger.start(key, tier, dispatched, now, queue, queue_charge, self.fetching_waited)

    def starts_within(self, seconds: float, tier: Tier) -> int:
        """Tasks of ``tier`` this worker is expected to start within ``seconds``, at its pace of the last second."""
        return self.start_rates.within(seconds, tier, self.clock())

    def settle(self, still_held: Container) -> None:
        """Retire what no longer holds a slot, charge its run time, refill."""
        settled = self.ledger.settle(still_held, self.clock())
        if not settled:
            return
        for s in settled:
            self.scheduler.finished(s.tier, s.runtime, s.charge)
            self.stats.observe_run(s.tier, s.runtime, s.waited)
            if self.lanes is not None and s.queue:
                self.lanes.finished(s.queue, s.runtime, s.queue_charge)
            if self.on_settled is not None:
                self.on_settled(s)
        if self.active:
            self._backoff = self.poll_interval * MIN_BACKOFF_FRACTION
            if not self.defer_refill:
                self.pump()
            elif not self._refill_pending:  # a timer due now fires after every callback of this turn
                self._refill_pending = True
                self.loop.call_later(0, self._refill)

    def _refill(self) -> None:
        self._refill_pending = False
        self.pump()
