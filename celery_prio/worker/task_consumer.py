"""The object that stands where Celery keeps ``consumer.task_consumer``: a façade that only wires.

It quacks like a ``kombu.Consumer`` (``queues``, ``add_queue``,
``cancel_by_queue``, ``consuming_from``, ``consume``, ``cancel``, ``close``),
so ``inspect active_queues``, ``add_consumer``/``cancel_consumer``, warm
shutdown and Flower keep working, and it connects Celery's task handler to
the worker's runtime (``worker_runtime.py``): the fetch loop, the intake of
messages, the fleet watch, the report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from celery.worker.consumer import Consumer
from kombu import Exchange, Queue

from ..brokers import Job
from ..policy.superseded import Superseded
from ..settings import PrioSettings
from .foreign_work import LEGACY_CHECK_INTERVAL, LegacyQueues
from .report import WorkerReport
from .worker_runtime import WorkerRuntime

if TYPE_CHECKING:
    from kombu.message import Message


class TierFetcher:
    """``consumer.task_consumer`` for celery-prio: kombu's Consumer interface over the worker's runtime."""

    def __init__(
        self, consumer: Consumer, settings: PrioSettings, superseded: Superseded, reconnected: bool = False
    ) -> None:
        self.c = consumer
        self.settings = settings
        self.runtime = WorkerRuntime(consumer, settings, superseded)
        self.reconnected = reconnected  # this process fetched on a connection before, which died
        self.consumed: list[Queue] = []  # the queues -Q (or add_consumer) named; sub-queues are served beside them
        self.legacy = LegacyQueues(self)
        for queue in consumer.app.amqp.queues.consume_from.values():
            self.add_queue(queue)

    # -- kombu.Consumer look-alike ------------------------------------------
    @property
    def on_message(self) -> Callable[[Message], None] | None:
        return self.runtime.intake.handler

    @on_message.setter
    def on_message(self, handler: Callable[[Message], None] | None) -> None:  # set by Celery's loop to its task handler
        self.runtime.intake.handler = handler
        self.runtime.loop.deliver = None if handler is None else self.runtime.intake.deliver

    @property
    def channel(self) -> object:
        """The channel the worker fetches and acks on (the source may replace it after a failed declare)."""
        return self.runtime.source.channel

    @property
    def active(self) -> bool:
        return self.runtime.loop.active

    @property
    def queues(self) -> list[Queue]:
        """What ``inspect active_queues`` (and so Flower's broker page) lists: the queues consumed, then the
        sub-queues served beside them that have been published to (realtime's per-task shortest-first queues,
        tenants', batched tasks'), so that every queue where a tier's work waits shows with its depth."""
        served = self.runtime.served
        consumed = {q.name for q in self.consumed}
        discovered = set(served.discovered)
        subqueues = [n for n in served.all_names() if n in discovered and n not in consumed]
        return self.consumed + [Queue(n, Exchange(""), routing_key=n, no_declare=True) for n in subqueues]

    def add_queue(self, queue: Queue) -> Queue:
        if not self.consuming_from(queue.name):
            queue = queue.bind(self.channel)
            queue.declare()
            self.consumed.append(queue)
            self.runtime.serve(q.name for q in self.consumed)
        return queue

    def consuming_from(self, queue: Queue | str) -> bool:
        name = getattr(queue, "name", queue)
        return any(q.name == name for q in self.consumed)

    def cancel_by_queue(self, queue: str) -> None:
        self.consumed = [q for q in self.consumed if q.name != queue]
        self.legacy.forget(queue)
        self.runtime.serve(q.name for q in self.consumed)

    def consume(self, no_ack: bool | None = None) -> None:
        if self.runtime.loop.active:
            return
        drain = Job(LEGACY_CHECK_INTERVAL, self.legacy.drain, "drain the queues of producers without celery-prio")
        self.runtime.start(self.reconnected, [drain])
        self.legacy.drain()

    def cancel(self) -> None:
        self.runtime.stop()

    def close(self) -> None:
        # The channel closes with the connection; closing it here would make
        # the Redis transport restore messages whose acks_late tasks are
        # still finishing during a warm shutdown.
        self.cancel()

    def qos(self, prefetch_count: int = 0, **_: object) -> None:
        """Prefetch does not apply: basic_get ignores basic.qos; the scheduler limits fetches."""

    # -- what PrioConsumer calls (per task, it calls ``runtime.track`` and ``runtime.slot_freed`` itself) ------
    def dead_letter(self, message: Message, reason: str) -> None:
        """Copy ``message`` to ``<prefix>.dead`` with ``reason``; the caller settles the original."""
        self.runtime.intake.dead_letter(message, reason)

    # -- reporting -----------------------------------------------------------
    def report(self, on_loop: bool = False) -> WorkerReport:
        """No broker call unless ``on_loop`` (the caller runs on the worker's loop): safe from the metrics thread."""
        return self.runtime.report(on_loop)

    def info(self) -> dict[str, object]:
        """For ``inspect prio_stats`` (run on the worker's loop: the broker's figures read now if stale)."""
        return self.report(on_loop=True).as_dict()


__all__ = ["TierFetcher"]
