"""A RabbitMQ worker's fetch source: ``basic_get`` per queue, in the scheduler's order."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ...policy.admission import REFUSAL_COUNTERS
from ...policy.served import ServedQueues
from ...settings import PrioSettings
from ...tiers import Tier
from ..base import MAX_ANNOUNCED_TASKS, BoostRecord, BrokerFetchSource, BrokerFigures, Job, Take
from ..soon import PACE_INTERVAL, Soon
from .dead_letters import publish_dead
from .fleet_figures import TICK_INTERVAL, FleetFigures
from .idle import IDLE_CONSUMERS_MAX, IDLE_RECHECK, IdleWait
from .management import listed_subqueues
from .registry import Presence, ProbeChannel, RegistryFollower, existing_depths, serving_counts
from .topology import declare_subqueue, declare_tier_queues, quorum_arguments

if TYPE_CHECKING:
    from amqp import Channel as AmqpChannel
    from amqp.basic_message import Message as AmqpMessage
    from celery import Celery
    from kombu.asynchronous import Hub
    from kombu.message import Message

logger = logging.getLogger(__name__)

#: An empty queue is re-asked after poll_interval / 10 at the soonest: on a
#: busy worker asking it on every fetch would double the round trips.
PROBE_FRACTION = 1 / 10

# Sub-queues the management API lists as empty share a budget of basic_gets per second (its figures
# lag by seconds, so they are still asked): a few idle tenants are asked as often as any queue,
# a thousand cost a worker this many round trips a second, not a thousand per fetch.
IDLE_PROBE_BUDGET = 200.0

#: At most this many ``basic_get`` in one round trip (queues found empty, then one that had work).
PIPELINE_MAX = 8
#: A fleet's record read this recently (by the lease's look) serves the report's refusal counts.
RECORD_READ_WITHIN = 1.0


def _empty_tiers(asked: list[tuple[Tier, str]], before: Tier | None) -> tuple[Tier, ...]:
    """Tiers whose every asked queue was empty, up to (not including) the tier a message came from."""
    out: list[Tier] = []
    for tier, _ in asked:
        if tier is before:
            break
        if tier not in out:
            out.append(tier)
    return tuple(out)


class AmqpFetchSource(BrokerFetchSource):
    """The worker's RabbitMQ side: ``basic_get`` per queue, guarded.

    What cannot be read goes to the dead letters (published with a confirm
    before the original is acked), never into Celery. py-amqp's basic_get
    blocks on a round trip and dispatches other channels' frames
    re-entrantly, so this runs from the worker's loop, never from inside a
    message callback.
    """

    def __init__(self, app: Celery, channel: AmqpChannel, served: ServedQueues, settings: PrioSettings) -> None:
        from kombu.serialization import prepare_accept_content

        super().__init__(served, settings)
        self.app = app
        self.channel = declare_tier_queues(channel, settings)
        self._listed_empty: set[str] = set()
        self._listed: list[str] = []  # sub-queues the management API listed (where it answers)
        self._listing_retry_at = 0.0
        # Sub-queues found through the registry stream (pushed: brokers/amqp/registry.py), declared here
        # on the loop before they are asked; and this worker's presence in the tiers it serves.
        self.follower = RegistryFollower(settings, on_new=lambda names: self._registry_grew())
        self._absorb_timer: Any = None  # serving what the registry pushed, due on the loop's next turn
        self._absorbed = -1  # ``follower.version`` whose names are served
        self._presence_for = -1  # ``served.version`` the presence was matched to (not looked at per fetch)
        self._declared: set[str] = set()
        self.presence = Presence(settings, quorum_arguments(settings, {}) or None)
        self.accept = prepare_accept_content(app.conf.accept_content)
        self._empty_at: dict[str, float] = {}  # queue name -> when a basic_get last found it empty
        self._probe_interval = settings.poll_interval * PROBE_FRACTION
        # A message that rides along behind the one taken goes back with basic_reject, which a quorum
        # queue counts toward its delivery limit: there, every queue is asked on its own.
        self._pipeline_max = 1 if settings.queue_type == "quorum" else PIPELINE_MAX
        # Idle: consumers instead of polling (``idle.py``); not on quorum queues (a give-back counts there).
        quorum = settings.queue_type == "quorum"
        self.idle = None if quorum else IdleWait(lambda: self.on_arrival(), lambda: self.free_slots() > 0)
        self._hub: Any = None
        self._recheck: Any = None  # the idle safety net's timer
        self._probe = ProbeChannel()  # depth reads, kept open
        self._fleet_figures: FleetFigures | None = None  # where a wait budget shares the fleet's figures

    def take(self, order: list[Tier]) -> Take:
        """The first message in asking order: tier by tier, each tier's queues as ``ServedQueues`` orders them.

        Each ``basic_get`` is a round trip, and a busy worker re-asks the
        queues it found empty every few milliseconds (realtime's among
        them). So the queues found empty at their last look are asked in
        the same round trip as the next queue that had work: one round trip
        per fetch while they stay empty. A message that rode along behind
        the one taken goes back to its queue (``basic_reject`` with requeue:
        RabbitMQ puts it back where it was).
        """
        self._follow_registry()
        idle = self.idle
        now = time.monotonic()
        plan: list[tuple[Tier, str]] = []
        known_empty: list[tuple[Tier, str]] = []  # watched by an idle consumer that was pushed nothing
        held: tuple[Tier, str] | None = None  # the first queue in asking order with a message pushed while idle
        for tier in order:
            for c in self.served.candidates(tier):
                if idle is not None and idle.holds(c.name):
                    held = (tier, c.name)
                    break
                if idle is not None and idle.watches(c.name):
                    known_empty.append((tier, c.name))
                elif not self._skip(c.name, now):
                    plan.append((tier, c.name))
            if held is not None:
                break
        found, asked = self._first_found(plan, now)  # what is not watched is still asked, pushed message or not
        if found is None and held is not None:
            self._empty_at.pop(held[1], None)
            found = (*held, idle.take(held[1]))
        if idle is not None:
            idle.give_back()  # whatever else was pushed goes back: nothing is held
            if found is not None and self.free_slots() <= 1:
                self._end_idle()  # this message fills the last free slot: nothing may be pushed to a busy worker
        rank = {tier: i for i, tier in enumerate(order)}
        looked = sorted(asked + known_empty, key=lambda tq: rank[tq[0]])  # stable: asking order inside a tier
        if found is not None:  # the empty ones before it in asking order
            looked = [tq for tq in looked if rank[tq[0]] <= rank[found[0]]]
        return self._take_found(found, looked)

    def take_more(self, queue: str, tier: Tier, count: int, task: str, max_bytes: int = 0) -> list[Message]:
        """Up to ``count`` more messages of ``task`` from ``queue`` (a batch): ``basic_get`` pipelined, one
        round trip per window. One of another task (nothing routes one there, but anyone can publish), or one
        beyond ``max_bytes`` in hand, goes back with whatever rode along behind it."""
        out: list[Message] = []
        window, stop, taken_bytes = min(count, self._pipeline_max), False, 0
        while len(out) < count and not stop:
            for raw in self.get_many([queue] * min(window, count - len(out))):
                if raw is None:
                    stop = True
                elif (
                    stop
                    or (max_bytes and taken_bytes >= max_bytes)
                    or (raw.properties.get("application_headers") or {}).get("task") != task
                ):
                    stop = True  # it and whatever rode along behind it go back, in order
                    self.channel.basic_reject(raw.delivery_tag, requeue=True)
                elif (message := self._to_python(raw, queue)) is not None:
                    out.append(message)
                    taken_bytes += len(raw.body or b"")
        return out

    def attach_loop(self, hub: Hub) -> None:
        self._hub = hub

    def wait_for_work(self, order: list[Tier]) -> bool:
        """Idle: a consumer on each of ``order``'s queues (``idle.py``); RabbitMQ pushes the next arrival."""
        if self.idle is None or self._hub is None:
            return False
        queues = self._queues_of(order)
        self.idle.start(self.channel, queues[:IDLE_CONSUMERS_MAX])
        if len(queues) > IDLE_CONSUMERS_MAX and self._recheck is None:  # the rest are asked now and then
            self._recheck = self._hub.call_later(IDLE_RECHECK, self._recheck_idle)
        return True

    def _queues_of(self, order: list[Tier]) -> list[str]:
        return [c.name for tier in order for c in self.served.candidates(tier)]

    def _recheck_idle(self) -> None:
        self._recheck = None
        self.on_arrival()

    def _end_idle(self) -> None:
        if self._recheck is not None:
            self._hub.timer.cancel(self._recheck)
            self._recheck = None
        if self.idle is not None:
            self.idle.end()

    def stop(self) -> None:
        self._cancel_absorb()
        self._end_idle()
        if self.idle is not None:
            self.idle.stop()

    @property
    def held(self) -> int:
        """Messages pushed while idle and not yet taken (normally none: the next fetch takes or returns them)."""
        return 0 if self.idle is None else self.idle.held

    def _first_found(
        self, plan: list[tuple[Tier, str]], now: float
    ) -> tuple[tuple[Tier, str, AmqpMessage] | None, list[tuple[Tier, str]]]:
        """The first message in ``plan``'s order (tier, queue, raw message) and the queues found empty before it."""
        asked: list[tuple[Tier, str]] = []  # found empty, in asking order, before anything was found
        start = 0
        while start < len(plan):
            end = start + 1
            while end < len(plan) and end - start < self._pipeline_max and plan[end - 1][1] in self._empty_at:
                end += 1
            window = plan[start:end]
            start = end
            found: tuple[Tier, str, AmqpMessage] | None = None
            for (tier, name), raw in zip(window, self.get_many([name for _, name in window]), strict=True):
                if raw is None:
                    self._empty_at[name] = now
                    if found is None:
                        asked.append((tier, name))
                elif found is None:
                    found = (tier, name, raw)
                    self._empty_at.pop(name, None)
                else:
                    self.channel.basic_reject(raw.delivery_tag, requeue=True)
            if found is not None:
                return found, asked
        return None, asked

    def _take_found(self, found: tuple[Tier, str, AmqpMessage] | None, asked: list[tuple[Tier, str]]) -> Take:
        empty_queues = tuple([n for _, n in asked])
        if found is None:
            return Take(empty=_empty_tiers(asked, before=None), empty_queues=empty_queues)
        tier, name, raw = found
        empty = _empty_tiers(asked, before=tier)
        message = self._to_python(raw, name)
        if message is None:
            return Take(dead_lettered=1, empty=empty, empty_queues=empty_queues)
        self._listed_empty.discard(name)
        return Take(tier, message, empty, 0, name, empty_queues)

    def _skip(self, queue: str, now: float) -> bool:
        """Found empty just now, or (a sub-queue) listed empty by the management API and asked lately."""
        since = now - self._empty_at.get(queue, float("-inf"))
        if queue in self._listed_empty:
            return since < max(self._probe_interval, len(self._listed_empty) / IDLE_PROBE_BUDGET)
        return since < self._probe_interval

    #: Seconds between looks at what the registry's follower and the management API (where it answers) found.
    discovery_interval = 1.0
    #: After the management API did not answer, it is asked again only after this many seconds: it is optional.
    LISTING_RETRY = 60.0
    #: Seconds between listings where it answers (a listing is costly for RabbitMQ; the registry already
    #: pushes every new sub-queue, and idle workers ask no queue at all).
    LISTING_INTERVAL = 30.0

    def prepare_subqueues(self, names: list[str]) -> None:
        for name in names:
            tier = self.settings.tier_for_queue(name)
            if tier is not None:
                self.channel = declare_subqueue(self.channel, self.settings, tier, name)
                self._declared.add(name)

    def _follow_registry(self) -> None:
        """Serve the sub-queues the registry pushed since the last fetch (declared first: a basic_get of a
        missing queue would close the channel), and keep this worker's presence in step with its tiers."""
        if self.follower.version != self._absorbed:
            self._absorbed = self.follower.version
            self.prepare_subqueues([n for n in self.follower.names if n not in self._declared])
            # Added to what is served, never replacing it: the registry only grows (a queue another path
            # found, such as a listing, stays served).
            names = list(dict.fromkeys([*self.served.discovered, *self.follower.names, *self._listed]))
            if names != self.served.discovered:
                self.served.set_discovered(names)
        if self._presence_for != self.served.version:
            if self.presence.tiers != set(self.served.tiers):
                self.presence.keep(self.channel.connection, self.served.tiers)
            self._presence_for = self.served.version

    def _registry_grew(self) -> None:
        """A sub-queue was announced (inside the frame dispatch: no broker call here). Served from the loop's next
        turn, not at the next fetch, which a worker with every slot busy does not make: a sliced run in a slot,
        which lists its tier's queues again when the served queues change, never saw a new queue's realtime call."""
        if self._hub is not None and self._absorb_timer is None:
            self._absorb_timer = self._hub.call_later(0, self._absorb_registry)  # a due timer: this turn
        self.on_arrival()

    def _absorb_registry(self) -> None:
        self._absorb_timer = None
        self._follow_registry()

    def _cancel_absorb(self) -> None:
        """A stopped source serves nothing more (its channel may be gone with the connection)."""
        if self._absorb_timer is not None:
            self._hub.timer.cancel(self._absorb_timer)
            self._absorb_timer = None

    def discover_subqueues(self) -> list[str] | None:
        """The registry's sub-queues, and those the management API lists where it answers.

        The registry is enough; the listing adds two things when it is
        there: sub-queues published to before this release's registry
        existed, and which of them are empty (those share
        ``IDLE_PROBE_BUDGET`` basic_gets a second between them).
        """
        if self.follower.channel is None:
            self._restart_follower()
        self.discovery_problem = self.follower.problem
        now = time.monotonic()
        if now >= self._listing_retry_at:
            listing = listed_subqueues(self.app, self.settings)
            if listing is None:
                self._listing_retry_at = now + self.LISTING_RETRY
                self._listed_empty = set()
            else:
                self._listing_retry_at = now + self.LISTING_INTERVAL
                self._listed_empty = {name for name, ready in listing if ready == 0}
                fresh = [name for name, _ in listing if name not in self._declared]
                self._declared.update(fresh)  # listed: it exists
                self._listed = [name for name, _ in listing]
        self._absorbed = -1  # serve what both found now
        self._follow_registry()
        return self.served.discovered

    def _restart_follower(self) -> None:
        connection = self.channel.connection
        # Read before the call: a connection the broker closes (RabbitMQ 3.10 can answer INTERNAL_ERROR to
        # streams declared by many workers at once) leaves the channel without it.
        errors = connection.connection_errors
        try:
            self.follower.start(connection)
        except errors:
            raise  # the consumer reconnects and starts again
        except Exception:
            logger.exception("celery-prio: %s", self.follower.problem)

    def housekeeping(self, dispatched: Callable[[], Mapping[Tier, int]]) -> list[Job]:
        if all(budget is None for budget in self.settings.max_wait.values()):
            return []
        figures = self._fleet_figures = FleetFigures(self.settings, self.served, lambda: self.slots)

        def look() -> None:
            figures.tick(self.channel.connection)

        soon = Soon(look, TICK_INTERVAL, "share admission figures")
        soon.hub, figures.nudge, self.served.on_run = self._hub, soon.nudge, figures.ran
        return [Job(PACE_INTERVAL, look, "share admission figures")]

    def broker_figures(self, now: float, idle: bool = False) -> BrokerFigures:
        """With the refusals the publishers counted, from the fleet's record (where a wait budget keeps one)."""
        figures = super().broker_figures(now, idle)
        if self._fleet_figures is not None:  # on the channel the figures are shared on (an error reply closes it)
            record = self._fleet_figures.fleet_record(self.channel.connection, within=RECORD_READ_WITHIN)
            if record is not None:
                figures.counters, figures.kept = record.counters, REFUSAL_COUNTERS
        return figures

    def fleet_serving(self) -> dict[Tier, int] | None:
        return serving_counts(self.channel.connection, self.settings)

    def announce_tasks(self, names: list[str]) -> None:
        from .registry import announce_tasks

        channel = self.channel.connection.channel()  # a channel of its own: a confirm on the fetch channel would
        try:  # put it in confirm mode
            announce_tasks(channel, self.settings, names[:MAX_ANNOUNCED_TASKS])
        finally:
            channel.close()

    def fleet_knows_task(self, name: str) -> bool:
        return name in self.follower.tasks

    def join_fleet(self) -> list[BoostRecord]:
        from .boost import join_fleet, read_journal_joining

        # Sub-queues from the registry (pushed from now on) and this worker's tiers, before the first fetch.
        self._restart_follower()
        self.presence.keep(self.channel.connection, self.served.tiers)

        # On the worker's own connection: counted while it is up (and its control queue with it).
        # A worker that cannot join still runs (fetching matters more), but boosts may then miss it.
        errors = self.channel.connection.connection_errors
        try:
            join_fleet(self.channel.connection.channel(), self.settings)
        except errors:
            raise  # the consumer reconnects and starts again
        except Exception:
            logger.exception("celery-prio: could not join %s: a boost may run a task twice", "the boost fleet")
            return []
        return read_journal_joining(self.app, self.settings)

    def get_many(self, queues: list[str]) -> list[AmqpMessage | None]:
        """One ``basic_get`` per queue, all sent before the first answer is read: one round trip.

        py-amqp answers ``basic_get`` synchronously; its frames are sent here
        and the answers (``get-ok`` or ``get-empty``, in the order asked)
        read back one by one with py-amqp's own decoding.
        """
        from amqp import spec

        self.broker_calls += len(queues)
        channel = self.channel
        if len(queues) == 1:
            return [channel.basic_get(queue=queues[0], no_ack=False)]
        for queue in queues:
            channel.send_method(spec.Basic.Get, "Bsb", (0, queue, False))
        out: list[AmqpMessage | None] = []
        for _ in queues:
            reply = channel.wait([spec.Basic.GetOk, spec.Basic.GetEmpty], returns_tuple=True)
            out.append(channel._on_get_ok(*reply) if reply and len(reply) >= 2 else None)
        return out

    def _to_python(self, raw: AmqpMessage, queue: str) -> Message | None:
        """kombu's message for ``raw``; one kombu cannot read goes to the dead letters (None)."""
        try:
            message = self.channel.message_to_python(raw)
        except Exception as exc:
            reason = f"malformed: kombu cannot read it ({exc!r})"
            publish_dead(self.channel, self.settings, raw.body, raw.properties, reason, queue, None)
            self.channel.basic_ack(raw.delivery_tag)
            return None
        message.accept = self.accept
        message.prio_queue = queue
        return message

    def queue_depths(self, names: list[str]) -> list[int]:
        # On a probe channel: a queue deleted since it was found closes that channel, not the fetch channel.
        return existing_depths(self.channel.connection, names, self._probe)

    def dead_letter(self, message: Message, reason: str, tier: Tier) -> None:
        queue = getattr(message, "prio_queue", "")
        publish_dead(self.channel, self.settings, message.body, message.properties, reason, queue, tier)
