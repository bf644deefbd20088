"""What ``install()`` and the publish path need of RabbitMQ: queue arguments, confirms, refusals,
sub-queues announced on the registry stream, continuations, boost and bulk sessions."""

from __future__ import annotations

import functools
import logging
import threading
from typing import TYPE_CHECKING, Any

from kombu import Queue

from ...errors import ConfigError, QueueFull
from ...settings import PrioSettings
from ...tiers import TIERS, Tier
from ..publishing import BulkSession, Publisher

if TYPE_CHECKING:
    from celery import Celery
    from kombu import Connection

    from .admission import AmqpAdmission
    from .boost import AmqpBooster, RecentPublishes
    from .continuations import AmqpContinuations

logger = logging.getLogger(__name__)


class AmqpPublisher(Publisher):
    kind = "amqp"

    def __init__(self, app: Celery) -> None:
        super().__init__(app)
        self._declared = threading.Event()
        self._refusal_lock = threading.Lock()
        self._refusal_adapter: Any = None  # one AMQP connection for the figures of refusals (see ``refusal``)

    def introduce_subqueue(self, tier: Tier, name: str) -> None:
        # Declared with the tier's aging and the sub-queue's cap, then appended to the registry stream
        # that every worker follows (brokers/amqp/registry.py): no management API needed.
        from .registry import announce
        from .topology import declare_subqueue

        settings = self.settings
        self.before_send()
        with self.app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=3)
            channel = declare_subqueue(conn.channel(), settings, tier, name)
            announce(channel, settings, name)

    @functools.cached_property
    def continuations(self) -> AmqpContinuations:
        from .continuations import AmqpContinuations

        return AmqpContinuations(self)

    boost_not_found = (
        "not among the tasks this process published lately: on RabbitMQ a task is boosted from the process "
        "that published it (prio_boost_memory), or it runs without task_track_started"
    )

    @functools.cached_property
    def booster(self) -> AmqpBooster:
        from .boost import AmqpBooster

        return AmqpBooster(self, self.continuations.waiting, self.recent_publishes)

    @functools.cached_property
    def recent_publishes(self) -> RecentPublishes:
        """This app's recent batch/offline messages published by this process: what a boost here republishes."""
        from .boost import RecentPublishes

        return RecentPublishes()

    def remember_publishes(self) -> None:
        from celery import signals

        recent = self.recent_publishes
        recent.watch(self.settings)
        uid = f"prio.recent.{id(self)}"  # one receiver per app's publisher (signals dispatch by uid)
        signals.before_task_publish.connect(recent.before_publish, weak=False, dispatch_uid=uid)
        signals.after_task_publish.connect(recent.after_publish, weak=False, dispatch_uid=uid)

    def bind(self, settings: PrioSettings) -> None:
        super().bind(settings)
        if "recent_publishes" in self.__dict__:
            self.recent_publishes.watch(settings)

    def check(self) -> None:
        settings = self.settings
        tier = Tier.BATCH  # the only tier that both receives promotions and can age
        if settings.overflow[tier] == "drop_oldest" and settings.aging[tier] is not None:
            raise ConfigError(
                f"prio_overflow[{tier.label}]='drop_oldest' with prio_aging[{tier.label}]="
                f"{settings.aging[tier]!r} is not supported on RabbitMQ: a message promoted into "
                f"{tier.label} could not be told apart from an evicted one. Use 'reject', or "
                f"prio_aging[{tier.label}]=None"
            )

    def queues(self) -> list[Queue]:
        from .topology import tier_queue  # carries the capacity and aging queue arguments

        return [tier_queue(self.settings, tier) for tier in TIERS]

    def configure(self, options: dict[str, object]) -> None:
        settings = self.settings
        if any(settings.max_length[t] is not None and settings.overflow[t] == "reject" for t in TIERS):
            # A full reject-publish queue only tells a publisher that uses confirms
            # (one broker round trip per publish: the price of never losing one).
            options["confirm_publish"] = True
        if settings.queue_type == "quorum":
            # Replicated queues are chosen so that nothing accepted is lost: a publish is accepted when
            # a majority of the queue's nodes have it, which only a confirm tells.
            options["confirm_publish"] = True

    def before_send(self) -> None:
        if not self._declared.is_set():
            from .topology import declare_tier_queues

            with self.app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=3)
                declare_tier_queues(conn.channel(), self.settings)
            self._declared.set()

    def new_bulk_session(self, connection: Connection, tier: Tier, queue: str | None) -> BulkSession:
        from .bulk import AmqpBulkSession

        self.before_send()
        return AmqpBulkSession(self.app, connection, self.settings, tier, queue, self.refusal_figures)

    @functools.cached_property
    def admission(self) -> AmqpAdmission:
        from .admission import AmqpAdmission

        return AmqpAdmission(self.app)

    def admit(self, tier: Tier, queue: str) -> None:
        if self.settings.max_wait[tier] is not None:
            self.admission.admit(self.settings, tier, queue)

    def refusal(self, tier: Tier, queue: str | None, exc: BaseException) -> QueueFull | None:
        from amqp.exceptions import MessageNacked

        seen = set()
        while exc is not None and id(exc) not in seen:
            if isinstance(exc, MessageNacked):
                self.admission.count_rejected(self.settings, tier)
                depth, rate = self.refusal_figures(tier, queue)
                return QueueFull.from_drain_rate(tier, depth, rate)
            seen.add(id(exc))
            exc = exc.__cause__ or exc.__context__
        return None

    def refusal_figures(self, tier: Tier, queue: str | None = None) -> tuple[int | None, float]:
        """Depth (of ``queue``: the tier's own or the sub-queue refused) and drain rate of a tier, for ``QueueFull``.

        One adapter (one AMQP connection) is kept per app for this, and one management client per endpoint:
        a burst of refusals opens nothing new.
        """
        from .admin import AmqpAdapter, tier_drain_rate

        settings = self.settings
        name = queue or settings.queue_name(tier)
        with self._refusal_lock:
            try:
                if self._refusal_adapter is None:
                    self._refusal_adapter = AmqpAdapter(self.app)
                depth: int | None = self._refusal_adapter.depth(name)
            except Exception as exc:  # the refusal itself must still reach the caller
                logger.warning("celery-prio: could not read the depth of %s: %r", name, exc)
                self._refusal_adapter = None
                depth = None
        return depth, tier_drain_rate(self.app, settings, tier)
