"""Prometheus ``/metrics`` for a worker (``prio_metrics_port``; off by default).

Served by the worker's main process, where the scheduler and the fetcher
live: prefork children record nothing, so no multiprocess mode is needed.
The collector reads the worker report at scrape time (nothing on the hot
path; building it makes no broker call) and asks the broker for queue
depths over a connection of its own (the scrape runs on the exporter's
thread, never on the worker's channel).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger(__name__)


class PrioCollector:
    def __init__(self, fetcher: Any, app: Celery) -> None:
        self.fetcher = fetcher
        self.app = app
        self._adapter = None

    def _depths(self) -> dict[str, int]:
        from ..brokers import adapter_for

        settings = self.fetcher.settings
        try:
            if self._adapter is None:
                self._adapter = adapter_for(self.app)
            return {t: self._adapter.tier_depth(settings, tier) for t, tier in _tiers()}
        except Exception as exc:
            logger.warning("celery-prio metrics: could not read queue depths: %r", exc)
            self._adapter = None
            return {}

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        report = self.fetcher.report()  # the worker's own figures: no broker call from this thread

        def family(kind, name: str, doc: str, attr: str):
            metric = kind(f"celery_prio_{name}", doc, labels=["tier"])
            for tier, row in report.tiers.items():
                value = getattr(row, attr)
                if value is not None:
                    metric.add_metric([tier], float(value))
            return metric

        yield family(CounterMetricFamily, "dispatched", "Tasks this worker took from the tier", "dispatched")
        yield family(CounterMetricFamily, "finished", "Tasks of the tier that left their slot", "finished")
        yield family(GaugeMetricFamily, "running", "Tasks of the tier in a slot now", "running")
        yield family(CounterMetricFamily, "busy_seconds", "Slot time used by the tier", "busy_seconds")
        yield family(GaugeMetricFamily, "slot_time_share", "Share of slot time received", "slot_time_share")
        yield family(GaugeMetricFamily, "configured_share", "Share of slot time configured", "configured_share")
        yield family(GaugeMetricFamily, "oldest_wait_seconds", "Age of the oldest waiting message", "oldest_wait_s")
        yield family(GaugeMetricFamily, "max_wait_seconds", "Longest queue wait seen", "wait_max_s")
        yield family(CounterMetricFamily, "promoted", "Messages promoted out of the tier (Redis)", "promoted")
        yield family(
            CounterMetricFamily, "boosted", "Tasks lifted out of the tier by celery_prio.boost (Redis)", "boosted"
        )
        yield family(
            CounterMetricFamily,
            "boosted_seen",
            "Tasks this worker took that a boost lifted into the tier",
            "boosted_seen",
        )
        yield family(
            CounterMetricFamily,
            "rejected",
            "Publishes refused with 429 at the cap (RabbitMQ: where a wait budget keeps the fleet's record)",
            "rejected",
        )
        yield family(
            CounterMetricFamily,
            "refused_wait",
            "Publishes refused with 429 for a predicted wait over prio_max_wait",
            "refused_wait",
        )
        yield family(CounterMetricFamily, "expired", "Calls past their deadline, marked expired unrun", "expired")
        yield family(
            CounterMetricFamily,
            "answered",
            "Realtime calls run whose publish time was known (of which on_time)",
            "answered",
        )
        yield family(
            CounterMetricFamily,
            "on_time",
            "Realtime calls answered within prio_realtime_target, publish to done (goodput)",
            "on_time",
        )
        yield family(CounterMetricFamily, "dropped", "Messages evicted to the dead letters (Redis)", "dropped")
        yield family(
            CounterMetricFamily,
            "dead_lettered",
            "Unrunnable messages moved to the dead letters (Redis)",
            "dead_lettered",
        )
        yield family(CounterMetricFamily, "yields", "Sliced runs that gave their slot to a higher tier", "yields")
        yield family(GaugeMetricFamily, "slice_seconds", "Configured GPU time slice of the tier", "slice_s")
        # Queues inside the tiers: the busiest by name, the rest as subqueue="other" (bounded cardinality).
        for name, attr, kind, doc in (
            ("subqueue_dispatched", "dispatched", CounterMetricFamily, "Tasks this worker took from the queue"),
            ("subqueue_busy_seconds", "busy_seconds", CounterMetricFamily, "Slot time used by the queue's tasks"),
            ("subqueue_share_of_tier", "share_of_tier", GaugeMetricFamily, "Share of its tier's slot time"),
        ):
            metric = kind(f"celery_prio_{name}", doc, labels=["tier", "subqueue"])
            for queue, row in report.subqueues.items():
                metric.add_metric([row.tier, queue], float(getattr(row, attr)))
            yield metric
        depth = GaugeMetricFamily(
            "celery_prio_queue_depth", "Messages waiting in the tier (its queue and sub-queues)", labels=["tier"]
        )
        for tier, value in self._depths().items():
            depth.add_metric([tier], value)
        yield depth
        stats = self.fetcher.runtime.stats
        for name, attr, doc in (
            ("wait_seconds", "wait_hist", "Queue wait, enqueue stamp to dispatch"),
            ("run_seconds", "run_hist", "Slot time per task"),
            ("batch_size", "batch_hist", "Calls per run of a batched task (celery_prio.Batch)"),
        ):
            metric = HistogramMetricFamily(f"celery_prio_{name}", doc, labels=["tier"])
            for tier, label in ((t, t.label) for t in stats.tiers):
                hist = getattr(stats.tiers[tier], attr)
                metric.add_metric([label], hist.cumulative(), sum_value=hist.total)
            yield metric
        yield CounterMetricFamily(
            "celery_prio_stale_skipped",
            "Originals of boosted tasks this worker acked unrun (RabbitMQ)",
            value=report.stale_skipped,
        )
        if report.dead_letters is not None:
            yield GaugeMetricFamily(
                "celery_prio_dead_letters",
                "Entries in the dead-letter queue (capped by prio_dead_letter_max)",
                value=report.dead_letters,
            )
        if report.dead_dropped is not None:
            yield CounterMetricFamily(
                "celery_prio_dead_dropped", "Oldest dead letters dropped by the cap (Redis)", value=report.dead_dropped
            )
        yield GaugeMetricFamily(
            "celery_prio_held_messages",
            "Messages pushed to this worker that wait for a slot (RabbitMQ with prio_fetch='consume')",
            value=report.held,
        )
        unserved = GaugeMetricFamily(
            "celery_prio_unserved_seconds",
            "How long the queue has held messages with no live worker serving its tier",
            labels=["tier", "queue"],
        )
        for queue, row in report.unserved.items():
            unserved.add_metric([row["tier"], queue], float(row["seconds"]))
        yield unserved
        yield GaugeMetricFamily(
            "celery_prio_discovery_ok",
            "1 while this worker can find new sub-queues (shortest-first queues, tenants), 0 when it cannot",
            value=0.0 if report.discovery_problem else 1.0,
        )
        yield GaugeMetricFamily("celery_prio_scrape_timestamp_seconds", "When this scrape ran", value=time.time())


def _tiers():
    from ..tiers import TIERS

    return [(t.label, t) for t in TIERS]


def serve_collector(collector: Any, host: str, port: int, needed_by: str) -> Any:
    """Serve one collector's ``/metrics`` from a thread of this process; returns the collector."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise RuntimeError(f"{needed_by} needs prometheus_client: pip install 'celery-prio[ops]'") from None
    registry = CollectorRegistry()
    registry.register(collector)
    start_http_server(port, addr=host, registry=registry)
    return collector


def serve_metrics(fetcher: Any, app: Celery, host: str, port: int) -> Any:
    """Start the exporter thread; returns the collector (tests read it directly)."""
    collector = serve_collector(PrioCollector(fetcher, app), host, port, "prio_metrics_port")
    logger.info("celery-prio: Prometheus metrics on http://%s:%d/metrics", host, port)
    return collector
