"""RabbitMQ fetch by push (``prio_fetch = "consume"``, the default on classic queues): consumers of prefetch 1
instead of a ``basic_get`` per task.

``basic_get`` costs a blocking round trip per task, and a busy worker asks
every queue it found empty again on each fetch: RabbitMQ pays for a ``get``
per queue per task (a busy fleet cost it 5x plain Celery). Here every queue
a worker serves and knows to exist (tier queues, front lanes, sub-queues,
up to ``PUSH_MAX``) is pushed to it: an empty queue's consumer costs nothing,
and the scheduler still picks among tiers:

* **Prefetch 1 per consumer.** RabbitMQ pushes a consumer its next message
  once Celery acks the last one, which for most tasks happens as they start.
  A task that Celery leaves unacked for long (``acks_late``, ETA, rate limit)
  would hold its consumer up, so that consumer is cancelled when its
  message is taken and a new one starts in its place. Both are sent
  ``nowait``: no round trip.
* **As many as the slots start within half of ``prio_hold_max``.** A queue
  keeps one consumer at least, so new work (a realtime request) is pushed
  the moment it is published. After a take it has as many as the worker's
  free slots, or (batch and offline) the tasks of its tier the worker
  started in half of ``prio_hold_max`` at its pace of the last second if
  more, Celery's prefetch at most: a drain of short tasks keeps messages
  coming, a tier with few of the slots' turns or long tasks is back to one.
  Consumers are cancelled only when they outnumber that: a consumer per
  message costs RabbitMQ ~100 µs more per message (measured).
* **In hand** are messages delivered but not yet given to Celery. A fetch takes
  from the hand in the scheduler's order, with no broker call. Queues not
  pushed (past ``PUSH_MAX``, or not known to exist) are still asked with
  ``basic_get``, in that same order. So is
  a pushed queue ahead of the message in hand whose next message may still
  be on its way; otherwise a lower tier's message would take the slot.
* **Given back.** A message left in hand for ``prio_hold_max`` seconds goes
  back to its queue (``basic_reject`` with requeue), so another worker can
  run it. That happens when every slot is busy or the scheduler wants other
  tiers. Its queue's consumers are then cancelled, and they start again when
  a slot asks for that tier and no queue before it has a message on its way
  (one would take the slot, and the called-back message would be held and
  given back again: on a busy fleet of one-slot workers that round cost
  RabbitMQ a consume, a delivery, a reject and a cancel per worker every
  ``prio_hold_max``).

Everything here runs on the worker's event loop. Deliveries arrive from
inside the connection's ``drain_events`` and only land in the hand.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ...policy.served import ServedQueues
from ...settings import PrioSettings
from ...tiers import Tier
from ..base import Job, Take
from .fetch import AmqpFetchSource
from .idle_reports import IdleReports
from .settles import SettleWatch

if TYPE_CHECKING:
    from amqp import Channel as AmqpChannel
    from amqp.basic_message import Message as AmqpMessage
    from celery import Celery

logger = logging.getLogger(__name__)

#: Queues one worker keeps consumers on at most (in asking order); more are asked by ``basic_get``.
PUSH_MAX = 1024
#: A batch or offline queue holds the starts expected within this share of ``prio_hold_max``: the last message
#: in hand then waits about that long, leaving the rest of ``prio_hold_max`` for the pace to vary.
HOLD_SHARE = 0.5
#: Seconds between looks at the hand when no delivery armed one (a look lost with a restarted loop).
HAND_BACKSTOP = 1.0
#: The shortest wait before looking at the hand again (a message due now is past ``prio_hold_max`` then).
GIVE_BACK_MIN_WAIT = 0.005


class AmqpConsumeSource(AmqpFetchSource):
    """``AmqpFetchSource`` with the tier queues and front lanes pushed to consumers (see the module doc)."""

    def __init__(self, app: Celery, channel: AmqpChannel, served: ServedQueues, settings: PrioSettings) -> None:
        super().__init__(app, channel, served, settings)
        self.hold_max = settings.hold_max
        self._prefetch_multiplier = max(int(app.conf.worker_prefetch_multiplier or 1), 1)
        self._tasks = app.tasks  # the registry itself (tasks registered later land in it): read per message
        # A consumer that was armed this recently may still be pushed a message (RabbitMQ pushes a queue's
        # next one once Celery acks the last, as the task starts): its queue is not taken to be empty.
        self._pending_window = settings.poll_interval
        self._tags = itertools.count(1)
        self._on_channel: Any = None  # the channel the consumers below live on
        self._synced = -1  # ``served.version`` the consumers were last matched to
        self._reset()

    def _reset(self) -> None:
        self.pushed: set[str] = set()  # queues fetched by push (the rest: basic_get)
        self._out: dict[str, dict[str, float]] = {}  # pushed queue -> {tag: started} of consumers not yet pushed to
        self._queue_of: dict[str, str] = {}  # consumer tag -> queue, while it lives
        self._hand: dict[str, deque[tuple[Any, float, str]]] = {}  # queue -> (message, arrived, its consumer)
        self._parked: set[str] = set()  # gave a message back: no consumer until a slot asks for its tier
        self._held = 0  # messages in all hands (a count: the metrics thread reads it while the loop runs)
        self._held_tier: dict[Tier, int] = {}  # the same per tier (for sliced tasks deciding whether to yield)
        self._settle_watch = SettleWatch()  # which consumers may still be pushed a message (``settles.py``)
        self._deferred = False  # the last take left a parked queue parked (a push before it may be coming)
        self._all_pushed = False  # the last take looked at pushed queues only
        # The last take found nothing, with every queue pushed and none with a message on its way: until a
        # delivery or a consumer change, the same ask finds nothing again (see ``take``).
        # (the tiers asked, ``served.version``, the full answer, the answer while nothing is due to be reported:
        # its tiers are told empty at the pace of their queues, not once per task a busy worker starts)
        self._quiet: tuple[tuple[Tier, ...], int, Take, Take] | None = None
        self._quiet_due = 0.0  # when one of the kept answer's queues is next due to be reported empty
        self._give_back_at = float("-inf")  # when the look for messages held too long is due (armed until then)
        self._look_timer: Any = None  # that look's timer: one at a time (a re-arm cancels the one before)
        self._idle_reports = IdleReports()  # when each pushed queue was last reported empty

    @property
    def held(self) -> int:
        """Messages in hand now: delivered to this worker, not yet given to Celery (safe from any thread)."""
        return self._held

    def held_by_tier(self) -> Mapping[Tier, int]:
        return self._held_tier

    def _count_held(self, name: str, delta: int, tier: Tier | None = None) -> None:
        self._held += delta
        tier = self.served.tier_of(name) if tier is None else tier
        self._held_tier[tier] = self._held_tier.get(tier, 0) + delta

    # -- consumers ---------------------------------------------------------------
    def _keep_consumers(self) -> None:
        """Consumers for exactly the tier queues and front lanes served now (on the current channel)."""
        if self.channel is not self._on_channel:
            # First call, or a failed declare replaced the channel: what lived on the old one is gone with it.
            self._reset()
            self._on_channel = self.channel
            self._synced = -1
            self.channel.basic_qos(0, 1, False)  # every consumer started on this channel: one message
            self._settle_watch.watch(self.channel)
        if self._synced == self.served.version:
            return
        self._synced = self.served.version
        # Every queue known to exist is pushed (a missing one would close the channel): tier queues, front
        # lanes, and the sub-queues declared here. An empty queue's consumer costs RabbitMQ nothing; polling it
        # would cost a ``basic_get`` per fetch. Past ``PUSH_MAX`` the rest are asked by ``basic_get``.
        known = {self.settings.queue_name(t) for t in self.served.tiers} | set(self.served.promoted.values())
        known |= self._declared
        wanted = {n for n in self.served.all_names() if n in known}
        if len(wanted) > PUSH_MAX:
            wanted = set([n for n in self.served.all_names() if n in wanted][:PUSH_MAX])
        for name in self.pushed - wanted:
            self._drop(name)
        for name in sorted(wanted - self.pushed):
            self.pushed.add(name)
            self._out[name], self._hand[name] = {}, deque()
            self._consume(name)

    def _on_its_way(self, name: str, now: float) -> bool:
        return self._settle_watch.on_its_way(self._out[name], now, self._pending_window)

    def _consume(self, name: str) -> None:
        self._unquiet(name)  # a new consumer's queue may have a message on its way
        tag = f"prio-{next(self._tags)}"
        self.channel.basic_consume(
            queue=name, consumer_tag=tag, callback=self._arrived, on_cancel=self._cancelled_by_broker, nowait=True
        )
        self._out[name][tag] = time.monotonic()
        self._queue_of[tag] = name

    def _cancel(self, tag: str) -> None:
        self._queue_of.pop(tag, None)
        self._settle_watch.gone(tag)
        self.channel.basic_cancel(tag, nowait=True)
        # nowait: py-amqp drops the callback only on cancel-ok. A delivery still in flight for it
        # then finds no callback, and py-amqp gives it back (basic_reject with requeue).
        self.channel.callbacks.pop(tag, None)
        self.channel.cancel_callbacks.pop(tag, None)

    def _consumers(self, name: str) -> int:
        """``name``'s live consumers: each either waits to be pushed or has its one message in hand."""
        return len(self._out[name]) + len(self._hand[name])

    def _top_up(self, name: str, target: int) -> None:
        """Consumers out for ``name`` until ``target`` messages are in hand or coming (one at least)."""
        for _ in range(max(target, 1) - self._consumers(name)):
            self._consume(name)

    def _settles_late(self, raw: AmqpMessage) -> bool:
        """Celery leaves it unacked long after it starts (ETA, ``acks_late``, rate limit): its consumer is stuck."""
        headers = raw.properties.get("application_headers") or {}
        if headers.get("eta"):
            return True
        task = self._tasks.get(headers.get("task"))
        if task is None:
            return False  # Celery settles an unknown task at once (dead letters)
        return bool(task.acks_late or (task.rate_limit and not self.app.conf.worker_disable_rate_limits))

    def _give_back(self, name: str) -> None:
        """Every consumer of ``name`` cancelled, then its hand back to the queue (a reject makes no room then)."""
        self._unquiet(name)
        out, self._out[name] = self._out[name], {}
        hand, self._hand[name] = self._hand[name], deque()
        for tag in [*out, *(tag for _, _, tag in hand)]:
            self._cancel(tag)
        self._count_held(name, -len(hand))
        for raw, _, _ in hand:
            self.channel.basic_reject(raw.delivery_tag, requeue=True)

    def _drop(self, name: str) -> None:
        self._give_back(name)
        self.pushed.discard(name)
        self._parked.discard(name)
        self._idle_reports.busy(name)
        del self._out[name], self._hand[name]

    def _arrived(self, raw: AmqpMessage) -> None:
        """A delivery (from inside ``drain_events``): into the hand; the fetch loop pumps on its next turn."""
        tag = raw.delivery_info.get("consumer_tag")
        name = self._queue_of.get(tag)
        if name is None or self._out[name].pop(tag, None) is None:  # not a live consumer's: cannot happen
            self.channel.basic_reject(raw.delivery_tag, requeue=True)
            return
        now = time.monotonic()
        self._hand[name].append((raw, now, tag))
        self._settle_watch.gone(tag)
        if now >= self._give_back_at:  # no look for messages held too long armed: due ``prio_hold_max`` from now
            self._arm_look(now, self.hold_max)
        tier = self.served.tier_of(name)
        self._unquiet(name, tier)
        self._count_held(name, 1, tier)
        self.on_delivery(tier)

    def _unquiet(self, name: str, tier: Tier | None = None) -> None:
        """``name`` (of ``tier``, when the caller knows it) changed (delivery, consumer started or given back):
        the kept empty answer falls if it asked ``name``'s tier, only then (a batch drain's pushes leave the
        realtime slot's answer standing)."""
        quiet = self._quiet
        if quiet is not None and (self.served.tier_of(name) if tier is None else tier) in quiet[0]:
            self._quiet = None

    def _cancelled_by_broker(self, tag: str) -> None:
        """RabbitMQ cancelled a consumer (its queue was deleted)."""
        self._quiet = None
        name = self._queue_of.pop(tag, None)
        if name is not None and name in self.pushed:
            # Consuming a queue that is gone would close the channel: ask it with basic_get from now on.
            logger.warning("celery-prio: RabbitMQ cancelled a consumer of %s; fetching it by basic_get", name)
            self._drop(name)
            self._declared.discard(name)  # not pushed again unless declared again
            self.on_arrival()  # an idle loop waits on pushes: look again

    # -- fetching ----------------------------------------------------------------
    def take(self, order: list[Tier]) -> Take:
        """The first message in asking order: a pushed queue's from the hand, any other queue's by ``basic_get``."""
        if self.follower.version != self._absorbed or self._presence_for != self.served.version:
            self._follow_registry()  # (each asked here, not called: twice per task a busy worker runs)
        if self.channel is not self._on_channel or self._synced != self.served.version:
            self._keep_consumers()
        quiet, asking = self._quiet, tuple(order)
        if quiet is not None and quiet[0] == asking and quiet[1] == self.served.version:
            # Nothing came and no consumer changed for these tiers since that take found nothing: the same
            # answer, no look (the realtime slot's ask once per drained task; the pending window never reopens).
            self._deferred, self._all_pushed = False, True  # as that take left them (another take may not have)
            now = time.monotonic()
            if now < self._quiet_due:  # none of its queues is due to be reported empty again yet, nor its tiers
                return quiet[3]
            kept = quiet[2]
            due = self._idle_reports.due(kept.empty_queues, self.pushed, now)
            self._quiet_due = self._idle_reports.next_due(kept.empty_queues, now)
            return Take(empty=kept.empty, empty_queues=due)
        # An answer kept for another ask stands: what this take changes goes through ``_unquiet``.
        now = time.monotonic()
        self._deferred = False
        all_pushed = True  # every queue looked at is pushed: an idle loop waits for the next delivery
        plan: list[tuple[Tier, str]] = []  # queues to basic_get, in asking order, before the first one in hand
        pending: set[str] = set()  # pushed queues whose next message may be on its way (asked only if needed)
        idle: list[tuple[Tier, str]] = []  # pushed queues with nothing in hand nor on its way: empty
        coming: set[Tier] = set()  # tiers with a message perhaps on its way: not known to be empty
        held: tuple[Tier, str] | None = None
        for tier in order:
            # Pushed queues with nothing in hand, parked or on its way are empty: neither ordered nor looked at
            # again (500 idle tenants are not sorted on every take); the others are ordered as the tier shares.
            active, empty = self._split(tier, now)
            if empty:
                idle.extend([(tier, name) for name in empty])
            for name in self.served.asking_order(tier, active) if active else ():
                if name not in self.pushed:
                    all_pushed = False
                    if not self._skip(name, now):
                        plan.append((tier, name))
                elif self._hand[name]:
                    held = (tier, name)
                    break
                elif name in self._parked and pending:
                    # A queue before it may have its next message on the way: that one takes the slot, so this
                    # queue's messages are not called back yet (each would be held, then given back again).
                    # Not known to be empty either; the loop polls until the push comes or the wait runs out.
                    self._deferred = True
                    coming.add(tier)
                elif name in self._parked or self._on_its_way(name, now):
                    if name in self._parked:  # a slot asks for this tier again: its messages come pushed
                        self._parked.discard(name)
                        self._top_up(name, self._hold_target(tier))
                    plan.append((tier, name))
                    pending.add(name)
                    coming.add(tier)
                else:
                    idle.append((tier, name))
            if held is not None:
                break
        if held is None:
            # Nothing lower in hand would take the slot meanwhile: wait for the push instead of asking.
            plan = [(tier, name) for tier, name in plan if name not in pending]
        found, asked = self._first_found(plan, now) if plan else (None, [])  # (no plan: every queue pushed)
        for _, name in plan if pending else ():
            if name in pending and self._empty_at.get(name) == now:  # asked now and found empty
                self._settle_watch.found_empty(self._out[name])
        if found is None and plan:
            # py-amqp reads deliveries while it waits for a get's answer: a pushed queue asked because its next
            # message was on its way may have it in hand now, and it comes before whatever was held.
            arrived = self._first_in_hand(plan)
            if arrived is None and held is not None and any(t is Tier.REALTIME and n in pending for t, n in plan):
                # RabbitMQ can answer the get empty while its push to us waits in the channel's mailbox (and a lower
                # tier would take the slot): a later method's answer comes after the push (docs/internals.md).
                self.channel.basic_qos(0, 1, False)
                self.broker_calls += 1
                arrived = self._first_in_hand(plan)
            if arrived is not None:
                held = arrived
        # A pushed queue whose next message may be on its way is not known to be empty: not reported as looked
        # at (shortest-first would otherwise reset its wait, and a long task pushed late would wait for good).
        if pending:
            asked = [tq for tq in asked if tq[1] not in pending]
        if found is None and held is not None:
            tier, name = held
            raw, _, tag = self._hand[name].popleft()
            self._count_held(name, -1, tier)
            target = self._hold_target(tier) - 1  # this message takes one of those slots
            if self._settles_late(raw) or self._consumers(name) + 1 > max(target, 1):  # + 1: the taken one's
                self._cancel(tag)  # stuck on this message for long, or more consumers out than slots to fill
            else:
                self._out[name][tag] = now  # pushed its next message once Celery acks this one
                self._settle_watch.kept(tag, raw.delivery_tag)
            self._top_up(name, target)
            found = (tier, name, raw)
        if found is not None:
            self._idle_reports.busy(found[1])  # busy again: reported at once when it next finds nothing
        looked = idle  # each list is in asking order already: merged by tier only when both have queues
        if asked:
            looked = sorted(asked + idle, key=lambda tq: order.index(tq[0])) if idle else asked
        take = self._take_found(found, looked)
        if coming:
            take.empty = tuple(t for t in take.empty if t not in coming)
        full_report = take.empty_queues
        take.empty_queues = self._idle_reports.due(full_report, self.pushed, now)
        self._all_pushed = all_pushed and held is None
        if found is None and held is None and all_pushed and not plan and not pending and not self._deferred:
            self._quiet = (asking, self.served.version, replace(take, empty_queues=full_report), Take())
            self._quiet_due = now  # its next ask reports what is due then, and works out when the next is
        return take

    def _first_in_hand(self, plan: list[tuple[Tier, str]]) -> tuple[Tier, str] | None:
        return next(((t, n) for t, n in plan if n in self.pushed and self._hand[n]), None)

    def _split(self, tier: Tier, now: float) -> tuple[set[str], list[str]]:
        """``tier``'s queues that may have a message (not pushed, in hand, parked, on its way), and the rest."""
        lane = self.served.promoted.get(tier)
        names = [lane, *self.served.by_tier[tier]] if lane else self.served.by_tier[tier]
        pushed, hand, parked, out = self.pushed, self._hand, self._parked, self._out
        on_its_way, window = self._settle_watch.on_its_way, self._pending_window
        active: set[str] = set()
        empty: list[str] = []
        for name in names:
            if name not in pushed or hand[name] or name in parked or (out[name] and on_its_way(out[name], now, window)):
                active.add(name)
            else:
                empty.append(name)
        return active, empty

    def _hold_target(self, tier: Tier) -> int:
        """Messages one of ``tier``'s queues may have in hand or coming.

        Batch and offline: as many as the worker started of that tier in half of ``prio_hold_max``, at its
        pace of the last second (its free slots at least, Celery's prefetch ``concurrency x
        worker_prefetch_multiplier`` at most): each is then expected to start within half of ``prio_hold_max``,
        well before it would be given back. A drain of short tasks keeps messages ready for the slots as they
        free, with no consumer cancelled and started again per task; a tier that gets few of the slots' turns
        (offline beside batch, a loaded host) or runs long tasks holds no more than the free slots. Realtime:
        its free slots only, so that a request waits in no worker's hand while another worker has a slot free.
        """
        if tier is Tier.REALTIME:
            return self.free_slots()
        expected = self.starts_within(self.hold_max * HOLD_SHARE, tier)
        return min(max(expected, self.free_slots()), self.slots * self._prefetch_multiplier)

    def wait_for_work(self, order: list[Tier]) -> bool:
        """Every queue of ``order`` pushed: the next delivery wakes the loop (no poll; the take that found nothing
        looked at them all, and its answer is kept). Otherwise (past ``PUSH_MAX``, or one unknown to exist) it polls."""
        return not self._deferred and self._all_pushed

    # -- housekeeping ------------------------------------------------------------
    def housekeeping(self, dispatched: Callable[[], Mapping[Tier, int]]) -> list[Job]:
        # The look is armed by the deliveries themselves (``_arrived``): an idle worker's loop is not woken
        # every ``prio_hold_max / 2`` for an empty hand. This slow round only re-arms a look that was lost.
        return [*super().housekeeping(dispatched), Job(HAND_BACKSTOP, self._look_at_hand, "give back held messages")]

    def _arm_look(self, now: float, delay: float) -> None:
        """The look at the hand, ``delay`` from ``now``, replacing any armed before: a look re-arms itself while
        the hand holds anything and the backstop re-arms too, so without the cancel looks would chain."""
        if self._hub is None:
            return
        if self._look_timer is not None:
            self._hub.timer.cancel(self._look_timer)
        self._give_back_at = now + delay
        self._look_timer = self._hub.call_later(delay, self._look_at_hand)

    def _look_at_hand(self) -> None:
        """Give back what was held too long; then, while anything is in hand, look again when the oldest is due.
        (Run by its timer or by the backstop's round: whichever runs, the other armed look is cancelled.)"""
        if self._look_timer is not None and self._hub is not None:
            self._hub.timer.cancel(self._look_timer)  # this one, already running (a no-op), or the one armed
        self._give_back_at, self._look_timer = float("-inf"), None
        self.give_back_stale()
        oldest = min((hand[0][1] for hand in self._hand.values() if hand), default=None)
        if oldest is not None:
            now = time.monotonic()
            self._arm_look(now, max(oldest + self.hold_max - now, GIVE_BACK_MIN_WAIT))

    def give_back_stale(self) -> None:
        """Held past ``prio_hold_max``: back to the queue, where another worker can run it."""
        now = time.monotonic()
        for name, hand in self._hand.items():
            if hand and now - hand[0][1] > self.hold_max:
                self._give_back(name)
                self._parked.add(name)

    def stop(self) -> None:
        """Consumers cancelled and the hand given back: a stopping worker holds nothing it will not run."""
        self._cancel_absorb()
        if self._on_channel is not self.channel:
            return
        try:
            for name in list(self.pushed):
                self._drop(name)
        except Exception as exc:  # the channel is gone (connection lost): RabbitMQ requeued the hand itself
            logger.info("celery-prio: consumers not cancelled (%r): the channel is closed", exc)
            self._reset()
        self._synced = -1
