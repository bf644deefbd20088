"""Work that reaches a worker from outside its own app's tiers, during adoption.

* **The old default queue.** Producers not yet on celery-prio (a rolling
  deploy) keep publishing to the app's old ``task_default_queue``
  (``celery`` unless set). :class:`LegacyQueues` serves each such queue
  (``prio_legacy_queues``) as the default tier while it holds messages,
  on workers that serve that tier's queue.
* **Another app's task.** Apps sharing a broker share the tier queues. A
  worker that fetches a task it has not registered, but that some worker of
  the fleet has (the broker's task directory, ``BrokerFetchSource.announce_tasks``),
  moves it to that task's own queue in its tier (:func:`forward_unregistered`),
  which only workers that registered the task serve
  (``ServedQueues.set_registered``), instead of dead-lettering it. A name no
  worker ever registered is bad input: dead-lettered, as always.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from celery.utils.log import get_logger
from kombu import Exchange, Queue

from ..brokers.base import BrokerFetchSource
from ..policy.served import ServedQueues
from ..runtime import runtime_of
from ..settings import PrioSettings
from .fetchloop import FetchLoop

logger = get_logger(__name__)

#: Seconds between looks at the queues producers without celery-prio publish to (``prio_legacy_queues``).
LEGACY_CHECK_INTERVAL = 5.0


class Runtime(Protocol):
    """What this module needs of ``worker_runtime.WorkerRuntime``."""

    app: Any  # the Celery app
    settings: PrioSettings
    source: BrokerFetchSource
    served: ServedQueues
    loop: FetchLoop


class TierFetcher(Protocol):
    """What this module needs of ``task_consumer.TierFetcher``."""

    consumed: list[Queue]
    runtime: Runtime

    def consuming_from(self, queue: Any) -> bool: ...
    def add_queue(self, queue: Queue) -> Queue: ...
    def cancel_by_queue(self, queue: str) -> None: ...


class LegacyQueues:
    def __init__(self, fetcher: TierFetcher) -> None:
        self.fetcher = fetcher
        self.draining: set[str] = set()  # legacy queues this worker added to what it consumes

    def forget(self, queue: str) -> None:
        """``queue`` is no longer consumed (``cancel_consumer``, or drained)."""
        self.draining.discard(queue)

    def drain(self) -> None:
        """Serve the legacy queues that hold messages; stop asking one once it is found empty. Not those that
        ``-Q``/``add_consumer`` named (the operator's choice stands), and only on a worker that serves the
        default tier's queue."""
        fetcher = self.fetcher
        settings, source = fetcher.runtime.settings, fetcher.runtime.source
        runtime = runtime_of(fetcher.runtime.app)
        named = {q.name for q in fetcher.consumed} - self.draining
        names = [n for n in (runtime.legacy_queues if runtime else ()) if n not in named]
        if not names or not fetcher.consuming_from(settings.queue_name(settings.default_tier)):
            return
        for name, depth in zip(names, source.queue_depths(names), strict=True):
            if depth > 0 and name not in self.draining:
                logger.warning(
                    "celery-prio: %d message(s) wait in %s, where producers without celery-prio publish: "
                    "draining it as %s while it has messages (prio_legacy_queues)",
                    depth,
                    name,
                    settings.default_tier.label,
                )
                self.draining.add(name)
                fetcher.add_queue(Queue(name, Exchange(name, type="direct"), routing_key=name))
            elif depth == 0 and name in self.draining:
                fetcher.cancel_by_queue(name)


def announce_tasks(source: BrokerFetchSource, tasks: Iterable[str]) -> None:
    """The fleet's task directory learns what this worker can run (another app's worker then moves such a task
    to its own queue instead of dead-lettering it)."""
    try:
        source.announce_tasks(sorted(tasks))
    except Exception:  # never fatal: without it, such tasks are dead-lettered as before
        logger.warning("celery-prio: could not record this worker's tasks in the broker", exc_info=True)


def forward_unregistered(worker: Runtime, message: Any) -> str | None:
    """Re-publish a task the ``worker`` has not registered to its task's own queue in its tier
    (``<tier>.sjf-<task>``), then ack it here. The queue's name, or None where it cannot go there (already
    in its own queue, no task name, the broker refused): the caller dead-letters it, as before."""
    headers = message.headers or {}
    name = headers.get("task")
    queue = getattr(message, "prio_queue", None) or (message.delivery_info or {}).get("routing_key") or ""
    app, settings = worker.app, worker.settings
    runtime = runtime_of(app)
    if not isinstance(name, str) or not name or runtime is None or not worker.source.fleet_knows_task(name):
        return None  # a name no worker of the fleet ever registered: bad input, dead-lettered as always
    tier = worker.loop.fetching or worker.served.tier_of(queue)
    own = settings.sjf_subqueue(name)
    if settings.subqueue_of(queue, tier) == own:
        return None
    try:
        target = runtime.publishing.subqueue(tier, own)
        with app.producer_or_acquire() as producer:  # confirmed on RabbitMQ, the capped push on Redis
            producer.publish(
                message.body,
                exchange=target.exchange,
                routing_key=target.routing_key,
                headers=dict(headers),  # the enqueue stamp too: its wait goes on counting
                content_type=message.content_type,
                content_encoding=message.content_encoding,
                correlation_id=message.properties.get("correlation_id"),
                reply_to=message.properties.get("reply_to"),
                retry=True,
            )
    except Exception:
        logger.exception("celery-prio: could not move unregistered task %s to its own queue", name)
        return None
    message.ack()  # after the copy is on the broker: a crash in between leaves two copies, never none
    logger.warning(
        "celery-prio: task %r is not registered on this worker; moved from %s to %s, which workers that "
        "registered it serve (apps sharing a broker, or a rolling deploy)",
        name,
        queue,
        target.name,
    )
    return target.name


__all__ = ["LEGACY_CHECK_INTERVAL", "LegacyQueues", "announce_tasks", "forward_unregistered"]
