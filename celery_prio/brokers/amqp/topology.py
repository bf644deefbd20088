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
(see ``quorum_arguments``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from amqp.exceptions import PreconditionFailed
from kombu import Exchange, Queue

from ...headers import PROMOTED_SUFFIX
from ...settings import PrioSettings
from ...tiers import TIERS, Tier

if TYPE_CHECKING:
    from amqp import Channel as AmqpChannel

logger = logging.getLogger(__name__)

OVERFLOW_ARG = {"reject": "reject-publish", "drop_oldest": "drop-head"}


#: RabbitMQ queue arguments (``x-max-length``, ``x-overflow``, ``x-message-ttl``, ``x-queue-type`` ...).
QueueArguments = dict[str, str | int]


def dead_letter_exchange(settings: PrioSettings, tier: Tier) -> str:
    return f"{settings.queue_name(tier)}.dlx"


def queue_arguments(settings: PrioSettings, tier: Tier, subqueue: bool = False) -> QueueArguments | None:
    """Capacity and aging as RabbitMQ queue arguments.

    A tier that drops or ages dead-letters into its own headers exchange,
    which routes on ``x-first-death-reason``: ``maxlen`` (capacity) to the
    dead-letter queue, ``expired`` (aging TTL) to the tier above. Keeping the
    two apart is why this is not a plain fanout DLX (needs RabbitMQ >= 3.10
    for ``x-match: all-with-x``).
    """
    args: QueueArguments = {}
    dlx = dead_letter_exchange(settings, tier)
    cap = settings.subqueue_cap(tier) if subqueue else settings.max_length[tier]
    if cap is not None:
        args["x-max-length"] = cap
        args["x-overflow"] = OVERFLOW_ARG[settings.overflow[tier]]
    ttl = aging_ttl(settings, tier)
    if ttl is not None:
        args["x-message-ttl"] = ttl
    if "x-message-ttl" in args or args.get("x-overflow") == "drop-head":
        args["x-dead-letter-exchange"] = dlx
    return quorum_arguments(settings, args, dlx) or None


def quorum_arguments(settings: PrioSettings, args: QueueArguments, dlx: str | None = None) -> QueueArguments:
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
    cap = args.get("x-max-length")
    if args.get("x-overflow") == "reject-publish" and isinstance(cap, int):
        args["x-max-length"] = cap - 1
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


def _declare_or_use_as_is(channel: AmqpChannel, name: str, args: QueueArguments | None, asked_by: str) -> AmqpChannel:
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


def declare_tier_queues(channel: AmqpChannel, settings: PrioSettings, tiers: Iterable[Tier] = TIERS) -> AmqpChannel:
    """Declare tier queues, the dead-letter queue and the routes between them.

    A queue declared earlier with other arguments cannot be redeclared
    (RabbitMQ answers PRECONDITION_FAILED and closes the channel). Instead of
    crashing, log what differs and how to fix it, and use the queue as it is.
    Returns the channel to go on with (a new one if that happened).
    """
    dead = settings.dead_letter_queue
    # The cap drops the oldest dead letters (RabbitMQ's default overflow, drop-head).
    capped: QueueArguments = {} if settings.dead_letter_max is None else {"x-max-length": settings.dead_letter_max}
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


def declare_subqueue(channel: AmqpChannel, settings: PrioSettings, tier: Tier, name: str) -> AmqpChannel:
    """A sub-queue: its tier's aging and dead-lettering, its own cap (``prio_subqueue_max_length``).

    Returns the channel to go on with (see ``_declare_as_is``)."""
    return _declare_as_is(channel, name, queue_arguments(settings, tier, subqueue=True))


def _declare_front_lane(channel: AmqpChannel, settings: PrioSettings, tier: Tier) -> AmqpChannel:
    """``<tier>.promoted``: uncapped (what enters it was admitted already); ages on like its tier."""
    ttl, dlx = aging_ttl(settings, tier), dead_letter_exchange(settings, tier)
    args = quorum_arguments(settings, {"x-message-ttl": ttl, "x-dead-letter-exchange": dlx} if ttl else {}, dlx)
    return _declare_as_is(channel, promoted_queue(settings, tier), args or None)


def _declare_as_is(channel: AmqpChannel, name: str, args: QueueArguments | None) -> AmqpChannel:
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
