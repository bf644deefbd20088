"""What ``install()`` and the publish path need of RabbitMQ: queue arguments, confirms, refusals,
sub-queues announced on the registry stream, continuations, boost and bulk sessions."""

from __future__ import annotations

import functools
import threading
from typing import Any

from kombu import Queue

from ...errors import ConfigError, QueueFull
from ...settings import PrioSettings
from ...tiers import TIERS, Tier
from ..base import BulkSession, Publisher


class AmqpPublisher(Publisher):
    kind = "amqp"

    def __init__(self) -> None:
        super().__init__()
        self._declared = threading.Event()

    def introduce_subqueue(self, app: Any, settings: PrioSettings, tier: Tier, name: str) -> None:
        # Declared with the tier's aging and the sub-queue's cap, then appended to the registry stream
        # that every worker follows (brokers/amqp_registry.py): no management API needed.
        from .registry import announce
        from .topology import declare_subqueue

        self.before_send(app, settings)
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=3)
            channel = declare_subqueue(conn.channel(), settings, tier, name)
            announce(channel, settings, name)

    @functools.cached_property
    def continuations(self) -> Any:
        from .continuations import AmqpContinuations

        return AmqpContinuations()

    boost_not_found = (
        "not among the tasks this process published lately: on RabbitMQ a task is boosted from the process "
        "that published it (prio_boost_memory), or it runs without task_track_started"
    )

    @functools.cached_property
    def booster(self) -> Any:
        from .boost import AmqpBooster

        return AmqpBooster(self.continuations.waiting)

    def remember_publishes(self, settings: PrioSettings) -> None:
        """Keep this process's recent batch/offline messages: what a boost here republishes."""
        from celery import signals

        from .boost import recent_publishes

        recent_publishes.watch(settings)
        signals.before_task_publish.connect(recent_publishes.before_publish, weak=False, dispatch_uid="prio.recent")
        signals.after_task_publish.connect(recent_publishes.after_publish, weak=False, dispatch_uid="prio.recent")

    def check(self, settings: PrioSettings) -> None:
        tier = Tier.BATCH  # the only tier that both receives promotions and can age
        if settings.overflow[tier] == "drop_oldest" and settings.aging[tier] is not None:
            raise ConfigError(
                f"prio_overflow[{tier.label}]='drop_oldest' with prio_aging[{tier.label}]="
                f"{settings.aging[tier]!r} is not supported on RabbitMQ: a message promoted into "
                f"{tier.label} could not be told apart from an evicted one. Use 'reject', or "
                f"prio_aging[{tier.label}]=None"
            )

    def queues(self, settings: PrioSettings) -> list[Queue]:
        from .topology import tier_queue  # carries the capacity and aging queue arguments

        return [tier_queue(settings, tier) for tier in TIERS]

    def configure(self, app: Any, settings: PrioSettings, options: dict[str, Any]) -> None:
        if any(settings.max_length[t] is not None and settings.overflow[t] == "reject" for t in TIERS):
            # A full reject-publish queue only tells a publisher that uses confirms
            # (one broker round trip per publish: the price of never losing one).
            options["confirm_publish"] = True
        if settings.queue_type == "quorum":
            # Replicated queues are chosen so that nothing accepted is lost: a publish is accepted when
            # a majority of the queue's nodes have it, which only a confirm tells.
            options["confirm_publish"] = True

    def before_send(self, app: Any, settings: PrioSettings) -> None:
        if not self._declared.is_set():
            from .topology import declare_tier_queues

            with app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=3)
                declare_tier_queues(conn.channel(), settings)
            self._declared.set()

    def new_bulk_session(
        self, app: Any, connection: Any, settings: PrioSettings, tier: Tier, queue: str | None
    ) -> BulkSession:
        from .bulk import AmqpBulkSession

        self.before_send(app, settings)
        return AmqpBulkSession(app, connection, settings, tier, queue)

    def refusal(
        self, app: Any, settings: PrioSettings, tier: Tier, queue: str | None, exc: BaseException
    ) -> QueueFull | None:
        from amqp.exceptions import MessageNacked

        from .admin import refusal_figures

        seen = set()
        while exc is not None and id(exc) not in seen:
            if isinstance(exc, MessageNacked):
                depth, rate = refusal_figures(app, settings, tier, queue)
                return QueueFull.from_drain_rate(tier, depth, rate)
            seen.add(id(exc))
            exc = exc.__cause__ or exc.__context__
        return None
