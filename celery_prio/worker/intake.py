"""What happens to each fetched message before Celery sees it: checked, counted, handed over — or settled here.

A message that cannot run (undecodable, a malformed envelope) goes to the
dead letters; the stale original of a task a RabbitMQ boost lifted is acked
unrun; a batched task's call starts or joins a batch. Nothing that fails
here goes up the event loop's stack: a bad message never stops a worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from celery.utils.log import get_logger

from ..brokers import BrokerFetchSource
from ..headers import BOOST_GENERATION_HEADER, BOOSTED_HEADER, ENQUEUED_HEADER, PROMOTED_HEADER, SLICE_HEADER
from ..policy.served import ServedQueues
from ..policy.superseded import RUN, STALE, Superseded, generation_of
from ..tiers import Tier
from ..untrusted import enqueue_age, headers_problem, valid_stamp, was_promoted_by_broker
from .batching import Batcher
from .fetchloop import FetchLoop
from .stats import WorkerStats

if TYPE_CHECKING:
    from kombu.message import Message

logger = get_logger(__name__)

#: Headers of work lifted into a tier rather than published there: it keeps its own terms (no deadline).
LIFTED_HEADERS = (PROMOTED_HEADER, BOOSTED_HEADER, SLICE_HEADER)

#: Dead-letter reasons are cut to this length (an exception's repr can be long).
MAX_REASON = 500


class Intake:
    """Hands fetched messages to Celery's task handler (``handler``, set when Celery's loop starts)."""

    def __init__(
        self,
        source: BrokerFetchSource,
        loop: FetchLoop,
        served: ServedQueues,
        stats: WorkerStats,
        batcher: Batcher,
        superseded: Superseded,
        on_decode_error: Callable[[Message, Exception], None],
        call_later: Callable[[float, Callable[[], None]], object],
    ) -> None:
        self.source, self.loop, self.served, self.stats = source, loop, served, stats
        self.batcher, self.superseded = batcher, superseded
        self.on_decode_error, self.call_later = on_decode_error, call_later
        self.handler: Callable[[Message], None] | None = None
        self.deadline = 0.0  # prio_realtime_deadline (0: realtime calls never expire here)

    def dead_letter(self, message: Message, reason: str) -> None:
        """Copy ``message`` to ``<prefix>.dead`` with ``reason``; the caller settles the original."""
        tier = self.loop.fetching
        if tier is None:
            tier = self.served.tier_of(getattr(message, "prio_queue", "") or "")
        self.source.dead_letter(message, reason[:MAX_REASON], tier)

    def deliver(self, tier: Tier, message: Message) -> None:
        """Hand one message to Celery (or, a batched task's call, start or join a batch); anything that cannot
        run goes to the dead letters, never up the stack."""
        if not self.admit(tier, message):
            return
        if self.batcher.batches(message):
            self.batcher.deliver(tier, message, self.loop.fetching_queue, self.hand_over, self._admit_and_hand)
            return
        self.hand_over(message)

    def _admit_and_hand(self, tier: Tier, message: Message) -> None:
        """A batch's top-up: each message is checked like any fetched one before Celery sees it."""
        if self.admit(tier, message):
            self.hand_over(message)

    def admit(self, tier: Tier, message: Message) -> bool:
        """Whether ``message`` goes on to Celery: not undecodable, not malformed, not a boosted task's stale
        copy (each of those is settled here); its wait counted."""
        if message.errors:
            try:
                message._reraise_error()  # kombu keeps the decode error on the message
            except Exception as exc:  # Celery's handler (PrioConsumer's) dead-letters it and acks
                self.on_decode_error(message, exc)
            return False
        problem = headers_problem(message.headers)
        if problem is not None:
            self.dead_letter(message, problem)
            message.ack()
            return False
        headers = message.headers or {}
        if not self.superseded:  # no boost known to this worker (nearly always): no copy of anything is stale
            verdict: str | float = RUN
        else:
            verdict = self.superseded.verdict(
                headers.get("id"), generation_of(headers.get(BOOST_GENERATION_HEADER)), time.time()
            )
        if verdict == STALE:
            # A RabbitMQ boost published a lifted copy of this task: this is the original, left behind.
            self.superseded.skipped += 1
            logger.info("celery-prio: %s[%s] was boosted: stale copy acked unrun", headers.get("task"), headers["id"])
            message.ack()
            return False
        if verdict != RUN:  # a boost of it is under way: its copy may not be on the broker yet; ask again
            self.call_later(float(verdict), lambda: self.deliver(tier, message))
            return False
        if tier is Tier.REALTIME and self.deadline > 0 and self._past_deadline(tier, headers):
            return True  # Celery's handler marks it expired (state, event, signal) and acks it, unrun
        self._count(tier, headers)
        return True

    def _past_deadline(self, tier: Tier, headers: dict[str, object]) -> bool:
        """A realtime call published longer ago than ``prio_realtime_deadline``: its caller gave up on it.
        It is given Celery's own ``expires`` (the deadline, passed), so Celery marks it expired as it marks
        a call whose ``expires=`` passed: ``REVOKED`` in the result backend (``.get()`` raises
        ``TaskRevokedError`` at once), the ``task-revoked`` event and signal (``expired=True``), acked unrun.
        A call with its own ``expires`` or an ETA, and work lifted into realtime (aged, boosted, a slice's
        continuation), keep their own terms. Asked of realtime calls only, where a deadline is set (``admit``)."""
        deadline = self.deadline
        if headers.get("expires") is not None or headers.get("eta") is not None:
            return False
        if any(h in headers for h in LIFTED_HEADERS) or was_promoted_by_broker(headers):
            return False
        published = valid_stamp(headers.get(ENQUEUED_HEADER))
        if published is None or time.time() - published <= deadline:
            return False
        headers["expires"] = datetime.fromtimestamp(published + deadline, tz=UTC).isoformat()
        self.stats.observe_expired(tier)
        return True

    def _count(self, tier: Tier, headers: dict[str, object]) -> None:
        now = time.time()
        if BOOSTED_HEADER in headers:
            self.stats.observe_boosted(tier)
        if SLICE_HEADER in headers:  # a sliced task resuming: neither a new arrival nor a new promotion
            self.stats.observe_fetch(tier, None, False, now)
            return
        promoted = PROMOTED_HEADER in headers or ("x-death" in headers and was_promoted_by_broker(headers))
        wait = enqueue_age(headers, now)
        self.loop.fetching_waited = wait  # its run's end tells whether it was answered within the target
        self.stats.observe_fetch(tier, wait, promoted, now)
        if wait is not None and self.loop.fetching_queue:
            self.served.observe_wait(self.loop.fetching_queue, wait)

    def hand_over(self, message: Message) -> None:
        try:
            if self.handler is None:
                raise RuntimeError("a message was fetched before Celery's loop set its task handler")
            self.handler(message)
        except Exception as exc:  # Celery's handler let it through: still never lost, never fatal
            logger.exception("celery-prio: could not hand a message to Celery")
            if not message.acknowledged:
                self.dead_letter(message, f"delivery failed: {exc!r}")
                message.ack()


__all__ = ["Intake"]
