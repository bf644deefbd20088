"""RabbitMQ (AMQP 0-9-1 through py-amqp).

Capacity and aging are RabbitMQ's own: ``x-max-length`` with ``x-overflow``
``reject-publish`` (the publisher, which uses confirms, gets a nack that
becomes ``QueueFull``) or ``drop-head`` (the oldest is dead-lettered into the
``<prefix>.dead`` queue, RabbitMQ's ``x-death`` header giving reason, queue
and time); ``x-message-ttl`` = the aging threshold, the expired message
dead-lettered into the tier above. See ``queue_arguments``.

``prio_queue_type = "quorum"`` declares the same queues as quorum queues
(replicated over the cluster, RabbitMQ >= 3.10 for message TTL): the same
arguments, with ``at-least-once`` dead-lettering wherever RabbitMQ allows it
(see ``quorum_arguments``).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

import amqp
from amqp.exceptions import NotFound, PreconditionFailed
from kombu import Exchange, Queue

from ..errors import QueueFull
from ..headers import DEAD_AT, DEAD_QUEUE, DEAD_REASON, DEAD_TIER, PROMOTED_SUFFIX
from ..policy.served import ServedQueues
from ..settings import PrioSettings
from ..tiers import TIERS, Tier
from ..untrusted import death_records
from .amqp_management import management_client
from .amqp_registry import Presence, RegistryFollower, existing_depths, read_registry, serving_counts
from .base import Broker, FetchSource, Take
from .publishing import BulkSession, fast_json

logger = logging.getLogger(__name__)

OVERFLOW_ARG = {"reject": "reject-publish", "drop_oldest": "drop-head"}
#: Logged once a worker counts for boosts (before its first fetch); tests wait for it.
FLEET_JOINED = "joined the fleet"


def dead_letter_exchange(settings: PrioSettings, tier: Tier) -> str:
    return f"{settings.queue_name(tier)}.dlx"


def queue_arguments(settings: PrioSettings, tier: Tier, subqueue: bool = False) -> dict[str, Any] | None:
    """Capacity and aging as RabbitMQ queue arguments.

    A tier that drops or ages dead-letters into its own headers exchange,
    which routes on ``x-first-death-reason``: ``maxlen`` (capacity) to the
    dead-letter queue, ``expired`` (aging TTL) to the tier above. Keeping the
    two apart is why this is not a plain fanout DLX (needs RabbitMQ >= 3.10
    for ``x-match: all-with-x``).
    """
    args: dict[str, Any] = {}
    dlx = dead_letter_exchange(settings, tier)
    cap = settings.subqueue_cap(tier) if subqueue else settings.max_length[tier]
    if cap is not None:
        args["x-max-length"] = cap
        args["x-overflow"] = OVERFLOW_ARG[settings.overflow[tier]]
    if aging_ttl(settings, tier) is not None:
        args["x-message-ttl"] = aging_ttl(settings, tier)
    if "x-message-ttl" in args or args.get("x-overflow") == "drop-head":
        args["x-dead-letter-exchange"] = dlx
    return quorum_arguments(settings, args, dlx) or None


def quorum_arguments(settings: PrioSettings, args: dict[str, Any], dlx: str | None = None) -> dict[str, Any]:
    """``args`` for the queue type ``prio_queue_type`` names (classic: as they are).

    A quorum queue always dead-letters into ``dlx`` (its tier's exchange):
    a message redelivered past the queue's delivery limit then reaches the
    dead letters instead of vanishing.

    A quorum queue dead-letters (aging, ``drop_oldest``) ``at-least-once``
    where RabbitMQ can: the message stays in its queue until the queue it
    moves to has confirmed it, so a promotion survives a node loss (RabbitMQ
    needs ``reject-publish`` overflow for that, set on uncapped queues too,
    where it changes nothing). A ``drop_oldest`` queue stays ``at-most-once``
    (RabbitMQ's only choice with ``drop-head``): an eviction or promotion
    whose destination cannot take it at that moment (its leader being
    elected, say) is dropped. Use ``reject`` there for at-least-once.

    RabbitMQ's quorum queues refuse a publish only once they are *over*
    ``x-max-length`` (measured on 3.10: a limit of N holds N + 1 when each
    publish waits for its confirm), so a ``reject`` cap of N is declared as
    N - 1, and the queue then holds exactly N.
    """
    if settings.queue_type != "quorum":
        return args
    args = {"x-queue-type": "quorum", **args}
    if dlx is not None:
        args.setdefault("x-dead-letter-exchange", dlx)
    if args.get("x-overflow") == "reject-publish":
        args["x-max-length"] -= 1
    if "x-dead-letter-exchange" in args:
        if args.get("x-overflow") == "drop-head":
            args["x-dead-letter-strategy"] = "at-most-once"
        else:
            args["x-overflow"] = "reject-publish"
            args["x-dead-letter-strategy"] = "at-least-once"
    return args


def promoted_queue(settings: PrioSettings, tier: Tier) -> str:
    """Where RabbitMQ delivers messages promoted *into* ``tier``.

    Dead-lettering appends at the tail; in the tier's own queue a promoted
    message would wait behind the whole backlog it already outwaited. Workers
    serving ``tier`` take from this sub-queue first.
    """
    return settings.queue_name(tier) + PROMOTED_SUFFIX


def aging_ttl(settings: PrioSettings, tier: Tier) -> int | None:
    seconds = settings.aging[tier]
    return None if seconds is None or tier is Tier.REALTIME else max(1, int(seconds * 1000))


def tier_queue(settings: PrioSettings, tier: Tier) -> Queue:
    name = settings.queue_name(tier)
    # no_declare: kombu would redeclare with these arguments on every new
    # connection and fail with PRECONDITION_FAILED after a cap change;
    # declare_tier_queues() does it once and handles that case.
    return Queue(
        name,
        Exchange(name, type="direct"),
        routing_key=name,
        queue_arguments=queue_arguments(settings, tier),
        no_declare=True,
    )


def _declare_or_use_as_is(channel: Any, name: str, args: dict[str, Any], asked_by: str) -> Any:
    """Declare a durable queue; one that exists with other arguments is used as it is (logged with the fix).
    Returns the channel to go on with (RabbitMQ closes the one a failed declare was on)."""
    try:
        channel.queue_declare(queue=name, durable=True, auto_delete=False, arguments=args)
    except PreconditionFailed as exc:
        logger.error(
            "celery-prio: queue %s exists with other arguments than %s ask for (%s): %s. Using the queue as "
            "it is. To apply the new settings (a queue's type can never change), drain and delete the queue, "
            "or set a RabbitMQ policy (rabbitmqctl set_policy ... '{\"max-length\": N}').",
            name,
            asked_by,
            args,
            exc.reply_text,
        )
        channel = channel.connection.channel()
        channel.queue_declare(queue=name, passive=True)
    return channel


def declare_tier_queues(channel: Any, settings: PrioSettings, tiers=TIERS) -> Any:
    """Declare tier queues, the dead-letter queue and the routes between them.

    A queue declared earlier with other arguments cannot be redeclared
    (RabbitMQ answers PRECONDITION_FAILED and closes the channel). Instead of
    crashing, log what differs and how to fix it, and use the queue as it is.
    Returns the channel to go on with (a new one if that happened).
    """
    dead = settings.dead_letter_queue
    # The cap drops the oldest dead letters (RabbitMQ's default overflow, drop-head).
    capped = {} if settings.dead_letter_max is None else {"x-max-length": settings.dead_letter_max}
    channel = _declare_or_use_as_is(channel, dead, quorum_arguments(settings, capped), "prio_dead_letter_max")
    for tier in TIERS:  # every tier queue: aging routes into the one above
        name = settings.queue_name(tier)
        channel.exchange_declare(exchange=name, type="direct", durable=True, auto_delete=False)
        channel = _declare_or_use_as_is(
            channel, name, queue_arguments(settings, tier), "prio_max_length/prio_overflow/prio_aging/prio_queue_type"
        )
        channel.queue_bind(queue=name, exchange=name, routing_key=name)
    for tier in settings.front_lanes():
        channel = _declare_front_lane(channel, settings, tier)
    for tier in TIERS:
        dlx = dead_letter_exchange(settings, tier)
        channel.exchange_declare(exchange=dlx, type="headers", durable=True, auto_delete=False)
        # maxlen: evicted by drop_oldest. delivery_limit: a quorum queue gave up on a message redelivered
        # too often (RabbitMQ 4 sets a limit of 20 by default); dead letters, not dropped unrouted.
        for reason in ("maxlen", "delivery_limit"):
            channel.queue_bind(
                queue=dead,
                exchange=dlx,
                routing_key="",
                arguments={"x-match": "all-with-x", "x-first-death-reason": reason},
            )
        if aging_ttl(settings, tier) is not None:
            channel.queue_bind(
                queue=promoted_queue(settings, tier.promoted()),
                exchange=dlx,
                routing_key="",
                arguments={"x-match": "all-with-x", "x-first-death-reason": "expired"},
            )
    return channel


def declare_subqueue(channel: Any, settings: PrioSettings, tier: Tier, name: str) -> Any:
    """A sub-queue: its tier's aging and dead-lettering, its own cap (``prio_subqueue_max_length``).

    Returns the channel to go on with (see ``_declare_as_is``)."""
    return _declare_as_is(channel, name, queue_arguments(settings, tier, subqueue=True))


def _declare_front_lane(channel: Any, settings: PrioSettings, tier: Tier) -> Any:
    """``<tier>.promoted``: uncapped (what enters it was admitted already); ages on like its tier."""
    ttl, dlx = aging_ttl(settings, tier), dead_letter_exchange(settings, tier)
    args = quorum_arguments(settings, {"x-message-ttl": ttl, "x-dead-letter-exchange": dlx} if ttl else {}, dlx)
    return _declare_as_is(channel, promoted_queue(settings, tier), args or None)


def _declare_as_is(channel: Any, name: str, args: dict[str, Any] | None) -> Any:
    """Declare ``name``; one that exists with other arguments is logged and used as it is.

    RabbitMQ closes the channel on PRECONDITION_FAILED: the channel to go on
    with is returned (a new one then).
    """
    try:
        channel.queue_declare(queue=name, durable=True, auto_delete=False, arguments=args)
    except PreconditionFailed as exc:
        logger.error(
            "celery-prio: %s exists with other arguments (%s): %s; using it as it is", name, args, exc.reply_text
        )
        channel = channel.connection.channel()
    return channel


class AmqpAdapter(Broker):
    kind = "amqp"

    def __init__(self, app: Any) -> None:
        super().__init__(app)
        self.connection = app.connection_for_write()
        self.connection.ensure_connection(max_retries=3)

    def _channel(self):
        return self.connection.default_channel

    def depth(self, queue: str) -> int:
        try:
            return int(self._channel().queue_declare(queue=queue, passive=True).message_count)
        except NotFound:
            self.connection.close()  # a failed passive declare closes the channel
            self.connection = self.app.connection_for_write()
            return 0

    def subqueues(self, settings: PrioSettings) -> list[str]:
        """The registry's sub-queues, and those the management API lists where it answers."""
        listed = [name for name, _ in listed_subqueues(self.app, settings) or []]
        return list(dict.fromkeys([*read_registry(self.connection.connection, settings), *listed]))

    def serving(self, settings: PrioSettings) -> dict[Tier, int]:
        return serving_counts(self.connection.connection, settings)

    def depths(self, queues: list[str]) -> list[int]:
        return existing_depths(self.connection.connection, queues)

    def delete_queues(self, queues: list[str]) -> None:
        channel = self._channel()
        for name in queues:
            channel.queue_delete(queue=name)
            channel.exchange_delete(exchange=name)

    # -- dead letters -------------------------------------------------------
    def dead_list(self, settings: PrioSettings, limit: int = 100) -> list[dict[str, Any]]:
        """Browse without consuming: fetch, describe, then give them all back."""
        channel = self.connection.channel()
        try:
            out = []
            for _ in range(limit):
                message = channel.basic_get(queue=settings.dead_letter_queue, no_ack=False)
                if message is None:
                    break
                out.append(describe_dead(message.properties.get("application_headers")))
            return out
        finally:
            channel.close()  # unacked messages go back to the queue, in order

    def dead_requeue(self, settings: PrioSettings, limit: int | None = None) -> tuple[int, int, int]:
        """Publish dead messages back to their queue (with confirms), then ack them: ``(moved, left, skipped)``.

        Only this app's queues are destinations: tier queues, front lanes and
        the tiers' sub-queues (shortest-first queues, tenants; declared first,
        with their tier's arguments); an entry naming anything else, or none, is skipped and
        stays in the dead-letter queue (held until the end of the pass, so it
        is not fetched again, then given back in order).
        """
        allowed = {settings.queue_name(t) for t in TIERS} | {settings.queue_name(t) + PROMOTED_SUFFIX for t in TIERS}
        moved = skipped = 0
        with self.app.connection_for_write() as conn:
            channel = conn.channel()
            before = channel.queue_declare(queue=settings.dead_letter_queue, passive=True).message_count
            for _ in range(before):
                if limit is not None and moved >= limit:
                    break
                raw = channel.basic_get(queue=settings.dead_letter_queue, no_ack=False)
                if raw is None:
                    break
                headers = raw.properties.get("application_headers")
                origin = dead_origin(headers)
                if origin not in allowed and not settings.is_subqueue(origin):
                    skipped += 1  # held unacked: back in the queue when the channel closes
                    continue
                tier = settings.tier_for_queue(origin)
                cap = settings.max_length[tier] if tier is not None and origin == settings.queue_name(tier) else None
                if settings.is_subqueue(origin):
                    cap = settings.subqueue_cap(tier)
                    # Through the default exchange a missing queue would drop it: make sure it is there
                    # (on a channel of its own: a failed declare closes its channel, not this one).
                    probe = declare_subqueue(conn.channel(), settings, tier, origin)
                    if probe.is_open:
                        probe.close()
                # A drop-head tier never refuses: publishing into a full one
                # would just evict another message into this queue. Stop at full.
                if cap is not None and channel.queue_declare(queue=origin, passive=True).message_count >= cap:
                    break
                # A fresh start in its tier: without the old death headers the
                # tier's dead-letter routes judge its next death, not its last.
                fresh = {k: v for k, v in (headers or {}).items() if not _death_annotation(k)}
                raw.properties["application_headers"] = fresh
                try:
                    channel.basic_publish_confirm(raw, exchange="", routing_key=origin)
                except Exception:  # nacked: the tier is full again
                    break
                channel.basic_ack(raw.delivery_tag)
                moved += 1
            channel.close()  # whatever is still unacked (skipped, or the one refused) goes back, in order
        return moved, before - moved, skipped

    def dead_purge(self, settings: PrioSettings) -> int:
        return int(self._channel().queue_purge(queue=settings.dead_letter_queue) or 0)

    def drain_rate(self, settings: PrioSettings, tier: Tier) -> float:
        """Messages/s leaving the tier queue, from the management API (0 if unknown)."""
        return tier_drain_rate(self.app, settings, tier)

    def close(self) -> None:
        self.connection.release()


_refusal_lock = threading.Lock()


def refusal_figures(app: Any, settings: PrioSettings, tier: Tier, queue: str | None = None) -> tuple[int | None, float]:
    """Depth (of ``queue``: the tier's own or the sub-queue refused) and drain rate of a tier, for ``QueueFull``.

    One adapter (one AMQP connection) is kept per app for this, and one
    management client per endpoint: a burst of refusals opens nothing new.
    """
    with _refusal_lock:
        adapter = app.__dict__.get("_celery_prio_refusal_adapter")
        try:
            if adapter is None:
                adapter = app._celery_prio_refusal_adapter = AmqpAdapter(app)
            depth: int | None = adapter.depth(queue or settings.queue_name(tier))
        except Exception as exc:  # the refusal itself must still reach the caller
            logger.warning("celery-prio: could not read the depth of %s: %r", queue or settings.queue_name(tier), exc)
            app._celery_prio_refusal_adapter = None
            depth = None
    return depth, tier_drain_rate(app, settings, tier)


def tier_drain_rate(app: Any, settings: PrioSettings, tier: Tier) -> float:
    return management_client(app, settings).drain_rate(settings.queue_name(tier))


def _death_annotation(key: Any) -> bool:
    return isinstance(key, str) and (key == "x-death" or key.startswith(("x-first-death", "prio_dead_")))


def dead_origin(headers: Any) -> str | None:
    """The queue a dead letter came from: our own annotation first, else RabbitMQ's ``x-death``."""
    if not isinstance(headers, dict):
        return None
    origin = headers.get(DEAD_QUEUE)
    if origin is None:
        deaths = death_records(headers)
        origin = deaths[0].get("queue") if deaths else None
    return origin if isinstance(origin, str) else None


def describe_dead(headers: Any) -> dict[str, Any]:
    """One dead letter as ``dead list`` shows it; never raises on odd headers."""
    if not isinstance(headers, dict):
        headers = {}
    deaths = death_records(headers)
    death = deaths[0] if deaths else {}
    reason = headers.get(DEAD_REASON) or death.get("reason")
    when = headers.get(DEAD_AT) or death.get("time")
    when = when.timestamp() if hasattr(when, "timestamp") else when
    text = lambda v: v if isinstance(v, str) else None  # noqa: E731
    return {
        "id": text(headers.get("id")),
        "task": text(headers.get("task")),
        "reason": "drop_oldest" if reason == "maxlen" else text(reason) or "unknown",
        "queue": dead_origin(headers),
        "at": when if isinstance(when, (int, float)) and not isinstance(when, bool) else None,
    }


#: An empty queue is re-asked after poll_interval / 10 at the soonest: on a
#: busy worker asking it on every fetch would double the round trips.
PROBE_FRACTION = 1 / 10
# Sub-queues the management API lists as empty share a budget of basic_gets per second (its figures
# lag by seconds, so they are still asked): a few idle tenants are asked as often as any queue,
# a thousand cost a worker this many round trips a second, not a thousand per fetch.
IDLE_PROBE_BUDGET = 200.0


def subqueue_pattern(settings: PrioSettings) -> str:
    """Regex of this app's sub-queue names (``<prefix>.<tier>.<name>``, not the front lanes)."""
    tiers = "|".join(re.escape(settings.queue_name(t)) for t in TIERS)
    return rf"^({tiers})\.(?!promoted$)[A-Za-z0-9][A-Za-z0-9_-]{{0,63}}$"


def listed_subqueues(app: Any, settings: PrioSettings) -> list[tuple[str, int | None]] | None:
    """This app's sub-queues and their ready counts from the management API; None when it cannot list."""
    return management_client(app, settings).list_queues(subqueue_pattern(settings))


#: At most this many ``basic_get`` in one round trip (queues found empty, then one that had work).
PIPELINE_MAX = 8


def _empty_tiers(asked: list[tuple[Tier, str]], before: Tier | None) -> tuple[Tier, ...]:
    """Tiers whose every asked queue was empty, up to (not including) the tier a message came from."""
    out: list[Tier] = []
    for tier, _ in asked:
        if tier is before:
            break
        if tier not in out:
            out.append(tier)
    return tuple(out)


class AmqpFetchSource(FetchSource):
    """The worker's RabbitMQ side: ``basic_get`` per queue, guarded.

    What cannot be read goes to the dead letters (published with a confirm
    before the original is acked), never into Celery. py-amqp's basic_get
    blocks on a round trip and dispatches other channels' frames
    re-entrantly, so this runs from the worker's loop, never from inside a
    message callback.
    """

    def __init__(self, app: Any, channel: Any, served: ServedQueues, settings: PrioSettings) -> None:
        from kombu.serialization import prepare_accept_content

        super().__init__(served, settings)
        self.app = app
        self.channel = declare_tier_queues(channel, settings)
        self._listed_empty: set[str] = set()
        self._listed: list[str] = []  # sub-queues the management API listed (where it answers)
        self._listing_retry_at = 0.0
        # Sub-queues found through the registry stream (pushed: brokers/amqp_registry.py), declared here
        # on the loop before they are asked; and this worker's presence in the tiers it serves.
        self.follower = RegistryFollower(settings, on_new=lambda names: self.on_arrival())
        self._absorbed = -1  # ``follower.version`` whose names are served
        self._declared: set[str] = set()
        self.presence = Presence(settings, quorum_arguments(settings, {}) or None)
        self.accept = prepare_accept_content(app.conf.accept_content)
        self._empty_at: dict[str, float] = {}  # queue name -> when a basic_get last found it empty
        self._probe_interval = settings.poll_interval * PROBE_FRACTION
        # A message that rides along behind the one taken goes back with basic_reject, which a quorum
        # queue counts toward its delivery limit: there, every queue is asked on its own.
        self._pipeline_max = 1 if settings.queue_type == "quorum" else PIPELINE_MAX

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
        now = time.monotonic()
        plan: list[tuple[Tier, str]] = []
        for tier in order:
            plan.extend((tier, c.name) for c in self.served.candidates(tier) if not self._skip(c.name, now))
        found, asked = self._first_found(plan, now)
        return self._take_found(found, asked)

    def _first_found(
        self, plan: list[tuple[Tier, str]], now: float
    ) -> tuple[tuple[Tier, str, Any] | None, list[tuple[Tier, str]]]:
        """The first message in ``plan``'s order (tier, queue, raw message) and the queues found empty before it."""
        asked: list[tuple[Tier, str]] = []  # found empty, in asking order, before anything was found
        start = 0
        while start < len(plan):
            end = start + 1
            while end < len(plan) and end - start < self._pipeline_max and plan[end - 1][1] in self._empty_at:
                end += 1
            window = plan[start:end]
            start = end
            found: tuple[Tier, str, Any] | None = None
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

    def _take_found(self, found: tuple[Tier, str, Any] | None, asked: list[tuple[Tier, str]]) -> Take:
        empty_queues = tuple(n for _, n in asked)
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
        if self.presence.tiers != set(self.served.tiers):
            self.presence.keep(self.channel.connection, self.served.tiers)

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
                self._listed_empty = {name for name, ready in listing if ready == 0}
                fresh = [name for name, _ in listing if name not in self._declared]
                self._declared.update(fresh)  # listed: it exists
                self._listed = [name for name, _ in listing]
        self._absorbed = -1  # serve what both found now
        self._follow_registry()
        return self.served.discovered

    def _restart_follower(self) -> None:
        try:
            self.follower.start(self.channel.connection)
        except self.channel.connection.connection_errors:
            raise  # the consumer reconnects and starts again
        except Exception:
            logger.exception("celery-prio: %s", self.follower.problem)

    def fleet_serving(self) -> dict[Tier, int] | None:
        return serving_counts(self.channel.connection, self.settings)

    def join_fleet(self) -> list[list[Any]]:
        from .amqp_boost import join_fleet, journal_key, read_journal

        # Sub-queues from the registry (pushed from now on) and this worker's tiers, before the first fetch.
        self._restart_follower()
        self.presence.keep(self.channel.connection, self.served.tiers)

        # On the worker's own connection: counted while it is up (and its control queue with it).
        # A worker that cannot join still runs (fetching matters more), but boosts may then miss it.
        try:
            join_fleet(self.channel.connection.channel(), self.settings)
        except self.channel.connection.connection_errors:
            raise  # the consumer reconnects and starts again
        except Exception:
            logger.exception("celery-prio: could not join %s: a boost may run a task twice", "the boost fleet")
            return []
        try:
            with self.app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=3)
                records = read_journal(conn.connection, self.settings, journal_key(self.app, self.settings))
        except Exception:
            # Counted in the fleet, so later boosts wait for this worker's answer; earlier ones are unknown here.
            logger.exception("celery-prio: could not read the boost journal: originals of earlier boosts may run")
            records = []
        logger.info("celery-prio: %s: boosts ask this worker; %d earlier boost(s) read", FLEET_JOINED, len(records))
        return records

    def get_many(self, queues: list[str]) -> list[Any]:
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
        out = []
        for _ in queues:
            reply = channel.wait([spec.Basic.GetOk, spec.Basic.GetEmpty], returns_tuple=True)
            out.append(channel._on_get_ok(*reply) if reply and len(reply) >= 2 else None)
        return out

    def _to_python(self, raw: Any, queue: str) -> Any:
        """kombu's message for ``raw``; one kombu cannot read goes to the dead letters (None)."""
        try:
            message = self.channel.message_to_python(raw)
        except Exception as exc:
            self._publish_dead(raw.body, raw.properties, f"malformed: kombu cannot read it ({exc!r})", queue, None)
            self.channel.basic_ack(raw.delivery_tag)
            return None
        message.accept = self.accept
        message.prio_queue = queue
        return message

    def queue_depths(self, names: list[str]) -> list[int]:
        # On a probe channel: a queue deleted since it was found closes that channel, not the fetch channel.
        return existing_depths(self.channel.connection, names)

    def dead_letter(self, message: Any, reason: str, tier: Tier) -> None:
        self._publish_dead(message.body, message.properties, reason, getattr(message, "prio_queue", ""), tier)

    def _publish_dead(self, body: Any, properties: dict, reason: str, queue: str, tier: Tier | None) -> None:
        logger.error("celery-prio: message from %s moved to %s: %s", queue, self.settings.dead_letter_queue, reason)
        props = dict(properties or {})
        headers = props.get("application_headers")
        headers = dict(headers) if isinstance(headers, dict) else {}
        headers.update({DEAD_REASON: reason, DEAD_QUEUE: queue, DEAD_AT: time.time()})
        if tier is not None:
            headers[DEAD_TIER] = tier.label
        props.update(application_headers=headers, delivery_mode=2)
        # Confirmed before the caller settles the original: never lost, at worst copied twice.
        self.channel.basic_publish_confirm(
            amqp.Message(body, **props), exchange="", routing_key=self.settings.dead_letter_queue
        )


class AmqpBulkSession(BulkSession):
    """A chunk's publishes are written in one go (``amqp_wire``) and their confirms collected together.

    One confirm window per chunk instead of one round trip per message. With
    ``reject-publish`` RabbitMQ nacks each message over the cap; the
    session reports exactly which ones.
    """

    CONFIRM_TIMEOUT = 60.0

    def __init__(self, app: Any, connection: Any, settings: PrioSettings, tier: Tier, queue: str | None = None) -> None:
        super().__init__(app, connection, settings, tier, queue)
        # The tier queue through its own exchange (as apply_async); a sub-queue through the default one.
        self.exchange = self.queue if queue is None else ""
        self.connection = connection
        self.channel.confirm_select()
        self._next_tag = 1
        self._pending: set[int] = set()
        self._nacked: set[int] = set()
        self.channel.events["basic_ack"].add(self._on_ack)
        self.channel.events["basic_nack"].add(self._on_nack)
        self._frames: Any = None  # amqp_wire.PublishFrames, from the first message
        self._shared_kwargs: tuple[Any, str] = ({}, "{}")

    def prepare(self, message: Any) -> tuple[bytes, str, dict[str, Any]]:
        """``(body, correlation_id, headers that differ)`` of one call; what the calls share is prepared once."""
        headers = message.headers
        if self._frames is None:
            from .amqp_wire import PublishFrames

            prepared = super().prepare(message)  # kombu's own message, once: its properties and encoding
            properties = dict(prepared.properties)
            properties.pop("application_headers")
            properties.pop("correlation_id", None)
            shared = {k: v for k, v in headers.items() if k not in self.VARIABLE_HEADERS}
            self._frames = PublishFrames(
                self.channel.channel_id,
                self.connection.connection.frame_max,
                self.exchange,
                self.queue,
                properties,
                shared,
            )
            self._shared_kwargs = (message.body[1], fast_json(message.body[1]))
        shared_kwargs, shared_kwargs_json = self._shared_kwargs
        if self.serializer == "json":
            args, kwargs, embed = message.body
            kwargs_json = shared_kwargs_json if kwargs is shared_kwargs else fast_json(kwargs)
            body: Any = f"[{fast_json(args)}, {kwargs_json}, {fast_json(embed)}]"
        else:
            body = super().prepare(message).body
        if isinstance(body, str):
            body = body.encode("utf-8")
        return body, headers["id"], {k: headers[k] for k in self.VARIABLE_HEADERS if k in headers}

    def _settle(self, tag: int, multiple: bool) -> list[int]:
        done = [t for t in self._pending if t <= tag] if multiple else [tag] if tag in self._pending else []
        self._pending.difference_update(done)
        return done

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        self._settle(delivery_tag, multiple)

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        self._nacked.update(self._settle(delivery_tag, multiple))

    def publish(self, messages: list[Any]) -> list[bool]:
        return self.collect(self.send(self.encode(messages)))

    def encode(self, messages: list[Any]) -> tuple[bytearray, list[int]]:
        """The chunk's frames (``amqp_wire``) and where each message's end in them."""
        out, ends = bytearray(), []
        for message in messages:
            body, correlation_id, variable = self.prepare(message)
            self._frames.add(out, body, correlation_id, variable)
            ends.append(len(out))
        return out, ends

    def send(self, encoded: tuple[bytearray, list[int]]) -> tuple[int, int, int]:
        """Write what fits of the chunk in one go; ``(first delivery tag, sent, chunk size)``."""
        out, ends = encoded
        count = self._room(len(ends))
        first = self._next_tag
        if count:
            amqp_connection = self.connection.connection
            amqp_connection.transport.write(memoryview(out)[: ends[count - 1]])
            amqp_connection.bytes_sent += 1  # what py-amqp's heartbeat check counts (writes, not bytes)
        self._next_tag += count
        self._pending.update(range(first, self._next_tag))
        return first, count, len(ends)

    def collect(self, ticket: tuple[int, int, int]) -> list[bool]:
        """Wait for the confirms of a sent chunk: per message, acked (True) or nacked / not sent (False)."""
        first, count, size = ticket
        end = first + count
        deadline = time.monotonic() + self.CONFIRM_TIMEOUT
        while self._pending and min(self._pending) < end:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"RabbitMQ did not confirm {len(self._pending)} publishes to {self.queue}")
            self.connection.drain_events(timeout=left)
        return [tag not in self._nacked for tag in range(first, end)] + [False] * (size - count)

    def _room(self, wanted: int) -> int:
        """How many of a chunk to send: all of it, except into a capped quorum queue.

        A quorum queue enforces its cap only after the fact (see
        ``quorum_arguments``): a chunk in flight together would overshoot it
        by up to the chunk. So the depth is read first and only what fits is
        sent; at the cap, one, for RabbitMQ to decide (another process may
        have drained it since the depth was read).
        """
        if self.settings.queue_type != "quorum" or self.cap is None or self.settings.overflow[self.tier] != "reject":
            return wanted
        depth = self.channel.queue_declare(queue=self.queue, passive=True).message_count
        return min(wanted, max(1, self.cap - depth))

    def queue_full(self, accepted: int) -> QueueFull:
        depth, rate = refusal_figures(self.app, self.settings, self.tier, self.queue)
        return QueueFull.from_drain_rate(self.tier, depth, rate)
