"""Worker side: a Consumer whose task fetch is driven by the tier scheduler.

Celery's default Tasks step subscribes to every queue with ``basic.consume``
and lets the broker push up to ``prefetch`` messages; once those sit in the
worker, priorities are gone (celery #4819, #6500). Here nothing is pushed:
for every free pool slot the scheduler names a tier and one message is
pulled from it (``fetchloop.py``, through the broker's fetch source). The
message then goes through Celery's own strategy/Request/pool path, so acks,
retries, ETA, revokes, rate and time limits behave exactly as before.

This module is only the Celery wiring (the blueprint steps and the Consumer
subclass); ``task_consumer.py`` stands in for kombu's Consumer, the
decisions live in ``scheduler.py`` and ``fetchloop.py``, the broker commands
under ``brokers/``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery import bootsteps
from celery.utils.log import get_logger
from celery.worker.consumer import Consumer
from celery.worker.consumer.control import Control
from celery.worker.consumer.mingle import Mingle
from kombu.common import QoS

from ..celery_hooks import notify_when_jobs_end
from ..policy.routes import check_task_tiers
from ..policy.superseded import Superseded
from ..runtime import runtime_of, settings_for
from ..tiers import Tier
from .foreign_work import forward_unregistered
from .metrics import serve_metrics
from .report import readable_rows
from .task_consumer import TierFetcher

if TYPE_CHECKING:
    from celery.concurrency.base import BasePool
    from celery.worker.request import Request
    from kombu.message import Message

logger = get_logger(__name__)


class PrioTasks(bootsteps.StartStopStep):
    """Replaces ``celery.worker.consumer.tasks:Tasks``: same contract, pull-based fetch."""

    requires = (Mingle,)
    changes_logged = False

    def __init__(self, c: Consumer, **kwargs: object) -> None:
        c.task_consumer = c.qos = None
        self.collector = None
        self.connections = 0  # consumer starts in this process: more than one, it reconnected
        super().__init__(c, **kwargs)

    def start(self, c: Consumer) -> None:
        settings = settings_for(c.app)
        check_task_tiers(c.app.tasks)  # a task with a bogus tier stops the worker here, loudly
        self.connections += 1
        superseded = c.superseded if isinstance(c, PrioConsumer) else Superseded()
        fetcher = TierFetcher(c, settings, superseded, reconnected=self.connections > 1)
        runtime = fetcher.runtime
        c.update_strategies()
        runtime.batcher.install_strategies()  # batched tasks: their calls gather into batches, not the pool
        # Celery's ETA path bumps ``c.qos``; with basic_get there is no
        # broker-side window to move, so the setter does nothing.
        c.qos = QoS(fetcher.qos, runtime.scheduler.concurrency)
        c.task_consumer = fetcher
        installed = runtime_of(c.app)
        if installed is not None and not PrioTasks.changes_logged:  # once per worker, not per reconnect
            PrioTasks.changes_logged = True
            logger.info("celery-prio: install() changed this app's configuration: %s", "; ".join(installed.changes))
        if settings.metrics_port is not None:
            if self.collector is None:  # one exporter per worker, kept across reconnects
                self.collector = serve_metrics(fetcher, c.app, settings.metrics_host, settings.metrics_port)
            self.collector.fetcher = fetcher
        logger.info(
            "celery-prio: serving %s (concurrency %d; %s; weights %s)",
            ", ".join(q.name for q in fetcher.consumed),
            runtime.scheduler.concurrency,
            reserve_line(runtime.scheduler.reserve, runtime.scheduler.concurrency, runtime.served.tiers),
            {t.label: w for t, w in settings.weights.items()},
        )

    def stop(self, c: Consumer) -> None:
        if c.task_consumer is not None:
            c.task_consumer.cancel()

    def shutdown(self, c: Consumer) -> None:
        if c.task_consumer is not None:
            c.task_consumer.close()
            c.task_consumer = None

    def info(self, c: Consumer) -> dict[str, Any]:
        fetcher = c.task_consumer
        if not isinstance(fetcher, TierFetcher):
            return {"prefetch_count": "N/A"}
        # Flower reads prefetch_count; the honest figure is the slot bound. Flower shows the other keys
        # as rows of its worker page: one readable line per tier (inspect prio_stats has the full report).
        return {"prefetch_count": fetcher.runtime.scheduler.concurrency, **readable_rows(fetcher.report(on_loop=True))}


def reserve_line(reserve: int, concurrency: int, served: list[Tier]) -> str:
    """Why slots are (or are not) held back, for the start-up line."""
    if Tier.REALTIME not in served:
        return "no slot held back: this worker serves no realtime queue"
    if reserve == 0:
        return "no slot held back for realtime (prio_reserve=0, or a single slot)"
    return (
        f"{reserve} of {concurrency} held for realtime arrivals (prio_reserve): "
        f"batch and offline run in at most {concurrency - reserve}"
    )


class PrioControl(Control):
    """Celery's remote-control step, re-pointed at PrioTasks (it requires the Tasks step)."""

    requires = (PrioTasks,)


class PrioConsumer(Consumer):
    """Selected by ``install()`` through the ``worker_consumer`` setting."""

    class Blueprint(Consumer.Blueprint):
        default_steps = [
            "celery.worker.consumer.connection:Connection",
            "celery.worker.consumer.mingle:Mingle",
            "celery.worker.consumer.events:Events",
            "celery.worker.consumer.gossip:Gossip",
            "celery.worker.consumer.heart:Heart",
            "celery_prio.worker.consumer:PrioControl",
            "celery_prio.worker.consumer:PrioTasks",
            # DelayedDelivery (native delays on quorum queues) is left out:
            # tier queues are classic queues and ETA uses Celery's timer.
            "celery.worker.consumer.consumer:Evloop",
            "celery.worker.consumer.agent:Agent",
        ]

    # Celery's handlers for messages it cannot run log, then ack or reject
    # (drop) them. Here they first copy the message to the dead letters with
    # the reason, so a bad message is kept as data and never redelivered
    # into a crash loop.
    def _dead_letter(self, message: Message, reason: str) -> None:
        fetcher = self.task_consumer
        if isinstance(fetcher, TierFetcher) and not message.acknowledged:
            fetcher.dead_letter(message, reason)

    def on_unknown_message(self, body: Any, message: Message) -> None:
        self._dead_letter(message, "unknown message format (neither task protocol 1 nor 2)")
        super().on_unknown_message(body, message)

    def on_unknown_task(self, body: Any, message: Message, exc: Exception) -> None:
        fetcher = self.task_consumer
        forwarded = (
            isinstance(fetcher, TierFetcher)
            and not message.acknowledged
            and forward_unregistered(fetcher.runtime, message)
        )
        if forwarded:
            return  # another app's task (or a newer version's): now in its own queue, for a worker that has it
        self._dead_letter(message, f"unregistered task: {exc}")
        super().on_unknown_task(body, message, exc)

    def on_invalid_task(self, body: Any, message: Message, exc: Exception) -> None:
        self._dead_letter(message, f"invalid task: {exc!r}")
        super().on_invalid_task(body, message, exc)

    def on_decode_error(self, message: Message, exc: Exception) -> None:
        self._dead_letter(message, f"cannot decode: {exc!r}")
        super().on_decode_error(message, exc)

    def __init__(self, on_task_request: Any, *args: object, pool: BasePool | None = None, **kwargs: object) -> None:
        #: This worker's memory of boosts on RabbitMQ (which task copies are stale): kept across reconnects,
        #: written by the ``prio_supersede`` control command and read by every fetch.
        self.superseded = Superseded()

        def on_task_request_tracked(request: Request) -> Any:
            fetcher = self.task_consumer
            if isinstance(fetcher, TierFetcher):
                fetcher.runtime.track(request)
            return on_task_request(request)

        if pool is not None:
            notify_when_jobs_end(pool, self._slot_freed)
        super().__init__(on_task_request_tracked, *args, pool=pool, **kwargs)

    def _slot_freed(self, by_result: bool) -> None:
        """A pool job left its slot (any thread; ``by_result``: through its result callback): the fetcher
        settles and refills it."""
        fetcher = self.task_consumer
        if isinstance(fetcher, TierFetcher):
            fetcher.runtime.slot_freed(by_result)


__all__ = ["PrioConsumer", "PrioTasks", "TierFetcher"]
